"""What only the SQLite store has to prove: URLs, schema, clock, errors, processes.

The contract itself is proven by test_store_contract (the store is in ``support.STORES``).
Here: real processes share one file (a storm, SIGKILLed holders, a restart, the default
path), the store's clock survives a wall clock stepping back, and a store that cannot
answer is a counted ``store_unavailable`` refusal. Executions are counted at a sink file
outside the store, opened O_APPEND by every process.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import FakeClock, sqlite_path

from effectfence import (
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentInFlight,
    InvalidRequest,
    LeaseLost,
    Replay,
    StoreUnavailable,
)
from effectfence.model import PreparedEffect
from effectfence.protocol import State
from effectfence.store import default_store_url, open_store
from effectfence.store._waiters import Waiters
from effectfence.store.base import APPLIED
from effectfence.store.sqlite import _ABSENT as _ABSENT_FOR_TESTS
from effectfence.store.sqlite import SCHEMA_VERSION, SQLiteStore, StoreSchemaError

WORKER = str(Path(__file__).with_name("sqlite_worker.py"))


def req(intent: str = "charge:1", agent: str = "a", cents: int = 77700) -> EffectRequest:
    return EffectRequest(intent, "order:777", "charge", {"cents": cents}, agent)


def spawn(mode: str, env: dict[str, str] | None = None, **args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, mode, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(Path(__file__).parent),
    )


def wait_ready(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.poll())


def finish(p: subprocess.Popen[str], go: bool = True) -> dict[str, Any]:
    out, _ = p.communicate("go\n" if go else None, timeout=120)
    assert p.returncode == 0, (p.returncode, out)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def run(mode: str, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, WORKER, mode, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(Path(__file__).parent),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def sink_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


# -- URLs, schema, options ------------------------------------------------------------------------


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "a.db"
    s = open_store(f"sqlite:///{str(db).lstrip('/')}")
    assert isinstance(s, SQLiteStore) and s.path == str(db)
    assert s.describe()["synchronous"] == "full" and s.describe()["journal_mode"] == "wal"
    s.close()
    s = open_store(f"sqlite:////{str(db).lstrip('/')}?synchronous=normal")  # four slashes too
    assert isinstance(s, SQLiteStore) and s.path == str(db)
    assert s.describe()["synchronous"] == "normal"
    assert s.describe()["url"].endswith("?synchronous=normal")
    s.close()
    monkeypatch.chdir(tmp_path)
    s = open_store("sqlite:///./rel.db")
    assert isinstance(s, SQLiteStore) and s.path == str(tmp_path / "rel.db")
    s.close()
    for bad in (
        "sqlite:///:memory:",
        "sqlite://",
        "sqlite:///",
        f"sqlite:///{db}?synchronous=off",
        f"sqlite:///{db}?nope=1",
    ):
        with pytest.raises(ValueError):
            open_store(bad)


def test_file_is_owner_only_and_schema_versioned(tmp_path: Path) -> None:
    path = str(tmp_path / "f.db")
    s = SQLiteStore(path)
    s.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (
        SCHEMA_VERSION,
    )
    conn.execute("UPDATE meta SET value = ? WHERE key='schema_version'", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreSchemaError, match="upgrade effectfence") as ei:
        SQLiteStore(path)
    assert ei.value.found == SCHEMA_VERSION + 1 and ei.value.supported == SCHEMA_VERSION


def test_refuses_a_foreign_database(tmp_path: Path) -> None:
    path = str(tmp_path / "other.db")
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreSchemaError, match="not an effectfence store"):
        SQLiteStore(path)
    # refused before anything was written: not even switched to WAL (which persists, and
    # would change another program's file)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()


@pytest.mark.parametrize("version", [None, 1])
def test_a_foreign_database_with_a_table_named_meta_is_refused_untouched(
    tmp_path: Path, version: int | None
) -> None:
    """A table named meta was taken as the mark of a fence store: a browser's History file
    was switched to WAL before being refused, and an app whose meta table held
    schema_version=1 was adopted, the fence's tables created in it (found by review)."""
    path = str(tmp_path / "app.db")
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value)")
    conn.execute("CREATE TABLE users (id INTEGER)")
    if version is not None:
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (version,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreSchemaError, match="not an effectfence store"):
        SQLiteStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"meta", "users"}
    conn.close()


def test_a_busy_timeout_sqlite_cannot_count_is_refused(tmp_path: Path) -> None:
    """sqlite3 hands it on as int milliseconds: past 2**31-1 it wrapped negative and SQLite
    stopped waiting for the lock at all (every contended step failed at once)."""
    for bad in (math.inf, 30 * 86400.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="busy_timeout"):
            SQLiteStore(str(tmp_path / "t.db"), busy_timeout=bad)
    SQLiteStore(str(tmp_path / "t.db"), busy_timeout=2_000_000.0).close()


def test_refuses_a_file_that_is_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are not the pages you are looking for\n" * 200)
    with pytest.raises(StoreSchemaError, match="not a SQLite database"):
        SQLiteStore(str(path))
    assert path.read_text().startswith("these are not")


def test_identity_and_key_survive_reopening(tmp_path: Path) -> None:
    path = str(tmp_path / "k.db")
    a = SQLiteStore(path)
    scope, key = a.ticket_scope, a.sealing_key()
    a.close()
    b = SQLiteStore(path)
    assert b.ticket_scope == scope and b.sealing_key() == key
    b.close()
    c = SQLiteStore(str(tmp_path / "other.db"))
    assert c.ticket_scope != scope and c.sealing_key() != key
    c.close()


def test_sweep_and_in_flight_use_indexes(tmp_path: Path) -> None:
    """O(expired): the sweep finds due rows through the reclaim_at index, not a scan."""
    s = SQLiteStore(str(tmp_path / "p.db"))
    s.close()
    conn = sqlite3.connect(str(tmp_path / "p.db"))
    plan = " ".join(
        r[3]
        for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT rowid FROM intents WHERE reclaim_at <= 5 "
            "ORDER BY reclaim_at LIMIT 10"
        )
    )
    assert "intents_reclaim" in plan, plan
    plan = " ".join(
        r[3]
        for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT count(*) FROM intents WHERE domain = 'd' "
            "AND state = 'in_flight'"
        )
    )
    assert "intents_in_flight" in plan, plan
    conn.close()


def test_cert_trail_outlives_the_replay_window(tmp_path: Path) -> None:
    clock = FakeClock()
    store = SQLiteStore(str(tmp_path / "c.db"), clock=clock, cert_retention=50.0)
    fence = EffectFence(FenceConfig(result_ttl=10.0, auto_sweep=False), store=store)
    t = fence.prepare(req()).ticket
    cert = fence.commit(t, "ok")
    clock.advance(10.0)
    fence.sweep()
    assert store.get("charge:1") is None  # the replay window ended
    assert [c.hash for c in store.certs("order:777")] == [cert.hash]  # the trail did not
    clock.advance(50.0)
    fence.sweep()
    assert list(store.certs("order:777")) == []
    store.close()


# -- the clock ------------------------------------------------------------------------------------


def test_clock_stepping_back_neither_steals_nor_keeps_a_lease(tmp_path: Path) -> None:
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "t.db"), clock=clock)
    fence = EffectFence(FenceConfig(lease_ttl=10.0, auto_sweep=False), store=store)
    t = fence.prepare(req(agent="holder")).ticket
    t0 = store.now()
    clock.advance(-3600.0)  # the wall clock is stepped back an hour
    assert store.now() >= t0  # store time never goes back
    clock.advance(9.0)
    with pytest.raises(IntentInFlight):  # not stolen: 9 s of the 10 s lease passed
        fence.prepare(req(agent="thief"))
    assert store.now() == pytest.approx(t0 + 9.0)
    clock.advance(1.0)  # not kept: 10 s passed, whatever the wall clock says
    adm = fence.prepare(req(agent="taker"))
    assert adm.fresh and adm.takeover and adm.ticket.token > t.token
    with pytest.raises(LeaseLost):
        fence.commit(t, "zombie")
    # another process opening the file now agrees on the time
    other = SQLiteStore(store.path, clock=clock)
    assert other.now() == pytest.approx(store.now())
    other.close()
    store.close()


def test_clock_step_back_seen_by_a_writer_first(tmp_path: Path) -> None:
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "w.db"), clock=clock)
    fence = EffectFence(FenceConfig(lease_ttl=10.0, auto_sweep=False), store=store)
    a = fence.prepare(req("a")).ticket
    t0 = store.now()
    clock.advance(-3600.0)
    b = fence.prepare(req("b")).ticket  # a write step absorbs the step back
    assert b.lease_until == pytest.approx(t0 + 10.0)
    assert a.lease_until == pytest.approx(t0 + 10.0)
    clock.advance(10.0)
    assert fence.prepare(req("a", agent="taker")).takeover
    store.close()


def _booted(path: str, boot: FakeClock, wall: FakeClock, boot_id: str = "boot-1") -> Any:
    store = SQLiteStore(path, clock=boot, wall=wall, boot_id=boot_id)
    return store, EffectFence(FenceConfig(lease_ttl=10.0, auto_sweep=False), store=store)


def test_a_wall_clock_step_and_its_correction_neither_steal_nor_keep_a_lease(
    tmp_path: Path,
) -> None:
    """Leases run on the boot clock: a wall clock stepped an hour ahead steals nothing, and
    stepped back again leaves store time where the boot clock says (found by review: the
    correcting step left store time an hour ahead, and the next step lapsed every lease)."""
    boot, wall = FakeClock(5_000.0), FakeClock(1_700_000_000.0)
    store, fence = _booted(str(tmp_path / "t.db"), boot, wall)
    t = fence.prepare(req(agent="holder")).ticket
    t0 = store.now()
    wall.advance(3600.0)  # stepped ahead
    boot.advance(5.0)
    with pytest.raises(IntentInFlight):
        fence.prepare(req(agent="thief"))
    wall.advance(-7200.0)  # corrected, and an hour too far back
    boot.advance(4.0)
    with pytest.raises(IntentInFlight):
        fence.prepare(req(agent="thief"))
    assert store.now() == pytest.approx(t0 + 9.0)  # neither ahead nor behind
    boot.advance(1.0)
    adm = fence.prepare(req(agent="taker"))
    assert adm.fresh and adm.takeover and adm.ticket.token > t.token
    store.close()


def test_the_default_clock_is_one_no_wall_clock_step_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default store reads the host's boot-time clock, not ``time.time``."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # an hour ahead from now on
    store = SQLiteStore(str(tmp_path / "d.db"))
    fence = EffectFence(FenceConfig(lease_ttl=600.0, auto_sweep=False), store=store)
    try:
        t = fence.prepare(req(agent="holder")).ticket
        monkeypatch.setattr(time, "time", lambda: real() + 7200.0)  # and another
        with pytest.raises(IntentInFlight):
            fence.prepare(req(agent="thief"))
        assert store.now() < t.lease_until
    finally:
        store.close()


@pytest.mark.parametrize("uptime", [3.0, 9_000.0], ids=["boot-clock-below", "boot-clock-above"])
def test_after_a_reboot_store_time_goes_on_with_the_downtime(tmp_path: Path, uptime: float) -> None:
    """The boot id, not the reading, tells a reboot: the new boot's clock may well read
    more than the old one's did."""
    boot, wall = FakeClock(5_000.0), FakeClock(1_700_000_000.0)
    path = str(tmp_path / "r.db")
    store, fence = _booted(path, boot, wall)
    t = fence.prepare(req(agent="holder")).ticket
    t0 = store.now()
    store.close()
    # the machine is down a minute; its boot clock starts again from nearly nothing
    boot2, wall2 = FakeClock(uptime), FakeClock(1_700_000_060.0)
    store, fence = _booted(path, boot2, wall2, "boot-2")
    assert store.now() == pytest.approx(t0 + 60.0)  # a reader is first to see the reboot
    adm = fence.prepare(req(agent="taker"))  # the holder died with the machine
    assert adm.takeover and adm.ticket.token > t.token
    assert adm.ticket.lease_until == pytest.approx(t0 + 70.0)
    store.close()


def test_a_wall_clock_gone_back_across_a_reboot_takes_no_time_back(tmp_path: Path) -> None:
    boot, wall = FakeClock(5_000.0), FakeClock(1_700_000_000.0)
    path = str(tmp_path / "r.db")
    store, fence = _booted(path, boot, wall)
    fence.prepare(req(agent="holder"))
    t0 = store.now()
    store.close()
    store, fence = _booted(path, FakeClock(3.0), FakeClock(1_699_990_000.0), "boot-2")
    with pytest.raises(IntentInFlight):  # a write is first to see the reboot
        fence.prepare(req(agent="thief"))
    assert store.now() == pytest.approx(t0)
    store.close()


def test_a_file_of_an_older_version_keeps_its_time_and_its_wall_columns(tmp_path: Path) -> None:
    """A file without the boot columns gains them with store time unchanged, and the wall
    pair older versions judge by is still kept up."""
    path = str(tmp_path / "old.db")
    SQLiteStore(path, clock=FakeClock(1_700_000_000.0)).close()
    conn = sqlite3.connect(path, isolation_level=None)
    for column in ("boot_id", "boot_offset", "boot_last"):
        conn.execute(f"ALTER TABLE fence DROP COLUMN {column}")
    # as an older version left it: an hour's step back absorbed into the offset
    conn.execute("UPDATE fence SET clock_offset = 3600.0, clock_last = 1700000100.0")
    conn.close()
    boot, wall = FakeClock(5_000.0), FakeClock(1_700_000_050.0)
    store, fence = _booted(path, boot, wall)
    assert store.now() == pytest.approx(1_700_000_100.0 + 3600.0)
    boot.advance(1.0)
    wall.advance(100.0)
    fence.prepare(req())
    conn = sqlite3.connect(path, isolation_level=None)
    row = conn.execute("SELECT clock_offset, clock_last, boot_id FROM fence").fetchone()
    conn.close()
    assert row == (3600.0, 1_700_000_150.0, "boot-1")
    assert store.now() == pytest.approx(1_700_000_101.0 + 3600.0)
    store.close()


def test_the_boot_clock_reads_the_host_clock_under_a_time_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from effectfence.store import sqlite as mod

    if not hasattr(time, "CLOCK_BOOTTIME") or not os.path.exists(mod._BOOT_ID):
        pytest.skip("no boot-time clock on this platform")
    offsets = tmp_path / "timens_offsets"
    offsets.write_text("monotonic 0 0\nboottime 100 500000000\n")
    monkeypatch.setattr(mod, "_TIMENS", str(offsets))
    clock, boot = mod._boot_clock()
    assert boot == Path(mod._BOOT_ID).read_text().strip()
    host = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert host - 100.5 <= clock() <= time.clock_gettime(time.CLOCK_BOOTTIME) - 100.5
    monkeypatch.setattr(mod, "_BOOT_ID", str(tmp_path / "missing"))
    assert mod._boot_clock() == (time.time, "wall")


# -- errors ---------------------------------------------------------------------------------------


def test_locked_database_is_a_counted_store_unavailable(tmp_path: Path) -> None:
    path = str(tmp_path / "l.db")
    store = SQLiteStore(path, busy_timeout=0.05)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    t = fence.prepare(req("held")).ticket
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with pytest.raises(StoreUnavailable) as ei:
            fence.prepare(req("new"))
        assert ei.value.code == "store_unavailable" and ei.value.retryable
        with pytest.raises(StoreUnavailable):
            fence.commit(t, "ok")
        stats = fence.stats()
        assert stats["prepare"]["store_unavailable"] == 1
        assert stats["refused_ticket_ops"] == 1
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    # nothing was decided: the record is as it was, the ticket still commits
    assert store.get("new") is None
    assert fence.commit(t, "ok").verify()
    assert fence.prepare(req("new")).fresh
    store.close()


def test_threads_of_one_process_queue_for_the_write_lock(tmp_path: Path) -> None:
    """Writers of one process wait on the store's own lock, not SQLite's busy handler: even
    with busy_timeout=0, a write that meets another thread's transaction waits for it."""
    path = str(tmp_path / "q.db")
    store = SQLiteStore(path, busy_timeout=0)
    other = SQLiteStore(path, busy_timeout=0)  # a second handle on the file, same process
    fence = EffectFence(FenceConfig(auto_sweep=False), store=other)
    inside, second_done = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def hold(conn: sqlite3.Connection) -> None:
        inside.set()
        # the second writer cannot finish while this transaction is open; it returns
        # at once only if it was refused instead of queued
        outcome["second_finished_first"] = second_done.wait(0.3)

    def first() -> None:
        store._write("hold", hold)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    try:
        outcome["second"] = fence.prepare(req("queued")).fresh
    except StoreUnavailable as exc:
        outcome["second"] = exc
    second_done.set()
    t.join(10)
    assert outcome["second"] is True, outcome
    assert outcome["second_finished_first"] is False
    store.close()
    other.close()


def _busy_then_open(store_cls: type[SQLiteStore], refusals: int) -> Any:
    """An ``_init_schema_once`` that SQLite refuses ``refusals`` times, as a busy file does."""
    real = store_cls._init_schema_once
    calls = {"n": 0}

    def once(self: SQLiteStore) -> tuple[str, str]:
        calls["n"] += 1
        if calls["n"] <= refusals:
            try:
                raise sqlite3.OperationalError("database is locked")
            except sqlite3.OperationalError as exc:
                exc.sqlite_errorcode = 5  # type: ignore[attr-defined]
                raise self._unavailable("open", exc) from exc
        return real(self)

    return once, calls


def test_open_waits_out_busy_refusals_within_busy_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    once, calls = _busy_then_open(SQLiteStore, refusals=3)
    monkeypatch.setattr(SQLiteStore, "_init_schema_once", once)
    SQLiteStore(str(tmp_path / "a.db")).close()
    assert calls["n"] == 4
    # no time to wait: the refusal is the answer, typed, and nothing was half-made
    once, calls = _busy_then_open(SQLiteStore, refusals=3)
    monkeypatch.setattr(SQLiteStore, "_init_schema_once", once)
    with pytest.raises(StoreUnavailable, match="database is locked"):
        SQLiteStore(str(tmp_path / "b.db"), busy_timeout=0)
    assert calls["n"] == 1


def test_open_does_not_retry_what_waiting_cannot_fix(tmp_path: Path) -> None:
    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE charges (id TEXT)")
    calls = {"n": 0}
    real = SQLiteStore._init_schema_once

    def once(self: SQLiteStore) -> tuple[str, str]:
        calls["n"] += 1
        return real(self)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(StoreSchemaError):
        mp.setattr(SQLiteStore, "_init_schema_once", once)
        SQLiteStore(str(path))
    assert calls["n"] == 1


def _open_at_barrier(path: str, barrier: Any, out: Any) -> None:
    barrier.wait()
    try:
        SQLiteStore(path).close()
        out.put("")
    except Exception as exc:  # reported to the parent, which fails the test with it
        out.put(repr(exc))


def test_processes_opening_one_new_file_together_all_open(tmp_path: Path) -> None:
    """Two wrappers started at once, or a restart racing the last close: switching a new
    file to WAL, and the checkpoint on close, refuse other openers without waiting. Before
    the open retried, about one round in five of four openers failed here."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    failures = []
    for rnd in range(30):
        path = str(tmp_path / f"f{rnd}.db")
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_at_barrier, args=(path, barrier, out)) for _ in range(4)]
        for p in procs:
            p.start()
        failures += [e for e in (out.get(timeout=60) for _ in procs) if e]
        for p in procs:
            p.join(timeout=60)
    assert failures == []


def test_closed_store_is_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "x.db"))
    store.close()
    with pytest.raises(StoreUnavailable):
        store.get("x")


# -- group commit: steps that wait for the write lock commit together --------------------------


def _queue_behind_the_lock(store: SQLiteStore, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads while this thread holds the store's write lock, release it
    once every one of them has queued its step, and return what each returned or raised."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    with store._writer:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(store._queue) < len(calls):  # every step waits for the next transaction
            assert time.monotonic() < deadline, "the steps did not queue"
            time.sleep(0.005)
    for t in threads:
        t.join(30)
    return out


def test_waiting_steps_commit_in_one_transaction_and_a_failing_one_alone_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SQLiteStore(str(tmp_path / "group.db"))
    fence = EffectFence(store=store)
    batches: list[int] = []
    commit_steps = store._commit_steps

    def counted(steps: list[Any], mine: Any) -> None:
        batches.append(len(steps))
        commit_steps(steps, mine)

    monkeypatch.setattr(store, "_commit_steps", counted)

    def failing(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE fence SET floor = floor + 1000 WHERE id = 0")  # then raises
        raise ValueError("this step fails after it wrote")

    floor = store._query("floor", "SELECT floor FROM fence WHERE id = 0")[0][0]
    calls: list[Callable[[], Any]] = [
        lambda i=i: fence.prepare(req(f"charge:group:{i}", agent=f"a{i}")) for i in range(6)
    ]
    calls.insert(3, lambda: store._write("failing", failing))
    out = _queue_behind_the_lock(store, calls)
    try:
        assert batches[:1] == [7], "the waiting steps did not share one transaction"
        failed = out.pop(3)
        assert isinstance(failed, ValueError)
        assert all(getattr(a, "fresh", False) for a in out), out
        assert store._query("floor", "SELECT floor FROM fence WHERE id = 0")[0][0] == floor
        tokens = sorted(a.ticket.token for a in out)
        assert len(set(tokens)) == 6  # each claim ran after the one before, in order
        for i, adm in enumerate(out):
            assert fence.commit(adm.ticket, i).hash
    finally:
        store.close()


def test_a_transaction_that_fails_applies_none_of_its_steps(tmp_path: Path) -> None:
    """One step breaking the transaction itself (an SQLite error: its state is unknown)
    rolls all of them back: each caller is told store_unavailable, nothing decided, and
    indeed nothing was: every intent is still free."""
    store = SQLiteStore(str(tmp_path / "group.db"))
    fence = EffectFence(store=store)

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO no_such_table VALUES (1)")

    calls: list[Callable[[], Any]] = [
        lambda i=i: fence.prepare(req(f"charge:none:{i}", agent=f"a{i}")) for i in range(4)
    ]
    calls.append(lambda: store._write("broken", broken))
    out = _queue_behind_the_lock(store, calls)
    try:
        assert all(isinstance(a, StoreUnavailable) for a in out), out
        for i in range(4):
            assert store.get(f"charge:none:{i}") is None
            assert fence.prepare(req(f"charge:none:{i}", agent="retry")).fresh
    finally:
        store.close()


def test_a_step_interrupted_while_it_waits_never_runs_later(tmp_path: Path) -> None:
    """Ctrl-C while a step waits for the write lock: its caller is gone, so the step must
    not run in the next caller's transaction (a claim nobody holds would sit in flight)."""
    import signal

    store = SQLiteStore(str(tmp_path / "group.db"))
    ran: list[bool] = []
    main = threading.get_ident()
    queued, interrupted = threading.Event(), threading.Event()

    def hold() -> None:
        with store._writer:
            deadline = time.monotonic() + 30
            while not store._queue and time.monotonic() < deadline:
                time.sleep(0.005)
            queued.set()
            signal.pthread_kill(main, signal.SIGINT)
            interrupted.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            store._write("interrupted", lambda conn: ran.append(True))
    finally:
        interrupted.set()
        holder.join(30)
    try:
        assert queued.is_set() and store._queue == []
        assert store._write("next", lambda conn: 1) == 1
        assert ran == [], "the interrupted step ran in another caller's transaction"
    finally:
        store.close()


def _claim(store: SQLiteStore, intent: str) -> Any:
    return store.claim(
        intent,
        expect=None,
        fingerprint=b"fp",
        domain=f"d:{intent}",
        agent="a",
        lease_ttl=30.0,
        reclaim_after=300.0,
        compare=(),
        reserve_at=None,
    )


class _InterruptedAfterCommit:
    """A connection whose COMMIT commits, then raises as a signal arriving during its fsync
    would (once): the leader's thread is interrupted, its batch did commit."""

    fired = False

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    @property
    def total_changes(self) -> int:
        return self.conn.total_changes

    def execute(self, sql: str, *args: Any) -> Any:
        out = self.conn.execute(sql, *args)
        if sql == "COMMIT" and not _InterruptedAfterCommit.fired:
            _InterruptedAfterCommit.fired = True
            raise KeyboardInterrupt("a signal during COMMIT's fsync")
        return out


def test_an_interrupt_as_the_batch_commits_leaves_every_answer_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SQLiteStore(str(tmp_path / "group.db"))
    acquire = store._acquire
    monkeypatch.setattr(store, "_acquire", lambda: _InterruptedAfterCommit(acquire()))
    claims: list[Callable[[], Any]] = [lambda i=i: _claim(store, f"charge:{i}") for i in range(3)]
    out = _queue_behind_the_lock(store, claims)
    try:
        interrupted = [o for o in out if isinstance(o, KeyboardInterrupt)]
        applied = [o for o in out if getattr(o, "outcome", None) is APPLIED]
        assert len(interrupted) == 1 and len(applied) == 2, out  # none told "nothing decided"
        for i in range(3):  # all three committed
            assert store.get(f"charge:{i}").state is State.IN_FLIGHT  # type: ignore[union-attr]
    finally:
        store.close()


def test_an_interrupt_as_the_leader_hands_its_connection_back_answers_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch committed; a signal lands while the leader gives its connection back to
    the pool. The other callers were told "did not run; nothing was decided" of claims
    that had committed (found by review), and the connection leaked."""
    store = SQLiteStore(str(tmp_path / "group.db"))
    release, fired = store._release, []

    def interrupted(conn: sqlite3.Connection) -> None:
        if not fired:
            fired.append(conn)
            raise KeyboardInterrupt("a signal after COMMIT returned")
        release(conn)

    monkeypatch.setattr(store, "_release", interrupted)
    claims: list[Callable[[], Any]] = [lambda i=i: _claim(store, f"charge:{i}") for i in range(3)]
    out = _queue_behind_the_lock(store, claims)
    monkeypatch.setattr(store, "_release", release)
    try:
        assert sum(isinstance(o, KeyboardInterrupt) for o in out) == 1, out
        assert sum(getattr(o, "outcome", None) is APPLIED for o in out) == 2, out
        for i in range(3):  # all three committed
            assert store.get(f"charge:{i}").state is State.IN_FLIGHT  # type: ignore[union-attr]
        assert fired[0] not in store._all and fired[0] not in store._free  # closed, not kept
    finally:
        store.close()
    assert store._all == []


def test_a_read_that_raises_gives_its_connection_back(tmp_path: Path) -> None:
    """A name that does not encode (a lone surrogate: a command line that is not UTF-8)
    raised UnicodeEncodeError from the driver, and each such read kept a connection open
    past close() (found by review). It is refused typed before any store sees it, and a
    read that raises anyway gives its connection back."""
    store = SQLiteStore(str(tmp_path / "reads.db"))
    fence = EffectFence(store=store)
    fence.intent_status("charge:1")
    before = len(store._all)
    for call in (
        lambda: fence.intent_status("charge:\udc80"),
        lambda: fence.current("order:\udc80"),
        lambda: fence.clear("charge:\udc80", reason="r", who="w"),
    ):
        with pytest.raises(InvalidRequest, match="lone surrogate"):
            call()
    for _ in range(5):  # below the fence: the driver's own error, connection returned
        with pytest.raises(UnicodeEncodeError):
            store.get("charge:\udc80")
    assert len(store._all) == before
    store.close()
    assert store._all == [] and store._live == []


def test_a_leader_that_cannot_get_a_connection_fails_every_step_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an SQLite error (an interrupt while connecting, a store closed meanwhile): the
    steps it took are still answered, store_unavailable, never None, and none runs later."""
    store = SQLiteStore(str(tmp_path / "group.db"))
    acquire, failed = store._acquire, []

    def once() -> sqlite3.Connection:
        if not failed:
            failed.append(True)
            raise KeyboardInterrupt("while the leader opened a connection")
        return acquire()

    monkeypatch.setattr(store, "_acquire", once)
    claims: list[Callable[[], Any]] = [lambda i=i: _claim(store, f"charge:{i}") for i in range(3)]
    out = _queue_behind_the_lock(store, claims)
    try:
        assert sum(isinstance(o, KeyboardInterrupt) for o in out) == 1, out
        assert sum(isinstance(o, StoreUnavailable) for o in out) == 2, out
        assert store._queue == []
        for i in range(3):
            assert store.get(f"charge:{i}") is None
            assert _claim(store, f"charge:{i}").outcome is APPLIED
    finally:
        store.close()


def test_an_interrupt_while_a_failed_batch_rolls_back_never_answers_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's own step breaks the transaction (an SQLite error), then a signal lands
    as it rolls back. The other steps' bodies had produced APPLIED answers: none may reach
    its caller (nothing committed), and the connection must not stay in its transaction
    holding the write lock."""
    store = SQLiteStore(str(tmp_path / "group.db"), busy_timeout=0.2)
    claim, discard = store._claim_empty, store._discard  # the body of a claim of an empty slot

    def breaking(conn: sqlite3.Connection, intent: str, *args: Any) -> Any:
        if intent == "charge:leader":
            raise sqlite3.OperationalError("disk I/O error")
        return claim(conn, intent, *args)

    def interrupted(conn: sqlite3.Connection) -> None:
        raise KeyboardInterrupt("a second signal, before the ROLLBACK ran")

    monkeypatch.setattr(store, "_claim_empty", breaking)
    monkeypatch.setattr(store, "_discard", interrupted)
    out: dict[str, Any] = {}

    def run(intent: str) -> None:
        try:
            out[intent] = _claim(store, intent)
        except BaseException as exc:
            out[intent] = exc

    followers = [threading.Thread(target=run, args=(f"charge:{x}",)) for x in "ab"]
    with store._writer:  # the two queue behind it; this thread then leads all three
        for t in followers:
            t.start()
        deadline = time.monotonic() + 30
        while len(store._queue) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        run("charge:leader")
    for t in followers:
        t.join(30)
    monkeypatch.setattr(store, "_discard", discard)
    try:
        assert isinstance(out["charge:leader"], KeyboardInterrupt)
        for x in "ab":
            assert isinstance(out[f"charge:{x}"], StoreUnavailable), out  # never APPLIED
            assert store.get(f"charge:{x}") is None
        other = sqlite3.connect(store.path, timeout=0.2)
        other.execute("BEGIN IMMEDIATE")  # the write lock was let go
        other.execute("ROLLBACK")
        other.close()
        monkeypatch.setattr(store, "_claim_empty", claim)
        assert _claim(store, "charge:a").outcome is APPLIED
    finally:
        store.close()


def test_a_connection_is_counted_for_forks_from_before_it_opens_until_after_it_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening and closing release the GIL: a fork by another thread in either window must
    find the connection counted, or the child may use a file SQLite's table (which the
    child inherits) says is open, with none of its locks."""
    from effectfence.store import sqlite as sqlite_store

    seen: list[tuple[str, int]] = []
    stores: list[SQLiteStore] = []
    connect = sqlite3.connect

    class Watched(sqlite3.Connection):
        def close(self) -> None:
            seen.append(("closing", len(stores[0]._live)))
            super().close()

    def watched_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        if stores:
            seen.append(("opening", len(stores[0]._live)))
        return connect(*args, factory=Watched, **kwargs)

    monkeypatch.setattr(sqlite_store.sqlite3, "connect", watched_connect)
    store = SQLiteStore.__new__(SQLiteStore)
    stores.append(store)
    store.__init__(str(tmp_path / "count.db"))  # type: ignore[misc]
    store.read("charge:1")  # a pooled connection and the keeper
    opened = len(store._live)
    store.close()
    assert opened >= 2 and store._live == []
    assert [n for what, n in seen if what == "opening"][:2] == [1, 2]  # counted before
    closing = [n for what, n in seen if what == "closing"]
    assert closing == list(range(opened, 0, -1)), seen  # still counted while it closes


def _fork_reports_open(path: str, out: Any) -> None:
    try:
        SQLiteStore(path).close()
        out.send("allowed")
    except StoreUnavailable:
        out.send("refused")


def test_a_store_collected_without_close_does_not_make_later_forks_refuse(
    tmp_path: Path,
) -> None:
    """Collected, its connections were closed with it: nothing is open for a child to
    inherit, so a child may open the file (a master that checked the store, then forks)."""
    import gc
    import multiprocessing

    path = str(tmp_path / "gc.db")
    store = SQLiteStore(path)
    store.read("charge:1")
    del store
    gc.collect()
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_fork_reports_open, args=(path, theirs))
    proc.start()
    try:
        assert mine.poll(30) and mine.recv() == "allowed"
    finally:
        proc.join(30)


# -- the read cache: a replay served again while the WAL-index header stands still ----------------


def test_a_kept_read_gives_way_to_another_process_commit(tmp_path: Path) -> None:
    path = str(tmp_path / "kept.db")
    store = SQLiteStore(path)
    try:
        assert store.read("charge:kept")[0] is None
        assert store.read("charge:kept")[0] is None  # served kept now
        assert store._kept_record("charge:kept") is None  # kept: the intent is absent
        out = run("commit_one", url=f"sqlite:///{path}", intent="charge:kept")
        assert out["fresh"] is True
        rec = store.read("charge:kept")[0]
        assert rec is not None and rec.state is State.DONE, "a kept read outlived a commit"
        assert rec.cert.hash == out["hash"]
    finally:
        store.close()


def test_a_kept_read_gives_way_to_another_connection_clearing(tmp_path: Path) -> None:
    path = str(tmp_path / "kept.db")
    store = SQLiteStore(path)
    fence = EffectFence(store=store)
    fence.commit(fence.prepare(req("charge:clear")).ticket, "r")
    other = SQLiteStore(path)
    try:
        assert store.read("charge:clear")[0] is not None
        assert store.read("charge:clear")[0] is store._kept_record("charge:clear")
        assert other.clear("charge:clear") is not None
        assert store.read("charge:clear")[0] is None, "a cleared intent replayed from a kept read"
    finally:
        other.close()
        store.close()


def test_a_kept_read_keeps_the_record_never_the_time(tmp_path: Path) -> None:
    """Leases lapse on a kept record as on a read one: ``now`` is computed at every read."""
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "t.db"), clock=clock)
    fence = EffectFence(FenceConfig(lease_ttl=10.0, auto_sweep=False), store=store)
    try:
        t = fence.prepare(req(agent="holder")).ticket
        with pytest.raises(IntentInFlight):
            fence.prepare(req(agent="twin"))
        rec, now = store.read(t.intent)
        clock.advance(11.0)
        kept, later = store.read(t.intent)
        assert kept is rec  # served kept: nothing was committed since
        assert later == pytest.approx(now + 11.0)
        adm = fence.prepare(req(agent="taker"))
        assert adm.fresh and adm.takeover and adm.ticket.token > t.token
    finally:
        store.close()


def test_a_store_opened_through_a_symlink_reads_the_header_sqlite_writes(tmp_path: Path) -> None:
    """SQLite follows the link: its -shm is the target's. A leftover -shm under the link's
    name (a file moved and linked after a crash) never changes; read, every kept read
    would be served forever."""
    import shutil

    real, link = str(tmp_path / "real.db"), str(tmp_path / "link.db")
    first = SQLiteStore(real)
    first.read("charge:x")
    shutil.copy(real + "-shm", link + "-shm")
    first.close()
    os.symlink(real, link)
    store = SQLiteStore(link)
    try:
        assert store.read("charge:x")[0] is None
        assert run("commit_one", url=f"sqlite:///{real}", intent="charge:x")["fresh"] is True
        rec = store.read("charge:x")[0]
        assert rec is not None and rec.state is State.DONE, "a stale -shm was read"
    finally:
        store.close()


def _fields(rec: Any) -> tuple[Any, ...]:
    return tuple(getattr(rec, f) for f in type(rec).__slots__)


def _no_statements(store: SQLiteStore) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a read ran its statement")

    store._query = refuse  # type: ignore[method-assign]


def test_a_kept_replay_reads_the_header_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay served from the read cache compares the WAL-index header read from a map of
    the ``-shm`` file's first page: no statement, and no system call (a pread was ~0.55 us
    of a ~4 us replay)."""
    store = SQLiteStore(str(tmp_path / "t.db"))
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        cert = fence.commit(fence.prepare(req()).ticket, "r")
        assert fence.prepare(req(agent="b")).cert.hash == cert.hash  # kept

        def no_pread(*args: Any) -> Any:
            raise AssertionError("the header was read with a system call")

        monkeypatch.setattr(os, "pread", no_pread)
        _no_statements(store)
        for agent in "cde":
            again = fence.prepare(req(agent=agent))
            assert not again.fresh and again.cert.hash == cert.hash
    finally:
        monkeypatch.undo()
        store.close()


_MAP_FAILS = r"""
import json, os, resource, sqlite3, sys
from effectfence.store import sqlite as S

path = sys.argv[1]
store = S.SQLiteStore(path)
other = sqlite3.connect(path, isolation_level=None)  # a read transaction: a read-mark lock
other.execute("BEGIN")
other.execute("SELECT count(*) FROM intents").fetchall()
store._keeper = store._open_conn()  # what the first cached read opens
store._all.append(store._keeper)
store._keeper.execute("SELECT 1 FROM fence").fetchall()
fd = S._shm_fd(store._real)

def locks():
    ino = os.stat(path + "-shm").st_ino
    held = []
    for line in open("/proc/locks"):
        f = line.split()
        if f[1] == "POSIX" and int(f[4]) == os.getpid() and int(f[5].split(":")[2]) == ino:
            held.append((f[3], f[6], f[7]))
    return sorted(held)

before = locks()
size = int([x for x in open("/proc/self/status") if x.startswith("VmSize")][0].split()[1])
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (size * 1024, hard))  # no room for another map
try:
    page = S._shm_map(fd)  # only the map, under the limit
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
header = store._raw_header()  # pread, as the map failed
print(json.dumps([page is None, len(header or b""), before, locks()]))
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks (Linux)")
def test_a_header_that_cannot_be_mapped_leaves_sqlites_locks_held(tmp_path: Path) -> None:
    """Closing any descriptor of the ``-shm`` file drops every POSIX lock the process holds
    on it, SQLite's own. Python's mmap keeps a duplicate descriptor and closes it when the
    map fails (and when it is collected): mapping the header with it dropped the DMS and
    read-mark locks of live connections once mmap(2) failed, here forced with RLIMIT_AS.
    The header is mapped on the kept descriptor itself, so a failure only means pread."""
    out = subprocess.run(
        [sys.executable, "-c", _MAP_FAILS, str(tmp_path / "t.db")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    assert out.returncode == 0, out.stderr
    unmapped, read, before, after = json.loads(out.stdout)
    assert unmapped and read == 96, out.stdout  # the map failed; pread read the header
    assert before and after == before, "the store's failed map dropped SQLite's locks"


def test_a_commit_here_carries_the_kept_reads_over_to_the_header_it_wrote(
    tmp_path: Path,
) -> None:
    """A replay right after a commit in this process reads nothing, and what it is served is
    what the statement returns: the records written, the others kept, the ticked clock."""
    path = str(tmp_path / "t.db")
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(path, clock=clock)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        assert store.read("charge:other")[0] is None  # kept
        cert = fence.commit(fence.prepare(req("charge:new")).ticket, "r")
        clock.advance(5.0)
        fresh = SQLiteStore(path, clock=clock)
        want_new, want_now = fresh.read("charge:new")
        fresh.close()
        _no_statements(store)
        rec, now = store.read("charge:new")
        assert rec is not None and rec.cert.hash == cert.hash
        assert _fields(rec) == _fields(want_new) and now == want_now
        assert store.read("charge:other") == (None, want_now)
        assert fence.prepare(req("charge:new")).cert.hash == cert.hash  # a replay, no read
    finally:
        store.close()


def test_commits_stack_levels_on_the_cache_and_merge_them_newest_first(tmp_path: Path) -> None:
    """Each commit here puts what it wrote on a new level over the old cache (left as it
    was); a chain grown deep is merged, newer levels over older, and a read served from deep
    down merges it too. Whatever the shape, every read is the statement's answer."""
    from effectfence.store.sqlite import _MERGE_DEPTH, _MERGE_WALK

    path = str(tmp_path / "t.db")
    store = SQLiteStore(path)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        assert store.read("charge:none")[0] is None  # kept: absent, at the bottom
        ticket = fence.prepare(req("charge:x")).ticket  # x in flight, kept
        cert = fence.commit(ticket, "r")  # x done: a newer level over the in-flight one
        depths = []
        for i in range(2 * _MERGE_DEPTH):
            old = store._kept
            frozen = dict(old.records)
            fence.commit(fence.prepare(req(f"charge:{i}")).ticket, i)
            changed = [k for k, v in frozen.items() if old.records.get(k) is not v]
            assert not changed, "a commit changed a published cache"
            depths.append(store._kept.depth)
        assert max(depths) < _MERGE_DEPTH and min(depths) == 0, depths
        n = 0
        while store._kept.depth < _MERGE_WALK:  # deep enough for a read from the bottom
            n += 1
            fence.commit(fence.prepare(req(f"charge:d{n}")).ticket, "r")
        fresh = SQLiteStore(path)
        want = {i: fresh.read(i)[0] for i in ("charge:x", "charge:0", "charge:none")}
        fresh.close()
        _no_statements(store)
        got = {i: store.read(i)[0] for i in want}
        assert got["charge:x"] is not None and got["charge:x"].cert.hash == cert.hash
        assert {i: r and _fields(r) for i, r in got.items()} == {
            i: r and _fields(r) for i, r in want.items()
        }
        assert store._kept.depth == 0, "a read from deep down did not merge the chain"
    finally:
        store.close()


def test_the_carried_over_cache_keeps_the_clock_state_the_commit_wrote(tmp_path: Path) -> None:
    """The wall clock steps back half a second (too little for readers to rebase) between a
    claim and its commit: the commit's tick grows the offset, and the carried-over cache
    computes time from that, exactly as the statement would."""
    path = str(tmp_path / "t.db")
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(path, clock=clock)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        ticket = fence.prepare(req("charge:new")).ticket
        assert store.read("charge:other")[0] is None  # kept, with the claim's clock state
        clock.advance(-0.5)
        fence.commit(ticket, "r")
        clock.advance(1.0)
        fresh = SQLiteStore(path, clock=clock)
        want = fresh.read("charge:other")
        fresh.close()
        _no_statements(store)
        assert store.read("charge:other") == want
    finally:
        store.close()


def _kept_and_another(tmp_path: Path) -> tuple[SQLiteStore, SQLiteStore, EffectFence]:
    """A store with ``charge:kept`` committed and kept, another on the same file, a fence."""
    path = str(tmp_path / "t.db")
    store, other = SQLiteStore(path), SQLiteStore(path)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    fence.commit(fence.prepare(req("charge:kept")).ticket, "r")
    assert store.read("charge:kept")[0] is not None
    return store, other, fence


def _other_commits_after_commit(store: SQLiteStore, other: SQLiteStore, intent: str) -> list[int]:
    """Patch ``store``'s header reads: the one after its next COMMIT is preceded by another
    connection clearing ``intent`` (one commit in the window). Returns the calls made."""
    real = store._wal_header
    calls: list[int] = []

    def header() -> bytes | None:
        calls.append(1)
        if len(calls) == 2:  # the read after COMMIT: someone else got in first
            assert other.clear(intent) is not None
        if len(calls) == 2:
            del store._wal_header  # once: back to the method
        return real()

    store._wal_header = header  # type: ignore[method-assign]
    return calls


def test_a_commit_by_anyone_else_in_between_stops_the_carry_over(tmp_path: Path) -> None:
    """The commit counter must have moved by exactly one: here another connection commits
    (clearing a kept intent) between this commit and the header read after it."""
    store, other, fence = _kept_and_another(tmp_path)
    try:
        ticket = fence.prepare(req("charge:mine")).ticket
        calls = _other_commits_after_commit(store, other, "charge:kept")
        fence.commit(ticket, "r")
        assert len(calls) == 2
        assert store.read("charge:kept")[0] is None, "a cleared intent was carried over"
    finally:
        other.close()
        store.close()


def test_a_carried_over_record_is_typed_as_read_back_with_an_int_clock(tmp_path: Path) -> None:
    """An injected clock may answer ints; the row reads back floats, and so must the cache."""
    path = str(tmp_path / "t.db")
    store = SQLiteStore(path, clock=lambda: 1_700_000_000)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        fence.abort(fence.prepare(req("charge:1")).ticket, "unknown")
        fresh = SQLiteStore(path, clock=lambda: 1_700_000_000)  # same clock: reads, no rebase
        want, _ = fresh.read("charge:1")
        fresh.close()
        _no_statements(store)
        got, now = store.read("charge:1")
        assert got is not None and got.state is State.FAILED
        assert [type(v) for v in _fields(got)] == [type(v) for v in _fields(want)]
        assert type(now) is float
    finally:
        store.close()


def test_a_transaction_that_wrote_nothing_is_not_carried_over(tmp_path: Path) -> None:
    """A step that found the record moved commits no frame, so the counter stays put; a
    commit by someone else in the window after it moves the counter by exactly one, which
    must not pass for ours (found by review: the cleared intent replayed)."""
    store, other, fence = _kept_and_another(tmp_path)
    try:
        calls = _other_commits_after_commit(store, other, "charge:kept")
        assert store.release("charge:kept", 999_999).outcome is not APPLIED  # a late release
        if len(calls) < 2:  # the header was not read after COMMIT: the other commit comes now
            del store._wal_header
            assert other.clear("charge:kept") is not None
        assert store.read("charge:kept")[0] is None, "a cleared intent was carried over"
        assert fence.prepare(req("charge:kept")).fresh
    finally:
        other.close()
        store.close()


def test_a_reader_holding_the_cache_of_before_never_sees_a_record_of_after(
    tmp_path: Path,
) -> None:
    """A published cache never changes: a reader preempted between taking it and looking
    the intent up gets the record and the clock state of one state, never a mix (found by
    review: a result already expired was served as live)."""
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "t.db"), clock=clock)
    fence = EffectFence(FenceConfig(auto_sweep=False, result_ttl=0.1), store=store)
    try:
        ticket = fence.prepare(req("charge:1")).ticket
        assert store.read("charge:1")[0] is not None  # kept, in flight
        go, parked = threading.Event(), threading.Event()

        class Pausing(dict):  # type: ignore[type-arg]
            def get(self, *args: Any) -> Any:
                if threading.current_thread().name == "reader":
                    parked.set()
                    go.wait(10)
                return dict.get(self, *args)

        store._kept.records = Pausing(store._kept.records)
        got: dict[str, Any] = {}
        reader = threading.Thread(
            name="reader", target=lambda: got.setdefault("read", store.read("charge:1"))
        )
        reader.start()
        assert parked.wait(10)
        clock.advance(-0.5)  # stepped back, under the rebase threshold: the tick grows the offset
        fence.commit(ticket, "r")
        clock.advance(0.2)
        go.set()
        reader.join(10)
        rec, now = got["read"]
        assert rec is not None
        if rec.state is State.DONE:  # the record of after: then the time of after
            fresh = SQLiteStore(store.path, clock=clock)
            try:
                want, want_now = fresh.read("charge:1")
                assert want is not None and (rec.until, now) == (want.until, want_now)
            finally:
                fresh.close()
        else:
            assert rec.state is State.IN_FLIGHT
    finally:
        store.close()


def test_a_late_reader_whose_clock_stepped_back_does_not_deadlock_a_commit(
    tmp_path: Path,
) -> None:
    """A reader whose statement finds the wall clock stepped back by over a second rebases
    the store clock, a write: it must not wait for the writer while holding the cache's
    lock, which a committing thread takes to carry the cache over (found by review: both
    threads stuck forever, and every later write of the file in this process with them)."""
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "t.db"), clock=clock)
    fence = EffectFence(FenceConfig(auto_sweep=False, lease_ttl=30), store=store)
    try:
        token = fence.prepare(req("charge:1")).ticket.token
        store.read("charge:1")
        ev = {k: threading.Event() for k in ("post", "post_go", "b", "b_go")}
        real_header, real_tick = store._raw_header, store._tick
        reads: list[int] = []

        def header() -> bytes | None:
            got = real_header()
            if threading.current_thread().name == "reader":
                reads.append(1)
                if len(reads) == 2:  # after its statement, the header still the same
                    ev["post"].set()
                    ev["post_go"].wait(10)
            return got

        def tick(conn: sqlite3.Connection, token: bool = False) -> tuple[float, int]:
            if threading.current_thread().name == "writer":
                ev["b"].set()
                ev["b_go"].wait(10)
            return real_tick(conn, token)

        store._raw_header, store._tick = header, tick  # type: ignore[method-assign]
        got: dict[str, Any] = {}
        reader = threading.Thread(
            name="reader", daemon=True, target=lambda: got.setdefault("r", store.read("zz"))
        )
        reader.start()
        assert ev["post"].wait(10)  # read header, row, header again: about to keep it
        clock.advance(1.0)
        store.renew("charge:1", token, lease_ttl=30, reclaim_after=60)  # the cache moves on
        clock.advance(-3.0)  # stepped back two seconds in all: the reader rebases
        writer = threading.Thread(
            name="writer",
            daemon=True,
            target=lambda: got.setdefault(
                "w", store.renew("charge:1", token, lease_ttl=30, reclaim_after=60)
            ),
        )
        writer.start()
        assert ev["b"].wait(10)  # the writer holds the write lock, inside its step
        ev["post_go"].set()  # the late reader rebases the clock: a write step
        deadline = time.monotonic() + 10
        while not any(s.op == "now" for s in store._queue) and time.monotonic() < deadline:
            if not reader.is_alive():
                break
            time.sleep(0.005)
        ev["b_go"].set()
        reader.join(10)
        writer.join(10)
        assert not reader.is_alive() and not writer.is_alive(), "deadlocked"
        assert got["w"].outcome is APPLIED and got["r"][0] is None
    finally:
        store.close()


def test_a_read_that_saw_a_later_commit_is_not_kept_under_the_header_before(
    tmp_path: Path,
) -> None:
    """A statement may see a commit that landed after its header was read: its row is of
    the later state, and kept under the earlier header it would be paired with that
    state's clock (found by review: a `now` earlier than the record's own `since`)."""
    clock = FakeClock(1_700_000_000.0)
    store = SQLiteStore(str(tmp_path / "t.db"), clock=clock)
    other = SQLiteStore(store.path, clock=clock)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        ticket = fence.prepare(req("charge:1")).ticket
        EffectFence(store=other).prepare(req("charge:other"))  # a commit elsewhere: cache stale
        store.read("charge:warm")  # the cache, at this header, without charge:1
        before = store._kept
        real_query = store._query

        def query(*args: Any) -> Any:  # a commit elsewhere lands after the header read
            clock.advance(0.8)
            assert (
                other.fail(ticket.intent, ticket.token, "boom", reclaim_after=60).outcome is APPLIED
            )
            return real_query(*args)

        store._query = query  # type: ignore[method-assign]
        rec = store.read("charge:1")[0]
        del store._query
        assert rec is not None and rec.state is State.FAILED
        assert before.records.get("charge:1", "absent") == "absent", "a later state was kept"
        assert store._kept_record("charge:1") in (_ABSENT_FOR_TESTS, rec)
    finally:
        other.close()
        store.close()


def test_a_clear_here_is_not_carried_over(tmp_path: Path) -> None:
    """Only steps whose writes are tracked carry the cache over; a clear (or a sweep, an
    eviction) lets the header change drop it."""
    store = SQLiteStore(str(tmp_path / "t.db"))
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        fence.commit(fence.prepare(req("charge:kept")).ticket, "r")
        assert store.read("charge:kept")[0] is not None
        assert store.clear("charge:kept") is not None
        assert store.read("charge:kept")[0] is None, "a cleared intent replayed"
    finally:
        store.close()


def test_a_batch_with_a_step_rolled_back_is_not_carried_over(tmp_path: Path) -> None:
    """A step that raised is rolled back to its savepoint: what it wrote never committed,
    so it must not reach the cache either."""
    from effectfence.store.sqlite import _Step

    store = SQLiteStore(str(tmp_path / "t.db"))
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    try:
        fence.prepare(req("charge:gone"))
        rec = store.get("charge:gone")
        assert rec is not None
        assert store.clear("charge:gone") is not None
        assert store.read("charge:gone")[0] is None

        def ticks(conn: sqlite3.Connection) -> float:
            return store._tick(conn)[0]

        def writes_then_fails(conn: sqlite3.Connection) -> None:
            store._put(conn, rec, None, new=True)
            raise ValueError("after writing")

        steps = [_Step("renew", ticks, ()), _Step("renew", writes_then_fails, ())]
        with store._writer:
            store._commit_steps(steps, steps[0])
        assert steps[0].error is None and isinstance(steps[1].error, ValueError)
        assert store.get("charge:gone") is None  # rolled back
        assert store.read("charge:gone")[0] is None, "a rolled-back write was served"
    finally:
        store.close()


def test_a_torn_or_missing_wal_header_means_the_statement_runs(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "t.db"))
    store.read("charge:1")
    good = os.pread(store._shm or -1, 96, 0)
    assert len(good) == 96 and store._wal_header() == good
    uninitialised = good[:12] + b"\x00" + good[13:48]
    fake = tmp_path / "fake-shm"
    try:
        for header in (good[:48] + bytes(48), uninitialised * 2, good[:60], b""):
            fake.write_bytes(header)
            fd = os.open(fake, os.O_RDONLY)
            # read from a map of it where one can be made (96 bytes), else with pread
            mapped = mmap.mmap(fd, 96, prot=mmap.PROT_READ) if len(header) == 96 else None
            store._shm, store._mapped = fd, mapped
            try:
                assert store._wal_header() is None, header
                assert store.read("charge:1")[0] is None  # read by the statement, unharmed
                assert store._kept.header != header, "kept under a torn header"
            finally:
                store._mapped = None
                if mapped is not None:
                    mapped.close()
                os.close(fd)
    finally:
        store._shm = -1
        store.close()


def test_closing_the_store_during_a_step_lets_the_step_finish_then_closes_it(
    tmp_path: Path,
) -> None:
    """close() while another thread's step is inside its transaction: closing a connection
    in use crashes the interpreter (found by review: a segfault), so close() closes the idle
    ones and the step's own connection is closed when the step ends; the step answers what
    it did, later calls are refused, and no connection is left open."""
    store = SQLiteStore(str(tmp_path / "t.db"))
    fence = EffectFence(FenceConfig(auto_sweep=False, lease_ttl=30), store=store)
    token = fence.prepare(req("charge:1")).ticket.token
    store.read("charge:2")  # the keeper connection is open too
    inside, go = threading.Event(), threading.Event()
    real_tick = store._tick

    def tick(conn: sqlite3.Connection, token: bool = False) -> tuple[float, int]:
        if threading.current_thread().name == "stepping":
            inside.set()
            go.wait(10)
        return real_tick(conn, token)

    store._tick = tick  # type: ignore[method-assign]
    got: dict[str, Any] = {}
    stepping = threading.Thread(
        name="stepping",
        target=lambda: got.setdefault(
            "step", store.renew("charge:1", token, lease_ttl=30, reclaim_after=60)
        ),
    )
    stepping.start()
    assert inside.wait(10)  # its transaction is open on its connection
    store.close()
    go.set()
    stepping.join(10)
    assert got["step"].outcome is APPLIED, "a step in flight was cut off by close()"
    with pytest.raises(StoreUnavailable):
        store.read("charge:1")
    assert store._live == [], "a connection was left open"
    reopened = SQLiteStore(store.path)
    try:
        rec = reopened.get("charge:1")
        assert rec is not None and rec.state is State.IN_FLIGHT and rec.token == token
    finally:
        reopened.close()


# -- processes ------------------------------------------------------------------------------------


def _forked_child(store: SQLiteStore, fresh_path: str, closed_path: str, out: Any) -> None:
    """What a forked child may and may not do with SQLite files: reported to the parent."""
    seen: dict[str, Any] = {}
    for name, attempt in (
        ("inherited read", lambda: store.read("charge:forked")),
        ("inherited prepare", lambda: EffectFence(store=store).prepare(req("charge:forked"))),
        ("new store, same file", lambda: SQLiteStore(store.path)),
    ):
        try:
            attempt()
            seen[name] = "allowed"
        except StoreUnavailable as exc:
            seen[name] = (exc.retryable, "forked" in exc.message, "spawn" in exc.recover)
    for name, path in (("a file the parent never opened", fresh_path),
                       ("a file the parent had closed", closed_path)):  # fmt: skip
        other = SQLiteStore(path)
        fence = EffectFence(store=other)
        seen[name] = fence.commit(fence.prepare(req("charge:child")).ticket, "r").hash != ""
        other.close()
    out.send(seen)


def test_a_forked_child_is_refused_a_file_its_parent_had_open(tmp_path: Path) -> None:
    """SQLite's table of open files and the locks it holds is per process; a forked child
    inherits the table and none of the locks, so its connections to a file its parent had
    open, new ones too, take no real lock. The parent's last close then deletes the WAL
    under the child, and an intent the child admitted is admitted again elsewhere (G1; a
    review reproduced exactly that). Such a file is refused in the child, typed, saying
    what to do; other files, and one the parent had closed before the fork, work."""
    import multiprocessing

    path = str(tmp_path / "fork.db")
    closed = str(tmp_path / "closed.db")
    SQLiteStore(closed).close()
    store = SQLiteStore(path)
    fence = EffectFence(store=store)
    fence.commit(fence.prepare(req("charge:parent")).ticket, "r")
    assert store.read("charge:forked")[0] is None  # kept in the parent's read cache
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_forked_child, args=(store, str(tmp_path / "new.db"), closed, theirs))
    proc.start()
    try:
        assert mine.poll(60), "the child did not answer"
        seen = mine.recv()
    finally:
        proc.join(30)
    refused = (False, True, True)  # not retryable, names the fork, says to spawn
    assert seen == {
        "inherited read": refused,
        "inherited prepare": refused,
        "new store, same file": refused,
        "a file the parent never opened": True,
        "a file the parent had closed": True,
    }
    assert proc.exitcode == 0
    try:  # the parent's own store is untouched, and the child claimed nothing
        assert fence.prepare(req("charge:forked", agent="parent")).fresh
    finally:
        store.close()


def _kept_shm_fd(path: str) -> int:
    from effectfence.store import sqlite as module

    kept: Any = module._SHM_FDS[path]
    return kept if isinstance(kept, int) else int(kept[0])


def _close_keeping_its_shm_fd(store: SQLiteStore) -> int:
    """Close ``store`` while another connection still uses the file, so its -shm descriptor
    stays kept (see _forget_shm), then let that connection go: the kept number now names a
    file SQLite deleted, as after any close while another process used the store."""
    holder = sqlite3.connect(store.path)
    holder.execute("SELECT 1 FROM fence").fetchall()  # maps the WAL: the -shm stays
    store.close()
    kept = _kept_shm_fd(store.path)
    holder.close()
    return kept


def test_closed_stores_keep_no_descriptor_of_a_file_nobody_uses(tmp_path: Path) -> None:
    """Each store file a process had read kept a -shm descriptor open for ever after its
    store closed: a process opening and closing stores on many files ran out of them
    (found by review). Closed once SQLite deleted the file; kept while it is in use."""
    from effectfence.store import sqlite as module

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    for i in range(50):
        store = SQLiteStore(str(tmp_path / f"s{i}.db"))
        store.read("charge:1")
        store.close()
    assert fds() == before
    assert not any(p.startswith(str(tmp_path)) for p in module._SHM_FDS)
    used = SQLiteStore(str(tmp_path / "used.db"))
    used.read("charge:1")
    assert _close_keeping_its_shm_fd(used) in [int(f) for f in os.listdir("/proc/self/fd")]


_OTHER = """
import sys
from effectfence import EffectFence, EffectRequest, FenceConfig, Refusal
from effectfence.store.sqlite import SQLiteStore
store = SQLiteStore(sys.argv[1])
if sys.argv[2] == "prepare":
    fence = EffectFence(FenceConfig(lease_ttl=600), store=store)
    try:
        print(fence.prepare(EffectRequest(
            "charge:2", "order:777", "charge", {"cents": 77700}, "other")).fresh)
    except Refusal as refusal:
        print(refusal.code)
store.close()
"""


def _take_numbers_below(n: int) -> list[int]:
    """Open /dev/null until ``n`` is the lowest free descriptor number (it must be free)."""
    taken = []
    while (fd := os.open(os.devnull, os.O_RDONLY)) != n:
        assert fd < n, (fd, n)
        taken.append(fd)
    os.close(fd)
    return taken


def _daemonized_child(path: str, kept: int, w: int) -> None:
    """Closes what it inherited, as daemons do, lines its descriptors up so that SQLite's
    database file gets the number the parent kept for the -shm file, then claims."""
    os.closerange(3, w)
    os.closerange(w + 1, 1 << 16)
    try:
        _take_numbers_below(kept)  # SQLite's next open (the database file) takes ``kept``
        fence = EffectFence(FenceConfig(lease_ttl=600), store=SQLiteStore(path))
        fence.prepare(req("charge:1", agent="child"))  # opens the database, then -shm
        other = [sys.executable, "-c", _OTHER, path]
        subprocess.run([*other, "close"], check=True, timeout=60)  # it may think it is last
        mine = fence.prepare(req("charge:2", agent="child")).fresh
        theirs = subprocess.run(
            [*other, "prepare"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        said = {"wal": os.path.exists(path + "-wal"), "mine": mine, "theirs": theirs}
    except BaseException as exc:  # reported, never raised out of a forked child
        said = {"error": repr(exc)}
    os.write(w, json.dumps(said).encode())
    os._exit(0)


def test_a_daemonized_child_never_closes_sqlites_descriptor_for_its_parents(
    tmp_path: Path,
) -> None:
    """A process that used a store and closed it keeps the -shm descriptor's number. Its
    forked child, closing what it inherited (python-daemon, os.closerange), had that number
    reused by SQLite for the database file; the store took it for its own stale -shm
    descriptor and closed it, dropping the child's locks. Another process's close then
    deleted the WAL under the child, and an intent the child admitted was admitted again
    (G1; found by review). The child must keep its locks: the other process is refused."""
    path = str(tmp_path / "daemon.db")
    store = SQLiteStore(path)
    store.read("charge:warm")  # the read cache opens (and keeps) the -shm descriptor
    kept = _close_keeping_its_shm_fd(store)
    r, w = os.pipe()
    assert w != kept
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's report is checked below)
        os.close(r)
        _daemonized_child(path, kept, w)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        said = json.loads(pipe.read() or b"{}")
    os.waitpid(pid, 0)
    assert said == {"wal": True, "mine": True, "theirs": "intent_in_flight"}


def test_a_kept_shm_descriptor_closed_behind_the_stores_back_is_never_closed_again(
    tmp_path: Path,
) -> None:
    """Code that closes the store's kept -shm descriptor frees its number for anyone; the
    store then must neither read through that number nor close it (whose ever it is)."""
    path = str(tmp_path / "reused.db")
    store = SQLiteStore(path)
    store.read("charge:warm")
    kept = _close_keeping_its_shm_fd(store)
    os.close(kept)
    other = tmp_path / "someone-else"
    other.write_bytes(b"not a -shm file")
    below = _take_numbers_below(kept)
    fd = os.open(other, os.O_RDONLY)
    assert fd == kept
    for n in below:
        os.close(n)
    try:
        store = SQLiteStore(path)
        fence = EffectFence(store=store)
        fence.commit(fence.prepare(req("charge:1")).ticket, "r")
        assert store.read("charge:1")[0] is not None
        assert os.readlink(f"/proc/self/fd/{fd}") == str(other), "the store closed it"
        store.close()
    finally:
        os.close(fd)


def _in_the_forked_child(waiters: Waiters, path: str, out: Any) -> None:
    waiters.wake("charge:held")
    store = SQLiteStore(path)  # takes the module's locks: a parent's thread held them
    fence = EffectFence(store=store)
    fence.commit(fence.prepare(req("charge:held-at-fork", agent="child")).ticket, "r")
    store.close()
    out.send(True)


def test_locks_a_parents_thread_held_at_the_fork_are_free_in_the_child(tmp_path: Path) -> None:
    """The thread that held them does not exist in the child: a lock copied held would be
    waited for forever (the child's first step would hang, not fail)."""
    import multiprocessing

    from effectfence.store import sqlite as sqlite_store

    waiters = Waiters()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with sqlite_store._WRITERS_LOCK, sqlite_store._SHM_LOCK, waiters._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_in_the_forked_child, args=(waiters, str(tmp_path / "c.db"), theirs))
    try:
        proc.start()
        done = mine.poll(30)
    finally:
        release.set()
        holder.join(10)
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    assert done and mine.recv() is True, "the child hung on a lock its parent's thread held"


def test_storm_four_processes_eight_threads_one_execution(tmp_path: Path) -> None:
    """4 processes x 8 threads, 1,000 prepares of one intent, released together: one runs."""
    path = sqlite_path()
    SQLiteStore(path).close()
    for rnd in range(3):
        sink = str(tmp_path / f"sink-{rnd}")
        intent = f"charge:storm-{rnd}"
        procs = [
            spawn("storm", path=path, sink=sink, intent=intent, threads=8, attempts=32)
            for _ in range(4)
        ]
        for p in procs:
            wait_ready(p)
        results = [finish(p) for p in procs]
        executions = sink_lines(sink)
        assert len(executions) == 1, (rnd, executions, results)
        total = {k: sum(r[k] for r in results) for k in ("fresh", "replay", "in_flight", "errors")}
        assert total["errors"] == 0 and total["fresh"] == 1, total
        assert sum(total.values()) == 4 * 8 * 32 >= 1000
        hashes = {h for r in results for h in r["hashes"]}
        assert len(hashes) == 1, hashes
        store = SQLiteStore(path)
        rec = store.get(intent)
        assert rec is not None and rec.cert is not None and rec.cert.hash in hashes
        store.close()


@pytest.mark.parametrize("phase", ["after_claim", "during_effect", "after_effect"])
def test_sigkilled_holder_is_taken_over_and_its_ticket_fenced(tmp_path: Path, phase: str) -> None:
    path = sqlite_path()
    sink = str(tmp_path / "sink")
    ticket_file = str(tmp_path / "ticket.json")
    intent = f"charge:crash-{phase}"
    lease = 0.5
    p = spawn(
        "hold", path=path, sink=sink, intent=intent, phase=phase, ticket=ticket_file, lease=lease
    )
    wait_ready(p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    dead_ticket = PreparedEffect.from_dict(json.loads(Path(ticket_file).read_text()))
    doomed = len(sink_lines(sink))  # what the dead worker did to the world

    store = SQLiteStore(path)
    fence = EffectFence(FenceConfig(lease_ttl=30.0), store=store)
    with pytest.raises(IntentInFlight):  # its lease is live: nobody runs it yet
        fence.prepare(req(intent, agent="early"))
    # wait for the lease (woken by the store, never past the lease), then race to take over
    assert fence.wait(intent, timeout=lease * 20)

    def survivor(i: int) -> str:
        adm = fence.prepare(req(intent, agent=f"survivor-{i}"))
        if not adm.fresh:
            return "replay"
        assert adm.takeover and adm.ticket.token > dead_ticket.token
        with open(sink, "a") as f:
            f.write(f"survivor {i}\n")
        fence.commit(adm.ticket, {"charged": 77700})
        return "took_over"

    from support import race

    outcomes = race(8, survivor)
    assert outcomes.count("took_over") == 1, outcomes
    assert all(o in ("replay", "took_over") or isinstance(o, IntentInFlight) for o in outcomes)
    assert len(sink_lines(sink)) == doomed + 1  # the survivors executed exactly once
    # the zombie: the dead worker's ticket, replayed, is powerless
    for op in (
        lambda: fence.commit(dead_ticket, {"charged": 77700}),
        lambda: fence.abort(dead_ticket, "zombie"),
        lambda: fence.release(dead_ticket),
        lambda: fence.renew(dead_ticket),
    ):
        with pytest.raises(LeaseLost):
            op()
    assert isinstance(fence.prepare(req(intent, agent="auditor")), Replay)
    store.close()


def test_committed_intent_replays_after_restart_in_a_new_process(tmp_path: Path) -> None:
    url = f"sqlite:///{sqlite_path().lstrip('/')}"
    first = run("commit_one", url=url, intent="charge:restart")
    assert first["fresh"]
    again = run("commit_one", url=url, intent="charge:restart", agent="second")
    assert again == {"fresh": False, "hash": first["hash"], "verify": True}
    fence = EffectFence.from_url(url)
    adm = fence.prepare(req("charge:restart", agent="third"))
    assert isinstance(adm, Replay) and adm.cert.hash == first["hash"] and adm.cert.verify()
    fence.close()


def test_two_processes_share_the_default_store(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "EFFECTFENCE_STORE"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["HOME"] = str(tmp_path / "home")
    sealed = run("seal", env=env, intent="charge:shared")
    expect = tmp_path / "state" / "effectfence" / "fence.db"
    assert sealed["url"] == f"sqlite:///{str(expect).lstrip('/')}"
    assert stat.S_IMODE(os.stat(expect.parent).st_mode) == 0o700
    committed = run("open_and_commit", env=env, wire=sealed["wire"])
    assert committed["url"] == sealed["url"] and committed["scope"] == sealed["scope"]
    store = SQLiteStore(str(expect))
    rec = store.get("charge:shared")
    assert rec is not None and rec.cert is not None and rec.cert.hash == committed["hash"]
    store.close()


def test_default_store_url_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EFFECTFENCE_STORE", "memory:")
    assert default_store_url() == "memory:"
    monkeypatch.delenv("EFFECTFENCE_STORE")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "x"))
    if sys.platform.startswith("linux"):
        assert (
            default_store_url() == f"sqlite:///{str(tmp_path).lstrip('/')}/x/effectfence/fence.db"
        )
    odd_names = ("state%41dir", "state?dir", "state#1", "caf\udce9", "~root")
    for odd in odd_names:  # quoted: the URL names that file (not UTF-8, or ~, too)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / odd))
        store = open_store(default_store_url())
        assert store.path == str(tmp_path / odd / "effectfence" / "fence.db")
        assert open_store(store.describe()["url"]).path == store.path
        store.close()
    from effectfence.store import sqlite_url
    from effectfence.store.sqlite import _parse_url

    for path in ("/~nosuchuser/fence.db", "/./x.db", "/srv/a b/caf\u00e9.db"):
        assert _parse_url(sqlite_url(path))[0] == path  # the URL names that very file
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    if sys.platform.startswith("linux"):
        assert default_store_url().endswith("/h/.local/state/effectfence/fence.db")


def _claim_empty_slot(store: SQLiteStore, intent: str, agent: str) -> Any:
    """The insert-first claim: what a decider that saw ``intent`` absent asks for."""
    return store.claim(
        intent,
        expect=None,
        fingerprint=b"f" * 32,
        domain="d",
        agent=agent,
        lease_ttl=30.0,
        reclaim_after=60.0,
        compare=(),
        reserve_at=None,
    )


def test_an_insert_first_claim_of_a_taken_slot_writes_nothing(tmp_path: Path) -> None:
    """A claim of a slot its decider saw empty inserts first; found taken, the domain's
    seq and the token it drew are rolled back with it, alone or in a batch, and the
    answer is MOVED with the record that is there."""
    from effectfence.store.base import MOVED

    store = SQLiteStore(str(tmp_path / "t.db"))
    try:
        first = _claim_empty_slot(store, "i1", "a")
        assert first.outcome is APPLIED and first.record is not None
        seq, token = first.record.seq, first.record.token
        alone = _claim_empty_slot(store, "i1", "b")
        assert alone.outcome is MOVED and alone.found is not None
        assert (alone.found.agent, alone.found.token) == ("a", token)
        # in one batch: the taken slot's savepoint rolls back, the other step commits
        out = _queue_behind_the_lock(
            store,
            [
                lambda: _claim_empty_slot(store, "i1", "c"),
                lambda: _claim_empty_slot(store, "i2", "c"),
            ],
        )
        assert out[0].outcome is MOVED and out[0].found.token == token
        assert out[1].outcome is APPLIED
        # neither failed claim used a seq or a token: the next ones follow on
        assert (out[1].record.seq, out[1].record.token) == (seq + 1, token + 1)
        assert store.current("d") == seq + 1
        assert store.get("i1").agent == "a"  # type: ignore[union-attr]
    finally:
        store.close()
