"""Linearizability of one intent under real OS threads.

The threads run with CPython's switch interval at one microsecond (``support.preemptive``),
so operations on one intent genuinely overlap: at the default 5 ms a thread would rarely
lose the GIL inside a fence call.

Each intent is an independent object, so its history stays small. Threads released by a
``threading.Barrier`` run prepare / commit / abort / release / clear on a few intents at
once; every operation records an invoke and a response timestamp from one shared monotonic
counter, and what it returned. For each intent, a search (Wing & Gong style: depth first,
only over operations that no pending operation must precede, memoised on the remaining set
and the model state) must find a sequential order consistent with real-time order ("a
responded before b was invoked" means a comes first) that the reference model accepts.

The reference model is DESIGN.md's state table for one intent with a frozen clock (leases
never lapse here: the takeover paths are covered by the stateful and chaos suites). Tokens
must grow along the order; a replay must return the hash that the commit in the order made.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from support import FakeClock, FenceFactory, Tick
from support import preemptive as switch_often

from effectfence import (
    EffectFence,
    EffectRequest,
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    LeaseLost,
    Replay,
)
from effectfence.model import PreparedEffect

# -- history and the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One completed operation: ``kind`` with ``arg``, returned ``result``, in [inv, resp]."""

    kind: str  # prepare | commit | abort | release | clear
    arg: Any  # prepare: payload index; ticket ops: token; clear: None
    result: tuple[Any, ...]
    inv: int
    resp: int


# state: (phase, token, payload, cert hash, highest token granted so far)
State = tuple[str, int, int, str, int]
ABSENT: State = ("absent", -1, -1, "", -1)


def step(state: State, op: Op) -> State | None:
    """The model's successor state if ``op`` could have returned ``op.result`` here."""
    phase, token, payload, h, top = state
    r = op.result
    if op.kind == "prepare":
        if phase == "absent":
            if r[0] == "fresh" and r[1] > top:
                return ("in_flight", r[1], op.arg, "", r[1])
            return None
        if payload != op.arg:
            want: tuple[Any, ...] = ("failed",) if phase == "failed" else ("conflict",)
        elif phase == "in_flight":
            want = ("in_flight",)
        elif phase == "done":
            want = ("replay", h)
        else:
            want = ("failed",)
        return state if r == want else None
    if op.kind == "clear":
        return (*ABSENT[:4], top) if r == (phase != "absent",) else None
    # ticket operations: only the current token of an in-flight record passes, except that
    # the ticket that committed may commit again (same result here) and gets the same cert
    if op.kind == "commit" and phase == "done" and token == op.arg:
        return state if r == ("ok", h) else None
    current = phase == "in_flight" and token == op.arg
    if not current:
        return state if r == ("lease_lost",) else None
    if r[0] != "ok":
        return None
    if op.kind == "commit":
        return ("done", token, payload, r[1], top)
    if op.kind == "abort":
        return ("failed", token, payload, "", top)
    if op.kind == "release":
        return (*ABSENT[:4], top)
    return None


def linearizable(history: list[Op], initial: State = ABSENT) -> bool:
    """Is there a total order, consistent with real time, that the model accepts?"""
    n = len(history)
    dead: set[tuple[frozenset[int], State]] = set()

    def search(remaining: frozenset[int], state: State) -> bool:
        if not remaining:
            return True
        key = (remaining, state)
        if key in dead:
            return False
        # an op may go next only if no other remaining op responded before it was invoked
        first_resp = min(history[i].resp for i in remaining)
        for i in remaining:
            if history[i].inv > first_resp:
                continue
            nxt = step(state, history[i])
            if nxt is not None and search(remaining - {i}, nxt):
                return True
        dead.add(key)
        return False

    return search(frozenset(range(n)), initial)


# -- the checker itself must be able to say no -----------------------------------------------


def test_checker_accepts_overlapping_valid_history() -> None:
    h = [
        Op("prepare", 0, ("in_flight",), 0, 5),  # overlaps the fresh one: may come after it
        Op("prepare", 0, ("fresh", 7), 1, 2),
        Op("commit", 7, ("ok", "h1"), 3, 6),
        Op("prepare", 0, ("replay", "h1"), 4, 8),
    ]
    assert linearizable(h)


@pytest.mark.parametrize(
    "history",
    [
        # two claims, one after the other, with nothing freeing the first: double execution
        [Op("prepare", 0, ("fresh", 1), 0, 1), Op("prepare", 0, ("fresh", 2), 2, 3)],
        # a replay that returned before the commit was even invoked
        [
            Op("prepare", 0, ("fresh", 1), 0, 1),
            Op("prepare", 0, ("replay", "h"), 2, 3),
            Op("commit", 1, ("ok", "h"), 4, 5),
        ],
        # a replay of some other certificate than the one committed
        [
            Op("prepare", 0, ("fresh", 1), 0, 1),
            Op("commit", 1, ("ok", "h"), 2, 3),
            Op("prepare", 0, ("replay", "other"), 4, 5),
        ],
        # an old token succeeded after a release and a new claim
        [
            Op("prepare", 0, ("fresh", 1), 0, 1),
            Op("release", 1, ("ok",), 2, 3),
            Op("prepare", 0, ("fresh", 2), 4, 5),
            Op("commit", 1, ("ok", "h"), 6, 7),
        ],
        # a token handed out twice
        [
            Op("prepare", 0, ("fresh", 3), 0, 1),
            Op("release", 3, ("ok",), 2, 3),
            Op("prepare", 0, ("fresh", 3), 4, 5),
        ],
        # a different payload replayed
        [
            Op("prepare", 0, ("fresh", 1), 0, 1),
            Op("commit", 1, ("ok", "h"), 2, 3),
            Op("prepare", 1, ("replay", "h"), 4, 5),
        ],
    ],
)
def test_checker_rejects_impossible_histories(history: list[Op]) -> None:
    assert not linearizable(history)


# -- real threads ----------------------------------------------------------------------------


def _encode(fn: Any) -> tuple[tuple[Any, ...], PreparedEffect | None]:
    try:
        adm = fn()
    except IntentInFlight:
        return ("in_flight",), None
    except IntentConflict:
        return ("conflict",), None
    except IntentFailed:
        return ("failed",), None
    if isinstance(adm, Replay):
        assert adm.cert.verify()
        return ("replay", adm.cert.hash), None
    return ("fresh", adm.ticket.token), adm.ticket


def _ticket_op(fence: EffectFence, kind: str, t: PreparedEffect) -> tuple[Any, ...]:
    try:
        if kind == "commit":
            return ("ok", fence.commit(t, {"by": t.agent}).hash)
        if kind == "abort":
            fence.abort(t, "unknown")
        else:
            fence.release(t)
    except LeaseLost:
        return ("lease_lost",)
    return ("ok",)


def run_round(
    fence: EffectFence, rng: random.Random, intents: list[str], per_intent: int
) -> dict[str, list[Op]]:
    """One barrier-released round; returns each intent's history."""
    tick = Tick()
    plans: list[tuple[str, list[str], int]] = []
    for intent in intents:
        for _ in range(per_intent):
            then = rng.choice(["commit", "commit", "abort", "release", "hold", "clear"])
            payload = 0 if rng.random() < 0.85 else 1
            plans.append((intent, [then, rng.choice(["commit", "release", "prepare"])], payload))
    histories: dict[str, list[Op]] = {i: [] for i in intents}
    lock = threading.Lock()
    barrier = threading.Barrier(len(plans))
    errors: list[BaseException] = []

    def record(intent: str, op: Op) -> None:
        with lock:
            histories[intent].append(op)

    def prepare(intent: str, payload: int, agent: str) -> PreparedEffect | None:
        request = EffectRequest(intent, "dom", "charge", {"payload": payload}, agent)
        inv = tick()
        result, ticket = _encode(lambda: fence.prepare(request))
        record(intent, Op("prepare", payload, result, inv, tick()))
        return ticket

    def worker(k: int) -> None:
        intent, (then, second), payload = plans[k]
        try:
            barrier.wait()
            ticket = prepare(intent, payload, f"agent-{k}")
            if then == "clear":
                inv = tick()
                cleared = fence.clear_intent(intent)
                record(intent, Op("clear", None, (cleared,), inv, tick()))
            elif ticket is not None and then != "hold":
                inv = tick()
                result = _ticket_op(fence, then, ticket)
                record(intent, Op(then, ticket.token, result, inv, tick()))
            if second == "prepare" or ticket is None:
                prepare(intent, payload, f"agent-{k}-again")
            else:  # a second ticket op with the same ticket: usually a late, powerless one
                inv = tick()
                result = _ticket_op(fence, second, ticket)
                record(intent, Op(second, ticket.token, result, inv, tick()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return histories


@pytest.fixture
def preemptive() -> Iterator[None]:
    with switch_often():
        yield


def test_concurrent_histories_are_linearizable(
    make_fence: FenceFactory, clock: FakeClock, preemptive: None
) -> None:
    rng = random.Random(20240917)
    rounds, checked, ops = 150, 0, 0
    for r in range(rounds):
        fence = make_fence(lease_ttl=1e6, result_ttl=1e6)
        intents = [f"charge:{r}:{k}" for k in range(3)]
        for intent, history in run_round(fence, rng, intents, per_intent=4).items():
            assert linearizable(history), (intent, sorted(history, key=lambda o: o.inv))
            checked += 1
            ops += len(history)
    assert checked == rounds * 3 and ops >= checked * 8


def test_concurrent_histories_pinned_to_one_moment(
    make_fence: FenceFactory, preemptive: None
) -> None:
    """Duplicates and clears of one intent all at once: still a single sequential story."""
    rng = random.Random(7)
    for _ in range(40):
        fence = make_fence(lease_ttl=1e6, result_ttl=1e6)
        (history,) = run_round(fence, rng, ["charge:hot"], per_intent=8).values()
        assert linearizable(history), sorted(history, key=lambda o: o.inv)
        fresh = [o for o in history if o.kind == "prepare" and o.result[0] == "fresh"]
        assert len({o.result[1] for o in fresh}) == len(fresh), "a token was granted twice"
