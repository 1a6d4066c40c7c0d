"""Counter tables, atomic (C11, cffi) vs pure Python, 1-8 threads: ``bench_counters.measure``.

Every round checks that the seqs won are unique and gapless (the script's own check).
"""

from __future__ import annotations

from typing import Any

from benchmarks import bench_counters
from benchmarks.stats import ratio, summary
from benchmarks.suite import Context, Skip

TITLE = "Counter tables: atomic (C11) vs pure Python"


def run(ctx: Context) -> dict[str, Any]:
    from effectfence import counters

    if counters.AtomicCounterTable is None:
        raise Skip("the C extension is not built: there is no atomic table to compare")
    rounds = ctx.pick(2, 5)
    ops = ctx.pick(2_000, 20_000)
    thread_counts = [1, 2, 4, 8]
    configs = [
        (op, style)
        for op in ctx.pick(("reserve", "advance_if"), bench_counters.OPS)
        for style in bench_counters.STYLES
        if not (op == "compare_exchange" and style == "slot")
    ]
    rows: list[dict[str, Any]] = []
    for op, style in configs:
        for threads in thread_counts:
            for hot in (True, False) if threads > 1 else (True,):
                samples: dict[str, list[float]] = {"atomic": [], "pure": []}
                for _ in range(rounds):
                    for backend in samples:  # interleaved, so drift hits both alike
                        samples[backend].append(
                            bench_counters.measure(backend, op, style, threads, hot, ops)
                        )
                row = {
                    "op": op,
                    "call": style,
                    "threads": threads,
                    "counter": "hot" if hot else "distinct",
                    "atomic": summary(samples["atomic"]),
                    "pure": summary(samples["pure"]),
                }
                row["ratio"] = ratio(row["atomic"], row["pure"])
                rows.append(row)
        ctx.progress(f"{op} by {style}: 1-8 threads done")
    ctx.check(
        f"{len(rows) * rounds * 2} rounds: every seq won was unique and gapless, no increment lost"
    )
    return {"rounds": rounds, "ops_per_thread": ops, "rows": rows}
