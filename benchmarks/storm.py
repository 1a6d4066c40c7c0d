"""The storm benchmark: several 1,000-attempt storms per counter table, medians with min-max.

    python benchmarks/storm.py                 # both tables, 7 runs each
    python benchmarks/storm.py --runs 15 --json storm.json

A thin script over :mod:`effectfence.storm`: every run also times the same harness with a
no-op in place of the fence, so the fence's own time is reported beside the harness time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from effectfence.storm import REFERENCE_MS, STORES, _waves, run_many, run_storm, summary


def warm_up(waves: int = 40, racers: int = 25) -> None:
    """The discarded pass of the bare harness that ``run_many`` makes first (for the suite)."""
    _waves(waves, racers, lambda w, i: None)


def one_storm(counters: str, waves: int = 40, racers: int = 25) -> dict[str, Any]:
    """One storm on the memory store, as a dict (the suite's per-run measurement)."""
    report = run_storm(waves, racers, "memory", counters)
    return {**report.to_dict(), "ok": report.ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/storm.py")
    p.add_argument("--waves", type=int, default=40)
    p.add_argument("--racers", type=int, default=25)
    p.add_argument("--store", choices=sorted(STORES), default="memory")
    p.add_argument("--counters", choices=["atomic", "pure", "both"], default="both")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    tables = ["atomic", "pure"] if args.counters == "both" else [args.counters]
    reports = run_many(args.waves, args.racers, args.store, tables, args.runs, 77700)
    s = summary(reports)
    attempts = args.waves * args.racers
    print(
        f"storm: {attempts} attempts ({args.waves} waves x {args.racers} new threads), "
        f"{args.runs} runs per table; median [min-max]"
    )
    for table, e in s.items():

        def fmt(key: str, e: dict = e) -> str:  # type: ignore[type-arg]
            v = e[key]
            return f"{v['median']:8.2f} [{v['min']:.2f}-{v['max']:.2f}]"

        print(
            f"  {table:<6} executions ok: {e['all_ok']}  fence_ms {fmt('fence_sum_ms')}  "
            f"harness_ms {fmt('harness_ms')}  elapsed_ms {fmt('elapsed_ms')}  "
            f"p50_us {fmt('prepare_p50_us')}  p99_us {fmt('prepare_p99_us')}  "
            f"fence/harness {e['fence_over_harness']:.3f}"
        )
    if "atomic" in s and "pure" in s:
        ratio = s["atomic"]["fence_sum_ms"]["median"] / s["pure"]["fence_sum_ms"]["median"]
        print(f"  atomic/pure fence time: {ratio:.3f}")
    for table, e in s.items():
        med = e["fence_sum_ms"]["median"]
        print(
            f"  target [{table}]: fence/harness {e['fence_over_harness'] * 100:.1f}% < 10%: "
            f"{'met' if e['fence_over_harness'] < 0.10 else 'NOT met'} (fence {med:.2f} ms; "
            f"the reference implementation's whole storm, measured elsewhere: {REFERENCE_MS} "
            "ms, for context, not compared)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"runs": [r.to_dict() for r in reports], "summary": s}, fh, indent=2)
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
