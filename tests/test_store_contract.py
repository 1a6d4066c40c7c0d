"""The store conformance suite: every step of ``effectfence.store.base``, on every store.

A store joins by adding one factory to ``support.STORES`` (a fresh, empty, isolated store on
the test's :class:`~support.FakeClock`); a store shared between processes also adds a
``support.REOPEN`` entry (another handle onto the same data, as a second process opens it).
Then it runs here, and in the guarantee suites (test_fence, test_chaos, test_stateful).

Three layers:

1. *Steps, directly*: each condition of each step, what it writes when it holds, and that
   it writes nothing when it does not (the answer names what it found).
2. *The state table through the fence*: every row of DESIGN.md for prepare and for each
   ticket operation, on this store.
3. *Concurrency through the fence*: real threads released together by a Barrier.

Time moves only through the injected clock. Expectations are written against
``store.now()``, never against the clock's reading, so a store whose clock is the clock
plus an offset (a server's clock) passes the same tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support import REOPEN, STORES, FakeClock, race

from effectfence import (
    EffectCert,
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    LeaseLost,
    Replay,
)
from effectfence.clock import HEAD_AGENTS_KEPT, MAX_HEAD_AGENTS
from effectfence.protocol import IntentRecord, State
from effectfence.store.base import APPLIED, BUSY, MOVED, RACE, STALE, FenceStore, Step

LEASE = 10.0
RECLAIM = 25.0
FP = b"payload-1"


@pytest.fixture
def store(store_kind: str, clock: FakeClock) -> Iterator[FenceStore]:
    s = STORES[store_kind](clock)
    yield s
    s.close()


def claim(
    store: FenceStore,
    intent: str = "i1",
    *,
    expect: IntentRecord | None = None,
    domain: str = "d",
    agent: str = "a",
    fingerprint: bytes = FP,
    lease_ttl: float = LEASE,
    reclaim_after: float = RECLAIM,
    compare: tuple[tuple[str, int], ...] = (),
    reserve_at: int | None = None,
) -> Step:
    return store.claim(
        intent,
        expect=expect,
        fingerprint=fingerprint,
        domain=domain,
        agent=agent,
        lease_ttl=lease_ttl,
        reclaim_after=reclaim_after,
        compare=compare,
        reserve_at=reserve_at,
    )


def held(store: FenceStore, intent: str = "i1", **kw: Any) -> IntentRecord:
    step = claim(store, intent, **kw)
    assert step.outcome is APPLIED, step
    assert step.record is not None
    return step.record


def cert_for(
    rec: IntentRecord, result: Any = "ok", clock: dict[str, int] | None = None
) -> EffectCert:
    return EffectCert(
        intent=rec.intent,
        parent=None,
        domain=rec.domain,
        seq=rec.seq,
        tool="charge",
        args={"cents": 1},
        result=result,
        vector_clock={rec.agent: 1} if clock is None else clock,
        read_set=[],
        agent=rec.agent,
    )


def complete(
    store: FenceStore,
    rec: IntentRecord,
    *,
    token: int | None = None,
    cert: EffectCert | None = None,
    result_ttl: float = 100.0,
    reclaim_after: float = 100.0,
    compare: tuple[tuple[str, int], ...] = (),
    own_seq: int | None = None,
    stale_reclaim_after: float = float("inf"),
    fingerprint: bytes | None = None,
) -> Step:
    return store.complete(
        rec.intent,
        rec.token if token is None else token,
        cert or cert_for(rec),
        fingerprint=rec.fingerprint if fingerprint is None else fingerprint,
        result_ttl=result_ttl,
        reclaim_after=reclaim_after,
        compare=compare,
        own_seq=own_seq,
        stale_reason="read_set_stale",
        stale_reclaim_after=stale_reclaim_after,
    )


def view(rec: IntentRecord | None) -> Any:
    """Everything a record says, comparable across stores (decoded anew or not)."""
    if rec is None:
        return None
    cert = None if rec.cert is None else rec.cert.hash
    return (
        rec.intent,
        rec.state,
        rec.token,
        bytes(rec.fingerprint),
        rec.domain,
        rec.agent,
        rec.lease_until,
        cert,
        rec.until,
        rec.reason,
        rec.since,
        rec.seq,
        rec.reclaim_at,
    )


def world(store: FenceStore, intents: tuple[str, ...], domains: tuple[str, ...]) -> Any:
    """What a step that did not apply must leave exactly as it was."""
    return (
        [view(store.get(i)) for i in intents],
        [store.current(d) for d in domains],
        [store.in_flight(d) for d in domains],
        store.size(),
    )


# -- reads ----------------------------------------------------------------------------------------


def test_empty_store_reads_create_nothing(store: FenceStore) -> None:
    before = store.size()
    assert store.get("nope") is None
    assert store.current("nope") == 0
    assert store.in_flight("nope") == 0
    assert list(store.records()) == []
    rec, now = store.read("nope")
    assert rec is None and now == store.now()
    assert store.size() == before
    assert store.current("nope") == 0


def test_read_returns_record_and_now(store: FenceStore, clock: FakeClock) -> None:
    rec = held(store)
    clock.advance(3.0)
    got, now = store.read("i1")
    assert view(got) == view(rec)
    assert now == store.now() == pytest.approx(rec.lease_until - LEASE + 3.0)


def test_now_follows_the_injected_clock(store: FenceStore, clock: FakeClock) -> None:
    t0 = store.now()
    clock.advance(7.5)
    assert store.now() == pytest.approx(t0 + 7.5)


def test_queries_on_a_used_store_create_nothing(store: FenceStore) -> None:
    held(store, "i1", domain="d")
    before = world(store, ("i1",), ("d",))
    for _ in range(3):
        store.get("other")
        store.current("other")
        store.in_flight("other")
        store.read("other")
        list(store.records(domain="other"))
    assert world(store, ("i1",), ("d",)) == before
    assert store.current("other") == 0


def test_records_lists_by_state_and_domain(store: FenceStore) -> None:
    a = held(store, "a", domain="d1")
    b = held(store, "b", domain="d1")
    c = held(store, "c", domain="d2")
    assert complete(store, b).ok
    assert store.fail("c", c.token, "boom", reclaim_after=float("inf")).ok
    assert {r.intent for r in store.records()} == {"a", "b", "c"}
    assert {r.intent for r in store.records(states=[State.IN_FLIGHT])} == {"a"}
    assert {r.intent for r in store.records(states=[State.DONE, State.FAILED])} == {"b", "c"}
    assert {r.intent for r in store.records(domain="d1")} == {"a", "b"}
    assert len(list(store.records(limit=2))) == 2
    # none at all: Redis appended the first match before it looked at the limit (review)
    assert list(store.records(limit=0)) == list(store.records(limit=-1)) == []
    (done,) = store.records(states=[State.DONE])
    assert done.cert is not None and done.cert.verify()
    assert view(store.get("a")) == view(a)


# -- claim ----------------------------------------------------------------------------------------


def test_claim_absent_installs_in_flight(store: FenceStore) -> None:
    now = store.now()
    step = claim(store, agent="alice")
    assert step.outcome is APPLIED and step.found is None
    rec = step.record
    assert rec is not None
    assert rec.state is State.IN_FLIGHT and rec.intent == "i1" and rec.agent == "alice"
    assert bytes(rec.fingerprint) == FP and rec.domain == "d"
    assert rec.lease_until == pytest.approx(now + LEASE)
    assert rec.reclaim_at == pytest.approx(now + RECLAIM)
    assert rec.seq == 1 and rec.token > 0
    assert step.head.hash is None and step.head.clock == {}
    assert view(store.get("i1")) == view(rec)
    assert store.current("d") == 1 and store.in_flight("d") == 1


def test_claim_reserves_next_seq_and_ever_larger_tokens(store: FenceStore) -> None:
    recs = [held(store, f"i{n}") for n in range(5)]
    assert [r.seq for r in recs] == [1, 2, 3, 4, 5]
    tokens = [r.token for r in recs]
    assert tokens == sorted(tokens) and len(set(tokens)) == 5
    assert store.in_flight("d") == 5


def test_claim_expect_none_on_existing_record_is_moved(store: FenceStore) -> None:
    rec = held(store)
    before = world(store, ("i1",), ("d",))
    step = claim(store, expect=None, agent="other")
    assert step.outcome is MOVED and step.record is None
    assert view(step.found) == view(rec)
    assert world(store, ("i1",), ("d",)) == before


def test_claim_expect_a_record_on_absent_is_moved(store: FenceStore) -> None:
    rec = held(store)
    assert store.release("i1", rec.token).ok
    before = world(store, ("i1",), ("d",))
    step = claim(store, expect=rec)
    assert step.outcome is MOVED and step.found is None
    assert world(store, ("i1",), ("d",)) == before


def test_claim_expect_an_older_version_is_moved(store: FenceStore, clock: FakeClock) -> None:
    old = held(store)
    clock.advance(1.0)
    new = store.renew("i1", old.token, lease_ttl=LEASE, reclaim_after=RECLAIM).record
    assert new is not None
    before = world(store, ("i1",), ("d",))
    step = claim(store, expect=old)  # the decider judged a version that is gone
    assert step.outcome is MOVED and view(step.found) == view(new)
    assert world(store, ("i1",), ("d",)) == before


def test_claim_takeover_replaces_the_observed_record(store: FenceStore, clock: FakeClock) -> None:
    old = held(store, agent="first")
    clock.advance(LEASE)
    seen = store.get("i1")
    step = claim(store, expect=seen, agent="second")
    assert step.outcome is APPLIED and view(step.found) == view(old)
    assert step.record is not None
    assert step.record.token > old.token and step.record.agent == "second"
    assert step.record.seq == old.seq + 1
    assert store.in_flight("d") == 1  # replaced, not added


def test_claim_over_done_and_failed_replaces_them(store: FenceStore) -> None:
    a = held(store, "a")
    b = held(store, "b")
    assert complete(store, a).ok
    assert store.fail("b", b.token, "x", reclaim_after=RECLAIM).ok
    for intent in ("a", "b"):
        seen = store.get(intent)
        step = claim(store, intent, expect=seen)
        assert step.outcome is APPLIED and view(step.found) == view(seen)
    assert store.in_flight("d") == 2


def test_claim_compare_stale_writes_nothing(store: FenceStore) -> None:
    held(store, "x", domain="other")  # other at 1
    before = world(store, ("i1",), ("d", "other", "ghost"))
    step = claim(store, compare=(("other", 0),))
    assert step.outcome is STALE and step.stale == ("other", 0, 1)
    assert world(store, ("i1",), ("d", "other", "ghost")) == before
    step = claim(store, compare=(("ghost", 3),))  # an absent domain is at the floor
    assert step.outcome is STALE and step.stale == ("ghost", 3, 0)
    assert world(store, ("i1",), ("d", "other", "ghost")) == before


def test_claim_compare_holds_then_applies(store: FenceStore) -> None:
    held(store, "x", domain="other")
    step = claim(store, compare=(("other", 1), ("ghost", 0)))
    assert step.outcome is APPLIED
    assert store.current("ghost") == 0


def test_claim_reserve_at_compare_exchange(store: FenceStore) -> None:
    step = claim(store, "a", reserve_at=0)  # absent domain is at the floor: wins
    assert step.outcome is APPLIED and step.record is not None and step.record.seq == 1
    before = world(store, ("a", "b"), ("d",))
    step = claim(store, "b", reserve_at=0)  # d is at 1 now
    assert step.outcome is RACE and step.stale == ("d", 0, 1)
    assert world(store, ("a", "b"), ("d",)) == before
    step = claim(store, "b", reserve_at=1)
    assert step.outcome is APPLIED and step.record is not None and step.record.seq == 2


def test_claim_lost_race_creates_no_domain(store: FenceStore) -> None:
    before = world(store, ("i1",), ("fresh",))
    step = claim(store, domain="fresh", reserve_at=5)
    assert step.outcome is RACE and step.stale == ("fresh", 5, 0)
    assert world(store, ("i1",), ("fresh",)) == before


def test_claim_head_is_the_last_commit_on_the_domain(store: FenceStore) -> None:
    a = held(store, "a", agent="x")
    c1 = cert_for(a, clock={"x": 1})
    assert complete(store, a, cert=c1).ok
    b = claim(store, "b", agent="y")
    assert b.head.hash == c1.hash and b.head.clock == {"x": 1}
    assert b.record is not None
    c2 = cert_for(b.record, clock={"y": 4})
    assert complete(store, b.record, cert=c2).ok
    step = claim(store, "c")
    assert step.head.hash == c2.hash and step.head.clock == {"x": 1, "y": 4}  # merged
    assert step.record is not None
    c3 = cert_for(step.record, clock={"x": 7, "y": 2, "z": 10**15})
    assert complete(store, step.record, cert=c3).ok
    after = claim(store, "d")  # element-wise maximum: larger counts win, smaller never do
    assert after.head.hash == c3.hash
    assert after.head.clock == {"x": 7, "y": 4, "z": 10**15}
    other = claim(store, "e", domain="elsewhere")
    assert other.head.hash is None and other.head.clock == {}


def test_a_head_clock_keeps_the_agents_with_the_most_events(store: FenceStore) -> None:
    """Every store bounds a domain's head clock the one way (clock.merge_head): unbounded,
    it grew by an entry for each agent name ever seen, and every claim read it. Past the
    bound it keeps HEAD_AGENTS_KEPT, so the next new agents cost no prune."""
    extra = 40
    # counts 1..K+extra, and ties at the kept set's edge decided by the smaller name
    # (code point order: "Z" < "a-" < "ag" < "é"); names of every width, some non-ASCII
    many = {f"agent-{i:05d}": i + 1 for i in range(MAX_HEAD_AGENTS + extra)}
    edge = MAX_HEAD_AGENTS + extra - HEAD_AGENTS_KEPT + 2  # KEPT - 2 agents count more
    ties = {"Z-tie": edge, "a-tie": edge, "é-tie": edge}  # and agent-{edge - 1} has edge too
    a = held(store, "a", agent="x")
    assert complete(store, a, cert=cert_for(a, clock={**many, **ties})).ok
    step = claim(store, "b")
    head = step.head.clock
    everyone = sorted({**many, **ties}.items(), key=lambda e: (-e[1], e[0]))
    assert head == dict(everyone[:HEAD_AGENTS_KEPT])
    assert len(head) == HEAD_AGENTS_KEPT and "agent-00000" not in head
    assert {"Z-tie", "a-tie"} <= head.keys()  # the edge's two places: the smaller names
    assert "é-tie" not in head and f"agent-{edge - 1:05d}" not in head
    # a later commit raising a left-out agent brings it back in, and prunes nothing
    b = step.record
    assert b is not None
    assert complete(store, b, cert=cert_for(b, clock={"agent-00000": 10**6})).ok
    after = claim(store, "c").head.clock
    assert after == {**head, "agent-00000": 10**6}


# -- complete -------------------------------------------------------------------------------------


def test_complete_applies_done_with_cert(store: FenceStore, clock: FakeClock) -> None:
    rec = held(store)
    clock.advance(2.0)
    now = store.now()
    cert = cert_for(rec, result={"charged": True})
    step = complete(store, rec, cert=cert, result_ttl=50.0, reclaim_after=60.0)
    assert step.outcome is APPLIED and view(step.found) == view(rec)
    done = store.get("i1")
    assert done is not None and view(done) == view(step.record)
    assert done.state is State.DONE and done.token == rec.token and done.seq == rec.seq
    assert done.until == pytest.approx(now + 50.0)
    assert done.reclaim_at == pytest.approx(now + 60.0)
    assert done.cert is not None and done.cert.hash == cert.hash and done.cert.verify()
    assert done.cert.result == {"charged": True}
    assert store.in_flight("d") == 0


@pytest.mark.parametrize("case", ["wrong_token", "wrong_payload", "absent", "done", "failed"])
def test_complete_is_compare_by_token(store: FenceStore, case: str) -> None:
    """The token and the payload fingerprint are the step's condition: the fence commits
    without reading first, so a ticket altered since admission must not apply."""
    rec = held(store)
    token = rec.token
    fingerprint = None
    if case == "wrong_payload":
        fingerprint = store.fingerprint_of(b"another payload")
    elif case == "wrong_token":
        token = rec.token + 1000
    elif case == "absent":
        assert store.release("i1", rec.token).ok
    elif case == "done":
        assert complete(store, rec).ok
    else:
        assert store.fail("i1", rec.token, "x", reclaim_after=RECLAIM).ok
    before = world(store, ("i1",), ("d",))
    found = store.get("i1")
    step = complete(
        store, rec, token=token, cert=cert_for(rec, result="again"), fingerprint=fingerprint
    )
    assert step.outcome is MOVED and step.record is None
    assert view(step.found) == view(found)
    assert world(store, ("i1",), ("d",)) == before


def test_complete_stale_read_set_fails_the_intent(store: FenceStore, clock: FakeClock) -> None:
    held(store, "x", domain="other")  # other at 1
    rec = held(store)
    clock.advance(1.0)
    now = store.now()
    step = complete(store, rec, compare=(("other", 0),), stale_reclaim_after=30.0)
    assert step.outcome is STALE and step.stale == ("other", 0, 1)
    failed = store.get("i1")
    assert failed is not None and view(failed) == view(step.record)
    assert failed.state is State.FAILED and failed.reason == "read_set_stale"
    assert failed.since == pytest.approx(now) and failed.token == rec.token
    assert failed.reclaim_at == pytest.approx(now + 30.0)
    assert store.in_flight("d") == 0
    assert claim(store, "y").head.hash is None  # no head from a failed commit


def test_complete_own_seq_judged_against_the_domain(store: FenceStore) -> None:
    rec = held(store, "a", reserve_at=0)  # d at 1
    held(store, "b")  # d at 2: a's own domain moved while it ran
    step = complete(store, rec, own_seq=rec.seq)
    assert step.outcome is STALE and step.stale == ("d", 1, 2)
    got = store.get("a")
    assert got is not None and got.state is State.FAILED


def test_complete_compare_holds(store: FenceStore) -> None:
    held(store, "x", domain="other")
    rec = held(store, reserve_at=0)
    step = complete(store, rec, compare=(("other", 1), ("ghost", 0)), own_seq=rec.seq)
    assert step.outcome is APPLIED
    assert store.current("ghost") == 0


# -- fail, release, renew, clear ------------------------------------------------------------------


def test_fail_writes_failed_compare_by_token(store: FenceStore, clock: FakeClock) -> None:
    rec = held(store)
    before = world(store, ("i1",), ("d",))
    assert store.fail("i1", rec.token + 7, "no", reclaim_after=RECLAIM).outcome is MOVED
    assert world(store, ("i1",), ("d",)) == before
    clock.advance(1.0)
    now = store.now()
    step = store.fail("i1", rec.token, "unknown outcome", reclaim_after=float("inf"))
    assert step.outcome is APPLIED and view(step.found) == view(rec)
    got = store.get("i1")
    assert got is not None and view(got) == view(step.record)
    assert got.state is State.FAILED and got.reason == "unknown outcome"
    assert got.since == pytest.approx(now) and got.reclaim_at == float("inf")
    assert store.in_flight("d") == 0
    assert store.fail("i1", rec.token, "again", reclaim_after=RECLAIM).outcome is MOVED


def test_release_deletes_only_its_own_token(store: FenceStore, clock: FakeClock) -> None:
    old = held(store)
    clock.advance(LEASE)
    new = held(store, expect=store.get("i1"))
    before = world(store, ("i1",), ("d",))
    step = store.release("i1", old.token)  # by key alone it would delete new's record
    assert step.outcome is MOVED and view(step.found) == view(new)
    assert world(store, ("i1",), ("d",)) == before
    step = store.release("i1", new.token)
    assert step.outcome is APPLIED and step.record is None and view(step.found) == view(new)
    assert store.get("i1") is None and store.in_flight("d") == 0
    assert store.release("i1", new.token).outcome is MOVED


def test_renew_extends_compare_by_token(store: FenceStore, clock: FakeClock) -> None:
    rec = held(store)
    clock.advance(4.0)
    now = store.now()
    step = store.renew("i1", rec.token, lease_ttl=20.0, reclaim_after=40.0)
    assert step.outcome is APPLIED and step.record is not None
    got = store.get("i1")
    assert got is not None and view(got) == view(step.record)
    assert got.lease_until == pytest.approx(now + 20.0)
    assert got.reclaim_at == pytest.approx(now + 40.0)
    assert got.token == rec.token and got.seq == rec.seq and got.state is State.IN_FLIGHT
    assert store.in_flight("d") == 1
    before = world(store, ("i1",), ("d",))
    assert store.renew("i1", rec.token + 1, lease_ttl=20.0, reclaim_after=40.0).outcome is MOVED
    assert world(store, ("i1",), ("d",)) == before
    assert complete(store, rec).ok
    assert store.renew("i1", rec.token, lease_ttl=20.0, reclaim_after=40.0).outcome is MOVED


def test_clear_removes_any_state(store: FenceStore) -> None:
    a, b, c = held(store, "a"), held(store, "b"), held(store, "c")
    assert complete(store, b).ok
    assert store.fail("c", c.token, "x", reclaim_after=RECLAIM).ok
    assert store.in_flight("d") == 1
    for intent, rec in (("a", a), ("b", b), ("c", c)):
        removed = store.clear(intent)
        assert removed is not None and removed.intent == intent and removed.token == rec.token
        assert store.get(intent) is None
    assert store.in_flight("d") == 0
    assert store.clear("a") is None
    assert store.current("d") == 3  # clearing records never rolls a seq back


def entry(intent: str, reason: str = "reconciled") -> dict[str, Any]:
    return {"action": "clear", "intent": intent, "who": "ops", "reason": reason, "forced": False}


@pytest.mark.parametrize("state", ["in_flight", "done", "failed"])
def test_clear_if_deletes_the_observed_record_and_records_why(
    store: FenceStore, clock: FakeClock, state: str
) -> None:
    rec = held(store, "a")
    if state == "done":
        assert complete(store, rec).ok
    elif state == "failed":
        assert store.fail("a", rec.token, "timeout", reclaim_after=RECLAIM).ok
    seen = store.get("a")
    assert seen is not None
    clock.advance(3.0)
    now = store.now()
    step = store.clear_if("a", expect=seen, entry=entry("a", "refunded by hand"))
    assert step.outcome is APPLIED, step
    assert step.found is not None and step.found.token == rec.token
    assert step.found.state is seen.state
    assert store.get("a") is None
    assert store.in_flight("d") == 0
    assert store.current("d") == rec.seq  # a clear never rolls a seq back
    got = step.entry
    assert got is not None
    assert got["reason"] == "refunded by hand" and got["who"] == "ops" and got["intent"] == "a"
    assert got["at"] == pytest.approx(now) and got["id"] >= 1
    assert store.audit(intent="a") == [got]


def test_clear_if_an_older_version_is_moved_and_records_nothing(
    store: FenceStore, clock: FakeClock
) -> None:
    rec = held(store, "a")
    # judged in flight; the holder renewed (another version) before the clear reached the store
    assert store.renew("a", rec.token, lease_ttl=20.0, reclaim_after=40.0).ok
    before = world(store, ("a",), ("d",))
    step = store.clear_if("a", expect=rec, entry=entry("a"))
    assert step.outcome is MOVED and step.found is not None and step.found.token == rec.token
    assert world(store, ("a",), ("d",)) == before
    assert store.audit() == []
    # judged, then cleared by someone else: absent is MOVED too, with nothing found
    now_rec = store.get("a")
    assert now_rec is not None and store.clear("a") is not None
    step = store.clear_if("a", expect=now_rec, entry=entry("a"))
    assert step.outcome is MOVED and step.found is None
    assert store.audit() == []


def test_audit_is_ordered_filtered_and_followable(store: FenceStore, clock: FakeClock) -> None:
    ids = []
    for n, intent in enumerate(("a", "b", "a", "c")):
        rec = held(store, intent)
        assert store.fail(intent, rec.token, "x", reclaim_after=RECLAIM).ok
        seen = store.get(intent)
        assert seen is not None
        clock.advance(1.0)
        step = store.clear_if(intent, expect=seen, entry=entry(intent, f"r{n}"))
        assert step.ok and step.entry is not None
        ids.append(step.entry["id"])
    assert ids == sorted(ids) and len(set(ids)) == 4
    everything = store.audit()
    assert [e["reason"] for e in everything] == ["r0", "r1", "r2", "r3"]
    assert [e["at"] for e in everything] == sorted(e["at"] for e in everything)
    assert [e["reason"] for e in store.audit(limit=2)] == ["r2", "r3"]  # the newest, in order
    assert [e["reason"] for e in store.audit(intent="a")] == ["r0", "r2"]
    assert [e["reason"] for e in store.audit(intent="a", limit=1)] == ["r2"]
    # a limit past what there is: all of it (one more than there was gave only the newest,
    # found by a docs trial of `intents show`)
    assert [e["reason"] for e in store.audit(intent="a", limit=3)] == ["r0", "r2"]
    assert [e["reason"] for e in store.audit(limit=5)] == ["r0", "r1", "r2", "r3"]
    assert [e["reason"] for e in store.audit(after=ids[1])] == ["r2", "r3"]
    assert [e["reason"] for e in store.audit(after=ids[0], limit=1)] == ["r1"]
    assert [e["reason"] for e in store.audit(intent="a", after=ids[0])] == ["r2"]
    assert store.audit(after=ids[-1]) == [] and store.audit(limit=0) == []
    # a read: asking changes nothing
    assert store.audit() == everything


def test_clear_if_races_one_winner(store: FenceStore) -> None:
    rec = held(store, "a")
    assert store.fail("a", rec.token, "x", reclaim_after=RECLAIM).ok
    seen = store.get("a")
    assert seen is not None
    steps = race(8, lambda i: store.clear_if("a", expect=seen, entry=entry("a", f"op{i}")))
    outcomes = [s.outcome for s in steps if isinstance(s, Step)]
    assert len(outcomes) == 8 and outcomes.count(APPLIED) == 1
    assert len(store.audit(intent="a")) == 1


# -- domains --------------------------------------------------------------------------------------


def test_evict_busy_while_in_flight(store: FenceStore) -> None:
    a = held(store, "a")
    held(store, "b")
    before = world(store, ("a", "b"), ("d",))
    step = store.evict_domain("d")
    assert step.outcome is BUSY and step.count == 2
    assert world(store, ("a", "b"), ("d",)) == before
    assert complete(store, a).ok
    assert store.evict_domain("d").outcome is BUSY
    assert store.clear("b") is not None
    step = store.evict_domain("d")
    assert step.outcome is APPLIED and step.value == 2


def test_evict_absent_domain(store: FenceStore) -> None:
    step = store.evict_domain("never")
    assert step.outcome is APPLIED and step.value is None
    assert store.current("never") == 0


def test_evict_never_reissues_a_seq(store: FenceStore) -> None:
    """G5: a re-created domain starts above every seq it (or any evicted one) handed out."""
    a = held(store, "a", domain="d")
    assert complete(store, a, cert=cert_for(a)).ok
    held_b = held(store, "b", domain="d")
    assert complete(store, held_b).ok  # d at 2
    for i in range(5):
        r = held(store, f"e{i}", domain="e")
        assert complete(store, r).ok  # e at 5
    assert store.evict_domain("e").value == 5
    assert store.evict_domain("d").value == 2
    floor = store.current("d")
    assert floor >= 5 and store.current("e") == floor and store.current("new") == floor
    again = held(store, "c", domain="d")
    assert again.seq > 5
    assert claim(store, "z").head.hash is None  # the head went with the domain
    # an old (domain, seq) pair never matches again: neither as a compare nor a reserve
    assert claim(store, "x", compare=(("e", 5),)).outcome is STALE
    assert claim(store, "x", domain="e", reserve_at=5).outcome is RACE
    assert claim(store, "x", domain="e", reserve_at=0).outcome is RACE


def test_evict_then_seqs_strictly_increase(store: FenceStore) -> None:
    seen: list[int] = []
    for round_ in range(4):
        for i in range(3):
            r = held(store, f"{round_}-{i}")
            seen.append(r.seq)
            assert complete(store, r).ok
        assert store.evict_domain("d").outcome is APPLIED
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


# -- sweep ----------------------------------------------------------------------------------------


def test_sweep_deletes_only_what_is_due(store: FenceStore, clock: FakeClock) -> None:
    lease = held(store, "lease", reclaim_after=10.0)
    done = held(store, "done", reclaim_after=100.0)
    assert complete(store, done, reclaim_after=20.0).ok
    failed = held(store, "failed", reclaim_after=100.0)
    assert store.fail("failed", failed.token, "x", reclaim_after=float("inf")).ok
    assert store.sweep() == 0
    clock.advance(9.9)
    assert store.sweep() == 0
    clock.advance(0.1)
    assert store.sweep() == 1
    assert store.get("lease") is None and store.in_flight("d") == 0
    clock.advance(10.0)
    assert store.sweep() == 1
    assert store.get("done") is None
    clock.advance(1e6)
    assert store.sweep() == 0
    assert store.get("failed") is not None  # a failure waits for an operator (G9)
    assert lease.token != done.token


def test_sweep_spares_a_record_rewritten_after_its_deadline_was_set(
    store: FenceStore, clock: FakeClock
) -> None:
    """Only the version that set ``reclaim_at`` may be deleted by it."""
    rec = held(store, "renewed", reclaim_after=10.0)
    old = held(store, "taken", reclaim_after=10.0)
    clock.advance(5.0)
    assert store.renew("renewed", rec.token, lease_ttl=LEASE, reclaim_after=100.0).ok
    clock.advance(5.0)  # old lease lapsed; taken over with a later deadline
    new = held(store, "taken", expect=store.get("taken"), reclaim_after=100.0)
    assert new.token != old.token
    assert store.sweep() == 0
    assert store.get("renewed") is not None and store.get("taken") is not None
    assert store.in_flight("d") == 2


def test_sweep_limit_and_resume(store: FenceStore, clock: FakeClock) -> None:
    for i in range(7):
        held(store, f"i{i}", reclaim_after=1.0)
    clock.advance(2.0)
    assert store.sweep(3) <= 3
    total = store.sweep(3)
    for _ in range(10):
        n = store.sweep(3)
        total += n
        if not n:
            break
    assert store.size()["records"] == 0
    assert store.in_flight("d") == 0


# -- shared stores: a second handle sees the same world -------------------------------------------


@pytest.fixture
def twin(store_kind: str, store: FenceStore, clock: FakeClock) -> Iterator[FenceStore]:
    if store_kind not in REOPEN:
        pytest.skip(f"{store_kind} is not shared between processes")
    other = REOPEN[store_kind](store, clock)
    yield other
    other.close()


def test_shared_handles_see_one_world(store: FenceStore, twin: FenceStore) -> None:
    assert store.shared and twin.shared
    assert store.ticket_scope == twin.ticket_scope != ""
    assert store.sealing_key() == twin.sealing_key()
    assert len(store.sealing_key()) >= 32
    a = held(store, "a")
    b = held(twin, "b")
    assert b.token > a.token and b.seq == a.seq + 1
    assert claim(twin, "a").outcome is MOVED
    assert complete(twin, a).ok
    got = store.get("a")
    assert got is not None and got.state is State.DONE
    assert store.now() == pytest.approx(twin.now())


def test_sealing_key_is_stable(store: FenceStore) -> None:
    k = store.sealing_key()
    assert isinstance(k, bytes) and len(k) >= 32 and store.sealing_key() == k


# -- certificates as an audit trail (stores that keep one) ----------------------------------------


def test_certs_in_seq_order(store: FenceStore) -> None:
    made = []
    for i in range(4):
        r = held(store, f"c{i}", domain="audit")
        c = cert_for(r, result=i)
        made.append(c)
        if i != 2:
            assert complete(store, r, cert=c).ok
        else:
            assert store.release(r.intent, r.token).ok
    try:
        got = list(store.certs("audit"))
    except NotImplementedError:
        pytest.skip(f"the {store.name} store keeps no audit trail")
    assert [c.hash for c in got] == [made[i].hash for i in (0, 1, 3)]
    assert all(c.verify() for c in got)
    assert [c.seq for c in store.certs("audit", after_seq=made[1].seq)] == [made[3].seq]
    assert len(list(store.certs("audit", limit=1))) == 1
    assert list(store.certs("none")) == []


# -- the state table, through the fence -----------------------------------------------------------


def _fence(store: FenceStore) -> EffectFence:
    return EffectFence(
        FenceConfig(lease_ttl=LEASE, result_ttl=100.0, auto_sweep=False), store=store
    )


def _req(agent: str = "a", cents: int = 1, intent: str = "x") -> EffectRequest:
    return EffectRequest(intent, "d", "charge", {"cents": cents}, agent)


ROWS = ["absent", "in_flight", "in_flight_lapsed", "done", "done_expired", "failed"]


def _into(fence: EffectFence, clock: FakeClock, row: str) -> Any:
    """Drive intent "x" into ``row``; returns the ticket that got it there (or None)."""
    if row == "absent":
        return None
    t = fence.prepare(_req()).ticket
    if row == "in_flight_lapsed":
        clock.advance(LEASE)
    elif row in ("done", "done_expired"):
        fence.commit(t, "r")
        if row == "done_expired":
            clock.advance(100.0)
    elif row == "failed":
        fence.abort(t, "unknown")
    return t


EXPECT_PREPARE = {
    "absent": "fresh",
    "in_flight": IntentInFlight,
    "in_flight_lapsed": "takeover",
    "done": "replay",
    "done_expired": "fresh",
    "failed": IntentFailed,
}


@pytest.mark.parametrize("row", ROWS)
def test_state_table_prepare(store: FenceStore, clock: FakeClock, row: str) -> None:
    fence = _fence(store)
    _into(fence, clock, row)
    want = EXPECT_PREPARE[row]
    if isinstance(want, type):
        before = world(store, ("x",), ("d",))
        with pytest.raises(want):
            fence.prepare(_req("b"))
        assert world(store, ("x",), ("d",)) == before
        if row != "failed":
            with pytest.raises(IntentConflict):
                fence.prepare(_req("b", cents=2))
        return
    adm = fence.prepare(_req("b"))
    if want == "replay":
        assert isinstance(adm, Replay) and adm.cert.verify()
        with pytest.raises(IntentConflict):
            fence.prepare(_req("b", cents=2))
    else:
        assert adm.fresh and adm.takeover == (want == "takeover")


@pytest.mark.parametrize("op", ["commit", "abort", "release", "renew"])
@pytest.mark.parametrize("row", ROWS)
def test_state_table_ticket_ops(store: FenceStore, clock: FakeClock, row: str, op: str) -> None:
    fence = _fence(store)
    if row == "absent":
        t = fence.prepare(_req()).ticket
        fence.release(t)
    else:
        t = _into(fence, clock, row)
    allowed = row in ("in_flight", "in_flight_lapsed")
    before = world(store, ("x",), ("d",))

    def go() -> Any:
        if op == "commit":
            return fence.commit(t, "other result")
        if op == "abort":
            return fence.abort(t, "why")
        if op == "release":
            return fence.release(t)
        return fence.renew(t)

    if allowed:
        go()
        return
    with pytest.raises(LeaseLost):
        go()
    assert world(store, ("x",), ("d",)) == before


@pytest.mark.parametrize("op", ["commit", "abort", "release", "renew"])
def test_old_token_after_takeover_is_powerless(
    store: FenceStore, clock: FakeClock, op: str
) -> None:
    fence = _fence(store)
    old = fence.prepare(_req("a")).ticket
    clock.advance(LEASE)
    new = fence.prepare(_req("b"))
    assert new.fresh and new.takeover and new.ticket.token > old.token
    before = world(store, ("x",), ("d",))
    with pytest.raises(LeaseLost):
        if op == "commit":
            fence.commit(old, "zombie")
        elif op == "abort":
            fence.abort(old, "zombie")
        elif op == "release":
            fence.release(old)
        else:
            fence.renew(old)
    assert world(store, ("x",), ("d",)) == before
    cert = fence.commit(new.ticket, "b")
    assert fence.prepare(_req("c")).cert.hash == cert.hash


# -- concurrency, through the fence ---------------------------------------------------------------


def test_threads_racing_one_intent_exactly_one_fresh(store: FenceStore) -> None:
    fence = _fence(store)
    n = 8
    for trial in range(10):
        intent = f"race-{trial}"

        def go(i: int, intent: str = intent) -> str:
            adm = fence.prepare(_req(f"t{i}", intent=intent))
            if adm.fresh:
                fence.commit(adm.ticket, i)
                return "fresh"
            return "replay"

        outcomes = race(n, go)
        assert outcomes.count("fresh") == 1, outcomes
        others = [o for o in outcomes if o != "fresh"]
        assert all(o == "replay" or isinstance(o, IntentInFlight) for o in others), outcomes


def test_threads_racing_one_expected_seq_exactly_one_wins(store: FenceStore) -> None:
    fence = _fence(store)
    n = 8
    for trial in range(5):
        at = store.current("d")

        def go(i: int, trial: int = trial, at: int = at) -> str:
            r = EffectRequest(f"occ-{trial}-{i}", "d", "charge", {"i": i}, "a", expected_seq=at)
            adm = fence.prepare(r)
            fence.commit(adm.ticket, i)
            return "won"

        outcomes = race(n, go)
        assert outcomes.count("won") == 1, outcomes
        assert store.current("d") == at + 1


def test_threads_distinct_intents_distinct_seqs(store: FenceStore) -> None:
    n = 16
    lock = threading.Lock()
    seqs: list[int] = []
    tokens: list[int] = []

    def go(i: int) -> None:
        rec = held(store, f"t{i}")
        with lock:
            seqs.append(rec.seq)
            tokens.append(rec.token)

    out = race(n, go)
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert sorted(seqs) == list(range(1, n + 1))
    assert len(set(tokens)) == n
    assert store.in_flight("d") == n
