"""Retention cuts a trail only from its start, and the cut trail still verifies.

A store deletes certificates past their retention (``cert_retention`` on SQLite and
PostgreSQL, ``certs_per_domain`` on Redis). Deleting one from the middle of a trail broke
the parent link over the hole, and ``effectfence certs --verify`` called a sound trail
tampered; the first certificates kept after a cut may also follow ones that went with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from support import (
    PG_DSN,
    REDIS_URL,
    FakeClock,
    drop_pg_schema,
    drop_redis_prefix,
    need,
    pg_pool,
    unique_name,
)
from support import sqlite_path as new_sqlite_path

from effectfence import EffectCert, EffectFence, EffectRequest, FenceConfig
from effectfence.cert import MAX_OPEN_OVERLAPS
from effectfence.operator.trail import check_trail, kept_after_cut
from effectfence.store.base import FenceStore

DOMAIN = "acct:1"
RETENTION = 50.0
SHORT, LONG = 10.0, 1000.0


def req(intent: str) -> EffectRequest:
    return EffectRequest(intent, DOMAIN, "charge", {"intent": intent}, "agent")


def _sqlite(clock: FakeClock) -> FenceStore:
    from effectfence.store.sqlite import SQLiteStore

    return SQLiteStore(new_sqlite_path(), clock=clock, cert_retention=RETENTION)


def _postgres(clock: FakeClock) -> FenceStore:
    need("pg")
    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pg")
    store = PostgresStore(pool=pg_pool(), schema=schema, clock=clock, cert_retention=RETENTION)
    store.dropped = lambda: drop_pg_schema(schema)  # type: ignore[attr-defined]
    return store


TIMED: dict[str, Callable[[FakeClock], FenceStore]] = {"sqlite": _sqlite, "postgres": _postgres}


@pytest.fixture(params=sorted(TIMED))
def timed_store(request: pytest.FixtureRequest) -> Iterator[tuple[FenceStore, FakeClock]]:
    clock = FakeClock()
    store = TIMED[request.param](clock)
    yield store, clock
    store.close()
    drop = getattr(store, "dropped", None)
    if drop is not None:
        drop()


def keep_untils(store: FenceStore) -> dict[int, float]:
    """seq -> keep_until of DOMAIN's certificates, read behind the store's back."""
    if hasattr(store, "schema"):
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as c:
            rows = c.execute(
                f'SELECT seq, keep_until FROM "{store.schema}".certs WHERE domain = %s',
                (DOMAIN,),
            ).fetchall()
    else:
        import sqlite3

        c = sqlite3.connect(store.path)  # type: ignore[attr-defined]
        rows = c.execute("SELECT seq, keep_until FROM certs WHERE domain = ?", (DOMAIN,)).fetchall()
        c.close()
    return {int(a): float(b) for a, b in rows}


def fences(store: FenceStore) -> tuple[EffectFence, EffectFence]:
    """Two processes' fences on one store, configured with different result TTLs: their
    certificates' retention ends out of seq order."""
    short = EffectFence(FenceConfig(result_ttl=SHORT, auto_sweep=False), store=store)
    long = EffectFence(FenceConfig(result_ttl=LONG, auto_sweep=False), store=store)
    return short, long


def overlapping_trail(short: EffectFence, long: EffectFence) -> list[EffectCert]:
    """seq 1 and 2 (short), 3 and 4 (long); 3 was admitted before 2 committed (its parent
    is 1), 4 after (its parent is 2). Returns the four certificates in seq order."""
    c1 = short.commit(short.prepare(req("i1")).ticket, "r1")
    t2 = short.prepare(req("i2")).ticket
    t3 = long.prepare(req("i3")).ticket
    c2 = short.commit(t2, "r2")
    t4 = long.prepare(req("i4")).ticket
    c3 = long.commit(t3, "r3")
    c4 = long.commit(t4, "r4")
    assert (c3.parent, c4.parent) == (c1.hash, c2.hash)
    return [c1, c2, c3, c4]


def test_a_certificate_goes_only_once_every_one_before_it_is_due(
    timed_store: tuple[FenceStore, FakeClock],
) -> None:
    store, clock = timed_store
    short, long = fences(store)
    long.commit(long.prepare(req("i1")).ticket, "r1")
    short.commit(short.prepare(req("i2")).ticket, "r2")  # due long before seq 1
    long.commit(long.prepare(req("i3")).ticket, "r3")
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()
    trail = list(store.certs(DOMAIN))
    assert [c.seq for c in trail] == [1, 2, 3]  # seq 2 stays while seq 1 is kept
    # and is kept until seq 1 may go: later sweeps do not look it over again
    keep = keep_untils(store)
    assert keep[2] == keep[1] and keep[1] > store.now()
    report = check_trail(trail, cut=store.trail_cut(DOMAIN))
    assert report.ok, report.reason
    assert store.trail_cut(DOMAIN) == 0
    clock.advance(LONG)
    short.sweep()
    assert list(store.certs(DOMAIN)) == []
    assert store.trail_cut(DOMAIN) == 3


def test_a_trail_cut_by_retention_verifies(timed_store: tuple[FenceStore, FakeClock]) -> None:
    store, clock = timed_store
    short, long = fences(store)
    made = overlapping_trail(short, long)
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()
    kept = list(store.certs(DOMAIN))
    assert kept == made[2:]
    cut = store.trail_cut(DOMAIN)
    assert cut == 2
    report = check_trail(kept, cut=cut)
    assert report.ok, report.reason
    assert (report.cut, report.after_cut) == (2, [3, 4])
    # without the cut, seq 4's parent (seq 2, deleted) is nowhere: the check that the
    # store's cut feeds is what tells retention from tampering
    assert not check_trail(kept).ok


def test_redis_count_retention_records_its_cut() -> None:
    need("redis")
    from effectfence.store.redis import RedisStore

    prefix = unique_name("redis")
    store = RedisStore(REDIS_URL, prefix=prefix, clock=FakeClock(), certs_per_domain=2)
    try:
        fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
        made = overlapping_trail(fence, fence)
        kept = list(store.certs(DOMAIN))
        assert kept == made[2:]
        assert store.trail_cut(DOMAIN) == 2
        report = check_trail(kept, cut=store.trail_cut(DOMAIN))
        assert report.ok and report.after_cut == [3, 4], report.reason
    finally:
        store.close()
        drop_redis_prefix(prefix)


def _line(n: int) -> list[EffectCert]:
    certs: list[EffectCert] = []
    parent: str | None = None
    for seq in range(1, n + 1):
        c = EffectCert(
            intent=f"i{seq}",
            parent=parent,
            domain=DOMAIN,
            seq=seq,
            tool="charge",
            args={},
            result=seq,
            vector_clock={"a": seq},
            read_set=(),
            agent="a",
        )
        certs.append(c)
        parent = c.hash
    return certs


def test_past_the_overlap_window_a_missing_parent_is_still_a_broken_link() -> None:
    certs = _line(MAX_OPEN_OVERLAPS + 10)
    kept = certs[5:]  # the store cut through seq 5
    assert check_trail(kept, cut=5).ok
    # a certificate deleted (and its successor's link left dangling) right after the cut
    # is accepted as retention's; one deleted further on is not
    late = 5 + MAX_OPEN_OVERLAPS + 2  # past the first MAX_OPEN_OVERLAPS kept
    holed = [c for c in kept if c.seq != late]
    report = check_trail(holed, cut=5)
    assert not report.ok and report.broken_at_seq == late + 1
    # below the cut anything may be gone: a certificate committed late can stay there
    assert check_trail([c for c in certs if c.seq != 3], cut=5).ok


def test_certs_verify_on_a_cut_trail_says_where_it_was_cut(
    timed_store: tuple[FenceStore, FakeClock],
) -> None:
    import io
    import json

    from effectfence.operator import certs as certs_cli

    store, clock = timed_store
    short, long = fences(store)
    overlapping_trail(short, long)
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()
    out = io.StringIO()
    assert certs_cli.main([DOMAIN, "--verify"], fence=short, out=out) == 0
    text = out.getvalue()
    assert text.startswith("OK: 2 certificate(s)"), text
    assert "retention deleted the trail through seq 2" in text
    assert "seq 3, 4 follow certificates that went with it" in text
    out = io.StringIO()
    assert certs_cli.main([DOMAIN, "--verify", "--json"], fence=short, out=out) == 0
    got = json.loads(out.getvalue())
    assert (got["ok"], got["cut"], got["after_cut"]) == (True, 2, [3, 4])


def test_an_attempt_in_flight_across_a_cut_commits_and_the_trail_verifies(
    timed_store: tuple[FenceStore, FakeClock],
) -> None:
    """The sweep does not wait for an attempt in flight: seq 2 lands below the cut, and
    seq 4 follows seq 3, which went with it (found by review)."""
    store, clock = timed_store
    short, long = fences(store)
    short.commit(short.prepare(req("i1")).ticket, "r1")  # seq 1
    t2 = long.prepare(req("i2")).ticket  # seq 2, in flight
    short.commit(short.prepare(req("i3")).ticket, "r3")  # seq 3
    t4 = long.prepare(req("i4")).ticket  # seq 4, its parent seq 3
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()  # seq 1 and 3 go
    assert store.trail_cut(DOMAIN) == 3
    long.commit(t2, "r2")
    long.commit(t4, "r4")
    kept = list(store.certs(DOMAIN))
    assert [c.seq for c in kept] == [2, 4]
    report = check_trail(kept, cut=3)
    assert report.ok, report.reason
    assert report.after_cut == [2, 4]


def test_verify_after_a_seq_past_the_cut(timed_store: tuple[FenceStore, FakeClock]) -> None:
    """--after N just past the cut: what follows deleted certificates is still accepted."""
    import io

    from effectfence.operator import certs as certs_cli

    store, clock = timed_store
    short, long = fences(store)
    short.commit(short.prepare(req("i1")).ticket, "r1")  # seq 1
    s2 = short.prepare(req("i2")).ticket  # seq 2, parent 1
    l3 = long.prepare(req("i3")).ticket  # seq 3, parent 1
    l4 = long.prepare(req("i4")).ticket  # seq 4, parent 1
    short.commit(s2, "r2")
    l5 = long.prepare(req("i5")).ticket  # seq 5, parent 2
    for t in (l3, l4, l5):
        long.commit(t, "r")
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()  # through seq 2
    for after in ("0", "3"):
        out = io.StringIO()
        assert certs_cli.main([DOMAIN, "--verify", "--after", after], fence=short, out=out) == 0, (
            after,
            out.getvalue(),
        )


def test_the_sweep_reads_only_certificates_that_may_go(tmp_path: object) -> None:
    """Certificates kept for ever (the default) cost a sweep nothing: the candidates come
    from the partial index of those with a retention (a scan of every certificate under
    the write lock, found by review)."""
    import sqlite3

    from effectfence.store.sqlite import _SWEEP_CERTS, SQLiteStore

    store = SQLiteStore(new_sqlite_path(), clock=FakeClock(), cert_retention=RETENTION)
    store.close()
    conn = sqlite3.connect(store.path)
    plan = " ".join(str(r[3]) for r in conn.execute("EXPLAIN QUERY PLAN " + _SWEEP_CERTS, (5, 10)))
    conn.close()
    assert "USING INDEX certs_keep" in plan, plan


def test_a_sweep_batch_deletes_at_most_its_size(tmp_path: object) -> None:
    """One due certificate at the end of a long due trail took the whole trail before it
    in one batch, under SQLite's write lock (200,000 in 144 ms, found by review)."""
    import sqlite3

    from effectfence.store.sqlite import SQLiteStore

    clock = FakeClock()
    path = new_sqlite_path()
    SQLiteStore(path, clock=clock).close()
    n = 500
    db = sqlite3.connect(path)
    # every certificate due, the last one first (a short result_ttl)
    db.executemany(
        "INSERT INTO certs (domain, seq, hash, cert, committed_at, keep_until) "
        "VALUES (?, ?, ?, ?, 0, ?)",
        [(DOMAIN, s, f"h{s}", b"", 2.0 + s) for s in range(1, n)] + [(DOMAIN, n, "hn", b"", 1.0)],
    )
    db.commit()
    db.close()
    clock.advance(10 * n)
    store = SQLiteStore(path, clock=clock)
    try:
        store._write("sweep", store._sweep_batch, 7)  # one batch of 7
        assert [c for c in store._query("t", "SELECT count(*) FROM certs")] == [(n - 7,)]
        assert store.trail_cut(DOMAIN) == 7  # the first seven: still a prefix
    finally:
        store.close()


def test_postgres_sweeps_take_turns_on_the_certificates() -> None:
    """Two sweepers each locked their batch and then deleted the other's range: a
    deadlock (found by review). One sweeper at a time prunes; another skips it."""
    import psycopg

    clock = FakeClock()
    store = _postgres(clock)
    short, long = fences(store)
    overlapping_trail(short, long)
    clock.advance(SHORT + RETENTION + 1)
    channel = store._channel  # type: ignore[attr-defined]
    with psycopg.connect(PG_DSN) as other:  # another sweeper, mid-batch
        other.execute("SELECT pg_advisory_xact_lock(hashtext(%s), 1)", (channel,))
        short.sweep()
        assert [c.seq for c in store.certs(DOMAIN)] == [1, 2, 3, 4]  # left to it
        other.rollback()
    short.sweep()
    assert [c.seq for c in store.certs(DOMAIN)] == [3, 4]
    store.close()
    store.dropped()  # type: ignore[attr-defined]


def test_the_postgres_functions_change_only_with_the_schema_version() -> None:
    """The DDL runs only on a schema older than the code's, so a function changed without
    a new version never reached an existing store (two did, found by review). Changing
    the DDL means a new SCHEMA_VERSION and a new pin here."""
    import hashlib

    from effectfence.store import postgres

    pinned = {11: "84482a3104d4d693ab81e03d8ea52c0dd001b0a900768a7e625097e7b5205b9b"}
    got = hashlib.sha256(postgres._DDL.encode()).hexdigest()
    assert pinned.get(postgres.SCHEMA_VERSION) == got, (postgres.SCHEMA_VERSION, got)


def test_released_seqs_between_do_not_push_a_link_past_the_window(
    timed_store: tuple[FenceStore, FakeClock],
) -> None:
    """Released attempts use seqs and leave no certificate: the first certificates kept
    after a cut may sit far more than MAX_OPEN_OVERLAPS seqs past it and still follow a
    deleted one. The window is counted in certificates kept (found by review)."""
    store, clock = timed_store
    short, long = fences(store)
    a = short.commit(short.prepare(req("A")).ticket, "r")  # seq 1
    tb = short.prepare(req("B")).ticket  # seq 2, parent A
    for k in range(MAX_OPEN_OVERLAPS + 10):  # attempts that did not fire
        short.release(short.prepare(req(f"released-{k}")).ticket)
    t1 = long.prepare(req("X1")).ticket  # parent A (B not committed yet)
    b = short.commit(tb, "r")
    t2 = long.prepare(req("X2")).ticket  # parent B
    x1, x2 = long.commit(t1, "r"), long.commit(t2, "r")
    assert (x1.parent, x2.parent) == (a.hash, b.hash)
    assert x2.seq > 2 + MAX_OPEN_OVERLAPS
    clock.advance(SHORT + RETENTION + 1)
    short.sweep()
    kept = list(store.certs(DOMAIN))
    cut = store.trail_cut(DOMAIN)
    assert [c.seq for c in kept] == [x1.seq, x2.seq] and cut == 2
    report = check_trail(kept, cut=cut)
    assert report.ok, report.reason
    # a part read after the first kept one counts it: still within the window
    assert check_trail(kept[1:], cut=cut, kept_before=kept_after_cut(store, DOMAIN, cut, x1.seq)).ok
