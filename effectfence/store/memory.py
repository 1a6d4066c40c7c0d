"""The in-process store: intent records in a dict, domain seqs in the counter table.

Concurrency design
------------------
- Records are immutable; a transition installs a new one. Readers (``get``, replay) take
  no lock and always see a whole record.
- Every transition of an intent runs under that intent's stripe lock (one of ``stripes``),
  so each contract operation is one atomic step, and distinct intents rarely contend.
- Domain seqs live in the counter table (C11 atomics, or the pure twin): concurrent claims
  of different intents on one domain reserve without any lock between them.
- In-flight counts per domain live in one dict per stripe, changed only under that
  stripe's lock, so stripes never race on a shared ``+=``; eviction sums them.
- ``evict_domain`` is rare and stops the world: it takes every stripe (in order), so no
  claim, commit or read-set check can touch the domain while it goes. ``current`` is
  lock-free and uses a seqlock-style epoch to never return a value read across an eviction.
- Expiry: a timing wheel of buckets (``granularity`` seconds each). Appending to a bucket
  is one GIL-atomic list append; a new bucket is pushed on a small heap under a lock. Sweep
  pops due buckets, so its cost is O(expired), and each entry is re-checked against the
  current record (its token), so a renewed lease or a replaced record is never reclaimed.
"""

from __future__ import annotations

import heapq
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from effectfence.counters import AtomicCounterTable, CounterTable, new_table
from effectfence.errors import IntentInFlight
from effectfence.protocol import IntentRecord, Row, State, observe
from effectfence.store.base import EMPTY_HEAD, ClaimResult, CommitResult, FenceStore, Head

__all__ = ["DEFAULT_STRIPES", "DEFAULT_WHEEL_GRANULARITY", "MemoryStore"]

_RECLAIMABLE = (Row.IN_FLIGHT_LAPSED, Row.DONE_EXPIRED)
_COMMITTED = CommitResult(True)
_PROCESS_TOKENS = new_table()
_TOKEN_SLOT = _PROCESS_TOKENS.slot("")  # "" is never a valid domain
_IN_FLIGHT = State.IN_FLIGHT
_DONE = State.DONE

DEFAULT_STRIPES = 64
DEFAULT_WHEEL_GRANULARITY = 0.25


class MemoryStore(FenceStore):
    """In-process store; the default. Judges leases by ``clock`` (monotonic by default)."""

    name = "memory"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        counters: CounterTable | None = None,
        stripes: int = DEFAULT_STRIPES,
        granularity: float = DEFAULT_WHEEL_GRANULARITY,
    ) -> None:
        if stripes < 1 or stripes & (stripes - 1):
            raise ValueError("stripes must be a power of two")
        if not granularity > 0:
            raise ValueError("granularity must be > 0")
        self._clock = clock
        self.ticket_scope = f"memory:{secrets.token_hex(16)}"
        self._seqs = counters if counters is not None else new_table()
        self.counters_backend = self._seqs.backend
        # fencing tokens: one monotonic counter for the whole process, so a ticket from one
        # store can never carry a token that is current in another
        self._tokens = _PROCESS_TOKENS
        self._token_slot = _TOKEN_SLOT
        self._records: dict[str, IntentRecord] = {}
        self._locks = [threading.Lock() for _ in range(stripes)]
        # attempts in flight per domain, one dict per stripe, each changed only under its
        # stripe's lock; evict_domain (holding every stripe) sums them
        self._inflight: list[dict[str, int]] = [{} for _ in range(stripes)]
        self._mask = stripes - 1
        self._heads: dict[str, Head] = {}
        self._heads_lock = threading.Lock()
        self._epoch = 0  # odd while an eviction is running
        self._g = granularity
        self._wheel: dict[int, list[tuple[str, int]]] = {}
        self._due: list[int] = []
        self._wheel_lock = threading.Lock()

    # -- helpers --------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    def fingerprint_of(self, payload: bytes) -> bytes:
        """The payload itself: comparing it costs less than hashing it, and replays compare."""
        return payload

    def _stripe(self, intent: str) -> int:
        return hash(intent) & self._mask

    def _lock(self, intent: str) -> threading.Lock:
        return self._locks[hash(intent) & self._mask]

    def _enter(self, stripe: int, domain: str) -> None:
        """One more attempt in flight on ``domain`` (caller holds the stripe's lock)."""
        counts = self._inflight[stripe]
        counts[domain] = counts.get(domain, 0) + 1

    def _leave(self, stripe: int, domain: str) -> None:
        """One attempt fewer in flight on ``domain`` (caller holds the stripe's lock)."""
        counts = self._inflight[stripe]
        n = counts[domain] - 1
        if n:
            counts[domain] = n
        else:
            del counts[domain]

    def new_token(self) -> int:
        return self._tokens.reserve_slot(self._token_slot)

    def _schedule(self, deadline: float, intent: str, token: int) -> None:
        b = math.ceil(deadline / self._g)
        entry = (intent, token)
        while True:
            bucket = self._wheel.get(b)
            if bucket is None:
                with self._wheel_lock:
                    bucket = self._wheel.get(b)
                    if bucket is None:
                        bucket = self._wheel[b] = []
                        heapq.heappush(self._due, b)
            bucket.append(entry)
            # A sweep may have taken this bucket between the lookup and the append (only if
            # the deadline is already due); then the entry went to a list nobody reads:
            # schedule it again, into a bucket the next sweep will see.
            if self._wheel.get(b) is bucket:
                return

    def _at(self, domain: str) -> int:
        """A domain's seq; an absent domain is at the floor, so eviction cannot bring back
        an old value (a read set taken before an eviction never matches after it)."""
        v = self._seqs.load(domain)
        return self._seqs.floor() if v is None else v

    def _stale(self, read_set: Sequence[tuple[str, int]]) -> tuple[str, int, int | None] | None:
        for d, s in read_set:
            actual = self._at(d)
            if actual != s:
                return (d, s, actual)
        return None

    def fast_path_parts(self) -> dict[str, Any] | None:
        """What the C fast path (``effectfence._speedups.FastPath``) works on: this store's
        own structures, under its own stripe locks, so the fast path is one more writer of
        them, never a copy. None when the counters are not the C table it calls directly."""
        seqs, tokens = self._seqs, self._tokens
        if AtomicCounterTable is None or not (
            type(seqs) is AtomicCounterTable and type(tokens) is AtomicCounterTable
        ):
            return None
        return {
            "records": self._records,
            "locks": self._locks,
            "inflight": self._inflight,
            "mask": self._mask,
            "heads": self._heads,
            "heads_lock": self._heads_lock,
            "wheel": self._wheel,
            "granularity": self._g,
            "store_schedule": self._schedule,
            "seq_slots": seqs._slots,  # type: ignore[attr-defined]
            "seqs_reserve": seqs.reserve,
            "clock": self._clock,
            "token_slot": self._token_slot,
            "IN_FLIGHT": State.IN_FLIGHT,
            "DONE": State.DONE,
            "EMPTY_HEAD": EMPTY_HEAD,
            "IntentRecord": IntentRecord,
            "Head": Head,
        }

    # -- contract ---------------------------------------------------------------------------
    def get(self, intent: str) -> IntentRecord | None:
        return self._records.get(intent)

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
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            now = self._clock()
            cur = self._records.get(intent)
            # condition 1: the slot is free, or still holds the lapsed / expired record we saw
            takeover = False
            if cur is not None:
                row = observe(cur, now)
                if cur.token != observed_token or row not in _RECLAIMABLE:
                    return ClaimResult(False, current=cur)
                takeover = row is Row.IN_FLIGHT_LAPSED
            # condition 2: the read set still holds. Entries on other domains are checked
            # here; an entry on the claim's own domain is checked BY the reservation below
            # (a compare-exchange), since other intents' claims hold other stripes and may
            # reserve on this domain between a check and a separate fetch-add.
            own: int | None = None
            if read_set:
                others = []
                for d, s in read_set:
                    if d == domain:
                        own = s
                    else:
                        others.append((d, s))
                stale = self._stale(others) if others else None
                if stale is None and own is not None and expected_seq not in (None, own):
                    stale = (domain, own, self._at(domain))  # both cannot hold at once
                if stale is not None:
                    return ClaimResult(False, stale=stale)
            # condition 3: reserve (compare-exchange with expected_seq or an own-domain
            # read-set entry, fetch-add without)
            strict = expected_seq if expected_seq is not None else own
            if strict is None:
                seq = self._seqs.reserve(domain)
            else:
                lost: int | None = None
                if self._seqs.find(domain) < 0:
                    floor = self._seqs.floor()
                    if strict != floor:  # lose without creating the domain (G7)
                        lost = floor
                if lost is None:
                    got = self._seqs.advance_if(domain, strict)
                    if got < 0:
                        lost = -got - 1
                    else:
                        seq = got
                if lost is not None:
                    if expected_seq is None:  # the read set's own entry moved
                        return ClaimResult(False, stale=(domain, strict, lost))
                    return ClaimResult(False, race=lost)
            token = self._tokens.reserve_slot(self._token_slot)
            lease_until = now + lease_ttl
            self._records[intent] = IntentRecord(
                intent, _IN_FLIGHT, token, fingerprint, domain, agent, lease_until
            )
            if not takeover:  # one more attempt in flight on the domain (inline _enter)
                counts = self._inflight[stripe]
                counts[domain] = counts.get(domain, 0) + 1
            elif cur is not None and cur.domain != domain:  # unreachable: same payload
                self._leave(stripe, cur.domain)
                self._enter(stripe, domain)
            head = self._heads.get(domain, EMPTY_HEAD)
        self._schedule(lease_until, intent, token)
        res = ClaimResult(True, seq, token, lease_until, head)
        res.takeover = takeover
        return res

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
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            if cur is None or cur.state is not _IN_FLIGHT or cur.token != token:
                return CommitResult(False, current=cur)
            stale = self._stale(read_set) if read_set else None
            if stale is None and own_seq is not None:
                actual = self._at(cur.domain)
                if actual != own_seq:
                    stale = (cur.domain, own_seq, actual)
            if stale is not None:
                self._records[intent] = IntentRecord(
                    intent,
                    State.FAILED,
                    token,
                    cur.fingerprint,
                    cur.domain,
                    cur.agent,
                    reason="read_set_stale",
                    since=self._clock(),
                )
                self._leave(stripe, cur.domain)
                return CommitResult(False, current=cur, stale=stale)
            self._records[intent] = IntentRecord(
                intent, _DONE, token, cur.fingerprint, cur.domain, cur.agent, 0.0, cert, until
            )
            counts = self._inflight[stripe]  # inline _leave: one attempt fewer in flight
            n = counts[cur.domain] - 1
            if n:
                counts[cur.domain] = n
            else:
                del counts[cur.domain]
            with self._heads_lock:
                old = self._heads.get(cur.domain, EMPTY_HEAD)
                clock = dict(old.clock)
                for a, n in cert.vector_clock.items():
                    if n > clock.get(a, 0):
                        clock[a] = n
                self._heads[cur.domain] = Head(cert.hash, clock)
        if until < math.inf:
            self._schedule(until, intent, token)
        return _COMMITTED

    def _finish(
        self, intent: str, token: int, new: IntentRecord | None
    ) -> tuple[bool, IntentRecord | None]:
        """Compare-by-token: replace an in-flight record of ``token`` with ``new``."""
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            if cur is None or cur.state is not _IN_FLIGHT or cur.token != token:
                return False, cur
            if new is None:
                del self._records[intent]
            else:
                self._records[intent] = new
            if new is None or new.state is not _IN_FLIGHT:
                self._leave(stripe, cur.domain)
            return True, cur

    def fail(self, intent: str, token: int, reason: str) -> tuple[bool, IntentRecord | None]:
        cur = self._records.get(intent)
        if cur is None:
            return False, None
        new = IntentRecord(
            intent,
            State.FAILED,
            token,
            cur.fingerprint,
            cur.domain,
            cur.agent,
            reason=reason,
            since=self._clock(),
        )
        return self._finish(intent, token, new)

    def release(self, intent: str, token: int) -> tuple[bool, IntentRecord | None]:
        return self._finish(intent, token, None)

    def renew(
        self, intent: str, token: int, lease_until: float
    ) -> tuple[bool, IntentRecord | None]:
        cur = self._records.get(intent)
        if cur is None:
            return False, None
        new = IntentRecord(
            intent,
            State.IN_FLIGHT,
            token,
            cur.fingerprint,
            cur.domain,
            cur.agent,
            lease_until=lease_until,
        )
        ok, found = self._finish(intent, token, new)
        if ok:
            self._schedule(lease_until, intent, token)
        return ok, found

    def clear(self, intent: str) -> IntentRecord | None:
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.pop(intent, None)
            if cur is not None and cur.state is _IN_FLIGHT:
                self._leave(stripe, cur.domain)
            return cur

    def current(self, domain: str) -> int:
        while True:
            e = self._epoch
            if e & 1:  # an eviction is running: wait for it rather than read across it
                with self._locks[0]:
                    pass
                continue
            v = self._at(domain)
            if self._epoch == e:
                return v

    def in_flight(self, domain: str) -> int:
        return sum(counts.get(domain, 0) for counts in self._inflight)

    def evict_domain(self, domain: str) -> int | None:
        for lk in self._locks:
            lk.acquire()
        try:
            busy = self.in_flight(domain)
            if busy:
                raise IntentInFlight(
                    f"can't evict domain {domain!r}: {busy} attempt(s) in flight on it",
                    state="in_flight",
                    domain=domain,
                    in_flight=busy,
                )
            self._epoch += 1
            try:
                value = self._seqs.evict(domain)
                with self._heads_lock:
                    self._heads.pop(domain, None)
            finally:
                self._epoch += 1
            return value
        finally:
            for lk in reversed(self._locks):
                lk.release()

    def sweep(self, limit: int | None = None, *, lapsed_grace: float = 0.0) -> int:
        now = self._clock()
        later: list[tuple[float, str, int]] = []
        reclaimed = 0
        visited = 0
        while True:
            with self._wheel_lock:
                if not self._due or self._due[0] * self._g > now:
                    break
                b = heapq.heappop(self._due)
                bucket = self._wheel.pop(b, [])
            # every deadline in bucket b is <= b * g <= now: all are due
            for i, (intent, token) in enumerate(bucket):
                if limit is not None and visited >= limit:
                    rest = bucket[i:]
                    with self._wheel_lock:
                        self._wheel.setdefault(b, []).extend(rest)
                        heapq.heappush(self._due, b)
                    for deadline, pending, tok in later:
                        self._schedule(deadline, pending, tok)
                    return reclaimed
                visited += 1
                stripe = hash(intent) & self._mask
                with self._locks[stripe]:
                    cur = self._records.get(intent)
                    if cur is None or cur.token != token:
                        continue
                    row = observe(cur, now)
                    if row is Row.IN_FLIGHT_LAPSED:
                        # its holder may still commit while nobody took over: keep it for
                        # the grace period, then reclaim (G8)
                        reclaim_at = cur.lease_until + lapsed_grace
                        if now < reclaim_at:
                            if reclaim_at < math.inf:
                                later.append((reclaim_at, intent, token))
                            continue
                        self._leave(stripe, cur.domain)
                    elif row is not Row.DONE_EXPIRED:
                        continue
                    del self._records[intent]
                    reclaimed += 1
        for deadline, intent, token in later:
            self._schedule(deadline, intent, token)
        return reclaimed

    def size(self) -> dict[str, int]:
        return {
            "records": len(self._records),
            "domains": len(self._seqs),
            "heads": len(self._heads),
            "wheel_buckets": len(self._wheel),
        }
