"""Wire tickets: authenticated, and refused when forged, edited, truncated or superseded."""

from __future__ import annotations

import base64
import json

import pytest
from support import FakeClock

from effectfence import EffectFence, EffectRequest, InvalidTicket, LeaseLost
from effectfence.tickets import TicketSigner


def _prepare(fence: EffectFence, agent: str = "a") -> str:
    adm = fence.prepare(EffectRequest("pay:1", "acct:1", "pay", {"cents": 10}, agent))
    assert adm.fresh
    return TicketSigner(b"k" * 32).seal(adm.ticket)


def test_round_trip(fence: EffectFence) -> None:
    signer = TicketSigner(b"k" * 32)
    wire = _prepare(fence)
    ticket = signer.open(wire)
    assert ticket.intent == "pay:1" and fence.commit(ticket, "ok").verify()


# a key shorter than SHA-256's 64-byte block is padded, a longer one hashed first
@pytest.mark.parametrize("key", [b"k" * 16, b"k" * 32, bytes(range(64)), b"\xff" * 65, b"q" * 200])
def test_the_mac_is_hmac_sha256_of_scope_nul_body(fence: EffectFence, key: bytes) -> None:
    """The wire format is shared by every process on a store (rolling upgrades included):
    however it is computed, the MAC stays HMAC-SHA256(key, scope || NUL || body), and the
    body is base64url without padding."""
    import hmac

    signer = TicketSigner(key, scope="store-7")
    wire = signer.seal(fence.prepare(EffectRequest("pay:2", "acct:1", "pay", {}, "a")).ticket)
    body, mac = wire.rsplit(".", 1)
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    assert body == base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert mac == hmac.digest(key, b"store-7\x00" + raw, "sha256").hex()
    assert signer.open(wire).intent == "pay:2"
    other = TicketSigner(key, scope="store-8")  # another store: refused
    with pytest.raises(InvalidTicket):
        other.open(wire)


def test_forged_edited_truncated_refused_and_change_nothing(fence: EffectFence) -> None:
    signer = TicketSigner(b"k" * 32)
    wire = _prepare(fence)
    body, mac = wire.rsplit(".", 1)
    data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    edited = dict(data, args={"cents": 10_000})
    edited_body = base64.urlsafe_b64encode(json.dumps(edited).encode()).decode().rstrip("=")
    before = fence.store.get("pay:1")
    for bad in (
        wire[:-1],  # truncated mac
        wire[: len(wire) // 2],  # truncated body
        edited_body + "." + mac,  # edited payload, old mac
        TicketSigner(b"x" * 32).seal(signer.open(wire)),  # another server's key
        body + "@@" + "." + mac,  # characters the decoder would skip
        body + "=" + "." + mac,  # padding it never carries
        "",
        "no-dot",
        42,
        *(  # the standard alphabet's spelling of the same bytes
            [body.replace("-", "+").replace("_", "/") + "." + mac]
            if "-" in body or "_" in body
            else []
        ),
    ):
        with pytest.raises(InvalidTicket):
            signer.open(bad)
    after = fence.store.get("pay:1")  # the same version (a durable store decodes anew)
    assert after is not None and before is not None
    assert (after.state, after.token, after.lease_until) == (
        before.state,
        before.token,
        before.lease_until,
    )
    fence.commit(signer.open(wire), "ok")


def test_the_standard_alphabets_spelling_of_a_ticket_is_refused(fence: EffectFence) -> None:
    signer = TicketSigner(b"k" * 32)
    for n in range(64):  # until a body has a character the two alphabets spell apart
        request = EffectRequest(f"pay:a{n}", "acct:1", "pay", {"note": "?>~" * n}, "a")
        wire = signer.seal(fence.prepare(request).ticket)
        body, mac = wire.rsplit(".", 1)
        if "-" in body or "_" in body:
            break
    else:
        raise AssertionError("no body with - or _")
    with pytest.raises(InvalidTicket):
        signer.open(body.replace("-", "+").replace("_", "/") + "." + mac)
    assert signer.open(wire).intent == f"pay:a{n}"


def test_a_ticket_whose_args_hold_a_large_integral_float_opens(fence: EffectFence) -> None:
    """Canonical JSON writes 1e16 as 10000000000000000; read back as an int it is past
    2**53 and the ticket was refused: the effect had run and could not be committed, and
    once the lease lapsed an identical call ran again (found by review)."""
    signer = TicketSigner(b"k" * 32)
    request = EffectRequest("pay:big", "acct:1", "pay", {"amount": 1e16, "n": [2.0**60]}, "a")
    wire = signer.seal(fence.prepare(request).ticket)
    ticket = signer.open(wire)
    assert ticket.args == {"amount": 1e16, "n": [2.0**60]}
    assert fence.commit(ticket, "paid").verify()


def test_replayed_after_takeover_is_lease_lost(fence: EffectFence, clock: FakeClock) -> None:
    signer = TicketSigner(b"k" * 32)
    old_wire = _prepare(fence)
    clock.advance(10.0)
    new = fence.prepare(EffectRequest("pay:1", "acct:1", "pay", {"cents": 10}, "b"))
    assert new.fresh
    with pytest.raises(LeaseLost):
        fence.commit(signer.open(old_wire), "stale")
    assert fence.store.get("pay:1").token == new.ticket.token  # type: ignore[union-attr]


def test_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EFFECTFENCE_TICKET_KEY", "shared-secret-of-enough-length")
    a, b = TicketSigner(), TicketSigner()
    fence = EffectFence()
    adm = fence.prepare(EffectRequest("i", "d", "t", {}))
    assert b.open(a.seal(adm.ticket)).token == adm.ticket.token
    monkeypatch.setenv("EFFECTFENCE_TICKET_KEY", "short")
    with pytest.raises(ValueError):
        TicketSigner()
    assert "zq" not in repr(TicketSigner(b"zq" * 16))


def test_a_mac_that_is_not_64_lowercase_hex_is_refused_malformed(fence: EffectFence) -> None:
    """Non-ASCII in the MAC once reached hmac.compare_digest, which raised TypeError: an
    untyped error instead of a refusal."""
    signer = TicketSigner(b"k" * 32)
    wire = _prepare(fence)
    body, mac = wire.rsplit(".", 1)
    for bad in (
        "eyJ9." + "\u00e9" * 64,  # the reviewer's: 64 characters, none of them ASCII
        f"{body}.{mac[:-1]}\u00e9",  # the genuine MAC, its last digit made non-ASCII
        body + "." + "\uff10" * 64,  # fullwidth digits: digits, but not hex
        f"{body}.{mac.upper()}",
        f"{body}.{mac[:-1]} ",
        f"{body}.{mac[:-1]}\n",
    ):
        with pytest.raises(InvalidTicket, match="malformed ticket"):
            signer.open(bad)
    fence.commit(signer.open(wire), "ok")  # the genuine ticket is untouched
