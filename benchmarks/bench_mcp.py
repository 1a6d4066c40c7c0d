"""What the fence adds to an MCP tool call, over real stdio and streamable HTTP.

One server process (``effectfence.mcp.build_server()`` plus a trivial ``noop`` tool taking the
same arguments as ``fence_prepare``), one SDK client (``stdio_client`` + ``ClientSession``),
same transport, same run. Measured per round, interleaved so drift hits all alike:

- ``noop``            a trivial tool's round trip (the baseline)
- ``prepare``         ``fence_prepare`` on a new intent (fresh: ticket sealed and returned)
- ``prepare+commit``  the full protocol for one effect (two round trips; compared with 2x noop)
- ``replay``          ``fence_prepare`` of a committed intent (cert returned)

and calls per second with 8 concurrent callers on one connection: noop, and a duplicate
storm where all 8 callers prepare the same intents and the winner commits.

Correctness is counted while measuring: every ``prepare`` must be fresh, every replay must
carry the committed hash, and in the storm the effect must run exactly once per intent
(executions == fresh admissions == intents) — checked against the server's own stats.

Over streamable HTTP (``effectfence serve --http`` on 127.0.0.1, same server code, same
``noop``): ``fence_prepare`` vs ``noop`` p50/p99 with 1 client, and with 8 concurrent
clients (8 sessions, 8 connections), each calling back to back, plus calls/s in total.

    python benchmarks/bench_mcp.py               # 5 rounds x 400 calls per scenario
    python benchmarks/bench_mcp.py --quick       # a smoke run
    python benchmarks/bench_mcp.py --transport http --store sqlite:///tmp/f.db

Target: the fence adds under 10% to a trivial tool's round trip (prepare p50 / noop p50),
on both transports; 8 concurrent HTTP clients on a SQLite store >= 500 prepares/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ARGS = {"order_id": 0, "cents": 500, "currency": "EUR", "customer": "cus_123"}
RESULT = {"charge_id": "ch_0", "status": "succeeded", "amount": 500}
CONCURRENCY = 8
TARGET_OVERHEAD = 0.10


def serve(store: str, http: bool) -> int:
    """The server side: the fence's tools plus a trivial tool on the same server."""
    from effectfence import FenceConfig
    from effectfence.mcp.server import build_server, open_fence
    from effectfence.mcp.telemetry import Metrics

    fence = open_fence(store, FenceConfig())
    metrics = Metrics()
    server = build_server(fence, metrics=metrics)

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
    noop = latency["noop"]["p50"]["median"]
    overhead = {
        "prepare": latency["prepare"]["p50"]["median"] / noop - 1,
        "replay": latency["replay"]["p50"]["median"] / noop - 1,
        "prepare+commit vs 2x noop": latency["prepare+commit"]["p50"]["median"] / (2 * noop) - 1,
    }
    per_round_overhead = [
        p / b - 1 for p, b in zip(lat["prepare"]["p50"], lat["noop"]["p50"], strict=True)
    ]
    return {
        "calls_per_round": n,
        "rounds": rounds,
        "latency_s": latency,
        "calls_per_s": {k: _summary(v) for k, v in rps.items()},
        "overhead": overhead,
        "prepare_overhead_per_round": _summary(per_round_overhead),
        "target": TARGET_OVERHEAD,
        "target_met": overhead["prepare"] < TARGET_OVERHEAD,
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


async def _measure_http(args: argparse.Namespace) -> dict[str, Any]:
    """1 client and 8 concurrent clients (own sessions and connections) against one
    ``serve --http`` process: noop vs fence_prepare on fresh intents."""
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
    url = json.loads(proc.stderr.readline())["url"]
    n, rounds = args.calls, args.rounds
    out: dict[str, Any] = {"calls_per_round": n, "rounds": rounds, "store": args.store}
    try:
        async with contextlib.AsyncExitStack() as stack:
            sessions: list[Any] = []
            for _ in range(CONCURRENCY):
                http = await stack.enter_async_context(create_mcp_http_client())
                read, write = await stack.enter_async_context(
                    streamable_http_client(url, http_client=http)
                )
                s = await stack.enter_async_context(ClientSession(read, write))
                await s.initialize()
                await s.list_tools()
                sessions.append(s)
            for i in range(getattr(args, "warmup", 50)):  # warm up
                for s in sessions:
                    await s.call_tool("noop", _req(f"w{i}"))
                    await s.call_tool("fence_prepare", _req(f"w{i}:{id(s)}"))

            async def client(s: Any, tool: str, tag: str, count: int, lat: list[float]) -> None:
                for i in range(count):
                    t0 = time.perf_counter()
                    r = await s.call_tool(tool, _req(f"{tag}:{i}"))
                    lat.append(time.perf_counter() - t0)
                    if tool == "fence_prepare":
                        assert r.structured_content["status"] == "fresh", r

            res: dict[str, dict[str, list[float]]] = {}
            pooled: dict[str, list[float]] = {}
            for rnd in range(rounds):
                # 1 client, noop and prepare interleaved so drift hits both alike
                one: dict[str, list[float]] = {"noop": [], "fence_prepare": []}
                for i in range(n):
                    for tool in ("noop", "fence_prepare"):
                        await client(sessions[0], tool, f"one{rnd}:{i}:{tool}", 1, one[tool])
                for tool, v in one.items():
                    pooled.setdefault(f"{tool} x1", []).extend(v)
                    d = res.setdefault(f"{tool} x1", {"p50": [], "p99": [], "calls/s": []})
                    d["p50"].append(_pct(v, 0.5))
                    d["p99"].append(_pct(v, 0.99))
                    d["calls/s"].append(1 / statistics.mean(v))
                # 8 clients at once, each back to back
                per = max(1, n // 2)
                for tool in ("noop", "fence_prepare"):
                    lat: list[float] = []
                    t0 = time.perf_counter()
                    async with anyio.create_task_group() as tg:
                        for c, s in enumerate(sessions):
                            tg.start_soon(client, s, tool, f"many{rnd}:{c}:{tool}", per, lat)
                    wall = time.perf_counter() - t0
                    pooled.setdefault(f"{tool} x8", []).extend(lat)
                    d = res.setdefault(f"{tool} x8", {"p50": [], "p99": [], "calls/s": []})
                    d["p50"].append(_pct(lat, 0.5))
                    d["p99"].append(_pct(lat, 0.99))
                    d["calls/s"].append(len(lat) / wall)
            stats = (await sessions[0].call_tool("fence_stats", {})).structured_content
    finally:
        proc.terminate()
        proc.wait(10)
    out["results"] = {k: {q: _summary(v) for q, v in d.items()} for k, d in res.items()}
    out["distribution_ms"] = {k: _dist(v) for k, v in pooled.items()}
    r = out["results"]
    out["overhead"] = {
        f"x{c}": r[f"fence_prepare x{c}"]["p50"]["median"] / r[f"noop x{c}"]["p50"]["median"] - 1
        for c in (1, CONCURRENCY)
    }
    out["target_met"] = all(v < TARGET_OVERHEAD for v in out["overhead"].values())
    out["prepares_per_s_x8"] = r["fence_prepare x8"]["calls/s"]["median"]
    out["counters"] = stats["counters"]
    out["store_name"] = stats["store"]
    return out


def _http_table(res: dict[str, Any]) -> str:
    ms = 1000.0
    lines = [
        f"MCP over streamable HTTP: {res['rounds']} rounds x {res['calls_per_round']} calls, "
        f"store={res['store_name']}, counters={res['counters']}  (median, min-max over rounds)",
        f"{'scenario':<18} {'p50 ms':>22} {'p99 ms':>22} {'calls/s':>18}",
    ]
    for k, d in res["results"].items():
        p50, p99, cps = d["p50"], d["p99"], d["calls/s"]
        lines.append(
            f"{k:<18} {p50['median'] * ms:>8.3f} ({p50['min'] * ms:.3f}-{p50['max'] * ms:.3f})"
            f" {p99['median'] * ms:>8.3f} ({p99['min'] * ms:.3f}-{p99['max'] * ms:.3f})"
            f" {cps['median']:>7.0f} ({cps['min']:.0f}-{cps['max']:.0f})"
        )
    o = res["overhead"]
    met = "MET" if res["target_met"] else "NOT MET"
    lines.append(
        f"fence overhead vs noop p50: 1 client {o['x1']:+.1%}, 8 clients "
        f"{o['x' + str(CONCURRENCY)]:+.1%};  target < {TARGET_OVERHEAD:.0%}: {met};  "
        f"8 clients: {res['prepares_per_s_x8']:.0f} prepares/s"
    )
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
    met = "MET" if res["target_met"] else "NOT MET"
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
    parser.add_argument("--store", default="memory", metavar="URL", help="default: memory")
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
    if args.transport in ("stdio", "both"):
        res["stdio"] = anyio.run(_measure, args)
        print(_table(res["stdio"]))
        correct = res["stdio"]["correct"]
    if args.transport in ("http", "both"):
        res["http"] = anyio.run(_measure_http, args)
        print(_http_table(res["http"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
