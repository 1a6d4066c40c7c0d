"""The intent state machine of docs/design.md, as data. Sans-IO: no clocks, no stores, no threads.

Theory of operation
-------------------
Every intent is one small object with four states::

    ABSENT ──prepare──▶ IN_FLIGHT(token, lease_until) ──commit──▶ DONE(cert, until)
       ▲                   │  │                        ──abort───▶ FAILED(reason, since)
       └────release────────┘  └─(lease lapses)─ takeover ─▶ IN_FLIGHT(new token)

Rules, each enforced here and nowhere else:

1. Whatever a caller asks, the record is first *observed* at one instant ``now`` (judged by
   the store's clock) and classified into one of six rows (:class:`Row`). A lapsed lease and
   an expired result are rows of their own, so time is part of the state, not a side check.
2. What ``prepare`` may do is a lookup in :data:`PREPARE_TABLE`, keyed by the row and by
   whether the request's payload fingerprint equals the recorded one. There is no other path
   to a claim: an unknown key is a bug and raises.
3. What a ticket operation (commit, abort, release, renew) may do is a lookup in
   :data:`TICKET_TABLE`, keyed by the row and by whether the ticket's fencing token is the
   record's current token. Only the current token of an in-flight record passes. A token is
   never reused (tokens come from one monotonic source per store), so a superseded holder
   can never match again: that is the fencing of G2.
4. A refusal names the operation, the observed state and the tokens; the caller raises it
   before touching anything, so a refused operation leaves every record as it was.
5. The store then performs the chosen transition as one conditional step: a claim installs
   only if the record is still the one observed (compare-and-set), a ticket operation only
   if the record is still in flight under the ticket's token (compare-by-token). If the
   record moved between observation and step, the step changes nothing and reports what it
   found, and the driver observes again: decisions are never applied to a record they were
   not made on. Time only moves forward, so a row observed lapsed or expired stays so while
   the record is unchanged: the decision stays valid until the step.
6. What a claim and a commit must compare (read set, ``expected_seq``) is planned here
   (:func:`plan_claim`, :func:`plan_commit`); the store only compares the pairs it is given.
7. When a record may be reclaimed is decided here, when it is written
   (:func:`reclaim_after`): the store deletes records whose deadline has passed and
   judges nothing else (G8).
8. What an operator's clear may do is a lookup in :data:`CLEAR_TABLE`, keyed by the row:
   a record in flight under a live lease is cleared only when forced (its holder may be
   running the effect right now, and a retry admitted after the clear would run it twice).
   The store deletes only the record the decision was made on, and records who cleared it
   and why in the same step.
9. The fence's ``prepare``/``commit`` and every store call these functions; none of them
   keeps a copy. ``docs/design.md`` maps each guarantee to the function that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any

from effectfence.errors import (
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    LeaseLost,
    Refusal,
)

__all__ = [
    "CLEAR_TABLE",
    "PREPARE_TABLE",
    "TICKET_TABLE",
    "Action",
    "ClearVerdict",
    "IntentRecord",
    "Row",
    "State",
    "TicketVerdict",
    "decide_clear",
    "decide_prepare",
    "judge_ticket",
    "observe",
    "plan_claim",
    "plan_commit",
    "reclaim_after",
]


class State(Enum):
    """Stored states. The repr is the name, as in error messages."""

    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"

    def __repr__(self) -> str:
        return self.name

    # identity hash in C: these are table keys on the hot path, and Enum's hash is Python
    __hash__ = object.__hash__


class Row(Enum):
    """A record as seen at one instant: the rows of the docs/design.md state table."""

    ABSENT = "absent"
    IN_FLIGHT_LIVE = "in_flight"
    IN_FLIGHT_LAPSED = "in_flight_lapsed"
    DONE_LIVE = "done"
    DONE_EXPIRED = "done_expired"
    FAILED = "failed"

    def __repr__(self) -> str:
        return self.name

    # identity hash in C: these are table keys on the hot path, and Enum's hash is Python
    __hash__ = object.__hash__


class Action(Enum):
    CLAIM = "claim"  # install a new IN_FLIGHT record with a new token
    TAKEOVER = "takeover"  # replace a lapsed lease: new token, old ticket powerless
    REPLAY = "replay"  # hand back the recorded certificate
    REFUSE_IN_FLIGHT = "intent_in_flight"
    REFUSE_CONFLICT = "intent_conflict"
    REFUSE_FAILED = "intent_failed"

    def __repr__(self) -> str:
        return self.name

    # identity hash in C: these are table keys on the hot path, and Enum's hash is Python
    __hash__ = object.__hash__


class TicketVerdict(Enum):
    ALLOW = "allow"
    LEASE_LOST = "lease_lost"
    #: the ticket that committed asks again: a commit with the same result gets the same
    #: certificate (its first answer was lost in transit); anything else is lease_lost
    COMMITTED = "committed"

    def __repr__(self) -> str:
        return self.name

    # identity hash in C: these are table keys on the hot path, and Enum's hash is Python
    __hash__ = object.__hash__


class ClearVerdict(Enum):
    CLEAR = "clear"  # delete the observed record (and record who and why)
    NOTHING = "nothing"  # no record: nothing to clear, nothing recorded
    NEEDS_FORCE = "needs_force"  # in flight under a live lease: refused unless forced

    def __repr__(self) -> str:
        return self.name


class IntentRecord:
    """One stored version of an intent. Immutable: transitions install a new record."""

    __slots__ = (
        "agent",
        "cert",
        "domain",
        "fingerprint",
        "intent",
        "lease_until",
        "reason",
        "reclaim_at",
        "seq",
        "since",
        "state",
        "token",
        "until",
    )

    def __init__(
        self,
        intent: str,
        state: State,
        token: int,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_until: float = 0.0,
        cert: Any = None,
        until: float = 0.0,
        reason: str = "",
        since: float = 0.0,
        seq: int = 0,
        reclaim_at: float = math.inf,
    ) -> None:
        self.intent = intent
        self.state = state
        self.token = token
        self.fingerprint = fingerprint
        self.domain = domain
        self.agent = agent
        self.lease_until = lease_until
        self.cert = cert
        self.until = until
        self.reason = reason
        self.since = since
        #: the seq this attempt reserved on ``domain``
        self.seq = seq
        #: when a sweep may delete the record: set by the writer from :func:`reclaim_after`
        self.reclaim_at = reclaim_at

    def __repr__(self) -> str:
        return (
            f"IntentRecord(intent={self.intent!r}, state={self.state!r}, token={self.token}, "
            f"domain={self.domain!r}, agent={self.agent!r})"
        )


def observe(record: IntentRecord | None, now: float) -> Row:
    """Rule 1: classify a record at ``now``. Leases and results end *at* their deadline."""
    if record is None:
        return _ABSENT
    state = record.state
    if state is _S_IN_FLIGHT:
        return _IN_FLIGHT_LIVE if now < record.lease_until else _IN_FLIGHT_LAPSED
    if state is _S_DONE:
        return _DONE_LIVE if now < record.until else _DONE_EXPIRED
    return _FAILED


# Module-level aliases: an Enum class attribute costs a metaclass lookup on the hot path.
_S_IN_FLIGHT, _S_DONE = State.IN_FLIGHT, State.DONE
_ABSENT, _FAILED = Row.ABSENT, Row.FAILED
_IN_FLIGHT_LIVE, _IN_FLIGHT_LAPSED = Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LAPSED
_DONE_LIVE, _DONE_EXPIRED = Row.DONE_LIVE, Row.DONE_EXPIRED
_ALLOW = TicketVerdict.ALLOW
_ROW_VALUE: dict[Row, str] = {row: row.value for row in Row}


# Rule 2. Key: (row, payload equals the recorded payload). ABSENT and DONE_EXPIRED have no
# payload to compare, so both halves of their key lead to a claim. A different payload never
# replays and never executes (G4); FAILED stays fenced whatever the payload (G9).
PREPARE_TABLE: dict[tuple[Row, bool], Action] = {
    (Row.ABSENT, True): Action.CLAIM,
    (Row.ABSENT, False): Action.CLAIM,
    (Row.IN_FLIGHT_LIVE, True): Action.REFUSE_IN_FLIGHT,
    (Row.IN_FLIGHT_LIVE, False): Action.REFUSE_CONFLICT,
    (Row.IN_FLIGHT_LAPSED, True): Action.TAKEOVER,
    (Row.IN_FLIGHT_LAPSED, False): Action.REFUSE_CONFLICT,
    (Row.DONE_LIVE, True): Action.REPLAY,
    (Row.DONE_LIVE, False): Action.REFUSE_CONFLICT,
    (Row.DONE_EXPIRED, True): Action.CLAIM,
    (Row.DONE_EXPIRED, False): Action.CLAIM,
    (Row.FAILED, True): Action.REFUSE_FAILED,
    (Row.FAILED, False): Action.REFUSE_FAILED,
}

# Rule 3. Key: (row, the ticket's token is the record's token). Dead ends are written out.
TICKET_TABLE: dict[tuple[Row, bool], TicketVerdict] = {
    (Row.ABSENT, False): TicketVerdict.LEASE_LOST,
    (Row.IN_FLIGHT_LIVE, True): TicketVerdict.ALLOW,
    (Row.IN_FLIGHT_LIVE, False): TicketVerdict.LEASE_LOST,
    # Lapsed but not taken over: the token is still current, so the holder may finish.
    (Row.IN_FLIGHT_LAPSED, True): TicketVerdict.ALLOW,
    (Row.IN_FLIGHT_LAPSED, False): TicketVerdict.LEASE_LOST,
    # A finished record is never overwritten by a ticket, not even its own; its own ticket
    # may still learn its certificate (a commit retried with the same result, G3).
    (Row.DONE_LIVE, True): TicketVerdict.COMMITTED,
    (Row.DONE_LIVE, False): TicketVerdict.LEASE_LOST,
    (Row.DONE_EXPIRED, True): TicketVerdict.LEASE_LOST,
    (Row.DONE_EXPIRED, False): TicketVerdict.LEASE_LOST,
    (Row.FAILED, True): TicketVerdict.LEASE_LOST,
    (Row.FAILED, False): TicketVerdict.LEASE_LOST,
}


# Rule 8. Key: the row. Clearing is the operator's reconcile (G9): any record may go, but one
# whose holder may be running the effect right now only when the operator says so.
CLEAR_TABLE: dict[Row, ClearVerdict] = {
    Row.ABSENT: ClearVerdict.NOTHING,
    Row.IN_FLIGHT_LIVE: ClearVerdict.NEEDS_FORCE,
    Row.IN_FLIGHT_LAPSED: ClearVerdict.CLEAR,
    Row.DONE_LIVE: ClearVerdict.CLEAR,
    Row.DONE_EXPIRED: ClearVerdict.CLEAR,
    Row.FAILED: ClearVerdict.CLEAR,
}

_CLAIM = PREPARE_TABLE[Row.ABSENT, True]


def decide_prepare(
    record: IntentRecord | None, now: float, fingerprint: bytes
) -> tuple[Row, Action]:
    """Rule 2: what prepare may do with this record."""
    if record is None:
        return _ABSENT, _CLAIM
    row = observe(record, now)
    return row, PREPARE_TABLE[row, record.fingerprint == fingerprint]


def prepare_refusal(
    action: Action, row: Row, record: IntentRecord, now: float, intent: str
) -> Refusal:
    """Rule 4: the typed refusal for a refusing action, naming state and holder."""
    state = _ROW_VALUE[row]  # Enum.value is a Python descriptor: looked up once, here
    if action is Action.REFUSE_IN_FLIGHT:
        retry_after = max(0.0, record.lease_until - now)
        return IntentInFlight(
            f"can't prepare {intent!r}: state={state}, held by {record.agent!r} "
            f"(token {record.token}) for {retry_after:.3f}s more",
            intent=intent,
            state=state,
            token=record.token,
            holder=record.agent,
            retry_after=retry_after,
        )
    if action is Action.REFUSE_CONFLICT:
        return IntentConflict(
            f"can't prepare {intent!r}: state={state} with a different payload "
            "(tool, args or domain differ from the recorded attempt)",
            intent=intent,
            state=state,
            holder=record.agent,
        )
    if action is Action.REFUSE_FAILED:
        return IntentFailed(
            f"can't prepare {intent!r}: state={state} ({record.reason}); "
            "the outcome is unknown until an operator clears it",
            intent=intent,
            state=state,
            holder=record.agent,
            reason=record.reason,
            # relative: ``since`` is on the store's clock, meaningless to a caller
            failed_for=max(0.0, now - record.since),
        )
    raise AssertionError(f"{action!r} is not a refusal")


def decide_clear(
    record: IntentRecord | None, now: float, intent: str, *, force: bool
) -> tuple[Row, ClearVerdict, Refusal | None]:
    """Rule 8: may an operator clear this record? Returns (row, verdict, refusal to raise).

    NEEDS_FORCE with ``force`` becomes CLEAR; without it, the refusal names the holder,
    its token and how long its lease still runs."""
    row = observe(record, now)
    verdict = CLEAR_TABLE[row]
    if verdict is not ClearVerdict.NEEDS_FORCE:
        return row, verdict, None
    if force:
        return row, ClearVerdict.CLEAR, None
    assert record is not None
    left = max(0.0, record.lease_until - now)
    return (
        row,
        verdict,
        IntentInFlight(
            f"can't clear {intent!r}: state={row.value}, held by {record.agent!r} (token "
            f"{record.token}) for {left:.3f}s more; its holder may be running the effect now",
            intent=intent,
            state=row.value,
            token=record.token,
            holder=record.agent,
            retry_after=left,
            recover="wait for the holder to commit, abort or lapse (retry_after), or clear it "
            "anyway with force (effectfence intents clear INTENT --reason ... --force) once "
            "you know it is not running",
        ),
    )


def judge_ticket(
    op: str, record: IntentRecord | None, now: float, intent: str, token: int
) -> tuple[TicketVerdict, Refusal | None]:
    """Rule 3 (G2): may ``op`` proceed with ``token`` on ``record`` at ``now``?

    Returns (verdict, refusal): ALLOW with None; COMMITTED with the refusal to raise unless
    the caller is a commit retried with the same result (:func:`recommit`); LEASE_LOST with
    the refusal to raise.
    """
    row = observe(record, now)
    current = record is not None and record.token == token
    verdict = TICKET_TABLE[row, current]
    if verdict is _ALLOW:
        return verdict, None
    holder = None if record is None else record.agent
    if verdict is TicketVerdict.COMMITTED:
        assert record is not None
        # "with another result" only where one was given: an abort, release or renew of a
        # committed ticket was told so too (found by review)
        other = " with another result" if op == "commit" else ""
        return verdict, LeaseLost(
            f"can't {op} {intent!r}: state={row.value}, this ticket (token {token}) already "
            f"committed{other}; its certificate is in details.cert_hash",
            intent=intent,
            state=row.value,
            token=token,
            holder=holder,
            committed_by_this_ticket=True,
            cert_hash=getattr(record.cert, "hash", None),
        )
    if current:
        # this very ticket finished the intent (a retried abort whose first answer was lost):
        # "token N is not the current lease; current token N" contradicted itself (review)
        return verdict, LeaseLost(
            f"can't {op} {intent!r}: state={row.value}, this ticket (token {token}) already "
            f"finished it; its lease is over",
            intent=intent,
            state=row.value,
            token=token,
            holder=holder,
            finished_by_this_ticket=True,
        )
    held = "" if record is None else f"; current token {record.token}"
    return verdict, LeaseLost(
        f"can't {op} {intent!r}: state={row.value}, token {token} is not the current lease{held}",
        intent=intent,
        state=row.value,
        token=token,
        holder=holder,
    )


def recommit(record: IntentRecord, result_json: bytes) -> Any:
    """The COMMITTED row (G3): the ticket that committed commits again. The same result gets
    the recorded certificate (an answer lost in transit can be retried); None otherwise."""
    cert = record.cert
    if cert is not None and cert.result_json == result_json:
        return cert
    return None


def plan_claim(
    read_set: Sequence[tuple[str, int]], domain: str, expected_seq: int | None
) -> tuple[tuple[tuple[str, int], ...], int | None, tuple[str, int, int | None] | None]:
    """Rule 6 (G6): what a claim compares, as (compare, reserve_at, contradiction).

    ``compare``: read-set entries on other domains, each must be at its seq when the claim
    applies. ``reserve_at``: the seq the claim's own domain must be at, reserved by one
    compare-exchange (``expected_seq``, or a read-set entry on the claim's own domain, since
    other claims may reserve on it between a check and a separate fetch-add); None reserves
    the next seq. ``contradiction``: a read-set entry and ``expected_seq`` that name two
    different seqs for the own domain (both cannot hold): a stale read set, nothing to try.
    """
    if not read_set:
        return (), expected_seq, None
    own: int | None = None
    others = []
    for d, s in read_set:
        if d == domain:
            own = s
        else:
            others.append((d, s))
    if own is not None and expected_seq is not None and own != expected_seq:
        return tuple(others), None, (domain, own, expected_seq)
    return tuple(others), expected_seq if expected_seq is not None else own, None


def plan_commit(
    read_set: Sequence[tuple[str, int]], domain: str, seq: int, expected_seq: int | None
) -> tuple[tuple[tuple[str, int], ...], int | None]:
    """Rule 6 (G6): what a commit re-validates, as (compare, own_seq).

    Read-set entries on other domains must still hold. An attempt strict about its own
    domain (``expected_seq``, or a read-set entry on it) is judged against its own
    reservation: the domain must still be at the ticket's ``seq`` (the ticket itself moved
    it there), so another attempt that reserved on it meanwhile makes the commit stale.
    """
    strict = expected_seq is not None
    others: tuple[tuple[str, int], ...] = ()
    if read_set:
        strict = strict or any(d == domain for d, _ in read_set)
        others = tuple((d, s) for d, s in read_set if d != domain)
    return others, (seq if strict else None)


def reclaim_after(state: State, ttl: float, lapsed_grace: float) -> float:
    """Rule 7 (G8): seconds after a write at which a sweep may delete the record.

    A lease is kept ``lapsed_grace`` past its end (its holder may still commit while nobody
    took over); a result lives ``ttl`` (``result_ttl``); a failure stays until an operator
    clears it (G9), so it is never reclaimed by time.
    """
    if state is _S_IN_FLIGHT:
        return ttl + lapsed_grace
    if state is _S_DONE:
        return ttl
    return math.inf


# Edges that time and the ticket operations add to the prepare table, for the diagram.
_OTHER_EDGES = (
    (Row.IN_FLIGHT_LIVE, Row.DONE_LIVE, "commit (current token)"),
    (Row.IN_FLIGHT_LIVE, Row.FAILED, "abort, or commit on a stale read set"),
    (Row.IN_FLIGHT_LIVE, Row.ABSENT, "release (current token)"),
    (Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LIVE, "renew (current token)"),
    (Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LAPSED, "lease_ttl passes"),
    (Row.IN_FLIGHT_LAPSED, Row.DONE_LIVE, "commit (token still current)"),
    (Row.DONE_LIVE, Row.DONE_LIVE, "commit again (same ticket, same result) = same cert"),
    (Row.IN_FLIGHT_LAPSED, Row.ABSENT, "sweep, once lapsed_grace has passed"),
    (Row.DONE_LIVE, Row.DONE_EXPIRED, "result_ttl passes"),
    (Row.DONE_EXPIRED, Row.ABSENT, "sweep"),
    (Row.FAILED, Row.ABSENT, "clear, with a reason (operator)"),
)


def diagram() -> str:
    """The state table as a Mermaid diagram; the README's copy is checked against this."""
    lines = ["stateDiagram-v2"]
    seen: set[tuple[Row, Action]] = set()
    for (row, same), action in PREPARE_TABLE.items():
        if (row, action) in seen:
            continue  # both payload halves lead to the same action: one edge
        seen.add((row, action))
        both = PREPARE_TABLE[row, not same] is action
        payload = "" if both else (" (same payload)" if same else " (other payload)")
        target = Row.IN_FLIGHT_LIVE if action in (Action.CLAIM, Action.TAKEOVER) else row
        lines.append(f"    {row.value} --> {target.value}: prepare{payload} = {action.value}")
    for src, dst, label in _OTHER_EDGES:
        lines.append(f"    {src.value} --> {dst.value}: {label}")
    return "\n".join(lines)
