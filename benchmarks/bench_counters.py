"""Atomic (C) vs pure-Python counter tables, side by side, with correctness checked in the run.

For each operation (reserve, advance_if, compare_exchange), call style (slot index, or domain
name including the dict lookup), thread count (1, 2, 4, 8) and contention (one hot counter, or
one counter per thread), every round runs the same loop on both tables.  Reported: median ops/s
with min-max over the rounds, and the atomic/pure ratio of the medians.  Every round also
checks that no seq was handed out twice (reserved values and successful advances are collected
and must be unique and gapless), so a fast-but-wrong table fails the benchmark.

    python benchmarks/bench_counters.py                 # full run (~1-2 min)
    python benchmarks/bench_counters.py --rounds 3 --ops 5000   # quick (< 30 s)

Writes benchmarks/results/counters.json (gitignored) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from effectfence import counters  # noqa: E402

OPS = ("reserve", "advance_if", "compare_exchange")
STYLES = ("slot", "name")


def _worker(table: Any, op: str, style: str, domain: str, n: int) -> Callable[[], list[int]]:
    """A loop of n calls; returns the seqs this thread won (for the correctness check)."""
    slot = table.slot(domain)
    key: Any = slot if style == "slot" else domain

    if op == "reserve":
        f = table.reserve_slot if style == "slot" else table.reserve

        def run() -> list[int]:
            won: list[int] = []
            append = won.append
            for _ in range(n):
                append(f(key))
            return won

    elif op == "advance_if":
        f2 = table.advance_if_slot if style == "slot" else table.advance_if

        def run() -> list[int]:
            won: list[int] = []
            append = won.append
            expected = table.load_slot(slot)
            for _ in range(n):
                r = f2(key, expected)
                if r > 0:
                    append(r)
                    expected = r
                else:
                    expected = -r - 1
            return won

    else:
        cas = table.compare_exchange  # name only: the protocol has no slot-level CAS

        def run() -> list[int]:
            won: list[int] = []
            append = won.append
            expected = table.load_slot(slot)
            for _ in range(n):
                swapped, observed = cas(domain, expected, expected + 1)
                if swapped:
                    append(expected + 1)
                    expected += 1
                else:
                    expected = observed
            return won

    return run


def measure(backend: str, op: str, style: str, threads: int, hot: bool, n: int) -> float:
    """One round: ops/s over all threads, after checking the seqs are unique and gapless."""
    table = counters.new_table(backend)
    domains = ["hot"] * threads if hot else [f"d{i}" for i in range(threads)]
    starts = {d: table.load(d) or 0 for d in set(domains)}
    for d in domains:
        table.slot(d)
    runs = [_worker(table, op, style, d, n) for d in domains]
    results: list[list[int]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def body(i: int) -> None:
        barrier.wait()
        results[i] = runs[i]()

    pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0

    # Correctness: per domain, everything won is unique and gapless from the start value.
    by_domain: dict[str, list[int]] = {}
    for d, won in zip(domains, results, strict=True):
        by_domain.setdefault(d, []).extend(won)
    for d, won in by_domain.items():
        won.sort()
        start = starts[d]
        if won != list(range(start + 1, start + 1 + len(won))):
            raise AssertionError(f"{backend} {op} {style}: seqs on {d} not unique/gapless")
        if table.load(d) != start + len(won):
            raise AssertionError(f"{backend} {op} {style}: final value of {d} is wrong")
        if op == "reserve" and len(won) != n * domains.count(d):
            raise AssertionError(f"{backend} reserve lost an increment on {d}")
    return threads * n / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per measurement (7)")
    parser.add_argument("--ops", type=int, default=20_000, help="calls per thread per round")
    parser.add_argument("--threads", default="1,2,4,8", help="thread counts (1,2,4,8)")
    parser.add_argument("--ops-filter", default=",".join(OPS), help="operations to run")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "counters.json"
    )
    args = parser.parse_args(argv)
    if counters.AtomicCounterTable is None:
        print("the C extension is not built: nothing to compare", file=sys.stderr)
        return 2
    thread_counts = [int(x) for x in args.threads.split(",")]
    configs: list[tuple[str, str, int, bool]] = []
    for op in args.ops_filter.split(","):
        for style in STYLES:
            if op == "compare_exchange" and style == "slot":
                continue  # the protocol has no slot-level compare_exchange
            for threads in thread_counts:
                for hot in (True, False) if threads > 1 else (True,):
                    configs.append((op, style, threads, hot))

    rows: list[dict[str, Any]] = []
    header = (
        f"{'op':<17}{'call':<5}{'thr':>4} {'counter':<9}"
        f"{'atomic ops/s (min-max)':>30}{'pure ops/s (min-max)':>30}{'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    for op, style, threads, hot in configs:
        samples: dict[str, list[float]] = {"atomic": [], "pure": []}
        for _ in range(args.rounds):
            for backend in ("atomic", "pure"):  # interleaved so drift hits both alike
                samples[backend].append(measure(backend, op, style, threads, hot, args.ops))
        row: dict[str, Any] = {
            "op": op,
            "call": style,
            "threads": threads,
            "counter": "hot" if hot else "distinct",
        }
        for backend, xs in samples.items():
            row[backend] = {
                "median": statistics.median(xs),
                "min": min(xs),
                "max": max(xs),
                "samples": xs,
            }
        row["ratio"] = row["atomic"]["median"] / row["pure"]["median"]
        rows.append(row)

        def fmt(s: dict[str, float]) -> str:
            return f"{s['median'] / 1e6:6.2f}M ({s['min'] / 1e6:.2f}-{s['max'] / 1e6:.2f})"

        print(
            f"{op:<17}{style:<5}{threads:>4} {row['counter']:<9}"
            f"{fmt(row['atomic']):>30}{fmt(row['pure']):>30}{row['ratio']:>6.2f}x",
            flush=True,
        )

    def ratio(op: str, style: str) -> float | None:
        for r in rows:
            if (r["op"], r["call"], r["threads"]) == (op, style, 1):
                return float(r["ratio"])
        return None

    targets = {
        "reserve slot 1 thread >= 3x": ratio("reserve", "slot"),
        "advance_if slot 1 thread >= 3x": ratio("advance_if", "slot"),
        "reserve name 1 thread >= 2x": ratio("reserve", "name"),
        "advance_if name 1 thread >= 2x": ratio("advance_if", "name"),
    }
    verdicts: dict[str, Any] = {}
    print("\ntargets:")
    for name, value in targets.items():
        need = 3.0 if "3x" in name else 2.0
        ok = value is not None and value >= need
        verdicts[name] = {"ratio": value, "met": ok}
        shown = "n/a" if value is None else f"{value:.2f}x"
        print(f"  {name:<34} {shown:>8}  {'MET' if ok else 'MISSED'}")
    behind = [r for r in rows if r["ratio"] <= 1.0]
    verdicts["atomic ahead at every thread count"] = {"met": not behind, "behind": behind}
    print(
        f"  {'atomic ahead in every row':<34} {'':>8}  "
        + ("MET" if not behind else f"MISSED in {len(behind)} rows")
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "argv": sys.argv,
                "rounds": args.rounds,
                "ops_per_thread": args.ops,
                "python": sys.version,
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "switch_interval": sys.getswitchinterval(),
                "backend_info": counters.backend_info(),
                "rows": rows,
                "targets": verdicts,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
