"""What only the server stores (PostgreSQL, Redis) have to prove, on real servers.

The contract itself is proven by test_store_contract (both are in ``support.STORES``). Here:
real processes storm one intent (executions counted at a sink file opened O_APPEND, outside
the store), connections cut before and in the middle of a step and replies lost after it,
a new process replaying what an old one committed, and a client wall clock that jumps.

No sleep-and-hope: processes start together on a "go" line, threads on a Barrier, and a step
"in the middle" is one blocked on a lock (PostgreSQL) or a paused server (Redis) that the test
sees blocked on the server before it cuts the connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import (
    PG_DSN,
    REDIS_URL,
    REQUIRE_SERVICES,
    FakeClock,
    drop_pg_schema,
    drop_redis_prefix,
    need,
    unique_name,
)

from effectfence import (
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentInFlight,
    LeaseLost,
    StoreUnavailable,
    fenced,
)
from effectfence.protocol import State
from effectfence.store import open_store

WORKER = str(Path(__file__).with_name("server_worker.py"))
KINDS = ["postgres", "redis"]


def with_query(url: str, **q: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in q.items())


@pytest.fixture(params=KINDS)
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store URL with a schema / prefix of its own, removed afterwards."""
    kind = request.param
    need("pg" if kind == "postgres" else "redis")
    name = unique_name(kind)
    if kind == "postgres":
        yield with_query(PG_DSN, schema=name)
        drop_pg_schema(name)
    else:
        yield with_query(REDIS_URL, prefix=name)
        drop_redis_prefix(name)


def req(intent: str = "charge:1", agent: str = "a", domain: str = "order:777") -> EffectRequest:
    return EffectRequest(intent, domain, "charge", {"cents": 77700}, agent)


def spawn(mode: str, **args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, mode, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).parent),
    )


def run(mode: str, **args: Any) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, WORKER, mode, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).parent),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def until(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll the *server's* state until ``cond()`` holds (bounded): an observed fact, not a
    guess about timing."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# -- processes ------------------------------------------------------------------------------------


def test_process_storm_executes_once(url: str, tmp_path: Path) -> None:
    """4 processes x 8 threads, 1,024 attempts on one intent: one execution at the sink."""
    sink = str(tmp_path / "sink")
    procs = [
        spawn("storm", url=url, sink=sink, intent="storm:1", threads=8, attempts=32)
        for _ in range(4)
    ]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.poll()
    for p in procs:  # all parked on their barriers: release them together
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    lines = Path(sink).read_text().splitlines()
    assert len(lines) == 1, lines
    assert sum(r["fresh"] for r in results) == 1
    assert sum(r["errors"] + r["unavailable"] for r in results) == 0, results
    total = sum(r["fresh"] + r["replay"] + r["in_flight"] for r in results)
    assert total == 4 * 8 * 32
    assert len({h for r in results for h in r["hashes"]}) == 1  # every replay: the same cert


def test_a_new_process_replays_what_an_old_one_committed(url: str) -> None:
    """Restart of the client: the record is in the server, the new process replays it.

    PostgreSQL keeps a committed step across a server restart too (synchronous_commit on,
    checked at connect). Redis keeps it across a *server* restart only with appendonly yes +
    appendfsync always (reported by durability()); this test restarts the client process."""
    first = run("commit_one", url=url, intent="restart:1")
    assert first["fresh"]
    second = run("commit_one", url=url, intent="restart:1", agent="second")
    assert second == {"fresh": False, "hash": first["hash"], "verify": True}


# -- faults: PostgreSQL -----------------------------------------------------------------------


@pytest.fixture
def pg() -> Iterator[Any]:
    need("pg")
    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pgfault")
    store = PostgresStore(PG_DSN, schema=schema, pool_max=4)
    yield store
    store.close()
    drop_pg_schema(schema)


def _pg_admin() -> Any:
    import psycopg

    return psycopg.connect(PG_DSN, autocommit=True)


def _blocked_pids(admin: Any, schema: str, fn: str) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        (f'%"{schema}".{fn}(%',),
    ).fetchall()
    return [r[0] for r in rows]


def _lock_domain(schema: str, domain: str) -> Any:
    """Hold a domain's row lock in an open transaction: steps on it block there."""
    import psycopg

    blocker = psycopg.connect(PG_DSN)
    blocker.execute(f'SELECT 1 FROM "{schema}".domains WHERE domain = %s FOR UPDATE', (domain,))
    return blocker


def test_pg_connection_cut_mid_claim_is_unavailable_and_leaves_nothing(pg: Any) -> None:
    fence = EffectFence(store=pg)
    fence.commit(fence.prepare(req("other")).ticket, "x")  # the domain row exists
    before = (pg.current("order:777"), pg.size())
    blocker = _lock_domain(pg.schema, "order:777")
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_catch(lambda: fence.prepare(req()))))
    t.start()
    with _pg_admin() as admin:
        (pid,) = until(lambda: _blocked_pids(admin, pg.schema, "claim"), "a blocked claim")
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    t.join(timeout=30)
    blocker.rollback()
    blocker.close()
    assert isinstance(got[0], StoreUnavailable), got
    assert got[0].code == "store_unavailable"
    assert pg.get("charge:1") is None  # nothing half-written
    assert (pg.current("order:777"), pg.size()) == before
    assert fence.prepare(req()).fresh  # and the intent is free


def test_pg_connection_cut_mid_complete_answers_from_the_store(pg: Any) -> None:
    fence = EffectFence(store=pg)
    ticket = fence.prepare(req()).ticket
    blocker = _lock_domain(pg.schema, "order:777")
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_catch(lambda: fence.commit(ticket, "r"))))
    t.start()
    with _pg_admin() as admin:
        (pid,) = until(lambda: _blocked_pids(admin, pg.schema, "complete"), "a blocked commit")
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # the cut step rolled back: nothing is marked done that did not commit
        rec = until(lambda: pg.get("charge:1"), "the record")
        assert rec.state is State.IN_FLIGHT and rec.token == ticket.token
        # the store re-read, found its token in flight, and ran the step again: blocked anew
        until(
            lambda: [p for p in _blocked_pids(admin, pg.schema, "complete") if p != pid],
            "the retried commit",
        )
    blocker.rollback()
    blocker.close()
    t.join(timeout=30)
    cert = got[0]
    assert not isinstance(cert, BaseException), cert
    assert cert.verify()
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    assert [c.hash for c in pg.certs("order:777")] == [cert.hash]  # one cert, not two


def test_pg_reply_lost_after_commit_is_not_a_lie(pg: Any) -> None:
    """The commit applied and its reply was lost: the store re-reads and says APPLIED."""
    import psycopg

    fence = EffectFence(store=pg)
    ticket = fence.prepare(req()).ticket
    real = pg._execute

    def lose_reply(conn: Any, query: Any, params: Any) -> Any:
        rows = real(conn, query, params)
        if query is pg._q_complete:
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    pg._execute = lose_reply
    try:
        cert = fence.commit(ticket, "r")
    finally:
        pg._execute = real
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    assert len(list(pg.certs("order:777"))) == 1


def test_pg_a_claim_that_lost_its_reply_answers_only_what_it_cannot_have_made(pg: Any) -> None:
    """prepare claims first, so a replay's one statement is the claim. When its reply is
    lost, a re-read that finds the intent done answers (a claim never makes a done record):
    the replay still replays, as when prepare read first and the read was retried. A
    record in flight may be the lost claim's own, so that stays store_unavailable (its
    lease lapses like a crashed holder's), and nothing runs twice."""
    import psycopg

    fence = EffectFence(FenceConfig(auto_sweep=False), store=pg)
    cert = fence.commit(fence.prepare(req()).ticket, "ok")
    real = pg._execute
    lost: list[Any] = []

    def lose_reply(conn: Any, query: Any, params: Any) -> Any:
        rows = real(conn, query, params)
        if query is pg._q_claim_first and not lost:
            lost.append(query)
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    pg._execute = lose_reply
    try:
        again = fence.prepare(req(agent="b"))
        assert lost, "the claim's reply was lost"
        assert not again.fresh and again.cert.hash == cert.hash
        lost.clear()
        got = _catch(lambda: fence.prepare(req("charge:2")))
        assert lost
    finally:
        pg._execute = real
    assert isinstance(got, StoreUnavailable), got
    rec = pg.get("charge:2")
    assert rec is not None and rec.state is State.IN_FLIGHT  # it applied; nobody holds it


def test_pg_a_version_2_process_commits_after_the_schema_is_upgraded(
    pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolling upgrade: a process that started on version-2 code (its ``complete`` has no
    fingerprint) still commits what it holds once the schema is upgraded under it; were its
    commit to fail, the effect would run again after its lease lapsed."""
    from psycopg import sql

    v2 = (
        sql.SQL(
            "SELECT * FROM {}.complete(%s, %s, %s, %s, %s::jsonb, %s, %s, %s::text[], "
            "%s::bigint[], %s::bigint, %s, %s, %s, %s::float8)"
        )
        .format(sql.Identifier(pg.schema))
        .as_bytes(None)
    )
    real = pg._run
    sent: list[int] = []

    def as_version_2(op: str, query: Any, params: Any) -> Any:
        if op == "complete":  # what version-2 code sent: no fingerprint after the token
            sent.append(len(params))
            query, params = v2, (*params[:2], *params[3:])
        return real(op, query, params)

    monkeypatch.setattr(pg, "_run", as_version_2)
    fence = EffectFence(store=pg)
    holder = fence.prepare(req()).ticket
    cert = fence.commit(holder, "charged")
    assert sent == [15] and cert.verify()
    assert pg.get("charge:1").state is State.DONE
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    # the shim keeps compare-by-token: a ticket whose lease moved on is still refused
    other = fence.prepare(req("charge:2")).ticket
    pg.release("charge:2", other.token)
    fence.prepare(req("charge:2"))
    with pytest.raises(LeaseLost):
        fence.commit(other, "late")


def test_pg_notifies_only_the_transitions_someone_waits_for(pg: Any) -> None:
    """A NOTIFY takes a database-wide lock at commit: steps no waiter registered for send
    none, and a registered waiter gets exactly one for the next transition."""
    import hashlib

    import psycopg

    got: list[str] = []
    with psycopg.connect(PG_DSN, autocommit=True) as listen:
        listen.add_notify_handler(lambda n: got.append(n.payload))
        listen.execute(f'LISTEN "{pg._channel}"')

        def delivered() -> list[str]:
            listen.execute("SELECT 1")  # pending notifications arrive with the answer
            return list(got)

        fence = EffectFence(store=pg)
        fence.commit(fence.prepare(req("quiet")).ticket, "r")
        t = fence.prepare(req("held")).ticket
        fence.renew(t)
        assert delivered() == [], "no waiter, no NOTIFY"
        assert pg._watch("held").token == t.token  # what a waiter in another process does
        fence.commit(t, "r")
        key = hashlib.md5(b"held", usedforsecurity=False).hexdigest()
        assert delivered() == [key]
        fence.prepare(req("held", agent="b"))  # a replay changes nothing; registration is spent
        assert delivered() == [key]


def test_pg_waiter_in_another_process_is_woken_by_the_commit(pg: Any) -> None:
    from effectfence.store.postgres import PostgresStore

    holder = EffectFence(FenceConfig(lease_ttl=60.0), store=pg)
    ticket = holder.prepare(req()).ticket
    other = PostgresStore(PG_DSN, schema=pg.schema, pool_max=2)
    other._waiters.poll = 120.0  # no re-reads: only the NOTIFY can end the wait early
    waiter = EffectFence(FenceConfig(lease_ttl=60.0), store=other)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(waiter.wait("charge:1", 50.0)))
    t.start()
    with _pg_admin() as admin:
        until(
            lambda: admin.execute(
                f'SELECT 1 FROM "{pg.schema}".watch WHERE intent = %s', ("charge:1",)
            ).fetchone(),
            "the waiter's registration",
        )
    holder.commit(ticket, "r")
    t.join(timeout=20)
    other.close()
    assert done == [True], "woken by the commit, well before the 50 s wait ran out"


def test_pg_a_listener_that_cannot_connect_never_holds_a_waiter(pg: Any) -> None:
    """A server that takes the connection and never answers (found by review: libpq's
    connect waits for ever, and it ran in the waiter's thread)."""
    import socket

    hole = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    try:
        pg._conninfo = f"host=127.0.0.1 port={hole.getsockname()[1]} dbname=test"
        ticket = EffectFence(FenceConfig(lease_ttl=60.0), store=pg).prepare(req()).ticket
        seen = pg.get(ticket.intent)
        done: list[bool] = []
        t = threading.Thread(
            target=lambda: done.append(pg.wait_for_change(ticket.intent, seen, 0.5)), daemon=True
        )
        t.start()
        t.join(timeout=10.0)
        assert done == [False], "the wait outlived its timeout"
        assert pg._listen_conn is None
    finally:
        hole.close()  # ends the connect, whoever makes it


@pytest.mark.parametrize("lease", [None, 1.0])
def test_pg_a_waiter_never_waits_on_a_held_row_past_its_time(pg: Any, lease: float | None) -> None:
    """A waiter reads the record ``FOR SHARE``, so it waits for a step holding the row.
    Version 10 waited for ever (found by review: 6 s on a 2 s lease): the store's wait
    must end at its timeout, and the fence's at the lease."""
    holder = EffectFence(FenceConfig(lease_ttl=lease or 60.0), store=pg)
    ticket = holder.prepare(req()).ticket
    seen = pg.get(ticket.intent)
    done: list[bool] = []
    if lease is None:
        wait = lambda: done.append(pg.wait_for_change(ticket.intent, seen, 0.5))  # noqa: E731
    else:
        waiter = EffectFence(FenceConfig(lease_ttl=lease), store=pg)
        wait = lambda: done.append(waiter.wait(ticket.intent, 60.0))  # noqa: E731
    with _pg_admin() as admin, admin.transaction():
        admin.execute(
            f'SELECT 1 FROM "{pg.schema}".intents WHERE intent = %s FOR UPDATE', (ticket.intent,)
        )
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(timeout=15.0)
        stuck = t.is_alive()
    t.join(timeout=15.0)  # the lock is gone: a stuck waiter ends now
    assert not stuck, "the waiter outlived its time behind a held row"
    # the store's wait saw no change; the fence's found the lease lapsed
    assert done == ([False] if lease is None else [True])


def test_pg_a_waiter_behind_a_queued_step_ends_at_its_time(pg: Any) -> None:
    """lock_timeout bounds each lock wait, not the statement: a step queued ahead of the
    waiter took the row as its holder ended, and the waiter waited for it afresh, with its
    whole time again (found by review: 1.9 s on a 1 s wait)."""
    import psycopg

    ticket = EffectFence(FenceConfig(lease_ttl=60.0), store=pg).prepare(req()).ticket
    seen = pg.get(ticket.intent)
    lock = f'SELECT 1 FROM "{pg.schema}".intents WHERE intent = %s FOR UPDATE'
    first, second = psycopg.connect(PG_DSN), psycopg.connect(PG_DSN)
    try:
        first.execute(lock, (ticket.intent,))
        queued = threading.Thread(target=lambda: second.execute(lock, (ticket.intent,)))
        queued.start()
        with _pg_admin() as admin:
            until(
                lambda: admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE %s",
                    (f'%"{pg.schema}".intents WHERE%FOR UPDATE%',),
                ).fetchone(),
                "the queued step",
            )
        took: list[float] = []

        def wait() -> None:
            started = time.monotonic()
            pg.wait_for_change(ticket.intent, seen, 2.0)
            took.append(time.monotonic() - started)

        waiter = threading.Thread(target=wait, daemon=True)
        began = time.monotonic()
        waiter.start()
        with _pg_admin() as admin:
            until(lambda: _blocked_pids(admin, pg.schema, "watch_"), "the waiter's lock wait")
        time.sleep(max(0.0, began + 1.6 - time.monotonic()))  # late in the waiter's time
        first.commit()  # the queued step takes the row, and holds it
        queued.join(timeout=10.0)
        waiter.join(timeout=10.0)
        assert took and took[0] < 2.8, took  # 3.6 s before: 1.6 s, then 2 s afresh
    finally:
        first.close()
        second.close()


@contextlib.contextmanager
def _network_namespace() -> Iterator[tuple[str, str, Callable[[], None]]]:
    """A network namespace joined to this one by a veth pair, and a relay on our end to
    the local PostgreSQL: yields (namespace, relay address, silence), where ``silence()``
    drops every packet from then on, with no reset: a network gone silent, which no
    loopback proxy can imitate (its kernel acknowledges)."""
    import shutil
    import socket

    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip) to make a network namespace")
    n = os.getpid() % 100000
    ns, ours, theirs = f"effn{n}", f"efa{n}", f"efb{n}"
    net = f"10.213.{n % 250}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    import psycopg.conninfo

    target = psycopg.conninfo.conninfo_to_dict(PG_DSN)
    dest = (str(target.get("host", "127.0.0.1")), int(target.get("port", 5432)))
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # a leftover
    ip("netns", "add", ns)
    relay: socket.socket | None = None
    try:
        ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        ip("link", "set", theirs, "netns", ns)
        ip("addr", "add", f"{net}.1/30", "dev", ours)
        ip("link", "set", ours, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{net}.2/30", "dev", theirs)
        ip("netns", "exec", ns, "ip", "link", "set", theirs, "up")
        relay = socket.create_server((f"{net}.1", 0))
        address = f"{net}.1:{relay.getsockname()[1]}"

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        def accept(listener: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while True:
                    near, _ = listener.accept()
                    far = socket.create_connection(dest)
                    for a, b in ((near, far), (far, near)):
                        threading.Thread(target=pump, args=(a, b), daemon=True).start()

        threading.Thread(target=accept, args=(relay,), daemon=True).start()
        # our end down: the veth drops what the namespace sends, and says nothing (netem
        # would do it more plainly, but this kernel has no sch_netem)
        yield ns, address, lambda: ip("link", "set", ours, "down")
    finally:
        if relay is not None:
            relay.close()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", ours], capture_output=True, timeout=30)


def test_pg_a_step_on_a_network_gone_silent_ends_within_the_timeout() -> None:
    """A step whose packets vanish (no reset, no reply) blocked until the kernel gave up,
    some fifteen minutes (found by review: libpq waits for ever by default). With the
    store's link options it ends within about its ``timeout``: unavailable, nothing run."""
    need("pg")
    schema = unique_name("pgsilent")
    try:
        with _network_namespace() as (ns, address, silence):
            url = PG_DSN.replace(PG_DSN.split("@", 1)[1].split("/", 1)[0], address, 1)
            child = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, WORKER, "silenced",
                 json.dumps({"url": with_query(url, schema=schema, timeout="2", pool_max="1")})],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, cwd=str(Path(__file__).parent),
            )  # fmt: skip
            try:
                assert child.stdout is not None and child.stdin is not None
                ready = child.stdout.readline()
                assert ready.strip() == "ready", (ready, child.stderr and child.stderr.read())
                silence()
                child.stdin.write("go\n")
                child.stdin.flush()
                out, err = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("a step on the silent network was still blocked after 60 s")
            finally:
                child.kill()
                child.wait()
            got = json.loads(out.strip().splitlines()[-1])
            assert got["outcome"] == "store_unavailable", (got, err)
            assert got["seconds"] < 20, got  # tcp_user_timeout 2 s, a reconnect's 2 s
    finally:
        drop_pg_schema(schema)


def test_pg_idle_connections_cut_before_a_step_cost_a_reconnect(pg: Any) -> None:
    fence = EffectFence(store=pg)
    fence.prepare(req("warm"))  # the pool holds a connection
    with _pg_admin() as admin:
        pids = [
            r[0]
            for r in admin.execute(
                "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                "application_name = '' AND backend_type = 'client backend' AND query LIKE %s",
                (f'%"{pg.schema}"%',),
            ).fetchall()
        ]
        assert pids
        # pg_terminate_backend only signals: the cut is done once the backends are gone
        # (a statement sent before that is cut mid-step, which is another test's case)
        until(
            lambda: (
                not admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
                ).fetchall()
            ),
            "the backends gone",
        )
    adm = fence.prepare(req())  # not StoreUnavailable: the dead connection was never used
    assert adm.fresh


@pytest.mark.parametrize("op", ["abort", "release"])
def test_pg_a_lost_step_that_applied_meanwhile_is_not_lease_lost(pg: Any, op: str) -> None:
    """The client's connection broke while its abort still ran on a server that had not
    noticed (blocked on the intent's row); the store ran the step again, the first run
    committed first, and the caller was told lease_lost of an abort that applied (found by
    review)."""
    import psycopg

    fence = EffectFence(store=pg)
    ticket = fence.prepare(req()).ticket
    blocker = psycopg.connect(PG_DSN)  # holds the intent's row
    blocker.execute(
        f'SELECT 1 FROM "{pg.schema}".intents WHERE intent = %s FOR UPDATE', ("charge:1",)
    )
    real, orphan = pg._execute, []

    def lose_connection(conn: Any, query: Any, params: Any) -> Any:
        if query is pg._q_finish and not orphan:
            other = psycopg.connect(PG_DSN, autocommit=True)  # the server runs it on
            t = threading.Thread(target=lambda: real(other, query, params))
            t.start()
            orphan.append((t, other))
            with _pg_admin() as admin:
                until(lambda: _blocked_pids(admin, pg.schema, "finish"), "the first run")
            conn.close()  # the client's side is gone
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(conn, query, params)

    pg._execute = lose_connection
    got: list[Any] = []
    step = (lambda: fence.abort(ticket, "boom")) if op == "abort" else lambda: fence.release(ticket)
    worker = threading.Thread(target=lambda: got.append(_catch(step)))
    try:
        worker.start()
        with _pg_admin() as admin:
            until(lambda: len(_blocked_pids(admin, pg.schema, "finish")) >= 2, "the re-run")
        blocker.rollback()
        worker.join(30)
        orphan[0][0].join(30)
    finally:
        pg._execute = real
        blocker.close()
        for _, conn in orphan:
            conn.close()
    assert got == [None], got
    rec = pg.get("charge:1")
    if op == "abort":
        assert rec is not None and rec.state is State.FAILED and rec.reason == "boom"
    else:
        assert rec is None


def test_pg_a_process_holding_many_descriptors_keeps_its_connections() -> None:
    """select() refuses descriptors past 1023, and the hang-up check took its error for a
    hang-up: a process holding that many (a busy HTTP server) replaced its connection on
    every step (found by review: 85 connections opened for 20 steps)."""
    need("pg")
    import resource

    from effectfence.store.postgres import PostgresStore

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below what this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    schema = unique_name("pgfault")
    try:
        store = PostgresStore(PG_DSN, schema=schema, pool_max=2)  # connects past fd 1023
        fence = EffectFence(store=store)
        fence.prepare(req("warm"))
        opened: list[int] = []
        connect = store._pool._connect

        def counting(*a: Any, **k: Any) -> Any:
            conn = connect(*a, **k)
            opened.append(conn.fileno())
            return conn

        store._pool._connect = counting  # type: ignore[method-assign]
        for i in range(10):
            fence.commit(fence.prepare(req(f"many:{i}")).ticket, "ok")
        assert opened == [], f"{len(opened)} connections opened for 20 steps"
        store.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        drop_pg_schema(schema)


@pytest.mark.parametrize("sync_off", [False, True])
def test_pg_the_callers_pool_gets_its_connections_back_as_lent(sync_off: bool) -> None:
    """A pool passed in is the application's too. The store put its connections in
    autocommit (and synchronous_commit on) for good: the application's own `with
    pool.connection()` blocks stopped being transactions, and one that raised halfway
    stayed half applied (found by review). Each step now borrows the connection and gives
    it back as it was; the step itself still runs in autocommit, durably."""
    need("pg")
    import psycopg_pool

    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pgpool")
    options = "&options=-c%20synchronous_commit%3Doff" if sync_off else ""
    pool = psycopg_pool.ConnectionPool(f"{PG_DSN}?application_name={schema}{options}",
                                       min_size=1, max_size=1, open=False)  # fmt: skip
    pool.open(wait=True)
    try:
        with pool.connection() as c:
            c.execute(f'CREATE TABLE "{schema}_app" (x int)')
        store = PostgresStore(pool=pool, schema=schema)
        fence = EffectFence(store=store)
        fence.commit(fence.prepare(req()).ticket, "ok")  # type: ignore[union-attr]
        with contextlib.suppress(RuntimeError), pool.connection() as c:
            c.execute(f'INSERT INTO "{schema}_app" VALUES (1)')
            raise RuntimeError("the application's transaction fails")
        with pool.connection() as c:
            count = c.execute(f'SELECT count(*) FROM "{schema}_app"').fetchone()[0]  # type: ignore[index]
            setting = c.execute("SHOW synchronous_commit").fetchone()[0]  # type: ignore[index]
            assert (count, c.autocommit) == (0, False)  # rolled back: still a transaction
            assert setting == ("off" if sync_off else "on")  # the session as it was
        assert (
            "synchronous_commit was off" in " ".join(store.describe().get("notes", []))
        ) is sync_off
        assert fence.prepare(req()).cert is not None  # the store still works on it
        store.close()
    finally:
        with pool.connection() as c:
            c.execute(f'DROP TABLE IF EXISTS "{schema}_app"')
        pool.close()
        drop_pg_schema(schema)


def test_pg_a_callers_session_changed_after_a_borrow_is_set_up_again() -> None:
    """The store checked synchronous_commit only the first time it borrowed each of the
    caller's connections: an application that later turned it off on its session (a common
    bulk-write optimisation) had every later step on that connection acknowledged before its
    WAL was flushed (found by review). The same for READ COMMITTED, which the steps rely
    on. Each borrow sets both, and gives the session back as the application left it."""
    need("pg")
    import psycopg_pool

    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pgpool")
    pool = psycopg_pool.ConnectionPool(PG_DSN, min_size=1, max_size=1, open=False)
    pool.open(wait=True)
    try:
        store = PostgresStore(pool=pool, schema=schema)
        fence = EffectFence(store=store)
        fence.commit(fence.prepare(req("warm")).ticket, "ok")  # the connection is checked
        with pool.connection() as c:  # the application, on its own session
            c.execute("SET synchronous_commit = off")
            c.execute("SET default_transaction_isolation = 'repeatable read'")
            c.commit()
        seen: list[tuple[str, str]] = []
        real = store._execute
        show = "SELECT current_setting('synchronous_commit'), " + (
            "current_setting('default_transaction_isolation')"
        )

        def spy(conn: Any, query: Any, params: Any) -> Any:
            if query is store._q_complete:
                seen.append(conn.execute(show).fetchone())
            return real(conn, query, params)

        store._execute = spy  # type: ignore[method-assign]
        fence.commit(fence.prepare(req("charge:9")).ticket, "charged")
        store._execute = real  # type: ignore[method-assign]
        assert seen == [("on", "read committed")], seen
        with pool.connection() as c:  # given back as the application left it
            assert c.execute(show).fetchone() == ("off", "repeatable read")
        store.close()
    finally:
        pool.close()
        drop_pg_schema(schema)


def test_pg_an_interrupt_while_lending_drops_the_callers_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt between switching the caller's connection to autocommit and handing
    back what to restore left it in autocommit for good (found by review): it is closed
    instead, and the pool replaces it."""
    need("pg")
    import psycopg
    import psycopg_pool

    from effectfence.store.postgres import _PIN, PostgresStore

    schema = unique_name("pglend")
    pool = psycopg_pool.ConnectionPool(
        f"{PG_DSN}?options=-c%20synchronous_commit%3Doff", min_size=1, max_size=1, open=False
    )
    pool.open(wait=True)
    try:
        store = PostgresStore(pool=pool, schema=schema)
        fence = EffectFence(store=store)
        real = psycopg.Connection.execute

        def interrupted(self: Any, query: Any, *a: Any, **k: Any) -> Any:
            if query == _PIN:  # the step's settings, once autocommit is switched on
                raise KeyboardInterrupt
            return real(self, query, *a, **k)

        monkeypatch.setattr(psycopg.Connection, "execute", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fence.prepare(req())
        monkeypatch.setattr(psycopg.Connection, "execute", real)
        with pool.connection() as c:
            assert c.autocommit is False, "the caller's connection came back in autocommit"
        assert fence.prepare(req()).fresh  # nothing was decided; the store goes on
        store.close()
    finally:
        pool.close()
        drop_pg_schema(schema)


def test_pg_a_dead_connection_of_the_callers_pool_is_store_unavailable() -> None:
    """A pool passed in is checked connection by connection on first use; a connection the
    server had dropped made that check raise the driver's own error out of prepare, untyped
    (found by review). It is store_unavailable, nothing decided, and the next call works."""
    need("pg")
    import psycopg_pool

    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pgfault")
    app = schema + "_pool"
    pool = psycopg_pool.ConnectionPool(
        f"{PG_DSN}?application_name={app}",
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True},
        open=False,
    )
    pool.open(wait=True)
    try:
        store = PostgresStore(pool=pool, schema=schema)
        fence = EffectFence(store=store)
        with pool.connection() as conn:  # a connection the store has not checked yet
            store._checked.discard(conn)
        with _pg_admin() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s",
                (app,),
            )
            until(
                lambda: (
                    not admin.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE application_name = %s", (app,)
                    ).fetchall()
                ),
                "the backend gone",
            )
        with pytest.raises(StoreUnavailable):
            fence.prepare(req())
        assert fence.prepare(req()).fresh  # nothing was decided; the pool reconnected
        store.close()
    finally:
        pool.close()
        drop_pg_schema(schema)


@pytest.mark.parametrize("step", ["prepare", "commit", "abort", "release", "renew"])
def test_pg_a_write_refused_as_read_only_is_store_unavailable(
    pg: Any, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A standby after a failover refuses writes (SQLSTATE 25006). The statement applied
    nothing, but psycopg raises it as InternalError, which escaped every step untyped:
    the driver then neither retried its commit nor told its caller the effect ran (found
    by review). Each step is store_unavailable now, the record is as it was, and the
    same step goes through once the server takes writes again."""
    fence = EffectFence(store=pg)
    ticket = fence.prepare(req()).ticket
    real = pg._execute

    def standby(conn: Any, query: Any, params: Any) -> Any:
        conn.execute("SET default_transaction_read_only = on")
        try:
            return real(conn, query, params)
        finally:
            conn.execute("SET default_transaction_read_only = off")

    calls: dict[str, Callable[[], Any]] = {
        "prepare": lambda: fence.prepare(req("charge:2")),
        "commit": lambda: fence.commit(ticket, "r"),
        "abort": lambda: fence.abort(ticket, "unsure"),
        "release": lambda: fence.release(ticket),
        "renew": lambda: fence.renew(ticket),
    }
    monkeypatch.setattr(pg, "_execute", standby)
    with pytest.raises(StoreUnavailable, match="read-only"):
        calls[step]()
    monkeypatch.setattr(pg, "_execute", real)
    rec = pg.get("charge:1")
    assert rec is not None and rec.state is State.IN_FLIGHT and rec.token == ticket.token
    assert pg.get("charge:2") is None
    calls[step]()  # nothing was applied: the same step goes through


def test_pg_a_claim_that_finds_a_record_reads_it_without_a_lock(pg: Any) -> None:
    """PostgreSQL is put-first: prepare claims as if the slot were empty, so every replay
    and every duplicate is a claim that finds a record. Locking that row (FOR UPDATE, as a
    claim expecting a record does) would make each of them wait behind any step holding it
    and pay a WAL flush. With another transaction holding the row, both forms of the claim
    (prepare's own statement, and the claim function an older process calls) answer at
    once, MOVED with the record and the server's clock."""
    from effectfence.store.base import MOVED

    fence = EffectFence(FenceConfig(auto_sweep=False), store=pg)
    cert = fence.commit(fence.prepare(req()).ticket, {"charge_id": "ch_1"})
    rec = pg.get("charge:1")
    seq = pg.current("order:777")
    answers: list[Any] = []

    def claims() -> None:
        for compare in ((), (("order:777", seq),)):  # the second is the general claim
            answers.append(
                _catch(
                    lambda compare=compare: pg.claim(
                        "charge:1",
                        expect=None,
                        fingerprint=rec.fingerprint,
                        domain="order:777",
                        agent="b",
                        lease_ttl=30.0,
                        reclaim_after=60.0,
                        compare=compare,
                        reserve_at=None,
                    )
                )
            )

    with _pg_admin() as admin:
        admin.autocommit = False
        admin.execute(
            f'SELECT 1 FROM "{pg.schema}".intents WHERE intent = %s FOR UPDATE', ("charge:1",)
        )
        worker = threading.Thread(target=claims, daemon=True)
        worker.start()
        worker.join(10)
        waited = worker.is_alive()
        admin.rollback()  # lets a claim that waited for the lock finish
        worker.join(10)
    assert not waited, "a claim that found a record waited for the row's lock"
    assert len(answers) == 2
    for step in answers:
        assert step.outcome is MOVED, step
        assert step.found.state is State.DONE and step.found.cert.hash == cert.hash
        assert step.now is not None and abs(step.now - pg.now()) < 60
    after = pg.get("charge:1")
    assert after is not None and (after.token, after.until, after.reclaim_at) == (
        rec.token,
        rec.until,
        rec.reclaim_at,
    ), "nothing written"


#: the three forms of a claim of an empty slot: plain, with a read set, with an expected seq
CLAIM_FORMS = ("plain", "read_set", "expected_seq")


@contextlib.contextmanager
def _prepare_waiting_on_an_insert(pg: Any, form: str) -> Iterator[tuple[Any, list[Any]]]:
    """A prepare of ``charge:1`` (in the claim ``form``) waiting on another transaction
    that inserted the intent and holds it open (yielded, with where the prepare's answer
    lands once it is let go)."""
    import psycopg

    fence = EffectFence(FenceConfig(auto_sweep=False), store=pg)
    fence.commit(fence.prepare(req("other")).ticket, "x")  # the domain row exists
    fence.commit(fence.prepare(req("read", domain="ledger:1")).ticket, "x")
    extra: dict[str, Any] = {
        "plain": {},
        "read_set": {"read_set": (("ledger:1", pg.current("ledger:1")),)},
        "expected_seq": {"expected_seq": pg.current("order:777")},
    }[form]
    request = EffectRequest("charge:1", "order:777", "charge", {"cents": 77700}, "a", **extra)
    holder = psycopg.connect(PG_DSN)
    holder.execute(
        f'INSERT INTO "{pg.schema}".intents (intent, state, token, fingerprint, domain, agent, '
        "lease_until, cert, until, reason, since, seq, reclaim_at) SELECT 'charge:1', state, "
        "token, fingerprint, domain, agent, lease_until, cert, until, reason, since, seq, "
        f"reclaim_at FROM \"{pg.schema}\".intents WHERE intent = 'other'"
    )
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_catch(lambda: fence.prepare(request))))
    t.start()
    try:
        with _pg_admin() as admin:
            until(lambda: _blocked_pids(admin, pg.schema, "claim"), "a claim waiting")
        yield holder, got
    finally:
        holder.rollback()  # the claim goes on
        holder.close()
        t.join(timeout=30)


@pytest.mark.parametrize("form", CLAIM_FORMS)
def test_pg_a_claim_takes_the_slot_before_the_domain(pg: Any, form: str) -> None:
    """Lock order: every step that finds a record holds its row, then its domain. A claim of
    an empty slot that took the domain first and then waited on the intent's key (another
    transaction inserting it, or a commit of it adding a key entry) deadlocked with that
    transaction as soon as it wanted the domain; PostgreSQL broke it after a second. Here a
    transaction inserts the intent and holds it while a claim of it waits: the domain must
    still be free, and so must the domains of its read set."""
    with _prepare_waiting_on_an_insert(pg, form) as (holder, got):
        free = _catch(
            lambda: holder.execute(
                f'SELECT 1 FROM "{pg.schema}".domains WHERE domain = ANY(%s) '
                "FOR NO KEY UPDATE NOWAIT",
                (["order:777", "ledger:1"],),
            )
        )
    assert not isinstance(free, BaseException), f"the waiting claim held the domain: {free}"
    assert len(got) == 1 and getattr(got[0], "fresh", False), got


@pytest.mark.parametrize("form", CLAIM_FORMS)
def test_pg_a_claim_that_waited_draws_its_token_after_the_one_it_waited_for(
    pg: Any, form: str
) -> None:
    """Fencing tokens grow: a claim whose insert waited for another transaction holding the
    intent (here one that claims it, draws a token, and clears it again) must draw its own
    token after that one's. Drawn before the wait, it came out smaller (seen by the
    linearizability test: fresh 9, cleared, then fresh 8 for the same intent)."""
    with _prepare_waiting_on_an_insert(pg, form) as (holder, got):
        row = holder.execute(f"SELECT nextval('\"{pg.schema}\".tokens')").fetchone()
        assert row is not None
        drawn = row[0]
        holder.execute(f'DELETE FROM "{pg.schema}".intents WHERE intent = %s', ("charge:1",))
        holder.commit()  # claimed, drew a token, cleared: the slot is empty again
    assert len(got) == 1 and getattr(got[0], "fresh", False), got
    assert got[0].ticket.token > drawn


def test_pg_a_claim_that_waited_past_its_lease_is_not_admitted_lapsed(pg: Any) -> None:
    """A claim of an empty slot read the server's clock before its insert and its domain
    lock, then waited on the domain's row (held by another step). It returned a Fresh
    ticket whose lease had ended before it was handed out: the very next duplicate took it
    over, and both ran the effect (G1; found by review). The lease is set again once the
    claim holds its locks."""
    fence = EffectFence(FenceConfig(lease_ttl=1.0, auto_sweep=False), store=pg)
    fence.commit(fence.prepare(req("warm")).ticket, "ok")  # the domain row exists
    blocker = _lock_domain(pg.schema, "order:777")
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(fence.prepare(req("charge:7"))))
    t.start()
    with _pg_admin() as admin:
        until(lambda: _blocked_pids(admin, pg.schema, "claim"), "the claim to wait")
    time.sleep(1.5)  # the domain is held longer than a lease (the claim waits on it)
    blocker.rollback()
    blocker.close()
    t.join(30)
    assert len(got) == 1 and got[0].fresh, got
    with pytest.raises(IntentInFlight):  # a duplicate, right after: the lease holds
        fence.prepare(req("charge:7", agent="b"))


def test_pg_a_fresh_attempt_is_two_statements_and_a_replay_one(pg: Any) -> None:
    """put_first on PostgreSQL: prepare claims without reading first, so a fresh attempt is
    a claim and a complete (it was a read, a claim and a complete) and a replay is the
    claim alone, answered with the record it found."""
    fence = EffectFence(FenceConfig(auto_sweep=False), store=pg)
    fence.commit(fence.prepare(req("warm")).ticket, {"charge_id": "ch_0"})  # pool, schema
    sent: list[bytes] = []
    execute = pg._execute

    def spy(conn: Any, query: Any, params: Any) -> Any:
        sent.append(query)
        return execute(conn, query, params)

    pg._execute = spy
    cert = fence.commit(fence.prepare(req()).ticket, {"charge_id": "ch_1"})
    assert len(sent) == 2 and b"claim(" in sent[0] and b"complete(" in sent[1], sent
    sent.clear()
    again = fence.prepare(req(agent="b"))
    assert not again.fresh and again.cert.hash == cert.hash
    assert len(sent) == 1 and b"claim(" in sent[0], sent


def _catch(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as exc:
        return exc


# -- faults: Redis ----------------------------------------------------------------------------


@pytest.fixture
def rs() -> Iterator[Any]:
    need("redis")
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from effectfence.store.redis import RedisStore

    prefix = unique_name("redisfault")
    client = redis.Redis.from_url(REDIS_URL, client_name=prefix, retry=Retry(NoBackoff(), 0))
    store = RedisStore(client=client, prefix=prefix)
    yield store
    store.close()
    client.close()
    drop_redis_prefix(prefix)


def test_a_failed_sweep_never_undoes_a_claim_that_applied(url: str) -> None:
    """A put-first store claims, then the fence sweeps (the first prepare always does):
    a sweep that failed raised "nothing was decided" out of a prepare whose claim had
    applied, and the intent sat in flight under a token nobody held (found by review). The
    admission stands; the sweep is tried again later."""
    fence = EffectFence.from_url(url)
    assert fence.store.put_first
    calls: list[int] = []

    def failing(limit: int | None = None) -> int:
        calls.append(1)
        raise StoreUnavailable("the sweep's connection broke")

    fence.store.sweep = failing  # type: ignore[method-assign]
    try:
        adm = fence.prepare(req())
        assert adm.fresh and calls == [1]
        rec = fence.store.get("charge:1")
        assert rec is not None and rec.token == adm.ticket.token
        assert fence.commit(adm.ticket, "r").verify()
    finally:
        fence.close()


def test_redis_an_intent_claimed_again_elsewhere_leaves_no_in_flight_entry(rs: Any) -> None:
    """A holder died, Redis expired its record's key, and the intent was claimed again on
    another domain: the sweep found a record under the key, took it for the version its
    index entry was for, and the old domain's in-flight set kept the intent for ever (G8,
    found by review)."""
    clock = FakeClock()
    store = type(rs)(client=rs._r, prefix=rs.prefix, clock=clock)
    fence = EffectFence(FenceConfig(lease_ttl=5.0, lapsed_grace=0.0, auto_sweep=False), store=store)
    fence.prepare(EffectRequest("job:1", "domA", "send", {"n": 1}, "a"))  # its holder dies
    rs._r.delete(f"{{{rs.prefix}}}:i:job:1")  # what the key's expiry does
    fence.commit(fence.prepare(EffectRequest("job:1", "domB", "send", {"n": 2}, "b")).ticket, 1)
    clock.advance(30)  # the domA entry falls due
    fence.sweep()
    assert store.in_flight("domA") == 0
    assert rs._r.smembers(f"{{{rs.prefix}}}:fl:domA") == set()


def test_redis_a_lost_step_that_applied_meanwhile_is_not_lease_lost(rs: Any) -> None:
    """The connection broke and the first run applied after the store looked (a command
    the server had received, run late): the re-run found the record moved, and the abort
    that had applied was reported lease_lost."""
    from effectfence.store import redis as redis_store

    fence = EffectFence(store=rs)
    ticket = fence.prepare(req()).ticket
    real, lost = rs._call, []

    def late(op: str, script: Any, keys: Any, args: Any) -> Any:
        if op == "fail" and not lost:
            lost.append(op)
            raise redis_store._Lost("connection reset")  # sent; its reply never came
        if op == "fail":
            real(op, script, keys, args)  # the first run, late
        return real(op, script, keys, args)

    rs._call = late
    try:
        fence.abort(ticket, "boom")
    finally:
        rs._call = real
    rec = rs.get("charge:1")
    assert rec is not None and rec.state is State.FAILED and rec.reason == "boom"


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_release_that_applied_and_lost_its_reply_is_not_lease_lost(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A release applied and its reply was lost; before the store re-read, the retry the
    release allowed claimed the intent. The store found a record under another token and the
    releasing holder was told lease_lost, though its release applied and nobody took its
    lease (found by review). A release leaves no trace to tell that from a takeover: the
    answer is store_unavailable (not retryable), never lease_lost."""
    import importlib

    store = request.getfixturevalue("rs" if kind == "redis" else "pg")
    lost = importlib.import_module(f"effectfence.store.{kind}")._Lost
    hook = "_call" if kind == "redis" else "_run"  # where a step's statement is sent
    fence = EffectFence(store=store)
    other = EffectFence(store=store)
    ticket = fence.prepare(req()).ticket
    real = getattr(store, hook)
    retried: list[Any] = []

    def lost_after_applying(op: str, *args: Any) -> Any:
        out = real(op, *args)
        if op == "release" and not retried:
            setattr(store, hook, real)
            retried.append(other.prepare(req(agent="b")))  # the retry the release allowed
            raise lost("connection reset")  # the reply never came
        return out

    setattr(store, hook, lost_after_applying)
    try:
        got = _catch(lambda: fence.release(ticket))
    finally:
        setattr(store, hook, real)
    assert retried and retried[0].fresh
    assert isinstance(got, StoreUnavailable), f"release that applied answered {got!r}"
    assert not got.retryable and "can't be told" in got.message
    rec = store.get("charge:1")
    assert rec is not None and rec.token == retried[0].ticket.token


class _BankDown(Exception):
    """A function's own 'nothing was sent' error, declared did_not_fire."""


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_the_driver_does_not_retry_a_release_the_store_says_not_to(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The case above through the driver: a did_not_fire exception, the release applied
    and lost its reply, a new claim came first. The store answers "can't be told", not
    retryable; the driver retried it anyway and the retry answered lease_lost, which the
    caller's note then said (found by review of the store fix)."""
    import importlib

    store = request.getfixturevalue("rs" if kind == "redis" else "pg")
    lost = importlib.import_module(f"effectfence.store.{kind}")._Lost
    hook = "_call" if kind == "redis" else "_run"
    fence = EffectFence(store=store)
    other = EffectFence(store=store)
    real = getattr(store, hook)
    retried: list[Any] = []

    def lost_after_applying(op: str, *args: Any) -> Any:
        out = real(op, *args)
        if op == "release" and not retried:
            retried.append(other.prepare(req("pay:1", agent="b", domain="d")))
            raise lost("connection reset")
        return out

    @fenced(fence, intent="pay:{n}", domain="d", agent="a", did_not_fire=(_BankDown,))
    def pay(n: int) -> int:
        setattr(store, hook, lost_after_applying)
        raise _BankDown("bank down, nothing sent")

    try:
        with pytest.raises(_BankDown) as got:
            pay(1)
    finally:
        setattr(store, hook, real)
    assert retried and retried[0].fresh
    notes = "\n".join(getattr(got.value, "__notes__", []))
    assert "can't be told" in notes and "lease_lost" not in notes, notes
    assert "stays in flight" not in notes, notes  # it is another caller's now


def _clients(admin: Any, name: str, cmd: str | None = None) -> list[int]:
    return [
        int(c["id"])
        for c in admin.client_list()
        if c.get("name") == name and (cmd is None or c.get("cmd") == cmd)
    ]


def test_redis_connections_killed_before_a_step_answer_correctly(rs: Any) -> None:
    import redis

    fence = EffectFence(store=rs)
    ticket = fence.prepare(req()).ticket
    admin = redis.Redis.from_url(REDIS_URL)
    for cid in _clients(admin, rs.prefix):
        admin.client_kill_filter(_id=cid)
    cert = fence.commit(ticket, "r")  # a killed idle connection is replaced, not used
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    admin.close()


def test_redis_connection_killed_mid_complete_answers_from_the_store(rs: Any) -> None:
    """CLIENT PAUSE WRITE holds the commit's script unrun on the server; the test kills that
    connection, sees the record still in flight, and lets the store's retry through."""
    import redis

    fence = EffectFence(store=rs)
    ticket = fence.prepare(req()).ticket
    admin = redis.Redis.from_url(REDIS_URL)
    admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
    try:
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(_catch(lambda: fence.commit(ticket, "r"))))
        t.start()
        (cid,) = until(lambda: _clients(admin, rs.prefix, "evalsha"), "a paused commit")
        admin.client_kill_filter(_id=cid)
        until(
            lambda: [c for c in _clients(admin, rs.prefix, "evalsha") if c != cid],
            "the retried commit",
        )
        rec = rs.get("charge:1")  # reads are not paused
        assert rec.state is State.IN_FLIGHT and rec.token == ticket.token
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    t.join(timeout=30)
    cert = got[0]
    assert not isinstance(cert, BaseException), cert
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    assert [c.hash for c in rs.certs("order:777")] == [cert.hash]
    admin.close()


def test_redis_reply_lost_after_commit_is_not_a_lie(rs: Any) -> None:
    import redis

    fence = EffectFence(store=rs)
    ticket = fence.prepare(req()).ticket
    real = rs._s_complete

    def lose_reply(*a: Any, **kw: Any) -> Any:
        real(*a, **kw)
        raise redis.ConnectionError("Connection closed by server.")

    rs._s_complete = lose_reply
    try:
        cert = fence.commit(ticket, "r")
    finally:
        rs._s_complete = real
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash


def test_redis_claim_reply_lost_is_unavailable_never_fresh(rs: Any) -> None:
    """A claim whose reply is lost may have taken the lease: the caller runs nothing."""
    import redis

    fence = EffectFence(store=rs)
    real = rs._s_claim

    def lose_reply(*a: Any, **kw: Any) -> Any:
        real(*a, **kw)
        raise redis.ConnectionError("Connection closed by server.")

    rs._s_claim = lose_reply
    try:
        with pytest.raises(StoreUnavailable):
            fence.prepare(req())
    finally:
        rs._s_claim = real
    with pytest.raises(IntentInFlight):  # the lease it took lapses like a crashed holder's
        fence.prepare(req(agent="b"))
    assert fence.stats()["prepare"]["store_unavailable"] == 1


def test_redis_a_claim_that_lost_its_reply_answers_only_what_it_cannot_have_made(
    rs: Any,
) -> None:
    """Redis claims first too, so a replay's one round trip is the claim script. When its
    reply is lost, a re-read that finds the intent done answers, as on PostgreSQL: the
    duplicate replays instead of hearing store_unavailable (found by review). A record in
    flight may be the lost claim's own: that stays unavailable, and nothing runs twice."""
    import redis

    fence = EffectFence(FenceConfig(auto_sweep=False), store=rs)
    cert = fence.commit(fence.prepare(req()).ticket, "ok")
    real = rs._s_claim
    lost: list[int] = []

    def lose_reply(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        if not lost:
            lost.append(1)
            raise redis.ConnectionError("Connection closed by server.")
        return out

    rs._s_claim = lose_reply
    try:
        again = fence.prepare(req(agent="b"))
        assert lost, "the claim's reply was lost"
        assert not again.fresh and again.cert.hash == cert.hash
        lost.clear()
        got = _catch(lambda: fence.prepare(req("charge:2")))
        assert lost
    finally:
        rs._s_claim = real
    assert isinstance(got, StoreUnavailable), got
    rec = rs.get("charge:2")
    assert rec is not None and rec.state is State.IN_FLIGHT  # it applied; nobody holds it


def test_redis_a_waiter_is_not_told_live_before_the_subscription_is(rs: Any) -> None:
    """A PUBLISH the server handles before the listener's SUBSCRIBE reaches nobody. A
    listener counted as live once it had *sent* SUBSCRIBE let a waiter sleep through the
    change it waited for (found by review). Here the SUBSCRIBE is held back until after the
    commit: the waiter must see the commit anyway, long before its poll would."""
    from effectfence.store.redis import RedisStore

    holder_store = RedisStore(client=rs._r, prefix=rs.prefix)
    holder = EffectFence(FenceConfig(lease_ttl=60.0), store=holder_store)
    ticket = holder.prepare(req()).ticket
    gate = threading.Event()
    real_pubsub = rs._r.pubsub

    def held_pubsub(*args: Any, **kwargs: Any) -> Any:
        ps = real_pubsub(*args, **kwargs)
        subscribe = ps.subscribe

        def later(*channels: Any, **kw: Any) -> None:
            threading.Thread(
                target=lambda: (gate.wait(30), subscribe(*channels, **kw)), daemon=True
            ).start()

        ps.subscribe = later
        return ps

    rs._r.pubsub = held_pubsub
    rs._waiters.poll = 120.0  # no slow re-reads: only a wake, or not being live, ends it
    done: list[bool] = []
    waiter = EffectFence(FenceConfig(lease_ttl=60.0), store=rs)
    t = threading.Thread(target=lambda: done.append(waiter.wait("charge:1", 50.0)), daemon=True)
    t.start()
    until(lambda: rs._waiters._events, "the waiter's registration")
    holder.commit(ticket, "r")
    gate.set()
    t.join(timeout=20)
    del rs._r.pubsub
    holder_store.close()
    assert done == [True], "the waiter slept through the commit"


@pytest.fixture
def own_rs() -> Iterator[Any]:
    """A Redis store built from a URL: its steps go on its own connections."""
    need("redis")
    from effectfence.store.redis import RedisStore

    prefix = unique_name("redisown")
    store = RedisStore(with_query(REDIS_URL, client_name=prefix), prefix=prefix)
    assert store._s_claim._conns is not None  # the store's own connections are under test
    yield store
    store.close()
    drop_redis_prefix(prefix)


def test_redis_steps_survive_a_server_that_lost_its_scripts(own_rs: Any) -> None:
    """Steps send EVALSHA on the store's own connections (no redis-py Script layer); a
    server that forgot the scripts (a restart, SCRIPT FLUSH) answers NOSCRIPT, and the step
    loads its script and runs, once."""
    import redis

    fence = EffectFence(store=own_rs)
    ticket = fence.prepare(req()).ticket
    admin = redis.Redis.from_url(REDIS_URL)
    admin.script_flush()
    cert = fence.commit(ticket, "r")
    admin.script_flush()
    again = fence.prepare(req(agent="b"))
    assert not again.fresh and again.cert.hash == cert.hash
    admin.close()


def test_redis_own_connections_killed_while_idle_are_replaced_before_a_claim(
    own_rs: Any,
) -> None:
    """A claim on a connection the server hung up would fail ("unavailable", since a lost
    claim may have applied). Each connection is checked before reuse: a fresh intent
    after every connection of the store was killed is still admitted."""
    import redis

    fence = EffectFence(store=own_rs)
    fence.commit(fence.prepare(req("charge:warm")).ticket, "r")
    admin = redis.Redis.from_url(REDIS_URL)
    killed = _clients(admin, own_rs.prefix)
    assert killed
    for cid in killed:
        admin.client_kill_filter(_id=cid)
    until(lambda: not set(killed) & set(_clients(admin, own_rs.prefix)), "the kills")
    assert fence.prepare(req("charge:after-kill")).fresh
    admin.close()


def test_redis_a_forked_child_never_uses_its_parents_connections(own_rs: Any) -> None:
    """A socket shared across a fork would interleave two processes' replies: the child
    opens its own, and its steps work."""
    import multiprocessing

    fence = EffectFence(store=own_rs)
    fence.commit(fence.prepare(req("charge:parent")).ticket, "r")
    parents = {id(c) for c in own_rs._conns._all}
    assert parents

    def child(out: Any) -> None:
        conn = own_rs._conns.take()
        fresh = EffectFence(store=own_rs).prepare(req("charge:child")).fresh
        out.send((id(conn) not in parents, fresh))

    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=child, args=(theirs,))
    proc.start()
    assert mine.poll(30), "the child did not answer"
    assert mine.recv() == (True, True)
    proc.join(30)
    assert proc.exitcode == 0
    # and the parent's connections still work
    assert fence.prepare(req("charge:parent", agent="b")).fresh is False


def _pg_child(store: Any, out: Any) -> None:
    inherited = {id(c) for c in store._pool._pool}
    fresh = EffectFence(store=store).prepare(req("charge:child")).fresh
    with store._conn("test") as conn:
        own = id(conn) not in inherited
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    try:
        foreign = EffectFence(store=_foreign_pool_store[0]).prepare(req("charge:x")).fresh
    except StoreUnavailable as exc:
        foreign = exc.message
    out.send((own, fresh, backend, foreign))


_foreign_pool_store: list[Any] = []


def test_pg_a_forked_child_never_uses_its_parents_connections(pg: Any) -> None:
    """A pooled connection's socket is shared with the parent after a fork: two processes'
    messages would interleave on one session. The child opens a pool of its own (a caller's
    pool can't be replaced: refused, unavailable), and the parent's sessions still work."""
    import multiprocessing

    import psycopg_pool

    from effectfence.store.postgres import PostgresStore

    fence = EffectFence(store=pg)
    fence.commit(fence.prepare(req("charge:parent")).ticket, "r")
    with pg._conn("test") as conn:
        parent_backends = {conn.execute("SELECT pg_backend_pid()").fetchone()[0]}
    theirs_pool = psycopg_pool.ConnectionPool(PG_DSN, min_size=1, max_size=1, open=True)
    schema = unique_name("pgforkpool")
    foreign = PostgresStore(pool=theirs_pool, schema=schema)
    _foreign_pool_store[:] = [foreign]
    try:
        ctx = multiprocessing.get_context("fork")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_pg_child, args=(pg, theirs))
        proc.start()
        assert mine.poll(30), "the child did not answer"
        own, fresh, backend, refused = mine.recv()
        proc.join(30)
        assert proc.exitcode == 0
        assert own is True and fresh is True and backend not in parent_backends
        assert isinstance(refused, str) and "opened before this process was forked" in refused
        # the parent's connections still work, and see the child's claim
        assert fence.prepare(req("charge:parent", agent="b")).fresh is False
        assert pg.get("charge:child") is not None
    finally:
        _foreign_pool_store.clear()
        foreign.close()
        theirs_pool.close()
        drop_pg_schema(schema)


def test_pg_sealing_key_cut_mid_insert_is_unavailable_or_the_key(pg: Any) -> None:
    """The key's insert cut (applied or not): the store answers the key it holds, or
    store_unavailable, never its internal _Lost (found by review)."""
    import psycopg

    real = pg._execute
    for applies in (False, True):
        pg._key = None

        def cut(conn: Any, query: Any, params: Any, applies: bool = applies) -> Any:
            if "sealing_key" in str(query) and "INSERT" in str(query):
                if applies:
                    real(conn, query, params)
                conn.close()
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return real(conn, query, params)

        pg._execute = cut
        try:
            if applies:
                assert len(pg.sealing_key()) == 32
            else:
                with pytest.raises(StoreUnavailable):
                    pg.sealing_key()
        finally:
            pg._execute = real


def _pg_close_in_child(store: Any) -> None:
    store.close()  # leaving an inherited ``with fence:``, say
    os._exit(0)


def test_pg_a_forked_childs_close_leaves_its_parents_sessions_alone(pg: Any) -> None:
    """close() in a child that never used the store closed the pool it inherited, sending
    a Terminate on the parent's sockets (found by review)."""
    import multiprocessing

    with pg._conn("test") as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    proc = multiprocessing.get_context("fork").Process(target=_pg_close_in_child, args=(pg,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    with _pg_admin() as admin:
        alive = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (backend,)
        ).fetchone()[0]
    assert alive == 1, "the child's close() ended the parent's session"
    assert EffectFence(store=pg).prepare(req("charge:after-fork")).fresh


def test_redis_a_script_the_server_still_lacks_is_unavailable_and_the_commit_retried(
    own_rs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOSCRIPT after the script's reload (flushed again, or another server behind a
    proxy) came out untyped: the commit was neither retried nor fenced, and once the lease
    lapsed an identical call ran the effect again (found by review). It ran nothing: it is
    store_unavailable, and the driver's retry commits."""
    import redis

    from effectfence.driver import Options, run_sync

    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0), raising=False)
    real = own_rs._s_complete
    flushed = [2]  # the first try and its reload both find no script

    def missing(keys: Any, args: Any) -> Any:
        if flushed[0]:
            flushed[0] -= 1
            raise redis.exceptions.NoScriptError("No matching script. Please use EVAL.")
        return real(keys=keys, args=args)

    monkeypatch.setattr(own_rs, "_s_complete", missing)
    fence = EffectFence(store=own_rs)
    with pytest.raises(StoreUnavailable):
        fence.commit(fence.prepare(req("charge:flushed")).ticket, "r")
    runs: list[int] = []
    done = run_sync(fence, req("charge:ran"), Options(), lambda t: runs.append(1) or "r")
    assert runs == [1] and done.fresh
    assert fence.intent_status("charge:ran").state == "done"


def test_redis_store_refuses_a_client_that_decodes_replies() -> None:
    """With decode_responses the steps read str where they expect bytes: a commit applied
    on the server and then raised, and every replay of it raised (found by review)."""
    need("redis")
    from effectfence.store.redis import RedisStore

    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(with_query(REDIS_URL, decode_responses="true"), prefix=unique_name("dec"))


def test_redis_own_connections_keep_the_max_connections_bound() -> None:
    """max_connections bounds the store's own connections as it bounded the pool: one more
    step while all are in use is refused as unavailable, and nothing is written."""
    need("redis")
    from effectfence.store.redis import RedisStore

    prefix = unique_name("redismax")
    store = RedisStore(REDIS_URL, prefix=prefix, max_connections=2)
    try:
        held = [store._conns.take(), store._conns.take()]  # both, as two steps in flight
        with pytest.raises(StoreUnavailable):
            EffectFence(store=store).prepare(req("charge:bounded"))
        for conn in held:
            store._conns.give(conn)
        assert store.get("charge:bounded") is None
        assert EffectFence(store=store).prepare(req("charge:bounded")).fresh
    finally:
        store.close()
        drop_redis_prefix(prefix)


def test_redis_on_a_single_connection_client_goes_through_redis_py(rs: Any) -> None:
    """A client the caller passed in keeps its own pool: steps go through redis-py's
    Script on it, and the fence works the same."""
    import redis

    from effectfence.store.redis import RedisStore

    one = redis.Redis.from_url(REDIS_URL, single_connection_client=True)
    store = RedisStore(client=one, prefix=rs.prefix)
    assert store._s_claim._conns is None
    fence = EffectFence(store=store)
    cert = fence.commit(fence.prepare(req("charge:single")).ticket, "r")
    assert fence.prepare(req("charge:single", agent="b")).cert.hash == cert.hash
    store.close()
    one.close()


def test_redis_reports_its_persistence(rs: Any) -> None:
    d = rs.durability()
    assert d["appendonly"] in ("yes", "no") and "verdict" in d
    safe = d["appendonly"] == "yes" and d["appendfsync"] == "always"
    assert d["acknowledged_writes_survive_a_crash"] is safe
    assert rs.describe()["durability"] == d


# -- Redis settings the shared server must never be put through: a private redis-server -------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``start(*args)``: a redis-server of the test's own on a free port (its URL), stopped
    at teardown: eviction policies, demotion to a replica and OOM are for it, never for the
    shared server. Skips without redis-server (fails with EFFECTFENCE_REQUIRE_SERVICES=1)."""
    import shutil

    binary = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        binary = None
    if binary is None:
        msg = "redis-server (or redis-py) is not installed here"
        if REQUIRE_SERVICES:
            pytest.fail(
                msg + "; EFFECTFENCE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False
            )
        pytest.skip(msg)
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
             "--save", "", "--appendonly", "no", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        procs.append(proc)
        client = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read() if proc.poll() is not None and proc.stderr else b""
                    raise AssertionError(
                        f"redis-server on port {port} did not start: {err.decode()!r}"
                    ) from None
                time.sleep(0.02)
        client.close()
        return f"redis://127.0.0.1:{port}/0"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()


def _admin(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru"])
def test_redis_refuses_to_open_where_eviction_is_possible(
    private_redis: Callable[..., str], policy: str
) -> None:
    """Records carry TTLs (volatile-* may evict one in flight: a second execution), and
    allkeys-* may evict the token counter: the store refuses to open, typed, naming the
    setting and the fix, and writes nothing."""
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", policy)
    with pytest.raises(StoreUnavailable) as refused:
        RedisStore.from_url(url)
    exc = refused.value
    assert "maxmemory-policy noeviction" in exc.message and policy in exc.message
    assert exc.details["setting"] == "maxmemory-policy"
    assert exc.details["maxmemory_policy"] == policy and exc.details["maxmemory"] > 0
    assert exc.retryable is False and "noeviction" in exc.recover
    admin = _admin(url)
    assert admin.dbsize() == 0
    admin.close()


def test_redis_allow_eviction_opens_and_says_so_loudly(private_redis: Callable[..., str]) -> None:
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru")
    opens: list[Callable[[], Any]] = [
        lambda: RedisStore.from_url(with_query(url, allow_eviction="true")),
        lambda: open_store(url, allow_eviction=True),
    ]
    for i, open_ in enumerate(opens):
        store = open_()
        d = store.durability()
        assert d["eviction"] == "possible" and d["eviction_allowed"] is True
        assert d["maxmemory"] == 100 * 1024 * 1024 and d["maxmemory_policy"] == "volatile-lru"
        assert d["verdict"].startswith("EVICTION POSSIBLE (opened with allow_eviction)")
        described = store.describe()
        assert described["warning"] == d["verdict"] and described["durability"] == d
        fence = EffectFence(store=store)
        fence.commit(fence.prepare(req(f"charge:{i}")).ticket, "r")
        store.close()


def test_redis_opens_with_noeviction_and_reports_the_memory_settings(
    private_redis: Callable[..., str],
) -> None:
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", "noeviction")
    store = RedisStore.from_url(url)
    d = store.durability()
    assert d["maxmemory"] == 100 * 1024 * 1024 and d["maxmemory_policy"] == "noeviction"
    assert d["eviction"] == "off" and d["memory_source"] == "CONFIG GET"
    assert "EVICTION" not in d["verdict"] and "warning" not in store.describe()
    store.close()


def test_redis_refuses_claims_once_the_server_is_switched_to_an_evicting_policy(
    private_redis: Callable[..., str],
) -> None:
    """Settings can change under an open store (CONFIG SET): within eviction_recheck the
    store sees it and refuses new claims until the server is switched back; what is stored
    is still answered."""
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", "noeviction")
    admin = _admin(url)
    store = RedisStore.from_url(url)
    store.eviction_recheck = 0.0  # every claim reads the settings again
    fence = EffectFence(store=store)
    try:
        done = fence.commit(fence.prepare(req("charge:before")).ticket, "r")
        admin.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(StoreUnavailable, match="allkeys-lru") as refused:
            fence.prepare(req("charge:after"))
        assert "noeviction" in refused.value.recover and refused.value.retryable
        assert store.get("charge:after") is None  # nothing was claimed
        assert store.get("charge:before").cert.hash == done.hash  # type: ignore[union-attr]
        assert store.durability()["maxmemory_policy"] == "allkeys-lru"
        admin.config_set("maxmemory-policy", "noeviction")
        assert fence.prepare(req("charge:after")).fresh
    finally:
        store.close()
        admin.close()


def test_redis_reads_eviction_settings_from_info_and_fails_closed_when_unreadable(
    private_redis: Callable[..., str],
) -> None:
    """A managed Redis refuses CONFIG: the settings come from INFO memory. Where INFO is
    refused too, eviction cannot be ruled out: refused, unless allow_eviction."""
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", "volatile-ttl")
    admin = _admin(url)
    admin.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "&*", "+@all", "-config")
    # INFO replication stays: every writing step runs it (the role check, may_write)
    admin.execute_command(
        "ACL", "SETUSER", "blind", "on", ">pw", "~*", "&*", "+@all", "-config", "-info",
        "+info|replication",
    )  # fmt: skip
    admin.execute_command(
        "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-config", "-info"
    )
    noconfig = url.replace("redis://", "redis://noconfig:pw@")
    blind = url.replace("redis://", "redis://blind:pw@")
    with pytest.raises(StoreUnavailable, match="volatile-ttl"):
        RedisStore.from_url(noconfig)
    admin.config_set("maxmemory-policy", "noeviction")  # the private server's, not the shared
    store = RedisStore.from_url(noconfig)
    d = store.durability()
    assert d["memory_source"].startswith("INFO memory") and d["eviction"] == "off"
    assert d["maxmemory_policy"] == "noeviction" and d["maxmemory"] == 100 * 1024 * 1024
    store.close()
    with pytest.raises(StoreUnavailable, match="unreadable"):
        RedisStore.from_url(blind)
    store = RedisStore.from_url(blind, allow_eviction=True)
    d = store.durability()
    assert d["cluster"] == "off"  # INFO cluster refused: CLUSTER MYID answered
    assert d["eviction"] == "unknown" and d["maxmemory"] is None
    assert d["verdict"].startswith("EVICTION UNKNOWN") and "warning" in store.describe()
    assert d["role"] == "master"
    store.close()
    with pytest.raises(StoreUnavailable) as refused:  # no step could run: none is offered
        RedisStore.from_url(
            url.replace("redis://", "redis://noinfo:pw@") + "?prefix=rv_noinfo",
            allow_eviction=True,
        )
    assert refused.value.details["server_reply"].startswith("NOINFO ")
    assert refused.value.retryable is False and "+info|replication" in refused.value.recover
    assert admin.keys("*rv_noinfo*") == []
    # nor CLUSTER: cluster mode can't be ruled out, refused as unreadable eviction is
    admin.execute_command("ACL", "SETUSER", "blind", "-cluster")
    with pytest.raises(StoreUnavailable) as refused:
        RedisStore.from_url(blind + "?prefix=rv_nocl", allow_eviction=True)
    assert refused.value.details["cluster"] == "unknown" and not refused.value.retryable
    assert admin.keys("*rv_nocl*") == []
    store = RedisStore.from_url(blind + "?prefix=rv_nocl&allow_cluster=1", allow_eviction=True)
    assert store.durability()["verdict"].startswith("CLUSTER UNKNOWN")
    store.close()
    admin.close()


def test_redis_refuses_to_open_on_a_writable_replica(private_redis: Callable[..., str]) -> None:
    """A replica that accepts writes (replica-read-only no): what it acknowledges never
    reaches the master and the next resync throws it away. It was reported safe, and a
    fence on it and one on the master both admitted the same intent (found by review). The
    store refuses to open there, typed, naming the URL (not its password) and why."""
    from effectfence.store.redis import RedisStore

    safe = ("--appendonly", "yes", "--appendfsync", "always", "--no-appendfsync-on-rewrite", "no")
    master = private_redis(*safe)
    port = master.rsplit(":", 1)[1].split("/")[0]
    replica = private_redis(*safe, "--replicaof", "127.0.0.1", port, "--replica-read-only", "no")
    admin = _admin(replica)
    admin.execute_command("ACL", "SETUSER", "fence", "on", ">s3cret", "~*", "&*", "+@all")
    on_master = RedisStore.from_url(master + "?prefix=rv_redis_rep")
    deadline = time.monotonic() + 30
    while not admin.exists("{rv_redis_rep}:meta"):  # the store is there, replicated
        assert time.monotonic() < deadline, "the replica never caught up"
        time.sleep(0.05)
    try:
        with pytest.raises(StoreUnavailable) as refused:
            RedisStore.from_url(
                replica.replace("redis://", "redis://fence:s3cret@") + "?prefix=rv_redis_rep"
            )
        exc = refused.value
        assert "replica" in exc.message and "resync" in exc.message and "master" in exc.message
        assert "s3cret" not in exc.message and replica.split("//")[1] in exc.message
        assert exc.details["role"] == "slave" and exc.retryable is False
        assert EffectFence(store=on_master).prepare(req()).fresh  # one execution, on the master
        d = on_master.durability()
        assert d["role"] == "master" and d["acknowledged_writes_survive_a_crash"]
    finally:
        on_master.close()
        admin.close()


def test_redis_refuses_to_open_where_the_role_cannot_be_read(
    private_redis: Callable[..., str],
) -> None:
    """A user denied INFO and ROLE (CONFIG allowed: eviction is read and ruled out) opened
    the store on a writable replica, unrefused, and a fence there and one on the master both
    admitted one intent (found by review of the replica fix). A role that can't be read is
    refused, as eviction that can't be read is."""
    from effectfence.store.redis import RedisStore

    master = private_redis()
    port = master.rsplit(":", 1)[1].split("/")[0]
    replica = private_redis("--replicaof", "127.0.0.1", port, "--replica-read-only", "no")
    admin = _admin(replica)
    admin.execute_command(
        "ACL", "SETUSER", "fence", "on", ">pw", "~*", "&*", "+@all", "-info", "-role"
    )
    try:
        with pytest.raises(StoreUnavailable) as refused:
            RedisStore.from_url(replica.replace("redis://", "redis://fence:pw@") + "?prefix=rv_x")
        assert "can't be read" in refused.value.message and not refused.value.retryable
        assert admin.dbsize() == 0
    finally:
        admin.close()


def test_redis_refuses_claims_once_its_master_is_demoted_to_a_writable_replica(
    private_redis: Callable[..., str],
) -> None:
    """A failover demotes the server the store opened on (it rejoins as a replica of the
    new master, replica-read-only no). The role was read only at open: the store went on
    claiming there, each claim lost at the next resync, while a fence on the new master
    admitted the same intent again (found by review). The role is read again with the
    eviction settings before claims, and claims are refused."""
    from effectfence.store.redis import RedisStore

    old = private_redis("--replica-read-only", "no")
    new = private_redis()
    new_port = new.rsplit(":", 1)[1].split("/")[0]
    on_old = RedisStore.from_url(old + "?prefix=rv_dem")
    assert "not master" not in on_old.durability()["verdict"]
    on_old.eviction_recheck = 0.0  # every claim reads the server's settings again
    admin_old = _admin(old)
    try:
        assert EffectFence(store=on_old).prepare(req("before")).fresh
        admin_old.execute_command("REPLICAOF", "127.0.0.1", new_port)  # the failover
        deadline = time.monotonic() + 30
        while admin_old.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the demoted server never synced"
            time.sleep(0.05)
        with pytest.raises(StoreUnavailable, match="role is slave, not master"):
            EffectFence(store=on_old).prepare(req())
        d = on_old.durability()
        # the verdict follows the role: it still called the demoted server safe (review)
        assert d["role"] == "slave" and not d["acknowledged_writes_survive_a_crash"]
        assert "not master" in d["verdict"], d["verdict"]
    finally:
        on_old.close()
        admin_old.close()


def test_redis_verdict_follows_an_eviction_policy_read_again(
    private_redis: Callable[..., str],
) -> None:
    """Switched to an evicting policy after the store opened, the server's claims are
    refused, but durability() kept the crash-safe verdict read at open, beside eviction
    'possible' (found by review of the role fix, which made the verdict follow the role)."""
    from effectfence.store.redis import RedisStore

    url = private_redis("--maxmemory", "100mb", "--maxmemory-policy", "noeviction")
    admin = _admin(url)
    store = RedisStore.from_url(url + "?prefix=rv_evv")
    store.eviction_recheck = 0.0
    try:
        assert "evict" not in store.durability()["verdict"].lower()
        admin.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(StoreUnavailable, match="allkeys-lru"):
            EffectFence(store=store).prepare(req())
        d = store.durability()
        assert d["eviction"] == "possible" and not d["acknowledged_writes_survive_a_crash"]
        assert "evict" in d["verdict"].lower(), d["verdict"]
        admin.config_set("maxmemory-policy", "noeviction")  # put back: so is the verdict
        assert EffectFence(store=store).prepare(req()).fresh
        assert "evict" not in store.durability()["verdict"].lower()
    finally:
        store.close()
        admin.close()


def test_redis_refuses_to_open_for_a_user_who_may_not_publish(
    private_redis: Callable[..., str],
) -> None:
    """Redis 7 gives a new ACL user no pub/sub channels (acl-pubsub-default resetchannels):
    ``~* +@all`` may write every key, but its PUBLISH is refused. Every step PUBLISHed after
    its writes: the claim applied, under a token nobody held, and the caller got a raw redis
    error (found by review). The store refuses to open, typed, naming the channel, and
    writes nothing."""
    from effectfence.store.redis import RedisStore

    url = private_redis()
    admin = _admin(url)
    admin.execute_command("ACL", "SETUSER", "fence", "on", ">pw", "~*", "+@all")
    try:
        with pytest.raises(StoreUnavailable) as refused:
            RedisStore.from_url(url.replace("redis://", "redis://fence:pw@") + "?prefix=rv_acl")
        exc = refused.value
        assert "PUBLISH" in exc.message and "{rv_acl}:changes" in exc.message
        assert exc.retryable is False and "&{rv_acl}:changes" in exc.recover
        assert admin.dbsize() == 0
    finally:
        admin.close()


def test_redis_refuses_to_open_for_a_user_refused_a_command_or_a_key(
    private_redis: Callable[..., str],
) -> None:
    """A user without EVALSHA, or without the store's keys, got redis-py's raw
    NoPermissionError: at open, or (EVALSHA, which the open's EVAL probe passed) at every
    step (found by review). Refused at open, typed, not retryable, writing nothing; the
    ``recover`` it gives is enough, on a database other than 0 too (its SELECT was refused
    and reported as unreadable settings, found by review): a user made with exactly that
    line runs every step. EVALSHA revoked later: each step is refused, nothing applied."""
    from effectfence.store.redis import RedisStore

    url = private_redis()
    admin = _admin(url)
    admin.execute_command(
        "ACL", "SETUSER", "noevalsha", "on", ">pw", "~*", "&*", "+@all", "-evalsha"
    )
    admin.execute_command("ACL", "SETUSER", "nokey", "on", ">pw", "~other:*", "&*", "+@all")
    try:
        recovers = set()
        for user in ("noevalsha", "nokey"):
            with pytest.raises(StoreUnavailable) as refused:
                RedisStore.from_url(url.replace("redis://", f"redis://{user}:pw@") + "?prefix=rv_u")
            exc = refused.value
            assert exc.retryable is False and exc.details["setting"] == "acl", exc
            assert "no permissions" in exc.message
            recovers.add(exc.recover)
            assert admin.dbsize() == 0
        (recover,) = recovers
        grant = recover.split("ACL SETUSER <user> ", 1)[1].split()
        admin.execute_command("ACL", "SETUSER", "least", "on", ">pw", "resetchannels", *grant)
        db1 = url.replace("redis://", "redis://least:pw@").rsplit("/", 1)[0] + "/1?prefix=rv_u"
        # redis-py's health checks (health_check_interval) PING: refused, a read after an
        # idle spell failed (found by review of a line that had dropped +ping)
        with _admin(db1.split("?")[0]) as least:
            assert least.ping()
        store = RedisStore.from_url(db1)
        try:
            fence = EffectFence(store=store)
            ticket = fence.prepare(req()).ticket
            cert = fence.commit(ticket, "r")
            assert fence.prepare(req(agent="b")).cert.hash == cert.hash
            fence.abort(fence.prepare(req("charge:2")).ticket, "declined")
            assert store.clear("charge:2") is not None and fence.sweep() >= 0
            assert store.durability()["appendfsync"] is not None  # CONFIG GET was allowed
            assert len(store.sealing_key()) == 32  # what the MCP server seals tickets with
            held = fence.prepare(req("charge:3")).ticket
            admin.execute_command("ACL", "SETUSER", "least", "-evalsha")
            for step in (lambda: fence.commit(held, "r"), lambda: fence.prepare(req("charge:4"))):
                with pytest.raises(StoreUnavailable) as refused:
                    step()
                assert refused.value.details["server_reply"].startswith("NOPERM ")
            admin.execute_command("ACL", "SETUSER", "least", "+evalsha")
            rec = store.get("charge:3")
            assert (
                rec is not None and rec.state is State.IN_FLIGHT and store.get("charge:4") is None
            )
        finally:
            store.close()
    finally:
        admin.close()


def test_redis_refuses_a_cluster_unless_allowed_and_types_its_redirects(
    private_redis: Callable[..., str], tmp_path: Path
) -> None:
    """In a cluster, a script that wrote and then touched a key the node no longer holds
    (the prefix's slot migrating) failed halfway, its first writes applied: a commit deleted
    the record in flight, and an identical call was admitted again once the reshard ended
    (found by review). A node in cluster mode is refused at open, typed, writing nothing,
    unless allow_cluster, which the verdict then names. With it, a node that does not serve
    the prefix's slot answers MOVED: that escaped as redis-py's raw MovedError ("9575
    127.0.0.1:7712", no code) at open, and in every step after a reshard (review). Now it is
    refused at open (not retryable), and in a step store_unavailable, nothing applied; both
    name the node that serves the slot."""
    from effectfence.store.redis import RedisStore

    def node(name: str) -> tuple[str, Any, str]:
        bus = str(_free_port())  # by default port + 10000: past 65535 for a high free port
        url = private_redis(
            "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / f"{name}.conf"),
            "--cluster-port", bus,
        )  # fmt: skip
        return url, _admin(url), bus

    (url_a, a, _), (url_b, b, b_bus) = node("a"), node("b")
    try:
        b_port = int(url_b.rsplit(":", 1)[1].split("/")[0])
        a.execute_command("CLUSTER", "MEET", "127.0.0.1", str(b_port), b_bus)
        slot = int(a.execute_command("CLUSTER", "KEYSLOT", "{rv_cl}"))
        a.execute_command("CLUSTER", "ADDSLOTS", *(i for i in range(16384) if i != slot))
        b.execute_command("CLUSTER", "ADDSLOTS", slot)
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in a.execute_command("CLUSTER", "INFO") or (
            b"cluster_state:ok" not in b.execute_command("CLUSTER", "INFO")
        ):
            assert time.monotonic() < deadline, "the two nodes did not form a cluster"
            time.sleep(0.05)
        for url in (url_a, url_b):  # refused on either node, whoever serves the slot
            with pytest.raises(StoreUnavailable) as refused:
                RedisStore.from_url(url + "?prefix=rv_cl")
            exc = refused.value
            assert exc.retryable is False and exc.details["setting"] == "cluster", exc
            assert exc.details["cluster"] == "on" and "allow_cluster" in exc.message
        assert a.dbsize() == 0 and b.dbsize() == 0
        with pytest.raises(StoreUnavailable) as refused:  # allowed, on the wrong node
            RedisStore.from_url(url_a + "?prefix=rv_cl&allow_cluster=true")
        exc = refused.value
        assert exc.retryable is False and exc.details["setting"] == "cluster", exc
        assert exc.details["server_reply"] == f"MOVED {slot} 127.0.0.1:{b_port}"
        assert f"127.0.0.1:{b_port}" in exc.recover and a.dbsize() == 0
        store = RedisStore.from_url(url_b + "?prefix=rv_cl&allow_cluster=true")  # its node
        fence = EffectFence(store=store)
        try:
            d = store.durability()
            assert d["cluster"] == "on" and d["verdict"].startswith("CLUSTER ON")
            assert store.describe()["warning"] == d["verdict"]
            # a recheck's verdict (eviction switched on meanwhile) dropped it (review)
            b.config_set("maxmemory", "100mb")
            b.config_set("maxmemory-policy", "allkeys-lru")
            store.eviction_recheck = 0
            with pytest.raises(StoreUnavailable, match="evict"):
                fence.prepare(req("c:0"))
            d = store.durability()
            assert d["verdict"].startswith("CLUSTER ON") and "allkeys-lru" in d["verdict"]
            assert store.describe()["warning"] == d["verdict"]
            b.config_set("maxmemory-policy", "noeviction")
            assert fence.prepare(req("c:1")).fresh  # read again: claims go on
            # a node that loses its last slot becomes a replica of its taker (Redis 7): the
            # role's recheck would refuse the claim below before its MOVED could
            store.eviction_recheck = 3600
            first = fence.prepare(req()).ticket
            fence.commit(first, "r")  # the domain's keys exist
            ticket = fence.prepare(req("c:m")).ticket
            # the slot starts to migrate to the other node: the commit's put() deleted the
            # record, the HSET after it failed as a key not on this node, and the record in
            # flight was lost (found by review). It commits whole now
            a_id = a.execute_command("CLUSTER", "MYID").decode()
            b_id = b.execute_command("CLUSTER", "MYID").decode()
            a.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", b_id)
            b.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", a_id)
            cert = fence.commit(ticket, "r")
            rec = store.get("c:m")
            assert rec is not None and rec.state is State.DONE and rec.cert == cert
            for n in (a, b):
                n.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
            ticket = fence.prepare(req("c:n")).ticket
            # the cluster gives the (emptied) slot to the other node: a reshard
            b.flushall()
            for n in (b, a):
                n.execute_command("CLUSTER", "SETSLOT", slot, "NODE", a_id)
            for step in (lambda: fence.commit(ticket, "r"), lambda: fence.prepare(req("c:2"))):
                with pytest.raises(StoreUnavailable) as moved:
                    step()
                assert moved.value.details["server_reply"].startswith(f"MOVED {slot} ")
            assert a.dbsize() == 0 and b.dbsize() == 0  # nothing applied anywhere
            for read_step in (lambda: store.get("charge:1"), lambda: store.current("order:1")):
                with pytest.raises(StoreUnavailable) as read:
                    read_step()  # current() ran undeclared keys: an untyped error (review)
                assert url_a.split("//")[1].split("/")[0] in read.value.recover
        finally:
            store.close()
    finally:
        a.close()
        b.close()


def test_redis_ask_means_a_migration_not_a_node_to_use() -> None:
    """An ASK names where the slot is going, not a node that serves it: its advice sent an
    operator from one node to the other and back (found by review)."""
    from effectfence.store.redis import _redirected

    assert "migrating to 10.0.0.2:7000" in _redirected("ASK 15685 10.0.0.2:7000")
    assert _redirected("MOVED 15685 10.0.0.2:7000").startswith("point the store's URL at 10.0")


def test_redis_refuses_to_open_where_info_is_renamed_away(
    private_redis: Callable[..., str],
) -> None:
    """Every writing step checks the role with INFO: on a server that renamed it away
    (rename-command INFO ""), the open's probe raised a raw script error (found by
    review). Refused typed, naming the setting, writing nothing."""
    from effectfence.store.redis import RedisStore

    url = private_redis("--rename-command", "INFO", "")
    admin = _admin(url)
    try:
        with pytest.raises(StoreUnavailable) as refused:
            RedisStore.from_url(url + "?prefix=rv_ren")
        assert refused.value.details["server_reply"].startswith("NOINFO ")
        assert refused.value.retryable is False and "renamed" in refused.value.recover
        assert admin.dbsize() == 0
    finally:
        admin.close()


def test_redis_a_step_that_may_not_publish_applies_nothing(
    private_redis: Callable[..., str],
) -> None:
    """The channel right taken away while the store runs (ACL SETUSER ... resetchannels):
    the complete script wrote DONE, the head and the certificate, then its PUBLISH was
    refused, and the caller got a raw redis error for a commit that applied (found by
    review). Each step checks the right before it writes: store_unavailable naming the
    channel, nothing applied, and once the right is back the same commit goes through."""
    from effectfence.store.redis import RedisStore

    url = private_redis()
    admin = _admin(url)
    admin.execute_command("ACL", "SETUSER", "fence", "on", ">pw", "~*", "&*", "+@all")
    store = RedisStore.from_url(url.replace("redis://", "redis://fence:pw@") + "?prefix=rv_r")
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        ticket = fence.prepare(req()).ticket
        admin.execute_command("ACL", "SETUSER", "fence", "resetchannels")
        for step in (lambda: fence.commit(ticket, "r"), lambda: fence.prepare(req("charge:2"))):
            with pytest.raises(StoreUnavailable) as refused:
                step()
            assert refused.value.details["server_reply"].startswith("NOPUBLISH ")
            assert "{rv_r}:changes" in refused.value.message
        rec = store.get("charge:1")
        assert rec is not None and rec.state is State.IN_FLIGHT and rec.token == ticket.token
        assert store.get("charge:2") is None
        admin.execute_command("ACL", "SETUSER", "fence", "&*")
        cert = fence.commit(ticket, "r")
        assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    finally:
        store.close()
        admin.close()


def _read_only(admin: Any) -> Callable[[], None]:
    """A failover demoted the server: a replica of a master that is not there."""
    admin.execute_command("REPLICAOF", "127.0.0.1", str(_free_port()))
    return lambda: admin.execute_command("REPLICAOF", "NO", "ONE")


def _writable_replica(admin: Any) -> Callable[[], None]:
    """The same, where replicas accept writes (replica-read-only no): what it takes is lost
    at its next resync. The store re-read the role only before claims, every
    eviction_recheck (30 s): a commit sent in that window applied there (found by review)."""
    admin.config_set("replica-read-only", "no")
    undo = _read_only(admin)

    def both() -> None:
        undo()
        admin.config_set("replica-read-only", "yes")

    return both


def _out_of_memory(admin: Any) -> Callable[[], None]:
    admin.config_set("maxmemory", 1)  # noeviction: writes are refused OOM
    return lambda: admin.config_set("maxmemory", 0)


def _no_replicas(admin: Any) -> Callable[[], None]:
    admin.config_set("min-replicas-to-write", 1)  # no class in redis-py: matched by its code
    return lambda: admin.config_set("min-replicas-to-write", 0)


@pytest.mark.parametrize(
    "refuse, code, commits",
    [
        # every writing script checks the role first (NOTMASTER): before, a read-only
        # replica refused at the first write (READONLY), and a writable one took it all
        (_read_only, "NOTMASTER", False),
        (_writable_replica, "NOTMASTER", False),
        # OOM refuses only a script whose first write may grow memory: a claim's; a commit
        # begins with an SREM, so Redis lets it run (and then it is whole)
        (_out_of_memory, "OOM", True),
        (_no_replicas, "NOREPLICAS", False),
    ],
    ids=["readonly", "writable-replica", "oom", "noreplicas"],
)
def test_redis_server_refusals_are_store_unavailable_and_apply_nothing(
    private_redis: Callable[..., str],
    refuse: Callable[[Any], Callable[[], None]],
    code: str,
    commits: bool,
) -> None:
    """READONLY (after a failover), OOM, NOREPLICAS...: the server refused the script
    before it wrote anything. prepare and commit answer store_unavailable with the server's
    reply (the driver's retries and abort act on it), and the records are as they were."""
    from effectfence.store.redis import RedisStore

    url = private_redis()
    store = RedisStore.from_url(url)
    fence = EffectFence(store=store)
    ticket = fence.prepare(req()).ticket
    admin = _admin(url)
    undo = refuse(admin)
    try:
        refusals = []
        if not commits:
            with pytest.raises(StoreUnavailable) as at_commit:
                fence.commit(ticket, "r")
            assert at_commit.value.details["operation"] == "complete"
            refusals.append(at_commit.value)
            rec = store.get("charge:1")
            assert rec is not None and rec.state is State.IN_FLIGHT and rec.token == ticket.token
        with pytest.raises(StoreUnavailable) as at_prepare:
            fence.prepare(req("charge:2"))
        refusals.append(at_prepare.value)
        for exc in refusals:
            assert exc.details["server_reply"].startswith(code + " ")
            assert exc.details["server_reply"] in exc.message and exc.retryable
        assert store.get("charge:2") is None
        if code == "NOTMASTER":  # an eviction too (left out of the guard at first: review)
            seq = store.current("order:777")
            with pytest.raises(StoreUnavailable, match="NOTMASTER"):
                store.evict_domain("order:777")
            assert store.current("order:777") == seq
            # and a first sealing key: made there, it was lost at the resync (review)
            with pytest.raises(StoreUnavailable, match="NOTMASTER"):
                store.sealing_key()
            assert admin.hget(f"{store._p}:meta", "sealing_key") is None
        if code == "NOTMASTER":  # and a store opened on the demoted server: typed, not raw
            with pytest.raises(StoreUnavailable, match="replica"):
                RedisStore.from_url(with_query(url, prefix="other"))
    finally:
        undo()
    cert = fence.commit(ticket, "r")  # nothing was applied: the same commit goes through
    assert fence.prepare(req(agent="b")).cert.hash == cert.hash
    key = store.sealing_key()  # made on the master, then read as made by every process
    assert len(key) == 32 and RedisStore.from_url(url).sealing_key() == key
    store.close()
    admin.close()


def test_redis_a_script_error_is_not_reported_as_nothing_applied(
    private_redis: Callable[..., str],
) -> None:
    """Only the server's refusals are store_unavailable: a script that failed while running
    (a bug) is raised as redis-py's error, never labelled "nothing was applied"."""
    import redis

    from effectfence.store.redis import _PRELUDE, RedisStore, _Script

    store = RedisStore.from_url(private_redis())
    broken = _Script(store._r, _PRELUDE + "return nil + 1", store._conns)
    with pytest.raises(redis.exceptions.ResponseError) as raised:
        store._call("probe", broken, (), ("",))
    assert not isinstance(raised.value, StoreUnavailable)
    store.close()


def test_pg_describe_reports_synchronous_commit(pg: Any) -> None:
    d = pg.describe()
    assert d["synchronous_commit"] != "off"
    assert d["schema"] == pg.schema and d["schema_version"] >= 1


# -- clock: the server decides --------------------------------------------------------------------


def test_client_clock_jumps_can_neither_steal_nor_keep_a_lease(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = EffectFence(FenceConfig(lease_ttl=30.0), store=open_store(url))
    ticket = holder.prepare(req()).ticket
    other = EffectFence(FenceConfig(lease_ttl=30.0), store=open_store(url))
    real_time, real_mono = time.time, time.monotonic
    # steal: the other client's clock is an hour ahead; the lease is still live on the server
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + 3600)
    with pytest.raises(IntentInFlight):
        other.prepare(req(agent="thief"))
    # keep: the holder's clock is an hour behind; its renewal is judged by the server's
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() - 3600)
    server_now = holder.store.now()
    until_ = holder.renew(ticket, ttl=0.2)
    assert server_now < until_ <= server_now + 0.2 + 5.0  # server time + ttl, not the client's
    monkeypatch.undo()
    # the short lease lapses on the server's clock (observed there), and is taken over
    until(lambda: other.store.now() >= until_, "the server's clock to pass the lease")
    taken = other.prepare(req(agent="b"))
    assert taken.fresh and taken.takeover
    with pytest.raises(LeaseLost):
        holder.commit(ticket, "too late")
    other.commit(taken.ticket, "b")
    holder.close()
    other.close()


def test_a_url_is_shown_as_it_was_given_but_its_password() -> None:
    """urlunsplit dropped the empty host of an absolute SQLite path: `info` said "no store at
    sqlite://tmp/x.db", a relative path, for sqlite:////tmp/x.db (found by review)."""
    from effectfence.store import mask_url, redact

    for url in (
        "sqlite:////tmp/x/new.db",
        "sqlite:///rel/new.db?synchronous=normal",
        "postgresql://fence@db.internal:5432/app?schema=s#frag",
        "redis://127.0.0.1:6379/0",
    ):
        assert mask_url(url) == url and redact(url) == url
    assert mask_url("postgresql://u:pw@h/db?password=x&schema=s") == (
        "postgresql://u:***@h/db?password=***&schema=s"
    )


@pytest.mark.parametrize("kind", ["pg", "redis"])
def test_a_password_in_the_query_is_never_shown(kind: str) -> None:
    """libpq and redis-py take ``?password=``: it was shown in full by ``info``,
    ``describe()``, ``repr`` and the console's label (found by review)."""
    need(kind)
    from effectfence.store import mask_url, redact

    secret = "S3CRET-in-the-query"
    name = unique_name("pgfault" if kind == "pg" else "t")
    if kind == "pg":
        url = with_query(PG_DSN, schema=name, password=secret)  # trust: any password does
    else:
        url = with_query(REDIS_URL, prefix=name, password=secret)  # no AUTH set: accepted
    shown = [redact(url), mask_url(url)]
    try:
        store = open_store(url)
        try:
            shown += [repr(store), json.dumps(store.describe())]
        finally:
            store.close()
        out = subprocess.run(
            [sys.executable, "-m", "effectfence", "info", "--store", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        shown.append(out.stdout + out.stderr)
    finally:
        drop_pg_schema(name) if kind == "pg" else drop_redis_prefix(name)
    assert all(secret not in text for text in shown), [t for t in shown if secret in t]
    assert all("password=***" in text for text in shown[:2])
    assert mask_url("host=h password='a b' dbname=d") == "host=h password=*** dbname=d"


@pytest.mark.parametrize("kind", ["pg", "redis"])
def test_a_misspelt_url_option_is_named_at_once(kind: str) -> None:
    """Redis passed it to redis-py, whose raw TypeError reached `info` as a traceback;
    PostgreSQL passed it to libpq, refused only once the pool had waited 10 s, and then
    as "can't connect, retry later" (found by review). Both name it, before connecting."""
    need(kind)
    from effectfence.store import open_store

    base, typo = (PG_DSN, "shcema") if kind == "pg" else (REDIS_URL, "certs_per_domian")
    url = with_query(base, **{typo: "5"})
    with pytest.raises(ValueError, match=f"unknown option '{typo}'"):
        open_store(url)
    known = "sslmode" if kind == "pg" else "socket_timeout"  # the drivers' own still pass
    name = unique_name("pgfault" if kind == "pg" else "t")
    value = "disable" if kind == "pg" else "5"
    key = "schema" if kind == "pg" else "prefix"
    store = open_store(with_query(base, **{key: name, known: value}))
    store.close()
    drop_pg_schema(name) if kind == "pg" else drop_redis_prefix(name)


@pytest.mark.parametrize("kind", ["sqlite", "pg", "redis"])
def test_an_option_given_twice_is_refused_naming_it(kind: str, tmp_path: Path) -> None:
    """The parser kept the last copy without a word: ``synchronous=full&synchronous=normal``
    ran at NORMAL, ``allow_eviction=false&allow_eviction=true`` allowed eviction (found by
    review). Refused before anything is opened, connected or made."""
    from effectfence.store import open_store

    if kind == "sqlite":
        path = tmp_path / "twice.db"
        base, twice = f"sqlite:///{path.as_posix().lstrip('/')}", "synchronous"
        values = ("full", "normal")
    else:
        need(kind)
        base = PG_DSN if kind == "pg" else REDIS_URL
        twice = "schema" if kind == "pg" else "allow_eviction"
        values = (
            (unique_name("pgtypo"), unique_name("pgtypo")) if kind == "pg" else ("false", "true")
        )
    sep = "&" if "?" in base else "?"
    url = f"{base}{sep}{twice}={values[0]}&{twice}={values[1]}"
    with pytest.raises(ValueError, match=f"option '{twice}' is given more than once"):
        open_store(url)
    if kind == "sqlite":
        assert list(tmp_path.iterdir()) == []  # no file made
    elif kind == "pg":
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            q = "SELECT count(*) FROM pg_namespace WHERE nspname = ANY(%s)"
            assert conn.execute(q, (list(values),)).fetchone() == (0,)  # no schema made


def test_redis_database_in_the_url_is_read_or_refused_never_guessed() -> None:
    """redis-py read ``/4x`` as database 0 and let ``db=0`` win over ``/4``: another
    database is another ledger, and a committed intent ran again there (found by review).
    A database the server has not got was a raw ResponseError (a traceback from the CLI)."""
    need("redis")
    from effectfence.errors import StoreUnavailable
    from effectfence.store import open_store

    base = REDIS_URL.rsplit("/", 1)[0] if REDIS_URL.count("/") > 2 else REDIS_URL
    prefix = unique_name("t_redis")
    for url, why in (
        (f"{base}/4x?prefix={prefix}", "must be a number"),
        (f"{base}/4?prefix={prefix}&db=0", "names the database twice"),
    ):
        with pytest.raises(ValueError, match=why):
            open_store(url)
    with pytest.raises(StoreUnavailable, match="DB index is out of range") as refused:
        open_store(f"{base}/99999?prefix={prefix}")
    assert refused.value.retryable is False


def test_postgres_open_says_why_it_cannot_connect() -> None:
    """The pool reports only "initialization incomplete after N sec": a wrong role or a
    missing database was a StoreUnavailable without its cause (found by review)."""
    need("pg")
    from urllib.parse import urlsplit, urlunsplit

    from effectfence.errors import StoreUnavailable
    from effectfence.store import open_store

    parts = urlsplit(PG_DSN)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 5432
    schema = unique_name("pgfault")
    for netloc, path, why in (
        (f"nobody_effectfence:pw@{host}:{port}", parts.path, 'role "nobody_effectfence"'),
        (parts.netloc, "/no_such_db_effectfence", 'database "no_such_db_effectfence"'),
    ):
        url = urlunsplit((parts.scheme, netloc, path, f"schema={schema}&timeout=1", ""))
        with pytest.raises(StoreUnavailable, match=why) as refused:
            open_store(url)
        assert "pw" not in str(refused.value)


def test_postgres_open_names_the_servers_words_alone_when_the_url_names_hosts() -> None:
    """A URL naming several hosts fails with one line per host: the server's FATAL was cut
    off behind another host's line, or a refused port was given as the server's words
    (found by review). Either order: the server's words are the FATAL alone."""
    need("pg")
    from urllib.parse import urlsplit

    from effectfence.errors import StoreUnavailable
    from effectfence.store import open_store

    parts = urlsplit(PG_DSN)
    real = f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"
    for hosts in (f"127.0.0.1:1,{real}", f"{real},127.0.0.1:1"):  # port 1: refused
        url = f"postgresql://nobody_effectfence@{hosts}{parts.path}"
        with pytest.raises(StoreUnavailable) as refused:
            open_store(f"{url}?schema={unique_name('pgfault')}&timeout=1")
        said = 'role "nobody_effectfence" does not exist'
        assert refused.value.details["server_reply"] == said, hosts
        assert f"the server says: {said}" in refused.value.message


def test_postgres_open_against_a_server_that_never_answers_takes_its_timeout_once() -> None:
    """A server that takes the connection and never answers: the open waited its pool's
    timeout, then for the pool's workers, then a connection of its own asked why, waiting
    its connect_timeout again: 4 s for timeout=1 (found by review). Now the pool's own
    last attempt says why, and the message does not claim the silent server said it."""
    need("pg")
    import socket

    from effectfence.errors import StoreUnavailable
    from effectfence.store import open_store

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the handshakes; nothing ever answers
    try:
        port = silent.getsockname()[1]
        url = f"postgresql://postgres@127.0.0.1:{port}/test?schema={unique_name('pgfault')}"
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"incomplete after 2\.0 sec") as refused:
            open_store(f"{url}&timeout=2")
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert took < 3.5, f"the open took {took:.1f} s for a 2 s timeout"
    assert "server says" not in refused.value.message
    assert refused.value.details.get("server_reply") is None


def test_read_sets_on_each_others_new_domains_admit_one_claim(pg: Any) -> None:
    """X claims on A reading B at 0; Y claims on B reading A at 0; neither domain has a
    row yet. In any order one comes second and must be refused read_set_stale (G6). The row
    locks locked nothing where no row was, so both passed their compare and both ran, then
    both failed at commit (found by review: 273 of 300 unforced trials). Forced here: the
    fence row held as an eviction holds it stops both where they create their domain, after
    their compare; released once both wait on a lock."""
    _one_of_two_claims_on_each_others_new_domains(pg)


def test_read_sets_on_new_domains_admit_one_claim_under_a_repeatable_read_default() -> None:
    """The same, on a database whose default isolation is REPEATABLE READ (ALTER DATABASE
    ... SET default_transaction_isolation, as an operator may): the steps rely on READ
    COMMITTED (each statement sees what committed before its locks were granted); under
    that default the compare read the snapshot taken before them, and both claims ran
    (found by review). The store's sessions are set to READ COMMITTED."""
    need("pg")
    from effectfence.store.postgres import PostgresStore

    schema = unique_name("pgrr")
    rr = "options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
    store = PostgresStore.from_url(f"{PG_DSN}?schema={schema}&{rr}")
    try:
        _one_of_two_claims_on_each_others_new_domains(store)
    finally:
        store.close()
        drop_pg_schema(schema)


def _one_of_two_claims_on_each_others_new_domains(pg: Any) -> None:
    import psycopg

    from effectfence.errors import ReadSetStale

    fence = EffectFence(store=pg)
    fence.current("warm")  # the schema exists before the gate takes its row
    gate = psycopg.connect(PG_DSN)
    gate.execute(f'SELECT 1 FROM "{pg.schema}".fence WHERE id = 0 FOR NO KEY UPDATE')
    out: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def claim(name: str, own: str, other: str) -> None:
        barrier.wait()
        try:
            out[name] = fence.request(f"i{name}", own, "t", {}, name, read_set=[(other, 0)])
        except Exception as exc:
            out[name] = exc

    threads = [
        threading.Thread(target=claim, args=("x", "dom_a", "dom_b")),
        threading.Thread(target=claim, args=("y", "dom_b", "dom_a")),
    ]
    for t in threads:
        t.start()
    with _pg_admin() as admin:
        deadline = time.monotonic() + 30
        while len(_blocked_pids(admin, pg.schema, "claim")) < 2:
            assert time.monotonic() < deadline, "the claims never both waited"
            time.sleep(0.01)
    gate.rollback()
    gate.close()
    for t in threads:
        t.join(30)
    fresh = [k for k, v in out.items() if getattr(v, "fresh", False)]
    stale = [k for k, v in out.items() if isinstance(v, ReadSetStale)]
    assert len(fresh) == 1 and len(stale) == 1, f"both admitted on stale read sets: {out}"


def test_pg_an_audit_reader_following_ids_sees_every_clear(pg: Any) -> None:
    """``audit(after=id)`` is how ``effectfence intents watch`` follows the operator's
    clears: it keeps the last id it printed and asks for larger ones. A bigserial id is
    drawn when a clear inserts its entry, not when it commits: a clear that drew id N and
    committed after one that drew N+1 was never shown to a reader already past N+1 (found
    by review). Forced here: the first clear is held after its insert (a waiter's
    registration of its intent locked), the second clears meanwhile."""
    import psycopg

    fence = EffectFence(store=pg)
    for name in ("i1", "i2"):
        fence.abort(fence.prepare(req(name)).ticket, "boom")
    pg._watch("i1")  # a waiter registered on i1: its clear deletes the registration
    blocker = psycopg.connect(PG_DSN)
    blocker.execute(f'SELECT 1 FROM "{pg.schema}".watch WHERE intent = %s FOR UPDATE', ("i1",))
    clears = [
        threading.Thread(target=lambda i=i: fence.clear(i, reason="reconciled", who="op"))
        for i in ("i1", "i2")
    ]
    with _pg_admin() as admin:
        clears[0].start()
        until(lambda: _blocked_pids(admin, pg.schema, "clear_if"), "i1's clear to wait")
        clears[1].start()  # done, or waiting for i1's
        until(
            lambda: (
                not clears[1].is_alive() or len(_blocked_pids(admin, pg.schema, "clear_if")) == 2
            ),
            "i2's clear to finish or wait",
        )
    seen: list[str] = []
    after = 0
    for e in fence.audit(after=after, limit=1000):  # the watcher's look
        after = e.id
        seen.append(e.intent)
    blocker.rollback()
    blocker.close()
    for t in clears:
        t.join(30)
    for e in fence.audit(after=after, limit=1000):  # its next look
        seen.append(e.intent)
    assert sorted(seen) == ["i1", "i2"], (seen, [(e.id, e.intent) for e in fence.audit()])


def test_redis_with_fsync_skipped_during_rewrites_is_not_called_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """appendfsync always, but no-appendfsync-on-rewrite yes: while the server rewrites its
    append-only file or snapshots, it does not fsync, and a crash then loses acknowledged
    steps. It was reported safe for money (found by review). The server's own settings are
    not changed: CONFIG GET answers as such a server's would."""
    need("redis")
    import redis

    from effectfence.store.redis import RedisStore

    real = redis.Redis.config_get
    fake = {"appendonly": "yes", "appendfsync": "always", "no-appendfsync-on-rewrite": "yes"}

    def config_get(self: Any, pattern: str = "*", *args: Any, **kw: Any) -> Any:
        return {pattern: fake[pattern]} if pattern in fake else real(self, pattern, *args, **kw)

    monkeypatch.setattr(redis.Redis, "config_get", config_get)
    name = unique_name("redis")
    for skips, safe in (("yes", False), ("no", True)):
        fake["no-appendfsync-on-rewrite"] = skips
        store = RedisStore(REDIS_URL, prefix=name)
        try:
            durability = store.describe()["durability"]
        finally:
            store.close()
        assert durability["acknowledged_writes_survive_a_crash"] is safe, durability
        assert ("no-appendfsync-on-rewrite" in durability["verdict"]) is not safe
    drop_redis_prefix(name)


def test_a_libpq_option_with_a_space_reaches_the_server_as_written() -> None:
    """The libpq part of the URL was put back with urlencode, which writes a space as "+",
    and libpq reads "+" as a plus: options=-c%20application_name%3D... failed as
    "unavailable, retry later" after the whole timeout (found by review)."""
    need("pg")
    from effectfence.store.postgres import PostgresStore

    name = unique_name("pg")
    url = with_query(PG_DSN, schema=name, options="-c%20application_name%3Dfence_app")
    store = PostgresStore.from_url(url, timeout=5)
    try:
        (row,) = store._run("t", "SHOW application_name", ())
        assert row[0] == "fence_app"
    finally:
        store.close()
        drop_pg_schema(name)


def test_a_plus_in_a_libpq_option_reaches_the_server_as_a_plus() -> None:
    """libpq reads "+" in a URL as a plus; the store read it as a space (parse_qsl) and sent
    %20 on: a password holding a "+" failed as "can't connect, retry later" (review)."""
    need("pg")
    import psycopg

    from effectfence.store.postgres import PostgresStore

    plain = with_query(PG_DSN, application_name="fence+app")
    with psycopg.connect(plain) as direct:  # libpq itself
        assert direct.execute("SHOW application_name").fetchone() == ("fence+app",)
    name = unique_name("pg")
    store = PostgresStore.from_url(with_query(plain, schema=name), timeout=5)
    try:
        (row,) = store._run("t", "SHOW application_name", ())
        assert row[0] == "fence+app"
    finally:
        store.close()
        drop_pg_schema(name)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://127.0.0.1:5432/test?application_name=a%00b",
        "postgresql://fence:s3cr%zzet@127.0.0.1:5432/test",
        "postgresql://fence@127.0.0.1:5432/test?password=s3cr%00et",
        "postgresql://fence@127.0.0.1:5432/test?sslpassword=s3cr%00et",
        "postgresql://fence@127.0.0.1:5432/test?password=s3cr\udc80",
    ],
)
def test_a_url_libpq_cannot_read_is_refused_at_once_by_name(url: str) -> None:
    """A %00 or a bad %-escape passed the store's checks and failed inside the pool, after
    the whole timeout, as "can't connect, retry later" (found by review). Refused at once,
    and a password libpq quotes is not shown."""
    from effectfence.store.postgres import PostgresStore

    with pytest.raises(ValueError, match="libpq can't read") as got:
        PostgresStore.from_url(url, timeout=30).close()
    assert "s3cr" not in str(got.value)


def test_pg_link_options_leave_what_the_operator_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's link options went to libpq as keywords, which win over a service file
    and PGCONNECT_TIMEOUT: keepalives=0 there was turned on (found by review)."""
    from effectfence.store.postgres import _link_options

    monkeypatch.delenv("PGSERVICE", raising=False)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    plain = _link_options("postgresql://h/db", 10.0)
    assert plain["tcp_user_timeout"] == 10000 and plain["keepalives"] == 1
    assert "keepalives" not in _link_options("postgresql://h/db?keepalives=0", 10.0)
    assert _link_options("postgresql://h/db?service=fence", 10.0) == {}
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "45")
    assert "connect_timeout" not in _link_options("postgresql://h/db", 10.0)
    monkeypatch.setenv("PGSERVICE", "fence")
    assert _link_options("postgresql://h/db", 10.0) == {}


def test_pg_the_unix_socket_url_with_no_host_opens() -> None:
    """postgresql:///db?host=/dir, libpq's usual Unix-socket form, was rebuilt without its
    "//" (urlunsplit drops it for an empty host) and refused (found by review)."""
    import psycopg.conninfo

    need("pg")
    sockets = "/var/run/postgresql"
    if not os.path.exists(f"{sockets}/.s.PGSQL.5432"):
        pytest.skip(f"no PostgreSQL socket in {sockets}")
    user = psycopg.conninfo.conninfo_to_dict(PG_DSN).get("user", "postgres")
    schema = unique_name("pgsock")
    try:
        fence = EffectFence.from_url(
            f"postgresql:///test?host={sockets}&user={user}&schema={schema}"
        )
        try:
            assert fence.prepare(req()).fresh
        finally:
            fence.close()
    finally:
        drop_pg_schema(schema)


@pytest.mark.parametrize("kind", ["pg", "redis"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_by_name(kind: str, value: str) -> None:
    """Redis took 0, -1, NaN and inf, then failed with a raw driver error or "unavailable,
    retry later"; PostgreSQL took inf (found by review). Refused at once, naming timeout."""
    need(kind)
    name = unique_name(kind)
    base = with_query(PG_DSN, schema=name) if kind == "pg" else with_query(REDIS_URL, prefix=name)
    with pytest.raises(ValueError, match="timeout"):
        open_store(with_query(base, timeout=value)).close()
