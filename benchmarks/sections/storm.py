"""The storm: 1,000 attempts at one intent in 40 waves of 25 new threads (``effectfence storm``),
compiled core vs pure twin in their own interpreters, runs interleaved:
``benchmarks/storm.py``'s ``one_storm`` over :func:`effectfence.storm.run_storm`. Then one
real ``effectfence storm`` with its default settings, run as a user would, whose transcript
the README shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.sections.fence import BUILDS
from benchmarks.stats import summary
from benchmarks.suite import ROOT, Context, Skip, Worker

TITLE = "The storm: 1,000 attempts, one execution"


def run(ctx: Context) -> dict[str, Any]:
    from effectfence.counters import AtomicCounterTable
    from effectfence.storm import REFERENCE_MS

    if AtomicCounterTable is None:
        raise Skip("the compiled core is not built: only the pure twin could run")
    runs = ctx.pick(2, 7)
    workers = {b: Worker(sys.executable, env, name=b) for b, (_, env) in BUILDS.items()}
    reports: dict[str, list[dict[str, Any]]] = {b: [] for b in BUILDS}
    try:
        for w in workers.values():
            w.call("storm:warm_up")
        for i in range(runs):
            for build, (table, _) in BUILDS.items():
                reports[build].append(workers[build].call("storm:one_storm", counters=table))
            ctx.progress(f"run {i + 1}/{runs}")
    finally:
        for w in workers.values():
            w.close()
    out: dict[str, Any] = {"runs": runs, "reference_ms": REFERENCE_MS, "builds": {}}
    for build, rs in reports.items():
        bad = [r for r in rs if not r["ok"]]
        if bad:
            raise AssertionError(f"{build}: a storm executed {bad[0]['executions']} times")
        out["builds"][build] = {
            "attempts": rs[0]["attempts"],
            "executions": [r["executions"] for r in rs],
            "replays": summary([r["replays"] for r in rs]),
            "fence_ms": summary([r["fence_sum_ms"] for r in rs]),
            "harness_ms": summary([r["harness_ms"] for r in rs]),
            "fence_over_harness": summary([r["fence_sum_ms"] / r["harness_ms"] for r in rs]),
            "prepare_p50_us": summary([r["prepare_p50_us"] for r in rs]),
            "prepare_p99_us": summary([r["prepare_p99_us"] for r in rs]),
        }
    b = out["builds"]
    out["ratio_pure_over_compiled"] = (
        b["pure"]["fence_ms"]["median"] / b["compiled"]["fence_ms"]["median"]
    )
    ctx.check(
        f"{runs * len(BUILDS)} storms of 1,000 attempts: exactly one execution in each, "
        "counted at the sink"
    )
    out["transcript"] = transcript(ctx)
    return out


def transcript(ctx: Context) -> dict[str, Any]:
    """One ``effectfence storm`` with its default settings, as a user runs it: its stdout, and
    per table the figures it printed (from its ``--json``, which changes nothing else)."""
    path = ctx.tmp / "storm-cli.json"
    cmd = [sys.executable, "-m", "effectfence", "storm", "--json", str(path)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    if proc.returncode != 0:  # its exit status is 0 only if every table executed exactly once
        raise AssertionError(
            f"effectfence storm exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )
    runs = json.loads(path.read_text())["runs"]
    keys = ("counters", "waves", "racers", "attempts", "executions", "replays", "harness_ms",
            "elapsed_ms", "fence_sum_ms")  # fmt: skip
    ctx.check(
        "`effectfence storm` (default settings) exited 0: exactly one execution for each of "
        + ", ".join(r["counters"] for r in runs)
    )
    return {
        "command": "effectfence storm",
        "stdout": proc.stdout,
        "runs": [{k: r[k] for k in keys} for r in runs],
    }
