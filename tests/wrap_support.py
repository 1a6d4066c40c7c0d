"""Helpers for the wrap tests: commands, ledgers, and the third-party server's venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest

from effectfence.wrap.client import StdioClient
from effectfence.wrap.proxy import META_KEY

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CHILD = [PY, str(ROOT / "tests" / "fixtures" / "wrap_child.py")]  # built on mcp 2.x
TIMEOUT = 60.0
SQLITE_SERVER = "mcp-server-sqlite==2025.4.25"


def env(**extra: str) -> dict[str, str]:
    out = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out.update(extra)
    return out


def demo(ledger: Path, delay: float = 0.3) -> list[str]:
    """The bundled double-firing server (no SDK), charging into ``ledger``."""
    return [
        PY,
        "-m",
        "effectfence.wrap.demo",
        "serve",
        "--delay",
        str(delay),
        "--ledger",
        str(ledger),
    ]


def wrap(
    store: str, *child: str, policy: Path | None = None, extra: tuple[str, ...] = ()
) -> list[str]:
    cmd = [PY, "-m", "effectfence", "wrap", "--store", store, *extra]
    if policy is not None:
        cmd += ["--policy", str(policy)]
    return [*cmd, "--", *child]


async def start(argv: list[str], **extra_env: str) -> StdioClient:
    client = await StdioClient.start(argv, env=env(**extra_env))
    await client.initialize("wrap-test")
    return client


def ledger(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if event is None or r.get("event", "charge") == event]


def marker(result: dict[str, Any]) -> dict[str, Any] | None:
    meta = result.get("_meta")
    return meta.get(META_KEY) if isinstance(meta, dict) else None


def text(result: dict[str, Any]) -> str:
    return "\n".join(c.get("text", "") for c in result.get("content", []))


def sqlite_server_venv() -> Path:
    """A venv holding mcp-server-sqlite and the ``mcp`` 1.x it was built on, made once per
    machine. With EFFECTFENCE_REQUIRE_SERVICES=1 (CI) a failure to make it fails the test."""
    base = Path(
        os.environ.get(
            "EFFECTFENCE_WRAP_CACHE", Path.home() / ".cache" / "effectfence" / "wrap-e2e"
        )
    )
    home = base / "sqlite-2025.4.25"
    exe = home / "bin" / "mcp-server-sqlite"
    if exe.exists():
        return exe
    try:
        base.mkdir(parents=True, exist_ok=True)
        venv.create(home, with_pip=True, clear=True)
        subprocess.run(
            [str(home / "bin" / "python"), "-m", "pip", "install", "-q", SQLITE_SERVER, "mcp<2"],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        why = f"can't install {SQLITE_SERVER}: {exc} {detail[-2000:].decode(errors='replace')}"
        if os.environ.get("EFFECTFENCE_REQUIRE_SERVICES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return exe
