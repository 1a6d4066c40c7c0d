"""``python -m benchmarks``: every benchmark of the project in one run, and the page it writes.

Each section is a module of ``benchmarks/sections`` that imports the measuring functions of
the project's benchmark scripts (``bench_counters.py``, ``bench_fence.py``, ...): the scripts
keep their own command lines; the suite runs them with one set of round counts, checks
correctness while it measures, and collects medians with min-max and ratios measured side by
side into one JSON (``benchmarks/results/latest.json``), from which ``benchmarks/report.py``
writes ``benchmarks/RESULTS.md``, the generated blocks of the README and of ``docs/`` and
(with matplotlib, the ``bench`` extra) the charts. A section whose prerequisite is missing (a
server unreachable, a module not there yet, a peer that did not install) is reported as
skipped, with the reason.

    python -m benchmarks                  # the full run (several minutes), publishes the page
    python -m benchmarks --quick          # under a minute; indicative figures, not published
    python -m benchmarks --peers          # also the peers, each in its own virtualenv
    python -m benchmarks --only fence,storm
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

#: section name -> module; the order of the run and of the page
SECTIONS: dict[str, str] = {
    "counters": "benchmarks.sections.counters",
    "fence": "benchmarks.sections.fence",
    "storm": "benchmarks.sections.storm",
    "stores": "benchmarks.sections.stores",
    "mcp": "benchmarks.sections.mcp",
    "wrap": "benchmarks.sections.wrap",
    "scan": "benchmarks.sections.scan",
    "peers": "benchmarks.sections.peers",
}

PG_URL = os.environ.get("EFFECTFENCE_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("EFFECTFENCE_REDIS_URL", "redis://127.0.0.1:6379/0")


class Skip(Exception):
    """A section (or a row of one) cannot run here; the message says why."""


@dataclass
class Context:
    """What a section is given: the mode, where to write, and a way to show progress."""

    quick: bool
    peers: bool
    tmp: Path
    pg_url: str = PG_URL
    redis_url: str = REDIS_URL
    section: str = ""
    started: float = field(default_factory=time.monotonic)
    checks: list[str] = field(default_factory=list)

    def progress(self, message: str) -> None:
        """One line on stderr: elapsed time, the section, what it is doing."""
        t = time.monotonic() - self.started
        print(
            f"[{int(t // 60):02d}:{t % 60:04.1f}] {self.section}: {message}",
            file=sys.stderr,
            flush=True,
        )

    def check(self, message: str) -> None:
        """Record a correctness check that passed while measuring (printed and published)."""
        self.checks.append(message)
        self.progress(f"checked: {message}")

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full


# -- workers: one interpreter per contender, JSON lines --------------------------------------------


class Worker:
    """A ``benchmarks/worker.py`` process; ``call`` runs one function there."""

    def __init__(
        self, python: str, env: dict[str, str] | None = None, name: str = "", peer: bool = False
    ) -> None:
        self.name = name or python
        full_env = {**os.environ, **(env or {})}
        # ours import effectfence from this tree; a peer's interpreter never sees it
        full_env["PYTHONPATH"] = "" if peer else str(ROOT)
        self.proc = subprocess.Popen(
            [python, str(HERE / "worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=full_env,
            text=True,
            cwd=str(ROOT),
        )
        self.hello = self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (status {self.proc.poll()})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(f"worker {self.name} failed:\n{answer['error']}")
        return answer["value"]

    def call(self, target: str, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"call": target, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- machine facts -----------------------------------------------------------------------------


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else "not found"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_facts() -> dict[str, Any]:
    """CPU, Python, compiler, cffi, build flags, effectfence's build: the page's machine line."""
    import sqlite3
    import sysconfig
    from importlib import metadata

    from effectfence import __version__
    from effectfence.counters import backend_info

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    try:
        cffi_version = metadata.version("cffi")
    except metadata.PackageNotFoundError:
        cffi_version = "not installed"
    flags = re.search(r"extra_compile_args=(\[[^\]]*\])", (ROOT / "build_ffi.py").read_text())
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "compiler": _first_line([cc, "--version"]),
        "cffi": cffi_version,
        "build_flags": flags.group(1) if flags else "?",
        "python_cflags": sysconfig.get_config_var("OPT") or "",
        "effectfence": __version__,
        "git_commit": (_git("rev-parse", "--short", "HEAD") or "?") + ("+dirty" if dirty else ""),
        "counters": backend_info(),
        "sqlite": sqlite3.sqlite_version,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def reachable(url: str, default_port: int) -> str | None:
    """None if a TCP connection to the URL's host and port opens, else why not."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        with socket.create_connection((host, port), timeout=2):
            return None
    except OSError as exc:
        return f"{parts.scheme} server at {host}:{port} is not reachable ({exc.strerror or exc})"


def postgres_facts(url: str) -> dict[str, str]:
    """Server version and its durability settings, read with psql."""
    if shutil.which("psql") is None:
        return {"version": "unknown (psql not found)"}
    out = subprocess.run(
        [
            "psql",
            url,
            "-Atc",
            "SHOW server_version; SHOW synchronous_commit; SHOW fsync; SHOW wal_sync_method;",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    vals = out.stdout.strip().splitlines()  # one line per SHOW; a version has spaces in it
    if out.returncode != 0 or len(vals) < 4:
        return {"version": f"unknown ({out.stderr.strip()[:200]})"}
    return {
        "version": vals[0],
        "synchronous_commit": vals[1],
        "fsync": vals[2],
        "wal_sync_method": vals[3],
    }


def redis_facts(url: str) -> dict[str, str]:
    """Server version and persistence settings, read with redis-cli."""
    if shutil.which("redis-cli") is None:
        return {"version": "unknown (redis-cli not found)"}
    facts: dict[str, str] = {}
    info = subprocess.run(
        ["redis-cli", "-u", url, "INFO", "server"], capture_output=True, text=True, timeout=20
    ).stdout
    m = re.search(r"redis_version:(\S+)", info)
    facts["version"] = m.group(1) if m else "unknown"
    for key in ("appendonly", "appendfsync", "save"):
        out = subprocess.run(
            ["redis-cli", "-u", url, "CONFIG", "GET", key],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.splitlines()
        facts[key] = out[1] if len(out) > 1 else "?"
    return facts


# -- the run -----------------------------------------------------------------------------------


def run_section(name: str, ctx: Context) -> dict[str, Any]:
    ctx.section = name
    ctx.checks = []
    t0 = time.monotonic()
    ctx.progress("start")
    entry: dict[str, Any]
    try:
        module = importlib.import_module(SECTIONS[name])
        data = module.run(ctx)
        entry = {"status": "ok", "data": data}
    except Skip as exc:
        entry = {"status": "skipped", "reason": str(exc)}
        ctx.progress(f"skipped: {exc}")
    except Exception as exc:  # a failed check fails its section, loudly, not the suite
        entry = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        ctx.progress(f"FAILED: {type(exc).__name__}: {exc}")
    entry["checks"] = list(ctx.checks)
    entry["seconds"] = round(time.monotonic() - t0, 1)
    ctx.progress(f"done in {entry['seconds']:.1f} s")
    return entry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny op counts, under a minute; figures are indicative only",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="install the peers (each in its own venv) and measure them",
    )
    p.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out")
    p.add_argument("--json", type=Path, help="where to write the results JSON")
    p.add_argument(
        "--no-publish",
        action="store_true",
        help="do not rewrite RESULTS.md, the charts and the README and docs blocks",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = list(SECTIONS) if not args.only else [s.strip() for s in args.only.split(",")]
    unknown = [n for n in names + [s for s in args.skip.split(",") if s] if n not in SECTIONS]
    if unknown:
        print(
            f"unknown section(s): {', '.join(unknown)}; known: {', '.join(SECTIONS)}",
            file=sys.stderr,
        )
        return 2
    names = [n for n in names if n not in args.skip.split(",")]
    command = "python -m benchmarks" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="effectfence-bench-") as tmp:
        ctx = Context(quick=args.quick, peers=args.peers, tmp=Path(tmp))
        ctx.section = "suite"
        ctx.progress(f"{command}: sections {', '.join(names)}")
        machine = machine_facts()
        sections: dict[str, Any] = {}
        for name in SECTIONS:
            if name in names:
                sections[name] = run_section(name, ctx)
            else:
                sections[name] = {
                    "status": "skipped",
                    "reason": "not selected (--only/--skip)",
                    "checks": [],
                    "seconds": 0.0,
                }
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc = {
        "format": "effectfence.bench/1",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "quick": args.quick,
        "peers": args.peers,
        "seconds": round(time.monotonic() - t0, 1),
        "machine": machine,
        "sections": sections,
    }
    from benchmarks import report

    publish = not (args.quick or args.no_publish or args.only)
    if args.json is not None:
        out_json = args.json
    else:  # only a published run replaces latest.json, which the page and blocks come from
        out_json = RESULTS / (
            "latest.json" if publish else "quick.json" if args.quick else "partial.json"
        )
    report.dump(doc, out_json)
    # publish what was saved, as read back (its keys sorted): the page must be the one that
    # ``python -m benchmarks.report`` renders from the committed JSON
    doc = json.loads(out_json.read_text())
    shown = out_json.relative_to(ROOT) if out_json.is_relative_to(ROOT) else out_json
    print(f"wrote {shown}")
    if not args.quick and not publish:
        print(f"to publish its sections: python -m benchmarks.report --merge {shown}")
    if not publish:
        page = RESULTS / "quick" / "RESULTS.md"
        written = report.publish(doc, page, charts=page.parent / "charts", readme=None)
        why = "quick" if args.quick else "partial"
        untouched = "RESULTS.md, the README and docs/ are untouched"
        print(f"{why} run: wrote {', '.join(written)} ({untouched})")
    else:
        written = report.publish(
            doc,
            HERE / "RESULTS.md",
            charts=RESULTS / "charts",
            readme=ROOT / "README.md",
            docs=sorted(report.DOCS.glob("*.md")),
        )
        print(f"wrote {', '.join(written)}")
    print(report.console_summary(doc))
    failed = [n for n, s in sections.items() if s["status"] == "failed"]
    return 1 if failed else 0
