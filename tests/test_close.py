"""close() lets the effects in hand settle before it closes the store.

Closing a fence closed its store at once. An effect a ``@fenced`` function was running
then could not be committed: it stayed in flight, and once its lease lapsed an identical
call (another process on the same store) ran it again. Now close() stops admitting and
waits for the effects the driver holds, up to a timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from effectfence import EffectFence, FenceConfig, StoreUnavailable, fenced
from effectfence.protocol import State
from effectfence.store.sqlite import SQLiteStore

WAIT = 10.0  # s a test waits for a thread it released (never reached when it works)


def _fence(path: Path) -> EffectFence:
    return EffectFence(FenceConfig(lease_ttl=30.0, auto_sweep=False), store=SQLiteStore(str(path)))


class Running:
    """A fenced charge blocked mid-effect in a worker thread until :meth:`finish`."""

    def __init__(self, fence: EffectFence, order: int = 1) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.out: list[object] = []

        @fenced(fence, intent="charge:{order}", domain="order:{order}")
        def charge(order: int) -> str:
            self.started.set()
            assert self.release.wait(WAIT)
            return "ch_1"

        self.charge = charge
        self.worker = threading.Thread(target=lambda: self.out.append(charge(order)))
        self.worker.start()
        assert self.started.wait(WAIT)

    def finish(self) -> None:
        self.release.set()
        self.worker.join(WAIT)


def _closing_began(fence: EffectFence) -> None:
    spin = threading.Event()
    for _ in range(100_000):
        if fence.closing:
            return
        spin.wait(0.0001)
    raise AssertionError("close() never began")


def _state(path: Path, intent: str) -> State | None:
    other = SQLiteStore(str(path))
    try:
        rec = other.get(intent)
        return None if rec is None else rec.state
    finally:
        other.close()


def test_close_waits_for_a_running_effect_to_commit(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    fence = _fence(path)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        started.set()
        assert release.wait(WAIT)
        ran.append(f"charged {order}")
        return "ch_1"

    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(charge(1)))
    worker.start()
    assert started.wait(WAIT)
    closer = threading.Thread(target=fence.close)
    closer.start()
    _closing_began(fence)
    assert closer.is_alive()  # waiting for the effect in hand, the store still open
    with pytest.raises(StoreUnavailable, match="closing"):
        charge(2)  # nothing new is admitted meanwhile
    release.set()
    worker.join(WAIT)
    closer.join(WAIT)
    assert not closer.is_alive()
    assert out == ["ch_1"] and ran == ["charged 1"]
    assert _state(path, "charge:1") is State.DONE  # recorded: an identical call replays
    assert _state(path, "charge:2") is None  # refused before anything was decided


def test_close_returns_at_its_timeout_and_the_store_closes_when_the_effect_settles(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.db"
    fence = _fence(path)
    run = Running(fence)
    fence.close(timeout=0.05)  # returns although the effect still runs...
    assert fence.intent_status("charge:1") is not None  # ...and the store is still open
    run.finish()
    assert run.out == ["ch_1"]  # recorded, not closed under it
    assert _state(path, "charge:1") is State.DONE
    with pytest.raises(StoreUnavailable):  # closed once the last effect settled
        fence.intent_status("charge:1")


def test_a_close_from_inside_the_effect_does_not_wait_for_it(tmp_path: Path) -> None:
    """A SIGTERM handler runs in the thread it interrupts: its close() waited the whole
    lease for the effect it had itself interrupted, then closed the store under it."""
    path = tmp_path / "s.db"
    fence = _fence(path)
    took: list[float] = []

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        t0 = time.monotonic()
        fence.close()  # as a signal handler landing here would (default timeout: 30 s)
        took.append(time.monotonic() - t0)
        return "ch_1"

    assert charge(1) == "ch_1"
    assert took[0] < WAIT
    assert _state(path, "charge:1") is State.DONE
    with pytest.raises(StoreUnavailable):
        fence.intent_status("charge:1")


def test_a_close_landing_while_its_thread_holds_the_lock_does_not_deadlock(
    tmp_path: Path,
) -> None:
    """The handler may interrupt its thread inside the bookkeeping's lock (review forced it
    there with a trace function): a plain lock deadlocked the thread on itself."""
    fence = _fence(tmp_path / "l.db")
    done = threading.Event()

    def handler_inside_the_lock() -> None:
        with fence._holds._cond:  # where the interrupted frame was
            fence.close(timeout=1.0)
        done.set()

    t = threading.Thread(target=handler_inside_the_lock, daemon=True)
    t.start()
    assert done.wait(WAIT)


def test_closing_one_fence_waits_for_the_effects_of_another_on_its_store(
    tmp_path: Path,
) -> None:
    """wrap keeps a fence per lease and TTL on one store: the first one closed closed the
    store under the others' effects (found by review)."""
    path = tmp_path / "w.db"
    store = SQLiteStore(str(path))
    first = EffectFence(FenceConfig(lease_ttl=30.0, auto_sweep=False), store=store)
    second = EffectFence(FenceConfig(lease_ttl=60.0, auto_sweep=False), store=store)
    run = Running(second)
    closer = threading.Thread(target=first.close)
    closer.start()
    _closing_began(first)
    assert closer.is_alive()  # waiting for the other fence's effect on the same store
    run.finish()
    closer.join(WAIT)
    assert run.out == ["ch_1"] and _state(path, "charge:1") is State.DONE
    second.close(timeout=0)  # the store is closed already: nothing to do


def test_aclose_lets_an_effect_on_the_same_loop_commit(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    fence = _fence(path)

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        @fenced(fence, intent="charge:{order}", domain="order:{order}")
        async def charge(order: int) -> str:
            started.set()
            await release.wait()
            return "ch_1"

        task = asyncio.create_task(charge(1))
        await asyncio.wait_for(started.wait(), WAIT)
        closer = asyncio.create_task(fence.aclose())
        for _ in range(100_000):
            if fence.closing:
                break
            await asyncio.sleep(0.0001)
        assert fence.closing and not closer.done()
        release.set()
        assert await asyncio.wait_for(task, WAIT) == "ch_1"
        await asyncio.wait_for(closer, WAIT)

    asyncio.run(main())
    assert _state(path, "charge:1") is State.DONE


def test_a_replay_or_a_refusal_holds_nothing(tmp_path: Path) -> None:
    fence = _fence(tmp_path / "r.db")

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        if order == 2:
            raise RuntimeError("declined")
        return "ch_1"

    assert charge(1) == "ch_1"
    assert charge(1) == "ch_1"  # replayed
    with pytest.raises(RuntimeError):
        charge(2)
    closer = threading.Thread(target=fence.close, kwargs={"timeout": 3 * WAIT}, daemon=True)
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive()  # nothing was left held: close did not wait


def test_a_close_landing_in_the_commit_does_not_wait_for_its_own_attempt(
    tmp_path: Path,
) -> None:
    """Not only inside the effect: a handler may land in the prepare or the commit. There
    close() waited the whole lease for its own attempt, whose lease (no longer renewed)
    lapsed meanwhile, and another process ran the effect again (found by review)."""
    path = tmp_path / "c.db"
    fence = _fence(path)
    took: list[float] = []
    real_commit = fence.commit

    def commit(*a: Any, **kw: Any) -> Any:
        if not took:
            t0 = time.monotonic()
            fence.close()  # as a SIGTERM handler landing at the start of the commit would
            took.append(time.monotonic() - t0)
        return real_commit(*a, **kw)

    fence.commit = commit  # type: ignore[method-assign]

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        return "ch_1"

    assert charge(1) == "ch_1"
    assert took[0] < WAIT
    assert _state(path, "charge:1") is State.DONE


def test_aclose_inside_an_async_effect_does_not_wait_for_it(tmp_path: Path) -> None:
    """aclose() runs close() in a worker thread, which copies the caller's context."""
    path = tmp_path / "ac.db"
    fence = _fence(path)
    took: list[float] = []

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    async def charge(order: int) -> str:
        t0 = time.monotonic()
        await fence.aclose()
        took.append(time.monotonic() - t0)
        return "ch_1"

    assert asyncio.run(charge(1)) == "ch_1"
    assert took[0] < WAIT
    assert _state(path, "charge:1") is State.DONE


def test_no_attempt_starts_on_a_store_closed_by_another_fence(tmp_path: Path) -> None:
    """A fence sharing the store that is not closing must not start an attempt once the
    store is closed (or about to be) by another fence's close."""
    store = SQLiteStore(str(tmp_path / "n.db"))
    first = EffectFence(FenceConfig(lease_ttl=30.0, auto_sweep=False), store=store)
    second = EffectFence(FenceConfig(lease_ttl=60.0, auto_sweep=False), store=store)
    ran: list[int] = []

    @fenced(second, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        ran.append(order)
        return "ch"

    first.close()
    with pytest.raises(StoreUnavailable, match="fence is closing"):  # refused before prepare
        charge(1)
    assert ran == []


def test_a_close_from_an_attempt_on_another_store_waits(tmp_path: Path) -> None:
    """The mark of an attempt in hand is its store's: closing another fence from inside
    an attempt waited for nothing (found by review)."""
    f1 = _fence(tmp_path / "1.db")
    f2 = _fence(tmp_path / "2.db")
    run = Running(f2)
    closing = threading.Thread(target=lambda: run_close_inside(f1, f2))
    closing.start()
    _closing_began(f2)
    # a close that does not wait leaves the store to the effect at once: give it a second
    gave_up = threading.Event()
    for _ in range(1000):
        if f2._holds._close_later:
            gave_up.set()
            break
        gave_up.wait(0.001)
    assert not gave_up.is_set() and closing.is_alive()  # waiting for f2's effect in hand
    run.finish()
    closing.join(WAIT)
    assert not closing.is_alive() and run.out == ["ch_1"]


def run_close_inside(f1: EffectFence, f2: EffectFence) -> None:
    @fenced(f1, intent="shutdown:{n}", domain="ops")
    def shutdown(n: int) -> str:  # an attempt on f1 whose job is closing f2
        f2.close(timeout=3 * WAIT)
        return "ok"

    shutdown(1)


def test_a_task_started_inside_an_attempt_does_not_carry_its_mark_after_it(
    tmp_path: Path,
) -> None:
    """A task started in an attempt copies the context; once the attempt ended, that
    task's aclose() still skipped its wait for other effects (found by review)."""
    path = tmp_path / "m.db"
    fence = _fence(path)

    async def main() -> None:
        shutdown, closed = asyncio.Event(), asyncio.Event()
        b_started, b_release = asyncio.Event(), asyncio.Event()
        watchers: list[asyncio.Task[None]] = []

        async def watcher() -> None:  # a shutdown hook started lazily, inside an attempt
            await shutdown.wait()
            await fence.aclose(timeout=3 * WAIT)
            closed.set()

        @fenced(fence, intent="a:{n}", domain="d:{n}")
        async def a(n: int) -> str:
            watchers.append(asyncio.create_task(watcher()))
            return "ok"

        @fenced(fence, intent="b:{n}", domain="d:{n}")
        async def b(n: int) -> str:
            b_started.set()
            await b_release.wait()
            return "ok"

        await a(1)  # that attempt is over
        tb = asyncio.create_task(b(2))
        await asyncio.wait_for(b_started.wait(), WAIT)
        shutdown.set()
        # a close that does not wait returns within microseconds: give it a second
        probe = asyncio.ensure_future(closed.wait())
        await asyncio.wait([probe], timeout=1.0)
        assert fence.closing and not closed.is_set()  # waiting for b's effect
        probe.cancel()
        b_release.set()
        assert await asyncio.wait_for(tb, WAIT) == "ok"
        await asyncio.wait_for(watchers[0], WAIT)

    asyncio.run(main())
    assert _state(path, "b:2") is State.DONE


# -- a coroutine closed mid-effect, a loop closed under it, a signal inside a step --------------


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_an_async_effect_whose_coroutine_is_closed_mid_run_is_fenced(
    kind: str, tmp_path: Path
) -> None:
    """A task dropped with its loop, then finalized by the collector, is closed: GeneratorExit
    at the effect's await. On a shared store (steps offloaded) what followed awaited, which
    a closing coroutine cannot: the intent stayed in flight with its hold, close() waited,
    and once the lease lapsed an identical call ran the effect again (found by review). It
    is settled at once, as on the memory store: fenced as failed (G9)."""
    import contextlib
    import gc
    import warnings

    from support import FakeClock

    from effectfence.errors import IntentFailed

    asyncio.set_event_loop_policy(None)  # a fresh program: no loop set in this thread
    clock = FakeClock()
    if kind == "sqlite":
        store = SQLiteStore(str(tmp_path / "g.db"), clock=clock)
        fence = EffectFence(FenceConfig(lease_ttl=5.0, auto_sweep=False), store=store)
    else:
        fence = EffectFence(FenceConfig(lease_ttl=5.0, auto_sweep=False, clock=clock))
    runs: list[int] = []
    block = [True]

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    async def charge(order: int) -> str:
        runs.append(order)  # the effect has begun: money may have moved
        if block[0]:
            await asyncio.Event().wait()
        return "ch_1"

    loop = asyncio.new_event_loop()
    keep: list[asyncio.Task[Any]] = []

    async def main() -> None:
        keep.append(asyncio.ensure_future(charge(1)))
        while not runs:
            await asyncio.sleep(0)

    try:
        loop.run_until_complete(main())
        loop.close()
        coro = keep.pop().get_coro()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.suppress(BaseException):
                coro.close()  # what the collector does to a dropped pending task's coroutine
            del coro
            gc.collect()
        assert fence.intent_status("charge:1").state == "failed"
        assert fence._holds._n == 0
        clock.advance(10.0)  # past the lease
        block[0] = False
        with pytest.raises(IntentFailed):
            asyncio.run(charge(1))
        assert runs == [1]
    finally:
        asyncio.set_event_loop_policy(None)
        fence.close()


def test_renewal_ends_once_the_loop_running_the_effect_is_closed(tmp_path: Path) -> None:
    """Renewed from a thread (an async @fenced on a shared store), a lease outlived the loop
    its effect ran on: closed without cancelling the task, nothing could resume the effect,
    yet the lease was renewed until the process exited (found by review)."""
    import contextlib
    import warnings

    renewals: list[float] = []
    more = threading.Event()

    class Counting(SQLiteStore):
        def renew(self, *a: Any, **kw: Any) -> Any:
            out = super().renew(*a, **kw)
            renewals.append(time.monotonic())
            if closed_at and len([t for t in renewals if t > closed_at[0]]) >= 3:
                more.set()
            return out

    closed_at: list[float] = []
    fence = EffectFence(
        FenceConfig(lease_ttl=5.0, auto_sweep=False), store=Counting(str(tmp_path / "f.db"))
    )
    started = threading.Event()

    @fenced(fence, intent="charge:{order}", domain="order:{order}", renew_every=0.05)
    async def charge(order: int) -> str:
        started.set()
        await asyncio.Event().wait()  # a long effect
        return "ch_1"

    loop = asyncio.new_event_loop()
    keep: list[asyncio.Task[Any]] = []

    async def main() -> None:
        keep.append(asyncio.ensure_future(charge(1)))  # a background task, referenced
        while not started.is_set() or not renewals:
            await asyncio.sleep(0.01)

    loop.run_until_complete(main())
    loop.close()  # the effect's task never runs again
    closed_at.append(time.monotonic())
    renewed_on = more.wait(2.0)  # three renewals come in 0.15 s when nothing stops them
    with warnings.catch_warnings(), contextlib.suppress(BaseException):
        warnings.simplefilter("ignore")
        keep[0].get_coro().close()
    fence.close()
    assert not renewed_on, "the lease of an effect whose loop is closed was renewed on"


def test_a_sigterm_handlers_close_inside_a_sqlite_step_does_not_hang(tmp_path: Path) -> None:
    """close() is safe from a signal handler, which runs in the thread it interrupts. With
    no effect in hand it closes the store at once, and the SQLite store's close took the
    lock a step holds while it hands its connection back: a SIGTERM landing there
    deadlocked the thread on itself (found by review). A real signal, in a process of its
    own, raised inside that section."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import signal
        from effectfence import EffectFence, FenceConfig, StoreUnavailable
        from effectfence.store.sqlite import SQLiteStore
        store = SQLiteStore({str(tmp_path / "sig.db")!r})
        fence = EffectFence(FenceConfig(lease_ttl=30.0, auto_sweep=False), store=store)
        signal.signal(signal.SIGTERM, lambda *a: fence.close())
        fence.intent_status("x")

        class Free(list):
            fired = False
            def append(self, conn):
                if not Free.fired:
                    Free.fired = True
                    signal.raise_signal(signal.SIGTERM)  # lands here: the pool's lock held
                super().append(conn)

        store._free = Free(store._free)
        fence.intent_status("y")  # a read not cached: takes a connection, hands it back
        try:
            fence.intent_status("z")
        except StoreUnavailable:
            print("closed cleanly")
        """
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung: a SIGTERM handler's fence.close() deadlocked")
    assert "closed cleanly" in out.stdout, out.stderr


def test_a_connection_handed_back_as_a_signal_handler_closes_the_store_is_closed(
    tmp_path: Path,
) -> None:
    """With the pool's lock reentrant, close() from a signal handler can run inside a step's
    hand-back, between its check and its append: the connection joined a list close() had
    drained already, and stayed open (found by review). The interrupt is where the test's
    list puts it."""
    import sqlite3

    store = SQLiteStore(str(tmp_path / "f.db"))
    conn = store._acquire()

    class Interrupted(list[sqlite3.Connection]):
        fired = False

        def append(self, item: sqlite3.Connection) -> None:
            if not Interrupted.fired:  # the handler runs here: past the check, before this
                Interrupted.fired = True
                store.close()
            super().append(item)

    store._free = Interrupted(store._free)
    store._release(conn)
    assert store._closed
    with pytest.raises(sqlite3.ProgrammingError):
        conn.execute("SELECT 1")  # closed with its store
    with pytest.raises(StoreUnavailable):
        store._acquire()
