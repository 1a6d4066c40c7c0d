"""effectfence against peer idempotency libraries and a plain baseline, in one run.

Single thread, in memory, the same small payload for everyone
(args ``{"order_id": k, "cents": 500, "currency": "EUR", "customer": "cus_123"}``, result
``{"charge_id": "ch_k", "status": "succeeded", "amount": 500}``). Two scenarios:

- fresh:  a new key each time: guard + run the effect (a sink counter) + record the result
          (effectfence: ``prepare(EffectRequest(...))`` then ``commit(ticket, result)``, the
          certificate included);
- replay: a key that already completed (1,000 of them, set up untimed), asked again with a
          NEW request object and a NEW args dict each time, as duplicates arrive in real life;
          the recorded result comes back and the effect does not run again.

Contenders:

- effectfence, atomic and pure counter tables: ``EffectFence.prepare`` / ``commit``. Every
  attempt canonicalises ``{"args", "domain", "tool"}`` (RFC 8785) and checks it against the
  recorded fingerprint (the in-memory store keeps the canonical bytes themselves and compares
  them, rather than hashing them); a commit builds and hashes a certificate chained to the
  domain's previous one; a domain sequence counter, lease, TTL and statistics are kept.
- once-kernel (``once.Once.begin`` / ``complete``): RFC 8785 SHA-256 of the payload on every
  begin, compared to the stored hash (conflict on mismatch), a random fence token and a lease
  per claim; ``complete`` re-canonicalises the result to check its size. No certificate, no
  domain sequence.
- idempotency (``@idempotent(store=MemoryStore(), key=...)``), two rows. "intent key": the key
  is the caller's idempotency key, as for the others; it checks NO payload: a duplicate with a
  different payload silently gets the first result. "derived key": the package's default, the
  key is derived from the function's arguments on every call (so it reads the payload, but a
  different payload is a different key: it runs again instead of being refused). Its fresh
  path stores an in-progress record, runs, ``json.dumps`` the result to test it, then stores
  the completed record; a replay is a dict lookup. No lease, no fence token, no certificate.
- baseline (written here): a dict of key -> record under one ``threading.Lock``, a
  ``threading.Event`` per in-flight key for waiters, and a SHA-256 over
  ``json.dumps(payload, sort_keys=True)`` as the record's fingerprint (fresh: hash + store;
  replay: hash the new payload, compare, return the stored result). Not canonical JSON (no
  RFC 8785 number/unicode rules), no lease, no takeover, no TTL, no certificate.

Contenders are interleaved within each round (and their order rotates from round to round),
so drift on a shared, noisy machine hits all alike: read the ratios, not the absolute figures.
Correctness is checked while measuring: the sink must count exactly one execution per fresh
key and none on replays, and every replay must return the recorded result (for effectfence,
the committed certificate, same hash). A peer that is not installed is reported and skipped.

    python benchmarks/bench_peers.py                 # default: 7 rounds x 5,000 ops
    python benchmarks/bench_peers.py --quick         # a smoke run: 2 rounds x 1,000 ops
    pip install idempotency once-kernel              # the peers (not project dependencies)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

# effectfence is imported where it is used, so benchmarks/contenders.py can import this
# module's helpers in a peer's own virtual environment, where effectfence is not installed.
try:
    import idempotency as idem_pkg
except ImportError:  # pragma: no cover - depends on the environment
    idem_pkg = None  # type: ignore[assignment]
try:
    import once as once_pkg
except ImportError:  # pragma: no cover - depends on the environment
    once_pkg = None  # type: ignore[assignment]

REPLAY_KEYS = 1000
DOMAIN = "order:1"
BASE = "effectfence (atomic)"

# (ops, round) -> ops/s: a runner times its own loop (setup excluded) and asserts.
Runner = Callable[[int, int], float]


class Sink:
    """Where the effect lands: counts executions independently of the contender."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.n += 1


def payload(k: int) -> dict[str, Any]:
    """A new args dict each call: duplicates arrive as new objects."""
    return {"order_id": k, "cents": 500, "currency": "EUR", "customer": "cus_123"}


def expected(k: int) -> dict[str, Any]:
    return {"charge_id": f"ch_{k}", "status": "succeeded", "amount": 500}


def effect(sink: Sink, k: int) -> dict[str, Any]:
    """The side effect: one sink hit, and its result."""
    sink.hit()
    return {"charge_id": f"ch_{k}", "status": "succeeded", "amount": 500}


def drop_pg_schema(url: str, schema: str) -> None:
    """Drop a benchmark's PostgreSQL schema and everything in it."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def drop_redis_prefix(url: str, prefix: str) -> None:
    """Delete a benchmark's Redis keys (``{prefix}:*``, the store's hash tag)."""
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match="[{]" + prefix + "[}]:*", count=1000))
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i : i + 1000])
    client.close()


def check_fresh(name: str, sink: Sink, results: list[Any], n: int) -> None:
    assert sink.n == n, f"{name} fresh: {sink.n} executions for {n} fresh keys"
    assert len(results) == n and all(r == expected(j) for j, r in enumerate(results)), (
        f"{name} fresh: wrong results"
    )


def check_replay(
    name: str, sink: Sink, results: list[Any], n: int, keys: int = REPLAY_KEYS
) -> None:
    """``n`` replays of ``keys`` intents, each set up once: none ran again (the sink holds
    the setup's executions only), and each returned its recorded result."""
    assert sink.n == keys, f"{name} replay: {sink.n - keys} re-executions"
    assert len(results) == n and all(r == expected(j % keys) for j, r in enumerate(results)), (
        f"{name} replay: a replay did not return the recorded result"
    )


# -- effectfence --------------------------------------------------------------------------------


def effectfence_runners(counters: str) -> dict[str, Runner]:
    from effectfence import EffectFence, EffectRequest, FenceConfig

    name = f"effectfence ({counters})"

    def new_fence() -> EffectFence:
        return EffectFence(FenceConfig(counters=counters, lease_ttl=60.0, result_ttl=3600.0))

    def fresh(n: int, rnd: int) -> float:
        fence, sink = new_fence(), Sink()
        results: list[Any] = []
        append, prepare, commit = results.append, fence.prepare, fence.commit
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            adm = prepare(EffectRequest(f"charge:{rnd}:{j}", DOMAIN, "charge", payload(j), "a1"))
            if adm.fresh:
                result = effect(sink, j)
                commit(adm.ticket, result)
            else:
                result = adm.cert.result
            append(result)
        dt = time.perf_counter() - t0
        check_fresh(name, sink, results, n)
        assert fence.stats()["commits"] == n
        return n / dt

    def replay(n: int, rnd: int) -> float:
        fence, sink = new_fence(), Sink()
        hashes = []
        for k in range(REPLAY_KEYS):
            adm = fence.prepare(EffectRequest(f"charge:{k}", DOMAIN, "charge", payload(k), "a1"))
            assert adm.fresh
            hashes.append(fence.commit(adm.ticket, effect(sink, k)).hash)
        certs: list[Any] = []
        append, prepare = certs.append, fence.prepare
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            k = j % REPLAY_KEYS
            adm = prepare(EffectRequest(f"charge:{k}", DOMAIN, "charge", payload(k), "a2"))
            if adm.fresh:  # must never happen: counted by the sink check below
                effect(sink, k)
            append(adm.cert)
        dt = time.perf_counter() - t0
        check_replay(name, sink, [c.result for c in certs], n)
        assert all(c.hash == hashes[j % REPLAY_KEYS] for j, c in enumerate(certs))
        assert fence.stats()["prepare"]["replayed"] == n
        return n / dt

    return {"fresh": fresh, "replay": replay}


# -- once-kernel --------------------------------------------------------------------------------


def once_runners() -> dict[str, Runner]:
    name = "once-kernel"
    assert once_pkg is not None

    def new_once() -> Any:
        return once_pkg.Once(once_pkg.MemoryStore(), default_ttl_sec=3600.0, lease_sec=60.0)

    def fresh(n: int, rnd: int) -> float:
        kernel, sink = new_once(), Sink()
        results: list[Any] = []
        append, begin, complete = results.append, kernel.begin, kernel.complete
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            key = f"charge:{rnd}:{j}"
            out = begin(key, payload(j))
            if out.execute:
                result = effect(sink, j)
                complete(key, out.record.fence_token, result)
            else:
                result = out.record.result
            append(result)
        dt = time.perf_counter() - t0
        check_fresh(name, sink, results, n)
        return n / dt

    def replay(n: int, rnd: int) -> float:
        kernel, sink = new_once(), Sink()
        for k in range(REPLAY_KEYS):
            out = kernel.begin(f"charge:{k}", payload(k))
            assert out.execute
            kernel.complete(f"charge:{k}", out.record.fence_token, effect(sink, k))
        results: list[Any] = []
        append, begin = results.append, kernel.begin
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            k = j % REPLAY_KEYS
            out = begin(f"charge:{k}", payload(k))
            if out.execute:  # must never happen: counted by the sink check below
                effect(sink, k)
            append(out.record.result)
        dt = time.perf_counter() - t0
        check_replay(name, sink, results, n)
        return n / dt

    return {"fresh": fresh, "replay": replay}


# -- idempotency --------------------------------------------------------------------------------


def idempotency_runners(derived_key: bool) -> dict[str, Runner]:
    name = "idempotency (derived key)" if derived_key else "idempotency (intent key)"
    assert idem_pkg is not None

    def new_charge(sink: Sink) -> Callable[[str, dict[str, Any]], Any]:
        key = None if derived_key else (lambda intent, args: intent)

        @idem_pkg.idempotent(ttl=3600.0, store=idem_pkg.MemoryStore(), key=key)
        def charge(intent: str, args: dict[str, Any]) -> dict[str, Any]:
            return effect(sink, args["order_id"])

        return charge

    def fresh(n: int, rnd: int) -> float:
        sink = Sink()
        charge = new_charge(sink)
        results: list[Any] = []
        append = results.append
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            append(charge(f"charge:{rnd}:{j}", payload(j)))
        dt = time.perf_counter() - t0
        check_fresh(name, sink, results, n)
        return n / dt

    def replay(n: int, rnd: int) -> float:
        sink = Sink()
        charge = new_charge(sink)
        for k in range(REPLAY_KEYS):
            charge(f"charge:{k}", payload(k))
        assert sink.n == REPLAY_KEYS
        results: list[Any] = []
        append = results.append
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            k = j % REPLAY_KEYS
            append(charge(f"charge:{k}", payload(k)))
        dt = time.perf_counter() - t0
        check_replay(name, sink, results, n)
        return n / dt

    return {"fresh": fresh, "replay": replay}


# -- baseline -----------------------------------------------------------------------------------


class Conflict(Exception):
    """Same key, different payload."""


class InFlight(Exception):
    """The key's first execution has not completed yet."""


@dataclass(slots=True)
class BaselineRecord:
    fingerprint: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None


class Baseline:
    """Dict + lock + an Event per in-flight key + SHA-256 of sorted-key JSON."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, BaselineRecord] = {}

    def begin(self, key: str, args: dict[str, Any]) -> tuple[bool, BaselineRecord]:
        """(True, record) if the caller must run the effect; (False, record) on a replay."""
        fp = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
        with self.lock:
            rec = self.records.get(key)
            if rec is None:
                rec = self.records[key] = BaselineRecord(fp)
                return True, rec
        if rec.fingerprint != fp:
            raise Conflict(key)
        if not rec.done.is_set():
            raise InFlight(key)  # a waiter would rec.done.wait(timeout) here
        return False, rec

    def complete(self, rec: BaselineRecord, result: Any) -> None:
        with self.lock:
            rec.result = result
        rec.done.set()


def baseline_runners() -> dict[str, Runner]:
    name = "baseline (dict+lock+sha256)"

    def fresh(n: int, rnd: int) -> float:
        base, sink = Baseline(), Sink()
        results: list[Any] = []
        append, begin, complete = results.append, base.begin, base.complete
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            run, rec = begin(f"charge:{rnd}:{j}", payload(j))
            if run:
                result = effect(sink, j)
                complete(rec, result)
            else:
                result = rec.result
            append(result)
        dt = time.perf_counter() - t0
        check_fresh(name, sink, results, n)
        return n / dt

    def replay(n: int, rnd: int) -> float:
        base, sink = Baseline(), Sink()
        for k in range(REPLAY_KEYS):
            run, rec = base.begin(f"charge:{k}", payload(k))
            assert run
            base.complete(rec, effect(sink, k))
        results: list[Any] = []
        append, begin = results.append, base.begin
        gc.collect()
        t0 = time.perf_counter()
        for j in range(n):
            k = j % REPLAY_KEYS
            run, rec = begin(f"charge:{k}", payload(k))
            if run:  # must never happen: counted by the sink check below
                effect(sink, k)
            append(rec.result)
        dt = time.perf_counter() - t0
        check_replay(name, sink, results, n)
        return n / dt

    return {"fresh": fresh, "replay": replay}


# -- harness ------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    version: str
    notes: str
    runners: dict[str, Runner] | None  # None: not installed
    skipped: str = ""


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def contenders() -> list[Contender]:
    import effectfence
    from effectfence.counters import AtomicCounterTable

    ef = version_of("effectfence")
    if ef == "?":  # run from a source tree
        ef = str(getattr(effectfence, "__version__", "?"))
    tables = ["atomic", "pure"] if AtomicCounterTable is not None else ["pure"]
    out = [
        Contender(
            f"effectfence ({t})",
            ef,
            "RFC 8785 payload checked on every attempt; certificate chained per domain; "
            "domain seq, lease, TTL, stats",
            effectfence_runners(t),
        )
        for t in tables
    ]
    once_note = (
        "RFC 8785 SHA-256 payload hash checked on every begin; fence token + lease; "
        "no certificate, no domain seq"
    )
    if once_pkg is not None:
        out.append(Contender("once-kernel", version_of("once-kernel"), once_note, once_runners()))
    else:
        out.append(Contender("once-kernel", "-", once_note, None, "pip install once-kernel"))
    idem_notes = {
        False: "NO payload check: same key + other payload silently returns the first result; "
        "no lease/fence token, no certificate",
        True: "key derived from the arguments on every call: other payload = another key, "
        "so it runs again (never refused); no lease/fence token, no certificate",
    }
    for derived in (False, True):
        label = "derived key" if derived else "intent key"
        if idem_pkg is not None:
            out.append(
                Contender(
                    f"idempotency ({label})",
                    version_of("idempotency"),
                    idem_notes[derived],
                    idempotency_runners(derived),
                )
            )
        else:
            out.append(
                Contender(
                    f"idempotency ({label})",
                    "-",
                    idem_notes[derived],
                    None,
                    "pip install idempotency",
                )
            )
    out.append(
        Contender(
            "baseline (dict+lock+sha256)",
            "-",
            "SHA-256 of json.dumps(sort_keys=True) checked on replay; not canonical JSON; "
            "no lease/takeover/TTL/certificate",
            baseline_runners(),
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="2 rounds of 1,000 ops")
    p.add_argument("--json", default="benchmarks/results/peers.json")
    a = p.parse_args(argv)
    if a.quick:
        a.ops, a.rounds = 1000, 2
    if a.ops < REPLAY_KEYS:
        p.error(f"--ops must be at least {REPLAY_KEYS}")
    everyone = contenders()
    for c in everyone:
        if c.runners is None:
            print(f"{c.name}: not installed ({c.skipped}), skipped")
    live = [c for c in everyone if c.runners is not None]
    scenarios = ["fresh", "replay"]
    samples: dict[tuple[str, str], list[float]] = {(s, c.name): [] for s in scenarios for c in live}
    for rnd in range(a.rounds):
        order = live[rnd % len(live) :] + live[: rnd % len(live)]  # rotate: no fixed position
        for scenario in scenarios:
            for c in order:
                assert c.runners is not None
                samples[(scenario, c.name)].append(c.runners[scenario](a.ops, rnd))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    base = BASE if any(c.name == BASE for c in live) else live[0].name
    rows: list[dict[str, Any]] = []
    width = max(len(c.name) for c in everyone)
    print(
        f"\n{a.rounds} rounds x {a.ops:,} ops, single thread, in memory "
        f"(Python {platform.python_version()}); ratio = {base} / contender\n"
    )
    print(
        f"{'scenario':<8} {'contender':<{width}} {'ops/s median':>13} {'min-max':>19} {'ratio':>7}"
    )
    for scenario in scenarios:
        ref = statistics.median(samples[(scenario, base)])
        for c in everyone:
            if c.runners is None:
                print(f"{scenario:<8} {c.name:<{width}} not installed ({c.skipped})")
                rows.append({"scenario": scenario, "contender": c.name, "skipped": c.skipped})
                continue
            s = samples[(scenario, c.name)]
            med = statistics.median(s)
            ratio = ref / med
            rows.append(
                {
                    "scenario": scenario,
                    "contender": c.name,
                    "version": c.version,
                    "median": med,
                    "min": min(s),
                    "max": max(s),
                    "samples": s,
                    "ratio_base_over_contender": ratio,
                }
            )
            span = f"{min(s):,.0f}-{max(s):,.0f}"
            print(f"{scenario:<8} {c.name:<{width}} {med:>13,.0f} {span:>19} {ratio:>6.2f}x")
        print()
    print("notes:")
    for c in everyone:
        print(f"  {c.name} {c.version}: {c.notes}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "ops": a.ops,
                "rounds": a.rounds,
                "python": platform.python_version(),
                "base": base,
                "rows": rows,
                "notes": {c.name: {"version": c.version, "notes": c.notes} for c in everyone},
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
