"""Requests, tickets and admissions: the values that cross the fence's surface.

Plain slotted classes, not pydantic: they sit on the hot path, and their checks are the few
type tests the protocol needs. Pydantic models live at the boundaries (MCP, files).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from effectfence import _accel
from effectfence.cert import EffectCert
from effectfence.clock import VectorClock
from effectfence.errors import InvalidRequest

__all__ = [
    "MAX_KNOWN_COUNTER",
    "MAX_NAME_LENGTH",
    "Admission",
    "EffectRequest",
    "Fresh",
    "PreparedEffect",
    "ReadSetEntry",
    "Replay",
]

MAX_NAME_LENGTH = 512
#: bounds on what a request may carry besides its args: these end up in every ticket
MAX_READ_SET = 256
MAX_CLOCK_AGENTS = 256
#: the largest counter a ``known_clock`` may name, for any agent (2**52). A domain's head
#: clock is the merge of its tickets' clocks, so a caller could otherwise park another
#: agent's counter at the JSON-safe edge (2**53-1) and every later attempt of that agent on
#: the domain would be refused after reserving a seq (G7). Under this bound an agent's own
#: counter only ever grows past 2**52 by its own commits, 2**52 of them before the edge.
MAX_KNOWN_COUNTER = 2**52
_SEQ_MAX = 2**53 - 2  # seqs go into certificates: keep seq+1 JSON-safe (RFC 8785)


#: a certificate's hash: lowercase hex SHA-256 (cert.py)
_is_hash = re.compile(r"[0-9a-f]{64}").fullmatch


class ReadSetEntry(NamedTuple):
    """When I decided, ``domain`` was at ``seq``."""

    domain: str
    seq: int


def _name(field: str, value: object) -> str:
    if type(value) is not str or not value:
        raise InvalidRequest(f"{field} must be a non-empty string, got {type(value).__name__}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidRequest(f"{field} is longer than {MAX_NAME_LENGTH} characters")
    _utf8(field, value)
    return value


def _utf8(field: str, value: str) -> None:
    """Every name ends up in a certificate and in a store's text: one that cannot be
    encoded (a lone surrogate) or held (NUL: PostgreSQL's text and jsonb refuse it) must
    be refused now, not discovered at commit after the effect ran."""
    if "\x00" in value:
        raise InvalidRequest(f"{field} contains a NUL character, which a store cannot hold")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{field} is not valid Unicode text (a lone surrogate)") from exc


def _seq(field: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= _SEQ_MAX:
        raise InvalidRequest(f"{field} must be an integer in [0, 2**53-2], got {value!r}")
    return value


def _read_set(entries: Iterable[Any] | None) -> tuple[ReadSetEntry, ...]:
    if not entries:
        return ()
    if isinstance(entries, str | bytes | Mapping) or not isinstance(entries, Iterable):
        # read_set=5 raised a bare TypeError, past the count of refusals (found by review)
        raise InvalidRequest("read_set must be a list of [domain, seq] pairs")
    out: list[ReadSetEntry] = []
    seen: dict[str, int] = {}
    for e in entries:
        if len(out) >= MAX_READ_SET:
            raise InvalidRequest(f"read_set has more than {MAX_READ_SET} entries")
        if isinstance(e, Mapping):
            d, s = e.get("domain"), e.get("seq")
        elif isinstance(e, tuple | list) and len(e) == 2:
            d, s = e
        else:
            raise InvalidRequest("read_set entries must be [domain, seq] pairs")
        d = _name("read_set domain", d)
        s = _seq(f"read_set seq of {d!r}", s)
        if seen.get(d, s) != s:
            raise InvalidRequest(f"read_set names domain {d!r} twice with different seqs")
        seen[d] = s
        out.append(ReadSetEntry(d, s))
    return tuple(out)


class EffectRequest:
    """What a caller wants to run, and what it believed when it decided."""

    __slots__ = (
        "agent",
        "args",
        "domain",
        "expected_seq",
        "intent",
        "known_clock",
        "parent",
        "read_set",
        "tool",
    )

    intent: str
    domain: str
    tool: str
    args: dict[str, Any]
    agent: str
    read_set: tuple[ReadSetEntry, ...]
    parent: str | None
    known_clock: VectorClock | None
    expected_seq: int | None

    def __init__(
        self,
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
    ) -> None:
        # Inline checks: this runs once per attempt, duplicates included (the hot path).
        n = MAX_NAME_LENGTH
        if (
            type(intent) is not str
            or not 0 < len(intent) <= n
            or not intent.isascii()
            or "\x00" in intent
        ):
            _name("intent", intent)
        if (
            type(domain) is not str
            or not 0 < len(domain) <= n
            or not domain.isascii()
            or "\x00" in domain
        ):
            _name("domain", domain)
        if type(tool) is not str or not 0 < len(tool) <= n or not tool.isascii() or "\x00" in tool:
            _name("tool", tool)
        if (
            type(agent) is not str
            or not 0 < len(agent) <= n
            or not agent.isascii()
            or "\x00" in agent
        ):
            _name("agent", agent)
        self.intent = intent
        self.domain = domain
        self.tool = tool
        self.agent = agent
        if type(args) is not dict:
            if args is None:
                args = {}
            elif isinstance(args, dict):
                # the dict's own storage: a subclass's __iter__/keys/items never run
                args = dict(dict.items(args))
            elif isinstance(args, Mapping):
                try:
                    args = dict(args)
                except Exception as exc:  # a Mapping's own methods: anything can happen
                    raise InvalidRequest(
                        f"args could not be read as a mapping ({type(exc).__name__})"
                    ) from exc
            else:
                raise InvalidRequest(f"args must be a JSON object, got {type(args).__name__}")
        self.args = args
        self.read_set = _read_set(read_set) if read_set else ()
        if parent is not None and (type(parent) is not str or not _is_hash(parent)):
            # anything else was written into the certificate as given, and the domain's
            # trail failed its check from there on for good (found by review)
            shown = repr(parent[:80]) if type(parent) is str else type(parent).__name__
            raise InvalidRequest(
                "parent must be a certificate hash, the 64 lowercase hex digits of a "
                f"certificate's `hash` (an earlier certificate of this domain), got {shown}"
            )
        self.parent = parent
        if known_clock is None or type(known_clock) is VectorClock:
            self.known_clock = known_clock
        else:
            try:
                self.known_clock = VectorClock(known_clock)
            except (ValueError, TypeError, AttributeError) as exc:
                raise InvalidRequest(f"known_clock: {exc}") from exc
        if self.known_clock:
            if len(self.known_clock) > MAX_CLOCK_AGENTS:
                raise InvalidRequest(f"known_clock names more than {MAX_CLOCK_AGENTS} agents")
            for a, count in self.known_clock.items():
                if len(a) > MAX_NAME_LENGTH:
                    raise InvalidRequest(
                        f"a known_clock agent is longer than {MAX_NAME_LENGTH} characters"
                    )
                _utf8("known_clock agent", a)
                if count > MAX_KNOWN_COUNTER:
                    raise InvalidRequest(
                        f"known_clock[{a!r}] is {count}, over the largest counter a request "
                        f"may name ({MAX_KNOWN_COUNTER} = 2**52)"
                    )
        self.expected_seq = None if expected_seq is None else _seq("expected_seq", expected_seq)

    def __repr__(self) -> str:
        return (
            f"EffectRequest(intent={self.intent!r}, domain={self.domain!r}, tool={self.tool!r}, "
            f"agent={self.agent!r})"
        )


# Every duplicate builds a request: with the accelerator, the plain positional call (3 to 5
# arguments, ASCII names, args a dict or None) is done in C; any other call runs the
# __init__ above, which stays the definition (inspect.signature follows __wrapped__ to it).
if _accel.speedups is not None:
    EffectRequest.__init__ = _accel.speedups.RequestInit(  # type: ignore[method-assign]
        EffectRequest,
        EffectRequest.__init__,
        EffectRequest.__init__.__defaults__[1],  # type: ignore[index]
        MAX_NAME_LENGTH,
    )


class PreparedEffect:
    """The ticket: what the winning attempt holds between prepare and commit.

    ``token`` is the fencing token (the lease generation, monotonic per intent). A newer
    holder always has a larger token, so a downstream system that remembers the largest
    token it has seen can refuse a paused holder that wakes up after a takeover::

        t0  A prepares          -> token 7, lease until t0+30
        t31 A is paused (GC, network), its lease lapses
        t32 B prepares          -> takeover, token 9; A's ticket is now powerless
        t33 B writes downstream with token 9, commits
        t40 A wakes, writes downstream with token 7 -> downstream refuses (7 < 9)
            A commits           -> lease_lost; B's record untouched
    """

    __slots__ = (
        "agent",
        "args",
        "args_json",
        "domain",
        "expected_seq",
        "fingerprint",
        "intent",
        "lease_until",
        "parent",
        "read_set",
        "scope",
        "seq",
        "token",
        "tool",
        "vector_clock",
    )

    def __init__(
        self,
        intent: str,
        domain: str,
        seq: int,
        token: int,
        agent: str,
        tool: str,
        args: dict[str, Any],
        read_set: tuple[ReadSetEntry, ...],
        parent: str | None,
        vector_clock: VectorClock,
        expected_seq: int | None,
        lease_until: float,
        fingerprint: bytes | None = None,
        args_json: bytes | None = None,
        scope: str = "",
    ) -> None:
        self.intent = intent
        self.domain = domain
        self.seq = seq
        self.token = token
        self.agent = agent
        self.tool = tool
        self.args = args
        self.read_set = read_set
        self.parent = parent
        self.vector_clock = vector_clock
        self.expected_seq = expected_seq
        self.lease_until = lease_until
        #: the store's fingerprint of the admitted payload; None on a ticket that crossed a
        #: process boundary (the fence then recomputes it from the ticket's fields)
        self.fingerprint = fingerprint
        #: canonical bytes of ``args`` as admitted (not on the wire: recomputed from args)
        self.args_json = args_json
        #: the issuing store's ``ticket_scope``: tokens count per store, so a ticket taken
        #: to another store's fence matched its holder's token there and released it (found
        #: by review). Not on the wire: a sealed ticket's MAC binds it to its store
        #: already. "" on a ticket built by hand or opened from the wire.
        self.scope = scope

    def to_dict(self) -> dict[str, Any]:
        """JSON form (for the wire, where it is authenticated by :mod:`effectfence.tickets`)."""
        return {
            "intent": self.intent,
            "domain": self.domain,
            "seq": self.seq,
            "token": self.token,
            "agent": self.agent,
            "tool": self.tool,
            "args": self.args,
            "read_set": [[d, s] for d, s in self.read_set],
            "parent": self.parent,
            "vector_clock": self.vector_clock.to_dict(),
            "expected_seq": self.expected_seq,
            "lease_until": self.lease_until,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreparedEffect:
        try:
            return cls(
                intent=_name("intent", data["intent"]),
                domain=_name("domain", data["domain"]),
                seq=_seq("seq", data["seq"]),
                token=_seq("token", data["token"]),
                agent=_name("agent", data["agent"]),
                tool=_name("tool", data["tool"]),
                args=dict(data["args"]),
                read_set=_read_set(data["read_set"]),
                parent=data["parent"],
                vector_clock=VectorClock(data["vector_clock"]),
                expected_seq=None
                if data["expected_seq"] is None
                else _seq("expected_seq", data["expected_seq"]),
                lease_until=float(data["lease_until"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed ticket: {exc}") from exc

    def __repr__(self) -> str:
        return f"PreparedEffect(intent={self.intent!r}, seq={self.seq}, token={self.token})"


class Admission:
    """The answer to prepare: :class:`Fresh` (run it) or :class:`Replay` (it already ran)."""

    __slots__ = ()
    fresh: bool = False

    @property
    def ticket(self) -> PreparedEffect:
        raise AttributeError("only a Fresh admission carries a ticket")

    @property
    def cert(self) -> EffectCert:
        raise AttributeError("only a Replay admission carries a certificate")


class Fresh(Admission):
    """You won: run the effect, then commit (or abort / release) this ticket."""

    __slots__ = ("_ticket", "takeover")
    fresh = True

    def __init__(self, ticket: PreparedEffect, takeover: bool = False) -> None:
        self._ticket = ticket
        self.takeover = takeover

    @property
    def ticket(self) -> PreparedEffect:
        return self._ticket

    def __repr__(self) -> str:
        return f"Fresh({self._ticket!r}, takeover={self.takeover})"


class Replay(Admission):
    """It already ran: do NOT run it again; here is what happened."""

    __slots__ = ("_cert",)

    def __init__(self, cert: EffectCert) -> None:
        self._cert = cert

    @property
    def cert(self) -> EffectCert:
        return self._cert

    @property
    def result(self) -> Any:
        return self._cert.result

    def __repr__(self) -> str:
        return f"Replay({self._cert!r})"
