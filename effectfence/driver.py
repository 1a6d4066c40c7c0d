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
import contextlib
import contextvars
import functools
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from effectfence.cert import EffectCert
from effectfence.errors import IntentInFlight, InvalidRequest, Refusal, StoreUnavailable
from effectfence.fence import EffectFence, driving
from effectfence.model import EffectRequest, PreparedEffect

__all__ = [
    "Done",
    "FencedCall",
    "Offloader",
    "Options",
    "Pause",
    "Run",
    "Wait",
    "drive",
    "run_async",
    "run_sync",
]

#: worker threads an :class:`Offloader` may start unless told otherwise: as many steps may
#: wait in the store at once (a lock another process holds) while others still run. More
#: threads contend for the GIL, but a SQLite store commits the steps waiting for its write lock
#: together (group commit), so as many steps as there are callers should be able to wait there:
#: 8 HTTP clients on one SQLite-backed server (synchronous=FULL, 4 bursts of 1,200
#: fence_prepare) measured 474-509 prepares/s with 4 threads, 519-586/s with 8 and 462-497/s
#: with 16, interleaved in one session
OFFLOAD_THREADS = 8


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


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep ``seconds`` (the store was unavailable; the step is tried again after)."""

    seconds: float


Done = FencedCall
Instruction = Wait | Run | Pause

#: pauses between the attempts to record an effect that ran while its store is unavailable:
#: a commit is safe to repeat (a repeat of one that applied answers its certificate), and a
#: short outage is far better ridden out than turned into an intent nobody can settle
COMMIT_RETRY_PAUSES = (0.05, 0.2, 0.5, 1.0)

#: a renewal that found the store unavailable is tried again this much sooner
RENEW_RETRY_FACTOR = 0.25


_T = TypeVar("_T")

#: work that outlives a cancelled caller (settling an admission, finishing a commit): held
#: here so it is not garbage-collected before it is done
_SETTLING: set[asyncio.Future[Any]] = set()


class _NotStarted(Exception):
    """The caller went away between the admission and the effect: nothing ran."""


def drive(
    fence: EffectFence, request: EffectRequest, options: Options
) -> Generator[Instruction, Any, FencedCall]:
    """The sequence, once. Yields instructions; returns the :class:`FencedCall`.

    Each attempt is held by the fence from before its prepare until it is settled, so
    :meth:`EffectFence.close` waits for an effect in hand instead of closing the store
    under it (its commit then failed, and a lapsed lease let it run again)."""
    deadline: float | None = None
    while True:
        fence._hold_effect()
        try:
            adm = fence.prepare(request)
        except IntentInFlight as exc:
            fence._let_effect_go()
            if not options.wait:
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + options.wait_timeout
            left = deadline - now
            if left <= 0:
                raise
            yield Wait(request.intent, min(left, exc.retry_after or left))
            continue
        except BaseException:
            fence._let_effect_go()
            raise
        if not adm.fresh:
            fence._let_effect_go()
            return FencedCall(adm.cert.result, adm.cert, False)
        break
    try:
        return (yield from _carry(fence, adm.ticket, options))
    finally:
        fence._let_effect_go()


def _carry(
    fence: EffectFence, ticket: PreparedEffect, options: Options
) -> Generator[Instruction, Any, FencedCall]:
    """An admitted attempt: run it, then commit it, or settle what it left."""
    try:
        result = yield Run(ticket, options.renew_every)
    except BaseException as exc:
        if isinstance(exc, (_NotStarted, *options.did_not_fire)):
            what, settle = "released", functools.partial(fence.release, ticket)
        else:
            # the reason is shown to every later caller of this intent: name the
            # exception's type, never its text (which may carry payment details). Bounded:
            # a reason the fence refuses (a type name over 4 KiB) left the intent in flight,
            # and it ran again once the lease lapsed (found by review)
            reason = _reason(f"the function raised {type(exc).__name__}")
            what, settle = "fenced as failed", functools.partial(fence.abort, ticket, reason)
        if isinstance(exc, GeneratorExit):  # closed: it may not yield, one attempt only
            # nobody is left to tell of a refusal (lease_lost: taken over meanwhile): raised,
            # it came out of close() in place of GeneratorExit (noted by review)
            with contextlib.suppress(Refusal):
                settle()
            raise
        try:
            yield from _settling(settle)
        except Refusal as refused:
            # the caller hears its own exception, not "nothing was decided" (which would
            # invite a retry of an effect that may have fired), nor lease_lost (a retry
            # took the lapsed lease over: its own error was lost, found by review)
            then = (
                "it stays in flight until its lease lapses"
                if isinstance(refused, StoreUnavailable) and refused.retryable
                else f"refused {refused.code}"  # not retryable: the store said why (above)
            )
            exc.add_note(
                f"effectfence: intent {ticket.intent!r} could not be {what} "
                f"({refused.message}); {then}"
            )
        else:
            if isinstance(exc, Refusal):
                # a refusal from inside the function (a nested fenced call's "retry later;
                # nothing was decided") reads as this call's own: say what became of it
                exc.add_note(
                    f"effectfence: raised inside the fenced function of intent "
                    f"{ticket.intent!r}, which is now {what}"
                )
        raise
    try:
        cert = yield from _record(fence, ticket, result)
    except InvalidRequest as exc:
        # it ran, but its result can't be recorded: fence the intent, say why
        # (a message may quote the value: a NUL in it would make the abort refused too)
        reason = _reason(f"result not recordable: {exc.message}")
        with contextlib.suppress(Refusal):  # taken over meanwhile: the same answer stands
            yield from _settling(functools.partial(fence.abort, ticket, reason))
        raise
    except Refusal:
        raise  # the fence's own answer (lease_lost, read_set_stale, a store that stayed down)
    except BaseException as exc:
        # An error no step should raise (a store's untyped error, a bug), or an interrupt
        # (Ctrl-C, a SIGTERM handler's SystemExit, the driver closed mid-retry): the effect
        # RAN, and the commit may or may not have applied. Left in flight, the intent would
        # be run again by an identical call once its lease lapsed (interrupts were left so,
        # found by review). An abort compares by token: it fences the intent if the commit
        # did not apply, and changes nothing if it did.
        reason = (
            "it ran; its caller was interrupted before its commit"
            if isinstance(exc, GeneratorExit)  # closed by run_sync/run_async on an interrupt
            else f"it ran; its commit failed with {type(exc).__name__}"
        )
        abort = functools.partial(fence.abort, ticket, _reason(reason))
        if isinstance(exc, Exception):
            with contextlib.suppress(Exception):
                yield from _settling(abort)
        else:  # interrupted or closed: record it once (a commit is safe to repeat), else
            try:  # fence it once; now, without a yield
                fence.commit(ticket, result)
            except Exception:
                with contextlib.suppress(Exception):
                    abort()
        raise
    return FencedCall(result, cert, True)


def _again(step: Callable[[], _T]) -> Generator[Instruction, Any, _T]:
    """``step()``, tried again after each of :data:`COMMIT_RETRY_PAUSES` while the store is
    unavailable: a store step that settles an effect (commit, abort, release) is safe to
    repeat, and a short outage is better ridden out than left to the lease. The last
    attempt's StoreUnavailable is raised, and at once one the store says not to retry (a
    release whose reply was lost: retried, it answered lease_lost; found by review)."""
    for pause in COMMIT_RETRY_PAUSES:
        try:
            return step()
        except StoreUnavailable as exc:
            if not exc.retryable:
                raise
            yield Pause(pause)
    return step()


def release_riding_blips(fence: EffectFence, ticket: PreparedEffect) -> BaseException | None:
    """``fence.release(ticket)`` for a ticket whose caller never received it, through a
    store blip as the driver settles its own (:func:`_again`), sleeping in this thread
    between tries: so call it on a thread of its own. What the last try raised, or None.
    One try left the intent held by nobody until its lease lapsed (noted by review)."""
    tries = _again(functools.partial(fence.release, ticket))
    try:
        pause = next(tries)
        while isinstance(pause, Pause):  # _again yields nothing else
            time.sleep(pause.seconds)
            pause = tries.send(None)
        raise AssertionError(f"a release yielded {pause!r}")  # cannot happen: reported
    except StopIteration:
        return None
    except Exception as exc:  # a refusal, or the store still down after the last try
        return exc


def release_aside(
    fence: EffectFence, ticket: PreparedEffect, then: Callable[[BaseException | None], None]
) -> None:
    """:func:`release_riding_blips` in a thread of its own (:func:`_aside`, not a shared
    worker, whose sleeps would hold up other calls' steps); ``then(outcome)`` there."""
    _aside(lambda: then(release_riding_blips(fence, ticket)))


def _settling(step: Callable[[], _T]) -> Generator[Instruction, Any, _T]:
    """:func:`_again` for a step that settles an effect (abort, release). Closed while it
    pauses (Ctrl-C, a task dropped), it makes one last attempt, now, without a yield: left
    untried, the intent stayed in flight and ran again once its lease lapsed (found by
    review, for an unrecordable result and for a commit that failed untyped)."""
    try:
        return (yield from _again(step))
    except GeneratorExit:
        with contextlib.suppress(Exception):  # nobody is left to tell
            step()
        raise


def _reason(text: str) -> str:
    """A reason every store and every reader takes: bounded, no NUL, no lone surrogate (a
    reason the fence refuses leaves the abort undone)."""
    text = text[:1000].replace("\x00", "\\0")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _record(
    fence: EffectFence, ticket: PreparedEffect, result: Any
) -> Generator[Instruction, Any, EffectCert]:
    """Commit an effect that ran (:func:`_again`). If the store never answers, the intent
    is fenced as failed if the store lets us, and the refusal says plainly that the effect
    RAN: "nothing was decided" would invite the very retry that runs it twice."""
    try:
        return (yield from _again(functools.partial(fence.commit, ticket, result)))
    except StoreUnavailable as exc:
        reason = "it ran, but its result could not be recorded: the store was unavailable"
        try:
            fence.abort(ticket, reason)
            fenced = "the intent is now failed: identical calls are refused until cleared"
        except Refusal:
            fenced = (
                "the intent stays in flight until its lease lapses: after that an "
                "identical call would run it again"
            )
        raise StoreUnavailable(
            f"{ticket.intent!r} RAN, but its result could not be recorded ({exc.message}); "
            f"{fenced}",
            retryable=False,
            recover="do not run it again: it ran. Reconcile downstream, then an operator "
            "clears the intent",
            intent=ticket.intent,
            token=ticket.token,
            ran=True,
        ) from exc


def run_sync(
    fence: EffectFence,
    request: EffectRequest,
    options: Options,
    effect: Callable[[PreparedEffect], Any],
) -> FencedCall:
    """Carry out :func:`drive` in this thread; the lease is renewed from a helper thread."""
    with driving(fence):  # a close from in here (a signal handler) does not wait for it
        gen = drive(fence, request, options)
        raised: BaseException | None = None  # what the effect raised, if it did
        try:
            try:
                instr = next(gen)
                while True:
                    if isinstance(instr, Wait | Pause):
                        try:
                            if isinstance(instr, Wait):
                                fence.wait(instr.intent, instr.timeout)
                            else:
                                time.sleep(instr.seconds)
                        except BaseException:
                            gen.close()  # interrupted between steps: settled now, not later
                            raise
                        instr = next(gen)
                        continue
                    try:
                        stop = _renew_in_thread(fence, instr.ticket, instr.renew_every)
                    except BaseException:
                        # the effect never started: released, not left parked for the
                        # collector to abort it (found by review)
                        _settle(gen, (False, instr))
                        raise
                    try:
                        result = effect(instr.ticket)
                    except BaseException as exc:
                        _stop_thread(stop)
                        raised = exc
                        instr = gen.throw(exc)
                        continue
                    _stop_thread(stop)
                    instr = gen.send(result)
            except StopIteration as done:
                call: FencedCall = done.value
                return call
        except RuntimeError as err:
            if isinstance(raised, StopIteration) and err.__cause__ is raised:
                # the effect's own StopIteration, re-raised by the driver (after its abort,
                # at once or after a pause), came out as RuntimeError (PEP 479): the caller
                # hears its own exception (found by review, twice)
                raise raised from None
            raise


async def run_async(
    fence: EffectFence,
    request: EffectRequest,
    options: Options,
    effect: Callable[[PreparedEffect], Awaitable[Any]],
    *,
    offload: bool | Offloader = False,
) -> FencedCall:
    """Carry out :func:`drive` on the running loop; the lease is renewed by a task.

    ``offload`` runs the fence's own steps in worker threads (for stores that do I/O), so
    the loop keeps serving other callers meanwhile: on the given :class:`Offloader`'s, or
    with ``True`` on the loop's default executor."""
    with driving(fence):  # an await aclose() from the effect does not wait for it
        gen = drive(fence, request, options)
        off_loop = _off_loop(offload)

        def advance(how: str, value: Any = None) -> tuple[bool, Any]:
            # StopIteration cannot cross a thread's future: turn it into a value here
            try:
                if how == "send":
                    return False, gen.send(value)
                return False, gen.throw(value)
            except StopIteration as done:
                return True, done.value

        async def step(how: str, value: Any = None) -> tuple[bool, Any]:
            if off_loop is None:
                return advance(how, value)
            hand = _Handoff(gen, advance)
            try:
                got: tuple[bool, Any] = await off_loop(hand.run, how, value)
            except (asyncio.CancelledError, GeneratorExit) as exc:
                # the step goes on in its thread; what it leaves held (an admission nobody
                # will act on) is let go by whichever comes last: the step, or this. A
                # coroutine being closed can await nothing more: it settles here and now
                done = hand.leave()
                if done is not None:
                    if isinstance(exc, GeneratorExit):
                        _settle(gen, done, wait=False)
                    else:
                        _settle_later(off_loop, gen, done)
                raise
            return got

        finished, instr = await step("send")
        while not finished:
            if isinstance(instr, Wait | Pause):
                try:
                    if isinstance(instr, Wait):
                        await _wait_in_thread(fence, instr.intent, instr.timeout)
                    else:
                        await asyncio.sleep(instr.seconds)
                except BaseException:
                    gen.close()  # cancelled between steps: settled now (the driver is idle here)
                    raise
                finished, instr = await step("send")
                continue
            if off_loop is not None:
                # a cancel that came as the step ended is held back by anyio (its answer was
                # in: nothing to cancel), and was delivered inside the effect, which was then
                # fenced as failed for a caller gone before it began (found by review). One
                # loop turn lets it land here, where the effect has not started: released
                try:
                    await asyncio.sleep(0)
                except BaseException as exc:
                    if isinstance(exc, GeneratorExit):
                        _settle(gen, (False, instr), wait=False)
                    else:
                        _settle_later(off_loop, gen, (False, instr))
                    raise
            try:
                task = _renew_in_task(fence, instr.ticket, instr.renew_every, off_loop)
            except BaseException:
                # the effect never started: released, not left parked for the collector to
                # abort it (found by review)
                if off_loop is None:
                    _settle(gen, (False, instr), wait=False)
                else:
                    _settle_later(off_loop, gen, (False, instr))
                raise
            try:
                result = await effect(instr.ticket)
            except GeneratorExit:
                # the coroutine is closed mid-effect (its loop closed, the collector finalizing
                # a dropped task): it can await nothing more, so the effect is settled here,
                # now, in this thread, as run_sync would. Left to _conclude's awaits it was
                # left in flight, and a takeover ran it again (found by review)
                with contextlib.suppress(RuntimeError):  # a closed loop's task can't cancel
                    _stop_task(task)
                gen.close()
                raise
            except BaseException as exc:
                _stop_task(task)
                return await _conclude(step, advance, gen.close, off_loop, "throw", exc)
            _stop_task(task)
            return await _conclude(step, advance, gen.close, off_loop, "send", result)
        call: FencedCall = instr
        return call


async def _conclude(
    step: Callable[..., Awaitable[tuple[bool, Any]]],
    advance: Callable[[str, Any], tuple[bool, Any]],
    close: Callable[[], None],
    off_loop: Callable[..., Awaitable[Any]] | None,
    how: str,
    value: Any,
) -> FencedCall:
    """What follows the effect (commit, or abort / release, with their retries), carried
    to its end even if the caller is cancelled meanwhile: a commit left half-tried would
    leave the intent in flight, and an identical call would run the effect again once the
    lease lapsed. The caller's cancellation still reaches the caller at once.

    Off the loop, its first step is queued in a worker thread here and now, and a pause
    is ridden out in a thread of its own (:func:`_after_effect`); no task carries it.
    Handed to a task, a shutdown that cancelled every task reached the task before its
    first step, or in a pause, and the commit of an effect that ran was never tried again;
    the driver, parked, was aborted by the collector or, kept alive by an idle worker, left
    in flight until an identical call ran the effect again (found by review).

    On the loop (``off_loop`` None) the steps never suspend, so nothing can cancel the
    first one; only a pause (a store error) needs the task below, and a cancel in its
    pause closes the driver, which makes one last attempt."""
    if off_loop is not None:
        loop = asyncio.get_running_loop()
        final: asyncio.Future[Any] = loop.create_future()
        job = _Once(_after_effect, advance, how, value, loop, final)
        try:
            _queue(off_loop, job)
        except RuntimeError:  # no thread to be had: here, unless a queued copy took it
            job()
        _SETTLING.add(final)
        final.add_done_callback(_forget)
        done: FencedCall = await asyncio.shield(final)
        return done
    finished, pending = await step(how, value)
    if finished:
        call: FencedCall = pending
        return call

    async def finish() -> FencedCall:
        finished, instr = False, pending
        while not finished:
            if not isinstance(instr, Pause):  # after the effect, drive only pauses
                raise AssertionError(f"unexpected instruction after the effect: {instr!r}")
            try:
                await asyncio.sleep(instr.seconds)
            except BaseException:
                close()  # cancelled in its pause: one last attempt, now (see drive)
                raise
            finished, instr = await step("send")
        settled: FencedCall = instr
        return settled

    task = asyncio.ensure_future(finish())
    _SETTLING.add(task)
    task.add_done_callback(_forget)
    return await asyncio.shield(task)


def _after_effect(
    advance: Callable[[str, Any], tuple[bool, Any]],
    how: str,
    value: Any,
    loop: asyncio.AbstractEventLoop,
    final: asyncio.Future[Any],
) -> None:
    """In a worker thread: the first step after the effect; its outcome goes to ``final``.
    A pause (the store failing) is ridden out in a thread of its own (:func:`_aside`)."""
    try:
        finished, instr = advance(how, value)
    except BaseException as exc:
        _deliver(loop, final, None, exc)
        return
    if finished:
        _deliver(loop, final, instr, None)
        return

    def ride(instr: Any) -> None:
        try:
            finished = False
            while not finished:
                if not isinstance(instr, Pause):  # after the effect, drive only pauses
                    raise AssertionError(f"unexpected instruction after the effect: {instr!r}")
                time.sleep(instr.seconds)
                finished, instr = advance("send", None)
        except BaseException as exc:
            _deliver(loop, final, None, exc)
        else:
            _deliver(loop, final, instr, None)

    _aside(ride, instr)


class _Once:
    """A job that may end up queued twice (a default executor that raised after queueing
    it, and the caller then running it itself): the first call runs it, any other none."""

    __slots__ = ("_args", "_fn", "_lock")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn = fn
        self._args = args
        self._lock = threading.Lock()

    def __call__(self, **kw: Any) -> None:
        if self._lock.acquire(blocking=False):
            self._fn(*self._args, **kw)


def _forget(fut: asyncio.Future[Any]) -> None:
    _SETTLING.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: a caller cancelled meanwhile will never read it


class _Handoff:
    """One step of :func:`drive` in a worker thread, whose awaiting caller may be cancelled
    meanwhile. Without this, a prepare that admitted the intent just as its caller was
    cancelled left the generator parked at ``Run`` until garbage collection closed it, and
    the close aborted the intent: refused to every identical call until an operator
    cleared it, for an effect that never started."""

    __slots__ = ("_advance", "_done", "_gen", "_left", "_lock")

    def __init__(self, gen: Generator[Instruction, Any, FencedCall], advance: Any) -> None:
        self._gen = gen
        self._advance = advance
        self._lock = threading.Lock()
        self._done: tuple[bool, Any] | None = None
        self._left = False

    def run(self, how: str, value: Any) -> tuple[bool, Any]:
        got: tuple[bool, Any] = self._advance(how, value)
        with self._lock:
            self._done = got
            left = self._left
        if left:
            _settle(self._gen, got, aside=True)  # in a shared worker
        return got

    def leave(self) -> tuple[bool, Any] | None:
        """The caller is cancelled: the step's outcome if it already came (the caller must
        settle it), else None (the step will, when it ends)."""
        with self._lock:
            self._left = True
            return self._done


def _settle(
    gen: Generator[Instruction, Any, FencedCall],
    got: tuple[bool, Any],
    *,
    wait: bool = True,
    aside: bool = False,
) -> None:
    """Nobody acts on this step's outcome: an admission is released (the effect never
    started), a wait is dropped; a finished call needs nothing.

    The release rides out a store blip as a commit does, pausing here (``wait``: a worker
    thread, or a caller that may block); a dropped Pause left it untried after the first
    blip, the intent in flight by nobody until its lease lapsed (found by review). Without
    ``wait`` (a coroutine being closed) the generator is closed at the first Pause, which
    makes one last attempt without one. ``aside``: called in a shared worker thread, whose
    pauses go to a thread of their own (:func:`_aside`)."""
    finished, instr = got
    if finished:
        return
    if not isinstance(instr, Run):
        gen.close()
        return
    try:
        instr = gen.throw(_NotStarted())
    except (_NotStarted, Refusal, StopIteration):
        return
    if aside and wait and isinstance(instr, Pause):
        _aside(_ride_release, gen, instr)  # not slept in a shared worker (see _aside)
        return
    _ride_release(gen, instr, wait=wait)


def _ride_release(
    gen: Generator[Instruction, Any, FencedCall], instr: Any, *, wait: bool = True
) -> None:
    """:func:`_settle`'s release from its first pause on."""
    with contextlib.suppress(_NotStarted, Refusal, StopIteration):
        while isinstance(instr, Pause):
            if not wait:
                gen.close()
                return
            time.sleep(instr.seconds)
            instr = gen.send(None)
        gen.close()  # cannot happen: after a release drive yields only pauses (fail closed)


def _aside(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` in a thread of its own, started here, for a settle step's retry
    pauses. Slept in a shared worker, they held up the steps and lease renewals of other
    calls queued behind it, and a lease lapsed mid-effect (found by review). Not a daemon:
    a process ending (``asyncio.run`` returned) waits for it, as for the executor it
    replaces; a daemon was cut off between two tries of a commit, and once the lease lapsed
    the effect ran again (found by review)."""
    ctx = contextvars.copy_context()
    try:
        threading.Thread(target=ctx.run, args=(fn, *args), name="effectfence-settle").start()
    except RuntimeError:  # no thread to be had (or the interpreter is ending): here, then
        fn(*args)


def _settle_later(
    off_loop: Callable[..., Awaitable[Any]],
    gen: Generator[Instruction, Any, FencedCall],
    got: tuple[bool, Any],
) -> None:
    """:func:`_settle` off the loop (a release is a store step), from a cancelled task.

    Queued in a thread here and now, not in a task of its own: a shutdown that cancelled
    every task reached that one before its first step, the release never ran, and the
    collector closing the driver aborted the intent for an effect that never began (found
    by review). A loop whose executor is already shut down settles here, without waiting."""
    job = _Once(functools.partial(_settle, aside=True), gen, got)
    try:
        fut = _queue(off_loop, job)
    except RuntimeError:  # no thread to be had: here, unless a queued copy took it
        job(wait=False)
        return
    _SETTLING.add(fut)
    fut.add_done_callback(_forget)


def _queue(off_loop: Callable[..., Awaitable[Any]], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread of ``off_loop`` (an Offloader's, or the loop's
    default executor for ``asyncio.to_thread``), queued here and now: its future. Raises
    RuntimeError where no thread can take it; the default executor may have queued the
    job all the same (it queues before it starts a thread), so give it a :class:`_Once`."""
    owner = getattr(off_loop, "__self__", None)
    if isinstance(owner, Offloader):
        return owner.submit(fn, *args)
    ctx = contextvars.copy_context()  # as to_thread: logging and tracing context carry over
    return asyncio.get_running_loop().run_in_executor(None, ctx.run, fn, *args)


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
    fence: EffectFence,
    ticket: PreparedEffect,
    every: float | None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> threading.Event | None:
    """Renew from a thread until ``stop`` is set; for an effect on ``loop``, also once that
    loop is closed: its effect can never go on, and renewed for ever its intent stayed in
    flight for ever (found by review)."""
    if every is None:
        return None
    stop = threading.Event()

    def beat() -> None:
        pause = every
        while not stop.wait(pause):
            if loop is not None and loop.is_closed():
                return
            try:
                fence.renew(ticket)
                pause = every
            except StoreUnavailable:
                pause = every * RENEW_RETRY_FACTOR  # a blip: keep the lease, try sooner
            except Refusal:
                return  # taken over or finished: commit will say so

    try:
        threading.Thread(
            target=beat, name=f"effectfence-renew-{ticket.intent}", daemon=True
        ).start()
    except BaseException:
        # interrupted in start(), which waits for the thread: it may be running already,
        # and with nobody holding ``stop`` it renewed for ever (found by review)
        stop.set()
        raise
    return stop


def _stop_thread(stop: threading.Event | None) -> None:
    if stop is not None:
        stop.set()


def _off_loop(
    offload: bool | Offloader,
) -> Callable[..., Awaitable[Any]] | None:
    """How a blocking step leaves the loop: an Offloader's threads, the default executor
    (``True``), or not at all (``False``: the store answers without blocking)."""
    if isinstance(offload, Offloader):
        return offload.run
    return asyncio.to_thread if offload else None


def _renew_in_task(
    fence: EffectFence,
    ticket: PreparedEffect,
    every: float | None,
    off_loop: Callable[..., Awaitable[Any]] | None,
) -> asyncio.Task[None] | threading.Event | None:
    if every is None:
        return None
    if off_loop is asyncio.to_thread:
        # renewed from a thread of its own: through the loop's default executor, renewals
        # queued behind the effects' own blocking calls (to_thread) that had filled it,
        # and leases lapsed mid-effect (found by review). An Offloader's threads run
        # store steps only: no effect can fill them.
        return _renew_in_thread(fence, ticket, every, asyncio.get_running_loop())
    period = every

    async def beat() -> None:
        pause = period
        while True:
            await asyncio.sleep(pause)
            try:
                if off_loop is not None:
                    await off_loop(fence.renew, ticket)
                else:
                    fence.renew(ticket)
                pause = period
            except StoreUnavailable:
                pause = period * RENEW_RETRY_FACTOR  # a blip: keep the lease, try sooner
            except Refusal:
                return  # taken over or finished: commit will say so

    return asyncio.get_running_loop().create_task(beat())


def _stop_task(task: asyncio.Task[None] | threading.Event | None) -> None:
    if isinstance(task, threading.Event):
        task.set()
    elif task is not None:
        task.cancel()


class Offloader:
    """Blocking fence steps run off an asyncio loop, on a few long-lived threads.

    Why not ``asyncio.to_thread`` / ``anyio.to_thread.run_sync``: a store step is ~0.1 ms of
    work, and a general-purpose pool costs as much again per call (``anyio``'s limiter,
    cancel scopes, a thread per concurrent call contending for the GIL). Measured with 8 HTTP
    clients on one server (SQLite, synchronous=FULL): ~480 prepares/s through
    ``anyio.to_thread``, ~540/s through this (``benchmarks/bench_mcp.py``).

    A job is a plain call in a worker thread, in a copy of the caller's context (logging
    and tracing context carry over); its result or exception comes back to the awaiting
    task. A caller cancelled while its job runs stops waiting at once; the job itself
    finishes in its thread (a step already sent cannot be called back, exactly as when a
    reply is lost), and its answer is dropped.
    """

    def __init__(self, threads: int = OFFLOAD_THREADS, name: str = "effectfence-step") -> None:
        if threads < 1:
            raise ValueError("an Offloader needs at least one thread")
        self.threads = threads
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._started = 0  # worker threads running
        self._pending = 0  # jobs queued or running
        self._lock = threading.Lock()  # orders jobs, thread starts and close()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # close()
                return
            loop, future, ctx, fn, args = job
            value, error = None, None
            try:
                value = ctx.run(fn, *args)
            except BaseException as exc:  # handed to the caller, whatever it is
                error = exc
            # no longer pending BEFORE the caller hears back: its next job must find this
            # thread counted free, or every answer could start another thread
            with self._lock:
                self._pending -= 1
            _deliver(loop, future, value, error)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread; its result, or its exception, here.

        A thread is started only when every running one has a job (up to ``threads``):
        one caller at a time keeps one warm thread, and a step blocked in the store (a lock
        held by another process) does not hold up the steps behind it."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """:meth:`run`, queued here and now (on the running loop): the job runs even if
        nobody ever awaits the future."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._pending >= self._started and self._started < self.threads:
                # started before anything is counted or queued: a thread that cannot start
                # (a process at its limit) left the job queued for a caller told it failed,
                # and a worker counted that never ran (found by review)
                threading.Thread(
                    target=self._work, name=f"{self.name}-{self._started + 1}", daemon=True
                ).start()
                self._started += 1
            self._jobs.put((loop, future, contextvars.copy_context(), fn, args))
            self._pending += 1
        return future

    def close(self) -> None:
        """Workers finish the jobs queued so far, then exit; a later :meth:`run` starts
        new ones (a server's lifespan may end and begin again)."""
        with self._lock:
            for _ in range(self._started):
                self._jobs.put(None)
            self._started = 0


def _deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    value: Any,
    exc: BaseException | None,
) -> None:
    def settle() -> None:
        if future.done():  # the caller was cancelled: nobody waits for this answer
            return
        if exc is None:
            future.set_result(value)
        else:
            future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed while the job ran: nobody is left to tell, and
        # nothing will settle the future: let it go (kept, it held the closed loop for good,
        # one per such shutdown: found by review)
        _SETTLING.discard(future)
