"""Vector clocks: which effects could have known about which.

A ticket's clock is the caller's ``known_clock`` merged with the domain's head clock (the
merge of every effect committed on the domain so far), ticked at the agent. So on one
domain:

- **Causally ordered**: an effect committed before another attempt was *admitted*
  (prepared) is in that attempt's past: its clock is ``lt`` the later one's, and the later
  certificate's ``parent`` is that effect or one committed after it (unless its caller
  named a ``parent`` of its own). Attempts that never
  overlap in time (one prepare after the previous commit, e.g. a caller that waits for
  each certificate) therefore form a line, clocks and parents alike.
- **Concurrent**: two attempts admitted before either committed did not see each other,
  and their clocks say so (``concurrent``, or equal when one agent ran both at once: an
  agent is one counter, not one sequential process). Both certificates name the same
  head as ``parent``: the chain is a DAG there, and
  :func:`effectfence.cert.verify_chain` reports the pair as concurrent, not as tampering.
- **Strict (``expected_seq``)**: an attempt admitted at the seq after one still in flight
  moves the domain under that one, whose commit is then refused ``read_set_stale``: of two
  overlapping strict attempts at most the later is certified, so when every attempt on a
  domain is strict its certificates form a line. A strict attempt overlapping a non-strict
  one is concurrent with it like any other.

Across domains, effects are ordered only through what callers pass as ``known_clock``; a
caller that withholds what it knew makes its effect look concurrent with what it saw.

Bounded: a ticket's clock carries at most :data:`MAX_TICKET_AGENTS` agents. A domain whose
history names more (each request may add up to 256 through ``known_clock``) has the agents
with the fewest events left out of its tickets, as version-vector pruning does: the orders
above then hold for the agents kept. Unbounded, a head grown by a few dozen commits made
every later ticket on the domain too large to hand out, for every caller, for good.

A domain's head clock, which every store keeps and every claim reads, is bounded the same
way at :data:`MAX_HEAD_AGENTS` (:func:`merge_head`: past it, the :data:`HEAD_AGENTS_KEPT`
with the most events stay). Unbounded, it grew by one entry for
every agent name ever seen on the domain (a name per session, say): every claim read it
and every commit rewrote it, so a busy domain's steps grew slower for good. An agent left
out of the head starts its own count again, and the orders above hold for the agents kept,
as for tickets.

Clocks are immutable: every operation returns a new clock, so a clock inside a certificate
can never change under it. Zero entries are dropped, so equal clocks have one canonical form.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import Any

from effectfence.canonical import MAX_SAFE_INTEGER, sha256_hex

__all__ = [
    "HEAD_AGENTS_KEPT",
    "MAX_HEAD_AGENTS",
    "MAX_TICKET_AGENTS",
    "VectorClock",
    "merge_counts",
    "merge_head",
    "ticket_counts",
]

#: the most agents a ticket's clock carries (see the module's "Bounded"): at the longest
#: names (512 characters) a clock of ~0.5 MiB, so a ticket stays within what one may carry
MAX_TICKET_AGENTS = 1024
#: the most agents a domain's head clock keeps (see the module's "Bounded"); the PostgreSQL
#: and Redis stores keep the same bound in their own merge (store.postgres, store.redis)
MAX_HEAD_AGENTS = 2 * MAX_TICKET_AGENTS
#: how many a head over the bound keeps: pruned with room to spare, so a domain at the bound
#: that meets a new agent with each commit sorts its head once per 512 of them, not at each
#: (at each, a Redis commit took 27 ms with the server blocked; found by review)
HEAD_AGENTS_KEPT = MAX_HEAD_AGENTS - MAX_HEAD_AGENTS // 4


class VectorClock(Mapping[str, int]):
    """agent -> counter, immutable, with the partial order of causality."""

    __slots__ = ("_c",)

    _c: dict[str, int]

    def __init__(self, counters: Mapping[str, int] | None = None) -> None:
        clean: dict[str, int] = {}
        if counters:
            for agent, n in counters.items():
                if type(agent) is not str or not agent:
                    raise ValueError(f"vector clock agent must be a non-empty str, got {agent!r}")
                if type(n) is not int or not 0 <= n <= MAX_SAFE_INTEGER:
                    raise ValueError(
                        f"vector clock counter for {agent!r} must be an int in [0, 2**53-1]"
                    )
                if n:
                    clean[agent] = n
        self._c = clean

    @classmethod
    def _trusted(cls, counters: dict[str, int]) -> VectorClock:
        """Build without validation from a dict this module produced."""
        vc = cls.__new__(cls)
        vc._c = counters
        return vc

    # Mapping protocol -------------------------------------------------------------------
    def __getitem__(self, agent: str) -> int:
        return self._c[agent]

    def get(self, agent: str, default: Any = 0) -> Any:  # missing agents are at 0
        return self._c.get(agent, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._c)

    def __len__(self) -> int:
        return len(self._c)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VectorClock):
            return self._c == other._c
        if isinstance(other, Mapping):
            return self._c == {k: v for k, v in other.items() if v}
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._c.items()))

    def __repr__(self) -> str:
        return f"VectorClock({self._c!r})"

    # Causality --------------------------------------------------------------------------
    def tick(self, agent: str) -> VectorClock:
        """One more event at ``agent``."""
        if type(agent) is not str or not agent:
            raise ValueError(f"vector clock agent must be a non-empty str, got {agent!r}")
        c = dict(self._c)
        c[agent] = c.get(agent, 0) + 1
        return VectorClock._trusted(c)

    def merge(self, other: Mapping[str, int]) -> VectorClock:
        """Element-wise maximum: everything either side knew."""
        oc = other._c if isinstance(other, VectorClock) else VectorClock(other)._c
        if not oc:
            return self
        if not self._c:
            return other if isinstance(other, VectorClock) else VectorClock._trusted(oc)
        return VectorClock._trusted(merge_counts(self._c, oc))

    def le(self, other: Mapping[str, int]) -> bool:
        """True when every event this clock knows, ``other`` knows too."""
        og = other.get
        return all(n <= og(agent, 0) for agent, n in self._c.items())

    def lt(self, other: Mapping[str, int]) -> bool:
        """Happened-before: ``le`` and not equal."""
        return self.le(other) and self != other

    def concurrent(self, other: Mapping[str, int]) -> bool:
        """Neither knew of the other."""
        return not self.le(other) and not VectorClock(other).le(self)

    def to_dict(self) -> dict[str, int]:
        return dict(self._c)

    def digest(self) -> str:
        """SHA-256 of the RFC 8785 form: equal clocks, equal digests, on any host."""
        return sha256_hex(self._c)


def merge_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Element-wise maximum of two counter maps, as a new dict: the one merge rule, used by
    :meth:`VectorClock.merge`, by tickets and by the stores' domain heads."""
    c = dict(a)
    for agent, n in b.items():
        if n > c.get(agent, 0):
            c[agent] = n
    return c


def merge_head(head: Mapping[str, int], clock: Mapping[str, int]) -> dict[str, int]:
    """A domain's head clock after a commit: the merge; if that names more than
    :data:`MAX_HEAD_AGENTS` agents, the :data:`HEAD_AGENTS_KEPT` with the most events (ties:
    the smaller name, in code point order)."""
    c = merge_counts(head, clock)
    if len(c) > MAX_HEAD_AGENTS:
        kept = heapq.nsmallest(HEAD_AGENTS_KEPT, ((-n, a) for a, n in c.items()))
        c = {a: -negative for negative, a in kept}
    return c


def ticket_counts(
    head: Mapping[str, int], known: Mapping[str, int] | None, agent: str
) -> dict[str, int]:
    """A ticket's clock: the domain head's clock merged with what the caller knew, ticked at
    the agent. Effects committed on a domain before a claim are therefore behind it. At
    most :data:`MAX_TICKET_AGENTS` agents: the agent's own entry, then the others with the
    most events (ties: the smaller name), the rest left out (see the module's "Bounded")."""
    c = merge_counts(head, known) if known else dict(head)
    own = c[agent] = c.get(agent, 0) + 1
    if len(c) > MAX_TICKET_AGENTS:
        kept = heapq.nsmallest(MAX_TICKET_AGENTS - 1, ((-n, a) for a, n in c.items() if a != agent))
        c = {a: -negative for negative, a in kept}
        c[agent] = own
    return c
