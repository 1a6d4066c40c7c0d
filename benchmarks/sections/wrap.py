"""``effectfence wrap`` over real stdio, wrapped vs direct: ``bench_wrap.run`` (the demo server
as the child; pass-through, fenced and replayed calls; the child's ledger counts executions).
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

from benchmarks.suite import Context, Skip

TITLE = "wrap: the proxy in front of a stdio MCP server"


def run(ctx: Context) -> dict[str, Any]:
    if importlib.util.find_spec("effectfence.wrap") is None:
        raise Skip("effectfence.wrap is not importable in this build")
    from benchmarks import bench_wrap

    rounds, calls = ctx.pick((1, 30), (5, 300))
    out: dict[str, Any] = {"rounds": rounds, "calls": calls}
    for kind in ("sqlite", "memory"):
        tmp = ctx.tmp / f"wrap-{kind}"
        tmp.mkdir(exist_ok=True)
        store = (
            f"sqlite:///{(tmp / 'fence.db').as_posix().lstrip('/')}"
            if kind == "sqlite"
            else "memory:"
        )
        ctx.progress(f"store {kind}: {rounds} rounds x {calls} calls")
        out[kind] = asyncio.run(bench_wrap.run(rounds, calls, store, tmp))
        c = out[kind]["checks"]
        ctx.check(
            f"{kind}: {c['distinct_fenced_calls']} distinct fenced calls ran "
            f"{c['fenced_runs']} times in the child; {c['replays']} replays marked"
        )
    return out
