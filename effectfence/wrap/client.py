"""A minimal MCP client over a child's stdio, for ``probe``, ``demo`` and the benchmark.

Enough to initialize, list and call tools, concurrently, without importing ``mcp`` (which
takes ~1.5 s): a probe must measure the server, not the client's start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["RPCError", "StdioClient"]

PROTOCOL_VERSION = "2025-06-18"  # a handshake version every 1.x and 2.x server accepts
LINE_LIMIT = 1 << 26


class RPCError(Exception):
    """The server answered a request with a JSON-RPC error."""

    def __init__(self, error: Any) -> None:
        self.error = error
        message = error.get("message") if isinstance(error, dict) else error
        super().__init__(f"server error: {message}")


class StdioClient:
    """One server process and the requests waiting for its answers."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.notifications: list[dict[str, Any]] = []
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(
        cls, argv: list[str], *, env: Mapping[str, str] | None = None, stderr: Any = None
    ) -> StdioClient:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=None if env is None else {**os.environ, **env},
            limit=LINE_LIMIT,
        )
        return cls(proc)

    async def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while line := await stdout.readline():
            try:
                msg = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(msg, dict):
                continue
            if "method" in msg:
                if "id" in msg:  # a server-to-client request: we offer no capabilities
                    result: dict[str, Any] | None = {} if msg["method"] == "ping" else None
                    reply: dict[str, Any] = {"jsonrpc": "2.0", "id": msg["id"]}
                    if result is None:
                        reply["error"] = {"code": -32601, "message": "not supported"}
                    else:
                        reply["result"] = result
                    self._write(reply)
                else:
                    self.notifications.append(msg)
                continue
            fut = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
            if fut is not None and not fut.done():
                fut.set_result(msg)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the server closed its stdout"))
        self._pending.clear()

    def _write(self, msg: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(orjson.dumps(msg) + b"\n")

    async def request(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 60.0
    ) -> Any:
        """Send a request; its ``result`` (a JSON-RPC error raises :class:`RPCError`)."""
        self._next += 1
        rid = self._next
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self._write(msg)
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(rid, None)
        if "error" in reply:
            raise RPCError(reply["error"])
        return reply.get("result")

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self._write(msg)

    async def initialize(self, name: str = "effectfence-probe") -> Any:
        result = await self.request(
            "initialize",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": name, "version": "1"},
            },
        )
        self.notify("notifications/initialized")
        return result

    async def call_tool(self, name: str, arguments: dict[str, Any], **kw: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "tools/call", {"name": name, "arguments": arguments}, **kw
        )
        return result

    async def close(self, timeout: float = 10.0) -> int:
        """Close the server's stdin and wait for it to exit (then terminate, then kill)."""
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            code = await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        return code

    async def __aenter__(self) -> StdioClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
