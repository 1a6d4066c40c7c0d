"""Stateful model checking: the fence against a small reference model of docs/design.md.

A hypothesis ``RuleBasedStateMachine`` drives the fence with prepare / commit / abort /
release / renew / clear / sweep / evict, moves the injected clock past leases and TTLs, and
keeps every ticket it was ever given (superseded ones included) to replay them later. After
every step the fence must agree with the model: every intent's state, token, certificate and
reason; every domain's seq; the number of records held; the statistics buckets.

The model is written from docs/design.md's state table, not from ``effectfence.protocol``: it
imports nothing of the fence's decision logic, so a wrong table in the core cannot agree with
itself here.

Time moves in multiples of 0.25 s and both TTLs are multiples of it, so deadlines are exact
floats and "reclaimed at its deadline" is a precise statement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import STORES, FakeClock

from effectfence import (
    DomainRace,
    EffectCert,
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    InvalidTicket,
    LeaseLost,
    ReadSetStale,
    Replay,
)
from effectfence.model import PreparedEffect

LEASE = 4.0
RESULT_TTL = 20.0
INTENTS = ("i0", "i1", "i2")
DOMAINS = ("d0", "d1")
PAYLOADS = ({"v": 0}, {"v": 1})
MODES = ("plain", "expect_ok", "expect_stale", "read_ok", "read_stale", "read_own")


@dataclass
class MRec:
    """One intent in the model."""

    state: str  # "in_flight" | "done" | "failed"
    token: int
    payload: tuple[str, int]  # (domain, payload index): what "same action" means here
    agent: str
    lease_until: float = 0.0
    until: float = 0.0
    cert_hash: str = ""
    reason: str = ""
    result: Any = None


@dataclass
class Model:
    records: dict[str, MRec] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    floor: int = 0
    heads: dict[str, str] = field(default_factory=dict)
    max_token: int = -1
    stats: dict[str, int] = field(default_factory=dict)

    def at(self, domain: str) -> int:
        return self.seqs.get(domain, self.floor)

    def row(self, intent: str, now: float) -> str:
        rec = self.records.get(intent)
        if rec is None:
            return "absent"
        if rec.state == "in_flight":
            return "in_flight" if now < rec.lease_until else "in_flight_lapsed"
        if rec.state == "done":
            return "done" if now < rec.until else "done_expired"
        return "failed"

    def count(self, bucket: str) -> None:
        self.stats[bucket] = self.stats.get(bucket, 0) + 1

    def in_flight(self, domain: str) -> int:
        return sum(
            1 for r in self.records.values() if r.state == "in_flight" and r.payload[0] == domain
        )


@dataclass
class Held:
    """A ticket and what the model knows about how it was obtained."""

    ticket: PreparedEffect
    payload: tuple[str, int]


class FenceMachine(RuleBasedStateMachine):
    store_kind: str = ""
    #: the "intents" machine leaves domains alone; the "full" one also evicts them
    evicts: bool = True

    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        store = STORES[self.store_kind](self.clock)
        self.fence = EffectFence(
            FenceConfig(lease_ttl=LEASE, result_ttl=RESULT_TTL, auto_sweep=False), store=store
        )
        self.m = Model()

    def teardown(self) -> None:
        self.fence.store.close()

    @initialize()
    def start(self) -> None:
        assert self.fence.stats()["attempts"] == 0

    # -- prepare ----------------------------------------------------------------------------------
    @rule(
        target=tickets,
        intent=st.sampled_from(INTENTS),
        domain=st.sampled_from(DOMAINS),
        payload=st.sampled_from(range(len(PAYLOADS))),
        agent=st.sampled_from(("ann", "bob")),
        mode=st.sampled_from(MODES),
    )
    def prepare(self, intent: str, domain: str, payload: int, agent: str, mode: str) -> Any:
        m, now = self.m, self.clock()
        other = DOMAINS[1 - DOMAINS.index(domain)]
        kw: dict[str, Any] = {}
        if mode == "expect_ok":
            kw["expected_seq"] = m.at(domain)
        elif mode == "expect_stale":
            kw["expected_seq"] = m.at(domain) + 1
        elif mode == "read_ok":
            kw["read_set"] = [(other, m.at(other))]
        elif mode == "read_stale":
            kw["read_set"] = [(other, m.at(other) + 2)]
        elif mode == "read_own":
            kw["read_set"] = [(domain, m.at(domain))]
        request = EffectRequest(intent, domain, "charge", PAYLOADS[payload], agent, **kw)
        key = (domain, payload)
        rec = m.records.get(intent)
        row = m.row(intent, now)
        same = rec is None or rec.payload == key

        def expect_refusal(exc: type[Exception], bucket: str) -> Any:
            try:
                got = self.fence.prepare(request)
            except exc:
                m.count(bucket)
                return multiple()
            raise AssertionError(f"{row}/{mode}: expected {exc.__name__}, got {got!r}")

        # docs/design.md's prepare column, row by row
        if row == "in_flight":
            return expect_refusal(
                IntentInFlight if same else IntentConflict,
                "intent_in_flight" if same else "intent_conflict",
            )
        if row == "in_flight_lapsed" and not same:
            return expect_refusal(IntentConflict, "intent_conflict")
        if row == "failed":
            return expect_refusal(IntentFailed, "intent_failed")
        if row == "done":
            if not same:
                return expect_refusal(IntentConflict, "intent_conflict")
            assert rec is not None
            adm = self.fence.prepare(request)
            assert isinstance(adm, Replay), adm
            assert adm.cert.hash == rec.cert_hash and adm.cert.verify()
            m.count("replayed")
            return multiple()
        # absent, expired result, or lapsed lease with the same payload: a claim or takeover,
        # if the read set still holds and the expected seq is still current
        if mode == "read_stale":
            return expect_refusal(ReadSetStale, "read_set_stale")
        if mode == "expect_stale":
            return expect_refusal(DomainRace, "domain_race")
        adm = self.fence.prepare(request)
        assert adm.fresh, adm
        t = adm.ticket
        assert adm.takeover == (row == "in_flight_lapsed")
        assert t.seq == m.at(domain) + 1, "the next seq, gapless"
        assert t.token > m.max_token, "tokens are never reused"
        assert t.parent == m.heads.get(domain), "built on the domain's last committed cert"
        assert t.lease_until == now + LEASE
        m.max_token = t.token
        m.seqs[domain] = t.seq
        m.records[intent] = MRec("in_flight", t.token, key, agent, lease_until=now + LEASE)
        m.count("admitted")
        if adm.takeover:
            m.count("takeovers")
        return Held(t, key)

    # -- ticket operations ------------------------------------------------------------------------
    def _current(self, held: Held) -> bool:
        rec = self.m.records.get(held.ticket.intent)
        return rec is not None and rec.state == "in_flight" and rec.token == held.ticket.token

    def _expect_lost(self, call: Any) -> None:
        with pytest.raises(LeaseLost):
            call()
        self.m.count("refused_ticket_ops")

    @rule(held=tickets, result=st.sampled_from(("ok", "charged", 7)))
    def commit(self, held: Held, result: Any) -> None:
        t, m, now = held.ticket, self.m, self.clock()
        done = m.records.get(t.intent)
        if (
            done is not None
            and done.state == "done"
            and done.token == t.token
            and now < done.until
            and done.result == result
        ):
            # the committing ticket commits again with the same result: the same certificate
            assert self.fence.commit(t, result).hash == done.cert_hash
            return
        if (
            done is not None
            and done.state == "failed"
            and done.reason == "read_set_stale"
            and done.token == t.token
        ):
            # this ticket's commit found its read set moved: told so again, not lease_lost
            with pytest.raises(ReadSetStale):
                self.fence.commit(t, result)
            m.count("refused_ticket_ops")
            return
        if not self._current(held):
            self._expect_lost(lambda: self.fence.commit(t, result))
            return
        strict = t.expected_seq is not None or any(d == t.domain for d, _ in t.read_set)
        stale = any(m.at(d) != s for d, s in t.read_set if d != t.domain)
        stale = stale or (strict and m.at(t.domain) != t.seq)
        rec = m.records[t.intent]
        if stale:
            with pytest.raises(ReadSetStale):
                self.fence.commit(t, result)
            m.records[t.intent] = MRec(
                "failed", t.token, rec.payload, rec.agent, reason="read_set_stale"
            )
            m.count("stale_commits")
            return
        cert = self.fence.commit(t, result)
        assert cert.verify()
        assert (cert.intent, cert.domain, cert.seq, cert.parent, cert.result) == (
            t.intent,
            t.domain,
            t.seq,
            t.parent,
            result,
        )
        m.records[t.intent] = MRec(
            "done",
            t.token,
            rec.payload,
            rec.agent,
            until=now + RESULT_TTL,
            cert_hash=cert.hash,
            result=result,
        )
        m.heads[t.domain] = cert.hash
        m.count("commits")

    @rule(held=tickets)
    def abort(self, held: Held) -> None:
        t = held.ticket
        if not self._current(held):
            self._expect_lost(lambda: self.fence.abort(t, "unknown outcome"))
            return
        self.fence.abort(t, "unknown outcome")
        rec = self.m.records[t.intent]
        self.m.records[t.intent] = MRec(
            "failed", t.token, rec.payload, rec.agent, reason="unknown outcome"
        )
        self.m.count("aborts")

    @rule(held=tickets)
    def release(self, held: Held) -> None:
        t = held.ticket
        if not self._current(held):
            self._expect_lost(lambda: self.fence.release(t))
            return
        self.fence.release(t)
        del self.m.records[t.intent]
        self.m.count("releases")

    @rule(held=tickets)
    def renew(self, held: Held) -> None:
        t = held.ticket
        if not self._current(held):
            self._expect_lost(lambda: self.fence.renew(t))
            return
        until = self.fence.renew(t)
        assert until == self.clock() + LEASE
        self.m.records[t.intent].lease_until = until
        self.m.count("renewals")

    @rule(held=tickets, change=st.sampled_from(("args", "tool")))
    def tampered_ticket(self, held: Held, change: str) -> None:
        """An edited ticket object: refused; never commits someone else's payload."""
        t = held.ticket
        data = t.to_dict()
        if change == "args":
            data["args"] = {"v": 99}
        else:
            data["tool"] = "refund"
        data["fingerprint"] = "0" * 64
        forged = PreparedEffect.from_dict(data)
        with pytest.raises(InvalidTicket if self._current(held) else LeaseLost):
            self.fence.commit(forged, "forged")
        self.m.count("refused_ticket_ops")

    # -- operator, time, housekeeping --------------------------------------------------------
    @rule(intent=st.sampled_from(INTENTS))
    def clear(self, intent: str) -> None:
        m = self.m
        row = m.row(intent, self.clock())
        cleared = self.fence.clear_intent(intent)
        if row != "done_expired":  # an expired, not yet swept result may or may not count
            assert cleared == (row != "absent")
        if cleared:
            m.count("clears")
        m.records.pop(intent, None)

    @rule(quarters=st.integers(min_value=1, max_value=100))
    def advance(self, quarters: int) -> None:
        self.clock.advance(quarters * 0.25)

    @rule()
    def sweep(self) -> None:
        m, now = self.m, self.clock()
        # a lapsed lease is kept for the grace period (result_ttl by default), then reclaimed
        due = [
            i
            for i in m.records
            if m.row(i, now) == "done_expired"
            or (
                m.row(i, now) == "in_flight_lapsed" and now >= m.records[i].lease_until + RESULT_TTL
            )
        ]
        n = self.fence.sweep()
        assert n == len(due), (n, due)
        for i in due:
            del m.records[i]
            m.count("reclaimed")

    @precondition(lambda self: self.evicts)
    @rule(domain=st.sampled_from(DOMAINS))
    def evict(self, domain: str) -> None:
        m = self.m
        if m.in_flight(domain):
            with pytest.raises(IntentInFlight):
                self.fence.evict_domain(domain)
            return
        last = self.fence.evict_domain(domain)
        assert last == m.seqs.pop(domain, None)
        if last is not None:
            m.floor = max(m.floor, last + 1)
        m.heads.pop(domain, None)

    # -- the state table, after every step ----------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        m, now, fence = self.m, self.clock(), self.fence
        for intent in INTENTS:
            row = m.row(intent, now)
            status = fence.intent_status(intent)
            want = "absent" if row == "done_expired" else row
            assert status.state == want, (intent, status, m.records.get(intent))
            rec = m.records.get(intent)
            if rec is None or want == "absent":
                continue
            assert status.token == rec.token
            assert status.domain == rec.payload[0]
            if want == "done":
                assert status.cert is not None and status.cert.hash == rec.cert_hash
            if want == "failed":
                assert status.reason == rec.reason
            if want.startswith("in_flight"):
                assert status.lease_until == rec.lease_until
        for domain in DOMAINS:
            assert fence.current(domain) == m.at(domain), domain
        size = fence.store.size()
        assert size["records"] == len(m.records)
        assert size["domains"] == len(m.seqs), "only a claim creates a domain"

    @invariant()
    def stats_agree(self) -> None:
        s = self.fence.stats()
        prepare = s["prepare"]
        for bucket, n in self.m.stats.items():
            got = prepare[bucket] if bucket in prepare else s[bucket]
            assert got == n, (bucket, got, n)
        assert s["attempts"] == sum(prepare.values())


#: The mutation harness sets this so a kill is reproducible run after run.
DERANDOMIZE = os.environ.get("EFFECTFENCE_DERANDOMIZE") == "1"


@pytest.mark.parametrize("scope", ["intents", "full"])
@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_fence_agrees_with_reference_model(store_kind: str, scope: str) -> None:
    machine = type(
        f"FenceMachine_{store_kind}_{scope}",
        (FenceMachine,),
        {"store_kind": store_kind, "evicts": scope == "full"},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            derandomize=DERANDOMIZE,
            database=None if DERANDOMIZE else settings.default.database,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_evict_refused_while_in_flight_after_other_evictions(store_kind: str) -> None:
    """Regression found by the machine above: in-flight accounting vs. the eviction floor.

    Attempts A, B, C are in flight on d; another domain e is used and evicted; then A
    commits. B and C are still in flight, so evicting d must be refused (docs/design.md, Domains).
    """
    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=LEASE, result_ttl=RESULT_TTL, auto_sweep=False),
        store=STORES[store_kind](clock),
    )
    held = [fence.prepare(EffectRequest(i, "d", "charge", {}, "a")).ticket for i in "ABC"]
    te = fence.prepare(EffectRequest("E", "e", "charge", {}, "a")).ticket
    fence.commit(te, "ok")
    fence.evict_domain("e")
    fence.commit(held[0], "ok")
    with pytest.raises(IntentInFlight):
        fence.evict_domain("d")
    for t in held[1:]:
        fence.commit(t, "ok")
    assert fence.evict_domain("d") == 3  # and once nothing is in flight, it goes


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_evict_allowed_when_idle_after_other_evictions(store_kind: str) -> None:
    """The same accounting the other way round: an idle domain must stay evictable."""
    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=LEASE, result_ttl=RESULT_TTL, auto_sweep=False),
        store=STORES[store_kind](clock),
    )
    t = fence.prepare(EffectRequest("A", "d", "charge", {}, "a")).ticket
    te = fence.prepare(EffectRequest("E", "e", "charge", {}, "a")).ticket
    fence.commit(te, "ok")
    fence.evict_domain("e")
    fence.commit(t, "ok")
    assert fence.evict_domain("d") == t.seq


# -- the state table, row by row (scripted: every cell of docs/design.md's table) --------------

ROWS = ("absent", "in_flight", "in_flight_lapsed", "done", "done_expired", "failed")
OTHER_PAYLOADS = {
    "args": EffectRequest("i", "d", "charge", {"v": 1}, "bob"),
    "tool": EffectRequest("i", "d", "refund", {"v": 0}, "bob"),
    "domain": EffectRequest("i", "d2", "charge", {"v": 0}, "bob"),
}
SAME = EffectRequest("i", "d", "charge", {"v": 0}, "bob")


def _fence(store_kind: str) -> tuple[EffectFence, FakeClock]:
    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=LEASE, result_ttl=RESULT_TTL, auto_sweep=False),
        store=STORES[store_kind](clock),
    )
    return fence, clock


def _into_row(store_kind: str, row: str) -> tuple[EffectFence, FakeClock, PreparedEffect, str]:
    """A fence whose intent "i" is in ``row``; the ticket that got it there; its cert hash."""
    fence, clock = _fence(store_kind)
    t = fence.prepare(EffectRequest("i", "d", "charge", {"v": 0}, "ann")).ticket
    cert_hash = ""
    if row == "absent":
        fence.release(t)
    elif row == "in_flight_lapsed":
        clock.advance(LEASE)  # a lease ends at its deadline
    elif row in ("done", "done_expired"):
        cert_hash = fence.commit(t, "charged").hash
        if row == "done_expired":
            clock.advance(RESULT_TTL)
    elif row == "failed":
        fence.abort(t, "bank timed out")
    return fence, clock, t, cert_hash


def _snapshot(fence: EffectFence) -> Any:
    rec = fence.store.get("i")
    return (
        None if rec is None else (rec.state, rec.token, rec.lease_until, rec.fingerprint),
        fence.current("d"),
        fence.current("d2"),
        fence.store.size(),
    )


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_state_table_prepare_same_payload(store_kind: str, row: str) -> None:
    fence, _, t, cert_hash = _into_row(store_kind, row)
    before = _snapshot(fence)
    if row in ("in_flight", "failed"):
        with pytest.raises(IntentInFlight if row == "in_flight" else IntentFailed):
            fence.prepare(SAME)
        assert _snapshot(fence) == before, "a refused prepare changes nothing (G7)"
        return
    adm = fence.prepare(SAME)
    if row == "done":
        assert isinstance(adm, Replay) and adm.cert.hash == cert_hash and adm.cert.verify()
        assert _snapshot(fence) == before
        return
    assert adm.fresh
    assert adm.takeover == (row == "in_flight_lapsed")
    assert adm.ticket.token > t.token, "a claim or takeover always gets a new token"


@pytest.mark.parametrize("change", sorted(OTHER_PAYLOADS))
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_state_table_prepare_other_payload(store_kind: str, row: str, change: str) -> None:
    fence, _, _, _ = _into_row(store_kind, row)
    before = _snapshot(fence)
    other = OTHER_PAYLOADS[change]
    if row in ("absent", "done_expired"):
        assert fence.prepare(other).fresh  # nothing recorded to conflict with
        return
    with pytest.raises(IntentFailed if row == "failed" else IntentConflict):
        fence.prepare(other)
    assert _snapshot(fence) == before, "never replayed, never executed (G4)"


@pytest.mark.parametrize("op", ["commit", "abort", "release", "renew"])
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_state_table_ticket_ops(store_kind: str, row: str, op: str) -> None:
    fence, _, t, _ = _into_row(store_kind, row)
    call = {
        "commit": lambda: fence.commit(t, "again"),
        "abort": lambda: fence.abort(t, "again"),
        "release": lambda: fence.release(t),
        "renew": lambda: fence.renew(t),
    }[op]
    before = _snapshot(fence)
    if row in ("in_flight", "in_flight_lapsed"):  # the current token, lapsed or not
        call()
        want = {"commit": "done", "abort": "failed", "release": "absent", "renew": "in_flight"}
        assert fence.intent_status("i").state == want[op]
        return
    with pytest.raises(LeaseLost):
        call()
    assert _snapshot(fence) == before, "a finished record is never overwritten (G2)"


@pytest.mark.parametrize("op", ["commit", "abort", "release", "renew"])
@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_state_table_old_token_after_takeover(store_kind: str, op: str) -> None:
    fence, _, old, _ = _into_row(store_kind, "in_flight_lapsed")
    new = fence.prepare(SAME)
    assert new.fresh and new.takeover and new.ticket.token > old.token
    before = _snapshot(fence)
    with pytest.raises(LeaseLost) as info:
        {
            "commit": lambda: fence.commit(old, "zombie"),
            "abort": lambda: fence.abort(old, "zombie"),
            "release": lambda: fence.release(old),
            "renew": lambda: fence.renew(old),
        }[op]()
    # the refusal says why: whose token is current now (the ticket table's row, G2)
    assert f"current token {new.ticket.token}" in info.value.message, info.value.message
    assert info.value.token == old.token
    assert _snapshot(fence) == before
    assert fence.commit(new.ticket, "ok").agent == "bob"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_replayed_cert_is_tamper_evident(store_kind: str) -> None:
    fence, _, _, _ = _into_row(store_kind, "done")
    adm = fence.prepare(SAME)
    assert isinstance(adm, Replay) and adm.cert.verify()
    body = adm.cert.to_dict()
    edits: dict[str, Any] = {
        "intent": "j",
        "parent": "0" * 64,
        "domain": "d9",
        "seq": body["seq"] + 1,
        "tool": "refund",
        "args": {"v": 1},
        "result": "refunded",
        "vector_clock": {"mallory": 1},
        "read_set": [["d", 0]],
        "agent": "mallory",
        "hash": "f" * 64,
    }
    for name, value in edits.items():
        assert not EffectCert.from_dict({**body, name: value}).verify(), name
    assert EffectCert.from_dict(body).verify()


# -- domains, sweep, refusals: scripted ----------------------------------------------------------


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_evict_refused_while_in_flight(store_kind: str) -> None:
    fence, _ = _fence(store_kind)
    t = fence.prepare(SAME).ticket
    with pytest.raises(IntentInFlight):
        fence.evict_domain("d")
    assert fence.current("d") == t.seq
    fence.commit(t, "ok")
    assert fence.evict_domain("d") == t.seq


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_evict_never_reissues_a_seq(store_kind: str) -> None:
    fence, _ = _fence(store_kind)
    issued: list[int] = []
    for rnd in range(3):
        for k in range(4):
            t = fence.prepare(EffectRequest(f"r{rnd}-{k}", "d", "charge", {}, "a")).ticket
            issued.append(t.seq)
            fence.commit(t, k)
        last = fence.current("d")
        assert fence.evict_domain("d") == last
        assert fence.current("d") > last, "an evicted domain never reads an old value"
        with pytest.raises(DomainRace):
            fence.prepare(EffectRequest(f"x{rnd}", "d", "charge", {}, "a", expected_seq=last))
        with pytest.raises(ReadSetStale):
            fence.prepare(EffectRequest(f"y{rnd}", "e", "charge", {}, "a", read_set=[("d", last)]))
    t = fence.prepare(EffectRequest("fresh-domain", "never-seen", "charge", {}, "a")).ticket
    issued.append(t.seq)
    assert issued == sorted(set(issued)), "reserved seqs are unique and strictly increasing"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_refused_prepares_leave_no_trace(store_kind: str) -> None:
    fence, _ = _fence(store_kind)
    t = fence.prepare(SAME).ticket
    before = (_snapshot(fence), fence.current("absent-domain"), fence.store.size())
    refused = [
        (IntentInFlight, SAME),
        (IntentConflict, OTHER_PAYLOADS["args"]),
        (DomainRace, EffectRequest("j", "absent-domain", "charge", {}, "a", expected_seq=5)),
        (DomainRace, EffectRequest("j", "d", "charge", {}, "a", expected_seq=t.seq + 3)),
        (ReadSetStale, EffectRequest("j", "d2", "charge", {}, "a", read_set=[("d", t.seq - 1)])),
        (ReadSetStale, EffectRequest("j", "d2", "charge", {}, "a", read_set=[("zz", 3)])),
    ]
    for exc, request in refused:
        with pytest.raises(exc):
            fence.prepare(request)
        after = (_snapshot(fence), fence.current("absent-domain"), fence.store.size())
        assert after == before, (exc.__name__, request)
        assert fence.intent_status("j").state == "absent"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_read_set_checked_at_prepare_and_commit(store_kind: str) -> None:
    fence, _ = _fence(store_kind)
    fence.commit(fence.prepare(EffectRequest("m", "inv", "charge", {}, "a")).ticket, "ok")
    at = fence.current("inv")
    with pytest.raises(ReadSetStale) as ei:
        fence.prepare(EffectRequest("i", "d", "charge", {}, "a", read_set=[("inv", at - 1)]))
    assert ei.value.details["actual"] == at
    t = fence.prepare(EffectRequest("i", "d", "charge", {}, "a", read_set=[("inv", at)])).ticket
    fence.commit(fence.prepare(EffectRequest("m2", "inv", "charge", {}, "a")).ticket, "moved")
    with pytest.raises(ReadSetStale):
        fence.commit(t, "stale")
    assert fence.intent_status("i").state == "failed"


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_sweep_reclaims_exactly_the_expired(store_kind: str) -> None:
    fence, clock = _fence(store_kind)
    lapsing = fence.prepare(EffectRequest("lapsing", "d", "charge", {}, "a")).ticket
    renewed = fence.prepare(EffectRequest("renewed", "d", "charge", {}, "a")).ticket
    failed = fence.prepare(EffectRequest("failed", "d", "charge", {}, "a")).ticket
    fence.abort(failed, "unknown")
    done = fence.prepare(EffectRequest("done", "d", "charge", {}, "a")).ticket
    fence.commit(done, "ok")
    clock.advance(LEASE - 1)
    fence.renew(renewed)
    clock.advance(1)  # lapsing lapsed now, but nobody took over: still its holder's
    assert fence.sweep() == 0
    assert fence.store.get("lapsing") is not None
    clock.advance(RESULT_TTL)  # past the grace for lapsing; done expired; renewed not yet
    assert fence.sweep() == 2
    assert fence.store.get("lapsing") is None and fence.store.get("done") is None
    with pytest.raises(LeaseLost):
        fence.commit(lapsing, "too late: reclaimed")
    assert fence.store.get("renewed") is not None
    clock.advance(LEASE)  # renewed's lease lapsed more than the grace ago
    assert fence.sweep() == 1
    assert fence.intent_status("failed").state == "failed", "unknown stays fenced (G9)"
    assert fence.sweep() == 0
    assert fence.store.size()["records"] == 1


@pytest.mark.parametrize("store_kind", sorted(STORES))
def test_auto_sweep_bounds_memory(store_kind: str) -> None:
    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=1.0, result_ttl=2.0, auto_sweep=True, sweep_interval=0.5),
        store=STORES[store_kind](clock),
    )
    for i in range(600):
        fence.commit(fence.prepare(EffectRequest(f"i{i}", "d", "t", {}, "a")).ticket, i)
        clock.advance(0.05)
    # never more than result_ttl + one sweep interval (+ a wheel slot) worth of records
    assert fence.store.size()["records"] <= (2.0 + 0.5 + 0.25) / 0.05 + 2
    assert fence.stats()["reclaimed"] >= 600 - 60
