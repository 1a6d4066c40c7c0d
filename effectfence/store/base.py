"""The store contract: what a store must do, each operation one atomic step.

The fence (a driver around the sans-IO protocol) decides; a store carries decisions out.
Every operation below is ONE conditional step in its store — a section under one lock, one
SQL transaction, one Lua script — with its conditions named in code. If the condition does
not hold, the step changes nothing and reports what it found instead, so the fence can
re-observe and re-decide. A process killed between two steps leaves a record from which the
guarantees still hold: an in-flight record whose holder died lapses and is taken over.

Conditions are judged by the store's own clock (:meth:`FenceStore.now`): the process's
monotonic clock in memory, the database server's clock for shared stores. Never a client's
wall clock.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from effectfence.protocol import IntentRecord

__all__ = ["EMPTY_HEAD", "ClaimResult", "CommitResult", "FenceStore", "Head"]


class Head:
    """What the last committed effect on a domain left for the next one to build on."""

    __slots__ = ("clock", "hash")

    def __init__(self, hash: str | None, clock: dict[str, int]) -> None:
        self.hash = hash
        self.clock = clock


EMPTY_HEAD = Head(None, {})


class ClaimResult:
    """Outcome of :meth:`FenceStore.claim`. Exactly one of the shapes below.

    - claimed: ``ok`` True, ``seq`` reserved, ``token`` and ``lease_until`` of the new lease,
      ``head`` of the domain at claim time.
    - moved: ``ok`` False, ``current`` is the record found instead (re-decide on it).
    - stale: ``ok`` False, ``stale`` = (domain, expected seq, actual seq) of a read-set entry.
    - race: ``ok`` False, ``race`` = the domain's actual seq (expected_seq lost).
    """

    __slots__ = (
        "current",
        "head",
        "lease_until",
        "ok",
        "race",
        "seq",
        "stale",
        "takeover",
        "token",
    )

    def __init__(
        self,
        ok: bool,
        seq: int = 0,
        token: int = 0,
        lease_until: float = 0.0,
        head: Head = EMPTY_HEAD,
        *,
        current: IntentRecord | None = None,
        stale: tuple[str, int, int | None] | None = None,
        race: int | None = None,
    ) -> None:
        self.ok = ok
        self.seq = seq
        self.token = token
        self.lease_until = lease_until
        self.head = head
        self.current = current
        self.stale = stale
        self.race = race
        #: the claim replaced a lapsed lease (not an absent or expired record)
        self.takeover = False


class CommitResult:
    """Outcome of :meth:`FenceStore.complete`: done, lease lost, or stale (now FAILED)."""

    __slots__ = ("current", "ok", "stale")

    def __init__(
        self,
        ok: bool,
        *,
        current: IntentRecord | None = None,
        stale: tuple[str, int, int | None] | None = None,
    ) -> None:
        self.ok = ok
        self.current = current
        self.stale = stale


class FenceStore(ABC):
    """One contract, several stores; ``tests/test_store_contract.py`` runs against all."""

    #: short name reported in stats ("memory", "sqlite", ...)
    name: str = "store"
    #: which counter table backs the domain sequences ("atomic", "pure", "sql", ...)
    counters_backend: str = "n/a"
    #: what a wire ticket is bound to: tickets of one scope are never honoured by another.
    #: A shared durable store uses a stable identity of its database; memory is per object.
    ticket_scope: str = ""

    def fingerprint_of(self, payload: bytes) -> bytes:
        """What the store keeps to recognise "the same payload": by default its SHA-256.

        ``payload`` is the RFC 8785 form of {"args", "domain", "tool"}; two requests are the
        same action exactly when their payloads are equal (G4)."""
        return hashlib.sha256(payload).digest()

    @abstractmethod
    def now(self) -> float:
        """The store's clock, in seconds; leases and TTLs are judged by it alone."""

    @abstractmethod
    def get(self, intent: str) -> IntentRecord | None:
        """The current record, or None. Never creates state."""

    @abstractmethod
    def claim(
        self,
        intent: str,
        *,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        observed_token: int | None,
        read_set: Sequence[tuple[str, int]],
        expected_seq: int | None,
    ) -> ClaimResult:
        """Put-first claim, atomically with the read-set check and the seq reservation.

        Conditions, all judged in the same step at the store's ``now``:
          1. slot: no record, or the record has ``observed_token`` and is a lapsed lease
             (takeover) or an expired result. Otherwise: moved, with the current record.
          2. read set: every ``(domain, seq)`` is at ``seq`` now (an absent domain is at the
             floor). Otherwise: stale, nothing written.
          3. reserve on ``domain``: with ``expected_seq`` one compare-exchange ``S -> S+1``
             (otherwise: race, nothing written); without, the next seq.
        Then an IN_FLIGHT record with a new token (:meth:`new_token`) and
        ``lease_until = now + lease_ttl`` is installed.
        """

    @abstractmethod
    def new_token(self) -> int:
        """A fencing token larger than every token this store has handed out."""

    @abstractmethod
    def complete(
        self,
        intent: str,
        token: int,
        cert: Any,
        until: float,
        *,
        read_set: Sequence[tuple[str, int]],
        own_seq: int | None,
    ) -> CommitResult:
        """IN_FLIGHT(token) -> DONE(cert, until), compare-by-token.

        The read set is re-validated in the same step; ``own_seq`` (set when the attempt was
        strict about its own domain) must still be the domain's current seq. If a dependency
        moved, the record becomes FAILED("read_set_stale") instead: the effect ran on a stale
        view and must be reconciled. On success the domain head takes the certificate.
        """

    @abstractmethod
    def fail(self, intent: str, token: int, reason: str) -> tuple[bool, IntentRecord | None]:
        """IN_FLIGHT(token) -> FAILED(reason, since=now), compare-by-token.

        Returns (done, record found): the record that was replaced, or the one that refused.
        """

    @abstractmethod
    def release(self, intent: str, token: int) -> tuple[bool, IntentRecord | None]:
        """IN_FLIGHT(token) -> ABSENT: compare-and-delete by token, never by key alone."""

    @abstractmethod
    def renew(
        self, intent: str, token: int, lease_until: float
    ) -> tuple[bool, IntentRecord | None]:
        """IN_FLIGHT(token) -> IN_FLIGHT(token, lease_until), compare-by-token."""

    @abstractmethod
    def clear(self, intent: str) -> IntentRecord | None:
        """Operator reconcile: any state -> ABSENT. Returns the record removed."""

    @abstractmethod
    def current(self, domain: str) -> int:
        """The domain's last reserved seq; an absent domain is at the floor. Never creates."""

    @abstractmethod
    def evict_domain(self, domain: str) -> int | None:
        """Forget a domain; refused (IntentInFlight) while an attempt is in flight on it.

        A later re-creation must start above every seq the domain ever handed out (G5).
        """

    @abstractmethod
    def in_flight(self, domain: str) -> int:
        """How many attempts are in flight on ``domain``."""

    @abstractmethod
    def sweep(self, limit: int | None = None, *, lapsed_grace: float = 0.0) -> int:
        """Reclaim expired results, and leases lapsed for more than ``lapsed_grace`` seconds,
        at O(expired) cost; returns how many.

        A lapsed lease nobody took over still belongs to its holder, who may commit: it is
        kept for the grace period, then reclaimed (its holder is presumed dead)."""

    @abstractmethod
    def size(self) -> dict[str, int]:
        """Records and domains held, for stats and for the bounded-memory tests."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections; the memory store has none."""
