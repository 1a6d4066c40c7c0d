"""Fence operations, compiled core vs pure twin, each in its own interpreter:
``bench_fence.SCENARIOS`` run by ``bench_fence.round_summary`` in two workers, one with the
compiled core (C counters + accelerator) and one with ``EFFECTFENCE_COUNTERS=pure`` (the whole
pure-Python twin, as on a machine without a compiler), rounds interleaved. Then what one kept
small result costs in each build (``bench_fence.kept_result_bytes``, tracemalloc).
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.stats import ratio, summary
from benchmarks.suite import Context, Skip, Worker

TITLE = "Fence operations: compiled core vs pure twin"
BUILDS = {"compiled": ("atomic", {}), "pure": ("pure", {"EFFECTFENCE_COUNTERS": "pure"})}


def run(ctx: Context) -> dict[str, Any]:
    from effectfence.counters import AtomicCounterTable

    if AtomicCounterTable is None:
        raise Skip("the compiled core is not built: only the pure twin could run")
    rounds = ctx.pick(2, 5)
    ops = ctx.pick(2_000, 20_000)
    threads_list = ctx.pick([1], [1, 8])
    scenarios = ["fresh", "replay", "in_flight", "decorator", "bare_call"]
    workers = {b: Worker(sys.executable, env, name=b) for b, (_, env) in BUILDS.items()}
    rows: list[dict[str, Any]] = []
    try:
        for name in scenarios:
            for threads in threads_list:
                ops_s: dict[str, list[float]] = {b: [] for b in BUILDS}
                lat: dict[str, list[dict[str, float]]] = {b: [] for b in BUILDS}
                for rnd in range(rounds):
                    for build, (table, _) in BUILDS.items():
                        got = workers[build].call(
                            "bench_fence:round_summary",
                            scenario=name,
                            table=table,
                            n=ops,
                            threads=threads,
                            rnd=rnd,
                        )
                        ops_s[build].append(got["ops_s"])
                        lat[build].append(got["latency_us"])
                row: dict[str, Any] = {"scenario": name, "threads": threads}
                for build in BUILDS:
                    row[build] = summary(ops_s[build])
                    # per-round p50/p99, then their medians
                    row[build]["p50_us"] = summary([q["p50"] for q in lat[build]])["median"]
                    row[build]["p99_us"] = summary([q["p99"] for q in lat[build]])["median"]
                row["ratio"] = ratio(row["compiled"], row["pure"])
                rows.append(row)
                ctx.progress(
                    f"{name} {threads}T: compiled {row['compiled']['median']:,.0f}/s, "
                    f"pure {row['pure']['median']:,.0f}/s"
                )
        builds = {b: w.call("bench_fence:build_info") for b, w in workers.items()}
        kept_n = ctx.pick(2_000, 100_000)
        kept = {
            b: workers[b].call("bench_fence:kept_result_bytes", table=table, n=kept_n)
            for b, (table, _) in BUILDS.items()
        }
    finally:
        for w in workers.values():
            w.close()
    ctx.check(
        "every fresh intent executed exactly once (sink), every replay returned the "
        "committed certificate, every in-flight duplicate was refused"
    )
    ctx.check(f"each build kept all {kept_n:,} committed results while its memory was traced")
    return {"rounds": rounds, "ops": ops, "rows": rows, "builds": builds, "kept_result": kept}
