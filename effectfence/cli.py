"""The ``effectfence`` command: one entry point, each subcommand owned by its room.

Subcommands are imported only when named, so ``effectfence info`` never pays for ``mcp``.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable

__all__ = ["main"]

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "info": ("effectfence.cli", "info_main", "which counter table runs, and versions"),
    "storm": ("effectfence.storm", "main", "1,000 attempts to charge order #777: one runs"),
    "serve": ("effectfence.mcp.server", "main", "MCP server (stdio, or --http) for the fence"),
    "scan": ("effectfence.scan.cli", "main", "list MCP tools that could fire twice, with evidence"),
    "wrap": ("effectfence.wrap.proxy", "main", "put any stdio MCP server behind the fence"),
    "probe": ("effectfence.wrap.probe", "main", "N identical calls: did it fire twice?"),
    "demo": ("effectfence.wrap.demo", "main", "a double-firing server, raw and wrapped"),
    "intents": ("effectfence.operator.intents", "main", "list, show, clear (with a reason), watch"),
    "certs": ("effectfence.operator.certs", "main", "export certificates, verify the chain"),
    "console": ("effectfence.operator.console", "main", "web page: fenced intents, clear, audit"),
    "bench": ("effectfence.cli", "bench_main", "the benchmark suite (a source checkout only)"),
}

USAGE = "usage: effectfence {" + ",".join(COMMANDS) + "} [options]   (effectfence CMD --help)"


def info_main(argv: list[str] | None = None) -> int:
    """Print the running counter backend (and why), the C core's version, and ours."""
    import argparse

    from effectfence import __version__
    from effectfence.counters import backend_info

    parser = argparse.ArgumentParser(prog="effectfence info", description=info_main.__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--store",
        metavar="URL",
        help="also open this store (memory:, sqlite:///path/fence.db, ...) and print its "
        "name, location and durability settings; a store nothing has used yet is reported, "
        "not created",
    )
    parser.add_argument(
        "--create",
        action="store_true",
        help="with --store: create the store if it is not there yet (as serve and wrap do "
        "on first use), e.g. to see a new Redis server's settings before anything runs",
    )
    args = parser.parse_args(argv)
    if args.create and args.store is None:
        parser.error("--create needs --store URL")
    data = {"effectfence": __version__, "python": sys.version.split()[0], **backend_info()}
    if args.store is not None:
        from effectfence.errors import StoreUnavailable
        from effectfence.store import (
            StoreMissing,
            StoreURLError,
            is_memory_url,
            open_store,
            redact,
        )

        try:
            # looking creates nothing: a mistyped URL is told so, not made (memory: is
            # always there, and takes no such option)
            keep = is_memory_url(args.store) or args.create
            store = open_store(args.store, **({} if keep else {"create": False}))
        except StoreMissing as exc:
            print(
                f"effectfence info: no store at {redact(args.store)}: {exc} (serve, wrap "
                "and the library create it on first use; --create creates it now)",
                file=sys.stderr,
            )
            return 1
        except (StoreURLError, StoreUnavailable, ValueError, RuntimeError) as exc:
            print(f"effectfence info: can't open {redact(args.store)}: {exc}", file=sys.stderr)
            return 1
        try:
            described = store.describe()
        finally:
            store.close()
        data["store_url"] = redact(args.store)
        data.update({f"store_{k}" if k != "store" else k: v for k, v in described.items()})
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k in data)
        for k, v in data.items():
            print(f"{k:<{width}}  {v}")
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    """Run ``python -m benchmarks`` from the source checkout this package was installed from.

    The suite lives in the repository's ``benchmarks/`` folder, which no wheel contains: from
    an installed wheel there is nothing to run, and this says so."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "suite.py").is_file():
        print(
            "effectfence bench: the benchmark suite is not installed with the package (it "
            "lives in the repository's benchmarks/ folder, which no wheel contains); clone "
            "the repository, pip install -e '.[bench]' and run python -m benchmarks",
            file=sys.stderr,
        )
        return 2
    cmd = [sys.executable, "-m", "benchmarks", *(argv or [])]
    return subprocess.run(cmd, cwd=root, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:<8} {text}")
        return 0 if argv else 2
    if argv[0] == "--version":
        from effectfence import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"effectfence: unknown command {name!r}\n{USAGE}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
