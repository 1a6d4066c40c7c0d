"""Helpers shared by the MCP server tests: in memory, and servers in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

PAYLOAD_KEYS = {"code", "message", "retryable", "recover", "details"}


@asynccontextmanager
async def connect(server: Any) -> AsyncIterator[Client]:
    async with Client(server) as client:
        yield client


def req(intent: str = "charge:1", **over: Any) -> dict[str, Any]:
    """fence_prepare arguments for a small card charge, with fields overridden."""
    base: dict[str, Any] = {
        "intent": intent,
        "domain": "order:1",
        "tool": "charge_card",
        "args": {"cents": 500, "card": "tok_visa"},
        "agent": "agent-a",
    }
    base.update(over)
    return base


# -- servers in real subprocesses, over streamable HTTP ---------------------------------------

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 30.0


@dataclass
class HttpServer:
    """A server process listening on 127.0.0.1 (an ephemeral port), and its stderr."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return self.url.rsplit("/", 1)[0]

    def decisions(self) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("event") == "decision":
                out.append(obj)
        return out


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    # each server its own memory unless a test names a store: never the user's ledger
    env["EFFECTFENCE_STORE"] = "memory:"
    env.update(extra)
    return env


@contextmanager
def http_server(argv: list[str], **env: str) -> Iterator[HttpServer]:
    """Start ``argv`` (which must print the ``listening`` JSON line on stderr), yield it,
    stop it. Its stderr is drained by a thread, so logging never blocks the server."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(**env),
    )
    assert proc.stderr is not None
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if not url and '"listening"' in line:
                url.append(json.loads(line)["url"])
                ready.set()
        ready.set()  # EOF: the server exited

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        ready.wait(START_TIMEOUT)
        if not url:
            raise AssertionError(f"the server did not start: {lines[-20:]}")
        yield HttpServer(proc, url[0], lines)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)


@asynccontextmanager
async def http_session(url: str, token: str | None = None) -> AsyncIterator[ClientSession]:
    """A Python SDK session over streamable HTTP, with a bearer token if given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session
