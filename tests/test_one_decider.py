"""What the one-decider change added: the commit-retry row, waiters that go away, reclaiming
that keeps pace with admission (G8), and the rules living in one place.

Every test runs on every store of ``support.STORES``; time moves only through the fake clock.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
from support import STORES, FakeClock, HookedStore, race

from effectfence import (
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentInFlight,
    InvalidTicket,
    LeaseLost,
    PreparedEffect,
    fenced,
)
from effectfence.fence import read_free_commit
from effectfence.protocol import TICKET_TABLE, Row, TicketVerdict

ROOT = Path(__file__).resolve().parents[1]


def _fence(store_kind: str, clock: FakeClock, **cfg: object) -> EffectFence:
    return EffectFence(FenceConfig(**cfg), store=STORES[store_kind](clock))  # type: ignore[arg-type]


# -- the commit-retry row (G3): an answer lost in transit can be asked for again ----------------


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_commit_retried_with_the_same_result_gets_the_same_certificate(store_kind: str) -> None:
    fence = _fence(store_kind, FakeClock(), auto_sweep=False)
    t = fence.prepare(EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")).ticket
    first = fence.commit(t, {"charge_id": "ch_1"})
    before = fence.stats()
    again = fence.commit(t, {"charge_id": "ch_1"})  # the first answer was "lost"
    assert again.hash == first.hash and again.verify()
    assert fence.stats()["commits"] == before["commits"], "a retry is not a second commit"
    assert fence.current("acct") == 1, "nothing moved"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_commit_retried_with_another_result_is_lease_lost(store_kind: str) -> None:
    fence = _fence(store_kind, FakeClock(), auto_sweep=False)
    t = fence.prepare(EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")).ticket
    first = fence.commit(t, {"charge_id": "ch_1"})
    with pytest.raises(LeaseLost) as info:
        fence.commit(t, {"charge_id": "ch_2"})
    assert info.value.details["committed_by_this_ticket"] is True
    assert info.value.details["cert_hash"] == first.hash
    assert fence.intent_status("pay:1").cert == first, "the record is never overwritten"
    for op in (fence.abort, fence.release, fence.renew):
        with pytest.raises(LeaseLost):
            op(t)  # type: ignore[operator]


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_commit_retried_after_its_result_expired_is_lease_lost(store_kind: str) -> None:
    """Rule 3 says DONE_EXPIRED, even for the ticket that committed: the commit's store step
    does not apply, and the refusal comes from the table, not from the record's state."""
    clock = FakeClock()
    fence = _fence(store_kind, clock, auto_sweep=False, result_ttl=10.0)
    t = fence.prepare(EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")).ticket
    fence.commit(t, {"charge_id": "ch_1"})
    clock.advance(10.0)
    with pytest.raises(LeaseLost) as info:
        fence.commit(t, {"charge_id": "ch_1"})
    assert info.value.state == "done_expired"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_other_ticket_retrying_a_commit_is_lease_lost(store_kind: str) -> None:
    clock = FakeClock()
    fence = _fence(store_kind, clock, auto_sweep=False, lease_ttl=10.0)
    old = fence.prepare(EffectRequest("pay:1", "acct", "pay", {}, "a")).ticket
    clock.advance(10.0)
    new = fence.prepare(EffectRequest("pay:1", "acct", "pay", {}, "b")).ticket  # takeover
    fence.commit(new, "ok")
    with pytest.raises(LeaseLost):
        fence.commit(old, "ok")  # same result, but not the ticket that committed


# -- a commit is one store step: the step's compare is Rule 3's check --------------------------


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_a_commit_reads_nothing_before_its_step(store_kind: str) -> None:
    """Fresh = one read, one claim, one complete: a read before the complete would be one
    round trip more on every server store."""
    store = HookedStore(STORES[store_kind](FakeClock()))
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    t = fence.prepare(EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")).ticket
    calls: list[str] = []
    store.before("get", lambda: calls.append("get"))
    store.before("complete", lambda: calls.append("complete"))
    fence.commit(t, {"charge_id": "ch_1"})
    assert calls == ["complete"]


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_round_trips_of_a_fresh_attempt_and_a_replay(store_kind: str) -> None:
    """Read-first stores: a fresh attempt reads, then claims; a replay is the read alone.
    Put-first stores (a claim that finds a record costs no more than a read): a fresh
    attempt is the claim alone, and a replay is that claim, refused, judged at its now."""
    inner = STORES[store_kind](FakeClock())
    store = HookedStore(inner)
    store.put_first = inner.put_first
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    calls: list[str] = []

    def spy() -> None:
        for op in ("get", "claim", "complete"):
            store.hooks[op] = [lambda op=op: calls.append(op)] * 4

    request = EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")
    spy()
    t = fence.prepare(request).ticket
    assert calls == (["claim"] if inner.put_first else ["get", "claim"])
    cert = fence.commit(t, {"charge_id": "ch_1"})
    calls.clear()
    spy()
    again = fence.prepare(request)
    assert not again.fresh and again.cert.hash == cert.hash
    assert calls == (["claim"] if inner.put_first else ["get"])


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_a_commit_with_a_ticket_altered_since_admission_is_refused(store_kind: str) -> None:
    fence = _fence(store_kind, FakeClock(), auto_sweep=False)
    t = fence.prepare(EffectRequest("pay:1", "acct", "pay", {"cents": 5}, "a")).ticket
    for forged in (
        PreparedEffect.from_dict({**t.to_dict(), "args": {"cents": 5000}}),
        PreparedEffect.from_dict({**t.to_dict(), "tool": "refund"}),
    ):
        before = fence.intent_status("pay:1")
        with pytest.raises(InvalidTicket, match="not the admitted one"):
            fence.commit(forged, {"charge_id": "ch_forged"})
        assert fence.intent_status("pay:1") == before, "a refused commit changes nothing"
    cert = fence.commit(t, {"charge_id": "ch_1"})
    assert cert.args == {"cents": 5} and cert.tool == "pay"


def test_the_read_free_commit_stands_on_rule_3() -> None:
    """The commit skips its read only while Rule 3 allows exactly what the step compares;
    any other table makes commits read and judge first (and the test above fail)."""
    assert read_free_commit(TICKET_TABLE)
    for row in (Row.IN_FLIGHT_LIVE, Row.IN_FLIGHT_LAPSED, Row.DONE_LIVE):
        for current in (True, False):
            table = dict(TICKET_TABLE)
            flip = table[row, current] is TicketVerdict.ALLOW
            table[row, current] = TicketVerdict.LEASE_LOST if flip else TicketVerdict.ALLOW
            assert not read_free_commit(table), (row, current)


# -- waiters: woken at the next transition, and gone once their wait ends -------------------------


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_waiters_do_not_linger_after_fenced_calls(store_kind: str) -> None:
    fence = _fence(store_kind, FakeClock(), auto_sweep=False, lease_ttl=60.0)
    inside = threading.Barrier(2)
    proceed = threading.Event()

    @fenced(fence, intent="job:{n}", domain="jobs", wait=True, wait_timeout=30.0)
    def job(n: int) -> int:
        if n == 0:
            inside.wait()
            assert proceed.wait(30)
        return n

    def call(i: int) -> int:
        if i == 0:
            return job(0)
        inside.wait()  # the holder is inside the function: these duplicates must wait
        for _ in range(3):
            try:
                return job(0)
            except IntentInFlight:  # registered before the holder finished: try again
                continue
        raise AssertionError("never got the holder's result")

    def release_holder() -> None:
        while not fence._waiters:  # the duplicates are parked in fence.wait
            threading.Event().wait(0.001)
        proceed.set()

    threading.Thread(target=release_holder, daemon=True).start()
    results = race(12, call)
    assert results == [0] * 12
    for i in range(1, 300):
        assert job(i) == i
    assert fence._waiters == {}, "every wait unregistered itself"


# -- G8: reclaiming keeps pace with admission, and a quiet spell does not strand a backlog ------


@pytest.mark.parametrize("store_kind", sorted(k for k in STORES if k.startswith("memory")))
def test_reclaiming_keeps_pace_at_any_rate(store_kind: str) -> None:
    """The in-process stores answer ``due()`` in one compare, so every prepare reaps a few
    due records. Shared stores answer False there (asking costs a round trip) and are swept
    on the fence's ``sweep_interval`` with ``sweep_batch``, sized by the operator."""
    clock = FakeClock()
    ttl, step = 1.0, 1e-4  # 10,000 effects per (fake) second: 100x the old sweep budget
    fence = _fence(store_kind, clock, lease_ttl=0.5, result_ttl=ttl, sweep_batch=50)
    peak = 0
    for i in range(30_000):
        fence.commit(fence.prepare(EffectRequest(f"i{i}", "d", "t", {}, "a")).ticket, 1)
        clock.advance(step)
        peak = max(peak, fence.store.size()["records"])
    kept_by_rate = ttl / step
    assert peak <= 1.5 * kept_by_rate, (peak, kept_by_rate)
    # a burst, then quiet for longer than the ttl: traffic resumes and the backlog drains
    clock.advance(10 * ttl)
    for i in range(3_000):
        fence.prepare(EffectRequest(f"late{i}", "d", "t", {}, "a"))
    assert fence.store.size()["records"] <= 3_000 + 50, fence.store.size()


# -- one decider: no store module judges time or payloads itself ------------------------------


RULES = {"observe", "decide_prepare", "judge_ticket", "PREPARE_TABLE", "TICKET_TABLE"}


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "effectfence" / "store").glob("*.py"))
)
def test_stores_import_no_rule(path: str) -> None:
    """A store performs steps; the rules are the protocol's (rule 8 of protocol.py)."""
    tree = ast.parse((ROOT / path).read_text())
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not used & RULES, f"{path} uses {sorted(used & RULES)}"
