"""The MCP server over stdio and streamable HTTP: ``bench_mcp._measure`` (the SDK's own
client over stdio) and ``bench_mcp._measure_http`` (``fence_prepare`` against a no-op tool
with the same arguments on the same server, interleaved: the SDK client with 1 session, and
the benchmark's raw client in 1 and in 8 processes released together), over HTTP on the
memory store and on a fresh SQLite file (synchronous=FULL).
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from benchmarks.suite import Context, Skip

TITLE = "MCP server: stdio and streamable HTTP"


def _http_check(ctx: Context, label: str, h: dict[str, Any]) -> None:
    c = h["checks"]
    if not h["correct"]:
        raise AssertionError(f"MCP HTTP ({label}): a correctness check failed: {c}")
    ctx.check(
        f"HTTP, {label} store: {c['prepares']} fence_prepare calls on new intents all answered "
        f"status fresh ({c['calls']} calls, none failed); the server admitted "
        f"{c['server_admitted']}, as many as were sent"
    )


def run(ctx: Context) -> dict[str, Any]:
    if importlib.util.find_spec("mcp") is None:
        raise Skip("the mcp SDK is not installed")
    import anyio

    from benchmarks import bench_mcp

    args = argparse.Namespace(
        store="memory", rounds=ctx.pick(1, 5), calls=ctx.pick(30, 300), warmup=ctx.pick(5, 100)
    )
    out: dict[str, Any] = {"store": args.store, "rounds": args.rounds, "calls": args.calls}
    ctx.progress(f"stdio: {args.rounds} rounds x {args.calls} calls per scenario")
    out["stdio"] = anyio.run(bench_mcp._measure, args)
    if not out["stdio"]["correct"]:
        raise AssertionError(f"MCP stdio: a correctness check failed: {out['stdio']['checks']}")
    c = out["stdio"]["checks"]
    ctx.check(
        f"stdio: {c['fresh']}/{c['fresh_expected']} prepares fresh, {c['replays_ok']} "
        f"replays carried the committed hash, storm: {c['executions']} executions for "
        f"{c['intents']} intents, server admitted {c['server_admitted']} as expected"
    )
    ctx.progress("streamable HTTP, memory store: SDK client x1, raw client x1 and x8 processes")
    out["http"] = anyio.run(bench_mcp._measure_http, args)
    _http_check(ctx, "memory", out["http"])
    db = ctx.tmp / "mcp-http.db"  # a fresh file: nothing from an earlier run in it
    args.store = "sqlite:///" + str(db).lstrip("/")
    ctx.progress(f"streamable HTTP, SQLite store {db}: the same")
    out["http_sqlite"] = anyio.run(bench_mcp._measure_http, args)
    _http_check(ctx, "SQLite", out["http_sqlite"])
    return out
