"""What the fence adds to an MCP tool call, over real stdio and streamable HTTP.

One server process (``effectfence.mcp.build_server()`` plus a trivial ``noop`` tool taking the
same arguments as ``fence_prepare``), one SDK client (``stdio_client`` + ``ClientSession``),
same transport, same run. Measured per round, interleaved so drift hits all alike:

- ``noop``            a trivial tool's round trip (the baseline)
- ``prepare``         ``fence_prepare`` on a new intent (fresh: ticket sealed and returned)
- ``prepare+commit``  the full protocol for one effect (two round trips; compared with 2x noop)
- ``replay``          ``fence_prepare`` of a committed intent (cert returned)

and calls per second with 8 concurrent callers on one connection: noop, and a duplicate
storm where all 8 callers prepare the same intents and the winner commits (8 tasks in the
one SDK client process: a figure bound by that client as much as by the server).

Correctness is counted while measuring: every ``prepare`` must be fresh, every replay must
carry the committed hash, and in the storm the effect must run exactly once per intent
(executions == fresh admissions == intents) — checked against the server's own stats.

Over streamable HTTP (``effectfence serve --http`` on 127.0.0.1, same server code, same
``noop``), ``fence_prepare`` vs ``noop`` on new intents, side by side in every round, seen by
two clients:

- ``raw``: :class:`RawMCP`, a minimal JSON-RPC-over-HTTP client in this file (stdlib
  sockets; JSON or SSE answers, ``Content-Length`` or chunked). x1: one client process,
  the two tools in turn, one call at a time. x8: 8 client PROCESSES, each with its own
  session (initialize, notifications/initialized) on one kept-alive connection, released
  together by a multiprocessing Barrier, calling one tool back to back; calls/s is every
  call over the time from the barrier to the last finish; a noop burst and a fence_prepare
  burst alternate, their order swapped every round. Why a client of our own: the SDK's
  client spends more CPU per call than the server does (where this was written: ~2 ms a
  no-op call against the server's ~1 ms and this client's ~0.1 ms; p50 3-7 ms where this
  client sees ~0.8 ms), so 8 SDK sessions in one process measured that process, not the
  server. The CPU per call of the server and of the clients is printed beside the
  figures, so this can be checked in every run.
- ``sdk``: the MCP SDK's ``ClientSession`` over ``streamable_http_client``, 1 session, p50
  and p99 of noop vs fence_prepare: what an agent built on the SDK sees.

Correctness is counted while measuring: every ``fence_prepare`` (of a new intent, always)
must answer a structured status ``fresh`` (the JSON result is parsed), and the server's
``fence_stats`` admitted count must equal the number of prepares sent; any failure or
mismatch fails the run (exit status 1).

    python benchmarks/bench_mcp.py               # 5 rounds x 400 calls per scenario
    python benchmarks/bench_mcp.py --quick       # a smoke run
    python benchmarks/bench_mcp.py --transport http --store sqlite:///tmp/f.db  # a new file
    python benchmarks/bench_mcp.py --transport http --store sqlite   # a fresh temporary file

Targets (issue #13): the fence adds under 10% to a trivial tool's round trip (prepare p50 /
noop p50) on both transports (over HTTP: judged on the raw client, 1 and 8 processes), on
the memory store: on a durable one each fresh prepare waits for a synchronous commit (SQLite
FULL ~0.3 ms here, a no-op call ~0.4 ms), reported but not judged (DURABLE_NA);
8 concurrent HTTP clients on a SQLite store >= 500 prepares/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import re
import select
import socket
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ARGS = {"order_id": 0, "cents": 500, "currency": "EUR", "customer": "cus_123"}
RESULT = {"charge_id": "ch_0", "status": "succeeded", "amount": 500}
CONCURRENCY = 8
TARGET_OVERHEAD = 0.10
#: why the overhead target is not judged on a durable store: a fresh prepare there waits for
#: one synchronous commit (~0.3 ms for SQLite FULL on this kind of host, a no-op call is
#: ~0.4 ms over HTTP), which no fence can skip and stay crash-safe; issue #13 judges the
#: SQLite store by its own target, prepares/s with 8 clients
DURABLE_NA = "n/a on a durable store (each fresh prepare is a synchronous commit)"


def durable(store: str) -> bool:
    """Whether ``store`` (a URL or a store's name) keeps its records on disk or a server."""
    return not (store == "memory" or store.startswith("memory:"))


def serve(store: str, http: bool) -> int:
    """The server side: the fence's tools plus a trivial tool on the same server."""
    from effectfence import FenceConfig
    from effectfence.mcp.server import build_server, open_fence
    from effectfence.mcp.telemetry import Metrics

    fence = open_fence(store, FenceConfig())
    metrics = Metrics()
    server = build_server(fence, metrics=metrics, freeze_heap=True)  # as `effectfence serve`

    async def noop(
        intent: str, domain: str, tool: str, args: dict[str, Any], agent: str
    ) -> dict[str, Any]:
        """A trivial tool: same arguments as fence_prepare, does nothing."""
        return {"ok": True}

    server.add_tool(noop, name="noop")
    if not http:
        server.run("stdio")
        return 0
    import anyio

    from effectfence.mcp.http import serve_http

    anyio.run(lambda: serve_http(server, fence, metrics, host="127.0.0.1", port=0))
    return 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: quantiles of the pooled latencies kept for the suite's distribution charts
DIST_Q = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def _dist(values: list[float]) -> dict[str, float]:
    """Quantiles (ms) of every latency of a scenario, all rounds pooled."""
    return {f"p{q * 100:g}": _pct(values, q) * 1e3 for q in DIST_Q}


def _summary(per_round: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
    }


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=[__file__, "--serve", "--store", args.store]
    )
    n, rounds = args.calls, args.rounds
    lat: dict[str, dict[str, list[float]]] = {
        k: {"p50": [], "p99": []} for k in ("noop", "prepare", "prepare+commit", "replay")
    }
    rps: dict[str, list[float]] = {"noop x8": [], "storm x8": []}
    checks = {"fresh": 0, "fresh_expected": 0, "replays_ok": 0, "executions": 0, "intents": 0}
    pooled: dict[str, list[float]] = {k: [] for k in lat}

    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        await s.list_tools()  # the client caches output schemas for validation

        def req(intent: str, agent: str = "bench") -> dict[str, Any]:
            return {
                "intent": intent,
                "domain": "order:bench",
                "tool": "charge",
                "args": ARGS,
                "agent": agent,
            }

        async def timed(name: str, arguments: dict[str, Any]) -> tuple[float, Any]:
            t0 = time.perf_counter()
            r = await s.call_tool(name, arguments)
            return time.perf_counter() - t0, r

        # warm up every path (imports, caches, schema validators)
        warm = getattr(args, "warmup", 100)
        for i in range(warm):
            await s.call_tool("noop", req(f"warm:{i}"))
            _, r = await timed("fence_prepare", req(f"warm:{i}"))
            await s.call_tool(
                "fence_commit", {"prepared": r.structured_content["prepared"], "result": RESULT}
            )
        committed = await s.call_tool("fence_prepare", req("warm:0"))
        committed_hash = committed.structured_content["cert"]["hash"]

        for rnd in range(rounds):
            samples: dict[str, list[float]] = {k: [] for k in lat}
            for i in range(n):
                intent = f"r{rnd}:{i}"
                dt, _ = await timed("noop", req(intent))
                samples["noop"].append(dt)
                dt, r = await timed("fence_prepare", req(intent))
                samples["prepare"].append(dt)
                checks["fresh_expected"] += 1
                checks["fresh"] += r.structured_content.get("status") == "fresh"
                t0 = time.perf_counter()
                _, r = await timed("fence_prepare", req(intent + ":pc"))
                ticket = r.structured_content["prepared"]
                await s.call_tool("fence_commit", {"prepared": ticket, "result": RESULT})
                samples["prepare+commit"].append(time.perf_counter() - t0)
                dt, r = await timed("fence_prepare", req("warm:0", agent="dup"))
                samples["replay"].append(dt)
                checks["replays_ok"] += r.structured_content["cert"]["hash"] == committed_hash
            for k, v in samples.items():
                pooled[k].extend(v)
                lat[k]["p50"].append(_pct(v, 0.50))
                lat[k]["p99"].append(_pct(v, 0.99))

            # throughput: 8 concurrent callers on one connection
            async def noop_caller(c: int, count: int, rnd: int = rnd) -> None:
                for i in range(count):
                    await s.call_tool("noop", req(f"t{rnd}:{c}:{i}"))

            per_caller = max(1, n // CONCURRENCY) * 2
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for c in range(CONCURRENCY):
                    tg.start_soon(noop_caller, c, per_caller)
            rps["noop x8"].append(CONCURRENCY * per_caller / (time.perf_counter() - t0))

            executions: dict[str, int] = {}

            async def storm_caller(
                c: int, count: int, executions: dict[str, int], rnd: int = rnd
            ) -> None:
                for i in range(count):
                    intent = f"storm{rnd}:{i}"
                    r = await s.call_tool("fence_prepare", req(intent, agent=f"agent-{c}"))
                    sc = r.structured_content or {}
                    if not r.is_error and sc.get("status") == "fresh":
                        executions[intent] = executions.get(intent, 0) + 1  # the effect
                        await s.call_tool(
                            "fence_commit", {"prepared": sc["prepared"], "result": RESULT}
                        )

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for c in range(CONCURRENCY):
                    tg.start_soon(storm_caller, c, per_caller, executions)
            calls = CONCURRENCY * per_caller + len(executions)  # prepares + commits
            rps["storm x8"].append(calls / (time.perf_counter() - t0))
            checks["intents"] += per_caller
            checks["executions"] += sum(executions.values())
            assert all(v == 1 for v in executions.values()), "an effect ran twice"

        stats = (await s.call_tool("fence_stats", {})).structured_content

    expected_admitted = warm + rounds * n * 2 + checks["intents"]
    checks["server_admitted"] = stats["prepare"]["admitted"]
    checks["server_admitted_expected"] = expected_admitted
    checks["server_commits"] = stats["events"]["commits"]
    checks["counters"] = stats["counters"]
    ok = (
        checks["fresh"] == checks["fresh_expected"]
        and checks["replays_ok"] == rounds * n
        and checks["executions"] == checks["intents"]
        and checks["server_admitted"] == expected_admitted
    )
    latency = {k: {q: _summary(v) for q, v in d.items()} for k, d in lat.items()}

    def paired(key: str, times: int = 1) -> list[float]:
        """The overhead of ``key`` over the no-op measured beside it, round by round: a
        ratio of medians could pair figures of different rounds (found by review: it read
        +9.3% where four of five paired rounds were over 10%)."""
        noops = lat["noop"]["p50"]
        return [p / (times * b) - 1 for p, b in zip(lat[key]["p50"], noops, strict=True)]

    per_round_overhead = paired("prepare")
    overhead = {
        "prepare": statistics.median(per_round_overhead),
        "replay": statistics.median(paired("replay")),
        "prepare+commit vs 2x noop": statistics.median(paired("prepare+commit", 2)),
    }
    return {
        "calls_per_round": n,
        "rounds": rounds,
        "latency_s": latency,
        "calls_per_s": {k: _summary(v) for k, v in rps.items()},
        "overhead": overhead,
        "prepare_overhead_per_round": _summary(per_round_overhead),
        "target": TARGET_OVERHEAD,
        "target_met": None if durable(args.store) else overhead["prepare"] < TARGET_OVERHEAD,
        "distribution_ms": {k: _dist(v) for k, v in pooled.items()},
        "correct": ok,
        "checks": checks,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def _req(intent: str, agent: str = "bench") -> dict[str, Any]:
    return {
        "intent": intent,
        "domain": "order:bench",
        "tool": "charge",
        "args": ARGS,
        "agent": agent,
    }


# -- a minimal MCP client over streamable HTTP ---------------------------------------------------


class RawMCPError(RuntimeError):
    """The server answered what this client cannot take: an HTTP status, framing or
    JSON-RPC error, or a closed connection."""


_SSE_LINE = re.compile(r"\r\n|\r|\n")
_MAX_LINE = 65536


def sse_messages(text: str) -> list[Any]:
    """The JSON-RPC messages of a ``text/event-stream`` body: the ``data`` of each
    ``message`` event (multi-line data joined with newlines), comments and other fields
    skipped. Lines end with CRLF, LF or CR, as the SSE spec says (not ``str.splitlines``,
    which also splits on U+2028 inside a JSON string). An event the stream ends without
    its blank line is kept: the body is complete once its framing says so."""
    out: list[Any] = []
    data: list[str] = []
    event = ""
    for line in [*_SSE_LINE.split(text), ""]:
        if not line:
            if data and event in ("", "message"):
                out.append(json.loads("\n".join(data)))
            data, event = [], ""
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    return out


def body_messages(content_type: str, body: bytes) -> list[Any]:
    """The JSON-RPC messages of a response body, JSON (one message or a batch) or SSE."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "application/json":
        data = json.loads(body)
        return data if isinstance(data, list) else [data]
    if kind == "text/event-stream":
        return sse_messages(body.decode("utf-8"))
    raise RawMCPError(f"unexpected content-type {content_type!r}")


class RawMCP:
    """One MCP session over one kept-alive HTTP/1.1 connection; blocking, stdlib only.

    Why not the SDK's client: it costs more CPU per call than the server does (see the
    module doc), so clients built on it measure themselves. This one sends each request
    and reads its whole answer (a JSON body or an SSE stream, with a ``Content-Length`` or
    chunked) before the next: the calls of one session are back to back, as an agent's
    are. It speaks only what the
    benchmark needs: ``initialize``, ``notifications/initialized``, ``tools/call``.

    A server may close a kept-alive connection left idle (uvicorn does after 5 s): between
    bursts, :meth:`reopen_if_closed` opens a new one for the same session (the session is
    its id, not its connection) and counts it in ``reopened``. Within a burst a closed
    connection is an error."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected http://HOST:PORT/PATH, got {url!r}")
        self.path = parts.path or "/"
        self.host = parts.netloc
        self.address = (parts.hostname, parts.port)
        self.timeout = timeout
        self.session: str | None = None
        self.protocol: str | None = None
        self.reopened = 0
        self._id = 0
        self._open()

    def _open(self) -> None:
        self.sock = socket.create_connection(self.address, timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = self.sock.makefile("rb")
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.rfile.close()
        self.sock.close()

    def reopen_if_closed(self) -> bool:
        """Between answers: if the server closed the connection, open a new one."""
        if not self.closed:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False  # open and quiet: as it should be between answers
            if self.sock.recv(1, socket.MSG_PEEK):
                raise RawMCPError("the server sent bytes outside an answer")
            self.close()
        self._open()
        self.reopened += 1
        return True

    # HTTP/1.1 framing
    def _line(self) -> bytes:
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line:
            raise RawMCPError("the server closed the connection")
        if len(line) > _MAX_LINE or not line.endswith(b"\n"):
            raise RawMCPError("a header or chunk-size line too long or cut short")
        return line

    def _exact(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) != n:
            raise RawMCPError(f"the server closed the connection {len(data)}/{n} bytes in a body")
        return data

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int(self._line().split(b";", 1)[0].strip(), 16)  # chunk extensions ignored
            if size == 0:
                while self._line().strip():  # trailers, up to the blank line
                    pass
                return b"".join(parts)
            parts.append(self._exact(size))
            if self._line().strip():
                raise RawMCPError("a chunk not followed by CRLF")

    def _exchange(self, message: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        if self.closed:
            raise RawMCPError("the connection was closed: a session holds one connection")
        body = json.dumps(message, separators=(",", ":")).encode()
        head = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}",
            "Accept: application/json, text/event-stream",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        if self.session is not None:
            head.append(f"Mcp-Session-Id: {self.session}")
        if self.protocol is not None:
            head.append(f"Mcp-Protocol-Version: {self.protocol}")
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        while True:
            status_line = self._line().split(None, 2)
            if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
                raise RawMCPError(f"not an HTTP/1.x status line: {status_line!r}")
            status = int(status_line[1])
            headers: dict[str, str] = {}
            while (line := self._line()).strip():
                name, sep, value = line.decode("latin-1").partition(":")
                if not sep:
                    raise RawMCPError(f"a malformed header line: {line!r}")
                key = name.strip().lower()
                headers[key] = (
                    f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
                )
            if status >= 200:
                break  # 1xx answers are interim: the real one follows
        if status in (204, 304):
            data = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            data = self._chunked()
        elif "content-length" in headers:
            data = self._exact(int(headers["content-length"]))
        else:  # delimited by the end of the connection
            data = self.rfile.read()
            self.close()
        if "close" in headers.get("connection", "").lower() and not self.closed:
            self.close()
        return status, headers, data

    # JSON-RPC
    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one request; its ``result`` (a JSON-RPC error raises RawMCPError)."""
        self._id += 1
        rid = self._id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        status, headers, body = self._exchange(message)
        if status != 200:
            raise RawMCPError(f"{method}: HTTP {status}: {body[:300]!r}")
        if method == "initialize" and "mcp-session-id" in headers:
            self.session = headers["mcp-session-id"]
        for m in body_messages(headers.get("content-type", ""), body):
            if isinstance(m, dict) and m.get("id") == rid:  # anything else: notifications
                if "error" in m:
                    raise RawMCPError(f"{method}: JSON-RPC error {m['error']}")
                if isinstance(m.get("result"), dict):
                    result: dict[str, Any] = m["result"]
                    return result
        raise RawMCPError(f"{method}: no answer with id {rid} in {body[:300]!r}")

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        status, _, body = self._exchange(message)
        if status not in (200, 202, 204):
            raise RawMCPError(f"{method}: HTTP {status}: {body[:300]!r}")

    def initialize(self) -> dict[str, Any]:
        result = self.request(
            "initialize",
            {
                "protocolVersion": RAW_PROTOCOL,
                "capabilities": {},
                "clientInfo": {"name": "bench_mcp-raw", "version": "1"},
            },
        )
        self.protocol = str(result["protocolVersion"])
        self.notify("notifications/initialized")
        return result

    def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return self.request("tools/call", {"name": name, "arguments": arguments})


RAW_PROTOCOL = "2025-06-18"


def answered(tool: str, result: dict[str, Any]) -> bool:
    """Whether a ``tools/call`` result is the one expected: no error, and for
    ``fence_prepare`` of a new intent the structured status ``fresh``."""
    if result.get("isError"):
        return False
    sc = result.get("structuredContent")
    if not isinstance(sc, dict):
        return False
    if tool == "fence_prepare":
        return sc.get("status") == "fresh" and isinstance(sc.get("prepared"), str)
    return sc.get("ok") is True if tool == "noop" else True


# -- the client processes -----------------------------------------------------------------------

#: how long a client process waits at the barrier, or the parent for an answer
POOL_TIMEOUT = 300.0


def _timed_calls(
    client: RawMCP, tools: tuple[str, ...], count: int, tag: str
) -> tuple[dict[str, list[float]], int, list[str]]:
    """``count`` rounds of one call of each tool, back to back, each on a new intent."""
    lat: dict[str, list[float]] = {t: [] for t in tools}
    failures: list[str] = []
    for i in range(count):
        order = tools if i % 2 == 0 else tools[::-1]  # neither always goes first
        for tool in order:
            args = _req(f"{tag}:{i}")
            t0 = time.perf_counter()
            result = client.call_tool(tool, args)
            lat[tool].append(time.perf_counter() - t0)
            if not answered(tool, result):
                failures.append(f"{tool} {args['intent']}: {json.dumps(result)[:300]}")
    return lat, len(failures), failures[:3]


def _raw_worker(url: str, index: int, barrier: Any, pipe: Connection) -> None:
    """A client process: one session on one kept-alive connection, commands from the pipe."""
    client: RawMCP | None = None
    try:
        client = RawMCP(url)
        client.initialize()
        pipe.send(("ok", os.getpid()))
        while True:
            cmd, arg = pipe.recv()
            if cmd == "stop":
                return
            client.reopen_if_closed()  # not timed: before the barrier
            if cmd == "burst":  # released with the others; one tool, back to back
                tool, count, tag = arg
                barrier.wait(POOL_TIMEOUT)
                c0, t0 = time.process_time(), time.perf_counter()
                lat, failed, why = _timed_calls(client, (tool,), count, f"{tag}:{index}")
                t1 = time.perf_counter()
                out = {"start": t0, "end": t1, "lat": lat[tool], "failed": failed, "why": why}
                cpu = time.process_time() - c0
                pipe.send(("ok", {**out, "cpu": cpu, "reopened": client.reopened}))
            elif cmd == "alternate":  # alone: each tool in turn, one call at a time
                tools, count, tag = arg
                c0 = time.process_time()
                lat, failed, why = _timed_calls(client, tools, count, f"{tag}:{index}")
                out = {"lat": lat, "failed": failed, "why": why}
                cpu = time.process_time() - c0
                pipe.send(("ok", {**out, "cpu": cpu, "reopened": client.reopened}))
            elif cmd == "call":
                name, arguments = arg
                pipe.send(("ok", client.call_tool(name, arguments)))
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except BaseException:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc()))
    finally:
        if client is not None:
            client.close()


class ClientPool:
    """``size`` client processes (spawned: nothing inherited from the parent's event loop),
    each with its own session on its own connection, released together by one Barrier."""

    def __init__(self, url: str, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(size)
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_raw_worker, args=(url, i, self.barrier, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.pipes.append(mine)
            self.procs.append(proc)
        self.pids = [self._answer(i) for i in range(size)]
        #: per process: idle connections the server closed, reopened between bursts
        self.reopened = [0] * size

    def _answer(self, i: int) -> Any:
        pipe = self.pipes[i]
        if not pipe.poll(POOL_TIMEOUT):
            raise RuntimeError(f"client process {i} did not answer in {POOL_TIMEOUT:.0f} s")
        try:
            kind, value = pipe.recv()
        except EOFError:
            raise RuntimeError(f"client process {i} exited ({self.procs[i].exitcode})") from None
        if kind != "ok":
            raise RuntimeError(f"client process {i} failed:\n{value}")
        if isinstance(value, dict) and "reopened" in value:
            self.reopened[i] = value["reopened"]
        return value

    def burst(self, tool: str, count: int, tag: str) -> dict[str, Any]:
        """Every process calls ``tool`` ``count`` times back to back, all released by the
        barrier; calls/s is every call over barrier-to-last-finish."""
        for pipe in self.pipes:
            pipe.send(("burst", (tool, count, tag)))
        answers = [self._answer(i) for i in range(len(self.pipes))]
        wall = max(a["end"] for a in answers) - min(a["start"] for a in answers)
        lat = [x for a in answers for x in a["lat"]]
        return {
            "lat": lat,
            "wall": wall,
            "calls/s": len(lat) / wall,
            "failed": sum(a["failed"] for a in answers),
            "why": [w for a in answers for w in a["why"]][:3],
            "cpu": sum(a["cpu"] for a in answers),
        }

    def alternate(self, tools: tuple[str, ...], count: int, tag: str) -> dict[str, Any]:
        """Process 0 alone: one call of each tool in turn, ``count`` times."""
        self.pipes[0].send(("alternate", (tools, count, tag)))
        answer: dict[str, Any] = self._answer(0)
        return answer

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.pipes[0].send(("call", (name, arguments)))
        answer: dict[str, Any] = self._answer(0)
        return answer

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop", None))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process (all its threads) from /proc; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the HTTP measurement -----------------------------------------------------------------------

TOOLS = ("noop", "fence_prepare")
TARGET_PREPARES_PER_S = 500.0

CLIENTS = {
    "raw": "RawMCP (benchmarks/bench_mcp.py): stdlib sockets, one session per process over "
    "one kept-alive connection; the x8 figures are 8 such processes released together by a "
    "Barrier, timed from the barrier to the last finish. Its CPU per call is a fraction of "
    "the server's, so these figures are the server's.",
    "sdk": "the MCP SDK's ClientSession over streamable_http_client, 1 session in this "
    "process: what an agent built on the SDK sees. Its client costs more CPU per call than "
    "the server, so it is reported at 1 client only (8 SDK sessions in one process measure "
    "that process).",
}


async def _measure_http(args: argparse.Namespace) -> dict[str, Any]:
    """``fence_prepare`` vs ``noop`` on one ``serve --http`` process, side by side per round:
    the SDK client (1 session), the raw client (1 process) and 8 raw client processes
    (noop and fence_prepare bursts alternately, their order swapped every round)."""
    import subprocess

    import anyio
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--http", "--store", args.store],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"the HTTP server exited ({proc.returncode}) before listening")
    url = json.loads(line)["url"]
    n, rounds = args.calls, args.rounds
    per = max(1, n // 2)  # calls per client process in an x8 burst: 4n calls in all
    warm = getattr(args, "warmup", 100)
    run = uuid.uuid4().hex[:8]  # intents new even in a store file used before
    sent = {"prepares": 0, "calls": 0}
    failures: list[str] = []
    failed = 0
    res: dict[str, dict[str, list[float]]] = {}
    over: dict[str, list[float]] = {"raw x1": [], "raw x8": [], "sdk x1": []}
    cpu: dict[str, list[float]] = {}
    pooled: dict[str, list[float]] = {}

    def record(key: str, lat: list[float], cps: float | None = None) -> None:
        pooled.setdefault(key, []).extend(lat)
        d = res.setdefault(key, {"p50": [], "p99": [], "calls/s": []})
        d["p50"].append(_pct(lat, 0.5))
        d["p99"].append(_pct(lat, 0.99))
        d["calls/s"].append(cps if cps is not None else 1 / statistics.mean(lat))

    def count(tool: str, calls: int, bad: int, why: list[str]) -> None:
        nonlocal failed
        sent["calls"] += calls
        sent["prepares"] += calls if tool == "fence_prepare" else 0
        failed += bad
        failures.extend(why[: max(0, 5 - len(failures))])

    def server_cpu() -> float | None:
        return _cpu_seconds(proc.pid)

    def note_cpu(key: str, s0: float | None, c_client: float, calls: int) -> None:
        s1 = server_cpu()
        if s0 is not None and s1 is not None:
            cpu.setdefault(f"server {key}", []).append((s1 - s0) / calls * 1e3)
        cpu.setdefault(f"client {key}", []).append(c_client / calls * 1e3)

    pool: ClientPool | None = None
    try:
        pool = ClientPool(url, CONCURRENCY)
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(create_mcp_http_client())
            read, write = await stack.enter_async_context(
                streamable_http_client(url, http_client=http)
            )
            s = await stack.enter_async_context(ClientSession(read, write))
            await s.initialize()
            await s.list_tools()  # the client caches output schemas for validation

            async def sdk_calls(count_: int, tag: str) -> dict[str, list[float]]:
                lat: dict[str, list[float]] = {t: [] for t in TOOLS}
                for i in range(count_):
                    for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
                        arguments = _req(f"{tag}:{i}")
                        t0 = time.perf_counter()
                        r = await s.call_tool(tool, arguments)
                        lat[tool].append(time.perf_counter() - t0)
                        sc = r.structured_content if isinstance(r.structured_content, dict) else {}
                        ok = answered(tool, {"isError": r.is_error, "structuredContent": sc})
                        count(tool, 1, 0 if ok else 1, [] if ok else [f"sdk {tool}: {sc}"])
                return lat

            # warm up every path of every client (imports, caches, schema validators)
            await sdk_calls(warm, f"{run}:warm:sdk")
            for tool in TOOLS:
                b = await anyio.to_thread.run_sync(pool.burst, tool, max(5, warm // 5), f"{run}:w")
                count(tool, len(b["lat"]), b["failed"], b["why"])

            for rnd in range(rounds):
                # 1 SDK session in this process, each tool in turn
                s0, c0 = server_cpu(), time.process_time()
                lat = await sdk_calls(n, f"{run}:{rnd}:sdk")
                note_cpu("sdk x1", s0, time.process_time() - c0, 2 * n)
                for tool in TOOLS:
                    record(f"sdk {tool} x1", lat[tool])
                # 1 raw client process, each tool in turn
                s0 = server_cpu()
                one = await anyio.to_thread.run_sync(pool.alternate, TOOLS, n, f"{run}:{rnd}:one")
                note_cpu("raw x1", s0, one["cpu"], 2 * n)
                for tool in TOOLS:
                    record(f"raw {tool} x1", one["lat"][tool])
                    count(tool, len(one["lat"][tool]), 0, [])
                failed += one["failed"]
                failures.extend(one["why"][: max(0, 5 - len(failures))])
                # 8 raw client processes at once, noop and fence_prepare in turn
                for tool in TOOLS if rnd % 2 == 0 else TOOLS[::-1]:
                    s0 = server_cpu()
                    b = await anyio.to_thread.run_sync(pool.burst, tool, per, f"{run}:{rnd}:x8")
                    note_cpu(f"raw {tool} x{CONCURRENCY}", s0, b["cpu"], len(b["lat"]))
                    record(f"raw {tool} x{CONCURRENCY}", b["lat"], b["calls/s"])
                    count(tool, len(b["lat"]), b["failed"], b["why"])
                for c, key in (("raw", "x1"), ("raw", f"x{CONCURRENCY}"), ("sdk", "x1")):
                    p = res[f"{c} fence_prepare {key}"]["p50"][-1]
                    over[f"{c} {key}"].append(p / res[f"{c} noop {key}"]["p50"][-1] - 1)
            stats = (await s.call_tool("fence_stats", {})).structured_content or {}
            reopened = sum(pool.reopened)
    finally:
        if pool is not None:
            pool.close()
        proc.terminate()
        proc.wait(10)

    results = {k: {q: _summary(v) for q, v in d.items()} for k, d in res.items()}

    x8 = f"x{CONCURRENCY}"
    # the median of the rounds' paired overheads, each fence_prepare beside its no-op
    overhead = {k: statistics.median(v) for k, v in over.items()}
    prepares_x8 = results[f"raw fence_prepare {x8}"]["calls/s"]["median"]
    store_name = stats.get("store", "?")
    admitted = stats.get("prepare", {}).get("admitted")
    checks = {
        "calls": sent["calls"],
        "prepares": sent["prepares"],
        "failed": failed,
        "failures": failures,
        "server_admitted": admitted,
        "reopened": reopened,
    }
    correct = failed == 0 and admitted == sent["prepares"]
    overhead_met: bool | None = None
    if not durable(store_name):
        overhead_met = max(overhead["raw x1"], overhead[f"raw {x8}"]) < TARGET_OVERHEAD
    sqlite = store_name == "sqlite"
    prepares_met = prepares_x8 >= TARGET_PREPARES_PER_S if sqlite else None
    judged = [v for v in (overhead_met, prepares_met) if v is not None]
    return {
        "format": 2,
        "store": args.store,
        "store_name": store_name,
        "counters": stats.get("counters"),
        "rounds": rounds,
        "calls_per_round": n,
        "per_client_x8": per,
        "clients": CLIENTS,
        "results": results,
        "overhead": overhead,
        "overhead_per_round": {k: _summary(v) for k, v in over.items()},
        "throughput_ratio_x8": prepares_x8 / results[f"raw noop {x8}"]["calls/s"]["median"],
        "prepares_per_s_x8": prepares_x8,
        "cpu_ms_per_call": {k: _summary(v) for k, v in cpu.items()},
        "targets": {
            "overhead": {
                "limit": TARGET_OVERHEAD,
                "on": ["raw x1", f"raw {x8}"],
                "applies": overhead_met is not None,
            },
            "overhead_met": overhead_met,
            "prepares_per_s": {"limit": TARGET_PREPARES_PER_S, "applies": sqlite},
            "prepares_per_s_met": prepares_met,
        },
        "target_met": all(judged) if judged else None,
        "distribution_ms": {k: _dist(v) for k, v in pooled.items()},
        "correct": correct,
        "checks": checks,
    }


def verdict(met: bool | None) -> str:
    """A target's verdict; None: the overhead target is not judged on a durable store."""
    return DURABLE_NA if met is None else "met" if met else "NOT met"


def _upper(met: bool | None) -> str:
    return verdict(met) if met is None else verdict(met).upper()


def _http_table(res: dict[str, Any]) -> str:
    ms = 1000.0
    x8 = f"x{CONCURRENCY}"
    lines = [
        f"MCP over streamable HTTP: store={res['store_name']} ({res['store']}), "
        f"counters={res['counters']}; {res['rounds']} rounds, per round x1: "
        f"{res['calls_per_round']} calls per tool, {x8}: {CONCURRENCY} processes x "
        f"{res['per_client_x8']} calls per tool  (median, min-max over rounds)",
        f"{'client':<5} {'scenario':<18} {'p50 ms':>22} {'p99 ms':>22} {'calls/s':>20}",
    ]
    for k, d in res["results"].items():
        client, scenario = k.split(" ", 1)
        p50, p99, cps = d["p50"], d["p99"], d["calls/s"]
        lines.append(
            f"{client:<5} {scenario:<18}"
            f" {p50['median'] * ms:>8.3f} ({p50['min'] * ms:.3f}-{p50['max'] * ms:.3f})"
            f" {p99['median'] * ms:>8.3f} ({p99['min'] * ms:.3f}-{p99['max'] * ms:.3f})"
            f" {cps['median']:>7.0f} ({cps['min']:.0f}-{cps['max']:.0f})"
        )
    o, por = res["overhead"], res["overhead_per_round"]
    lines.append(
        "fence overhead, p50 fence_prepare / noop - 1 (per round min..max): "
        + ", ".join(
            f"{k} {v:+.1%} ({por[k]['min']:+.1%}..{por[k]['max']:+.1%})" for k, v in o.items()
        )
    )
    lines.append(
        f"{CONCURRENCY} processes: {res['prepares_per_s_x8']:.0f} prepares/s, "
        f"{res['throughput_ratio_x8']:.2f}x the no-op's calls/s, so a fence_prepare's mean "
        f"latency is {1 / res['throughput_ratio_x8']:.2f}x a no-op's ({CONCURRENCY} clients "
        "back to back: mean = clients / calls/s; a p50 alone can mislead where waits are "
        "unfair, as SQLite's busy handler makes them)"
    )
    cpu = res["cpu_ms_per_call"]
    if cpu:
        lines.append(
            "CPU ms per call (server process / all clients): "
            + "; ".join(
                f"{k} {cpu[f'server {k}']['median']:.3f} / {cpu[f'client {k}']['median']:.3f}"
                for k in ("sdk x1", "raw x1", f"raw noop {x8}", f"raw fence_prepare {x8}")
                if f"server {k}" in cpu
            )
        )
    t = res["targets"]
    met = _upper(t["overhead_met"])
    if t["prepares_per_s_met"] is None:
        rate_met = f"n/a (store is {res['store_name']})"
    else:
        rate_met = "MET" if t["prepares_per_s_met"] else "NOT MET"
    lines.append(
        f"targets: fence adds < {TARGET_OVERHEAD:.0%} over noop p50 (raw x1 and {x8}): {met}; "
        f"{x8} on SQLite >= {TARGET_PREPARES_PER_S:.0f} prepares/s: {rate_met}"
    )
    c = res["checks"]
    lines.append(
        f"correctness: {'OK' if res['correct'] else 'FAILED'}: {c['prepares']} prepares of new "
        f"intents sent ({c['calls']} calls), {c['failed']} not answered as expected, server "
        f"admitted {c['server_admitted']}; {c['reopened']} idle connections the server "
        "closed between bursts reopened for their sessions"
        + (f"; first failures: {c['failures']}" if c["failures"] else "")
    )
    lines.append("clients: " + "; ".join(f"{k} = {v}" for k, v in res["clients"].items()))
    return "\n".join(lines)


def _table(res: dict[str, Any]) -> str:
    ms = 1000.0
    lines = [
        f"MCP over stdio: {res['rounds']} rounds x {res['calls_per_round']} calls, "
        f"counters={res['checks']['counters']}  (median, min-max over rounds)",
        f"{'scenario':<16} {'p50 ms':>22} {'p99 ms':>22}",
    ]
    for k, d in res["latency_s"].items():
        p50, p99 = d["p50"], d["p99"]
        lines.append(
            f"{k:<16} {p50['median'] * ms:>8.3f} ({p50['min'] * ms:.3f}-{p50['max'] * ms:.3f})"
            f" {p99['median'] * ms:>8.3f} ({p99['min'] * ms:.3f}-{p99['max'] * ms:.3f})"
        )
    lines.append(f"{'throughput':<16} {'calls/s':>22}")
    for k, d in res["calls_per_s"].items():
        lines.append(f"{k:<16} {d['median']:>8.0f} ({d['min']:.0f}-{d['max']:.0f})")
    o = res["overhead"]
    por = res["prepare_overhead_per_round"]
    lines.append(
        f"fence overhead vs noop p50: prepare {o['prepare']:+.1%} "
        f"(per round {por['min']:+.1%}..{por['max']:+.1%}), replay {o['replay']:+.1%}, "
        f"prepare+commit vs 2x noop {o['prepare+commit vs 2x noop']:+.1%}"
    )
    met = _upper(res["target_met"])
    lines.append(
        f"target < {res['target']:.0%}: {met};  correctness: "
        f"{'OK' if res['correct'] else 'FAILED'} {res['checks']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--http", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--transport", choices=["stdio", "http", "both"], default="both", help="default: both"
    )
    parser.add_argument(
        "--store",
        default="memory",
        metavar="URL",
        help="default: memory; 'sqlite' alone: a fresh temporary SQLite file per transport "
        "(synchronous=FULL), removed afterwards",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="calls per scenario per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds x 50 calls")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mcp.json")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.store, args.http)
    if args.quick:
        args.rounds, args.calls = 2, 50
    import anyio

    res: dict[str, Any] = {}
    correct = True
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as tmp:
        fresh = args.store == "sqlite"
        if args.transport in ("stdio", "both"):
            if fresh:
                args.store = f"sqlite:///{tmp.lstrip('/')}/stdio.db"
            res["stdio"] = anyio.run(_measure, args)
            print(_table(res["stdio"]))
            correct = res["stdio"]["correct"]
        if args.transport in ("http", "both"):
            if fresh:
                args.store = f"sqlite:///{tmp.lstrip('/')}/http.db"
            res["http"] = anyio.run(_measure_http, args)
            print(_http_table(res["http"]))
            correct = correct and res["http"]["correct"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
