"""close() lets the effects in hand settle before it closes the store.

Closing a fence closed its store at once. An effect a ``@fenced`` function was running
then could not be committed: it stayed in flight, and once its lease lapsed an identical
call (another process on the same store) ran it again. Now close() stops admitting and
waits for the effects the driver holds, up to a timeout.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from effectfence import EffectFence, FenceConfig, StoreUnavailable, fenced
from effectfence.protocol import State
from effectfence.store.sqlite import SQLiteStore

WAIT = 10.0  # s a test waits for a thread it released (never reached when it works)


def _fence(path: Path) -> EffectFence:
    return EffectFence(FenceConfig(lease_ttl=30.0, auto_sweep=False), store=SQLiteStore(str(path)))


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


def test_close_gives_up_after_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    fence = _fence(path)
    started, release = threading.Event(), threading.Event()

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> str:
        started.set()
        assert release.wait(WAIT)
        return "ch_1"

    errors: list[BaseException] = []

    def work() -> None:
        try:
            charge(1)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(WAIT)
    fence.close(timeout=0.05)  # returns although the effect still runs
    release.set()
    worker.join(WAIT)
    # what closing under an effect has always meant: it ran, its result was not recorded,
    # and the caller is told so plainly
    assert len(errors) == 1 and isinstance(errors[0], StoreUnavailable)
    assert "RAN" in str(errors[0])
    assert _state(path, "charge:1") is State.IN_FLIGHT


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
