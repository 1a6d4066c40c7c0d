"""The Offloader: blocking fence steps off an asyncio loop, on a few long-lived threads.

And the promise it serves (issue #12): the MCP server does not block its event loop on store
I/O. A step held inside SQLite's write lock must not keep another caller's replay, which
needs no write lock, from being answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
import threading
from pathlib import Path

import anyio
import pytest
from mcp_support import connect, req

from effectfence import EffectFence, FenceConfig
from effectfence.driver import Offloader
from effectfence.mcp.server import build_server
from effectfence.store.sqlite import SQLiteStore

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def test_a_job_runs_on_a_worker_and_its_result_comes_back() -> None:
    off = Offloader(threads=2, name="t-off")

    async def main() -> tuple[str, int]:
        got: tuple[str, int] = await off.run(
            lambda a, b: (threading.current_thread().name, a + b), 2, 3
        )
        return got

    name, total = asyncio.run(main())
    assert total == 5
    assert name.startswith("t-off-") and name != threading.main_thread().name
    off.close()


def test_an_exception_reaches_the_caller_with_its_type() -> None:
    off = Offloader(threads=1)

    def boom() -> None:
        raise KeyError("which key")

    async def main() -> None:
        await off.run(boom)

    with pytest.raises(KeyError, match="which key"):
        asyncio.run(main())
    off.close()


def test_the_callers_context_carries_over() -> None:
    off = Offloader(threads=1)

    async def main() -> str:
        VAR.set("from the caller")
        seen: str = await off.run(VAR.get)
        return seen

    assert asyncio.run(main()) == "from the caller"
    off.close()


def test_jobs_run_side_by_side_up_to_the_thread_count() -> None:
    """Two jobs that each wait for the other finish only if both run at once."""
    off = Offloader(threads=2)
    barrier = threading.Barrier(2, timeout=10)

    async def main() -> list[int]:
        return list(await asyncio.gather(off.run(barrier.wait), off.run(barrier.wait)))

    assert sorted(asyncio.run(main())) == [0, 1]
    off.close()


def test_one_caller_at_a_time_keeps_one_warm_thread() -> None:
    off = Offloader(threads=8, name="t-warm")

    async def main() -> set[str]:
        names: set[str] = set()
        for _ in range(20):
            names.add(await off.run(lambda: threading.current_thread().name))
        return names

    assert asyncio.run(main()) == {"t-warm-1"}
    off.close()


def test_threads_grow_while_all_are_busy_and_never_past_the_bound() -> None:
    """Two jobs block (a lock another process holds, say): a third starts no third thread
    with threads=2, and runs as soon as one of the two is done."""
    off = Offloader(threads=2)
    release = threading.Event()
    running = [threading.Event(), threading.Event()]
    third = threading.Event()

    def blocked(i: int) -> None:
        running[i].set()
        release.wait(10)

    async def main() -> None:
        a = asyncio.ensure_future(off.run(blocked, 0))
        b = asyncio.ensure_future(off.run(blocked, 1))
        c = asyncio.ensure_future(off.run(third.set))
        while not (running[0].is_set() and running[1].is_set()):
            await asyncio.sleep(0.001)  # both blocked jobs hold a thread each
        assert not third.is_set()  # no third thread: the bound holds
        release.set()
        await asyncio.gather(a, b, c)
        assert third.is_set()

    asyncio.run(main())
    off.close()


def test_a_cancelled_caller_stops_waiting_and_the_job_still_finishes() -> None:
    off = Offloader(threads=1)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        release.wait(10)
        finished.set()
        return "dropped"

    async def main() -> None:
        task = asyncio.ensure_future(off.run(job))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        # the next job queues behind it on the one worker: it ran to the end
        assert await off.run(lambda: finished.is_set()) is True

    asyncio.run(main())
    off.close()


def test_after_close_a_new_run_starts_new_workers() -> None:
    off = Offloader(threads=2, name="t-restart")

    async def main() -> int:
        got: int = await off.run(lambda: 7)
        return got

    assert asyncio.run(main()) == 7
    off.close()
    assert asyncio.run(main()) == 7  # a lifespan that ends and begins again
    off.close()
    with pytest.raises(ValueError):
        Offloader(threads=0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_step_blocked_in_the_store_does_not_stall_other_callers(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Another process holds SQLite's write lock (a raw connection here). A fresh prepare
    waits for it inside the store; meanwhile a replay, which reads without the lock, is
    answered. Run inline on the loop, the replay would wait behind the blocked prepare,
    which gives up after busy_timeout: the prepare would be refused, not fresh."""
    path = tmp_path / "fence.db"
    store = SQLiteStore(str(path), busy_timeout=20.0)
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    server = build_server(fence)
    async with connect(server) as client:
        done = await client.call_tool("fence_prepare", req("charge:old"))
        ticket = done.structured_content["prepared"]
        await client.call_tool("fence_commit", {"prepared": ticket, "result": {"ok": 1}})

        holder = sqlite3.connect(str(path), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, as another process would hold it
        answers: dict[str, object] = {}

        async def fresh() -> None:
            answers["fresh"] = await client.call_tool("fence_prepare", req("charge:new"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(fresh)
            with anyio.fail_after(10):
                replay = await client.call_tool("fence_prepare", req("charge:old"))
            assert replay.structured_content["status"] == "replay"
            assert "fresh" not in answers  # still blocked on the lock: nothing overtook it
            holder.execute("ROLLBACK")
        holder.close()
        fresh_answer = answers["fresh"]
        assert fresh_answer.structured_content["status"] == "fresh"  # type: ignore[attr-defined]
    store.close()
