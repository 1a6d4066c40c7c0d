"""The MCP server over stdio and streamable HTTP: ``bench_mcp._measure`` and
``bench_mcp._measure_http`` (the SDK's own client; ``fence_prepare`` against a no-op tool
with the same arguments on the same server, interleaved; 8 concurrent callers).
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from benchmarks.suite import Context, Skip

TITLE = "MCP server: stdio and streamable HTTP"


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
    ctx.progress("streamable HTTP: 1 and 8 clients")
    out["http"] = anyio.run(bench_mcp._measure_http, args)
    ctx.check("HTTP: every fence_prepare of a new intent was fresh")
    return out
