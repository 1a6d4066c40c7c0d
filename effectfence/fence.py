"""EffectFence: the driver that runs the protocol against a store.

The protocol (:mod:`effectfence.protocol`) decides; the store carries out one conditional
step; this module wires them together, builds tickets and certificates, counts every
attempt in exactly one statistics bucket, and wakes waiters. It does no I/O of its own:
the memory store is in-process, and durable stores bring their own drivers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from effectfence.canonical import (
    MAX_SAFE_INTEGER,
    CanonicalError,
    canonical_bytes,
    fast_bytes,
    name_bytes,
)
from effectfence.cert import MAX_PAYLOAD_DEPTH, EffectCert, spliced_hash
from effectfence.clock import VectorClock, ticket_counts
from effectfence.counters import new_table
from effectfence.errors import (
    CLEAR_COMMAND,
    REFUSAL_TYPES,
    DomainRace,
    IntentInFlight,
    InvalidRequest,
    InvalidTicket,
    LeaseLost,
    ReadSetStale,
    Refusal,
    StoreUnavailable,
)
from effectfence.model import (
    Admission,
    EffectRequest,
    Fresh,
    PreparedEffect,
    Replay,
    _utf8,
)
from effectfence.protocol import (
    TICKET_TABLE,
    Action,
    ClearVerdict,
    IntentRecord,
    Row,
    State,
    TicketVerdict,
    decide_clear,
    decide_prepare,
    judge_ticket,
    observe,
    plan_claim,
    plan_commit,
    prepare_refusal,
    reclaim_after,
    recommit,
)
from effectfence.store import _fork
from effectfence.store.base import APPLIED, BUSY, MOVED, RACE, STALE, FenceStore, Step
from effectfence.store.cmemory import memory_store
from effectfence.store.memory import MemoryStore

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_RESULT_TTL",
    "DEFAULT_SWEEP_INTERVAL",
    "AuditEntry",
    "EffectFence",
    "FenceConfig",
    "IntentStatus",
]

DEFAULT_LEASE_TTL = 30.0
DEFAULT_RESULT_TTL = 24 * 3600.0
DEFAULT_SWEEP_INTERVAL = 1.0
DEFAULT_SWEEP_BATCH = 10_000

#: what a commit refused store_unavailable tells its caller to do (the effect has run)
UNRECORDABLE_RESULT_RECOVER = (
    "the effect ran: do NOT run it again; commit a result that can be recorded (smaller, "
    "JSON only) with the same ticket, or abort the ticket so the intent is fenced"
)
COMMIT_UNAVAILABLE_RECOVER = (
    "the effect ran but its result is not recorded yet: call commit again with the same "
    "ticket and result (safe to repeat); do NOT run the effect again"
)

#: due wheel entries each prepare visits when any are due: far more than one attempt
#: schedules (a lease and a result), so reclaiming keeps pace with admission at any rate and
#: a backlog left by a quiet spell drains within a few thousand calls, ~5 us each (G8)
REAP_BATCH = 16
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
DEFAULT_MAX_DEPTH = 32
#: longest lease or finite result lifetime accepted (~31 years): deadlines stay exact floats
MAX_TTL = 1e9
_MAX_MOVES = 64  # a record that moves this often under one prepare is reported in flight
#: longest reason (and who) an operator's clear records
MAX_CLEAR_TEXT = 4096
#: the largest fencing token a store holds (a signed 64-bit column)
_MAX_TOKEN = 2**63 - 1
#: what ``clear``'s ``expect_state`` may name: a record's state, or a row of the state table
#: as a status showed it (a lease that lapsed since, a result that expired since, is still
#: the version looked at), and the record state each one means
_EXPECTABLE = {
    **{s.value: s.value for s in (State.IN_FLIGHT, State.DONE, State.FAILED)},
    Row.IN_FLIGHT_LAPSED.value: State.IN_FLIGHT.value,
    Row.DONE_EXPIRED.value: State.DONE.value,
}
#: what ``clear_intent(intent)`` records: the library's form names no one and no reason
LIBRARY_CLEARER = "library"
LIBRARY_CLEAR_REASON = "clear_intent() called without a reason"

_REPLAY, _CLAIM, _TAKEOVER = Action.REPLAY, Action.CLAIM, Action.TAKEOVER
_ALLOW, _COMMITTED = TicketVerdict.ALLOW, TicketVerdict.COMMITTED
_STALE_REASON = "read_set_stale"
_T = TypeVar("_T")


def read_free_commit(table: Mapping[tuple[Row, bool], TicketVerdict]) -> bool:
    """May a commit skip the read before its store step? The step's compare-by-token (with
    the ticket's payload) is Rule 3's check exactly when ``table`` lets a ticket act on every
    in-flight row holding its token and on nothing else. Should Rule 3 ever say otherwise,
    commits read and judge first, as abort, release and renew do: the table stays the judge."""
    allowed = {key for key, verdict in table.items() if verdict is TicketVerdict.ALLOW}
    return allowed == {(Row.IN_FLIGHT_LIVE, True), (Row.IN_FLIGHT_LAPSED, True)}


_READ_FREE_COMMIT = read_free_commit(TICKET_TABLE)

PREPARE_BUCKETS = ("admitted", "replayed", *REFUSAL_TYPES)
EVENT_BUCKETS = (
    "commits",
    "aborts",
    "releases",
    "renewals",
    "takeovers",
    "clears",
    "reclaimed",
    "stale_commits",
    "refused_ticket_ops",
)


_CLOCK_OF_A_GIVEN_STORE = "config.clock is for the memory store; a given store has its own"


def _memory_options(cfg: FenceConfig) -> dict[str, Any]:
    """What a config gives the memory store it makes: its clock and counter table."""
    kw: dict[str, Any] = {}
    if cfg.clock is not None:
        kw["clock"] = cfg.clock
    if cfg.counters is not None:
        kw["counters"] = new_table(cfg.counters)
    return kw


@dataclass(frozen=True, kw_only=True, slots=True)
class FenceConfig:
    """How long leases and results live, how the fence judges time, and its limits."""

    lease_ttl: float = DEFAULT_LEASE_TTL
    result_ttl: float = DEFAULT_RESULT_TTL
    #: the memory store's clock (monotonic seconds); tests inject a fake one
    clock: Callable[[], float] | None = None
    #: sweep expired records on the way through prepare, every ``sweep_interval`` seconds
    auto_sweep: bool = True
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL
    sweep_batch: int = DEFAULT_SWEEP_BATCH
    #: how long a lapsed lease nobody took over is kept (its holder may still commit)
    #: before a sweep reclaims it; None: as long as a result would live (``result_ttl``)
    lapsed_grace: float | None = None
    max_args_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_result_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: nesting allowed in args and results: at most MAX_PAYLOAD_DEPTH (what a certificate holds)
    max_depth: int = DEFAULT_MAX_DEPTH
    #: counter table for the memory store: "atomic", "pure" or None (environment / best)
    counters: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_args_bytes", "max_result_bytes", "max_depth", "sweep_batch"):
            value = getattr(self, name)
            if type(value) is not int:  # NaN passed every comparison below (found by review)
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("lease_ttl", "result_ttl", "lapsed_grace", "sweep_interval"):
            if type(getattr(self, name)) is bool:  # True is 1: a one-second lease
                raise ValueError(f"{name} must be a number of seconds, not a bool")
        if not (isinstance(self.lease_ttl, int | float) and 0 < self.lease_ttl <= MAX_TTL):
            raise ValueError(f"lease_ttl must be > 0 and <= {MAX_TTL:g} s, got {self.lease_ttl!r}")
        if not (
            isinstance(self.result_ttl, int | float)
            and (0 < self.result_ttl <= MAX_TTL or self.result_ttl == math.inf)
        ):
            raise ValueError(
                f"result_ttl must be > 0 and <= {MAX_TTL:g} s, or math.inf to keep results forever"
            )
        if self.lapsed_grace is not None and not (
            isinstance(self.lapsed_grace, int | float)
            and (0 <= self.lapsed_grace <= MAX_TTL or self.lapsed_grace == math.inf)
        ):
            raise ValueError(f"lapsed_grace must be in [0, {MAX_TTL:g}] s, math.inf or None")
        if not self.sweep_interval > 0 or self.sweep_batch < 1:
            raise ValueError("sweep_interval must be > 0 and sweep_batch >= 1")
        if self.max_args_bytes < 2 or self.max_result_bytes < 2 or self.max_depth < 1:
            raise ValueError("size limits must allow at least an empty JSON object")
        if self.max_depth > MAX_PAYLOAD_DEPTH:
            # deeper args or results would be admitted, and run, but their certificate could
            # not be re-encoded (verified, stored, exported): refuse the configuration instead
            raise ValueError(
                f"max_depth must be <= {MAX_PAYLOAD_DEPTH} (the deepest payload a certificate "
                f"holds), got {self.max_depth!r}"
            )


@dataclass(frozen=True, slots=True)
class IntentStatus:
    """One intent as seen now. Asking never creates state."""

    intent: str
    state: str
    token: int | None = None
    holder: str | None = None
    domain: str | None = None
    lease_until: float | None = None
    retry_after: float | None = None
    cert: EffectCert | None = None
    reason: str | None = None
    since: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action in the store's audit trail: who cleared which intent, when (``at``,
    on the store's clock) and why, and what the record was (``previous``: state, holder,
    token, domain, seq and the failure, lease or certificate hash; never args or results)."""

    id: int
    at: float
    intent: str
    action: str
    who: str
    reason: str
    forced: bool = False
    previous: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditEntry:
        return cls(
            id=int(data["id"]),
            at=float(data["at"]),
            intent=str(data.get("intent", "")),
            action=str(data.get("action", "clear")),
            who=str(data.get("who", "")),
            reason=str(data.get("reason", "")),
            forced=bool(data.get("forced", False)),
            previous=dict(data.get("previous") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at,
            "intent": self.intent,
            "action": self.action,
            "who": self.who,
            "reason": self.reason,
            "forced": self.forced,
            "previous": dict(self.previous),
        }


class _Waiter:
    """Waiters of one intent in this process: woken at its next transition."""

    __slots__ = ("count", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.count = 0


class _Holds:
    """The attempts in hand on one store, across the fences that share it.

    :meth:`EffectFence.close` waits for them and closes the store once none is left, now
    or when the last is given back: a fence sharing the store with others (wrap keeps one
    per lease and TTL) must not close it under their effects. The lock is reentrant: a
    signal handler's close may land while the thread it interrupted holds it. Counted per
    fork generation: a child holds none of its parent's attempts."""

    def __init__(self) -> None:
        # the lock alone on every attempt (twice per @fenced call); the condition only for
        # a close that waits (a Condition's own enter/exit cost ~1 us a call, measured)
        self._lock = _fork.rlock()
        self._cond = threading.Condition(self._lock)
        self._closers = 0  # closes waiting on the condition
        self._gen = _fork.generation()
        self._n = 0
        self._close_later = False
        self._closed = False  # by one of the fences: the others' close() has nothing to do

    @classmethod
    def of(cls, store: FenceStore) -> _Holds:
        with _HOLDS_LOCK:
            holds = getattr(store, "_effectfence_holds", None)
            if not isinstance(holds, _Holds):
                holds = cls()
                with contextlib.suppress(AttributeError):  # no __dict__: this fence's own
                    store._effectfence_holds = holds  # type: ignore[attr-defined]
            return holds

    def _fresh(self) -> None:
        if self._gen != _fork.generation():
            self._gen, self._n, self._close_later = _fork.generation(), 0, False
            self._closed = False

    def take(self) -> bool:
        """One more attempt in hand; False (none taken) once the store is closed or closing
        when idle: a fence sharing it that is not closing must not start one then."""
        with self._lock:
            if self._gen != _fork.generation():
                self._fresh()
            if self._closed:
                return False
            self._n += 1
            return True

    def give_back(self, store: FenceStore) -> None:
        """One attempt settled; the last one closes the store if a close is waiting (it
        runs in the settling caller's thread: an error there must not cost it its answer)."""
        with self._lock:
            if self._gen != _fork.generation():
                self._fresh()
            self._n = max(0, self._n - 1)
            if self._n:
                return
            if self._closers:
                self._cond.notify_all()
            if self._close_later:
                self._close_later, self._closed = False, True
                with contextlib.suppress(Exception):
                    store.close()

    def close_when_idle(self, store: FenceStore, timeout: float) -> None:
        """Wait up to ``timeout`` for the attempts in hand; then close the store, or leave
        it to the last one given back. Closed under the lock: no attempt starts meanwhile."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._fresh()
            self._closers += 1
            try:
                while self._n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._closers -= 1
            if self._n:
                self._close_later = True
            elif not self._closed:
                self._closed = True
                store.close()


class _Attempt:
    """One attempt the driver carries out, on one store's holds, live until it ends."""

    __slots__ = ("holds", "live")

    def __init__(self, holds: _Holds) -> None:
        self.holds, self.live = holds, True


#: the attempts the driver is carrying out in this context, from before the prepare to the
#: settle: a close of their store from inside one (a signal handler landing in the effect,
#: the commit or the prepare; an ``await aclose()`` in an async effect, whose thread copies
#: the context) must not wait for it. A context variable, not a thread's; and each attempt
#: marks itself dead when it ends, as a task or thread started inside it copies the mark and
#: outlives it (found by review)
_DRIVING: contextvars.ContextVar[tuple[_Attempt, ...]] = contextvars.ContextVar(
    "effectfence_driving", default=()
)


def _in_effect_here(holds: _Holds) -> bool:
    if any(a.live and a.holds is holds for a in _DRIVING.get()):
        return True
    try:  # the loop's own effects wait on this thread: waiting here would stall them
        import asyncio

        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class driving:
    """For the driver: around an attempt it carries out (see :meth:`EffectFence.close`).
    A class, not a generator: it runs on every ``@fenced`` call."""

    __slots__ = ("_attempt", "_token")

    def __init__(self, fence: EffectFence) -> None:
        self._attempt = _Attempt(fence._holds)

    def __enter__(self) -> None:
        self._token = _DRIVING.set((*_DRIVING.get(), self._attempt))

    def __exit__(self, *exc: object) -> None:
        self._attempt.live = False
        # a coroutine finalized by the collector exits in whatever context that runs in,
        # where the token is not valid (ValueError); its own context dies with it anyway
        with contextlib.suppress(ValueError):
            _DRIVING.reset(self._token)


_HOLDS_LOCK = threading.Lock()


class EffectFence:
    """Exactly one attempt per intent runs; every other learns what happened.

    ``fence.prepare(request)`` returns :class:`Fresh` (run the effect, then ``commit`` the
    ticket) or :class:`Replay` (it already ran: here is the certificate), or raises a typed
    :class:`~effectfence.errors.Refusal`.

    This class is the driver of the sans-IO protocol: every decision is a call into
    :mod:`effectfence.protocol`, every change one step of the store. It holds no rule.
    """

    def __init__(self, config: FenceConfig | None = None, *, store: FenceStore | None = None):
        self.config = cfg = config or FenceConfig()
        if store is None:
            store = memory_store(**_memory_options(cfg))  # the C one when built (cmemory)
        elif cfg.clock is not None:
            raise ValueError(_CLOCK_OF_A_GIVEN_STORE)
        self.store = store
        self._lease_ttl = float(cfg.lease_ttl)
        self._result_ttl = float(cfg.result_ttl)
        grace = float(cfg.result_ttl if cfg.lapsed_grace is None else cfg.lapsed_grace)
        self._lapsed_grace = grace
        self._lease_reclaim = reclaim_after(State.IN_FLIGHT, self._lease_ttl, grace)
        self._result_reclaim = reclaim_after(State.DONE, self._result_ttl, grace)
        self._failed_reclaim = reclaim_after(State.FAILED, 0.0, grace)
        backend = store.counters_backend
        self._stats = new_table(backend if backend in ("atomic", "pure") else None)
        self._slot = {k: self._stats.slot(k) for k in (*PREPARE_BUCKETS, *EVENT_BUCKETS)}
        self._inc = self._stats.reserve_slot
        self._slot_admitted = self._slot["admitted"]
        self._slot_commits = self._slot["commits"]
        self._slot_replayed = self._slot["replayed"]
        self._now = store.now
        self._read = store.read
        self._due = store.due
        self._put_first = store.put_first
        # the memory store keeps the payload itself: skip a call that returns its argument
        self._fp_is_payload = type(store).fingerprint_of is MemoryStore.fingerprint_of
        self._auto = cfg.auto_sweep
        self._waiters: dict[str, _Waiter] = {}
        # released in a forked child: a thread of the parent that held one at the fork does
        # not exist there (a child's auto-sweep was skipped for ever, a wait deadlocked)
        self._waiters_lock = _fork.lock()
        self._sweep_due = -math.inf
        self._sweep_lock = _fork.lock()
        # attempts the driver holds (admitted, or being admitted, and not yet settled), on
        # this store by every fence sharing it: close() waits for them (see _Holds)
        self._closing = False
        self._holds = _Holds.of(store)

    @classmethod
    def from_url(cls, url: str, config: FenceConfig | None = None, **options: Any) -> EffectFence:
        """A fence on the store a URL names: ``memory:``, ``sqlite:///path/fence.db``,
        ``postgresql://...``, ``redis://...`` (see :func:`effectfence.store.open_store`)."""
        from effectfence.store import is_memory_url, open_store

        cfg = config or FenceConfig()
        if is_memory_url(url):
            if not options:
                return cls(cfg)
            # options go to the store, as for every URL (they were dropped without a word,
            # an injected clock unused: found by review), with what the config gives it
            store = open_store(url, **{**_memory_options(cfg), **options})
            return cls(dataclasses.replace(cfg, clock=None), store=store)
        if cfg.clock is not None:  # refused before the store is opened: a refusal makes nothing
            raise ValueError(_CLOCK_OF_A_GIVEN_STORE)
        store = open_store(url, **options)
        try:
            return cls(cfg, store=store)
        except BaseException:
            store.close()  # refused: its connections were left open (found by review)
            raise

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting, let the effects the driver is running here settle, then release
        the store's connections.

        An effect that ran while its store was closed under it could not be recorded: it
        stayed in flight, and once its lease lapsed an identical call ran it again. So from
        now on every prepare is refused ``store_unavailable``, and close waits up to
        ``timeout`` seconds (default: the lease TTL) for the effects of
        :func:`~effectfence.fenced` and ``wrap`` on this store (by any fence sharing it) to
        commit, abort or release. The store closes once none is left: now, or when the last
        one settles (close returns at the timeout either way; it never waits for the calling
        thread's own effect, as a signal handler's would, nor on an event loop's thread).
        Tickets a caller holds from
        :meth:`prepare` itself are the caller's to settle first. From async code use
        :meth:`aclose`, so the loop's own effects can settle meanwhile."""
        wait = self._lease_ttl if timeout is None else float(timeout)
        self._closing = True
        if _in_effect_here(self._holds):
            wait = 0.0  # the effects that would settle are waiting on this very caller
        self._holds.close_when_idle(self.store, max(0.0, wait))

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close`, waiting in a thread so the event loop's effects can settle."""
        import asyncio

        await asyncio.to_thread(self.close, timeout)

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called: new attempts are refused."""
        return self._closing

    def _hold_effect(self) -> None:
        """For the driver, before each prepare: one attempt in hand until
        :meth:`_let_effect_go`, or refused once :meth:`close` was called."""
        if self._closing or not self._holds.take():
            self._count("store_unavailable")
            raise self._closing_refusal()

    def _let_effect_go(self) -> None:
        self._holds.give_back(self.store)

    @staticmethod
    def _closing_refusal() -> StoreUnavailable:
        return StoreUnavailable(
            "the fence is closing: it admits no new attempt; nothing was decided",
            recover="retry against a fence that is open (this process is shutting down)",
        )

    # -- statistics ---------------------------------------------------------------------------
    def _count(self, bucket: str) -> None:
        self._inc(self._slot[bucket])

    def count_refused_prepare(self, code: str) -> None:
        """For drivers that refuse a prepare before it reaches the fence (a malformed MCP
        call): the attempt still lands in exactly one statistics bucket."""
        if code not in REFUSAL_TYPES:
            raise ValueError(f"unknown refusal code {code!r}")
        self._count(code)

    def stats(self, *, size: bool = True) -> dict[str, Any]:
        """Every prepare attempt in exactly one bucket, plus event counts and sizes.

        ``size=False`` leaves out the one figure that needs the store (its record counts):
        the rest is this process's own, readable while the store is down."""
        load = self._stats.load_slot
        prepare = {k: load(self._slot[k]) for k in PREPARE_BUCKETS}
        out: dict[str, Any] = {
            "attempts": sum(prepare.values()),
            "prepare": prepare,
            **{k: load(self._slot[k]) for k in EVENT_BUCKETS},
            "store": self.store.name,
            "counters": self.store.counters_backend,
        }
        if size:
            out["size"] = self.store.size()
        return out

    # -- payloads -------------------------------------------------------------------------------
    def fingerprint(self, request: EffectRequest) -> str:
        """Hex SHA-256 of the canonical {"args", "domain", "tool"}: what "same action" means."""
        payload, _ = self._payload(request.intent, request.args, request.domain, request.tool)
        return hashlib.sha256(payload).hexdigest()

    def _payload(self, intent: str, args: Any, domain: str, tool: str) -> tuple[bytes, bytes]:
        """(canonical payload, canonical args). The payload is the RFC 8785 form of
        {"args", "domain", "tool"}, assembled from the canonical args (spliced_hash's
        principle), so the certificate can reuse the args' bytes at commit. The store turns
        it into the fingerprint it keeps (``FenceStore.fingerprint_of``)."""
        cfg = self.config
        try:
            limit = cfg.max_args_bytes  # counted while encoding: bounded work for any args
            args_json = fast_bytes(args, cfg.max_depth, max_bytes=limit) or canonical_bytes(
                args, max_depth=cfg.max_depth, max_bytes=limit
            )
            if len(args_json) > cfg.max_args_bytes:
                raise CanonicalError(
                    "$",
                    f"canonical form is {len(args_json)} bytes, over "
                    f"max_args_bytes={cfg.max_args_bytes}",
                )
            payload = b"".join(
                (
                    b'{"args":',
                    args_json,
                    b',"domain":',
                    name_bytes(domain),
                    b',"tool":',
                    name_bytes(tool),
                    b"}",
                )
            )
        except CanonicalError as exc:
            raise InvalidRequest(f"args of {intent!r}: {exc}", intent=intent) from exc
        return payload, args_json

    def _result_json(self, intent: str, result: Any) -> bytes:
        cfg = self.config
        try:
            return canonical_bytes(result, max_depth=cfg.max_depth, max_bytes=cfg.max_result_bytes)
        except CanonicalError as exc:
            # the effect ran: "fix the call" alone invites running it again (found by review)
            raise InvalidRequest(
                f"result of {intent!r}: {exc}",
                intent=intent,
                recover=UNRECORDABLE_RESULT_RECOVER,
            ) from exc

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, request: EffectRequest) -> Admission:
        """Admit exactly one attempt per intent; replay or refuse every other (G1, G3, G4)."""
        if type(request) is not EffectRequest:
            self._count("invalid_request")
            raise InvalidRequest(f"prepare takes an EffectRequest, got {type(request).__name__}")
        if self._closing:  # see close(): an effect admitted now could not be recorded
            self._count("store_unavailable")
            raise self._closing_refusal()
        intent = request.intent
        try:
            payload, args_json = self._payload(intent, request.args, request.domain, request.tool)
        except InvalidRequest:
            self._count("invalid_request")
            raise
        fp = payload if self._fp_is_payload else self.store.fingerprint_of(payload)
        # A store that cannot answer refuses the attempt ``store_unavailable``: counted in
        # that bucket like any refusal, and raised before anything was decided.
        try:
            return self._decide(request, fp, args_json)
        except StoreUnavailable:
            self._count("store_unavailable")
            raise

    def _decide(self, request: EffectRequest, fp: bytes, args_json: bytes) -> Admission:
        """prepare, from the payload on: observe, ask the protocol, carry out one step."""
        intent = request.intent
        store = self.store
        compare, reserve_at, contradiction = plan_claim(
            request.read_set, request.domain, request.expected_seq
        )
        if self._put_first and contradiction is None:
            # claim as if the slot were empty: the claim's compare-and-set is the observation
            rec, now = None, -math.inf
        else:
            rec, now = self._read(intent)  # one round trip: a replay is this one read
            if self._auto:
                if now >= self._sweep_due:
                    self._auto_sweep(now)
                    rec, now = self._read(intent)
                elif self._due(now):  # keep pace with admission: a few due records per call
                    self.sweep(REAP_BATCH)
        seen = True  # rec and now are an observation to decide on
        for _ in range(_MAX_MOVES):
            if not seen:
                rec, now = self._read(intent)
            seen = False
            row, action = decide_prepare(rec, now, fp)
            if action is _REPLAY:
                self._inc(self._slot_replayed)
                return Replay(rec.cert)  # type: ignore[union-attr]
            if action is not _CLAIM and action is not _TAKEOVER:
                assert rec is not None
                refusal = prepare_refusal(action, row, rec, now, intent)
                self._count(refusal.code)
                raise refusal
            if contradiction is not None:  # both cannot hold: report where the domain is
                d, want, _ = contradiction
                raise self._refuse_stale(intent, row, (d, want, store.current(d)))
            step = store.claim(
                intent,
                expect=rec,
                fingerprint=fp,
                domain=request.domain,
                agent=request.agent,
                lease_ttl=self._lease_ttl,
                reclaim_after=self._lease_reclaim,
                compare=compare,
                reserve_at=reserve_at,
            )
            outcome = step.outcome
            if step.now is not None:  # a put-first claim: what it found, at the store's now
                rec, now, seen = step.found, step.now, outcome is MOVED
                if self._auto and now >= self._sweep_due:
                    if outcome is APPLIED:
                        # housekeeping must not undo a decision: a failed sweep here said
                        # "nothing was decided" of a claim that applied, and the intent sat
                        # in flight under a token nobody held (found by review)
                        with contextlib.suppress(StoreUnavailable):
                            self._auto_sweep(now)
                    else:
                        self._auto_sweep(now)
                        # it may have removed what the claim found: decide on what is there
                        seen = False
            if outcome is APPLIED:
                return self._admit(request, fp, args_json, step, action is _TAKEOVER)
            if outcome is STALE:
                raise self._refuse_stale(intent, row, step.stale)
            if outcome is RACE:
                assert step.stale is not None
                if request.expected_seq is None:  # the read set's own-domain entry moved
                    raise self._refuse_stale(intent, row, step.stale)
                self._count("domain_race")
                raise DomainRace(
                    f"can't prepare {intent!r}: expected {request.domain!r} at "
                    f"{request.expected_seq}, it is at {step.stale[2]}",
                    intent=intent,
                    state=row.value,
                    domain=request.domain,
                    expected=request.expected_seq,
                    actual=step.stale[2],
                )
            # MOVED: the record changed between observation and claim: observe again
        self._count("intent_in_flight")
        raise IntentInFlight(
            f"can't prepare {intent!r}: the record kept changing under contention",
            intent=intent,
            state="contended",
            retry_after=0.0,
        )

    def _refuse_stale(self, intent: str, row: Row, stale: Any) -> ReadSetStale:
        d, want, got = stale
        self._count("read_set_stale")
        return ReadSetStale(
            f"can't prepare {intent!r}: read set says {d!r} at {want}, it is at {got}",
            intent=intent,
            state=row.value,
            domain=d,
            expected=want,
            actual=got,
        )

    def _admit(
        self, request: EffectRequest, fp: bytes, args_json: bytes, step: Step, takeover: bool
    ) -> Fresh:
        rec = step.record
        assert rec is not None
        head = step.head
        seq = rec.seq
        agent = request.agent
        counters = ticket_counts(head.clock, request.known_clock, agent)
        if seq > MAX_SAFE_INTEGER or counters[agent] > MAX_SAFE_INTEGER:
            # Backstop, unreachable by construction: it takes 2**53 reservations, or 2**52
            # commits by one agent, since a request names no counter above
            # MAX_KNOWN_COUNTER (model.py; so no caller can park another agent's counter at
            # the edge). Should a head get there anyway (a store written before that bound),
            # a certificate could not record this seq or clock: refuse before the effect runs
            # (fail closed). The reserved seq stays used (G5).
            self.store.release(request.intent, rec.token)
            self._count("invalid_request")
            what = (
                f"domain {request.domain!r} has used up its JSON-safe seq range"
                if seq > MAX_SAFE_INTEGER
                else f"the vector clock of {agent!r} on {request.domain!r} is at its JSON-safe "
                "maximum"
            )
            raise InvalidRequest(
                f"{what}; a certificate could not record this attempt", intent=request.intent
            )
        ticket = PreparedEffect(
            request.intent,
            request.domain,
            seq,
            rec.token,
            agent,
            request.tool,
            request.args,
            request.read_set,
            request.parent if request.parent is not None else head.hash,
            VectorClock._trusted(counters),
            request.expected_seq,
            rec.lease_until,
            fp,
            args_json,
            self.store.ticket_scope,
        )
        self._inc(self._slot_admitted)
        if takeover:
            self._count("takeovers")
            self._wake(request.intent)
        return Fresh(ticket, takeover)

    # -- ticket operations ------------------------------------------------------------------------
    def _check_ticket(self, op: str, ticket: PreparedEffect) -> None:
        """Judge a ticket against the record now (G2); refuse one whose payload is not the
        admitted one."""
        if type(ticket) is not PreparedEffect:
            raise InvalidTicket(f"{op} takes a PreparedEffect ticket, got {type(ticket).__name__}")
        self._check_scope(op, ticket)
        store = self.store
        try:
            rec, now = store.read(ticket.intent)
        except StoreUnavailable:
            self._count("refused_ticket_ops")
            raise
        verdict, refusal = judge_ticket(op, rec, now, ticket.intent, ticket.token)
        if verdict is not _ALLOW:  # COMMITTED too: this is not a commit
            self._count("refused_ticket_ops")
            assert refusal is not None
            raise refusal
        assert rec is not None
        if rec.fingerprint != self._ticket_payload(ticket)[0]:
            self._count("refused_ticket_ops")
            raise _not_admitted(op, ticket)

    def _check_scope(self, op: str, ticket: PreparedEffect) -> None:
        """Refuse a ticket another store issued: its token counts in that store, and here
        it matched whichever attempt holds the same token (found by review: a release
        freed another holder's intent and a duplicate ran). A ticket with no scope (built
        by hand, or unpickled from an older version) is judged as before."""
        scope = getattr(ticket, "scope", "")
        if scope and scope != self.store.ticket_scope:
            self._count("refused_ticket_ops")
            raise InvalidTicket(
                f"can't {op} {ticket.intent!r}: this ticket was issued by another store "
                f"({scope.split(':', 1)[0]}), not this fence's: use the fence that prepared it",
                intent=ticket.intent,
            )

    def _ticket_payload(self, ticket: PreparedEffect) -> tuple[bytes, bytes]:
        """(fingerprint, canonical args) of the payload a ticket carries: as admitted, or
        computed anew for a ticket built by hand (and then compared with the record's)."""
        fp = ticket.fingerprint
        args_json = ticket.args_json
        if fp is None or args_json is None:
            payload, args_json = self._payload(
                ticket.intent, ticket.args, ticket.domain, ticket.tool
            )
            fp = self.store.fingerprint_of(payload)
        return fp, args_json

    def _ticket_step(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        """A ticket operation's store step; a store that cannot answer refuses it
        ``store_unavailable``, counted with the other refused ticket operations."""
        try:
            return fn(*args, **kw)
        except StoreUnavailable:
            self._count("refused_ticket_ops")
            raise

    def _lost(self, op: str, ticket: PreparedEffect, found: IntentRecord | None) -> Refusal:
        self._count("refused_ticket_ops")
        _, refusal = judge_ticket(op, found, self.store.now(), ticket.intent, ticket.token)
        if refusal is None:  # the record moved and moved back: still not ours to finish
            refusal = _moved(op, ticket.intent)
        return refusal

    def commit(self, ticket: PreparedEffect, result: Any) -> EffectCert:
        """Record the effect's result; DONE with a certificate, atomically with the token check.

        One store step, no read before it: the step applies only while the record is in
        flight under the ticket's token with the ticket's payload, which are Rule 3's ALLOW
        rows (:func:`read_free_commit`). Anything else, the record found is judged by Rule 3
        and refused, or answered as a retry of this very commit (G3)."""
        if type(ticket) is not PreparedEffect:
            kind = type(ticket).__name__
            raise InvalidTicket(f"commit takes a PreparedEffect ticket, got {kind}")
        self._check_scope("commit", ticket)
        intent = ticket.intent
        fp, args_json = self._ticket_payload(ticket)
        result_json = self._result_json(intent, result)
        if not _READ_FREE_COMMIT:
            rec, now = self._ticket_step(self.store.read, intent)
            if judge_ticket("commit", rec, now, intent, ticket.token)[0] is not _ALLOW:
                return self._commit_refused(ticket, fp, result_json, rec)
        domain = ticket.domain
        read_set = ticket.read_set
        compare, own_seq = plan_commit(read_set, domain, ticket.seq, ticket.expected_seq)
        rs = tuple((d, s) for d, s in read_set) if read_set else ()
        vc = ticket.vector_clock.to_dict()
        try:
            digest = spliced_hash(
                intent,
                ticket.parent,
                domain,
                ticket.seq,
                ticket.tool,
                args_json,
                result_json,
                vc,
                rs,
                ticket.agent,
            )
        except CanonicalError as exc:
            raise InvalidRequest(f"certificate of {intent!r}: {exc}", intent=intent) from exc
        # The certificate keeps the hashed bytes, not the caller's objects: neither the
        # caller's args nor its result can change a certificate after the fact (G3).
        cert = EffectCert._trusted(
            intent,
            ticket.parent,
            domain,
            ticket.seq,
            ticket.tool,
            args_json,
            result_json,
            vc,
            rs,
            ticket.agent,
            digest,
        )
        try:
            step = self._ticket_step(
                self.store.complete,
                intent,
                ticket.token,
                cert,
                fingerprint=fp,
                result_ttl=self._result_ttl,
                reclaim_after=self._result_reclaim,
                compare=compare,
                own_seq=own_seq,
                stale_reason=_STALE_REASON,
                stale_reclaim_after=self._failed_reclaim,
            )
        except StoreUnavailable as exc:
            # "retry later; nothing was decided" is true of this step, but a caller reads
            # it about the effect, which ran: say which retry is the safe one
            exc.recover = COMMIT_UNAVAILABLE_RECOVER
            raise
        except CanonicalError as exc:
            # Backstop: a store that could not encode the certificate (its cert_to_json)
            # wrote nothing. Typed, so a driver aborts ("result not recordable") and the
            # intent stays fenced, never re-run.
            raise InvalidRequest(
                f"certificate of {intent!r} could not be recorded: {exc}", intent=intent
            ) from exc
        outcome = step.outcome
        if outcome is APPLIED:
            self._inc(self._slot_commits)
            if self._waiters:
                self._wake(intent)
            return cert
        if outcome is STALE:
            assert step.stale is not None
            self._count("stale_commits")
            self._wake(intent)
            raise _stale_commit(intent, ticket.token, *step.stale)
        return self._commit_refused(ticket, fp, result_json, step.found)

    def _commit_refused(
        self, ticket: PreparedEffect, fp: bytes, result_json: bytes, found: IntentRecord | None
    ) -> EffectCert:
        """The commit's step did not apply: judge the record it found (Rule 3), as the
        ticket operations that read first do (:meth:`_check_ticket`)."""
        intent = ticket.intent
        if (
            found is not None
            and found.state is State.FAILED
            and found.token == ticket.token
            and found.reason == _STALE_REASON
            and found.fingerprint == fp
        ):
            # this ticket's commit already found its read set moved (a retry, or a step
            # whose reply was lost): the same answer, not "lease lost"
            self._count("refused_ticket_ops")
            raise self._stale_again(ticket)
        verdict, refusal = self._ticket_step(
            lambda: judge_ticket("commit", found, self.store.now(), intent, ticket.token)
        )
        if verdict is _COMMITTED and found is not None and found.fingerprint == fp:
            # only a retry of the very commit, with the same result, learns the certificate
            again = recommit(found, result_json)
            if again is not None:
                return again  # type: ignore[no-any-return]
        self._count("refused_ticket_ops")
        if verdict is _ALLOW and found is not None and found.fingerprint == fp:
            raise _moved("commit", intent)
        if verdict is _ALLOW:
            # in flight under this ticket's token, yet the step did not apply: the ticket
            # does not carry the payload that was admitted
            raise _not_admitted("commit", ticket)
        assert refusal is not None
        raise refusal

    def _stale_again(self, ticket: PreparedEffect) -> ReadSetStale:
        """The refusal of a commit made stale earlier, its moved pair read again (the
        store keeps no record of it; a compared domain only ever moves on)."""
        compare, own_seq = plan_commit(
            ticket.read_set, ticket.domain, ticket.seq, ticket.expected_seq
        )
        pairs = [*compare, *(() if own_seq is None else ((ticket.domain, own_seq),))]
        for d, want in pairs:
            got = self._ticket_step(self.store.current, d)
            if got != want:
                return _stale_commit(ticket.intent, ticket.token, d, want, got)
        return _stale_commit(ticket.intent, ticket.token, None, None, None)

    def abort(self, ticket: PreparedEffect, reason: str = "aborted") -> None:
        """The outcome is unknown: fence the intent until an operator clears it (G9)."""
        if type(reason) is not str or not reason or len(reason) > 4096 or "\x00" in reason:
            raise InvalidRequest(
                "abort reason must be a non-empty string of at most 4096 chars, without NUL"
            )
        _utf8("abort reason", reason)  # shown to every later caller, and in the audit trail
        if reason == _STALE_REASON:
            # reserved for the commit that found its read set moved: a commit after such an
            # abort was told read_set_stale, a race that never happened (found by review)
            raise InvalidRequest(
                f"abort reason {_STALE_REASON!r} is reserved for a commit whose read set "
                "moved: give another reason"
            )
        self._check_ticket("abort", ticket)
        step = self._ticket_step(
            self.store.fail, ticket.intent, ticket.token, reason, reclaim_after=self._failed_reclaim
        )
        if step.outcome is not APPLIED:
            raise self._lost("abort", ticket, step.found)
        self._count("aborts")
        self._wake(ticket.intent)

    def release(self, ticket: PreparedEffect) -> None:
        """The effect definitely did not fire: free the intent for a retry."""
        self._check_ticket("release", ticket)
        step = self._ticket_step(self.store.release, ticket.intent, ticket.token)
        if step.outcome is not APPLIED:
            raise self._lost("release", ticket, step.found)
        self._count("releases")
        self._wake(ticket.intent)

    def renew(self, ticket: PreparedEffect, ttl: float | None = None) -> float:
        """Heartbeat while the token is current: the lease then ends ``ttl`` (default: the
        lease TTL) from now on the store's clock, whatever was left; returns the deadline."""
        lease = self._lease_ttl if ttl is None else ttl
        if type(lease) is bool or not (isinstance(lease, int | float) and 0 < lease <= MAX_TTL):
            raise InvalidRequest(f"ttl must be > 0 and <= {MAX_TTL:g} s, got {ttl!r}")
        self._check_ticket("renew", ticket)
        step = self._ticket_step(
            self.store.renew,
            ticket.intent,
            ticket.token,
            lease_ttl=float(lease),
            reclaim_after=reclaim_after(State.IN_FLIGHT, float(lease), self._lapsed_grace),
        )
        if step.outcome is not APPLIED:
            raise self._lost("renew", ticket, step.found)
        assert step.record is not None
        until = step.record.lease_until
        ticket.lease_until = until
        self._count("renewals")
        return until

    # -- operator and queries ----------------------------------------------------------------------
    def clear(
        self,
        intent: str,
        *,
        reason: str,
        who: str,
        force: bool = False,
        expect_state: str | None = None,
        expect_token: int | None = None,
    ) -> AuditEntry | None:
        """The operator's reconcile: the intent's record -> ABSENT, recorded with who cleared
        it, when (the store's clock) and why, in the same store step (G9).

        An intent in flight under a live lease is refused :class:`IntentInFlight` unless
        ``force``: its holder may be running the effect right now, and an attempt admitted
        after the clear would run it a second time. ``expect_state`` / ``expect_token``:
        what the operator looked at; a record that is no longer in that state or under that
        token is refused (``intent_in_flight``, retryable: look again), so a decision made
        on one attempt never clears the next (a forced clear of a lease taken over since,
        a commit that landed since, a new failure nobody has reconciled). Returns the audit
        entry, or None when there was no record (nothing cleared, nothing recorded)."""
        _check_intent(intent)
        if expect_state is not None and (
            type(expect_state) is not str or expect_state not in _EXPECTABLE
        ):
            raise InvalidRequest(
                f"expect_state must be one of {sorted(_EXPECTABLE)}", intent=intent
            )
        if expect_token is not None and (
            type(expect_token) is not int or not 0 <= expect_token <= _MAX_TOKEN
        ):
            # past the stores' 64-bit tokens it was "moved, retry" (found by review)
            raise InvalidRequest(
                f"expect_token must be a token: an int in 0..{_MAX_TOKEN}", intent=intent
            )
        if type(reason) is not str or not reason.strip() or len(reason) > MAX_CLEAR_TEXT:
            raise InvalidRequest(
                f"a clear needs a reason: a non-empty string of at most {MAX_CLEAR_TEXT} chars",
                intent=intent,
            )
        if type(who) is not str or not who.strip() or len(who) > 256:
            raise InvalidRequest("who must be a non-empty string of at most 256 chars")
        # recorded in the audit trail: text every store and reader holds (a lone surrogate
        # deleted the record, then failed, and made the trail unreadable; found by review)
        _utf8("clear reason", reason)
        _utf8("who", who)
        if type(force) is not bool:
            raise InvalidRequest("force must be True or False", intent=intent)
        store = self.store
        for _ in range(_MAX_MOVES):
            rec, now = store.read(intent)
            row, verdict, refusal = decide_clear(rec, now, intent, force=force)
            if refusal is not None:
                raise refusal
            if verdict is ClearVerdict.NOTHING:
                return None
            assert rec is not None
            if (expect_state is not None and rec.state.value != _EXPECTABLE[expect_state]) or (
                expect_token is not None and rec.token != expect_token
            ):
                raise IntentInFlight(
                    f"can't clear {intent!r}: its record changed since you looked (expected "
                    f"{expect_state or 'any state'} under token "
                    f"{'any' if expect_token is None else expect_token}; it is "
                    f"{rec.state.value} under token {rec.token}, agent {rec.agent!r})",
                    intent=intent,
                    state=row.value,
                    token=rec.token,
                    holder=rec.agent,
                    retryable=True,
                    recover="look at the record again; clear it if it still needs clearing",
                )
            entry = {
                "action": "clear",
                "intent": intent,
                "who": who,
                "reason": reason,
                "forced": bool(force) and row is Row.IN_FLIGHT_LIVE,
                "previous": _snapshot(rec, row, now),
            }
            step = store.clear_if(intent, expect=rec, entry=entry)
            if step.outcome is APPLIED:
                assert step.entry is not None
                self._count("clears")
                self._wake(intent)
                return AuditEntry.from_dict(step.entry)
            # the record moved between the look and the step: judge the new one
        raise IntentInFlight(
            f"can't clear {intent!r}: its record kept changing; try again",
            intent=intent,
            retryable=True,
        )

    def clear_intent(self, intent: str) -> bool:
        """The library's one-argument reconcile: any state -> ABSENT, as documented since the
        first release, live leases included. Recorded in the audit trail like every clear
        (who ``library``, a reason saying none was given, forced when it broke a live
        lease). Operators use :meth:`clear`, which asks for a reason and refuses a live lease
        unless forced. True if something was cleared."""
        return (
            self.clear(intent, reason=LIBRARY_CLEAR_REASON, who=LIBRARY_CLEARER, force=True)
            is not None
        )

    def audit(
        self, intent: str | None = None, *, after: int | None = None, limit: int = 100
    ) -> list[AuditEntry]:
        """The audit trail (of one intent, or all), oldest first: the newest ``limit``
        entries, or with ``after`` the ones recorded after that id. Never creates state."""
        if intent is not None:
            _check_intent(intent)
        return [
            AuditEntry.from_dict(e)
            for e in self.store.audit(intent=intent, after=after, limit=limit)
        ]

    def intent_status(self, intent: str) -> IntentStatus:
        """One intent's state now, as a value. Never creates state (G8)."""
        _check_intent(intent)
        rec, now = self.store.read(intent)
        return status_of(intent, rec, now)

    def record(self, intent: str) -> tuple[IntentRecord | None, float]:
        """The stored record of ``intent`` and the store's clock, for the operator's views.
        Never creates state (G8)."""
        _check_intent(intent)
        return self.store.read(intent)

    def current(self, domain: str) -> int:
        """The domain's last reserved seq (the floor if it does not exist). Creates nothing."""
        _check_name("domain", domain)
        return self.store.current(domain)

    def evict_domain(self, domain: str) -> int | None:
        """Forget a domain's counter; refused while an attempt is in flight on it (G5)."""
        _check_name("domain", domain)
        step = self.store.evict_domain(domain)
        if step.outcome is BUSY:
            raise IntentInFlight(
                f"can't evict domain {domain!r}: {step.count} attempt(s) in flight on it",
                state="in_flight",
                domain=domain,
                in_flight=step.count,
            )
        return step.value

    def sweep(self, limit: int | None = None) -> int:
        """Reclaim expired results and lapsed leases now; returns how many."""
        n = self.store.sweep(limit)
        if n:
            for _ in range(n):
                self._count("reclaimed")
        return n

    def _auto_sweep(self, now: float) -> None:
        if not self._sweep_lock.acquire(blocking=False):
            return  # another thread is sweeping
        try:
            self._sweep_due = now + self.config.sweep_interval
            self.sweep(self.config.sweep_batch)
        finally:
            self._sweep_lock.release()

    # -- waiting -----------------------------------------------------------------------------------
    def _wake(self, intent: str) -> None:
        w = self._waiters.pop(intent, None)
        if w is not None:
            w.event.set()

    def wait(self, intent: str, timeout: float) -> bool:
        """Block up to ``timeout`` s while ``intent`` is in flight with a live lease; True
        when it is not (any more). Woken by this process's transitions at once, and by
        other processes' through the store (:meth:`FenceStore.wait_for_change`).
        Registered before the check, so no transition is missed; unregistered after."""
        _check_intent(intent)
        # NaN passed every comparison and returned False at once; a str raised TypeError
        # from inside the store's wait (found by review)
        if type(timeout) not in (int, float) or not timeout >= 0:
            raise InvalidRequest(f"wait's timeout is seconds, a number >= 0, got {timeout!r}")
        with self._waiters_lock:
            w = self._waiters.get(intent)
            if w is None:
                w = self._waiters[intent] = _Waiter()
            w.count += 1
        try:
            rec, now = self.store.read(intent)
            if observe(rec, now) is not Row.IN_FLIGHT_LIVE:
                return True
            assert rec is not None
            timeout = min(timeout, max(0.0, rec.lease_until - now))  # never past the lease
            if self.store.shared:
                self.store.wait_for_change(intent, rec, timeout)
            else:
                w.event.wait(timeout)
            rec, now = self.store.read(intent)
            return observe(rec, now) is not Row.IN_FLIGHT_LIVE
        finally:
            with self._waiters_lock:
                w.count -= 1
                if w.count == 0 and self._waiters.get(intent) is w:
                    # _wake pops without this lock (a transition must not wait on it): its
                    # pop may land between the check and here, found by review (KeyError)
                    self._waiters.pop(intent, None)

    # -- conveniences -----------------------------------------------------------------------------
    def request(
        self,
        intent: str,
        domain: str,
        tool: str,
        args: Mapping[str, Any] | None = None,
        agent: str = "anonymous",
        *,
        read_set: Iterable[Any] | None = None,
        parent: str | None = None,
        known_clock: Mapping[str, int] | None = None,
        expected_seq: int | None = None,
    ) -> Admission:
        """``prepare(EffectRequest(...))`` in one call; a malformed request is counted as
        an ``invalid_request`` attempt like any other refusal."""
        try:
            if read_set is None and parent is None and known_clock is None and expected_seq is None:
                # the plain positional call: the one the accelerator builds in C (model.py)
                request = EffectRequest(intent, domain, tool, args, agent)
            else:
                request = EffectRequest(
                    intent,
                    domain,
                    tool,
                    args,
                    agent,
                    read_set=read_set,
                    parent=parent,
                    known_clock=known_clock,
                    expected_seq=expected_seq,
                )
        except InvalidRequest:
            self._count("invalid_request")
            raise
        return self.prepare(request)


def _moved(op: str, intent: str) -> LeaseLost:
    """The step found the record no longer in flight under the ticket: not ours to finish."""
    return LeaseLost(f"can't {op} {intent!r}: the lease moved", intent=intent)


def _check_name(what: str, name: object) -> None:
    """A name a query may look up, held to the rule every request's names are (NUL, a lone
    surrogate: no store can hold or encode them), so one is refused typed here, not as a
    driver's error there (a lone surrogate comes from a command line that is not UTF-8)."""
    if type(name) is not str or not name:
        raise InvalidRequest(f"{what} must be a non-empty string without NUL")
    _utf8(what, name)


def _check_intent(intent: object) -> None:
    _check_name("intent", intent)


def _stale_commit(
    intent: str, token: int, d: str | None, want: int | None, got: int | None
) -> ReadSetStale:
    """A commit whose read set moved while the effect ran: the effect ran, the intent is
    FAILED, and running it again is the one wrong answer."""
    moved = "a compared domain moved" if d is None else f"{d!r} moved from {want} to {got}"
    return ReadSetStale(
        f"can't commit {intent!r}: {moved} while the effect ran; the intent is now FAILED: "
        "reconcile, then clear it",
        retryable=False,
        recover="the effect ran on a stale view: do not run it again; reconcile "
        f"downstream, then an operator clears the intent ({CLEAR_COMMAND})",
        intent=intent,
        state="failed",
        token=token,
        domain=d,
        expected=want,
        actual=got,
    )


def _not_admitted(op: str, ticket: PreparedEffect) -> InvalidTicket:
    return InvalidTicket(
        f"can't {op} {ticket.intent!r}: the ticket's payload is not the admitted one",
        intent=ticket.intent,
        token=ticket.token,
    )


def _snapshot(rec: IntentRecord, row: Row, now: float) -> dict[str, Any]:
    """What a clear removed, for its audit entry: state, holder, token and the facts of its
    row. Never the args or the result (they may hold personal data): a done record is
    named by its certificate's hash."""
    snap: dict[str, Any] = {
        "state": row.value,
        "token": rec.token,
        "holder": rec.agent,
        "domain": rec.domain,
        "seq": rec.seq,
    }
    if row is Row.FAILED:
        snap["failure"] = rec.reason
        snap["failed_for"] = max(0.0, now - rec.since)
    elif row in (Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LAPSED):
        snap["lease_left"] = max(0.0, rec.lease_until - now)
    elif rec.cert is not None:
        snap["cert_hash"] = rec.cert.hash
    return snap


def status_of(intent: str, rec: IntentRecord | None, now: float) -> IntentStatus:
    """An intent's status from its record at ``now`` (the protocol's row, as a value)."""
    row = observe(rec, now)
    if rec is None or row is Row.DONE_EXPIRED:
        return IntentStatus(intent, Row.ABSENT.value)
    if row in (Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LAPSED):
        return IntentStatus(
            intent,
            row.value,
            token=rec.token,
            holder=rec.agent,
            domain=rec.domain,
            lease_until=rec.lease_until,
            retry_after=max(0.0, rec.lease_until - now),
        )
    if row is Row.DONE_LIVE:
        return IntentStatus(
            intent, row.value, token=rec.token, holder=rec.agent, domain=rec.domain, cert=rec.cert
        )
    return IntentStatus(
        intent,
        row.value,
        token=rec.token,
        holder=rec.agent,
        domain=rec.domain,
        reason=rec.reason,
        since=rec.since,
    )
