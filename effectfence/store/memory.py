"""The in-process store: intent records in a dict, domain seqs in the counter table.

It decides nothing (the rules are in :mod:`effectfence.protocol`); it performs the steps
of :mod:`effectfence.store.base` atomically and reports what it found.

Concurrency design
------------------
- Records are immutable; a transition installs a new one. Readers (``get``, replay) take
  no lock and always see a whole record, and a claim's compare-and-set is an identity
  compare with the record the decider observed.
- Every transition of an intent runs under that intent's stripe lock (one of ``stripes``),
  so each step is atomic, and distinct intents rarely contend.
- Domain seqs live in the counter table (C11 atomics, or the pure twin): concurrent claims
  of different intents on one domain reserve without any lock between them.
- In-flight counts per domain live in one dict per stripe, changed only under that
  stripe's lock, so stripes never race on a shared ``+=``; eviction sums them.
- ``evict_domain`` is rare and stops the world: it takes every stripe (in order), so no
  claim, commit or compare can touch the domain while it goes. ``current`` is lock-free
  and uses a seqlock-style epoch to never return a value read across an eviction.
- Reclaiming: every record carries ``reclaim_at``, set by the decider when it is written.
  A timing wheel of buckets (``granularity`` seconds each) holds (intent, token) entries;
  appending is one GIL-atomic list append, a new bucket is pushed on a small heap. Sweep
  pops due buckets, so its cost is O(expired), and deletes an entry's record only if it
  still is the version that scheduled it and its ``reclaim_at`` has passed.
- Keeping pace (G8): :meth:`due` is one compare, so the fence can ask it on every prepare
  and reap a few due entries each time (more than an attempt schedules), keeping the held
  set near rate x ttl at any rate without a background thread.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from effectfence.clock import merge_head
from effectfence.counters import CounterTable, new_table
from effectfence.protocol import IntentRecord, State
from effectfence.store.base import (
    APPLIED,
    BUSY,
    EMPTY_HEAD,
    MOVED,
    RACE,
    STALE,
    FenceStore,
    Head,
    Step,
)
from effectfence.store.codec import entry_from_json, entry_to_json

__all__ = [
    "DEFAULT_AUDIT_KEEP",
    "DEFAULT_STRIPES",
    "DEFAULT_WHEEL_GRANULARITY",
    "MemoryStore",
]

_PROCESS_TOKENS = new_table()
_TOKEN_SLOT = _PROCESS_TOKENS.slot("")  # "" is never a valid domain
_IN_FLIGHT = State.IN_FLIGHT
_DONE = State.DONE
_FAILED = State.FAILED

DEFAULT_STRIPES = 64
DEFAULT_WHEEL_GRANULARITY = 0.25
#: operator clears the memory store remembers (the oldest go first); it lives as long as
#: the process, so its audit trail does too
DEFAULT_AUDIT_KEEP = 10_000


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
        audit_keep: int = DEFAULT_AUDIT_KEEP,
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
        # the first bucket that is not yet due, as a deadline: a one-compare "anything due?"
        self._next_due = math.inf
        # (bucket, position) of each due bucket a limited sweep stopped in: one each, as
        # limited sweeps run concurrently (every prepare runs one when entries are due); a
        # single slot lost the first bucket's rest when a second sweep stopped elsewhere
        self._partial: list[tuple[list[tuple[str, int]], int]] = []
        # the operator's audit trail: (id, at, entry JSON), bounded, appended under the
        # intent's stripe lock (with the delete) and then this lock
        self._audit: collections.deque[tuple[int, float, str]] = collections.deque(
            maxlen=audit_keep
        )
        self._audit_ids = itertools.count(1)
        self._audit_lock = threading.Lock()

    # -- helpers --------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    def fingerprint_of(self, payload: bytes) -> bytes:
        """The payload itself: comparing it costs less than hashing it, and replays compare."""
        return payload

    def _stripe(self, intent: str) -> int:
        return hash(intent) & self._mask

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

    def _schedule(self, deadline: float, intent: str, token: int) -> None:
        if deadline == math.inf:
            return  # kept until cleared: nothing to schedule
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
                        if not self._partial:
                            self._next_due = self._due[0] * self._g
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

    def _compare(self, pairs: Sequence[tuple[str, int]]) -> tuple[str, int, int | None] | None:
        for d, s in pairs:
            actual = self._at(d)
            if actual != s:
                return (d, s, actual)
        return None

    def due(self, now: float) -> bool:
        return now >= self._next_due

    # -- reads ----------------------------------------------------------------------------
    def get(self, intent: str) -> IntentRecord | None:
        return self._records.get(intent)

    def read(self, intent: str) -> tuple[IntentRecord | None, float]:
        return self._records.get(intent), self._clock()

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

    def size(self) -> dict[str, int]:
        return {
            "records": len(self._records),
            "domains": len(self._seqs),
            "heads": len(self._heads),
            "wheel_buckets": len(self._wheel),
        }

    def records(
        self, *, states: Sequence[State] = (), domain: str | None = None, limit: int = 1000
    ) -> Iterator[IntentRecord]:
        n = 0
        for rec in list(self._records.values()):
            if n >= limit:
                return
            if (not states or rec.state in states) and (domain is None or rec.domain == domain):
                n += 1
                yield rec

    # -- steps ----------------------------------------------------------------------------
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
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            # condition 1: the slot still holds the record the decider observed
            if cur is not expect:
                return Step(MOVED, found=cur)
            # condition 2: the compared pairs hold
            if compare:
                stale = self._compare(compare)
                if stale is not None:
                    return Step(STALE, found=cur, stale=stale)
            # condition 3: reserve (compare-exchange at reserve_at, fetch-add without)
            seqs = self._seqs
            if reserve_at is None:
                seq = seqs.reserve(domain)
            else:
                lost: int | None = None
                if seqs.find(domain) < 0:
                    floor = seqs.floor()
                    if reserve_at != floor:  # lose without creating the domain (G7)
                        lost = floor
                if lost is None:
                    got = seqs.advance_if(domain, reserve_at)
                    if got < 0:
                        lost = -got - 1
                    else:
                        seq = got
                if lost is not None:
                    return Step(RACE, found=cur, stale=(domain, reserve_at, lost))
            now = self._clock()
            token = self._tokens.reserve_slot(self._token_slot)
            lease_until = now + lease_ttl
            reclaim_at = now + reclaim_after
            rec = IntentRecord(
                intent,
                _IN_FLIGHT,
                token,
                fingerprint,
                domain,
                agent,
                lease_until,
                None,
                0.0,
                "",
                0.0,
                seq,
                reclaim_at,
            )
            self._records[intent] = rec
            # in-flight bookkeeping: a takeover replaces an in-flight record (same domain:
            # same payload), anything else adds one
            if cur is None or cur.state is not _IN_FLIGHT:
                counts = self._inflight[stripe]
                counts[domain] = counts.get(domain, 0) + 1
            elif cur.domain != domain:
                self._leave(stripe, cur.domain)
                self._enter(stripe, domain)
            head = self._heads.get(domain, EMPTY_HEAD)
        self._schedule(reclaim_at, intent, token)
        return Step(APPLIED, rec, cur, head)

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
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            if (
                cur is None
                or cur.state is not _IN_FLIGHT
                or cur.token != token
                or cur.fingerprint != fingerprint
            ):
                return Step(MOVED, found=cur)
            stale = self._compare(compare) if compare else None
            if stale is None and own_seq is not None:
                actual = self._at(cur.domain)
                if actual != own_seq:
                    stale = (cur.domain, own_seq, actual)
            now = self._clock()
            if stale is None:
                rec = IntentRecord(
                    intent,
                    _DONE,
                    token,
                    cur.fingerprint,
                    cur.domain,
                    cur.agent,
                    0.0,
                    cert,
                    now + result_ttl,
                    "",
                    0.0,
                    cur.seq,
                    now + reclaim_after,
                )
                with self._heads_lock:
                    old = self._heads.get(cur.domain, EMPTY_HEAD)
                    self._heads[cur.domain] = Head(
                        cert.hash, merge_head(old.clock, cert.vector_clock)
                    )
            else:
                rec = IntentRecord(
                    intent,
                    _FAILED,
                    token,
                    cur.fingerprint,
                    cur.domain,
                    cur.agent,
                    reason=stale_reason,
                    since=now,
                    seq=cur.seq,
                    reclaim_at=now + stale_reclaim_after,
                )
            self._records[intent] = rec
            counts = self._inflight[stripe]  # inline _leave: one attempt fewer in flight
            n = counts[cur.domain] - 1
            if n:
                counts[cur.domain] = n
            else:
                del counts[cur.domain]
        self._schedule(rec.reclaim_at, intent, token)
        if stale is not None:
            return Step(STALE, rec, cur, stale=stale)
        return Step(APPLIED, rec, cur)

    def _finish(self, intent: str, token: int, make: Callable[[IntentRecord], Any]) -> Step:
        """Compare-by-token: replace the in-flight record of ``token`` with ``make(cur)``
        (None deletes it)."""
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            if cur is None or cur.state is not _IN_FLIGHT or cur.token != token:
                return Step(MOVED, found=cur)
            new: IntentRecord | None = make(cur)
            if new is None:
                del self._records[intent]
            else:
                self._records[intent] = new
            if new is None or new.state is not _IN_FLIGHT:
                self._leave(stripe, cur.domain)
        if new is not None:
            self._schedule(new.reclaim_at, intent, token)
        return Step(APPLIED, new, cur)

    def fail(self, intent: str, token: int, reason: str, *, reclaim_after: float) -> Step:
        now = self._clock()
        return self._finish(
            intent,
            token,
            lambda cur: IntentRecord(
                intent,
                _FAILED,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                reason=reason,
                since=now,
                seq=cur.seq,
                reclaim_at=now + reclaim_after,
            ),
        )

    def release(self, intent: str, token: int) -> Step:
        return self._finish(intent, token, lambda cur: None)

    def renew(self, intent: str, token: int, *, lease_ttl: float, reclaim_after: float) -> Step:
        def renewed(cur: IntentRecord) -> IntentRecord:
            now = self._clock()
            return IntentRecord(
                intent,
                _IN_FLIGHT,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                lease_until=now + lease_ttl,
                seq=cur.seq,
                reclaim_at=now + reclaim_after,
            )

        return self._finish(intent, token, renewed)

    def clear(self, intent: str) -> IntentRecord | None:
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.pop(intent, None)
            if cur is not None and cur.state is _IN_FLIGHT:
                self._leave(stripe, cur.domain)
            return cur

    def clear_if(self, intent: str, *, expect: IntentRecord, entry: Mapping[str, Any]) -> Step:
        data = entry_to_json(entry)  # encoded (and checked) before any lock is taken
        stripe = hash(intent) & self._mask
        with self._locks[stripe]:
            cur = self._records.get(intent)
            # the condition: still the version the decider judged (identity: records are
            # immutable, every transition installs a new one)
            if cur is None or cur is not expect:
                return Step(MOVED, found=cur)
            del self._records[intent]
            if cur.state is _IN_FLIGHT:
                self._leave(stripe, cur.domain)
            with self._audit_lock:
                row = (next(self._audit_ids), self._clock(), data)
                self._audit.append(row)
        return Step(APPLIED, None, cur, entry=entry_from_json(row[2], row[0], row[1]))

    def audit(
        self, *, intent: str | None = None, after: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self._audit_lock:
            rows = list(self._audit)
        out = [entry_from_json(data, i, at) for i, at, data in rows if after is None or i > after]
        if intent is not None:
            out = [e for e in out if e.get("intent") == intent]
        n = max(0, int(limit))
        return out[:n] if after is not None else out[max(0, len(out) - n) :] if n else []

    def evict_domain(self, domain: str) -> Step:
        for lk in self._locks:
            lk.acquire()
        try:
            busy = self.in_flight(domain)
            if busy:
                return Step(BUSY, count=busy)
            self._epoch += 1
            try:
                value = self._seqs.evict(domain)
                with self._heads_lock:
                    self._heads.pop(domain, None)
            finally:
                self._epoch += 1
            return Step(APPLIED, value=value)
        finally:
            for lk in reversed(self._locks):
                lk.release()

    def sweep(self, limit: int | None = None) -> int:
        now = self._clock()
        reclaimed = 0
        visited = 0
        g = self._g
        while True:
            with self._wheel_lock:
                if self._partial:  # a bucket an earlier, limited sweep did not finish
                    bucket, start = self._partial.pop()
                elif not self._due or self._due[0] * g > now:
                    self._next_due = self._due[0] * g if self._due else math.inf
                    break
                else:
                    b = heapq.heappop(self._due)
                    bucket, start = self._wheel.pop(b, []), 0
                    self._next_due = self._due[0] * g if self._due else math.inf
            # every deadline in a popped bucket is <= its end <= now: all are due
            for i in range(start, len(bucket)):
                if limit is not None and visited >= limit:
                    with self._wheel_lock:  # keep the rest, O(1): resume here next time
                        self._partial.append((bucket, i))
                        self._next_due = now
                    return reclaimed
                intent, token = bucket[i]
                visited += 1
                stripe = hash(intent) & self._mask
                with self._locks[stripe]:
                    cur = self._records.get(intent)
                    # compare: still the version that scheduled this entry, and its
                    # deadline (set by the decider when it wrote it) has passed
                    if cur is None or cur.token != token or cur.reclaim_at > now:
                        continue
                    del self._records[intent]
                    if cur.state is _IN_FLIGHT:
                        self._leave(stripe, cur.domain)
                    reclaimed += 1
        return reclaimed
