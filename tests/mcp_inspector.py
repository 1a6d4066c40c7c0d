"""The official MCP Inspector CLI, pinned, installed from the npm registry into a cache.

A third-party client built on the TypeScript SDK: it validates ``structuredContent`` against
the tool's output schema even on ``isError`` results, which the Python SDK does not, so it
proves what our own client cannot. Standard library only, so CI can install it before any
virtual environment exists::

    python3 tests/mcp_inspector.py install     # prints the CLI's entry point

The cache is ``$EFFECTFENCE_INSPECTOR_DIR`` or ``~/.cache/effectfence/inspector-<version>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "2.12.0"
PACKAGE = "@modelcontextprotocol/inspector"
DIR_ENV = "EFFECTFENCE_INSPECTOR_DIR"
#: set (CI sets it) to make a missing Inspector fail the tests instead of skipping them
REQUIRE_ENV = "EFFECTFENCE_REQUIRE_SERVICES"
INSTALL_TIMEOUT = 600


class Unavailable(RuntimeError):
    """The Inspector cannot run here (no node/npm, or the install failed)."""


def cache_dir() -> Path:
    env = os.environ.get(DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "effectfence" / f"inspector-{VERSION}"


def _package_dir(root: Path) -> Path:
    return root / "node_modules" / "@modelcontextprotocol" / "inspector"


def _installed(root: Path) -> Path | None:
    pkg = _package_dir(root)
    try:
        version = json.loads((pkg / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None
    entry = pkg / "clients" / "launcher" / "build" / "index.js"
    return entry if version == VERSION and entry.is_file() else None


def install() -> Path:
    """The CLI's entry point, installing the pinned version first if it is missing."""
    root = cache_dir()
    entry = _installed(root)
    if entry is not None:
        return entry
    npm = shutil.which("npm")
    if npm is None:
        raise Unavailable("npm is not on PATH: cannot install the MCP Inspector")
    # install beside the cache, then move it in: a half-finished install is never used
    tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [
        npm,
        "install",
        "--prefix",
        str(tmp),
        "--no-audit",
        "--no-fund",
        "--omit=dev",
        "--loglevel=error",
        f"{PACKAGE}@{VERSION}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Unavailable(f"npm install {PACKAGE}@{VERSION} timed out") from exc
    if proc.returncode != 0 or _installed(tmp) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Unavailable(f"npm install {PACKAGE}@{VERSION} failed:\n{proc.stderr[-2000:]}")
    shutil.rmtree(root, ignore_errors=True)
    try:
        tmp.rename(root)
    except OSError:  # another process installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    entry = _installed(root)
    if entry is None:
        raise Unavailable(f"the MCP Inspector is not usable in {root}")
    return entry


def command() -> list[str]:
    """``node <entry> --cli``: how to run the pinned Inspector CLI."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node is not on PATH: cannot run the MCP Inspector")
    return [node, str(install()), "--cli"]


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python3 tests/mcp_inspector.py install")
    print(install())
