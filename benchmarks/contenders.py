"""The same work for every contender, effectfence and its peers, each in its own interpreter.

This module imports nothing but the standard library and ``bench_peers``' helpers (the payload,
the expected result, the sink and its checks, which import no effectfence either), so it runs
unchanged in a peer's own virtual environment: ``benchmarks/worker.py`` loads it there and the
suite asks it, over JSON lines, to time one round. A contender is a *guard*: ``call(key, args,
run)`` runs ``run()`` (the effect: one sink hit) only if this key has not run, and returns the
recorded result otherwise; a duplicate that finds the key in flight raises :class:`Busy`.

Work, identical for everyone (single thread unless said):

- ``fresh``: a new key each call, through the full guard (claim, run the effect, record).
- ``replay``: keys that completed (1,000 of them, set up untimed), asked again with a new args
  dict each time; the recorded result must come back and the effect must not run.
- ``storm``: 1,000 attempts at one key (40 waves x 25 new threads behind a barrier, the storm
  of ``effectfence storm``); the effect must run exactly once, counted at the sink.

Correctness is checked in every round: executions counted at the sink, every result equal to
the recorded one, and for effectfence every replayed certificate equal to the committed one.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import (
    REPLAY_KEYS,
    Sink,
    check_fresh,
    check_replay,
    drop_pg_schema,
    drop_redis_prefix,
    effect,
    expected,
    payload,
)

DOMAIN = "order:1"
STORM_WAVES, STORM_RACERS = 40, 25


class Busy(Exception):
    """The key is in flight with another caller: not run, not replayed (refused)."""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


# -- guards -------------------------------------------------------------------------------------


class Guard:
    """One contender on one store. ``call`` is the full guard; ``close`` frees the store."""

    version = "?"

    def call(self, key: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to free by default."""


class EffectfenceGuard(Guard):
    """``EffectFence.prepare`` / ``commit``; replays are checked against the committed hash."""

    def __init__(self, url: str) -> None:
        from effectfence import EffectFence, FenceConfig, __version__
        from effectfence.errors import IntentInFlight

        self.version = __version__
        self.in_flight = IntentInFlight
        cfg = FenceConfig(lease_ttl=60.0, result_ttl=3600.0)
        self.cleanup: Callable[[], None] = lambda: None
        if url == "memory:":
            self.fence = EffectFence(cfg)
        else:
            # a schema / key prefix of its own, dropped at close: the shared servers keep
            # nothing of a run (the default names are a user's, not a benchmark's)
            name = f"bench_ef_{os.getpid()}x{time.monotonic_ns() % 10**9}"
            if url.startswith("postgresql"):
                sep = "&" if "?" in url else "?"
                self.fence = EffectFence.from_url(f"{url}{sep}schema={name}", cfg)
                self.cleanup = lambda: drop_pg_schema(url, name)
            elif url.startswith("redis"):
                sep = "&" if "?" in url else "?"
                self.fence = EffectFence.from_url(f"{url}{sep}prefix={name}", cfg)
                self.cleanup = lambda: drop_redis_prefix(url, name)
            else:  # a SQLite file: the suite's temporary directory is removed with it
                self.fence = EffectFence.from_url(url, cfg)
        self.hashes: dict[str, str] = {}

    def call(self, key: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        from effectfence import EffectRequest

        try:
            adm = self.fence.prepare(EffectRequest(key, DOMAIN, "charge", args, "bench"))
        except self.in_flight as exc:
            raise Busy(key) from exc
        if adm.fresh:
            result = run()
            self.hashes[key] = self.fence.commit(adm.ticket, result).hash
            return result
        cert = adm.cert
        if key in self.hashes and cert.hash != self.hashes[key]:
            raise AssertionError(f"{key}: a replay returned another certificate")
        return cert.result

    def close(self) -> None:
        self.fence.close()
        self.cleanup()


class OnceGuard(Guard):
    """once-kernel: ``Once.begin`` / ``complete`` on its memory, SQLite or PostgreSQL store."""

    def __init__(self, url: str) -> None:
        import once

        self.version = _version("once-kernel")
        self.busy = once.InProgressError if hasattr(once, "InProgressError") else None
        self.cleanup: Callable[[], None] = lambda: None
        if url == "memory:":
            store: Any = once.MemoryStore()
        elif url.startswith("sqlite:"):
            from once.sqlite import SqliteStore

            store = SqliteStore("/" + url.removeprefix("sqlite:///").lstrip("/"))
        else:
            from once.pg import PostgresStore

            table = f"once_bench_{os.getpid()}_{time.monotonic_ns() % 10**9}"
            store = PostgresStore(url, table=table, max_size=8)

            def drop() -> None:
                with store._pool.connection() as conn:
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
                store._pool.close()

            self.cleanup = drop
        self.kernel = once.Once(store, default_ttl_sec=3600.0, lease_sec=60.0)

    def call(self, key: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        from once.kernel import InProgressError

        try:
            out = self.kernel.begin(key, args)
        except InProgressError as exc:
            raise Busy(key) from exc
        if out.execute:
            result = run()
            self.kernel.complete(key, out.record.fence_token, result)
            return result
        return out.record.result

    def close(self) -> None:
        self.cleanup()


class IdempotencyGuard(Guard):
    """idempotency: ``@idempotent(store=MemoryStore(), key=intent)``; a decorator, so the
    guarded function is made once per key set (the key function returns the intent)."""

    def __init__(self, url: str) -> None:
        import idempotency

        self.version = _version("idempotency")
        self.runs: dict[str, Callable[[], Any]] = {}

        @idempotency.idempotent(
            ttl=3600.0, store=idempotency.MemoryStore(), key=lambda key, args: key
        )
        def guarded(key: str, args: dict[str, Any]) -> Any:
            return self.runs[key]()

        self.guarded = guarded

    def call(self, key: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        self.runs[key] = run
        try:
            return self.guarded(key, args)
        except Exception as exc:  # its LockTimeoutError after 10 s of a live holder
            if type(exc).__name__ in ("LockTimeoutError", "DuplicateExecutionError"):
                raise Busy(key) from exc
            raise


class PowertoolsGuard(Guard):
    """AWS Lambda Powertools' ``idempotent_function``, keyed by the intent, on its Redis layer
    or an in-memory layer written on its public ``BasePersistenceLayer``; payload validation
    (``payload_validation_jmespath="args"``, MD5 of sorted-key JSON) on in memory only."""

    def __init__(self, url: str) -> None:
        import warnings

        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.exceptions import (
            IdempotencyAlreadyInProgressError,
        )

        # It warns on every call that no Lambda context gives it a deadline: not ours to time.
        warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
        self.version = _version("aws-lambda-powertools")
        self.busy = IdempotencyAlreadyInProgressError
        self.cleanup: Callable[[], None] = lambda: None
        if url == "memory:":
            layer: Any = _powertools_memory_layer()
        else:
            import redis
            from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
                RedisCachePersistenceLayer,
            )

            client = redis.Redis.from_url(url)
            layer = RedisCachePersistenceLayer(client=client)
            prefix = f"bench{os.getpid()}x{time.monotonic_ns() % 10**9}"
            self.prefix = prefix

            def drop() -> None:
                for k in client.scan_iter(match=f"{prefix}*", count=1000):
                    client.delete(k)
                client.close()

            self.cleanup = drop
        # Payload validation on, except on Redis: there, 3.37.0's completed record drops the
        # validation hash (RedisCachePersistenceLayer._update_record writes data, status and
        # expiry only), so with it on every replay is refused IdempotencyValidationError.
        config = IdempotencyConfig(
            event_key_jmespath="intent",
            payload_validation_jmespath="args" if url == "memory:" else None,
            expires_after_seconds=3600,
        )
        self.runs: dict[str, Callable[[], Any]] = {}
        prefix = getattr(self, "prefix", None)

        @idempotent_function(
            data_keyword_argument="request",
            persistence_store=layer,
            config=config,
            key_prefix=prefix,
        )
        def guarded(request: dict[str, Any]) -> Any:
            return self.runs[request["intent"]]()

        self.guarded = guarded

    def call(self, key: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        self.runs[key] = run
        try:
            return self.guarded(request={"intent": key, "args": args})
        except self.busy as exc:
            raise Busy(key) from exc

    def close(self) -> None:
        self.cleanup()


def _powertools_memory_layer() -> Any:
    """An in-memory persistence layer on Powertools' public base class: a dict under a lock,
    put-if-absent (or expired) for the in-progress record, as its DynamoDB layer does."""
    import datetime as dt

    from aws_lambda_powertools.utilities.idempotency import BasePersistenceLayer
    from aws_lambda_powertools.utilities.idempotency.exceptions import (
        IdempotencyItemAlreadyExistsError,
        IdempotencyItemNotFoundError,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.datarecord import DataRecord

    class MemoryPersistenceLayer(BasePersistenceLayer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()
            self.items: dict[str, DataRecord] = {}

        def _get_record(self, idempotency_key: str) -> DataRecord:
            rec = self.items.get(idempotency_key)
            if rec is None:
                raise IdempotencyItemNotFoundError
            return rec

        def _put_record(self, data_record: DataRecord) -> None:
            now = int(dt.datetime.now().timestamp())
            with self.lock:
                old = self.items.get(data_record.idempotency_key)
                if old is not None and (old.expiry_timestamp or 0) > now:
                    raise IdempotencyItemAlreadyExistsError(old_data_record=old)
                self.items[data_record.idempotency_key] = data_record

        def _update_record(self, data_record: DataRecord) -> None:
            with self.lock:
                self.items[data_record.idempotency_key] = data_record

        def _delete_record(self, data_record: DataRecord) -> None:
            with self.lock:
                self.items.pop(data_record.idempotency_key, None)

    return MemoryPersistenceLayer()


GUARDS: dict[str, Callable[[str], Guard]] = {
    "effectfence": EffectfenceGuard,
    "once-kernel": OnceGuard,
    "idempotency": IdempotencyGuard,
    "aws-lambda-powertools": PowertoolsGuard,
}


# -- the work, timed (called by the worker: JSON in, JSON out) -----------------------------------


def _fresh_url(url: str, tag: str) -> str:
    """A new SQLite file per round, so no round reads another's records."""
    if url.startswith("sqlite:///"):
        path, _, query = url.removeprefix("sqlite:///").partition("?")
        base, dot, ext = path.rpartition(".")
        path = f"{base}-{tag}.{ext}" if dot else f"{path}-{tag}"
        return "sqlite:///" + path + (f"?{query}" if query else "")
    return url


def _fresh(guard: Guard, contender: str, url: str, n: int, rnd: int) -> dict[str, Any]:
    sink, results = Sink(), []
    append, call = results.append, guard.call
    tag = f"fresh:{os.getpid()}:{rnd}:{time.monotonic_ns()}"
    gc.collect()
    t0 = time.perf_counter()
    for j in range(n):
        append(call(f"{tag}:{j}", payload(j), lambda j=j: effect(sink, j)))
    dt = time.perf_counter() - t0
    check_fresh(contender, sink, results, n)
    return {"ops_s": n / dt, "executions": sink.n, "version": guard.version}


def _replay(guard: Guard, contender: str, url: str, n: int, rnd: int) -> dict[str, Any]:
    sink = Sink()
    tag = f"replay:{os.getpid()}:{rnd}:{time.monotonic_ns()}"
    for k in range(REPLAY_KEYS):
        guard.call(f"{tag}:{k}", payload(k), lambda k=k: effect(sink, k))
    results: list[Any] = []
    append, call = results.append, guard.call
    gc.collect()
    t0 = time.perf_counter()
    for j in range(n):
        k = j % REPLAY_KEYS
        append(call(f"{tag}:{k}", payload(k), lambda k=k: effect(sink, k)))
    dt = time.perf_counter() - t0
    check_replay(contender, sink, results, n)
    return {"ops_s": n / dt, "re_executions": sink.n - REPLAY_KEYS, "version": guard.version}


def _replay_other(guard: Guard, contender: str, url: str, n: int, rnd: int) -> dict[str, Any]:
    """Replays of ``n`` intents another client committed, each once: the reader's caches
    start empty, so every replay reads the store. Timed on the writer, every SQLite replay
    was a hit in the store's in-process cache of its own writes, which a peer without one
    cannot match (found by review); a duplicate from another process meets no such cache.
    A file store only: a server store's guard has a namespace of its own."""
    if not url.startswith("sqlite:"):
        raise ValueError("replay_other measures a file store shared by two clients")
    sink = Sink()
    tag = f"other:{os.getpid()}:{rnd}:{time.monotonic_ns()}"
    for k in range(n):
        guard.call(f"{tag}:{k}", payload(k), lambda k=k: effect(sink, k))
    reader = GUARDS[contender](url)
    if isinstance(guard, EffectfenceGuard) and isinstance(reader, EffectfenceGuard):
        reader.hashes = dict(guard.hashes)  # what each replay must carry
    try:
        results: list[Any] = []
        append, call = results.append, reader.call
        gc.collect()
        t0 = time.perf_counter()
        for k in range(n):
            append(call(f"{tag}:{k}", payload(k), lambda k=k: effect(sink, k)))
        dt = time.perf_counter() - t0
    finally:
        reader.close()
    check_replay(contender, sink, results, n, keys=n)
    return {"ops_s": n / dt, "re_executions": sink.n - n, "version": guard.version}


def _storm(
    guard: Guard,
    contender: str,
    url: str,
    rnd: int,
    waves: int = STORM_WAVES,
    racers: int = STORM_RACERS,
) -> dict[str, Any]:
    """1,000 attempts at one key in waves of new threads; the effect must run once."""
    sink = Sink()
    key = f"storm:{os.getpid()}:{rnd}:{time.monotonic_ns()}"
    lock = threading.Lock()
    spent: list[int] = []
    outcome = {"replays": 0, "refused": 0, "wrong": 0, "errors": 0}
    now = time.perf_counter_ns

    def attempt(w: int, i: int) -> None:
        t0 = now()
        try:
            result = guard.call(key, payload(777), lambda: effect(sink, 777))
        except Busy:
            with lock:
                outcome["refused"] += 1
            spent.append(now() - t0)
            return
        except Exception:
            with lock:
                outcome["errors"] += 1
            raise
        spent.append(now() - t0)
        with lock:
            outcome["wrong"] += result != expected(777)

    start = time.perf_counter()
    for w in range(waves):
        barrier = threading.Barrier(racers)

        def racer(i: int, w: int = w, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            attempt(w, i)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - start
    attempts = len(spent)
    outcome["replays"] = attempts - outcome["refused"] - sink.n
    ok = sink.n == 1 and not outcome["wrong"] and not outcome["errors"]
    assert ok, f"{contender} storm on {url}: {sink.n} executions, {outcome}"
    return {
        "attempts": attempts,
        "executions": sink.n,
        **outcome,
        "guard_ms": sum(spent) / 1e6,
        "elapsed_ms": elapsed * 1e3,
        "version": guard.version,
    }


def _with_guard(work: Callable[..., dict[str, Any]], tag: str) -> Callable[..., dict[str, Any]]:
    def run(contender: str, url: str, rnd: int, **kw: Any) -> dict[str, Any]:
        own = _fresh_url(url, f"{tag}{rnd}")
        guard = GUARDS[contender](own)
        try:
            return work(guard, contender, own, rnd=rnd, **kw)
        finally:
            guard.close()  # a failed check must not leave keys or tables behind

    return run


fresh = _with_guard(_fresh, "f")
replay = _with_guard(_replay, "r")
replay_other = _with_guard(_replay_other, "o")
storm = _with_guard(_storm, "s")
