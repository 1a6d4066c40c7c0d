"""Stores side by side: fresh prepare+commit and replay per second, 1 client / 8 threads / 4
processes, with SQLite's own physical limit measured in the same run.

Rows:

- ``memory``: the in-process store (processes: n/a, it is not shared);
- ``sqlite FULL`` / ``sqlite NORMAL``: :class:`effectfence.store.sqlite.SQLiteStore`;
- ``raw sqlite FULL/NORMAL``: the physical limit, hand-written: a claim and a complete as two
  ``BEGIN IMMEDIATE`` transactions on a minimal table (fresh), one primary-key SELECT (replay);
- ``raw postgresql`` / ``raw redis`` (with ``--store``): the same floor on the server, one
  statement (or command) per step;
- ``floor sqlite FULL/NORMAL (contract)``, ``floor postgresql (contract)``: the least the
  contract's steps must write (slot, domain seq, token, record, head, certificate),
  hand-written on the store's indexes (:class:`FloorSQLiteClient`): how much of the gap to
  the limit is the contract's, how much the store's;
- ``once-kernel (sqlite NORMAL)``: ``once.Once`` on its ``SqliteStore`` (WAL, NORMAL is
  hard-wired), if ``pip install once-kernel`` is available (reported when missing);
- ``--store URL`` (repeatable): any other store, e.g. postgresql://, redis://.

Every fresh execution appends one line to a sink file opened O_APPEND (checked: exactly one
per fresh op, none on replays); every replay is checked against the committed hash (or the
recorded result, for peers). Figures: median over rounds, with min-max.

    python benchmarks/bench_stores.py                  # 3 rounds
    python benchmarks/bench_stores.py --quick          # 1 round, fewer ops
    python benchmarks/bench_stores.py --store redis://localhost:6379/0
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import secrets
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    import once as once_pkg
except ImportError:
    once_pkg = None

MODES = ("1 client", "8 threads", "4 processes")
THREADS = 8
PROCS = 4
REPLAY_KEYS = 1000
_DEVNULL = os.open(os.devnull, os.O_WRONLY)  # setup's executions are not measured


def payload(k: int) -> dict[str, Any]:
    return {"order_id": k, "cents": 500, "currency": "EUR", "customer": "cus_123"}


def fire(sink_fd: int, key: str) -> None:
    os.write(sink_fd, (key + "\n").encode())


# -- clients: one per (contender, process); ops are called from any of its threads ----------------


class FenceClient:
    def __init__(self, url: str) -> None:
        from effectfence import EffectFence

        self.fence = EffectFence.from_url(url)

    def fresh(self, key: str, k: int, sink: int) -> None:
        from effectfence import EffectRequest

        adm = self.fence.prepare(EffectRequest(key, f"acct:{k % 64}", "charge", payload(k), "b"))
        assert adm.fresh, key
        fire(sink, key)
        self.fence.commit(adm.ticket, {"charge_id": f"ch_{k}", "status": "succeeded"})

    def setup(self, key: str, k: int) -> str:
        from effectfence import EffectRequest

        adm = self.fence.prepare(EffectRequest(key, f"acct:{k % 64}", "charge", payload(k), "b"))
        return self.fence.commit(adm.ticket, {"charge_id": f"ch_{k}"}).hash

    def replay(self, key: str, k: int, expect: str) -> None:
        from effectfence import EffectRequest

        adm = self.fence.prepare(EffectRequest(key, f"acct:{k % 64}", "charge", payload(k), "b"))
        assert not adm.fresh and adm.cert.hash == expect, key

    def close(self) -> None:
        self.fence.close()


class RawClient:
    """The floor under any SQLite store: the least a claim+complete and a read can cost."""

    def __init__(self, url: str) -> None:
        self.path, _, q = url.removeprefix("sqlite:///").partition("?")
        self.path = "/" + self.path.lstrip("/")
        self.sync = "NORMAL" if "synchronous=normal" in q else "FULL"
        self.local = threading.local()
        self.conns: list[sqlite3.Connection] = []
        c = self.conn()
        c.execute(
            "CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, state TEXT, token INTEGER, r BLOB)"
        )

    def conn(self) -> sqlite3.Connection:
        c: sqlite3.Connection | None = getattr(self.local, "c", None)
        if c is None:
            c = sqlite3.connect(
                self.path, isolation_level=None, timeout=30, check_same_thread=False
            )
            c.execute("PRAGMA journal_mode=WAL")
            c.execute(f"PRAGMA synchronous={self.sync}")
            self.local.c = c
            self.conns.append(c)
        return c

    def fresh(self, key: str, k: int, sink: int) -> None:
        c = self.conn()
        c.execute("BEGIN IMMEDIATE")
        ok = c.execute(
            "INSERT INTO t (k, state, token) VALUES (?, 'in_flight', ?) ON CONFLICT DO NOTHING",
            (key, k),
        ).rowcount
        c.execute("COMMIT")
        assert ok == 1
        fire(sink, key)
        c.execute("BEGIN IMMEDIATE")
        c.execute("UPDATE t SET state = 'done', r = ? WHERE k = ? AND token = ?", (b"r", key, k))
        c.execute("COMMIT")

    def setup(self, key: str, k: int) -> str:
        self.fresh(key, k, _DEVNULL)
        return "r"

    def replay(self, key: str, k: int, expect: str) -> None:
        row = self.conn().execute("SELECT r FROM t WHERE k = ?", (key,)).fetchone()
        assert row[0] == b"r"

    def close(self) -> None:
        for c in self.conns:
            c.close()


def _namespace(url: str, option: str) -> tuple[str, str]:
    """(the URL without ``option``, its value): the schema or key prefix of a raw row."""
    base, _, query = url.partition("?")
    params = [p for p in query.split("&") if p]
    name = next(p.split("=", 1)[1] for p in params if p.startswith(option + "="))
    rest = [p for p in params if not p.startswith(option + "=")]
    return base + ("?" + "&".join(rest) if rest else ""), name


class RawPostgresClient:
    """PostgreSQL's floor, hand-written: a one-statement claim (INSERT ... ON CONFLICT DO
    NOTHING) and a one-statement compare-by-token complete (UPDATE), each its own fsynced
    autocommit transaction, and one primary-key SELECT; one connection per thread."""

    def __init__(self, url: str) -> None:
        self.dsn, schema = _namespace(url, "schema")
        self.table = f'"{schema}".t'
        self.local = threading.local()
        self.conns: list[Any] = []
        c = self.conn()
        c.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        c.execute(
            f"CREATE TABLE IF NOT EXISTS {self.table} "
            "(k text PRIMARY KEY, state text, token bigint, r bytea)"
        )

    def conn(self) -> Any:
        c = getattr(self.local, "c", None)
        if c is None:
            import psycopg

            c = self.local.c = psycopg.connect(self.dsn, autocommit=True)
            self.conns.append(c)
        return c

    def fresh(self, key: str, k: int, sink: int) -> None:
        c = self.conn()
        ok = c.execute(
            f"INSERT INTO {self.table} (k, state, token) VALUES (%s, 'in_flight', %s) "
            "ON CONFLICT DO NOTHING",
            (key, k),
        ).rowcount
        assert ok == 1
        fire(sink, key)
        done = c.execute(
            f"UPDATE {self.table} SET state = 'done', r = %s WHERE k = %s AND token = %s",
            (b"r", key, k),
        ).rowcount
        assert done == 1

    def setup(self, key: str, k: int) -> str:
        self.fresh(key, k, _DEVNULL)
        return "r"

    def replay(self, key: str, k: int, expect: str) -> None:
        row = self.conn().execute(f"SELECT r FROM {self.table} WHERE k = %s", (key,)).fetchone()
        assert row is not None and row[0] == b"r"

    def close(self) -> None:
        for c in self.conns:
            c.close()


class RawRedisClient:
    """Redis's floor, hand-written: a claim (SET NX), a compare-by-token complete (a
    three-line Lua script) and one GET, on the same server settings as the store's row."""

    _CAS = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then "
        "return redis.call('SET', KEYS[1], ARGV[2]) end return false"
    )

    def __init__(self, url: str) -> None:
        import redis

        base, prefix = _namespace(url, "prefix")
        self.r = redis.Redis.from_url(base)
        self.p = "{" + prefix + "}:"  # the store's key form, so drop_namespaces finds them
        self.cas = self.r.register_script(self._CAS)

    def fresh(self, key: str, k: int, sink: int) -> None:
        assert self.r.set(self.p + key, f"t{k}", nx=True)
        fire(sink, key)
        assert self.cas(keys=[self.p + key], args=[f"t{k}", "done:r"])

    def setup(self, key: str, k: int) -> str:
        self.fresh(key, k, _DEVNULL)
        return "r"

    def replay(self, key: str, k: int, expect: str) -> None:
        assert self.r.get(self.p + key) == b"done:r"

    def close(self) -> None:
        self.r.close()


# the contract's floor: what a store must write for one attempt, hand-written, no Python of
# ours around it. A certificate of about the size the fence's rows carry.
_FLOOR_CERT = (b'{"agent":"b","args":{"cents":500,"currency":"EUR","customer":"cus_123",'
               b'"order_id":0},"domain":"acct:0","format":"effectfence.cert/1","hash":"'
               + b"0" * 64 + b'","intent":"charge:0","parent":"' + b"0" * 64
               + b'","read_set":[],"result":{"charge_id":"ch_0","status":"succeeded"},'
               b'"seq":1,"tool":"charge","vector_clock":{"b":1}}')  # fmt: skip

_FLOOR_SQLITE = """
CREATE TABLE IF NOT EXISTS fence (id INTEGER PRIMARY KEY, token INTEGER NOT NULL,
    clock_last REAL NOT NULL);
INSERT OR IGNORE INTO fence VALUES (0, 0, 0);
CREATE TABLE IF NOT EXISTS intents (intent TEXT PRIMARY KEY, state TEXT NOT NULL,
    token INTEGER NOT NULL, fingerprint BLOB NOT NULL, domain TEXT NOT NULL,
    agent TEXT NOT NULL, lease_until REAL NOT NULL, cert BLOB, until REAL NOT NULL,
    seq INTEGER NOT NULL, reclaim_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS intents_reclaim ON intents (reclaim_at);
CREATE INDEX IF NOT EXISTS intents_in_flight ON intents (domain) WHERE state = 'in_flight';
CREATE TABLE IF NOT EXISTS domains (domain TEXT PRIMARY KEY, seq INTEGER NOT NULL,
    head TEXT, clock TEXT);
CREATE TABLE IF NOT EXISTS certs (domain TEXT NOT NULL, seq INTEGER NOT NULL,
    hash TEXT NOT NULL, cert BLOB NOT NULL, committed_at REAL NOT NULL,
    PRIMARY KEY (domain, seq));
"""


class FloorSQLiteClient(RawClient):
    """The least SQLite can write for the contract (not a store: no read cache, no checks
    beyond the ones a step must make): a claim that takes the slot, reserves the domain's
    seq and draws a token from one persisted counter; a compare-by-token complete that
    records the result, moves the domain's head and appends the certificate to the trail;
    each a ``BEGIN IMMEDIATE`` transaction, on the same indexes the store keeps. A replay
    reads the record and the clock in one statement. Measured beside the store and the raw
    limit, it shows how much of the gap is the contract's writes and how much the store's."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.conn().executescript(_FLOOR_SQLITE)

    def fresh(self, key: str, k: int, sink: int) -> None:
        c, now, domain = self.conn(), time.time(), f"acct:{k % 64}"
        c.execute("BEGIN IMMEDIATE")
        seq = c.execute(
            "INSERT INTO domains (domain, seq) VALUES (?, 1) ON CONFLICT (domain) "
            "DO UPDATE SET seq = seq + 1 RETURNING seq",
            (domain,),
        ).fetchall()[0][0]
        token = c.execute(
            "UPDATE fence SET token = token + 1, clock_last = ? WHERE id = 0 RETURNING token",
            (now,),
        ).fetchall()[0][0]
        took = c.execute(
            "INSERT INTO intents VALUES (?, 'in_flight', ?, ?, ?, 'b', ?, NULL, 0, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (key, token, b"f" * 32, domain, now + 30, seq, now + 60),
        ).rowcount
        c.execute("COMMIT")
        assert took == 1
        fire(sink, key)
        c.execute("BEGIN IMMEDIATE")
        done = c.execute(
            "UPDATE intents SET state = 'done', lease_until = 0, cert = ?, until = ?, "
            "reclaim_at = ? WHERE intent = ? AND token = ? AND state = 'in_flight'",
            (_FLOOR_CERT, now + 3600, now + 7200, key, token),
        ).rowcount
        c.execute("UPDATE fence SET clock_last = ? WHERE id = 0", (now,))
        c.execute(
            "UPDATE domains SET head = ?, clock = ? WHERE domain = ?",
            ("0" * 64, f'{{"b":{k}}}', domain),
        )
        c.execute(
            "INSERT INTO certs VALUES (?, ?, ?, ?, ?)", (domain, seq, "0" * 64, _FLOOR_CERT, now)
        )
        c.execute("COMMIT")
        assert done == 1

    def replay(self, key: str, k: int, expect: str) -> None:
        row = (
            self.conn()
            .execute(
                "SELECT f.clock_last, i.state, i.cert FROM fence f LEFT JOIN intents i "
                "ON i.intent = ? WHERE f.id = 0",
                (key,),
            )
            .fetchone()
        )
        assert row[1] == "done" and row[2] == _FLOOR_CERT


class FloorPostgresClient(RawPostgresClient):
    """PostgreSQL's contract floor (see :class:`FloorSQLiteClient`): the claim one statement
    (the domain's seq, a token from a sequence and the slot, in one CTE, on the server's
    clock), the complete one statement (the record, the head and the certificate), each its
    own fsynced autocommit transaction; a replay is one primary-key SELECT with the
    server's time."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        c = self.conn()
        s = self.table.rsplit(".", 1)[0]
        self.s = s
        c.execute(f"CREATE SEQUENCE IF NOT EXISTS {s}.tokens")
        c.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.intents (intent text PRIMARY KEY, "
            "state text NOT NULL, token bigint NOT NULL, fingerprint bytea NOT NULL, "
            "domain text NOT NULL, agent text NOT NULL, lease_until float8 NOT NULL, "
            "cert bytea, until float8 NOT NULL, seq bigint NOT NULL, reclaim_at float8 NOT NULL)"
        )
        c.execute(
            f"CREATE INDEX IF NOT EXISTS intents_reclaim ON {s}.intents (reclaim_at) "
            "WHERE reclaim_at < 1e300"
        )
        c.execute(
            f"CREATE INDEX IF NOT EXISTS intents_in_flight ON {s}.intents (domain) "
            "WHERE state = 'in_flight'"
        )
        c.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.domains (domain text PRIMARY KEY, "
            "seq bigint NOT NULL, head text, clock jsonb)"
        )
        c.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.certs (domain text, seq bigint, hash text, "
            "cert bytea, committed_at float8, PRIMARY KEY (domain, seq))"
        )
        self.claim = (
            f"WITH n AS (SELECT extract(epoch FROM clock_timestamp())::float8 AS now), "
            f"d AS (INSERT INTO {s}.domains AS x (domain, seq) VALUES (%(d)s, 1) "
            "ON CONFLICT (domain) DO UPDATE SET seq = x.seq + 1 RETURNING seq) "
            f"INSERT INTO {s}.intents SELECT %(k)s, 'in_flight', nextval('{s}.tokens'), "
            "%(fp)s, %(d)s, 'b', n.now + 30, NULL, 0, d.seq, n.now + 60 FROM n, d "
            "ON CONFLICT DO NOTHING RETURNING token"
        )
        self.complete = (
            f"WITH n AS (SELECT extract(epoch FROM clock_timestamp())::float8 AS now), "
            f"i AS (UPDATE {s}.intents SET state = 'done', lease_until = 0, cert = %(c)s, "
            "until = (SELECT now FROM n) + 3600, reclaim_at = (SELECT now FROM n) + 7200 "
            "WHERE intent = %(k)s AND token = %(t)s AND state = 'in_flight' "
            "RETURNING domain, seq), "
            f"h AS (UPDATE {s}.domains SET head = %(h)s, clock = %(v)s::jsonb "
            "WHERE domain = (SELECT domain FROM i)) "
            f"INSERT INTO {s}.certs SELECT i.domain, i.seq, %(h)s, %(c)s, n.now FROM i, n "
            "RETURNING seq"
        )

    def fresh(self, key: str, k: int, sink: int) -> None:
        c = self.conn()
        row = c.execute(
            self.claim, {"d": f"acct:{k % 64}", "k": key, "fp": b"f" * 32}, prepare=True
        ).fetchone()
        assert row is not None
        fire(sink, key)
        done = c.execute(
            self.complete,
            {"c": _FLOOR_CERT, "k": key, "t": row[0], "h": "0" * 64, "v": f'{{"b":{k}}}'},
            prepare=True,
        ).fetchone()
        assert done is not None

    def replay(self, key: str, k: int, expect: str) -> None:
        row = (
            self.conn()
            .execute(
                "SELECT extract(epoch FROM clock_timestamp())::float8, state, cert "
                f"FROM {self.s}.intents WHERE intent = %s",
                (key,),
                prepare=True,
            )
            .fetchone()
        )
        assert row is not None and row[1] == "done" and row[2] == _FLOOR_CERT


class OnceClient:
    def __init__(self, url: str) -> None:
        from once.sqlite import SqliteStore

        path = "/" + url.removeprefix("sqlite:///").partition("?")[0].lstrip("/")
        self.kernel = once_pkg.Once(SqliteStore(path), default_ttl_sec=3600.0, lease_sec=60.0)

    def fresh(self, key: str, k: int, sink: int) -> None:
        out = self.kernel.begin(key, payload(k))
        assert out.execute, key
        fire(sink, key)
        self.kernel.complete(key, out.record.fence_token, {"charge_id": f"ch_{k}"})

    def setup(self, key: str, k: int) -> str:
        out = self.kernel.begin(key, payload(k))
        self.kernel.complete(key, out.record.fence_token, {"charge_id": f"ch_{k}"})
        return f"ch_{k}"

    def replay(self, key: str, k: int, expect: str) -> None:
        out = self.kernel.begin(key, payload(k))
        assert not out.execute and out.record.result["charge_id"] == expect, key

    def close(self) -> None:
        pass


CLIENTS: dict[str, Callable[[str], Any]] = {
    "fence": FenceClient,
    "raw": RawClient,
    "rawpg": RawPostgresClient,
    "rawredis": RawRedisClient,
    "floor": FloorSQLiteClient,
    "floorpg": FloorPostgresClient,
    "once": OnceClient,
}


# -- one measured run ---------------------------------------------------------------------------


def _work(
    client: Any, scenario: str, tag: str, n: int, sink: int, expect: list[str], off: int
) -> None:
    if scenario == "fresh":
        for j in range(n):
            client.fresh(f"{tag}:{j}", j, sink)
    else:
        for j in range(n):
            k = (j + off) % REPLAY_KEYS
            client.replay(f"charge:{k}", k, expect[k])


def _threads(
    client: Any, scenario: str, tag: str, n: int, sink: int, expect: list[str], threads: int
) -> tuple[float, float]:
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        barrier.wait()
        try:
            _work(client, scenario, f"{tag}:t{i}", n, sink, expect, i * 97)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    for t in ts:
        t.join()
    t1 = time.monotonic()
    if errors:
        raise errors[0]
    return t0, t1


def _proc_main(
    kind: str,
    url: str,
    scenario: str,
    tag: str,
    n: int,
    sink_path: str,
    expect: list[str],
    barrier: Any,
    out: Any,
) -> None:
    client = CLIENTS[kind](url)
    sink = os.open(sink_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    barrier.wait()
    t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
    _work(client, scenario, tag, n, sink, expect, os.getpid())
    out.put((t0, time.monotonic()))
    client.close()


def measure(kind: str, url: str, scenario: str, mode: str, n: int, tmp: str, rnd: int) -> float:
    """Ops per second for one (contender, scenario, mode, round); checked at the sink."""
    sink_path = tempfile.mktemp(prefix=f"sink-{kind}-{scenario}-{mode[0]}-{rnd}-", dir=tmp)
    sink = os.open(sink_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    client = CLIENTS[kind](url)
    expect: list[str] = []
    timed = client
    if scenario == "replay":
        expect = [client.setup(f"charge:{k}", k) for k in range(REPLAY_KEYS)]
        if not url.startswith("memory"):
            # replayed by a client that did not write them: on the writer, every SQLite
            # replay was a hit in the store's cache of its own writes (found by review)
            timed = CLIENTS[kind](url)
    tag = f"r{rnd}"
    if mode == "1 client":
        t0 = time.monotonic()
        _work(timed, scenario, tag, n, sink, expect, 0)
        t1 = time.monotonic()
        total = n
    elif mode == "8 threads":
        per = max(1, n // THREADS)
        t0, t1 = _threads(timed, scenario, tag, per, sink, expect, THREADS)
        total = per * THREADS
    else:
        per = max(1, n // PROCS)
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(PROCS)
        q = ctx.Queue()
        ps = [
            ctx.Process(
                target=_proc_main,
                args=(kind, url, scenario, f"{tag}:p{i}", per, sink_path, expect, barrier, q),
            )
            for i in range(PROCS)
        ]
        for p in ps:
            p.start()
        spans = [q.get(timeout=600) for _ in ps]
        for p in ps:
            p.join()
            assert p.exitcode == 0, (kind, scenario, p.exitcode)
        t0, t1 = min(s[0] for s in spans), max(s[1] for s in spans)
        total = per * PROCS
    if timed is not client:
        timed.close()
    client.close()
    os.close(sink)
    with open(sink_path) as f:
        lines = f.read().splitlines()
    want = total if scenario == "fresh" else 0
    assert len(lines) == want, (kind, scenario, mode, len(lines), want)
    return total / (t1 - t0)


#: the schemas / key prefixes this run made on the shared servers, dropped when it ends
_MADE: list[tuple[str, str, str]] = []


def namespaced(scheme: str, url: str) -> Callable[[int, str, str], str]:
    """A server store URL with its own schema (PostgreSQL) or key prefix (Redis) for each
    measurement: the servers outlive the run, and a replay's setup must start from nothing
    (the same intents committed by an earlier round or run would replay, not be fresh)."""
    run_id = secrets.token_hex(3)
    option = "schema" if scheme == "postgresql" else "prefix"

    def make(r: int, s: str, m: str) -> str:
        name = f"bench_{run_id}_{r}_{s}_{m.split()[0]}"
        _MADE.append((scheme, url, name))
        return f"{url}{'&' if '?' in url else '?'}{option}={name}"

    return make


def drop_namespaces() -> int:
    """Drop what :func:`namespaced` made; returns how many."""
    try:
        from benchmarks.bench_peers import drop_pg_schema, drop_redis_prefix
    except ImportError:  # run as a script, from benchmarks/
        from bench_peers import drop_pg_schema, drop_redis_prefix

    made, n = list(_MADE), 0
    _MADE.clear()
    for scheme, url, name in made:
        with contextlib.suppress(Exception):  # a server gone since: nothing left to drop
            if scheme == "postgresql":
                drop_pg_schema(url, name)
            else:
                drop_redis_prefix(url, name)
            n += 1
    return n


# -- the table ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, fewer ops")
    ap.add_argument("--store", action="append", default=[], help="another store URL to add")
    ap.add_argument("--fresh-ops", type=int, default=800)
    ap.add_argument("--replay-ops", type=int, default=8000)
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    nf = 200 if args.quick else args.fresh_ops
    nr = 2000 if args.quick else args.replay_ops
    tmp = tempfile.mkdtemp(prefix="bench-stores-")
    rows: list[tuple[str, str, Callable[[int, str, str], str], bool]] = [
        ("memory", "fence", lambda r, s, m: "memory:", False),
    ]

    def sqlite_url(sync: str, name: str) -> Callable[[int, str, str], str]:
        def url(r: int, s: str, m: str) -> str:
            path = os.path.join(tmp, f"{name}-{r}-{s}-{m[0]}.db").lstrip("/")
            return f"sqlite:///{path}" + ("?synchronous=normal" if sync == "normal" else "")

        return url

    rows += [
        ("sqlite FULL", "fence", sqlite_url("full", "full"), True),
        ("raw sqlite FULL (limit)", "raw", sqlite_url("full", "rawfull"), True),
        ("floor sqlite FULL (contract)", "floor", sqlite_url("full", "floorfull"), True),
        ("sqlite NORMAL", "fence", sqlite_url("normal", "normal"), True),
        ("raw sqlite NORMAL (limit)", "raw", sqlite_url("normal", "rawnormal"), True),
        ("floor sqlite NORMAL (contract)", "floor", sqlite_url("normal", "floornormal"), True),
    ]
    if once_pkg is not None:
        rows.append(("once-kernel (sqlite NORMAL)", "once", sqlite_url("normal", "once"), True))
    for extra in args.store:
        scheme = extra.split("://")[0]
        make = (
            namespaced(scheme, extra)
            if scheme in ("postgresql", "redis")
            else (lambda r, s, m, u=extra: u)
        )
        rows.append((scheme + " (--store)", "fence", make, True))

    results: dict[tuple[str, str, str], list[float]] = {}
    try:
        for rnd in range(rounds):
            for scenario, n in (("fresh", nf), ("replay", nr)):
                for mode in MODES:
                    for name, kind, url, shared in rows:
                        if mode == "4 processes" and not shared:
                            continue
                        rate = measure(kind, url(rnd, scenario, mode), scenario, mode, n, tmp, rnd)
                        results.setdefault((name, scenario, mode), []).append(rate)
                        print(f"  round {rnd} {scenario:6} {mode:11} {name:28} {rate:>10,.0f}/s",
                              file=sys.stderr, flush=True)  # fmt: skip
    finally:
        drop_namespaces()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nops/s, median (min-max) over {rounds} round(s); python {sys.version.split()[0]}, "
          f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cpus")  # fmt: skip
    if once_pkg is None:
        print("once-kernel: not installed (pip install once-kernel) - its row is missing")
    for scenario in ("fresh", "replay"):
        print(f"\n{scenario:<30}" + "".join(f"{m:>26}" for m in MODES))
        for name, *_ in rows:
            cells = []
            for mode in MODES:
                v = results.get((name, scenario, mode))
                if not v:
                    cells.append(f"{'n/a':>26}")
                    continue
                cells.append(
                    f"{statistics.median(v):>10,.0f} ({min(v):,.0f}-{max(v):,.0f})".rjust(26)
                )
            print(f"{name:<30}" + "".join(cells))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
