"""effectfence: exactly one attempt runs a side effect; every other learns what happened.

>>> fence = EffectFence()
>>> adm = fence.prepare(EffectRequest("charge:order-123", "order:123", "charge", {"cents": 500}))
>>> if adm.fresh:
...     cert = fence.commit(adm.ticket, {"charged": 500})   # after running the effect
... else:
...     cert = adm.cert                                      # it already ran: do not run it
>>> cert.verify()
True

The protocol core (protocol, fence, model, cert, clock, canonical, errors, tickets) does no
I/O. The MCP server, ``wrap`` and ``scan`` are separate rooms that import the core, never
the other way round; importing ``effectfence`` never imports ``mcp``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from effectfence.canonical import CanonicalError, canonical_bytes
from effectfence.cert import CERT_FORMAT, ChainReport, EffectCert, verify_chain
from effectfence.clock import VectorClock
from effectfence.counters import BACKEND as COUNTERS_BACKEND
from effectfence.decorator import FencedCall, fenced
from effectfence.errors import (
    DomainRace,
    FenceError,
    IntentConflict,
    IntentFailed,
    IntentInFlight,
    InvalidRequest,
    InvalidTicket,
    LeaseLost,
    ReadSetStale,
    Refusal,
    StoreUnavailable,
)
from effectfence.fence import (
    DEFAULT_LEASE_TTL,
    DEFAULT_RESULT_TTL,
    AuditEntry,
    EffectFence,
    FenceConfig,
    IntentStatus,
)
from effectfence.model import (
    Admission,
    EffectRequest,
    Fresh,
    PreparedEffect,
    ReadSetEntry,
    Replay,
)

__version__ = "0.1.0"

__all__ = [
    "CERT_FORMAT",
    "COUNTERS_BACKEND",
    "DEFAULT_LEASE_TTL",
    "DEFAULT_RESULT_TTL",
    "Admission",
    "AuditEntry",
    "CanonicalError",
    "ChainReport",
    "DomainRace",
    "EffectCert",
    "EffectFence",
    "EffectRequest",
    "FenceConfig",
    "FenceError",
    "FencedCall",
    "Fresh",
    "IntentConflict",
    "IntentFailed",
    "IntentInFlight",
    "IntentStatus",
    "InvalidRequest",
    "InvalidTicket",
    "LeaseLost",
    "PreparedEffect",
    "ReadSetEntry",
    "ReadSetStale",
    "Refusal",
    "Replay",
    "StoreUnavailable",
    "VectorClock",
    "__version__",
    "abort_effect",
    "canonical_bytes",
    "commit_effect_cert",
    "default_fence",
    "fenced",
    "prepare_effect_fence",
    "release_effect",
    "renew_lease",
    "verify_chain",
]

_default: EffectFence | None = None
_default_lock = threading.Lock()


def default_fence() -> EffectFence:
    """The process-wide fence the functional API uses when none is passed. Made once under
    a lock: two threads' first calls each made a fence of its own, and both were admitted
    for the same intent (found by review)."""
    global _default
    fence = _default
    if fence is None:
        with _default_lock:
            fence = _default
            if fence is None:
                fence = _default = EffectFence()
    return fence


def prepare_effect_fence(
    intent: str,
    domain: str,
    tool: str,
    args: Mapping[str, Any] | None = None,
    agent: str = "anonymous",
    *,
    read_set: Iterable[Any] | None = None,
    parent: str | None = None,
    known_clock: Mapping[str, int] | None = None,
    expected_seq: int | None = None,
    fence: EffectFence | None = None,
) -> Admission:
    """Ask to run an effect: Fresh (run it, then commit) or Replay (it already ran)."""
    return (fence or default_fence()).request(
        intent,
        domain,
        tool,
        args,
        agent,
        read_set=read_set,
        parent=parent,
        known_clock=known_clock,
        expected_seq=expected_seq,
    )


def commit_effect_cert(
    ticket: PreparedEffect, result: Any, *, fence: EffectFence | None = None
) -> EffectCert:
    """Record the result of an effect that ran; returns its certificate."""
    return (fence or default_fence()).commit(ticket, result)


def abort_effect(
    ticket: PreparedEffect, reason: str = "aborted", *, fence: EffectFence | None = None
) -> None:
    """The outcome is unknown: fence the intent until an operator clears it."""
    (fence or default_fence()).abort(ticket, reason)


def release_effect(ticket: PreparedEffect, *, fence: EffectFence | None = None) -> None:
    """The effect definitely did not fire: free the intent for a retry."""
    (fence or default_fence()).release(ticket)


def renew_lease(
    ticket: PreparedEffect, ttl: float | None = None, *, fence: EffectFence | None = None
) -> float:
    """Extend the ticket's lease; returns the new deadline."""
    return (fence or default_fence()).renew(ticket, ttl)
