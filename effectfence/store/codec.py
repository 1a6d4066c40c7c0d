"""How durable stores write records and certificates: one encoding for all of them.

A certificate is kept as its JSON form (:meth:`EffectCert.to_dict`, canonical bytes), so a
replay in any process rebuilds the same certificate, hash included, and ``verify()`` still
recomputes it from the fields: a store that corrupts a byte is caught, never trusted.
A record's other fields are plain columns (or hash fields), named by :data:`RECORD_FIELDS`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from effectfence.canonical import canonical_bytes, json_loads
from effectfence.cert import CERT_MAX_DEPTH, EffectCert
from effectfence.protocol import IntentRecord, State

__all__ = [
    "RECORD_FIELDS",
    "CertCache",
    "cert_from_json",
    "cert_to_json",
    "decode_deadline",
    "encode_deadline",
    "entry_from_json",
    "entry_to_json",
    "record_from_row",
    "record_to_row",
]

#: the columns of a stored record, in this order (``cert`` holds :func:`cert_to_json`)
RECORD_FIELDS = (
    "intent",
    "state",
    "token",
    "fingerprint",
    "domain",
    "agent",
    "lease_until",
    "cert",
    "until",
    "reason",
    "since",
    "seq",
    "reclaim_at",
)

_STATES = {s.value: s for s in State}
#: what a stored "never" looks like where a column can't hold infinity (JSON, some SQL)
NEVER = 1e300


def cert_to_json(cert: EffectCert) -> bytes:
    """RFC 8785 bytes of the certificate's JSON form (with its hash)."""
    return canonical_bytes(cert.to_dict(), max_depth=CERT_MAX_DEPTH)


def cert_from_json(data: bytes | str) -> EffectCert:
    """The certificate back from :func:`cert_to_json`; its hash is kept as stored."""
    return EffectCert.from_dict(json_loads(data.encode() if isinstance(data, str) else data))


class CertCache:
    """Certificates by their stored bytes: a replay decodes each one once, not every time.

    Certificates are immutable, so one decoded object serves every replay of it. A commit
    that applied hands its certificate in (:meth:`keep`): the bytes were made from it, so
    the first replay in this process costs no decode either. Bounded: when full it starts
    over; a miss only costs a decode."""

    __slots__ = ("_by_bytes", "size")

    def __init__(self, size: int = 4096) -> None:
        self._by_bytes: dict[bytes, EffectCert] = {}
        self.size = size

    def decode(self, data: bytes) -> EffectCert:
        cert = self._by_bytes.get(data)
        if cert is None:
            cert = cert_from_json(data)
            self.keep(data, cert)
        return cert

    def keep(self, data: bytes, cert: EffectCert) -> None:
        """``data`` is :func:`cert_to_json` of ``cert``."""
        by_bytes = self._by_bytes
        if len(by_bytes) >= self.size:
            by_bytes.clear()
        by_bytes[data] = cert


def entry_to_json(entry: Any) -> str:
    """An audit entry as stored: JSON text, without the ``id`` and ``at`` the store adds."""
    body = {k: v for k, v in dict(entry).items() if k not in ("id", "at")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    try:  # the ASCII form writes a lone surrogate as an escape no strict reader takes
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("an audit entry must be valid Unicode text (a lone surrogate)") from exc
    return text


def entry_from_json(data: bytes | str, id: int, at: float) -> dict[str, Any]:
    """An audit entry back, with the ``id`` and ``at`` the store recorded (a fresh dict)."""
    entry: dict[str, Any] = json_loads(data.encode() if isinstance(data, str) else bytes(data))
    entry["id"] = int(id)
    entry["at"] = float(at)
    return entry


def encode_deadline(t: float) -> float:
    return NEVER if t == math.inf else t


def decode_deadline(t: float) -> float:
    return math.inf if t >= NEVER else float(t)


def record_to_row(rec: IntentRecord) -> tuple[Any, ...]:
    """The record as a tuple in :data:`RECORD_FIELDS` order, JSON- and SQL-safe."""
    return (
        rec.intent,
        rec.state.value,
        rec.token,
        rec.fingerprint,
        rec.domain,
        rec.agent,
        encode_deadline(rec.lease_until),
        None if rec.cert is None else cert_to_json(rec.cert),
        encode_deadline(rec.until),
        rec.reason,
        rec.since,
        rec.seq,
        encode_deadline(rec.reclaim_at),
    )


def record_from_row(row: Any) -> IntentRecord:
    """A record from a row in :data:`RECORD_FIELDS` order (a tuple, or a mapping by name)."""
    if isinstance(row, dict):
        row = tuple(row[f] for f in RECORD_FIELDS)
    (intent, state, token, fp, domain, agent, lease_until, cert, until, reason, since, seq,
     reclaim_at) = row  # fmt: skip
    return IntentRecord(
        intent,
        _STATES[state],
        int(token),
        bytes(fp),
        domain,
        agent,
        decode_deadline(float(lease_until)),
        None
        if cert is None
        else cert_from_json(bytes(cert) if not isinstance(cert, str) else cert),
        decode_deadline(float(until)),
        reason or "",
        float(since),
        int(seq),
        decode_deadline(float(reclaim_at)),
    )
