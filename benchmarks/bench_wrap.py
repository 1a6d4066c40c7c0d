"""What ``effectfence wrap`` adds to a tool call, over real stdio, wrapped vs direct.

The child is the bundled demo server (``effectfence demo serve --delay 0``: no SDK, so the
child's own cost is small and the wrapper's shows). One minimal JSON-RPC client
(:class:`effectfence.wrap.client.StdioClient`) drives each server. Four processes, so no
scenario's state leaks into another's: direct and wrapped, for

- ``pass-through``: ``get_charges`` (``readOnlyHint``): relayed byte for byte;
- ``fenced``: ``charge_card`` on a new order each call: prepare, run in the child, commit
  (on the store under test: by default a SQLite file, the kind ``wrap`` uses by default);
- ``replay``: ``charge_card`` of an order already charged: answered from the ledger.

Latency: one caller, calls in sequence, rounds interleaved direct/wrapped so drift hits
both alike; the added latency is wrapped p50 (p99) minus direct p50 (p99). Throughput:
8 concurrent callers on one connection. Correctness is counted while measuring: every
fenced call ran exactly once (the child's ledger), every replay was marked.

    python benchmarks/bench_wrap.py                 # 5 rounds x 300 calls
    python benchmarks/bench_wrap.py --quick         # a smoke run
    python benchmarks/bench_wrap.py --store memory:

Targets: < 1 ms added at p50 for a fenced call on the default store's kind (SQLite),
< 0.3 ms for a pass-through call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from effectfence.wrap.client import StdioClient
from effectfence.wrap.proxy import META_KEY

CONCURRENCY = 8
TARGET_FENCED_MS = 1.0
TARGET_PASS_MS = 0.3
DIST_Q = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _start(argv: list[str]) -> StdioClient:
    client = await StdioClient.start(argv)
    await client.initialize("bench")
    return client


async def _timed(client: StdioClient, tool: str, args: dict[str, Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = await client.call_tool(tool, args)
    return time.perf_counter() - t0, result


async def run(rounds: int, calls: int, store: str, tmp: Path) -> dict[str, Any]:
    py = sys.executable
    ledger = {k: tmp / f"{k}.jsonl" for k in ("pd", "pw", "fd", "fw")}

    def demo(key: str) -> list[str]:
        return [
            py,
            "-m",
            "effectfence.wrap.demo",
            "serve",
            "--delay",
            "0",
            "--ledger",
            str(ledger[key]),
        ]

    def wrapped(key: str) -> list[str]:
        return [py, "-m", "effectfence", "wrap", "--store", store, "--", *demo(key)]

    pd, pw, fd, fw = await asyncio.gather(
        _start(demo("pd")), _start(wrapped("pw")), _start(demo("fd")), _start(wrapped("fw"))
    )
    keys = ("pass_d", "pass_w", "fenced_d", "fenced_w", "replay_w")
    lat: dict[str, list[float]] = {k: [] for k in keys}  # every call, all rounds pooled
    by_round: dict[str, list[list[float]]] = {k: [] for k in keys}
    rates: dict[str, list[float]] = {k: [] for k in keys[:4]}
    run_id = f"{time.time_ns():x}"
    n = 0
    total = max(CONCURRENCY, calls * 2 // CONCURRENCY * CONCURRENCY)

    async def storm(client: StdioClient, tool: str, make: Any) -> float:
        t0 = time.perf_counter()

        async def caller(c: int) -> None:
            for k in range(total // CONCURRENCY):
                await client.call_tool(tool, make(c, k))

        await asyncio.gather(*(caller(c) for c in range(CONCURRENCY)))
        return total / (time.perf_counter() - t0)

    try:
        for _ in range(20):  # warm up both paths (and the store's file)
            await _timed(pd, "get_charges", {})
            await _timed(pw, "get_charges", {})
        for r in range(rounds):
            for k in keys:
                by_round[k].append([])
            for i in range(calls):
                n += 1
                args = {"order_id": f"{run_id}-{r}-{i}", "cents": 100}
                # alternate which side goes first, so neither always follows the other
                pairs = [("pass_d", pd, "get_charges", {}), ("pass_w", pw, "get_charges", {})]
                pairs += [
                    ("fenced_d", fd, "charge_card", args),
                    ("fenced_w", fw, "charge_card", args),
                ]
                if i % 2:
                    pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
                for key, client, tool, a in pairs:
                    dt, res = await _timed(client, tool, a)
                    assert not res.get("isError"), res
                    lat[key].append(dt)
                    by_round[key][-1].append(dt)
                dt, res = await _timed(fw, "charge_card", args)  # the identical call again
                assert res["_meta"][META_KEY]["replayed"] is True, res
                lat["replay_w"].append(dt)
                by_round["replay_w"][-1].append(dt)
            # 8 concurrent callers, every round, direct and wrapped side by side (the order
            # alternating): one run each, after all rounds, was shown as if a median (review)
            order = [("pass", "get_charges"), ("fenced", "charge_card")]
            for kind, tool in order:
                sides = [(f"{kind}_d", pd if kind == "pass" else fd)]
                sides.append((f"{kind}_w", pw if kind == "pass" else fw))
                for key, client in sides if r % 2 == 0 else sides[::-1]:

                    def make(c: int, k: int, r: int = r, kind: str = kind) -> dict[str, Any]:
                        if kind == "pass":
                            return {}
                        return {"order_id": f"{run_id}-s{r}-{c}-{k}", "cents": 1}

                    rates[key].append(await storm(client, tool, make))
    finally:
        await asyncio.gather(*(c.close() for c in (pd, pw, fd, fw)))
    runs = sum(1 for _ in ledger["fw"].open()) if ledger["fw"].exists() else 0
    expect = n + rounds * total
    assert runs == expect, f"fenced calls ran {runs} times for {expect} distinct calls"

    def ms(key: str, q: float) -> float:
        return round(_pct(lat[key], q) * 1e3, 3)

    def added(name: str, q: float) -> dict[str, float]:
        """Wrapped minus direct, round by round (each pair measured side by side): median
        and min-max over the rounds, in ms."""
        per = [
            (_pct(w, q) - _pct(d, q)) * 1e3
            for d, w in zip(by_round[f"{name}_d"], by_round[f"{name}_w"], strict=True)
        ]
        return {
            "median": round(statistics.median(per), 3),
            "min": round(min(per), 3),
            "max": round(max(per), 3),
        }

    def rate(key: str) -> dict[str, float]:
        v = rates[key]
        return {"median": round(statistics.median(v)), "min": round(min(v)), "max": round(max(v))}

    out: dict[str, Any] = {
        "store": store.split(":", 1)[0],
        "calls_per_scenario": rounds * calls,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    for name in ("pass", "fenced"):
        d, w = f"{name}_d", f"{name}_w"
        p50, p99 = added(name, 0.5), added(name, 0.99)
        out[name] = {
            "direct_p50_ms": ms(d, 0.5),
            "wrapped_p50_ms": ms(w, 0.5),
            "added_p50_ms": p50["median"],
            "added_p50_ms_range": [p50["min"], p50["max"]],
            "direct_p99_ms": ms(d, 0.99),
            "wrapped_p99_ms": ms(w, 0.99),
            "added_p99_ms": p99["median"],
            "added_p99_ms_range": [p99["min"], p99["max"]],
            "direct_calls_per_s_8": rate(d),
            "wrapped_calls_per_s_8": rate(w),
        }
    out["replay"] = {"wrapped_p50_ms": ms("replay_w", 0.5), "wrapped_p99_ms": ms("replay_w", 0.99)}
    # quantiles (ms) of every latency, for the suite's distribution charts
    out["distribution_ms"] = {
        k: {f"p{q * 100:g}": _pct(v, q) * 1e3 for q in DIST_Q} for k, v in lat.items()
    }
    out["checks"] = {"fenced_runs": runs, "distinct_fenced_calls": expect, "replays": n}
    out["mean_ms"] = {k: round(statistics.fmean(v) * 1e3, 3) for k, v in lat.items()}
    out["targets"] = {"fenced_added_p50_ms": TARGET_FENCED_MS, "pass_added_p50_ms": TARGET_PASS_MS}
    out["targets_met"] = {
        "fenced_added_p50_under_1ms": out["fenced"]["added_p50_ms"] < TARGET_FENCED_MS,
        "pass_added_p50_under_0.3ms": out["pass"]["added_p50_ms"] < TARGET_PASS_MS,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="calls per round and scenario")
    parser.add_argument("--quick", action="store_true", help="1 round x 50 calls")
    parser.add_argument(
        "--store",
        help="the wrapper's store (default: a fresh SQLite file, the default store's kind)",
    )
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.calls = 1, 50
    with tempfile.TemporaryDirectory() as tmp:
        store = opts.store or f"sqlite:///{Path(tmp) / 'fence.db'}"
        report = asyncio.run(run(opts.rounds, opts.calls, store, Path(tmp)))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
