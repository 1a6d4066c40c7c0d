"""Tickets that cross a process boundary, authenticated with HMAC-SHA256 (G10).

A ticket on the wire is ``base64url(canonical JSON) "." hex(HMAC-SHA256(key, canonical
JSON))``. The key is ``EFFECTFENCE_TICKET_KEY`` if the operator sets one, else the store's
own sealing key (:meth:`TicketSigner.for_store`), so servers sharing a durable store open
each other's tickets with no configuration. A forged, edited or truncated ticket fails the
MAC and is refused ``invalid_ticket`` before the fence looks at it; a genuine ticket whose
lease was taken over is refused ``lease_lost`` by the fence itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
from typing import Any

from effectfence.canonical import CanonicalError, canonical_bytes, json_loads
from effectfence.cert import CERT_MAX_DEPTH
from effectfence.errors import InvalidRequest, InvalidTicket
from effectfence.model import PreparedEffect

__all__ = ["TICKET_KEY_ENV", "TicketSigner"]

TICKET_KEY_ENV = "EFFECTFENCE_TICKET_KEY"
_MAX_WIRE = 4 << 20
_MAC = re.compile(r"[0-9a-f]{64}")
_BLOCK = 64  # SHA-256's block size, the HMAC key's padded length
_IPAD = bytes(b ^ 0x36 for b in range(256))  # translate tables: key XOR ipad / opad
_OPAD = bytes(b ^ 0x5C for b in range(256))
_URLSAFE = bytes.maketrans(b"+/", b"-_")


class TicketSigner:
    """Seals tickets for the wire and opens them again, refusing any that were altered."""

    __slots__ = ("_inner", "_outer", "_scope")

    def __init__(self, key: bytes | None = None, *, scope: str = "") -> None:
        if key is None:
            env = os.environ.get(TICKET_KEY_ENV)
            key = env.encode() if env else secrets.token_bytes(32)
        if len(key) < 16:
            raise ValueError(f"a ticket key needs at least 16 bytes ({TICKET_KEY_ENV})")
        # The store a ticket belongs to is part of what is authenticated: two processes that
        # share a key but not a store (each its own memory) can never honour each other's
        # tickets, whose tokens come from unrelated counters.
        self._scope = scope.encode()
        # HMAC-SHA256 (RFC 2104) keyed once: the inner hash already holds the padded key and
        # the scope, the outer one its padded key; each ticket hashes copies (see _mac). The
        # key itself is kept nowhere else.
        block = key if len(key) <= _BLOCK else hashlib.sha256(key).digest()
        block = block.ljust(_BLOCK, b"\x00")
        self._inner = hashlib.sha256(block.translate(_IPAD) + self._scope + b"\x00")
        self._outer = hashlib.sha256(block.translate(_OPAD))

    @classmethod
    def for_store(cls, store: Any) -> TicketSigner:
        """The signer of every process sharing ``store``: the operator's key
        (``EFFECTFENCE_TICKET_KEY``) if set, else the key kept in the store itself, so a
        ticket sealed by one server opens in every other on the same ledger."""
        env = os.environ.get(TICKET_KEY_ENV)
        key = env.encode() if env else store.sealing_key()
        return cls(key, scope=store.ticket_scope)

    def __repr__(self) -> str:
        return "TicketSigner(key=<hidden>)"

    def _mac(self, body: bytes) -> str:
        # Copies of the keyed states, not hmac.digest: the one-shot call lets go of the GIL
        # around its ~2 us of hashing, and with another thread busy (a server's workers)
        # getting it back made it ~35 us a call, against ~6 for this (measured in one
        # process beside a spinning thread); an update under 2 KiB keeps the GIL. Two hash
        # copies, not a copy of an hmac object: ~4 us less per fresh prepare inside a
        # serving MCP process (paired with the old seal in one server), the same MAC
        # (tests/test_tickets.py).
        inner = self._inner.copy()
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()

    def seal(self, ticket: PreparedEffect) -> str:
        """The wire form; refused (InvalidRequest) if :meth:`open` would refuse it as too
        large, so no one is ever handed a ticket that cannot be committed."""
        try:
            # as deep as the fence admits: the ticket holds args one level down, as a
            # certificate does (sealed at 64, deeper admitted args crashed prepare after
            # the claim, found by review)
            body = canonical_bytes(ticket.to_dict(), max_depth=CERT_MAX_DEPTH)
        except CanonicalError as exc:  # a refusal, so a caller lets the claim go
            raise InvalidRequest(
                f"the ticket for {ticket.intent!r} cannot be sealed: {exc}", intent=ticket.intent
            ) from exc
        # base64url without padding, straight from binascii (what urlsafe_b64encode wraps)
        head = binascii.b2a_base64(body, newline=False).translate(_URLSAFE).rstrip(b"=")
        wire = head.decode() + "." + self._mac(body)
        if len(wire) > _MAX_WIRE:
            raise InvalidRequest(
                f"the ticket for {ticket.intent!r} would be {len(wire)} bytes, over the "
                f"{_MAX_WIRE} a ticket may carry: send smaller args, fewer read-set entries or a "
                "smaller known_clock",
                intent=ticket.intent,
            )
        return wire

    def open(self, wire: object) -> PreparedEffect:
        if type(wire) is not str or not wire or len(wire) > _MAX_WIRE:
            raise InvalidTicket("a ticket must be the non-empty string prepare returned")
        head, dot, mac = wire.rpartition(".")
        # checked before compare_digest, which raises TypeError (not a refusal) on non-ASCII
        if not dot or not _MAC.fullmatch(mac):
            raise InvalidTicket("malformed ticket: expected <body>.<mac of 64 lowercase hex>")
        try:
            body = base64.urlsafe_b64decode(head + "=" * (-len(head) % 4))
        except (binascii.Error, ValueError) as exc:
            raise InvalidTicket("malformed ticket body") from exc
        # the decoder drops characters outside its alphabet and ignores padding bits: a
        # ticket is the one wire string seal made, not any that decodes to its body
        if base64.urlsafe_b64encode(body).rstrip(b"=") != head.encode("ascii", "replace"):
            raise InvalidTicket("malformed ticket body: not the form prepare returned")
        if not hmac.compare_digest(self._mac(body), mac):
            raise InvalidTicket("ticket authentication failed: forged, edited or truncated")
        try:
            # canonical JSON writes an integral float past 2**53 without a fraction (1e16:
            # 10000000000000000); json_loads reads it back as the float it was, where a
            # plain parser made it an int the re-encoding refuses: the ticket of an effect
            # that ran could not be committed (found by review)
            data = json_loads(body)
            if canonical_bytes(data, max_depth=CERT_MAX_DEPTH) != body:
                raise InvalidTicket("ticket body is not canonical")
            return PreparedEffect.from_dict(data)
        except (ValueError, CanonicalError, InvalidRequest) as exc:
            raise InvalidTicket(f"malformed ticket: {exc}") from exc
