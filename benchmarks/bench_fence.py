"""Fence throughput and latency, atomic and pure counter tables side by side.

Scenarios (each checks correctness while it measures: executions are counted at a sink,
every replay must be a Replay with the committed hash, every duplicate must be refused):

- fresh:     prepare + run (sink) + commit, a new intent each time (certificate included)
- replay:    a committed intent asked again, each time with a NEW request object, so the
             payload fingerprint is recomputed and checked, as duplicates arrive in real life
- in_flight: a duplicate of an intent whose holder has not committed, refused
- decorator: ``@fenced`` function on fresh intents vs the same bare function

Single thread and N threads (released together by a barrier). Reports ops/s as the median
(min-max) over rounds, p50/p99 latency of one operation, and the atomic/pure ratio.

    python benchmarks/bench_fence.py                 # default: 5 rounds, 20k ops
    python benchmarks/bench_fence.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from effectfence import EffectFence, EffectRequest, FenceConfig, IntentInFlight, fenced
from effectfence.counters import AtomicCounterTable

ARGS = {"order_id": 0, "cents": 500, "currency": "EUR", "customer": "cus_123"}
RESULT = {"charge_id": "ch_0", "status": "succeeded", "amount": 500}
TARGETS = {"fresh": 100_000, "replay": 300_000}


class Sink:
    """Where the effect lands: counts executions independently of the fence."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.n += 1


def new_fence(counters: str) -> EffectFence:
    return EffectFence(FenceConfig(counters=counters, lease_ttl=60.0, result_ttl=3600.0))


def run_threads(threads: int, work: Callable[[int], list[int]]) -> tuple[float, list[int]]:
    """Run work(i) in ``threads`` threads released together; (seconds, latencies ns)."""
    if threads == 1:
        t0 = time.perf_counter()
        lat = work(0)
        return time.perf_counter() - t0, lat
    barrier = threading.Barrier(threads + 1)
    out: list[list[int]] = [[] for _ in range(threads)]

    def run(i: int) -> None:
        barrier.wait()
        out[i] = work(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, [x for part in out for x in part]


def scenario_fresh(counters: str, n: int, threads: int, rnd: int) -> tuple[float, list[int]]:
    fence = new_fence(counters)
    sink = Sink()
    per = n // threads
    clock = time.perf_counter_ns

    def work(i: int) -> list[int]:
        lat = []
        for j in range(per):
            t0 = clock()
            adm = fence.prepare(
                EffectRequest(f"charge:{rnd}:{i}:{j}", "order:1", "charge", ARGS, "agent-1")
            )
            if adm.fresh:
                sink.hit()
                fence.commit(adm.ticket, RESULT)
            lat.append(clock() - t0)
        return lat

    dt, lat = run_threads(threads, work)
    assert sink.n == per * threads, "every fresh intent must execute exactly once"
    assert fence.stats()["commits"] == per * threads
    return per * threads / dt, lat


def scenario_replay(counters: str, n: int, threads: int, rnd: int) -> tuple[float, list[int]]:
    fence = new_fence(counters)
    keys = 1000
    hashes = []
    for k in range(keys):
        adm = fence.prepare(EffectRequest(f"charge:{k}", "order:1", "charge", ARGS, "agent-1"))
        hashes.append(fence.commit(adm.ticket, RESULT).hash)
    per = n // threads
    clock = time.perf_counter_ns
    bad: list[int] = []

    def work(i: int) -> list[int]:
        lat = []
        for j in range(per):
            k = (i * 7919 + j) % keys
            t0 = clock()
            adm = fence.prepare(EffectRequest(f"charge:{k}", "order:1", "charge", ARGS, "agent-2"))
            lat.append(clock() - t0)
            if adm.fresh or adm.cert.hash != hashes[k]:
                bad.append(k)
        return lat

    dt, lat = run_threads(threads, work)
    assert not bad, "a replay must return the committed certificate"
    assert fence.stats()["prepare"]["replayed"] == per * threads
    return per * threads / dt, lat


def scenario_in_flight(counters: str, n: int, threads: int, rnd: int) -> tuple[float, list[int]]:
    fence = new_fence(counters)
    holder = fence.prepare(EffectRequest("charge:held", "order:1", "charge", ARGS, "agent-1"))
    assert holder.fresh
    per = n // threads
    clock = time.perf_counter_ns
    admitted: list[int] = []

    def work(i: int) -> list[int]:
        lat = []
        for _ in range(per):
            t0 = clock()
            try:
                fence.prepare(EffectRequest("charge:held", "order:1", "charge", ARGS, "agent-2"))
                admitted.append(1)
            except IntentInFlight:
                pass
            lat.append(clock() - t0)
        return lat

    dt, lat = run_threads(threads, work)
    assert not admitted, "a duplicate of an in-flight intent must be refused"
    return per * threads / dt, lat


def scenario_decorator(counters: str, n: int, threads: int, rnd: int) -> tuple[float, list[int]]:
    fence = new_fence(counters)
    sink = Sink()

    @fenced(fence, intent="charge:{r}:{i}:{j}", domain="order:1", tool="charge")
    def charge(r: int, i: int, j: int) -> dict[str, Any]:
        sink.hit()
        return RESULT

    per = n // threads
    clock = time.perf_counter_ns

    def work(i: int) -> list[int]:
        lat = []
        for j in range(per):
            t0 = clock()
            charge(rnd, i, j)
            lat.append(clock() - t0)
        return lat

    dt, lat = run_threads(threads, work)
    assert sink.n == per * threads
    return per * threads / dt, lat


def scenario_bare(counters: str, n: int, threads: int, rnd: int) -> tuple[float, list[int]]:
    sink = Sink()

    def charge(r: int, i: int, j: int) -> dict[str, Any]:
        sink.hit()
        return RESULT

    per = n // threads
    clock = time.perf_counter_ns

    def work(i: int) -> list[int]:
        lat = []
        for j in range(per):
            t0 = clock()
            charge(rnd, i, j)
            lat.append(clock() - t0)
        return lat

    dt, lat = run_threads(threads, work)
    assert sink.n == per * threads
    return per * threads / dt, lat


SCENARIOS: dict[str, Callable[[str, int, int, int], tuple[float, list[int]]]] = {
    "fresh": scenario_fresh,
    "replay": scenario_replay,
    "in_flight": scenario_in_flight,
    "decorator": scenario_decorator,
    "bare_call": scenario_bare,
}


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def round_summary(scenario: str, table: str, n: int, threads: int, rnd: int) -> dict[str, Any]:
    """One round of one scenario, for the suite: ops/s and latency quantiles (us)."""
    ops, lat = SCENARIOS[scenario](table, n, threads, rnd)
    return {"ops_s": ops, "latency_us": {"p50": pct(lat, 0.50), "p99": pct(lat, 0.99)}}


def kept_result_bytes(table: str, n: int) -> dict[str, Any]:
    """Memory one kept small result costs (args ``{"n": i}``, result ``{"ok": true}``): the
    traced growth over ``n`` commits held by the memory store, divided by ``n``."""
    fence = EffectFence(FenceConfig(counters=table, result_ttl=1e9, auto_sweep=False))

    def commit(i: int) -> Any:
        adm = fence.prepare(EffectRequest(f"m{i}", "d", "t", {"n": i}))
        assert adm.fresh
        return fence.commit(adm.ticket, {"ok": True})

    for i in range(200):  # warm-up: caches, interned names, table growth
        commit(-1 - i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [commit(i) for i in range(n)]
        del kept  # the certificates handed back; the store keeps its own
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    if fence.stats()["size"]["records"] < n:
        raise AssertionError("the store reclaimed results it was told to keep")
    return {"n": n, "bytes_per_result": grown / n}


def build_info() -> dict[str, Any]:
    """Which build this interpreter runs (compiled core or pure twin), for the suite."""
    from effectfence.counters import backend_info

    info = backend_info()
    return {k: info[k] for k in ("backend", "forced", "speedups", "speedups_off_reason")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--quick", action="store_true", help="2 rounds of 4,000 ops")
    p.add_argument("--json", default="benchmarks/results/fence.json")
    a = p.parse_args(argv)
    if a.quick:
        a.ops, a.rounds = 4000, 2
    tables = ["atomic", "pure"] if AtomicCounterTable is not None else ["pure"]
    rows: list[dict[str, Any]] = []
    for name in a.scenarios:
        for threads in a.threads:
            per_table: dict[str, dict[str, Any]] = {}
            samples: dict[str, list[float]] = {t: [] for t in tables}
            lats: dict[str, list[int]] = {t: [] for t in tables}
            for rnd in range(a.rounds):
                for table in tables:  # interleaved, so drift hits both alike
                    ops, lat = SCENARIOS[name](table, a.ops, threads, rnd)
                    samples[table].append(ops)
                    lats[table].extend(lat)
            for table in tables:
                s = samples[table]
                per_table[table] = {
                    "median": statistics.median(s),
                    "min": min(s),
                    "max": max(s),
                    "p50_us": pct(lats[table], 0.50),
                    "p99_us": pct(lats[table], 0.99),
                }
            row = {"scenario": name, "threads": threads, **{t: per_table[t] for t in tables}}
            if "pure" in per_table and "atomic" in per_table:
                row["ratio_atomic_pure"] = (
                    per_table["atomic"]["median"] / per_table["pure"]["median"]
                )
            rows.append(row)
            cells = "  ".join(
                f"{t}: {v['median']:>9,.0f}/s ({v['min']:,.0f}-{v['max']:,.0f}) "
                f"p50 {v['p50_us']:.1f}us p99 {v['p99_us']:.1f}us"
                for t, v in per_table.items()
            )
            ratio = (
                f"  atomic/pure {row['ratio_atomic_pure']:.2f}x"
                if "ratio_atomic_pure" in row
                else ""
            )
            print(f"{name:<10} {threads:>2}T  {cells}{ratio}", flush=True)
    by = {(r["scenario"], r["threads"]): r for r in rows}
    summary: dict[str, Any] = {}
    best = tables[0]
    for name, target in TARGETS.items():
        r = by.get((name, 1))
        if r:
            got = r[best]["median"]
            summary[name] = {"target": target, "median": got, "met": got >= target}
            print(
                f"target {name} (1 thread, {best}): {got:,.0f}/s vs {target:,}/s -> "
                f"{'met' if got >= target else 'NOT met'}"
            )
    if ("decorator", 1) in by and ("bare_call", 1) in by:
        d = by[("decorator", 1)][best]["p50_us"] - by[("bare_call", 1)][best]["p50_us"]
        summary["decorator_overhead_us_p50"] = d
        print(f"decorator overhead over a bare call (p50, 1 thread, {best}): {d:.1f} us")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
