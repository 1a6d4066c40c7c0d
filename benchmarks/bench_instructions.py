"""Instructions per fence operation, counted by valgrind: a figure this noisy machine can't move.

Wall-clock benchmarks here drift by up to ~1.6x with other tenants' load; instruction counts
from ``valgrind --tool=callgrind`` are the same run after run for the same build and inputs.
Each scenario runs N operations in a child interpreter, minus a baseline child that builds
the same inputs and does nothing, so what remains is the fence's own work per operation.
(SHA-256 is counted in software under valgrind, so hashing weighs more here than on the
CPU; compare runs of this benchmark with each other, not with wall-clock figures.)

    python benchmarks/bench_instructions.py              # needs valgrind on PATH
    python benchmarks/bench_instructions.py --ops 2000 --counters pure
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys
from effectfence import EffectFence, EffectRequest, FenceConfig
mode, n = sys.argv[1], int(sys.argv[2])
ARGS = {"order_id": 0, "cents": 500, "currency": "EUR", "customer": "cus_123"}
RES = {"charge_id": "ch_0", "status": "succeeded", "amount": 500}
fence = EffectFence(FenceConfig(counters=sys.argv[3]))
reqs = [EffectRequest(f"c:{i}", "order:1", "charge", ARGS, "agent-2") for i in range(n)]
sink = [0]
if mode == "fresh":
    for r in reqs:
        adm = fence.prepare(r)
        sink[0] += 1
        fence.commit(adm.ticket, RES)
    assert sink[0] == n and fence.stats()["commits"] == n
elif mode == "replay":
    fence.commit(fence.prepare(reqs[0]).ticket, RES)
    for _ in range(n):
        assert not fence.prepare(EffectRequest("c:0", "order:1", "charge", ARGS, "agent-3")).fresh
elif mode == "replay-base":
    fence.commit(fence.prepare(reqs[0]).ticket, RES)
    for _ in range(n):
        EffectRequest("c:0", "order:1", "charge", ARGS, "agent-3")
"""

SCENARIOS = {
    # scenario -> (mode, baseline mode)
    "fresh prepare+commit": ("fresh", "base"),
    "replay (new request)": ("replay", "base"),
    "replay, fence only": ("replay", "replay-base"),
}


def count(mode: str, ops: int, counters: str) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-c",
            CHILD,
            mode,
            str(ops),
            counters,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--counters", choices=["atomic", "pure"], default="atomic")
    p.add_argument("--json", default="benchmarks/results/instructions.json")
    a = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    cache: dict[str, int] = {}

    def total(mode: str) -> int:
        if mode not in cache:
            cache[mode] = count(mode, a.ops, a.counters)
        return cache[mode]

    rows = {}
    for name, (mode, base) in SCENARIOS.items():
        per_op = (total(mode) - total(base)) / a.ops
        rows[name] = round(per_op)
        print(f"{name:<24} {per_op:>10,.0f} instructions/op  ({a.counters} table, {a.ops} ops)")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ops": a.ops, "counters": a.counters, "per_op": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
