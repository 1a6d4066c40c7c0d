"""What the MCP server tells its operator: one log line per decision, and Prometheus metrics.

Both are fed by the same record, a :class:`Decision`, filled in while a tool call runs:
who asked (the principal, when the transport names one), about which intent and domain,
what the fence answered (``fresh``, ``replay``, ``committed``, ... or a refusal code), the
fencing token and how long the fence (and so its store) took. Never the args or the result:
they are the caller's data and may carry secrets.

Logs are standard :mod:`logging` on the ``effectfence.mcp.decisions`` logger at INFO, so an
embedding application routes them as it likes; ``effectfence serve`` writes them as JSON lines
on stderr (:func:`configure_logging`). Metrics are plain counters updated on the event loop
thread (one writer, no locks) and rendered in the Prometheus text format (version 0.0.4) by
:meth:`Metrics.render`; the fence's own statistics are read per scrape; when the store does
not answer, its record counts are left out and ``effectfence_store_up`` is 0.

This module imports neither ``mcp`` nor any HTTP library.
"""

from __future__ import annotations

import bisect
import json
import logging
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effectfence.fence import EffectFence

__all__ = ["DECISION_LOGGER", "Decision", "Metrics", "configure_logging"]

DECISION_LOGGER = "effectfence.mcp.decisions"
_log = logging.getLogger(DECISION_LOGGER)

#: upper bounds (seconds) of the fence-latency histogram: a memory fence answers in
#: microseconds, a SQLite one in tens of microseconds to milliseconds, a remote one in more
LATENCY_BUCKETS = (
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class Decision:
    """One tool call as the operator sees it. Filled in by the tool, logged by the server."""

    __slots__ = (
        "domain",
        "intent",
        "latency",
        "outcome",
        "principal",
        "ticket",
        "token",
        "tool",
        "transport",
    )

    def __init__(self, tool: str, principal: str | None) -> None:
        self.tool = tool
        self.principal = principal
        #: "http" or "stdio" (stdio also stands for in memory and direct calls)
        self.transport = "stdio"
        self.intent: str | None = None
        self.domain: str | None = None
        self.token: int | None = None
        self.outcome = "error"
        #: seconds spent in the fence (the store's share of the call), None if not reached
        self.latency: float | None = None
        #: the ticket a fresh prepare handed out (never logged): released if its caller
        #: went away before receiving it
        self.ticket: Any = None

    def log(self) -> None:
        if _log.isEnabledFor(logging.INFO):
            _log.info("decision", extra={"decision": self.fields()})

    def fields(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "intent": self.intent,
            "domain": self.domain,
            "principal": self.principal,
            "outcome": self.outcome,
            "token": self.token,
            "latency_ms": None if self.latency is None else round(self.latency * 1000, 3),
        }


class _JsonLines(logging.Formatter):
    """Every record as one JSON object: decisions carry their fields, others a message."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        decision = getattr(record, "decision", None)
        if isinstance(decision, dict):
            line["event"] = "decision"
            line.update(decision)
        else:
            line["message"] = record.getMessage()
            if record.exc_info:
                line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure_logging(level: str) -> None:
    """JSON lines on stderr at ``level`` (``off`` for nothing but warnings of the SDK)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    decisions = logging.getLogger(DECISION_LOGGER)
    if level == "off":
        decisions.setLevel(logging.CRITICAL + 1)
    else:
        decisions.setLevel(level.upper())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


#: tickets the in-flight gauge tracks at most (abandoned ones that nobody takes over would
#: otherwise grow it for ever): the oldest is forgotten first
MAX_HELD = 100_000
#: what ends a ticket handed out here: finished through here, cleared by fence_clear, or
#: refused lease_lost (its record was cleared elsewhere, or lapsed and swept: it can never
#: finish; a takeover already replaced it, see observe)
_FINISHED = frozenset(("committed", "aborted", "released", "cleared", "lease_lost"))


class Metrics:
    """Counters for the Prometheus text format, fed with :class:`Decision` records."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        #: intent -> token of each ticket handed out here and not yet finished through here,
        #: oldest first. Ordered, not a dict: forgetting a dict's first key scans past every
        #: one deleted before it, ~24 us an observed fresh prepare once full (measured)
        self._held: OrderedDict[str, int | None] = OrderedDict()
        self._bounds = LATENCY_BUCKETS
        self._hist: dict[str, list[int]] = {}
        self._sum: dict[str, float] = {}
        self.started = time.time()

    def observe(self, d: Decision) -> None:
        self.calls[(d.tool, d.outcome)] += 1
        if d.latency is not None:
            buckets = self._hist.get(d.tool)
            if buckets is None:
                buckets = self._hist[d.tool] = [0] * (len(self._bounds) + 1)
            buckets[bisect.bisect_left(self._bounds, d.latency)] += 1
            self._sum[d.tool] = self._sum.get(d.tool, 0.0) + d.latency
        # tickets handed out here and not yet finished through here, known by intent and
        # token: a retried commit (answered "committed" again, G3) finishes nothing twice
        # (found by review: the gauge went down once per retry). A lapsed lease counts until
        # it is taken over; a takeover replaces the ticket it took over.
        if d.intent is None:
            return
        if d.outcome in ("fresh", "takeover"):
            self._held.pop(d.intent, None)  # re-inserted last: the newest is forgotten last
            self._held[d.intent] = d.token
            if len(self._held) > MAX_HELD:
                self._held.popitem(last=False)
            return
        finished = d.outcome in _FINISHED or (
            d.tool == "fence_commit" and d.outcome == "read_set_stale"
        )
        if finished and d.intent in self._held and self._held[d.intent] == d.token:
            del self._held[d.intent]

    @property
    def in_flight(self) -> int:
        """Tickets handed out by this server not yet finished through it."""
        return len(self._held)

    def render(self, fence: EffectFence, stats: dict[str, Any] | None = None) -> str:
        """The text of ``/metrics``; ``stats`` is ``fence.stats()`` (read here if not
        given), without ``size`` when the store did not answer: its record counts are then
        left out and ``effectfence_store_up`` is 0, so a scrape during an outage succeeds."""
        from effectfence import __version__

        s = stats if stats is not None else fence.stats()
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                v = repr(float(value)) if isinstance(value, float) else str(value)
                out.append(f"{name}{labels} {v}")

        store, counters = str(fence.store.name), str(fence.store.counters_backend)
        family(
            "effectfence_info",
            "gauge",
            "This server: version, store and counter table.",
            [(_labels(version=__version__, store=store, counters=counters), 1)],
        )
        family(
            "effectfence_store_up",
            "gauge",
            "1 if the store answered this scrape; 0 if not (effectfence_store_records is "
            "then left out).",
            [("", 1 if "size" in s else 0)],
        )
        family(
            "effectfence_prepare_attempts_total",
            "counter",
            "Prepare attempts by outcome: admitted, replayed, or the refusal code.",
            [(_labels(outcome=k), v) for k, v in s["prepare"].items()],
        )
        for event, help_ in (
            ("commits", "Effects committed (certificates minted)."),
            ("aborts", "Attempts aborted: outcome unknown, intent fenced."),
            ("releases", "Attempts released: the effect did not fire."),
            ("renewals", "Leases renewed."),
            ("takeovers", "Lapsed leases taken over by a new attempt."),
            ("clears", "Intents cleared by an operator."),
            ("reclaimed", "Expired records reclaimed by sweeps."),
            ("stale_commits", "Commits refused read_set_stale (the intent failed)."),
            ("refused_ticket_ops", "Commit, abort, release or renew refused by the fence."),
        ):
            if event in s:
                family(f"effectfence_{event}_total", "counter", help_, [("", s[event])])
        family(
            "effectfence_tool_calls_total",
            "counter",
            "MCP tool calls by tool and outcome (the answer, or the refusal code).",
            [(_labels(tool=t, outcome=o), n) for (t, o), n in sorted(self.calls.items())],
        )
        family(
            "effectfence_in_flight",
            "gauge",
            "Tickets handed out by this server not yet committed, aborted, released or "
            "cleared through it, nor refused lease_lost (a lapsed lease counts until it is "
            "taken over; at most "
            f"{MAX_HELD:,} are tracked, the oldest forgotten first).",
            [("", self.in_flight)],
        )
        if "size" in s:
            family(
                "effectfence_store_records",
                "gauge",
                "Intent records the store holds now (in flight, done and failed).",
                [("", int(s["size"].get("records", 0)))],
            )
        out.append(
            "# HELP effectfence_fence_seconds Time spent in the fence (its store) per tool call."
        )
        out.append("# TYPE effectfence_fence_seconds histogram")
        for tool in sorted(self._hist):
            counts = self._hist[tool]
            running = 0
            for bound, n in zip((*self._bounds, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f"effectfence_fence_seconds_bucket{_labels(tool=tool, le=le)} {running}")
            out.append(f"effectfence_fence_seconds_sum{_labels(tool=tool)} {self._sum[tool]!r}")
            out.append(f"effectfence_fence_seconds_count{_labels(tool=tool)} {running}")
        family(
            "effectfence_start_time_seconds",
            "gauge",
            "When this server started (Unix time).",
            [("", self.started)],
        )
        return "\n".join(out) + "\n"
