"""One driver for "prepare -> wait -> run -> renew -> commit / abort / release".

The sequence is written once, as a generator that yields what it needs done and is told
what happened (sans-IO, as :mod:`effectfence.protocol` is): :class:`Wait` (block until the
intent's holder finishes, or the wait runs out) and :class:`Run` (run the effect while
renewing the lease; the result, or the exception, is sent back). :func:`run_sync` and
:func:`run_async` carry those out with threads or with asyncio; ``@fenced`` uses both, and
any other driver (``wrap``) supplies its own ``Run``.

Outcomes: a result commits (the certificate is returned); an exception whose type is
declared "did not fire" releases (a retry may run it); any other exception aborts (the
outcome is unknown: the intent stays fenced until an operator clears it, G9). A result the
fence cannot record (not JSON) aborts too: the effect ran and nobody can say what it did.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from effectfence.cert import EffectCert
from effectfence.errors import IntentInFlight, InvalidRequest, Refusal
from effectfence.fence import EffectFence
from effectfence.model import EffectRequest, PreparedEffect

__all__ = ["Done", "FencedCall", "Options", "Run", "Wait", "drive", "run_async", "run_sync"]


class FencedCall:
    """What one fenced call did: its result, the certificate, and whether it ran here."""

    __slots__ = ("cert", "fresh", "result")

    def __init__(self, result: Any, cert: EffectCert, fresh: bool) -> None:
        self.result = result
        self.cert = cert
        self.fresh = fresh

    def __repr__(self) -> str:
        return f"FencedCall(fresh={self.fresh}, cert={self.cert!r})"


@dataclass(frozen=True, slots=True)
class Options:
    """How a driven call waits for a holder and what its exceptions mean."""

    #: a duplicate that finds the intent in flight waits for the holder (else: refused)
    wait: bool = False
    #: how long it may wait in all, seconds; never past the holder's lease in one go
    wait_timeout: float = 15.0
    #: renew the lease every this many seconds while the effect runs (None: never)
    renew_every: float | None = None
    #: exception types meaning "the effect definitely did not fire": release, not abort
    did_not_fire: tuple[type[BaseException], ...] = ()


@dataclass(frozen=True, slots=True)
class Wait:
    """Block up to ``timeout`` s until ``intent`` is no longer in flight."""

    intent: str
    timeout: float


@dataclass(frozen=True, slots=True)
class Run:
    """Run the effect for ``ticket``, renewing every ``renew_every`` s; send its result."""

    ticket: PreparedEffect
    renew_every: float | None


Done = FencedCall
Instruction = Wait | Run


def drive(
    fence: EffectFence, request: EffectRequest, options: Options
) -> Generator[Instruction, Any, FencedCall]:
    """The sequence, once. Yields instructions; returns the :class:`FencedCall`."""
    deadline: float | None = None
    while True:
        try:
            adm = fence.prepare(request)
            break
        except IntentInFlight as exc:
            if not options.wait:
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + options.wait_timeout
            left = deadline - now
            if left <= 0:
                raise
            yield Wait(request.intent, min(left, exc.retry_after or left))
    if not adm.fresh:
        return FencedCall(adm.cert.result, adm.cert, False)
    ticket = adm.ticket
    try:
        result = yield Run(ticket, options.renew_every)
    except BaseException as exc:
        if isinstance(exc, options.did_not_fire):
            fence.release(ticket)
        else:
            # the reason is shown to every later caller of this intent: name the
            # exception's type, never its text (which may carry payment details)
            fence.abort(ticket, f"the function raised {type(exc).__name__}")
        raise
    try:
        cert = fence.commit(ticket, result)
    except InvalidRequest as exc:
        # it ran, but its result can't be recorded: fence the intent, say why
        fence.abort(ticket, f"result not recordable: {exc.message}"[:1000])
        raise
    return FencedCall(result, cert, True)


def run_sync(
    fence: EffectFence,
    request: EffectRequest,
    options: Options,
    effect: Callable[[PreparedEffect], Any],
) -> FencedCall:
    """Carry out :func:`drive` in this thread; the lease is renewed from a helper thread."""
    gen = drive(fence, request, options)
    try:
        instr = next(gen)
        while True:
            if isinstance(instr, Wait):
                fence.wait(instr.intent, instr.timeout)
                instr = next(gen)
                continue
            stop = _renew_in_thread(fence, instr.ticket, instr.renew_every)
            try:
                result = effect(instr.ticket)
            except BaseException as exc:
                _stop_thread(stop)
                instr = gen.throw(exc)
                continue
            _stop_thread(stop)
            instr = gen.send(result)
    except StopIteration as done:
        call: FencedCall = done.value
        return call


async def run_async(
    fence: EffectFence,
    request: EffectRequest,
    options: Options,
    effect: Callable[[PreparedEffect], Awaitable[Any]],
    *,
    offload: bool = False,
) -> FencedCall:
    """Carry out :func:`drive` on the running loop; the lease is renewed by a task.

    ``offload`` runs the fence's own steps in a worker thread (for stores that do I/O), so
    the loop keeps serving other callers meanwhile."""
    gen = drive(fence, request, options)

    def advance(how: str, value: Any = None) -> tuple[bool, Any]:
        # StopIteration cannot cross a thread's future: turn it into a value here
        try:
            if how == "send":
                return False, gen.send(value)
            return False, gen.throw(value)
        except StopIteration as done:
            return True, done.value

    async def step(how: str, value: Any = None) -> tuple[bool, Any]:
        if offload:
            return await asyncio.to_thread(advance, how, value)
        return advance(how, value)

    finished, instr = await step("send")
    while not finished:
        if isinstance(instr, Wait):
            await _wait_in_thread(fence, instr.intent, instr.timeout)
            finished, instr = await step("send")
            continue
        task = _renew_in_task(fence, instr.ticket, instr.renew_every, offload)
        try:
            result = await effect(instr.ticket)
        except BaseException as exc:
            _stop_task(task)
            finished, instr = await step("throw", exc)
            continue
        _stop_task(task)
        finished, instr = await step("send", result)
    call: FencedCall = instr
    return call


async def _wait_in_thread(fence: EffectFence, intent: str, timeout: float) -> None:
    """``fence.wait`` in a thread of its own, not the loop's default executor: waiters
    blocked there could fill every worker while the holder's own commit (``offload``)
    queues behind them, and nobody is woken until the waits time out."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish(exc: BaseException | None) -> None:
        if not done.done():
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

    def run() -> None:
        try:
            fence.wait(intent, timeout)
        except BaseException as exc:
            loop.call_soon_threadsafe(finish, exc)
        else:
            loop.call_soon_threadsafe(finish, None)

    threading.Thread(target=run, name=f"effectfence-wait-{intent}", daemon=True).start()
    await done


def _renew_in_thread(
    fence: EffectFence, ticket: PreparedEffect, every: float | None
) -> threading.Event | None:
    if every is None:
        return None
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            try:
                fence.renew(ticket)
            except Refusal:
                return  # taken over or finished: commit will say so

    threading.Thread(target=beat, name=f"effectfence-renew-{ticket.intent}", daemon=True).start()
    return stop


def _stop_thread(stop: threading.Event | None) -> None:
    if stop is not None:
        stop.set()


def _renew_in_task(
    fence: EffectFence, ticket: PreparedEffect, every: float | None, offload: bool
) -> asyncio.Task[None] | None:
    if every is None:
        return None
    period = every

    async def beat() -> None:
        while True:
            await asyncio.sleep(period)
            try:
                if offload:
                    await asyncio.to_thread(fence.renew, ticket)
                else:
                    fence.renew(ticket)
            except Refusal:
                return

    return asyncio.get_running_loop().create_task(beat())


def _stop_task(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
