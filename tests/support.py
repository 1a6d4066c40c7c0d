"""Test support shared by the suites: an injected clock and the registry of stores.

``STORES`` is the one registry the guarantee suites parametrize over: a store added to the
project adds itself here and joins every conformance, chaos and stateful test.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from effectfence import EffectFence, _accel
from effectfence.counters import AtomicCounterTable, new_table
from effectfence.protocol import IntentRecord
from effectfence.store.base import FenceStore, Step
from effectfence.store.cmemory import CMemoryStore
from effectfence.store.memory import MemoryStore


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _memory(backend: str) -> Callable[[FakeClock], FenceStore]:
    def make(clock: FakeClock) -> FenceStore:
        return MemoryStore(clock=clock, counters=new_table(backend))

    return make


#: name -> factory: a fresh, empty, isolated store on the test's clock. A store joins every
#: guarantee suite (test_store_contract, test_fence, test_chaos, test_stateful) by adding one.
STORES: dict[str, Callable[[FakeClock], FenceStore]] = {
    "memory-pure": _memory("pure"),
}
if AtomicCounterTable is not None:
    STORES["memory-atomic"] = _memory("atomic")
if AtomicCounterTable is not None and _accel.memstore is not None:
    # the default store of the compiled build: claim and complete in C
    STORES["memory-c"] = lambda clock: CMemoryStore(clock=clock, counters=new_table("atomic"))

#: name -> reopen(store, clock): another handle onto the same data as ``store``, opened as a
#: second process would. Only stores shared between processes have one.
REOPEN: dict[str, Callable[[FenceStore, FakeClock], FenceStore]] = {}

# -- SQLite: a new file per store, in one directory removed at exit --------------------------------
_SQLITE_DIR = tempfile.mkdtemp(prefix="effectfence-sqlite-")
atexit.register(shutil.rmtree, _SQLITE_DIR, True)
_sqlite_files = itertools.count()


def sqlite_path() -> str:
    """A path for a fresh SQLite store file nobody else uses."""
    return os.path.join(_SQLITE_DIR, f"fence-{os.getpid()}-{next(_sqlite_files)}.db")


def _sqlite(clock: FakeClock) -> FenceStore:
    from effectfence.store.sqlite import SQLiteStore

    return SQLiteStore(sqlite_path(), clock=clock)


def _sqlite_reopen(store: FenceStore, clock: FakeClock) -> FenceStore:
    from effectfence.store.sqlite import SQLiteStore

    assert isinstance(store, SQLiteStore)
    return SQLiteStore(store.path, clock=clock)


STORES["sqlite"] = _sqlite
REOPEN["sqlite"] = _sqlite_reopen


# -- server stores: PostgreSQL and Redis -------------------------------------------------------
# Found through EFFECTFENCE_PG_DSN / EFFECTFENCE_REDIS_URL. Each store gets its own schema / key
# prefix, dropped when the store that created it closes. Without a server the tests skip and
# say why; with EFFECTFENCE_REQUIRE_SERVICES=1 (CI) a missing server fails them.
PG_DSN = os.environ.get("EFFECTFENCE_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("EFFECTFENCE_REDIS_URL", "redis://127.0.0.1:6379/0")
REQUIRE_SERVICES = os.environ.get("EFFECTFENCE_REQUIRE_SERVICES") == "1"
_names = itertools.count()
_probed: dict[str, str | None] = {}


def unique_name(kind: str) -> str:
    """A schema / key prefix no other test (or process) uses; dropped when the process
    exits, should the test that made it not get there (an interrupted run, a failure)."""
    name = f"t_{kind}_{os.getpid()}_{next(_names)}_{os.urandom(3).hex()}"
    _made.append((kind, name))
    return name


_made: list[tuple[str, str]] = []


def _drop_what_was_made() -> None:
    """At exit: what :func:`unique_name` handed out is gone from the shared servers. A
    server that went away meanwhile has nothing left to drop."""
    schemas = [name for kind, name in _made if kind.startswith("p")]
    if schemas:
        with contextlib.suppress(Exception):
            import psycopg

            with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=3) as conn:
                conn.execute("SET lock_timeout = '2s'")  # a lock left held never hangs exit
                for name in schemas:
                    # each on its own: one schema that cannot go leaves the others to go
                    with contextlib.suppress(psycopg.Error):
                        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    for kind, name in _made:
        if kind.startswith("redis"):
            with contextlib.suppress(Exception):
                drop_redis_prefix(name)


atexit.register(_drop_what_was_made)


def _probe(kind: str) -> str | None:
    """None if the server answers, else why not (probed once per process)."""
    if kind not in _probed:
        try:
            if kind == "pg":
                import psycopg

                psycopg.connect(PG_DSN, connect_timeout=3).close()
            else:
                import redis

                redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
            _probed[kind] = None
        except Exception as exc:  # ImportError or no server: both mean "can't run here"
            _probed[kind] = f"{type(exc).__name__}: {exc}"
    return _probed[kind]


def need(kind: str) -> None:
    """Skip (or, with EFFECTFENCE_REQUIRE_SERVICES=1, fail) when the server is not there."""
    import pytest

    why = _probe(kind)
    if why is None:
        return
    where = PG_DSN if kind == "pg" else REDIS_URL
    msg = f"no {'PostgreSQL' if kind == 'pg' else 'Redis'} at {where} ({why})"
    if REQUIRE_SERVICES:
        pytest.fail(msg + "; EFFECTFENCE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
    pytest.skip(msg + "; set EFFECTFENCE_PG_DSN / EFFECTFENCE_REDIS_URL to run it")


def drop_pg_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def drop_redis_prefix(prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match="[{]" + prefix + "[}]:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


def _dropping(store: FenceStore, drop: Callable[[], None]) -> FenceStore:
    """The store, whose close() also removes what it created on the server."""
    close = store.close

    def close_and_drop() -> None:
        close()
        drop()

    store.close = close_and_drop  # type: ignore[method-assign]
    return store


_pg_pool: Any = None


def pg_pool() -> Any:
    """One connection pool for every PostgreSQL store of this test process (the stores differ
    by schema, which every statement names): suites that open dozens of stores stay within
    the server's max_connections. It also runs the stores on a pool the caller owns."""
    global _pg_pool
    if _pg_pool is None:
        from psycopg_pool import ConnectionPool

        _pg_pool = ConnectionPool(
            PG_DSN, min_size=1, max_size=12, kwargs={"autocommit": True}, open=True
        )
        atexit.register(_pg_pool.close)
    return _pg_pool


def _postgres(clock: FakeClock) -> FenceStore:
    need("pg")
    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pg")
    store = PostgresStore(pool=pg_pool(), schema=schema, clock=clock)
    return _dropping(store, lambda: drop_pg_schema(schema))


def _postgres_reopen(store: FenceStore, clock: FakeClock) -> FenceStore:
    from effectfence.store.postgres import PostgresStore

    assert isinstance(store, PostgresStore)
    return PostgresStore(PG_DSN, schema=store.schema, clock=clock)


STORES["postgres"] = _postgres
REOPEN["postgres"] = _postgres_reopen

FenceFactory = Callable[..., EffectFence]


T = TypeVar("T")


def race(n: int, fn: Callable[[int], T]) -> list[T | BaseException]:
    """Run ``fn(i)`` in ``n`` real OS threads released together by a Barrier.

    The threads are built and parked first, so the collision is forced, not hoped for.
    Returns each thread's result or the exception it raised, in thread order.
    """
    barrier = threading.Barrier(n)
    out: list[T | BaseException | None] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as exc:  # collected, asserted on by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in out if o is not None]


# -- forced interleavings (appended for the chaos / linearizability suites) -------------------


class HookedStore(FenceStore):
    """Any store, with one-shot hooks run just *before* a contract operation reaches it.

    A hook is the other party of a check-then-act race: the fence has observed the record and
    decided, and the hook changes the world before the store's conditional step runs. This
    pins the interleaving exactly, on every store, with no sleeps and no luck.
    """

    def __init__(self, inner: FenceStore) -> None:
        self.inner = inner
        self.name = inner.name
        self.counters_backend = inner.counters_backend
        self.hooks: dict[str, list[Callable[[], object]]] = {}

    def before(self, op: str, hook: Callable[[], object]) -> None:
        """Run ``hook()`` once, right before the next call of ``op`` reaches the store."""
        self.hooks.setdefault(op, []).append(hook)

    def _fire(self, op: str) -> None:
        pending = self.hooks.get(op)
        if pending:
            pending.pop(0)()  # popped first: a hook that calls ``op`` itself does not recurse

    def __getattr__(self, name: str) -> Any:  # anything the contract grows later
        return getattr(self.inner, name)

    def fingerprint_of(self, payload: bytes) -> bytes:
        return self.inner.fingerprint_of(payload)

    def now(self) -> float:
        return self.inner.now()

    def get(self, intent: str) -> IntentRecord | None:
        self._fire("get")
        return self.inner.get(intent)

    def claim(self, intent: str, **kw: Any) -> Step:
        self._fire("claim")
        return self.inner.claim(intent, **kw)

    def complete(self, intent: str, token: int, cert: Any, **kw: Any) -> Step:
        self._fire("complete")
        return self.inner.complete(intent, token, cert, **kw)

    def fail(self, intent: str, token: int, reason: str, **kw: Any) -> Step:
        self._fire("fail")
        return self.inner.fail(intent, token, reason, **kw)

    def release(self, intent: str, token: int) -> Step:
        self._fire("release")
        return self.inner.release(intent, token)

    def renew(self, intent: str, token: int, **kw: Any) -> Step:
        self._fire("renew")
        return self.inner.renew(intent, token, **kw)

    def clear(self, intent: str) -> IntentRecord | None:
        self._fire("clear")
        return self.inner.clear(intent)

    def clear_if(self, intent: str, **kw: Any) -> Step:
        self._fire("clear_if")
        return self.inner.clear_if(intent, **kw)

    def audit(self, **kw: Any) -> list[dict[str, Any]]:
        return self.inner.audit(**kw)

    def current(self, domain: str) -> int:
        return self.inner.current(domain)

    def evict_domain(self, domain: str) -> Step:
        self._fire("evict_domain")
        return self.inner.evict_domain(domain)

    def in_flight(self, domain: str) -> int:
        return self.inner.in_flight(domain)

    def sweep(self, limit: int | None = None) -> int:
        self._fire("sweep")
        return self.inner.sweep(limit)

    def size(self) -> dict[str, int]:
        return self.inner.size()

    def close(self) -> None:
        self.inner.close()


class Tick:
    """A shared monotonic counter for invoke/response timestamps (``next`` is one GIL step)."""

    def __init__(self) -> None:
        self._c = itertools.count()

    def __call__(self) -> int:
        return next(self._c)


@contextlib.contextmanager
def preemptive(interval: float = 1e-6) -> Iterator[None]:
    """Make CPython switch threads every ``interval`` seconds, so races really interleave.

    At the default 5 ms switch interval a thread almost never loses the GIL inside a
    microsecond-long fence call, and "concurrent" threads would run nearly one after another.
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _redis(clock: FakeClock) -> FenceStore:
    need("redis")
    from effectfence.store.redis import RedisStore

    prefix = unique_name("redis")
    store = RedisStore(REDIS_URL, prefix=prefix, clock=clock)
    return _dropping(store, lambda: drop_redis_prefix(prefix))


def _redis_reopen(store: FenceStore, clock: FakeClock) -> FenceStore:
    from effectfence.store.redis import RedisStore

    assert isinstance(store, RedisStore)
    return RedisStore(REDIS_URL, prefix=store.prefix, clock=clock)


STORES["redis"] = _redis
REOPEN["redis"] = _redis_reopen
