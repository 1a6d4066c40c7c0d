"""The store contract: a few atomic compare-and-set steps that decide nothing.

The fence decides (every rule lives in :mod:`effectfence.protocol` and is applied by
:mod:`effectfence.fence`); a store carries decisions out. Each step below is ONE atomic
operation in its store (a section under one lock, one SQL transaction or statement, one Lua
script) whose conditions are plain comparisons the decider chose: "the record is still the
one I observed", "the record is in flight under this token", "domain D is at seq S". When a
condition does not hold the step changes nothing and reports what it found, so the decider
observes again and re-decides. A process killed between two steps leaves a record from
which the guarantees still hold: an in-flight record whose holder died lapses and is taken
over with a new token.

Time: deadlines are computed inside the step from the store's own clock
(:meth:`FenceStore.now`): the process's monotonic clock in memory, the database server's
clock for shared stores; never a client's wall clock. The decider passes durations
(``lease_ttl``, ``result_ttl``, ``reclaim_after``), the store adds its ``now``.

Every step answers with one tagged :class:`Step`. ``tests/test_store_contract.py`` is the
conformance suite: a new store passes by adding one fixture.

The stale-holder hazard, and how the fencing token closes it::

    t0  A claims            -> token 7, lease until t0+30
    t31 A is paused, its lease lapses; the record still says IN_FLIGHT(token 7)
    t32 B observes it lapsed and claims with expect=<that record>
                            -> the store installs IN_FLIGHT(token 9): A's token is gone
    t40 A wakes and commits -> complete(token 7) finds token 9: MOVED, nothing written
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import Enum
from typing import Any

from effectfence.errors import StoreUnavailable
from effectfence.protocol import IntentRecord, State

__all__ = ["EMPTY_HEAD", "FenceStore", "Head", "Outcome", "Step", "StoreMissing"]


class StoreMissing(ValueError):
    """A store opened with ``create=False`` is not there: a file, schema or prefix that
    nothing has written (a typo, or a store not used yet). Looking must not create one."""


class Head:
    """What the last committed effect on a domain left for the next one to build on."""

    __slots__ = ("clock", "hash")

    def __init__(self, hash: str | None, clock: dict[str, int]) -> None:
        self.hash = hash
        self.clock = clock

    def __repr__(self) -> str:
        return f"Head(hash={self.hash!r}, clock={self.clock!r})"


EMPTY_HEAD = Head(None, {})
_KEY_LOCK = threading.Lock()


class Outcome(Enum):
    """What a step did. The repr is the name, as in messages."""

    APPLIED = "applied"  # the condition held and the write happened
    MOVED = "moved"  # the record is not the one the decider judged: ``found`` holds it
    STALE = "stale"  # a compared (domain, seq) pair did not hold: ``stale`` names it
    RACE = "race"  # the reserve compare-exchange lost: ``stale`` names the domain's seq
    BUSY = "busy"  # evict_domain: attempts are in flight on the domain (``count``)

    def __repr__(self) -> str:
        return self.name

    __hash__ = object.__hash__


APPLIED, MOVED, STALE, RACE, BUSY = (
    Outcome.APPLIED,
    Outcome.MOVED,
    Outcome.STALE,
    Outcome.RACE,
    Outcome.BUSY,
)


class Step:
    """The one result type of every step.

    - ``record``: the record the step installed (APPLIED), else None.
    - ``found``: the record the step found (the one replaced, or the one that refused).
    - ``head``: for a claim, the domain's head when it applied.
    - ``stale``: (domain, expected seq, actual seq) for STALE and RACE.
    - ``count``: attempts in flight, for BUSY; the evicted seq (or None) is ``value``.
    - ``entry``: for an operator's clear, the audit entry as the store recorded it.
    - ``now``: the store's clock when the step ran, from a :attr:`FenceStore.put_first`
      store's claim (the decider judges ``found`` at it); None elsewhere.
    """

    __slots__ = ("count", "entry", "found", "head", "now", "outcome", "record", "stale", "value")

    def __init__(
        self,
        outcome: Outcome,
        record: IntentRecord | None = None,
        found: IntentRecord | None = None,
        head: Head = EMPTY_HEAD,
        stale: tuple[str, int, int | None] | None = None,
        count: int = 0,
        value: int | None = None,
        entry: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> None:
        self.outcome = outcome
        self.record = record
        self.found = found
        self.head = head
        self.stale = stale
        self.count = count
        self.value = value
        self.entry = entry
        self.now = now

    @property
    def ok(self) -> bool:
        return self.outcome is APPLIED

    def __repr__(self) -> str:
        return f"Step({self.outcome!r}, record={self.record!r}, found={self.found!r})"


#: the longest a server store waits on one step (a day): past it a timeout is a mistake
MAX_STEP_TIMEOUT = 86400.0


def step_timeout(value: Any) -> float:
    """A server store's ``timeout``: seconds, finite, > 0. Redis took 0, -1, NaN and inf
    and failed later with a raw driver error or "unavailable, retry later"; PostgreSQL took
    inf (found by review)."""
    if type(value) not in (int, float) or not 0 < value <= MAX_STEP_TIMEOUT:
        raise ValueError(
            f"timeout must be seconds, a number > 0 and <= {MAX_STEP_TIMEOUT:g}, got {value!r}"
        )
    return float(value)


def settled(step: Step, applied: Callable[[IntentRecord | None], bool]) -> Step:
    """A ticket step run again after its connection broke: an answer of MOVED holding what
    this step writes means the first run applied after all (it was still going on a
    server that had not noticed the client was gone, and committed before the second
    looked): APPLIED, as it is. Anything else stands. Found by review: an abort that had
    applied was reported lease_lost."""
    if step.outcome is MOVED and applied(step.found):
        return Step(APPLIED, step.found, None)
    return step


def release_untold(where: str, intent: str, holder: int) -> StoreUnavailable:
    """A release whose reply was lost, its intent now held under another token. A release
    leaves no trace, so "it applied, then someone claimed" cannot be told from "a takeover
    came first": answered lease_lost, it told a holder whose release applied that its lease
    was taken (found by review). Not retryable: a retry would say lease_lost."""
    return StoreUnavailable(
        f"{where} lost the reply of release {intent!r}, which is now held under token "
        f"{holder}: whether the release applied before that claim can't be told",
        operation="release",
        retryable=False,
        recover="nothing to retry: the intent is another caller's now",
    )


def same_record(a: IntentRecord | None, b: IntentRecord | None) -> bool:
    """The compare of a claim's compare-and-set for stores that cannot compare identity.

    Two versions of one intent are the same version when state, token and deadlines are
    equal: every transition changes the token (claim, takeover) or the state or a deadline
    (commit, abort, renew), so this tells versions apart as identity does in memory."""
    if a is None or b is None:
        return a is b
    return (
        a.token == b.token
        and a.state is b.state
        and a.lease_until == b.lease_until
        and a.until == b.until
    )


class FenceStore(ABC):
    """One contract, several stores (memory, sqlite, postgresql, redis)."""

    #: short name reported in stats ("memory", "sqlite", ...)
    name: str = "store"
    #: which counter table backs the domain sequences ("atomic", "pure", "sql", ...)
    counters_backend: str = "n/a"
    #: what a wire ticket is bound to: tickets of one scope are never honoured by another.
    #: A shared durable store uses a stable identity of its database; memory is per object.
    ticket_scope: str = ""
    #: True when the store is shared with other processes: waiting duplicates cannot rely on
    #: the fence's in-process wake-ups alone and ask :meth:`wait_for_change`
    shared: bool = False
    #: True when a claim that finds a record costs about what a read costs (it writes
    #: nothing durable and holds no lock past itself: Redis, PostgreSQL). ``prepare`` then
    #: claims first, as if the slot were empty, and judges the record a MOVED claim found at
    #: the claim's ``now`` (:attr:`Step.now`): a fresh attempt is a claim and a complete, two
    #: round trips. A store where an attempted claim costs the write lock (SQLite) reads
    #: first.
    put_first: bool = False

    def fingerprint_of(self, payload: bytes) -> bytes:
        """What the store keeps to recognise "the same payload": by default its SHA-256.

        ``payload`` is the RFC 8785 form of {"args", "domain", "tool"}; two requests are the
        same action exactly when their payloads are equal (G4)."""
        return hashlib.sha256(payload).digest()

    # -- reads ---------------------------------------------------------------------------
    @abstractmethod
    def now(self) -> float:
        """The store's clock, in seconds; leases and TTLs are judged by it alone."""

    @abstractmethod
    def get(self, intent: str) -> IntentRecord | None:
        """The current record, or None. Never creates state."""

    def read(self, intent: str) -> tuple[IntentRecord | None, float]:
        """The record and the store's ``now``, read together (one round trip where the store
        is remote: a replay is this one read)."""
        return self.get(intent), self.now()

    def finished_after_lost_claim(self, intent: str) -> Step | None:
        """After a claim of a slot its decider saw empty lost its connection (remote stores
        claim first, so that claim was also the duplicate's only look): a finished record
        (done or failed) is not one that claim could have made, so it is an answer (MOVED,
        at a fresh read's clock), as a replay's read lost the same way is retried. Nothing
        there, or a record in flight (perhaps the lost claim's own): None, and the claim is
        unavailable."""
        try:
            rec, now = self.read(intent)
        except StoreUnavailable:
            return None
        if rec is None or rec.state is State.IN_FLIGHT:
            return None
        return Step(MOVED, found=rec, now=now)

    @abstractmethod
    def current(self, domain: str) -> int:
        """The domain's last reserved seq; an absent domain is at the floor. Never creates."""

    @abstractmethod
    def in_flight(self, domain: str) -> int:
        """How many attempts are in flight on ``domain``."""

    @abstractmethod
    def size(self) -> dict[str, int]:
        """Records and domains held, for stats and for the bounded-memory tests."""

    def records(
        self, *, states: Sequence[State] = (), domain: str | None = None, limit: int = 1000
    ) -> Iterator[IntentRecord]:
        """Stored records (for the operator), optionally of some states or one domain."""
        raise NotImplementedError(f"the {self.name} store does not list records")

    def certs(self, domain: str, *, after_seq: int = 0, limit: int = 1000) -> Iterator[Any]:
        """Committed certificates of ``domain`` with ``seq > after_seq``, in seq order: the
        audit trail, kept by durable stores for as long as the operator asks (optional)."""
        raise NotImplementedError(f"the {self.name} store keeps no certificate trail")

    def trail_cut(self, domain: str) -> int:
        """The seq through which retention deleted ``domain``'s certificates (0: none). A
        store deletes only a prefix of a trail, so the trail it keeps starts after this;
        the trail check then accepts links to certificates before it (see
        :func:`effectfence.operator.trail.check_trail`)."""
        return 0

    def sealing_key(self) -> bytes:
        """The key that seals wire tickets (:mod:`effectfence.tickets`). A shared store keeps
        one in the store, so a ticket sealed by one process opens in every process sharing
        it; by default a random key per store object (tickets live as long as the object)."""
        with _KEY_LOCK:  # two threads asking first must get one key
            key: bytes | None = getattr(self, "_sealing_key", None)
            if key is None:
                key = self._sealing_key = secrets.token_bytes(32)
            return key

    # -- steps ---------------------------------------------------------------------------
    @abstractmethod
    def claim(
        self,
        intent: str,
        *,
        expect: IntentRecord | None,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        reserve_at: int | None,
    ) -> Step:
        """Put-first claim, atomically with the read-set compare and the seq reservation.

        Conditions, in this order, all in one step:
          1. slot: the intent's record is ``expect`` (None: there is none). Otherwise MOVED
             with the record found.
          2. compare: every ``(domain, seq)`` is at ``seq`` (an absent domain is at the
             floor). Otherwise STALE, nothing written.
          3. reserve on ``domain``: with ``reserve_at`` one compare-exchange ``S -> S+1``
             (otherwise RACE with the domain's seq, nothing written; an absent domain is
             at the floor and is not created by losing); without, the next seq.
        Then APPLIED: an IN_FLIGHT record with a token larger than every token the store
        handed out, ``lease_until = now + lease_ttl``, ``reclaim_at = now + reclaim_after``
        and the reserved seq; ``head`` is the domain's head at that moment.
        """

    @abstractmethod
    def complete(
        self,
        intent: str,
        token: int,
        cert: Any,
        *,
        fingerprint: bytes,
        result_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        own_seq: int | None,
        stale_reason: str,
        stale_reclaim_after: float,
    ) -> Step:
        """IN_FLIGHT(token, fingerprint) -> DONE(cert, until = now + result_ttl,
        reclaim_at = now + reclaim_after), compare-by-token.

        The fingerprint is compared with the token: a ticket carries the payload it was
        admitted with, so the fence can commit without reading the record first (the step's
        condition is the ticket check; the fence judges only a refusal, from ``found``).
        Otherwise MOVED with the record found. In the same step every ``compare`` pair and,
        if given, ``own_seq`` (the record's own domain at that seq) are compared; if one
        does not hold the record becomes FAILED(``stale_reason``, since=now, reclaim_at =
        now + stale_reclaim_after) instead and the answer is STALE with the pair. On APPLIED
        the domain's head becomes the certificate's hash, its clock the merge, bounded
        (:func:`effectfence.clock.merge_head`).
        """

    @abstractmethod
    def fail(self, intent: str, token: int, reason: str, *, reclaim_after: float) -> Step:
        """IN_FLIGHT(token) -> FAILED(reason, since=now, reclaim_at=now + reclaim_after),
        compare-by-token."""

    @abstractmethod
    def release(self, intent: str, token: int) -> Step:
        """IN_FLIGHT(token) -> ABSENT: compare-and-delete by token, never by key alone."""

    @abstractmethod
    def renew(self, intent: str, token: int, *, lease_ttl: float, reclaim_after: float) -> Step:
        """IN_FLIGHT(token) -> IN_FLIGHT(token, now + lease_ttl), compare-by-token."""

    @abstractmethod
    def clear(self, intent: str) -> IntentRecord | None:
        """Any state -> ABSENT, unconditionally and unrecorded. Returns the record removed.
        The fence clears with :meth:`clear_if`; this stays for tools that must empty a slot."""

    @abstractmethod
    def clear_if(self, intent: str, *, expect: IntentRecord, entry: Mapping[str, Any]) -> Step:
        """The operator's clear: compare-and-delete, and an audit entry, in one step.

        Condition: the intent's record is still ``expect``, the version the decider judged
        (:func:`same_record`). Otherwise MOVED with the record found, nothing written.
        Then the record is deleted and ``entry`` (a JSON object the decider wrote: who, why,
        what was cleared) is appended to the audit trail with two fields the store adds:
        ``id`` (larger than every id before it) and ``at`` (the store's ``now``). APPLIED
        with ``found`` the record deleted and ``entry`` the entry as recorded. Either both
        happen or neither: a clear nobody can account for is what this step exists to
        prevent."""

    @abstractmethod
    def audit(
        self, *, intent: str | None = None, after: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Audit entries (of one intent, or all), oldest first: with ``after`` those whose
        ``id`` is larger, at most ``limit``; without, the newest ``limit``. A read: never
        creates state."""

    @abstractmethod
    def evict_domain(self, domain: str) -> Step:
        """Forget a domain's counter and head, unless attempts are in flight on it (BUSY
        with their ``count``). APPLIED with ``value`` the seq it was at (None if absent).
        A later re-creation starts above every seq the domain ever handed out (G5)."""

    @abstractmethod
    def sweep(self, limit: int | None = None) -> int:
        """Delete records whose ``reclaim_at`` has passed (compare-by-token against the
        version that set it), at O(expired) cost; returns how many."""

    def due(self, now: float) -> bool:
        """Cheap hint: has some record's ``reclaim_at`` passed? Stores where asking costs a
        round trip answer False and are swept on the fence's ``sweep_interval`` alone."""
        return False

    def describe(self) -> dict[str, Any]:
        """What ``effectfence info --store`` prints: the store, and its durability."""
        return {"store": self.name, "counters": self.counters_backend}

    # -- waiting and lifetime ------------------------------------------------------------
    def wait_for_change(self, intent: str, seen: IntentRecord | None, timeout: float) -> bool:
        """Block up to ``timeout`` s until the intent's record is no longer ``seen``, for
        waiters in other processes; True if it changed. Stores that can be woken (LISTEN,
        pub/sub) override this; the default polls with backoff."""
        import time

        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            if not same_record(self.get(intent), seen):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections; the memory store has none."""
