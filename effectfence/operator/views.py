"""What the operator sees: one intent, one audit entry, a list, as plain JSON-able dicts.

Shared by the commands and the console so both say the same thing. Args and results are
left out unless the caller asks (``show_payload``): they may hold personal data. A
certificate is then named by its hash, seq, parent, tool and agent, and still verified.
"""

from __future__ import annotations

import argparse
import getpass
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from effectfence.canonical import MAX_SAFE_INTEGER
from effectfence.fence import AuditEntry, EffectFence, FenceConfig, _check_name
from effectfence.protocol import IntentRecord, Row, State, observe

__all__ = [
    "STATE_FILTERS",
    "clear_view",
    "entry_view",
    "format_age",
    "intent_view",
    "list_intents",
    "open_fence",
    "parse_duration",
    "printable",
    "whoami",
    "whole_number",
]

#: what ``--state`` accepts, and the stored states each one means
STATE_FILTERS: dict[str, tuple[State, ...]] = {
    "in-flight": (State.IN_FLIGHT,),
    "failed": (State.FAILED,),
    "done": (State.DONE,),
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def open_fence(url: str | None) -> EffectFence:
    """A fence on the store a URL names (None: the servers' default store). The operator's
    fence never sweeps on its own, and opens only a store that is there: looking changes
    nothing, and a mistyped URL is told so, not shown an empty store it just made
    (:class:`~effectfence.store.StoreMissing`)."""
    from effectfence.store import default_store_url, is_memory_url, open_store

    # looking makes no directory either (found by a docs trial)
    target = default_store_url(create=False) if url is None else url
    config = FenceConfig(auto_sweep=False)
    if is_memory_url(target):
        return EffectFence(config)
    return EffectFence(config, store=open_store(target, create=False))


def whoami() -> str:
    """The OS user, the default ``who`` of a clear."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        return "unknown"


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 10m, 2h, 1d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_age(seconds: float | None) -> str:
    """``42s``, ``3m12s``, ``5h03m``, ``2d04h``; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def cert_view(cert: Any, *, show_payload: bool) -> dict[str, Any]:
    """A certificate as the operator sees it: verified, and without args and result unless
    asked."""
    out: dict[str, Any] = {
        "hash": cert.hash,
        "verifies": cert.verify(),
        "domain": cert.domain,
        "seq": cert.seq,
        "parent": cert.parent,
        "tool": cert.tool,
        "agent": cert.agent,
        "vector_clock": cert.vector_clock,
        "read_set": [list(p) for p in cert.read_set],
    }
    if show_payload:
        out["args"] = cert.args
        out["result"] = cert.result
    return out


def intent_view(
    intent: str, rec: IntentRecord | None, now: float, *, show_payload: bool = False
) -> dict[str, Any]:
    """One intent at ``now`` (the store's clock): its row of the state table and the facts
    of that row. ``age`` is how long it has been failed, or how long its lease has lapsed;
    ``lease_left`` how long a live lease still runs."""
    row = observe(rec, now)
    out: dict[str, Any] = {"intent": intent, "state": row.value}
    if rec is None:
        return out
    out.update(
        domain=rec.domain, seq=rec.seq, holder=rec.agent, token=rec.token, age=None, detail=""
    )
    if row is Row.IN_FLIGHT_LIVE:
        out["lease_left"] = rec.lease_until - now
        out["detail"] = f"lease {format_age(rec.lease_until - now)} left"
    elif row is Row.IN_FLIGHT_LAPSED:
        out["lease_left"] = 0.0
        out["age"] = now - rec.lease_until
        out["detail"] = f"lease lapsed {format_age(now - rec.lease_until)} ago"
    elif row is Row.FAILED:
        out["failure"] = rec.reason
        out["age"] = max(0.0, now - rec.since)
        out["detail"] = rec.reason
    elif rec.cert is not None:
        out["result_left"] = rec.until - now if math.isfinite(rec.until) else None
        out["cert"] = cert_view(rec.cert, show_payload=show_payload)
        out["detail"] = f"cert {rec.cert.hash[:16]}"
    return out


def entry_view(entry: AuditEntry, now: float) -> dict[str, Any]:
    """An audit entry with its age (store clock) and, for people, an approximate wall time
    (this host's clock minus that age: the memory store's clock is not a calendar)."""
    out = entry.to_dict()
    age = max(0.0, now - entry.at)
    out["age"] = age
    out["when"] = _iso(time.time() - age)
    return out


def clear_view(intent: str, entry: AuditEntry | None) -> dict[str, Any]:
    """What a clear answers a client (MCP's fence_clear, wrap's effectfence_clear): whether
    there was a record, its state, and the audit entry that records who cleared it and why."""
    if entry is None:
        return {"intent": intent, "cleared": False, "previous_state": "absent"}
    return {
        "intent": intent,
        "cleared": True,
        "previous_state": str(entry.previous.get("state", "absent")),
        "audit_id": entry.id,
        "who": entry.who,
        "reason": entry.reason,
        "forced": entry.forced,
    }


#: records an agent or age filter looks through (the store filters state and domain)
FILTER_SCAN = 100_000


def whole_number(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to 2**53-1 (past it, no store's driver
    takes it: a traceback, found by review), named ``what`` in the complaint."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= MAX_SAFE_INTEGER:
            raise argparse.ArgumentTypeError(
                f"expected {what} (a whole number, {low} to 2**53-1), got {text!r}"
            )
        return value

    return parse


def printable(value: object) -> str:
    """``value`` as text for a terminal: characters that are not printable (a newline, a
    carriage return, an escape sequence) written as escapes. Names and reasons come from
    agents: printed raw, one name forged a whole row of ``intents list`` and sent escape
    sequences to the operator's terminal (found by review)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def list_intents(
    fence: EffectFence,
    *,
    states: Sequence[str] = (),
    domain: str | None = None,
    agents: Iterable[str] = (),
    older_than: float | None = None,
    limit: int = 1000,
    show_payload: bool = False,
) -> list[dict[str, Any]]:
    """Records of the given state filters (``STATE_FILTERS`` keys; none: all), domain and
    agents, as :func:`intent_view` dicts, at most ``limit``. ``older_than`` keeps failed
    intents failed that long and in-flight ones whose lease lapsed that long ago (the store
    keeps no other age). The store filters by state and domain; agents and age are judged
    here, over up to :data:`FILTER_SCAN` records (the first ``limit`` records alone hid
    every match past them, found by review)."""
    if domain is not None:
        _check_name("domain", domain)  # typed, not a driver's error (a non-UTF-8 argv)
    for agent in agents:
        _check_name("agent", agent)
    wanted: list[State] = []
    for name in states:
        wanted.extend(STATE_FILTERS[name])
    who = set(agents)
    store = fence.store
    now = store.now()
    out: list[dict[str, Any]] = []
    if limit <= 0:
        return out
    scan = max(limit, FILTER_SCAN) if who or older_than is not None else limit
    for rec in store.records(states=tuple(wanted), domain=domain, limit=scan):
        if who and rec.agent not in who:
            continue
        view = intent_view(rec.intent, rec, now, show_payload=show_payload)
        if older_than is not None and not (view["age"] is not None and view["age"] >= older_than):
            continue
        out.append(view)
        if len(out) >= limit:
            break
    return out
