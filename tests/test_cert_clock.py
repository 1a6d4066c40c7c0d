"""Certificates (frozen format, tamper evidence, chains) and vector clocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectfence import (
    EffectCert,
    EffectFence,
    EffectRequest,
    InvalidRequest,
    VectorClock,
    verify_chain,
)
from effectfence.canonical import canonical_bytes, canonical_str
from effectfence.cert import spliced_hash

VECTORS = json.loads((Path(__file__).parent / "vectors" / "certs.json").read_text())


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["fields"]["intent"])
def test_certificate_format_is_frozen(vector: dict[str, Any]) -> None:
    cert = EffectCert(**vector["fields"])
    assert canonical_str(cert.body()) == vector["canonical"]
    assert cert.hash == vector["hash"]
    assert cert.verify()
    again = EffectCert.from_dict(json.loads(json.dumps(cert.to_dict())))
    assert again.hash == cert.hash and again.verify() and again == cert


def test_from_dict_refuses_malformed() -> None:
    good = EffectCert(**VECTORS["vectors"][0]["fields"]).to_dict()
    for bad in (
        {k: v for k, v in good.items() if k != "seq"},
        {**good, "extra": 1},
        {**good, "seq": "1"},
        {**good, "format": "other/9"},
        {**good, "read_set": [["d"]]},
        {**good, "vector_clock": {"a": "1"}},
        [good],
    ):
        with pytest.raises(InvalidRequest):
            EffectCert.from_dict(bad)  # type: ignore[arg-type]


def test_certificate_is_immutable_and_repr_hides_payload() -> None:
    cert = EffectCert(**VECTORS["vectors"][0]["fields"])
    with pytest.raises(AttributeError):
        cert.result = "forged"  # type: ignore[misc]
    assert "cents" not in repr(cert) and "charge_id" not in repr(cert)


def test_chain_verification() -> None:
    a = EffectCert(**{**VECTORS["vectors"][0]["fields"], "parent": None})
    b = EffectCert(**{**VECTORS["vectors"][0]["fields"], "seq": 2, "parent": a.hash})
    c = EffectCert(**{**VECTORS["vectors"][0]["fields"], "seq": 3, "parent": b.hash})
    assert verify_chain([a, b, c]).ok and verify_chain([]).ok
    report = verify_chain([a, c])
    assert not report and report.broken_at == 1
    forged = EffectCert.from_dict({**b.to_dict(), "result": "edited"})
    assert verify_chain([a, forged, c]).broken_at == 1


agents = st.sampled_from(["a", "b", "c", "d"])
clocks = st.dictionaries(agents, st.integers(0, 5)).map(VectorClock)


@given(clocks, clocks, clocks)
def test_vector_clock_laws(x: VectorClock, y: VectorClock, z: VectorClock) -> None:
    m = x.merge(y)
    assert x.le(m) and y.le(m)  # merge is an upper bound
    assert m == y.merge(x)  # commutative
    assert x.merge(y).merge(z) == x.merge(y.merge(z))  # associative
    assert x.le(x) and not x.lt(x)
    assert x.lt(x.tick("a"))
    if x.le(y) and y.le(x):
        assert x == y and x.digest() == y.digest()
    assert x.concurrent(y) == (not x.le(y) and not y.le(x))
    if x.le(y) and y.le(z):
        assert x.le(z)


def test_vector_clock_validation_and_canonical_digest() -> None:
    assert (
        VectorClock({"a": 0}) == VectorClock()
        and VectorClock({"a": 0}).digest() == VectorClock().digest()
    )
    assert VectorClock({"b": 1, "a": 2}).digest() == VectorClock({"a": 2, "b": 1}).digest()
    for bad in ({"": 1}, {"a": -1}, {"a": 1.5}, {1: 1}):
        with pytest.raises(ValueError):
            VectorClock(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        VectorClock().tick("")


names = st.text(min_size=1, max_size=12)
json_leaf = st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=8)
json_val = st.recursive(
    json_leaf | st.floats(allow_nan=False, allow_infinity=False),
    lambda i: st.lists(i, max_size=4) | st.dictionaries(st.text(max_size=6), i, max_size=4),
    max_leaves=15,
)


@settings(max_examples=300, deadline=None)
@given(
    names,
    st.none() | st.text(min_size=1, max_size=64),
    names,
    st.integers(0, 2**53 - 2),
    names,
    st.dictionaries(st.text(max_size=6), json_val, max_size=4),
    json_val,
    st.dictionaries(names, st.integers(1, 99), max_size=3),
    st.lists(st.tuples(names, st.integers(0, 2**53 - 2)), max_size=3),
    names,
)
def test_spliced_hash_equals_the_canonical_body_hash(
    intent: str,
    parent: str | None,
    domain: str,
    seq: int,
    tool: str,
    args: dict[str, Any],
    result: Any,
    vc: dict[str, int],
    rs: list[tuple[str, int]],
    agent: str,
) -> None:
    """The fence assembles certificate bodies from canonical parts; prove it is exact."""
    full = EffectCert(
        intent=intent,
        parent=parent,
        domain=domain,
        seq=seq,
        tool=tool,
        args=args,
        result=result,
        vector_clock=vc,
        read_set=rs,
        agent=agent,
    )
    spliced = spliced_hash(
        intent,
        parent,
        domain,
        seq,
        tool,
        canonical_bytes(args),
        canonical_bytes(result),
        vc,
        rs,
        agent,
    )
    assert spliced == full.hash


def test_certificate_keeps_private_copies() -> None:
    fence = EffectFence()
    args: dict[str, Any] = {"cents": 500, "items": [1, 2]}
    result: dict[str, Any] = {"id": "ch_1"}
    adm = fence.prepare(EffectRequest("i", "d", "charge", args, "a"))
    args["items"].append(3)  # the caller's objects change after the fact...
    cert = fence.commit(adm.ticket, result)
    result["id"] = "forged"
    replay = fence.prepare(EffectRequest("i", "d", "charge", {"cents": 500, "items": [1, 2]}, "b"))
    assert replay.cert.verify() and replay.cert.hash == cert.hash  # ...the record does not
    assert replay.cert.args == {"cents": 500, "items": [1, 2]}
    assert replay.cert.result == {"id": "ch_1"}


@pytest.mark.parametrize("x", [2.0**53, 1e17, 1.7e18, -1.7e18, 2.0**64, 1e20])
def test_a_certificate_holding_an_integral_float_past_2_53_verifies_everywhere(x: float) -> None:
    """Review 2, bug 1: the canonical text of 1.7e18 is ``1700000000000000000``; read back
    as an int, the certificate failed verify() (G3) and could not be stored or exported."""
    from effectfence.store.codec import cert_from_json, cert_to_json

    cert = EffectCert(
        intent="i",
        parent=None,
        domain="d",
        seq=1,
        tool="t",
        args={"amount": x},
        result={"ts_ns": x},
        vector_clock={"a": 1},
        read_set=[],
        agent="a",
    )
    assert cert.verify() and cert.result == {"ts_ns": x} and cert.args == {"amount": x}
    stored = cert_from_json(cert_to_json(cert))
    assert stored == cert and stored.verify() and stored.hash == cert.hash
    assert EffectCert.from_dict(cert.to_dict()).verify()


def test_a_tickets_clock_keeps_its_own_agent_and_the_busiest_others() -> None:
    from effectfence.clock import MAX_TICKET_AGENTS, ticket_counts

    head = {f"agent-{i:05d}": 1 + i % 7 for i in range(3 * MAX_TICKET_AGENTS)}
    known = {"reader": 99}
    got = ticket_counts(head, known, "me")
    assert len(got) == MAX_TICKET_AGENTS and got["me"] == 1 and got["reader"] == 99
    # the others kept are those with the most events, ties broken by the smaller name
    others = sorted(((-n, a) for a, n in {**head, **known}.items()))[: MAX_TICKET_AGENTS - 1]
    assert {a for _, a in others} | {"me"} == set(got)
    assert ticket_counts(head, known, "me") == got  # the same clock, wherever it is made
    small = {"a": 3, "b": 1}
    assert ticket_counts(small, {"c": 2}, "b") == {"a": 3, "b": 2, "c": 2}  # nothing left out


def test_no_domain_history_makes_its_tickets_too_large_to_hand_out() -> None:
    """Found by review: each commit's known_clock (up to 256 agents of 512 characters) grew
    the domain's head clock, and after ~40 commits every ticket on the domain was over the
    4 MiB a sealed ticket may carry: every later prepare, by anyone, was refused (after
    reserving a seq) for good. Tickets now carry a bounded clock."""
    from effectfence.clock import MAX_TICKET_AGENTS
    from effectfence.tickets import TicketSigner

    fence = EffectFence()
    signer = TicketSigner(b"k" * 32)
    for c in range(40):
        known = {f"{c:02d}-{i:03d}-" + "k" * 500: 1 for i in range(256)}
        adm = fence.prepare(
            EffectRequest(f"poison:{c}", "order:1", "t", {}, "mallory", known_clock=known)
        )
        signer.seal(adm.ticket)
        fence.commit(adm.ticket, 1)
    adm = fence.prepare(EffectRequest("innocent:1", "order:1", "t", {"n": 1}, "bob"))
    assert adm.fresh and len(adm.ticket.vector_clock) == MAX_TICKET_AGENTS
    assert len(signer.seal(adm.ticket)) < 2 << 20  # well within the 4 MiB
    assert fence.commit(adm.ticket, 1).vector_clock["bob"] == 1


def test_a_chain_whose_clocks_order_nothing_is_checked_in_linear_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Certificates whose clocks order none of the others (anyone may send such a chain
    to fence_verify) made the check compare every pair and list every pair: 10,000 took a
    minute and hundreds of MB on the server's loop (found by review). Comparisons are now
    at most MAX_OPEN_OVERLAPS per certificate, the list at most MAX_REPORTED_OVERLAPS
    pairs, and the report says it is incomplete; links and hashes are checked in full."""
    import effectfence.cert as cert_module
    from effectfence.cert import MAX_OPEN_OVERLAPS, MAX_REPORTED_OVERLAPS

    n = 4 * MAX_OPEN_OVERLAPS
    chain, parent = [], None
    for i in range(n):
        c = EffectCert(
            intent=f"i{i}", parent=parent, domain="d", seq=i + 1, tool="t", args={},
            result=None, vector_clock={}, read_set=[], agent="a",
        )  # fmt: skip
        chain.append(c)
        parent = c.hash
    compared = 0
    real = cert_module._happened_before

    def counted(a: Any, b: Any) -> bool:
        nonlocal compared
        compared += 1
        return real(a, b)

    monkeypatch.setattr(cert_module, "_happened_before", counted)
    report = verify_chain(chain)
    assert report.ok and report.length == n
    assert compared <= n * MAX_OPEN_OVERLAPS  # was n * (n - 1) / 2
    assert len(report.concurrent) == MAX_REPORTED_OVERLAPS and not report.concurrent_complete
    assert report.concurrent[0] == (0, 1)  # the first overlaps, listed exactly
    tampered = [*chain[:-1], EffectCert.from_dict({**chain[-1].to_dict(), "result": 1})]
    assert verify_chain(tampered).broken_at == n - 1  # the last link is still checked


def test_a_chain_of_a_few_overlaps_is_reported_complete() -> None:
    a = EffectCert(
        intent="a", parent=None, domain="d", seq=1, tool="t", args={}, result=None,
        vector_clock={"x": 1}, read_set=[], agent="x",
    )  # fmt: skip
    b = EffectCert(
        intent="b", parent=None, domain="d", seq=2, tool="t", args={}, result=None,
        vector_clock={"y": 1}, read_set=[], agent="y",
    )  # fmt: skip
    report = verify_chain([a, b])
    assert report.ok and report.concurrent == ((0, 1),) and report.concurrent_complete
