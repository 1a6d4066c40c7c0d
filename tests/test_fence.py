"""The guarantees G1-G10 of docs/design.md, each with a test that fails when its guard goes.

Every test runs on every store in ``conftest.STORES`` (both counter tables included).
Collisions are forced with ``threading.Barrier``; time moves only through the fake clock.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from support import FakeClock, FenceFactory, race

from effectfence import (
    DomainRace,
    EffectCert,
    EffectFence,
    EffectRequest,
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    InvalidRequest,
    InvalidTicket,
    LeaseLost,
    ReadSetStale,
    Replay,
    VectorClock,
    verify_chain,
)
from effectfence.canonical import CanonicalError
from effectfence.cert import MAX_PAYLOAD_DEPTH
from effectfence.decorator import fenced
from effectfence.fence import FenceConfig
from effectfence.model import MAX_KNOWN_COUNTER, PreparedEffect

_T = TypeVar("_T")


def req(
    intent: str = "charge:order-1",
    domain: str = "order:1",
    args: dict[str, Any] | None = None,
    agent: str = "agent-a",
    **kw: Any,
) -> EffectRequest:
    return EffectRequest(
        intent, domain, "charge", {"cents": 500} if args is None else args, agent, **kw
    )


def fresh(fence: EffectFence, r: EffectRequest | None = None) -> PreparedEffect:
    adm = fence.prepare(r or req())
    assert adm.fresh, adm
    return adm.ticket


def snapshot(fence: EffectFence, intents: list[str], domains: list[str]) -> Any:
    """Everything a refused prepare must leave untouched."""
    recs = []
    for i in intents:
        r = fence.store.get(i)
        recs.append(None if r is None else (r.state, r.token, r.lease_until, r.fingerprint))
    return recs, [fence.current(d) for d in domains], fence.store.size()


# -- G1 exactly-once ----------------------------------------------------------------------------


def test_g1_sixteen_concurrent_duplicates_admit_exactly_one(fence: EffectFence) -> None:
    n = 16
    for trial in range(20):

        def attempt(i: int, trial: int = trial) -> str:
            return "fresh" if fence.prepare(req(intent=f"charge:{trial}")).fresh else "replay"

        outcomes = race(n, attempt)
        assert [o for o in outcomes if o == "fresh"] == ["fresh"], outcomes
        assert sum(isinstance(o, IntentInFlight) for o in outcomes) == n - 1


def test_g1_fresh_then_duplicates_replay(fence: EffectFence) -> None:
    t = fresh(fence)
    with pytest.raises(IntentInFlight) as ei:
        fence.prepare(req(agent="agent-b"))
    assert ei.value.holder == "agent-a" and ei.value.retry_after == pytest.approx(10.0)
    cert = fence.commit(t, {"charged": 500})
    for agent in ("agent-a", "agent-b", "agent-c"):
        adm = fence.prepare(req(agent=agent))
        assert isinstance(adm, Replay) and adm.cert.hash == cert.hash


def test_g1_record_retained_until_result_ttl(fence: EffectFence, clock: FakeClock) -> None:
    cert = fence.commit(fresh(fence), "ok")
    clock.advance(99.9)
    assert fence.prepare(req()).cert.hash == cert.hash
    clock.advance(0.2)  # past result_ttl: treated as absent, a new attempt may run
    assert fence.prepare(req()).fresh


# -- G2 fencing ---------------------------------------------------------------------------------


def test_g2_takeover_makes_old_ticket_powerless(fence: EffectFence, clock: FakeClock) -> None:
    old = fresh(fence)
    clock.advance(10.0)  # the lease ends at its deadline
    adm = fence.prepare(req(agent="agent-b"))
    assert adm.fresh and adm.takeover
    new = adm.ticket
    assert new.token > old.token
    for op in (
        lambda: fence.commit(old, "stale"),
        lambda: fence.abort(old, "stale"),
        lambda: fence.release(old),
        lambda: fence.renew(old),
    ):
        with pytest.raises(LeaseLost) as ei:
            op()
        assert ei.value.code == "lease_lost" and ei.value.token == old.token
    rec = fence.store.get(new.intent)
    assert rec is not None and rec.token == new.token and rec.agent == "agent-b"
    cert = fence.commit(new, "charged once")
    assert cert.agent == "agent-b" and fence.prepare(req()).cert.hash == cert.hash


def test_g2_lapsed_holder_may_finish_while_nobody_took_over(
    fence: EffectFence, clock: FakeClock
) -> None:
    t = fresh(fence)
    clock.advance(50.0)
    assert fence.commit(t, "late but current").verify()


def test_g2_commit_after_commit_never_overwrites(fence: EffectFence) -> None:
    t = fresh(fence)
    cert = fence.commit(t, "first")
    with pytest.raises(LeaseLost) as ei:
        fence.commit(t, "second")
    # a retried commit can tell its own success apart from a lost lease
    assert ei.value.details["committed_by_this_ticket"] is True
    assert ei.value.details["cert_hash"] == cert.hash
    assert fence.prepare(req()).cert.hash == cert.hash


def test_g2_renew_keeps_lease_alive(fence: EffectFence, clock: FakeClock) -> None:
    t = fresh(fence)
    clock.advance(8.0)
    fence.renew(t)
    clock.advance(8.0)  # 16 s after prepare, 8 s after renew: still live
    with pytest.raises(IntentInFlight):
        fence.prepare(req(agent="agent-b"))
    fence.commit(t, "ok")


# -- G3 replay ----------------------------------------------------------------------------------


def test_g3_replay_is_identical_and_verifies(fence: EffectFence) -> None:
    cert = fence.commit(fresh(fence), {"charge_id": "ch_1", "amount": 500})
    for _ in range(5):
        again = fence.prepare(req()).cert
        assert again.hash == cert.hash and again.to_dict() == cert.to_dict() and again.verify()


# -- G4 payload identity ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changed",
    [
        {"args": {"cents": 501}},
        {"domain": "order:2"},
    ],
)
def test_g4_changed_payload_conflicts_done(fence: EffectFence, changed: dict[str, Any]) -> None:
    fence.commit(fresh(fence), "ok")
    before = snapshot(fence, ["charge:order-1"], ["order:1", "order:2"])
    with pytest.raises(IntentConflict) as ei:
        fence.prepare(req(**changed))
    assert ei.value.code == "intent_conflict"
    assert snapshot(fence, ["charge:order-1"], ["order:1", "order:2"]) == before


def test_g4_changed_tool_conflicts_in_flight_and_lapsed(
    fence: EffectFence, clock: FakeClock
) -> None:
    fresh(fence)
    other = EffectRequest("charge:order-1", "order:1", "refund", {"cents": 500}, "agent-b")
    with pytest.raises(IntentConflict):
        fence.prepare(other)
    clock.advance(11.0)  # lapsed: a different payload must not take over either
    with pytest.raises(IntentConflict):
        fence.prepare(other)


def test_g4_key_order_does_not_matter(fence: EffectFence) -> None:
    fence.commit(fresh(fence, req(args={"a": 1, "b": [1, 2]})), "ok")
    assert not fence.prepare(req(args={"b": [1, 2], "a": 1})).fresh


# -- G5 sequences ---------------------------------------------------------------------------------


def test_g5_seqs_unique_increasing_across_intents(fence: EffectFence) -> None:
    seqs = [fresh(fence, req(intent=f"i{i}")).seq for i in range(50)]
    assert seqs == sorted(set(seqs)) and seqs == list(range(seqs[0], seqs[0] + 50))
    assert fence.current("order:1") == seqs[-1]


def test_g5_thirty_two_threads_distinct_intents_one_domain(fence: EffectFence) -> None:
    n = 32

    def go(i: int) -> list[int]:
        return [fresh(fence, req(intent=f"i{i}-{j}")).seq for j in range(20)]

    seqs = [s for out in race(n, go) for s in out]  # type: ignore[union-attr]
    assert len(seqs) == len(set(seqs)) == n * 20
    assert sorted(seqs) == list(range(min(seqs), min(seqs) + n * 20))  # gapless


def test_g5_evict_refused_in_flight_and_no_aba(fence: EffectFence) -> None:
    t = fresh(fence)
    with pytest.raises(IntentInFlight):
        fence.evict_domain("order:1")
    fence.commit(t, "ok")
    for i in range(3):
        fence.commit(fresh(fence, req(intent=f"more{i}")), "ok")
    last = fence.current("order:1")
    assert fence.evict_domain("order:1") == last
    # the evicted domain reads at the floor, never back at an old value or 0
    assert fence.current("order:1") > last
    with pytest.raises(DomainRace):  # an old (domain, seq) pair never matches again
        fence.prepare(req(intent="late", expected_seq=last))
    with pytest.raises(ReadSetStale):
        fence.prepare(req(intent="late2", read_set=[("order:1", last)]))
    t2 = fresh(fence, req(intent="after-evict"))
    assert t2.seq > last
    # and other, never-seen domains start above it too
    assert fresh(fence, req(intent="elsewhere", domain="order:9")).seq > last


# -- G6 strict OCC --------------------------------------------------------------------------------


def test_g6_expected_seq_race_exactly_one_winner(fence: EffectFence) -> None:
    n = 8
    for trial in range(100):
        domain = f"acct:{trial}"
        base = fence.current(domain)

        def go(i: int, domain: str = domain, base: int = base) -> int:
            return fresh(fence, req(intent=f"{domain}-{i}", domain=domain, expected_seq=base)).seq

        outcomes = race(n, go)
        wins = [o for o in outcomes if isinstance(o, int)]
        assert wins == [base + 1], (trial, outcomes)
        assert sum(isinstance(o, DomainRace) for o in outcomes) == n - 1


def test_g6_read_set_checked_at_prepare(fence: EffectFence) -> None:
    fence.commit(fresh(fence, req(intent="a", domain="inventory:9")), "ok")
    at = fence.current("inventory:9")
    before = snapshot(fence, ["b"], ["order:1", "inventory:9"])
    with pytest.raises(ReadSetStale) as ei:
        fence.prepare(req(intent="b", read_set=[("inventory:9", at - 1)]))
    assert ei.value.details["actual"] == at
    assert snapshot(fence, ["b"], ["order:1", "inventory:9"]) == before
    t = fresh(fence, req(intent="b", read_set=[("inventory:9", at)]))
    assert fence.commit(t, "ok").read_set == (("inventory:9", at),)


def test_g6_read_set_moving_during_effect_fails_commit(fence: EffectFence) -> None:
    at = fence.current("inventory:9")
    t = fresh(fence, req(read_set=[("inventory:9", at)]))
    fence.commit(fresh(fence, req(intent="other", domain="inventory:9")), "moved it")
    with pytest.raises(ReadSetStale) as first:
        fence.commit(t, "ran on a stale view")
    # the same commit again (a retry, or a server step whose reply was lost, which the
    # stores answer from the record found): the same refusal, never lease_lost
    with pytest.raises(ReadSetStale) as again:
        fence.commit(t, "ran on a stale view")
    assert again.value.details == first.value.details
    assert first.value.details["domain"] == "inventory:9"
    st = fence.intent_status("charge:order-1")
    assert st.state == "failed" and st.reason == "read_set_stale"
    with pytest.raises(IntentFailed):
        fence.prepare(req())


def test_a_nul_in_a_name_a_clock_agent_or_a_reason_is_refused_before_anything_runs(
    fence: EffectFence,
) -> None:
    """PostgreSQL's text and jsonb cannot hold U+0000: a clock agent with one made the
    commit fail with a raw driver error after the effect ran, the intent stayed in flight,
    and once its lease lapsed an identical call ran the effect again; an abort reason with
    one left the intent in flight too (found by review). Every store now refuses them the
    same way, typed, before anything is decided."""
    before = snapshot(fence, ["charge:order-1"], ["order:1"])
    for bad in (
        lambda: req(intent="x\x00"),
        lambda: req(domain="order:\x00"),
        lambda: req(agent="a\x00"),
        lambda: EffectRequest("charge:order-1", "order:1", "charge\x00", {}),
        lambda: req(known_clock={"ag\x00": 1}),
        lambda: req(read_set=[("inv\x00", 1)]),
    ):
        with pytest.raises(InvalidRequest, match="NUL"):
            fence.prepare(bad())
    assert snapshot(fence, ["charge:order-1"], ["order:1"]) == before
    for look in (
        lambda: fence.intent_status("x\x00"),
        lambda: fence.current("order:\x00"),
        lambda: fence.evict_domain("order:\x00"),
        lambda: fence.clear("x\x00", reason="r", who="ops"),
        lambda: fence.audit("x\x00"),
        lambda: fence.wait("x\x00", 0.0),
        lambda: fence.record("x\x00"),
    ):
        with pytest.raises(InvalidRequest, match="NUL"):
            look()
    t = fresh(fence)
    with pytest.raises(InvalidRequest, match="NUL"):
        fence.abort(t, "gateway said \x00")
    assert fence.intent_status("charge:order-1").state == "in_flight"
    fence.abort(t, "gateway said nothing")
    assert fence.intent_status("charge:order-1").state == "failed"


def test_wait_refuses_a_timeout_that_is_not_seconds(fence: EffectFence) -> None:
    """NaN returned False at once (every comparison with it fails) and a str raised a bare
    TypeError from inside the store (found by review): a typed refusal, nothing waited on."""
    t = fresh(fence)
    for bad in (math.nan, -1.0, "5", None, True, [1.0]):
        with pytest.raises(InvalidRequest, match="timeout"):
            fence.wait("charge:order-1", bad)  # type: ignore[arg-type]
    assert fence._waiters == {}
    assert fence.wait("charge:order-1", 0) is False and fence.wait("charge:order-1", 0.0) is False
    fence.commit(t, {"ok": True})
    assert fence.wait("charge:order-1", math.inf) is True


def test_g6_expected_seq_judged_against_own_reservation(fence: EffectFence) -> None:
    base = fence.current("order:1")
    t = fresh(fence, req(expected_seq=base))
    assert fence.commit(t, "ok").seq == base + 1  # its own move is not staleness
    t2 = fresh(fence, req(intent="x2", expected_seq=base + 1))
    fence.commit(fresh(fence, req(intent="x3")), "someone moved the domain")
    with pytest.raises(ReadSetStale) as first:
        fence.commit(t2, "late")
    with pytest.raises(ReadSetStale) as again:
        fence.commit(t2, "late")
    assert again.value.details == first.value.details
    assert (first.value.details["expected"], first.value.details["actual"]) == (base + 2, base + 3)


# -- G7 no trace --------------------------------------------------------------------------------


def test_g7_refused_prepares_change_nothing(fence: EffectFence) -> None:
    t = fresh(fence)
    domains = ["order:1", "order:2", "inventory:1"]
    intents = ["charge:order-1", "x", "y"]
    before = snapshot(fence, intents, domains)
    base = fence.current("order:2")
    attempts = [
        lambda: fence.prepare(req()),  # in flight
        lambda: fence.prepare(req(args={"cents": 1})),  # conflict
        lambda: fence.prepare(req(intent="x", domain="order:2", expected_seq=base + 5)),
        lambda: fence.prepare(req(intent="y", read_set=[("inventory:1", 7)])),
        lambda: fence.prepare(req(intent="x", args={"bad": math.nan})),
    ]
    for attempt in attempts:
        with pytest.raises(
            (IntentInFlight, IntentConflict, DomainRace, ReadSetStale, InvalidRequest)
        ):
            attempt()
        assert snapshot(fence, intents, domains) == before
    fence.commit(t, "ok")


def test_g7_release_is_compare_by_token(fence: EffectFence, clock: FakeClock) -> None:
    old = fresh(fence)
    clock.advance(10.0)
    new = fresh(fence, req(agent="agent-b"))
    with pytest.raises(LeaseLost):
        fence.release(old)
    rec = fence.store.get("charge:order-1")
    assert rec is not None and rec.token == new.token and rec.state.name == "IN_FLIGHT"
    fence.release(new)
    assert fence.store.get("charge:order-1") is None


# -- G8 bounded memory --------------------------------------------------------------------------


def test_g8_sweep_reclaims_only_expired(fence: EffectFence, clock: FakeClock) -> None:
    # lease 10 s, result 100 s; a lapsed lease nobody took over is kept for result_ttl
    for i in range(10):
        fence.commit(fresh(fence, req(intent=f"done{i}")), i)  # until t+100
    clock.advance(60.0)  # t+60
    live = [fresh(fence, req(intent=f"live{i}")) for i in range(3)]  # leases until t+70
    for i in range(5):
        fence.commit(fresh(fence, req(intent=f"young{i}")), i)  # until t+160
    clock.advance(45.0)  # t+105: done* expired; live* lapsed (not taken over)
    fence.renew(live[0])  # until t+115
    failed = fresh(fence, req(intent="failed"))
    fence.abort(failed, "unknown")
    assert fence.sweep() == 10  # only the expired results
    assert all(fence.store.get(f"young{i}") is not None for i in range(5))
    assert fence.commit(live[1], "slow but nobody took over").verify()  # still its own
    clock.advance(65.5)  # t+170.5: live2's lease lapsed 100.5 s ago, past the grace
    assert fence.sweep() == 5 + 1  # the young results, and the abandoned lease live2
    assert fence.store.get("live2") is None
    assert fence.store.get("live0") is not None  # renewed: lapsed only since t+115
    assert fence.intent_status("failed").state == "failed"  # G9: never reclaimed
    assert fence.sweep() == 0


@pytest.mark.parametrize("kind", ["memory-python", "memory-c"])
def test_g8_two_limited_sweeps_stopping_in_two_buckets_lose_neither(
    kind: str, clock: FakeClock
) -> None:
    """Every prepare runs a limited sweep when entries are due, so limited sweeps run
    concurrently. Each remembered the bucket it stopped in in one slot: the second to stop
    overwrote the first, whose bucket (already off the wheel) was never visited again, and
    its expired records were never reclaimed (found by review). Sweep A is held inside
    bucket 1 while sweep B stops inside bucket 2."""
    import threading

    from effectfence.store.cmemory import memory_store
    from effectfence.store.memory import MemoryStore

    store = MemoryStore(clock=clock) if kind == "memory-python" else memory_store(clock=clock)
    if kind == "memory-c" and type(store) is MemoryStore:
        pytest.skip("the C memory store is not built")
    cfg = FenceConfig(lease_ttl=5, result_ttl=10, lapsed_grace=0, auto_sweep=False)
    fence = EffectFence(cfg, store=store)

    def commit(intent: str) -> None:
        fence.commit(fresh(fence, EffectRequest(intent, "d", "t", {}, "a")), "ok")

    def stripe(intent: str) -> int:
        return hash(intent) & store._mask

    first = ["x1", "x2"]
    for intent in first:
        commit(intent)  # one bucket
    clock.advance(1.0)
    second = [n for n in (f"y{i}" for i in range(200)) if stripe(n) != stripe("x1")][:2]
    for intent in second:
        commit(intent)  # the next bucket
    clock.advance(6.5)
    assert fence.sweep() == 0  # the leases' entries: their records are done, spared
    clock.advance(100)  # every result has expired
    lock = store._locks[stripe("x1")]
    entered, go = threading.Event(), threading.Event()

    class Held:  # sweep A waits inside bucket 1, at x1's stripe
        def __enter__(self) -> None:
            if threading.current_thread().name == "A" and not go.is_set():
                entered.set()
                go.wait(10)
            lock.acquire()

        def __exit__(self, *exc: object) -> None:
            lock.release()

    store._locks[stripe("x1")] = Held()
    a = threading.Thread(target=fence.sweep, args=(1,), name="A")
    a.start()
    assert entered.wait(10)
    fence.sweep(1)  # B: takes bucket 2 and stops inside it
    go.set()
    a.join(10)
    store._locks[stripe("x1")] = lock
    while fence.sweep():
        pass
    assert [i for i in first + second if store.get(i) is not None] == []


def _locks_free_in_child(fence: EffectFence, out: Any) -> None:
    out.send((fence._sweep_lock.acquire(blocking=False), fence._waiters_lock.acquire(timeout=5)))


def test_a_fence_lock_a_parents_thread_held_at_a_fork_is_free_in_the_child() -> None:
    """The fence's sweep and waiter locks were plain locks: a fork while another thread
    held one left it held in the child for ever (auto-sweep skipped for good, a wait
    deadlocked; found by review)."""
    import multiprocessing
    import threading

    fence = EffectFence()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fence._sweep_lock, fence._waiters_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        ctx = multiprocessing.get_context("fork")
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=_locks_free_in_child, args=(fence, theirs))
        child.start()
        assert mine.poll(20), "the child did not answer"
        assert mine.recv() == (True, True)
        child.join(20)
    finally:
        release.set()
        holder.join(10)


def test_g8_queries_never_create_state(fence: EffectFence) -> None:
    size = fence.store.size()
    assert fence.intent_status("nothing:here").state == "absent"
    fence.current("no-such-domain")
    assert fence.store.size() == size


def test_g8_auto_sweep_bounds_memory(make_fence: FenceFactory, clock: FakeClock) -> None:
    fence = make_fence(lease_ttl=1.0, result_ttl=2.0, auto_sweep=True, sweep_interval=1.0)
    for i in range(2000):
        fence.commit(fresh(fence, req(intent=f"i{i}")), i)
        clock.advance(0.01)
    assert fence.store.size()["records"] <= 2.0 / 0.01 + 150
    assert fence.stats()["reclaimed"] > 1500


def test_g8_a_due_sweep_that_removes_what_the_claim_found_is_observed_again(
    make_fence: FenceFactory, clock: FakeClock
) -> None:
    """On a store that claims first (PostgreSQL, Redis), the sweep that fell due ran after
    the claim had found a lapsed record, and the decision was then made on that record
    although the sweep had just removed it: an intent_conflict where every other store,
    which sweeps before it reads, answered fresh (found by a differential run). The fence
    observes again after such a sweep, so every store answers alike."""
    fence = make_fence(lease_ttl=1.0, result_ttl=1.0, lapsed_grace=0, auto_sweep=True)
    fence.prepare(req(args={"cents": 1}))  # held, then abandoned: its holder died
    clock.advance(fence.config.sweep_interval + 5.0)  # past its reclaim, and a sweep is due
    adm = fence.prepare(req(args={"cents": 2}))  # other args: a conflict only while it lives
    assert adm.fresh
    assert fence.stats()["reclaimed"] == 1


# -- G9 unknown stays fenced ---------------------------------------------------------------------


def test_g9_abort_fences_until_cleared(fence: EffectFence, clock: FakeClock) -> None:
    fence.abort(fresh(fence), "timeout talking to the bank")
    clock.advance(10_000.0)
    with pytest.raises(IntentFailed) as ei:
        fence.prepare(req())
    assert ei.value.details["reason"] == "timeout talking to the bank"
    assert fence.sweep() == 0
    assert fence.clear_intent("charge:order-1")
    assert fence.prepare(req()).fresh


def test_g9_release_frees_for_retry(fence: EffectFence) -> None:
    t = fresh(fence)
    fence.release(t)
    t2 = fresh(fence)
    assert t2.token > t.token


# -- G10 tamper evidence ------------------------------------------------------------------------


def test_g10_any_field_change_is_detected(fence: EffectFence) -> None:
    cert = fence.commit(fresh(fence, req(read_set=[])), {"ok": True})
    base = cert.to_dict()
    changes = {
        "intent": "charge:order-2",
        "parent": "0" * 64,
        "domain": "order:2",
        "seq": base["seq"] + 1,
        "tool": "refund",
        "args": {"cents": 5000},
        "result": {"ok": False},
        "vector_clock": {"agent-a": 99},
        "read_set": [["x", 1]],
        "agent": "mallory",
        "hash": "f" * 64,
    }
    assert EffectCert.from_dict(base).verify()
    for field, value in changes.items():
        bad = copy.deepcopy(base)
        bad[field] = value
        assert not EffectCert.from_dict(bad).verify(), field
    # a certificate hands out copies: editing one changes nothing the fence replays
    args = cert.args
    args["cents"] = 1
    assert cert.args == {"cents": 500} and cert.verify()
    assert fence.prepare(req(read_set=[])).cert.verify()


# -- certificates, clocks, chains --------------------------------------------------------------


def test_certs_chain_per_domain_and_clocks_order(fence: EffectFence) -> None:
    certs = []
    for i, agent in enumerate(["a", "b", "a", "c"]):
        certs.append(fence.commit(fresh(fence, req(intent=f"step{i}", agent=agent)), i))
    assert certs[0].parent is None
    assert verify_chain(certs).ok
    clocks = [VectorClock(c.vector_clock) for c in certs]
    assert all(x.lt(y) for x, y in itertools.pairwise(clocks))
    broken = verify_chain([certs[0], certs[2]])
    assert not broken.ok and broken.broken_at == 1


def test_concurrent_tickets_on_one_domain_have_concurrent_clocks(fence: EffectFence) -> None:
    a = fresh(fence, req(intent="x", agent="a"))
    b = fresh(fence, req(intent="y", agent="b"))
    assert a.vector_clock.concurrent(b.vector_clock)
    ca = fence.commit(a, 1)
    c = fresh(fence, req(intent="z", agent="c"))
    assert VectorClock(ca.vector_clock).lt(c.vector_clock)


def test_known_clock_is_merged(fence: EffectFence) -> None:
    t = fresh(fence, req(known_clock={"planner": 4}))
    assert t.vector_clock == VectorClock({"planner": 4, "agent-a": 1})


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        {"x": math.nan},
        {"x": math.inf},
        {"x": -math.inf},
        {1: "non-string key"},
        {"x": b"bytes"},
        {"x": object()},
        {"x": {1, 2}},
        {"x": 2**60},
        {"x": "\ud800"},
    ],
)
def test_bad_args_refused_before_anything(fence: EffectFence, args: dict[Any, Any]) -> None:
    before = snapshot(fence, ["charge:order-1"], ["order:1"])
    with pytest.raises(InvalidRequest) as ei:
        fence.prepare(req(args=args))
    assert ei.value.code == "invalid_request"
    assert snapshot(fence, ["charge:order-1"], ["order:1"]) == before
    assert fence.stats()["prepare"]["invalid_request"] == 1


def test_oversized_and_deep_payloads_refused(make_fence: FenceFactory) -> None:
    fence = make_fence(max_args_bytes=1000, max_result_bytes=100, max_depth=8)
    with pytest.raises(InvalidRequest):
        fence.prepare(req(args={"blob": "x" * 2000}))
    deep: Any = 1
    for _ in range(20):
        deep = [deep]
    with pytest.raises(InvalidRequest):
        fence.prepare(req(args={"deep": deep}))
    t = fresh(fence)
    with pytest.raises(InvalidRequest) as too_big:
        fence.commit(t, "y" * 200)
    # the effect ran: the refusal must not read as "fix the call and run it again"
    assert "do NOT run it again" in too_big.value.recover
    with pytest.raises(InvalidRequest):
        fence.commit(t, {"x": math.nan})
    assert fence.intent_status(t.intent).state == "in_flight"  # nothing half-written
    fence.commit(t, "fits")


@pytest.mark.parametrize(
    "build",
    [
        lambda: EffectRequest("", "d", "t"),
        lambda: EffectRequest("i", "", "t"),
        lambda: EffectRequest("i", "d", ""),
        lambda: EffectRequest("i", "d", "t", [1, 2]),  # type: ignore[arg-type]
        lambda: EffectRequest("i", "d", "t", {}, "a", expected_seq=-1),
        lambda: EffectRequest("i", "d", "t", {}, "a", expected_seq=True),
        lambda: EffectRequest("i", "d", "t", {}, "a", read_set=[("d", "1")]),
        lambda: EffectRequest("i", "d", "t", {}, "a", read_set=[("d", 1), ("d", 2)]),
        lambda: EffectRequest("i", "d", "t", {}, "a", known_clock={"x": -1}),
        lambda: EffectRequest("i", "d", "t", {}, "a", known_clock={"x": 2**60}),
        lambda: EffectRequest("i" * 600, "d", "t"),
    ],
)
def test_malformed_requests_are_typed_errors(build: Any) -> None:
    with pytest.raises(InvalidRequest):
        build()


def test_forged_ticket_object_refused(fence: EffectFence) -> None:
    t = fresh(fence)
    forged = PreparedEffect.from_dict(
        {**t.to_dict(), "args": {"cents": 1}, "fingerprint": "x" * 64}
    )
    with pytest.raises(InvalidTicket):
        fence.commit(forged, "nope")
    with pytest.raises(InvalidTicket):
        fence.commit("not a ticket", "nope")  # type: ignore[arg-type]
    fence.commit(t, "ok")


# -- statistics ------------------------------------------------------------------------------------


def test_every_attempt_in_exactly_one_bucket(fence: EffectFence, clock: FakeClock) -> None:
    t = fresh(fence)
    for _ in range(3):
        with pytest.raises(IntentInFlight):
            fence.prepare(req())
    with pytest.raises(IntentConflict):
        fence.prepare(req(args={"cents": 2}))
    fence.commit(t, "ok")
    fence.prepare(req())
    with pytest.raises(DomainRace):
        fence.prepare(req(intent="r", expected_seq=0 if fence.current("order:1") else 5))
    s = fence.stats()
    p = s["prepare"]
    assert p["admitted"] == 1 and p["replayed"] == 1 and p["intent_in_flight"] == 3
    assert p["intent_conflict"] == 1 and p["domain_race"] == 1
    assert s["attempts"] == 7 and s["commits"] == 1


def test_failed_refusal_says_how_long_ago_not_a_clock_reading(
    fence: EffectFence, clock: FakeClock
) -> None:
    fence.abort(fresh(fence), "unknown")
    clock.advance(42.0)
    with pytest.raises(IntentFailed) as ei:
        fence.prepare(req())
    assert ei.value.details["failed_for"] == pytest.approx(42.0)
    assert "since" not in ei.value.details


# -- review 2: integral floats past 2**53, the depth certificates hold, clock poisoning ------------


@pytest.mark.parametrize("x", [2.0**53, 1e17, 1.7e18, -1.7e18, 2.0**64, 1e20])
def test_a_result_holding_an_integral_float_past_2_53_commits_and_replays(
    fence: EffectFence, x: float
) -> None:
    """Bug 1 (G3): RFC 8785 writes 1.7e18 as ``1700000000000000000``; decoded as an int it
    made a memory certificate fail verify(), and a durable store's commit raise an untyped
    CanonicalError after the effect ran (the intent stayed in flight: a second run later)."""
    cert = fence.commit(fresh(fence), {"ts_ns": x})
    assert cert.verify() and cert.result == {"ts_ns": x}
    replay = fence.prepare(req())
    assert isinstance(replay, Replay)
    assert replay.cert.hash == cert.hash and replay.cert.verify() and replay.cert == cert
    assert replay.result == {"ts_ns": x} and type(replay.result["ts_ns"]) is float


def test_args_holding_an_integral_float_past_2_53_prepare_commit_and_replay(
    fence: EffectFence,
) -> None:
    r = req(args={"amount": 1e17})
    cert = fence.commit(fresh(fence, r), {"ok": True})
    assert cert.verify() and cert.args == {"amount": 1e17}
    replay = fence.prepare(req(args={"amount": 1e17}))
    assert isinstance(replay, Replay) and replay.cert == cert and replay.cert.verify()


def test_a_fenced_effect_returning_a_big_integral_float_runs_once(
    fence: EffectFence, clock: FakeClock
) -> None:
    """The reviewer's double fire: the commit failed, the lease lapsed, the effect ran again."""
    runs: list[int] = []

    @fenced(fence, intent="charge:{order}", domain="order:{order}")
    def charge(order: int) -> dict[str, float]:
        runs.append(order)
        return {"provider_ts_ns": 1.7e18}

    assert charge(777) == {"provider_ts_ns": 1.7e18}
    clock.advance(60.0)  # past the lease
    assert charge(777) == {"provider_ts_ns": 1.7e18}
    assert runs == [777]


def test_max_depth_is_bounded_by_what_a_certificate_holds(make_fence: FenceFactory) -> None:
    """Bug 1: max_depth had no bound, but certificates re-encoded at depth 64: deeper args
    were admitted, ran, and their certificate failed verify() or could not be stored."""
    with pytest.raises(ValueError, match="max_depth"):
        FenceConfig(max_depth=MAX_PAYLOAD_DEPTH + 1)
    fence = make_fence(max_depth=MAX_PAYLOAD_DEPTH)
    deep: Any = 1
    for _ in range(100):  # deeper than the old re-encoding depth, well within the stack
        deep = [deep]
    cert = fence.commit(fresh(fence, req(args={"deep": deep})), {"deep": deep})
    assert cert.verify() and cert.args == {"deep": deep}
    replay = fence.prepare(req(args={"deep": deep}))
    assert isinstance(replay, Replay) and replay.cert == cert and replay.cert.verify()


def _nest(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


def _from_deep_down(frames_left: int, fn: Callable[[], _T]) -> _T:
    """``fn()`` called with only ``frames_left`` frames of the interpreter's stack to spare."""

    def down(k: int) -> _T:
        return fn() if k <= 0 else down(k - 1)

    here = len(inspect.stack(0))
    return down(sys.getrecursionlimit() - here - frames_left)


def test_the_deepest_payload_admitted_commits_verifies_and_replays_from_any_stack(
    make_fence: FenceFactory,
) -> None:
    """Past the compiled encoder's depth the Python encoder recurses, so whether a payload
    encoded hung on how deep the caller's stack was: args admitted at prepare got a
    certificate that failed verify(), a commit SQLite could not record after the effect
    ran, or a replay refused from deeper down (found by review, at max_depth 512). Now a
    payload is encoded on a fresh stack when the caller's cannot hold it, and the bound is
    one every re-encoding of the certificate takes."""
    fence = make_fence(max_depth=MAX_PAYLOAD_DEPTH)
    with pytest.raises(InvalidRequest, match="nesting"):
        fence.prepare(req(args={"deep": _nest(MAX_PAYLOAD_DEPTH)}))
    deep = _nest(MAX_PAYLOAD_DEPTH - 1)  # the deepest admitted: args themselves are a level
    ticket = _from_deep_down(200, lambda: fresh(fence, req(args={"deep": deep})))
    cert = _from_deep_down(200, lambda: fence.commit(ticket, {"deep": deep}))
    assert cert.verify() and cert.args == {"deep": deep}
    replay = _from_deep_down(200, lambda: fence.prepare(req(args={"deep": deep})))
    assert isinstance(replay, Replay) and replay.cert == cert and replay.cert.verify()
    again = fence.prepare(req(args={"deep": deep}))  # and from a shallow stack
    assert isinstance(again, Replay) and again.cert == cert


def test_a_certificate_the_store_cannot_encode_is_a_typed_refusal(
    fence: EffectFence, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug 1 backstop: a CanonicalError from the store's step (its cert_to_json) escaped
    commit untyped; as InvalidRequest, a driver aborts ("result not recordable")."""
    t = fresh(fence)

    def unencodable(*args: Any, **kw: Any) -> Any:
        raise CanonicalError("$.result", "this store cannot encode it")

    monkeypatch.setattr(fence.store, "complete", unencodable)
    with pytest.raises(InvalidRequest, match="could not be recorded") as ei:
        fence.commit(t, {"ok": True})
    assert ei.value.code == "invalid_request"
    monkeypatch.undo()
    assert fence.intent_status(t.intent).state == "in_flight"  # nothing half-written
    fence.abort(t, "result not recordable")
    assert fence.intent_status(t.intent).state == "failed"  # fenced, never re-run (G9)


def test_a_known_clock_cannot_lock_another_agent_out_of_a_domain(fence: EffectFence) -> None:
    """Bug 2 (G7): mallory named alice at 2**53-1 in her known_clock; the domain's head then
    carried it, and every later prepare by alice there reserved a seq and was refused."""
    domains = ["acct:1"]
    before = snapshot(fence, ["m:1"], domains)
    with pytest.raises(InvalidRequest, match="known_clock"):
        fence.request("m:1", "acct:1", "t", {}, "mallory", known_clock={"alice": 2**53 - 1})
    assert snapshot(fence, ["m:1"], domains) == before, "a refused prepare changes no state"
    assert fence.stats()["prepare"]["invalid_request"] == 1
    # at the bound, mallory's effect is admitted, and alice keeps room for 2**52 commits
    edge = {"alice": MAX_KNOWN_COUNTER, "bob": MAX_KNOWN_COUNTER}
    fence.commit(fresh(fence, req("m:2", "acct:1", agent="mallory", known_clock=edge)), {})
    for i in range(2):
        seq = fence.current("acct:1")
        t = fresh(fence, req(f"alice:{i}", "acct:1", agent="alice"))
        assert t.seq == seq + 1 and t.vector_clock["alice"] == MAX_KNOWN_COUNTER + 1 + i
        assert fence.commit(t, {"paid": i}).verify()


def test_a_poisoned_head_is_still_refused_before_the_effect_runs(fence: EffectFence) -> None:
    """The backstop behind bug 2's bound, for a head no request can make any more (a store
    written before the bound; here a ticket edited by hand in-process): the attempt is
    refused invalid_request before anything runs, and its claim released."""
    t = fresh(fence, req("m:1", "acct:1", agent="mallory"))
    t.vector_clock = VectorClock({"alice": 2**53 - 1, "mallory": 1})
    fence.commit(t, {})
    before = fence.stats()["prepare"]["invalid_request"]
    with pytest.raises(InvalidRequest, match="JSON-safe maximum"):
        fence.prepare(req("alice:1", "acct:1", agent="alice"))
    assert fence.intent_status("alice:1").state == "absent"
    assert fence.stats()["prepare"]["invalid_request"] == before + 1
    assert fence.request("alice:1", "elsewhere", "t", {}, "alice").fresh


@pytest.mark.parametrize("url", [None, 5, b"memory:"])
def test_from_url_refuses_what_is_not_a_url_typed(url: Any) -> None:
    """from_url(None) raised AttributeError (the memory check ran .strip() on it), before
    open_store could refuse it typed (found by review)."""
    from effectfence.store import StoreURLError

    with pytest.raises(StoreURLError):
        EffectFence.from_url(url)


@pytest.mark.parametrize("op", ["commit", "abort", "release", "renew"])
def test_a_ticket_taken_to_another_stores_fence_is_refused_and_changes_nothing(
    make_fence: FenceFactory, op: str
) -> None:
    """Tokens count per store, so two stores hand out the same token for the same intent:
    store 1's ticket, taken to store 2's fence, released store 2's holder, and a duplicate
    was admitted while that holder's effect ran (found by review; SQLite, PostgreSQL and
    Redis). A ticket knows its store; another store's fence refuses it invalid_ticket."""
    one, two = make_fence(), make_fence()
    req = EffectRequest("charge:7", "order:1", "charge", {"cents": 5}, "bot")
    theirs, mine = one.prepare(req).ticket, two.prepare(req).ticket
    before = two.intent_status("charge:7")
    calls: dict[str, Callable[[], Any]] = {
        "commit": lambda: two.commit(theirs, {"ok": 1}),
        "abort": lambda: two.abort(theirs, "why"),
        "release": lambda: two.release(theirs),
        "renew": lambda: two.renew(theirs),
    }
    with pytest.raises(InvalidTicket, match="issued by another store"):
        calls[op]()
    after = two.intent_status("charge:7")
    assert (after.state, after.token) == (before.state, before.token) == ("in_flight", mine.token)
    with pytest.raises(IntentInFlight):  # no duplicate admitted
        two.prepare(req)
    assert two.commit(mine, {"ok": 1}).seq == mine.seq  # its own holder still commits
