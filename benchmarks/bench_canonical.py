"""Benchmark canonical JSON against rfc8785 and json.dumps(sort_keys=True).

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_canonical.py [--rounds 15] [--number 20000]

Every round also checks that ``canonical_bytes`` equals ``rfc8785.dumps`` byte for byte,
so a speed-up can never come from a wrong answer. ``json.dumps`` is there as the floor
the stdlib gives (it is not RFC 8785: no ES6 numbers, code-point key order).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import rfc8785

from effectfence.canonical import _exact_bytes, _fast_ok, canonical_bytes

CASES: dict[str, Any] = {
    "small dict": {
        "intent": "pay-123",
        "amount": 1250,
        "currency": "EUR",
        "attempt": 2,
        "tool": "payments.charge",
    },
    "cert body": {
        "v": 1,
        "intent": "invoice-42:charge",
        "tool": "payments.charge",
        "payload_sha256": "9f" * 32,
        "args": {"customer": "cus_123", "amount": 1250, "currency": "EUR", "capture": True},
        "read_set": [["account:cus_123", 17], ["ledger:2024-06", 4]],
        "clock": {"store": "sqlite:main", "token": 42},
        "holder": "worker-7",
        "token": 42,
        "outcome": "committed",
        "committed_at_ms": 1717000000123,
    },
    "non-ASCII keys": {
        "größe": 3,
        "prix €": 1250,
        "名前": "テスト",
        "emoji 😀": True,
        "ascii": None,
    },
    "float-bearing": {
        "amount": 12.5,
        "rate": 0.0125,
        "limit": 1e21,
        "tiny": 1e-7,
        "count": 3,
    },
}

Impl = Callable[[Any], bytes | str]


def json_sorted(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


IMPLS: dict[str, Impl] = {
    "canonical_bytes": canonical_bytes,
    "exact path only": _exact_bytes,
    "rfc8785.dumps": rfc8785.dumps,
    "json.dumps(sort)": json_sorted,
}


def time_calls(fn: Impl, value: Any, number: int) -> float:
    """ns per call over ``number`` calls."""
    perf = time.perf_counter_ns
    start = perf()
    for _ in range(number):
        fn(value)
    return (perf() - start) / number


def measure(value: Any, number: int, rounds: int) -> dict[str, list[float]]:
    """Per-implementation ns/call for each round.

    Rounds are interleaved across implementations (round-robin) so that load from other
    processes on a shared machine lands on every column alike; GC is off while timing.
    """
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for _ in range(rounds):
        assert canonical_bytes(value) == rfc8785.dumps(value)
        for name, fn in IMPLS.items():
            gc.disable()
            try:
                times[name].append(time_calls(fn, value, number))
            finally:
                gc.enable()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()

    medians: dict[tuple[str, str], float] = {}
    header = f"{'case':<16} {'path':<5} " + " ".join(f"{name:>24}" for name in IMPLS)
    print(f"ns per call: median (min-max) over {args.rounds} rounds x {args.number} calls")
    print(header)
    print("-" * len(header))
    for case, value in CASES.items():
        cells = []
        per_impl = measure(value, args.number, args.rounds)
        for name, times in per_impl.items():
            med = statistics.median(times)
            medians[case, name] = med
            cells.append(f"{med:>8.0f} ({min(times):.0f}-{max(times):.0f})".rjust(24))
        path = "fast" if _fast_ok(value, 64) else "exact"
        print(f"{case:<16} {path:<5} " + " ".join(cells))

    print()
    print("ratios of medians (>1 means canonical_bytes is faster)")
    for case in CASES:
        ours = medians[case, "canonical_bytes"]
        print(
            f"{case:<16} rfc8785/ours {medians[case, 'rfc8785.dumps'] / ours:5.2f}x   "
            f"json.dumps/ours {medians[case, 'json.dumps(sort)'] / ours:5.2f}x   "
            f"exact/ours {medians[case, 'exact path only'] / ours:5.2f}x"
        )


if __name__ == "__main__":
    main()
