"""The one driver (prepare -> run -> renew -> commit) when the store fails around the effect.

A store that is briefly unavailable must not stop the lease being renewed, must not turn an
effect that ran into "nothing was decided", and a caller cancelled while its prepare is in a
worker thread must not leave the intent fenced for an effect that never started. Time is
real but every wait is bounded; collisions are forced with events, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import FakeClock

from effectfence import EffectFence, EffectRequest, FenceConfig, IntentFailed, fenced
from effectfence.driver import (
    Offloader,
    Options,
    Run,
    _off_loop,
    _settle_later,
    drive,
    run_async,
    run_sync,
)
from effectfence.errors import IntentInFlight, StoreUnavailable
from effectfence.store.memory import MemoryStore

BOUND = 20.0

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # run_async and the Offloader are asyncio's


def req(intent: str = "charge:1") -> EffectRequest:
    return EffectRequest(intent, "order:1", "charge", {"cents": 100}, "a")


class Flaky(MemoryStore):
    """A memory store whose chosen steps fail (StoreUnavailable) a set number of times."""

    def __init__(self, **fail: int) -> None:
        super().__init__()
        self.failing = dict(fail)
        self.calls: dict[str, int] = {}
        self.renewed = threading.Event()
        self.claim_entered = threading.Event()
        self.claim_done = threading.Event()
        self.claim_gate: threading.Event | None = None

    def _maybe_fail(self, step: str) -> None:
        self.calls[step] = self.calls.get(step, 0) + 1
        left = self.failing.get(step, 0)
        if left:
            self.failing[step] = left - 1
            raise StoreUnavailable(f"{step}: the store is down (simulated)")

    def renew(self, *args: Any, **kw: Any) -> Any:
        self._maybe_fail("renew")
        out = super().renew(*args, **kw)
        self.renewed.set()
        return out

    def complete(self, *args: Any, **kw: Any) -> Any:
        self._maybe_fail("complete")
        return super().complete(*args, **kw)

    def fail(self, *args: Any, **kw: Any) -> Any:  # the step behind fence.abort
        self._maybe_fail("fail")
        return super().fail(*args, **kw)

    def release(self, *args: Any, **kw: Any) -> Any:
        self._maybe_fail("release")
        return super().release(*args, **kw)

    def claim(self, *args: Any, **kw: Any) -> Any:
        self.claim_entered.set()
        if self.claim_gate is not None:
            assert self.claim_gate.wait(BOUND)
        try:
            return super().claim(*args, **kw)
        finally:
            self.claim_done.set()


def test_a_failed_renewal_does_not_stop_the_heartbeat() -> None:
    """One StoreUnavailable while renewing used to end the heartbeat for good: an effect
    outlasting its lease could then be taken over and run a second time."""
    store = Flaky(renew=1)
    fence = EffectFence(FenceConfig(lease_ttl=5.0), store=store)

    def effect(ticket: Any) -> str:
        assert store.renewed.wait(BOUND), "the lease was never renewed after the blip"
        return "ok"

    done = run_sync(fence, req(), Options(renew_every=0.01), effect)
    assert done.fresh and store.calls["renew"] >= 2


async def test_a_failed_renewal_does_not_stop_the_heartbeat_task() -> None:
    store = Flaky(renew=1)
    fence = EffectFence(FenceConfig(lease_ttl=5.0), store=store)

    async def effect(ticket: Any) -> str:
        async with asyncio.timeout(BOUND):
            while not store.renewed.is_set():
                await asyncio.sleep(0.005)
        return "ok"

    done = await run_async(fence, req(), Options(renew_every=0.01), effect)
    assert done.fresh and store.calls["renew"] >= 2


def test_a_commit_is_tried_again_through_a_short_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0, 0.0), raising=False)
    store = Flaky(complete=2)
    fence = EffectFence(store=store)
    runs: list[int] = []
    done = run_sync(fence, req(), Options(), lambda t: runs.append(1) or "charged")
    assert done.fresh and done.cert.result == "charged" and runs == [1]
    assert fence.prepare(req()).fresh is False  # recorded: a duplicate replays


@pytest.mark.parametrize("applies", [False, True])
def test_a_commit_that_raises_an_untyped_error_leaves_the_intent_fenced_not_in_flight(
    applies: bool,
) -> None:
    """A store's untyped error at commit (Redis's NoScriptError was one, found by review)
    was neither retried nor fenced: the intent stayed in flight and, once its lease
    lapsed, an identical call ran the effect again. The driver now aborts (compare by
    token): fenced if the commit did not apply, unchanged if it did."""

    class Broken(MemoryStore):
        def complete(self, *args: Any, **kw: Any) -> Any:
            if applies:
                super().complete(*args, **kw)
            raise KeyError("a store bug")

    fence = EffectFence(store=Broken())
    runs: list[int] = []
    with pytest.raises(KeyError):
        run_sync(fence, req(), Options(), lambda t: runs.append(1) or "charged")
    assert runs == [1]
    state = fence.intent_status("charge:1").state
    assert state == ("done" if applies else "failed"), state


def test_an_effect_that_ran_but_was_never_recorded_says_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old answer was the store's own "retry later; nothing was decided", for an effect
    that had run: the retry it invites runs it twice. Now: it RAN, not retryable, and the
    intent is fenced as failed so identical attempts are refused."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0), raising=False)
    store = Flaky(complete=100)
    fence = EffectFence(store=store)
    with pytest.raises(StoreUnavailable) as caught:
        run_sync(fence, req(), Options(), lambda t: "charged")
    refusal = caught.value
    assert refusal.retryable is False and "RAN" in refusal.message
    assert refusal.details["ran"] is True and "do not run it again" in refusal.recover
    assert store.calls["complete"] == 3
    assert fence.intent_status("charge:1").state == "failed"


async def test_a_caller_cancelled_while_its_prepare_runs_off_the_loop_leaves_nothing_held() -> None:
    """The prepare admits the intent in a worker thread just as its caller is cancelled:
    nobody will run the effect, so the admission is released (not aborted: that would
    refuse every identical call until an operator cleared an effect that never started)."""
    store = Flaky()
    store.claim_gate = threading.Event()
    fence = EffectFence(store=store)
    offloader = Offloader(2, name="test-cancel")
    started: list[int] = []

    async def effect(ticket: Any) -> str:
        started.append(1)
        return "charged"

    await _cancelled_during_the_claim(store, fence, offloader, effect)
    async with asyncio.timeout(BOUND):
        while not store.claim_done.is_set():
            await asyncio.sleep(0.005)
        while fence.intent_status("charge:1").state != "absent":  # admitted, then let go
            await asyncio.sleep(0.005)
    assert started == []
    again = fence.prepare(req())
    assert again.fresh  # an identical call runs: nothing was left fenced
    offloader.close()


def test_a_commit_refused_unavailable_says_to_commit_again_not_to_run_again() -> None:
    """The store's own recover ("retry later; nothing was decided") is about the step; read
    about the effect, which ran, it invites running it twice (MCP agents read `recover`)."""
    store = Flaky(complete=1)
    fence = EffectFence(store=store)
    adm = fence.prepare(req())
    with pytest.raises(StoreUnavailable) as caught:
        fence.commit(adm.ticket, "charged")
    assert caught.value.retryable is True
    assert "commit again" in caught.value.recover and "do NOT run" in caught.value.recover
    assert fence.commit(adm.ticket, "charged").result == "charged"  # and so it is safe


async def test_a_caller_cancelled_while_its_commit_is_retried_still_gets_it_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The effect ran; the commit met a blip and waits to try again; the caller gives up
    (a timeout). The commit must still be carried through: left half-tried, the intent
    stayed in flight and an identical call ran the effect again once the lease lapsed."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.2, 0.2))
    store = Flaky(complete=1)
    fence = EffectFence(store=store)
    runs: list[int] = []

    async def effect(ticket: Any) -> str:
        runs.append(1)
        return "charged"

    task = asyncio.ensure_future(run_async(fence, req(), Options(), effect))
    async with asyncio.timeout(BOUND):
        while store.calls.get("complete", 0) < 1:  # the first commit failed: now pausing
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(BOUND):
        while fence.intent_status("charge:1").state != "done":
            await asyncio.sleep(0.01)
    again = fence.prepare(req())
    assert again.fresh is False and again.cert.result == "charged" and runs == [1]


def test_an_abort_the_store_refuses_leaves_the_callers_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The effect failed (it may have fired) and the store would not take the abort: the
    caller used to get the store's "retry later; nothing was decided" instead of its own
    error, an invitation to run the effect again."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0))
    store = Flaky(fail=100)
    fence = EffectFence(store=store)

    def effect(ticket: Any) -> str:
        raise TimeoutError("the gateway did not answer")

    with pytest.raises(TimeoutError) as caught:
        run_sync(fence, req(), Options(), effect)
    assert store.calls["fail"] == 3  # tried again before giving up
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "could not be fenced as failed" in notes and "stays in flight" in notes


@pytest.mark.parametrize("fired", [True, False])
def test_a_settle_refused_lease_lost_leaves_the_callers_own_error(fired: bool) -> None:
    """The function stalled past its lease, a retry took the intent over, then it raised:
    its abort (or, for a did-not-fire error, its release) is refused lease_lost, and that
    refusal replaced the caller's own exception (found by review): `except TimeoutError`
    no longer fired, and a did-not-fire error came back as lease_lost."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=10.0, clock=clock, auto_sweep=False))

    def effect(ticket: Any) -> str:
        clock.advance(11)  # past its lease: an identical call takes the intent over
        assert fence.prepare(req()).fresh
        raise (TimeoutError if fired else ConnectionRefusedError)("the gateway")

    options = Options(did_not_fire=() if fired else (ConnectionRefusedError,))
    with pytest.raises(TimeoutError if fired else ConnectionRefusedError) as caught:
        run_sync(fence, req(), options, effect)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    what = "fenced as failed" if fired else "released"
    assert f"could not be {what}" in notes and "refused lease_lost" in notes, notes
    assert fence.intent_status("charge:1").state == "in_flight"  # the new holder's, untouched


def test_an_abort_through_a_short_outage_fences_the_intent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0))
    store = Flaky(fail=1)
    fence = EffectFence(store=store)

    def effect(ticket: Any) -> str:
        raise TimeoutError("the gateway did not answer")

    with pytest.raises(TimeoutError):
        run_sync(fence, req(), Options(), effect)
    assert fence.intent_status("charge:1").state == "failed"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["in the commit step", "in the commit's retry pause"])
def test_an_interrupt_after_the_effect_ran_never_leaves_it_in_flight(
    monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException], where: str
) -> None:
    """Ctrl-C, or a SIGTERM handler's SystemExit, landing after the effect ran (in the
    commit, or while the commit rides out an outage) left the intent in flight, and once
    its lease lapsed an identical call ran the effect again (found by review). The driver
    now records it once more on the way out, or else fences it."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (5.0,))
    store = Flaky(complete=0 if where == "in the commit step" else 1)  # 1: an outage first
    fence = EffectFence(store=store)
    if where == "in the commit step":
        real = store.complete

        def complete(*args: Any, **kw: Any) -> Any:
            store.complete = real  # type: ignore[method-assign]  # once
            raise interrupt()

        store.complete = complete  # type: ignore[method-assign]
    else:

        def sleep(seconds: float) -> None:
            raise interrupt()  # the signal lands while the driver waits to commit again

        monkeypatch.setattr("effectfence.driver.time.sleep", sleep)
    runs: list[int] = []
    with pytest.raises(interrupt):
        run_sync(fence, req(), Options(), lambda t: runs.append(1) or "charged")
    assert runs == [1]
    assert fence.intent_status("charge:1").state == "done"  # recorded on the way out
    again = fence.prepare(req())
    assert not again.fresh and again.cert.result == "charged"


def test_an_interrupt_when_nothing_can_be_recorded_fences_the_intent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same interrupt with a store that stays down at commit: the one commit on the
    way out fails too, and the one abort after it fences the intent."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (5.0,))
    store = Flaky(complete=100)

    def sleep(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("effectfence.driver.time.sleep", sleep)
    fence = EffectFence(store=store)
    with pytest.raises(KeyboardInterrupt):
        run_sync(fence, req(), Options(), lambda t: "charged")
    assert store.calls["complete"] == 2  # the failed one, then the one on the way out
    status = fence.intent_status("charge:1")
    assert status.state == "failed" and status.reason is not None
    assert "it ran" in status.reason and "interrupted" in status.reason


async def test_renewals_are_not_queued_behind_the_effects_own_threads() -> None:
    """A store that blocks (offload) was renewed through the loop's default executor; an
    effect calling its blocking SDK with ``asyncio.to_thread`` fills that same executor,
    so the renewals waited behind the very effects they kept alive and the leases lapsed
    mid-effect (found by review). Here the executor has one worker, the effect holds it
    until it has seen a renewal, and a renewal must come meanwhile."""
    import concurrent.futures

    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
    store = Flaky()
    fence = EffectFence(store=store)

    async def effect(ticket: Any) -> bool:
        return await asyncio.to_thread(store.renewed.wait, 5.0)  # the SDK call, blocking

    done = await run_async(fence, req(), Options(renew_every=0.01), effect, offload=True)
    assert done.fresh and done.cert.result is True  # renewed while the effect held the worker


async def _cancelled_during_the_claim(
    store: Flaky, fence: EffectFence, offloader: Offloader, effect: Any
) -> None:
    """A caller cancelled while its prepare is in the store (off the loop); the claim then
    completes in its thread, for nobody."""
    assert store.claim_gate is not None
    task = asyncio.ensure_future(run_async(fence, req(), Options(), effect, offload=offloader))
    async with asyncio.timeout(BOUND):
        while not store.claim_entered.is_set():
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store.claim_gate.set()


async def _state_becomes(fence: EffectFence, state: str, intent: str = "charge:1") -> None:
    async with asyncio.timeout(BOUND):
        while fence.intent_status(intent).state != state:
            await asyncio.sleep(0.005)


async def test_an_anyio_cancel_as_the_prepare_step_ends_releases_before_the_effect() -> None:
    """An anyio cancel scope (the MCP SDK's) cancelled after the offloaded prepare finished
    but before its task resumed: anyio delivers nothing at that await (the answer is in).
    The effect then started, the cancel landed at its first await, and the intent was
    fenced as failed for an effect that never began (found by review). Now the cancel
    lands before the effect and the admission is released."""
    store = Flaky()
    store.claim_gate = threading.Event()
    fence = EffectFence(store=store)
    offloader = Offloader(2, name="cancel-as-step-ends")
    started: list[int] = []
    loop = asyncio.get_running_loop()
    host: dict[str, Any] = {}
    cancelled = asyncio.Event()

    async def effect(ticket: Any) -> str:
        started.append(1)
        await asyncio.sleep(0)
        return "charged"

    async def caller() -> None:
        host["task"] = asyncio.current_task()
        with anyio.CancelScope() as scope:
            host["scope"] = scope
            await run_async(fence, req(), Options(), effect, offload=offloader)

    def poll() -> None:  # cancel exactly when the step's answer is in, unread
        task = host.get("task")
        if task is not None and store.claim_done.is_set():
            waiter = task._fut_waiter
            if waiter is not None and waiter.done():
                host["scope"].cancel()
                cancelled.set()
                return
        loop.call_soon(poll)

    t = asyncio.ensure_future(caller())
    async with asyncio.timeout(BOUND):
        while not store.claim_entered.is_set():
            await asyncio.sleep(0.005)
    loop.call_soon(poll)
    store.claim_gate.set()
    async with asyncio.timeout(BOUND):
        await cancelled.wait()
        await t
    await _state_becomes(fence, "absent")
    offloader.close()
    assert started == []


async def test_a_release_after_a_cancel_rides_out_a_store_blip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of an admission whose caller was cancelled meets one StoreUnavailable:
    it is tried again, as a commit is. The Pause was dropped, the release never retried,
    and the intent stayed in flight, held by nobody, until its lease lapsed (review)."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.01, 0.01, 0.01))
    store = Flaky(release=1)
    store.claim_gate = threading.Event()
    fence = EffectFence(store=store)
    offloader = Offloader(2, name="release-blip")

    async def effect(ticket: Any) -> str:
        raise AssertionError("never started")

    await _cancelled_during_the_claim(store, fence, offloader, effect)
    async with asyncio.timeout(BOUND):  # the first release fails; the second must come
        while store.calls.get("release", 0) < 2:
            await asyncio.sleep(0.005)
    await _state_becomes(fence, "absent")
    offloader.close()


@pytest.mark.parametrize("how", ["offloader", "default executor"])
def test_a_release_handed_off_as_the_loop_shuts_down_still_runs(how: str) -> None:
    """A cancelled caller's admission is handed off to be released just as the loop shuts
    down. Handed off as a task, it was cancelled before its first step, the release never
    ran, and the collector closing the driver aborted the intent: refused to every
    identical call until an operator cleared it, for an effect that never began (review)."""
    fence = EffectFence(store=MemoryStore())
    offloader = Offloader(1, name="shutdown-release")
    off_loop = _off_loop(offloader if how == "offloader" else True)
    assert off_loop is not None

    async def main() -> None:
        gen = drive(fence, req(), Options())
        instr = gen.send(None)
        assert isinstance(instr, Run)  # admitted; nobody will run it
        _settle_later(off_loop, gen, (False, instr))
        # a shutdown that cancels every task (as servers do on SIGTERM) reaches the
        # hand-off before its first step
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    asyncio.run(main())
    gc.collect()  # a driver left parked is closed here
    deadline = threading.Event()
    for _ in range(int(BOUND / 0.005)):
        if fence.intent_status("charge:1").state != "in_flight":
            break
        deadline.wait(0.005)
    offloader.close()
    assert fence.intent_status("charge:1").state == "absent"  # released, not aborted
    assert fence.prepare(req()).fresh


def test_a_coroutine_closed_mid_effect_after_a_takeover_closes_quietly() -> None:
    """A coroutine closed mid-effect (its loop gone, the collector finalizing a dropped
    task) fences the intent once; if the lease was taken over meanwhile, that abort is
    refused lease_lost. The refusal came out of close() in place of GeneratorExit (noted
    by review): close() raised an exception no finalizer expects, for a hold already gone."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=5.0, clock=clock, auto_sweep=False))
    loop = asyncio.new_event_loop()
    never = loop.create_future()
    started: list[int] = []

    async def effect(ticket: Any) -> str:
        started.append(1)
        await never
        return "charged"

    coro = run_async(fence, req(), Options(), effect)
    try:
        assert coro.send(None) is never  # parked inside the effect
        clock.advance(6)  # the lease lapses; another caller takes it over
        taken = EffectRequest("charge:1", "order:1", "charge", {"cents": 100}, "b")
        assert fence.prepare(taken).fresh
        coro.close()  # must not raise
    finally:
        loop.close()
    assert started == [1]
    assert fence.intent_status("charge:1").state == "in_flight"  # the takeover's, untouched


class _NoRenewThreads:
    """threading.Thread.start fails for the fence's renewal threads only (a process at its
    thread limit: "can't start new thread")."""

    def __enter__(self) -> None:
        self.orig = threading.Thread.start
        orig = self.orig

        def start(th: threading.Thread) -> None:
            if th.name.startswith("effectfence-renew"):
                raise RuntimeError("can't start new thread")
            orig(th)

        threading.Thread.start = start  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        threading.Thread.start = self.orig  # type: ignore[method-assign]


def test_a_renewer_that_cannot_start_releases_an_effect_that_never_ran() -> None:
    """The renewal thread fails to start after the admission, before the function is
    called. The driver was left parked, and the collector closing it aborted the intent:
    fenced as failed for an effect that never ran (found by review)."""
    fence = EffectFence()
    ran: list[int] = []

    @fenced(fence, intent="pay:{n}", domain="acct:{n}", renew_every=1.0)
    def pay(n: int) -> dict[str, int]:
        ran.append(n)
        return {"n": n}

    with _NoRenewThreads(), pytest.raises(RuntimeError):
        pay(1)
    gc.collect()
    assert ran == []
    assert fence.intent_status("pay:1").state == "absent"
    assert pay(1) == {"n": 1} and ran == [1]  # a retry runs it


def test_a_renewer_that_cannot_start_releases_an_async_effect_on_a_durable_store(
    tmp_path: Path,
) -> None:
    """The same, for a coroutine on SQLite (steps offloaded, renewed from a thread)."""
    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db")
    ran: list[int] = []

    @fenced(fence, intent="pay:{n}", domain="acct:{n}", renew_every=1.0)
    async def pay(n: int) -> dict[str, int]:
        ran.append(n)
        return {"n": n}

    async def main() -> None:
        with _NoRenewThreads(), pytest.raises(RuntimeError):
            await pay(1)

    try:
        asyncio.run(main())
        gc.collect()
        for _ in range(int(BOUND / 0.005)):  # released by a worker thread
            if fence.intent_status("pay:1").state != "in_flight":
                break
            threading.Event().wait(0.005)
        assert ran == []
        assert fence.intent_status("pay:1").state == "absent"
    finally:
        fence.close(timeout=0)


def test_an_interrupt_while_the_renewer_starts_leaves_nothing_renewing() -> None:
    """Ctrl-C lands in Thread.start() of the renewal thread (it waits for the thread to
    run), before the function is called. The thread ran on with nobody holding its stop
    event: while anything kept the driver alive (a REPL's sys.last_value), the lease was
    renewed for ever and every identical call refused intent_in_flight (found by review)."""
    fence = EffectFence(FenceConfig(lease_ttl=0.3))
    ran: list[int] = []

    @fenced(fence, intent="pay:{n}", domain="acct:{n}", renew_every=0.05)
    def pay(n: int) -> dict[str, int]:
        ran.append(n)
        return {"n": n}

    orig = threading.Thread.start
    renewers: list[threading.Thread] = []

    def start(th: threading.Thread) -> None:
        orig(th)
        if th.name.startswith("effectfence-renew"):
            renewers.append(th)
            raise KeyboardInterrupt  # delivered in start()'s wait for the thread

    kept: list[BaseException] = []
    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        pay(1)
    except KeyboardInterrupt as exc:
        kept.append(exc)  # kept alive, as a REPL or an error reporter keeps it
    finally:
        threading.Thread.start = orig  # type: ignore[method-assign]
    assert len(renewers) == 1
    renewers[0].join(5.0)
    assert not renewers[0].is_alive(), "the renewal thread still runs"
    assert ran == []
    assert fence.intent_status("pay:1").state == "absent"


def test_an_exception_type_with_a_long_name_is_fenced_not_run_again(clock: FakeClock) -> None:
    """The function raised (outcome unknown, G9): fenced as failed. The reason named the
    exception's type unbounded; over 4 KiB the fence refused it, the abort was undone, and
    once the lease lapsed the effect ran again (found by review)."""
    fence = EffectFence(FenceConfig(clock=clock, lease_ttl=10.0))
    ran: list[int] = []
    boom = type("Gateway" + "E" * 4200, (Exception,), {})  # a dynamically named fault

    @fenced(fence, intent="pay:{n}", domain="acct:{n}")
    def pay(n: int) -> None:
        ran.append(n)
        raise boom("timeout talking to the bank: charged or not?")

    with pytest.raises(boom):
        pay(1)
    clock.advance(11.0)  # the first attempt's lease lapses
    with pytest.raises(IntentFailed):
        pay(1)
    assert ran == [1]


class _FailBlips(MemoryStore):
    """fail() (the step behind abort) is unavailable ``n`` times; complete() may be broken."""

    def __init__(self, n: int, *, broken_complete: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.n = n
        self.broken_complete = broken_complete

    def fail(self, *a: Any, **kw: Any) -> Any:
        if self.n > 0:
            self.n -= 1
            raise StoreUnavailable("blip")
        return super().fail(*a, **kw)

    def complete(self, *a: Any, **kw: Any) -> Any:
        if self.broken_complete:
            raise RuntimeError("a step that should never raise this")
        return super().complete(*a, **kw)


@pytest.mark.parametrize("case", ["unrecordable result", "untyped commit error"])
def test_an_interrupt_while_an_abort_rides_out_a_blip_makes_one_last_attempt(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The function ran; its result cannot be recorded (NaN), or its commit fails with an
    untyped error: the driver aborts. The abort meets a store blip and pauses; Ctrl-C lands
    in the pause. Closed there, the driver made no last attempt, the intent stayed in
    flight, and once its lease lapsed the effect ran a second time (found by review)."""
    store = _FailBlips(1, broken_complete=case == "untyped commit error", clock=clock)
    fence = EffectFence(FenceConfig(lease_ttl=10.0), store=store)
    ran: list[int] = []

    @fenced(fence, intent="pay:{n}", domain="acct:{n}")
    def pay(n: int) -> Any:
        ran.append(n)
        return float("nan") if case == "unrecordable result" else {"n": n}

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("effectfence.driver.time.sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pay(1)
    monkeypatch.undo()
    assert fence.intent_status("pay:1").state == "failed"
    clock.advance(11.0)
    with pytest.raises(IntentFailed):
        pay(1)
    assert ran == [1]


def test_a_stop_iteration_from_the_function_reaches_the_caller_as_itself() -> None:
    """The caller hears its own exception; a StopIteration (next() on an exhausted
    iterator) re-raised through the driver came out as RuntimeError (PEP 479; review)."""
    fence = EffectFence()

    @fenced(fence, intent="pay:{n}", domain="acct:{n}")
    def pay(n: int) -> None:
        next(iter(()))

    with pytest.raises(StopIteration):
        pay(1)
    assert fence.intent_status("pay:1").state == "failed"  # it ran: fenced, as any raise


def test_from_url_memory_passes_its_options_to_the_store() -> None:
    """from_url passes its options to the store, as for every URL; for memory they were
    dropped without a word: an injected clock unused, a misplaced lease_ttl accepted
    (found by review). The first fix refused them all, though the memory store takes
    several (its review): they go to the store now, with the config's clock and table."""
    assert EffectFence.from_url("memory:", clock=FakeClock(5.0)).store.now() == 5.0
    kept = EffectFence.from_url("memory:", audit_keep=5)
    assert kept.store._audit.maxlen == 5  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="lease_ttl"):
        EffectFence.from_url("memory:", lease_ttl=1.0)  # meant FenceConfig(lease_ttl=1.0)
    fence = EffectFence.from_url("memory:", FenceConfig(clock=FakeClock(7.0)), audit_keep=5)
    assert fence.store.now() == 7.0


def test_a_refusal_from_inside_the_function_says_what_became_of_the_call() -> None:
    """A nested fenced call refused store_unavailable ("retry later; nothing was decided")
    inside the function reached the caller as if this call's own: retryable, while its
    intent was now fenced as failed and a retry was refused intent_failed (review). The
    refusal now carries a note naming the intent and what became of it."""
    fence = EffectFence()

    @fenced(fence, intent="order:{n}", domain="acct:{n}")
    def order(n: int) -> None:
        raise StoreUnavailable("the ledger is down (simulated)")  # a nested call's refusal

    with pytest.raises(StoreUnavailable) as got:
        order(1)
    notes = getattr(got.value, "__notes__", [])
    assert any("'order:1'" in n and "fenced as failed" in n for n in notes), notes
    assert fence.intent_status("order:1").state == "failed"


def test_a_stop_iteration_after_an_abort_blip_reaches_the_caller_as_itself() -> None:
    """The first fix caught PEP 479's RuntimeError only around the throw; when the abort
    that follows meets a store blip, it came out of the next step after the pause, and the
    caller heard RuntimeError again (found by review of that fix)."""
    fence = EffectFence(store=Flaky(fail=1))

    def effect(ticket: Any) -> None:
        next(iter(()))

    with pytest.raises(StopIteration):
        run_sync(fence, req(), Options(), effect)
    assert fence.intent_status("charge:1").state == "failed"


def _join_workers(prefix: str) -> None:
    for th in threading.enumerate():
        if th.name.startswith(prefix):
            th.join(BOUND)
            assert not th.is_alive(), th.name


@pytest.mark.parametrize("how", ["offloader", "default executor"])
def test_a_commit_handed_off_as_the_loop_shuts_down_still_runs(how: str) -> None:
    """The effect ran; a shutdown cancelling every task lands in the next loop turn. The
    commit was handed to a task of its own, which the shutdown reached before its first
    step: never sent. With the default executor the collector then aborted the intent (an
    effect that succeeded fenced as failed); with an Offloader the idle worker kept the
    parked driver alive, the intent stayed in flight, and once the lease lapsed an
    identical call ran the effect again (found by review). The commit is queued at once."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(clock=clock, lease_ttl=10.0))
    offloader = Offloader(1, name="commit-at-shutdown")
    ran: list[int] = []

    def cancel_all() -> None:
        for task in asyncio.all_tasks():
            task.cancel()

    async def effect(ticket: Any) -> str:
        ran.append(1)
        asyncio.get_running_loop().call_soon(cancel_all)  # SIGTERM lands as it returns
        return "charged"

    async def main() -> None:
        offload: Offloader | bool = offloader if how == "offloader" else True
        task = asyncio.ensure_future(run_async(fence, req(), Options(), effect, offload=offload))
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())  # waits for the default executor's jobs
    offloader.close()
    _join_workers("commit-at-shutdown")  # the Offloader's queued jobs have run
    gc.collect()
    status = fence.intent_status("charge:1")
    assert status.state == "done", status
    clock.advance(11.0)
    again = run_sync(fence, req(), Options(), lambda ticket: ran.append(2) or "charged")
    assert ran == [1] and not again.fresh and again.result == "charged"


def test_a_commit_riding_out_a_blip_as_the_loop_shuts_down_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The effect ran; its commit met a store blip, and the task carrying it paused. A
    shutdown cancelling every task reached it in the pause: the commit was never tried
    again, the driver (kept alive by the idle worker) stayed parked, and once the lease
    lapsed an identical call ran the effect a second time (found by review)."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (2.0,))  # the shutdown within
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=10.0), store=_ShutdownOnBlip(clock=clock))
    offloader = Offloader(1, name="commit-blip-shutdown")
    ran: list[int] = []

    async def effect(ticket: Any) -> str:
        ran.append(1)
        return "charged"

    async def main() -> None:
        fence.store.loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
        task = asyncio.ensure_future(run_async(fence, req(), Options(), effect, offload=offloader))
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())
    # the Offloader lives on, as a server's does: its idle worker kept the parked driver
    # alive, so not even the collector's last attempt came
    gc.collect()
    for _ in range(int(10.0 / 0.01)):  # the commit's pause is 2 s
        if fence.intent_status("charge:1").state != "in_flight":
            break
        threading.Event().wait(0.01)
    status = fence.intent_status("charge:1")
    offloader.close()
    _join_workers("commit-blip-shutdown")
    assert status.state == "done", status
    clock.advance(11.0)
    again = run_sync(fence, req(), Options(), lambda ticket: ran.append(2) or "charged")
    assert ran == [1] and not again.fresh


class _ShutdownOnBlip(MemoryStore):
    """complete() is unavailable once, and a shutdown that cancels every task is set to
    land while the driver pauses before trying it again."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.blips = 1

    def complete(self, *a: Any, **kw: Any) -> Any:
        if self.blips:
            self.blips -= 1
            loop = self.loop
            assert loop is not None

            def cancel_all() -> None:
                for task in asyncio.all_tasks():
                    task.cancel()

            loop.call_soon_threadsafe(loop.call_later, 0.2, cancel_all)  # in the pause
            raise StoreUnavailable("complete: the store is down (simulated)")
        return super().complete(*a, **kw)


class _ThreadLimit:
    """Thread.start fails once for threads named ``prefix`` (a process at its limit)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.failed: list[str] = []

    def __enter__(self) -> _ThreadLimit:
        self.orig = orig = threading.Thread.start

        def start(th: threading.Thread) -> None:
            if th.name.startswith(self.prefix) and not self.failed:
                self.failed.append(th.name)
                raise RuntimeError("can't start new thread")
            orig(th)

        threading.Thread.start = start  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        threading.Thread.start = self.orig  # type: ignore[method-assign]


def test_a_step_whose_worker_cannot_start_is_not_queued_behind_the_callers_back() -> None:
    """The Offloader queued a prepare, then failed to start the thread for it: the caller
    heard RuntimeError while its prepare stayed queued. A later step's worker ran it: the
    intent admitted for a caller long gone, then aborted when the driver was let go: fenced
    as failed for an effect that never began (found by review)."""
    fence = EffectFence(store=MemoryStore())
    offloader = Offloader(2, name="worker-limit")
    ran: list[str] = []

    async def effect(ticket: Any) -> str:
        ran.append(ticket.intent)
        return "charged"

    async def main() -> None:
        limit = _ThreadLimit("worker-limit")
        with limit, pytest.raises(RuntimeError, match="can't start new thread"):
            await run_async(fence, req(), Options(), effect, offload=offloader)
        assert limit.failed
        other = await run_async(fence, req("charge:2"), Options(), effect, offload=offloader)
        assert other.fresh

    asyncio.run(main())
    offloader.close()
    _join_workers("worker-limit")
    gc.collect()
    assert ran == ["charge:2"]
    assert fence.intent_status("charge:1").state == "absent"


def test_a_worker_that_cannot_start_leaves_the_offloader_working() -> None:
    """A release handed off when no thread could start: it ran inline, but the Offloader
    had counted a worker that never ran, so every later step on it waited for ever
    (found by review)."""
    fence = EffectFence(store=MemoryStore())
    offloader = Offloader(1, name="one-worker")
    off_loop = _off_loop(offloader)
    assert off_loop is not None

    async def main() -> None:
        gen = drive(fence, req(), Options())
        instr = gen.send(None)
        assert isinstance(instr, Run)
        with _ThreadLimit("one-worker") as limit:
            _settle_later(off_loop, gen, (False, instr))  # a cancelled caller's admission
        assert limit.failed
        assert fence.intent_status("charge:1").state == "absent"  # released inline
        assert await asyncio.wait_for(offloader.run(lambda: "stepped"), BOUND) == "stepped"

    try:
        asyncio.run(main())
    finally:
        offloader.close()


@pytest.mark.parametrize("raised", [False, True])
def test_a_step_the_default_executor_queued_as_it_failed_runs_once(
    monkeypatch: pytest.MonkeyPatch, raised: bool
) -> None:
    """offload=True: the default executor queues a job before it starts a thread for it.
    A thread that could not start: the commit (or abort) ran here, and the queued copy ran
    as well once a thread was free: two drivers of one generator, run_async returned None,
    and an abort could be lost (found by review). The first to start runs it, once."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.5,))
    fence = EffectFence(store=Flaky(fail=1) if raised else Flaky(complete=1))
    gate = threading.Event()
    limit = _ThreadLimit("asyncio")

    async def effect(ticket: Any) -> str:
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, gate.wait, BOUND)  # the executor's one thread is busy
        limit.__enter__()  # and no other can start now
        threading.Timer(0.05, gate.set).start()  # the busy thread frees up soon
        if raised:
            raise ValueError("card declined")
        return "charged"

    async def main() -> Any:
        try:
            return await run_async(fence, req(), Options(), effect, offload=True)
        finally:
            limit.__exit__()

    if raised:
        with pytest.raises(ValueError, match="card declined"):
            asyncio.run(main())
    else:
        done = asyncio.run(main())
        assert done is not None and done.result == "charged", done
    assert limit.failed
    assert fence.intent_status("charge:1").state == ("failed" if raised else "done")


CHILD = textwrap.dedent(
    """
    import asyncio, contextlib, sys
    import effectfence.driver as drv
    from effectfence import EffectFence, FenceConfig
    from effectfence.driver import Options, run_async
    from effectfence.errors import StoreUnavailable
    from effectfence.store.sqlite import SQLiteStore
    from effectfence.model import EffectRequest

    drv.COMMIT_RETRY_PAUSES = (1.0,)  # one blip, one pause of 1 s

    class Blip(SQLiteStore):
        blips = 1
        def complete(self, *a, **kw):
            if Blip.blips:
                Blip.blips -= 1
                raise StoreUnavailable("complete: the store is down (simulated)")
            return super().complete(*a, **kw)

    fence = EffectFence(FenceConfig(lease_ttl=30.0), store=Blip(sys.argv[1]))

    async def effect(ticket):
        loop = asyncio.get_running_loop()
        def cancel_all():  # Ctrl-C / SIGTERM during the commit's retry pause
            for task in asyncio.all_tasks():
                task.cancel()
        loop.call_later(0.3, cancel_all)
        return "charged"

    async def main():
        req = EffectRequest("charge:1", "order:1", "charge", {"cents": 100}, "a")
        with contextlib.suppress(asyncio.CancelledError):
            await run_async(fence, req, Options(), effect, offload=True)

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())  # waits for the default executor's jobs
    print("exited")
    """
)


def test_a_commit_riding_out_a_blip_outlives_the_process_ending(tmp_path: Path) -> None:
    """offload=True; the effect ran; its commit met a store blip and a shutdown landed in
    the retry pause. asyncio.run returned and the script ended, while the pause was ridden
    out in a daemon thread nobody waited for: the commit was never tried again, the intent
    stayed in flight, and once its lease lapsed the effect ran again (found by review).
    The thread is not a daemon: the process waits for it."""
    import subprocess
    import sys

    db = tmp_path / "fence.db"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(db)], capture_output=True, text=True, timeout=60
    )
    assert "exited" in out.stdout, out.stderr
    fence = EffectFence.from_url(f"sqlite:///{db}")
    try:
        assert fence.intent_status("charge:1").state == "done"
    finally:
        fence.close()


@pytest.mark.parametrize("step", ["commit", "release"])
def test_a_settle_step_riding_out_a_blip_leaves_other_calls_renewals_alone(step: str) -> None:
    """A's commit (its effect ran), or the release of A's admission (its caller went away
    while it was claimed), meets four store blips. Their retry pauses were slept in the
    shared worker: B's lease renewals queued behind them, B's lease lapsed mid-effect and
    an identical call was admitted again, so B's effect could run twice (found by review,
    for the commit, then for the release). Pauses are ridden out in a thread of their own."""
    store = Flaky(**{"complete" if step == "commit" else "release": 4})  # 1.75 s of pauses
    fence = EffectFence(FenceConfig(lease_ttl=1.0), store=store)
    offloader = Offloader(1, name="renewals-alone")
    b_started = threading.Event()
    taken_over: list[bool] = []

    async def main() -> None:
        b_may_end = asyncio.Event()

        async def effect_b(ticket: Any) -> str:
            b_started.set()
            await b_may_end.wait()
            return "b"

        async def effect_a(ticket: Any) -> str:
            assert step == "commit", "A's effect must not run"
            return "a"

        options = Options(renew_every=0.1)
        b = asyncio.ensure_future(
            run_async(fence, req("charge:B"), options, effect_b, offload=offloader)
        )
        async with asyncio.timeout(BOUND):
            while not b_started.is_set():
                await asyncio.sleep(0.005)
        gate = threading.Event()
        store.claim_entered.clear()
        store.claim_gate = gate
        a = asyncio.ensure_future(
            run_async(fence, req("charge:A"), Options(), effect_a, offload=offloader)
        )
        async with asyncio.timeout(BOUND):
            while not store.claim_entered.is_set():
                await asyncio.sleep(0.005)
        if step == "release":
            a.cancel()  # A's caller goes away while its claim runs in the worker
        gate.set()
        async with asyncio.timeout(BOUND):
            while store.calls.get("complete" if step == "commit" else "release", 0) < 4:
                await asyncio.sleep(0.005)  # until A's step is in its last (1 s) pause
        await asyncio.sleep(0.5)  # half of that pause: B renewed every 0.1 s meanwhile
        with contextlib.suppress(IntentInFlight):  # another process's identical call
            taken_over.append(fence.prepare(req("charge:B")).fresh)
        b_may_end.set()
        async with asyncio.timeout(BOUND):
            assert (await b).fresh
            with contextlib.suppress(asyncio.CancelledError):
                await a

    asyncio.run(main())
    offloader.close()
    _join_workers("renewals-alone")
    _join_workers("effectfence-settle")
    assert fence.intent_status("charge:A").state == ("done" if step == "commit" else "absent")
    assert taken_over == []


def test_a_commit_delivered_after_its_loop_closed_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """offload=True; the commit meets a blip and a shutdown lands in its retry pause. The
    commit applies from its own thread after asyncio.run closed the loop, and its answer
    can't be delivered: the future waiting for it stayed in the module's set for good, and
    the closed loop with it, one per such shutdown (found by review)."""
    import effectfence.driver as drv

    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.3,))
    fence = EffectFence(store=Flaky(complete=1))
    before = set(drv._SETTLING)

    async def effect(ticket: Any) -> str:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        return "charged"

    async def main() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await run_async(fence, req(), Options(), effect, offload=True)

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())
    _join_workers("effectfence-settle")
    assert fence.intent_status("charge:1").state == "done"
    assert set(drv._SETTLING) - before == set(), "an undeliverable answer is kept"
