"""``@fenced``: once per intent for sync and async functions, on every store."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from support import FakeClock, FenceFactory, race

from effectfence import (
    EffectFence,
    EffectRequest,
    IntentFailed,
    IntentInFlight,
    InvalidRequest,
    fenced,
)


class Sink:
    """Counts executions where the effect lands, independent of the fence's statistics."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.lock = threading.Lock()

    def hit(self, value: Any) -> None:
        with self.lock:
            self.calls.append(value)


class BankDown(Exception):
    """Raised before the bank was reached: the charge definitely did not happen."""


def test_first_call_runs_duplicates_get_recorded_result(fence: EffectFence) -> None:
    sink = Sink()

    @fenced(fence, intent="charge:{order_id}", domain="order:{order_id}")
    def charge(order_id: int, cents: int) -> dict[str, Any]:
        sink.hit(order_id)
        return {"charged": cents, "id": f"ch_{order_id}"}

    assert charge(7, 500) == {"charged": 500, "id": "ch_7"}
    assert charge(7, 500) == {"charged": 500, "id": "ch_7"}
    assert charge(order_id=7, cents=500) == {"charged": 500, "id": "ch_7"}
    assert sink.calls == [7]
    first = charge.call_with_cert(7, 500)  # type: ignore[attr-defined]
    assert not first.fresh and first.cert.verify() and first.cert.tool.endswith("charge")


def test_exception_aborts_and_fences(fence: EffectFence) -> None:
    sink = Sink()

    @fenced(fence, intent="pay:{n}", domain="d")
    def pay(n: int) -> None:
        sink.hit(n)
        raise TimeoutError("no answer from the bank")

    with pytest.raises(TimeoutError):
        pay(1)
    with pytest.raises(IntentFailed):  # outcome unknown: never silently retried
        pay(1)
    assert sink.calls == [1]
    assert "TimeoutError" in (fence.intent_status("pay:1").reason or "")


def test_did_not_fire_releases_for_retry(fence: EffectFence) -> None:
    sink = Sink()
    fail = [True]

    @fenced(fence, intent="pay:{n}", domain="d", did_not_fire=(BankDown,))
    def pay(n: int) -> str:
        sink.hit(n)
        if fail[0]:
            raise BankDown
        return "paid"

    with pytest.raises(BankDown):
        pay(1)
    fail[0] = False
    assert pay(1) == "paid"
    assert pay(1) == "paid"
    assert sink.calls == [1, 1]


def test_unrecordable_result_fences_intent(fence: EffectFence) -> None:
    @fenced(fence, intent="x:{n}", domain="d")
    def f(n: int) -> object:
        return object()

    with pytest.raises(InvalidRequest):
        f(1)
    assert fence.intent_status("x:1").state == "failed"


def test_concurrent_calls_run_once_and_waiters_get_the_result(fence: EffectFence) -> None:
    sink = Sink()
    n = 8

    @fenced(fence, intent="job:{k}", domain="jobs", wait=True, wait_timeout=5.0)
    def job(k: int) -> int:
        sink.hit(k)
        # hold the lease until every other caller has been refused and is waiting
        deadline = time.monotonic() + 5
        while fence.stats()["prepare"]["intent_in_flight"] < n - 1:
            assert time.monotonic() < deadline, "the duplicates never arrived"
            time.sleep(0.001)
        return k * 10

    assert race(n, lambda i: job(3)) == [30] * n
    assert sink.calls == [3]
    assert fence.stats()["prepare"]["replayed"] == n - 1  # woken, then replayed


def test_without_wait_duplicates_are_refused_in_flight(fence: EffectFence) -> None:
    inside = threading.Event()
    go = threading.Event()

    @fenced(fence, intent="j", domain="d")
    def slow() -> str:
        inside.set()
        go.wait(5)
        return "done"

    t = threading.Thread(target=slow)
    t.start()
    inside.wait(5)
    with pytest.raises(IntentInFlight):
        slow()
    go.set()
    t.join()
    assert slow() == "done"


def test_wait_timeout_must_be_shorter_than_lease(fence: EffectFence) -> None:
    with pytest.raises(ValueError):
        fenced(fence, intent="i", domain="d", wait=True, wait_timeout=10.0)
    with pytest.raises(ValueError):
        fenced(fence, intent="i", domain="d", renew_every=11.0)


def test_renewal_keeps_a_long_call_fenced(make_fence: FenceFactory, clock: FakeClock) -> None:
    fence = make_fence(lease_ttl=10.0)
    renewed = threading.Event()
    inside = threading.Event()
    finish = threading.Event()
    original = fence.renew

    def spy(ticket: Any, ttl: float | None = None) -> float:
        out = original(ticket, ttl)
        renewed.set()
        return out

    fence.renew = spy  # type: ignore[method-assign]

    @fenced(fence, intent="long", domain="d", tool="long", renew_every=0.01)
    def long_call() -> str:
        inside.set()
        finish.wait(5)
        return "ok"

    t = threading.Thread(target=long_call)
    t.start()
    inside.wait(5)
    clock.advance(9.0)
    renewed.clear()
    assert renewed.wait(5)  # a heartbeat after the clock moved: lease now ends at t+19
    clock.advance(9.0)  # 18 s after prepare: without renewal this would be a takeover
    with pytest.raises(IntentInFlight):
        fence.prepare(EffectRequest("long", "d", "long", {}))
    finish.set()
    t.join()


def test_templates_and_callables(fence: EffectFence) -> None:
    @fenced(fence, intent=lambda user, amount: f"tip:{user}", domain="user:{user}", agent="{user}")
    def tip(user: str, amount: int = 5) -> int:
        return amount

    assert tip("ann") == 5
    st = fence.intent_status("tip:ann")
    assert st.state == "done" and st.holder == "ann" and st.domain == "user:ann"
    with pytest.raises(InvalidRequest):

        @fenced(fence, intent="x:{missing}", domain="d")
        def bad(n: int) -> int:
            return n

        bad(1)


def test_async_functions_are_fenced(fence: EffectFence) -> None:
    sink = Sink()

    @fenced(fence, intent="a:{n}", domain="d", wait=True, wait_timeout=5.0)
    async def work(n: int) -> int:
        sink.hit(n)
        await asyncio.sleep(0.01)
        return n + 1

    async def main() -> list[int]:
        return list(await asyncio.gather(*(work(4) for _ in range(10))))

    assert asyncio.run(main()) == [5] * 10
    assert sink.calls == [4]

    @fenced(fence, intent="b", domain="d")
    async def boom() -> None:
        raise RuntimeError("unknown")

    with pytest.raises(RuntimeError):
        asyncio.run(boom())
    assert fence.intent_status("b").state == "failed"


def test_async_callable_objects_are_awaited_and_generators_refused(fence: EffectFence) -> None:
    """An object with an ``async def __call__`` was taken for a plain function: its call
    returned an un-run coroutine, the fence could not record it, and the intent was fenced
    as failed for an effect that never ran. A generator function's body would run only
    after the fence recorded the call: refused when decorated."""
    sink = Sink()

    class Charger:
        async def __call__(self, n: int) -> int:
            sink.hit(n)
            return n * 2

    charge = fenced(fence, intent="obj:{n}", domain="d")(Charger())
    assert asyncio.run(charge(3)) == 6 and asyncio.run(charge(3)) == 6
    assert sink.calls == [3]
    assert fence.intent_status("obj:3").state == "done"

    def rows(n: int) -> Any:
        yield n

    async def arows(n: int) -> Any:
        yield n

    for gen in (rows, arows):
        with pytest.raises(TypeError, match="generator function"):
            fenced(fence, intent="g:{n}", domain="d")(gen)


def test_a_sync_function_that_hands_back_a_coroutine_is_told_so_and_fenced(
    fence: EffectFence,
) -> None:
    """A sync wrapper of an async function (functools.wraps, for logging) hands back an
    un-run coroutine: the caller was told "result not recordable ... the effect ran: do NOT
    run it again" (found by review). It now hears what happened: a coroutine came back
    un-run. The intent is fenced, not released: the wrapper's own body ran. A sync bridge
    that runs the async function itself stays a sync function (called without await)."""
    import functools

    sink = Sink()

    async def charge(n: int) -> int:
        sink.hit(n)
        return n * 2

    @functools.wraps(charge)
    def logged(*a: Any, **kw: Any) -> Any:
        return charge(*a, **kw)

    fenced_logged = fenced(fence, intent="w:{n}", domain="d")(logged)
    with pytest.raises(TypeError, match="returned a coroutine without running it"):
        fenced_logged(5)
    assert sink.calls == [] and fence.intent_status("w:5").state == "failed"

    @functools.wraps(charge)
    def bridge(n: int) -> int:
        return asyncio.run(charge(n))

    fenced_bridge = fenced(fence, intent="b:{n}", domain="d")(bridge)
    assert fenced_bridge(6) == 12 and fenced_bridge(6) == 12
    assert sink.calls == [6] and fence.intent_status("b:6").state == "done"


def test_argument_binding_matches_python(fence: EffectFence) -> None:
    @fenced(fence, intent="b:{a}:{b}:{c}", domain="d")
    def f(a: int, b: int = 2, *, c: int = 3) -> list[int]:
        return [a, b, c]

    assert f(1) == [1, 2, 3]
    assert f(1, 5, c=7) == [1, 5, 7]
    assert f(b=9, a=4) == [4, 9, 3]
    for bad_args, bad_kw in (((), {}), ((1, 2, 3), {}), ((1,), {"a": 1}), ((1,), {"z": 0})):
        with pytest.raises(InvalidRequest):
            f(*bad_args, **bad_kw)

    @fenced(fence, intent="v:{args}", domain="d")
    def g(*args: int) -> int:  # not a plain signature: bound by inspect
        return sum(args)

    assert g(1, 2) == 3


def test_a_method_is_fenced_with_args_as_the_readme_shows(fence: EffectFence) -> None:
    """A method, fenced the README's way: ``args`` leaves ``self`` out of the payload."""
    runs: list[int] = []

    class Bank:
        @fenced(
            fence,
            intent="charge:{order_id}",
            domain="order:{order_id}",
            args=lambda self, order_id: {"order_id": order_id},
        )
        def charge(self, order_id: int) -> dict[str, int]:
            runs.append(order_id)
            return {"charged": order_id}

    assert Bank().charge(3) == Bank().charge(3) == {"charged": 3}
    assert runs == [3]


def test_args_that_is_not_a_function_is_refused_when_decorating(fence: EffectFence) -> None:
    """Names (as wrap's policy takes) were accepted and failed at the first call with
    "'tuple' object is not callable" (found by review)."""
    with pytest.raises(TypeError, match="args must be a callable"):
        fenced(fence, intent="i:{x}", domain="d", args=("x",))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["12", None, 1.5])
def test_a_template_whose_format_spec_the_value_does_not_take_is_refused_typed(
    value: Any,
) -> None:
    """{order:05d} given "12" or None raised ValueError / TypeError, untyped (review)."""
    fence = EffectFence()

    @fenced(fence, intent="charge:{order:05d}", domain="order:{order}")
    def charge(order: Any) -> int:
        return 1

    with pytest.raises(InvalidRequest, match="can't be filled"):
        charge(value)
    assert charge(12) == 1
