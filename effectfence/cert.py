"""Effect certificates: a content-addressed record of every effect that ran.

The hash is the lowercase hex SHA-256 of the RFC 8785 canonical JSON of an object holding
the ten fields plus ``format``. Anyone holding a certificate can recompute it; any change
to any field changes it (G10). ``parent`` chains a certificate to the one it was built on,
so a list of certificates can be checked as a whole by :func:`verify_chain`.

A domain's certificates form a line when each attempt was admitted after the one before it
committed, and a DAG where attempts overlapped: two attempts admitted before either
committed both name the head they saw as their parent, and their clocks are concurrent
(neither saw the other; see :mod:`effectfence.clock`). :func:`verify_chain` accepts both
shapes and reports the overlaps; it fails an edited certificate or a parent that names no
earlier certificate of the chain.

The format is frozen by ``tests/vectors/certs.json``: change a byte of the encoding and
those vectors fail.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from effectfence.canonical import (
    CanonicalError,
    canonical_bytes,
    json_loads,
    name_bytes,
    sort_keys_bytes,
    string_bytes,
)
from effectfence.errors import InvalidRequest

__all__ = [
    "CERT_FORMAT",
    "CERT_MAX_DEPTH",
    "MAX_OPEN_OVERLAPS",
    "MAX_PAYLOAD_DEPTH",
    "MAX_REPORTED_OVERLAPS",
    "ChainReport",
    "EffectCert",
    "spliced_hash",
    "spliced_hash_py",
    "verify_chain",
]

CERT_FORMAT = "effectfence.cert/1"

#: the deepest args or result a certificate holds (``FenceConfig.max_depth`` is bounded by
#: it): whatever the fence admitted, every later re-encoding of its certificate must accept.
#: Past the compiled encoder's depth the Python encoder walks two frames a level; at 512 a
#: certificate admitted at prepare failed verify(), or could not be stored, once re-encoded
#: one level deeper from a deeper stack (found by review). 256 leaves the interpreter's
#: stack room to spare, and a payload nested that deep is no tool's real argument.
MAX_PAYLOAD_DEPTH: Final = 256
#: the nesting every re-encoding of a certificate allows (hash, JSON form, durable stores):
#: its args and result sit one level below the body
CERT_MAX_DEPTH: Final = MAX_PAYLOAD_DEPTH + 1

_FIELDS = (
    "intent",
    "parent",
    "domain",
    "seq",
    "tool",
    "args",
    "result",
    "vector_clock",
    "read_set",
    "agent",
)


def cert_body(
    intent: str,
    parent: str | None,
    domain: str,
    seq: int,
    tool: str,
    args: Any,
    result: Any,
    vector_clock: Mapping[str, int] | Iterable[tuple[str, int]],
    read_set: Sequence[tuple[str, int]],
    agent: str,
) -> dict[str, Any]:
    """The object whose canonical form is hashed."""
    return {
        "format": CERT_FORMAT,
        "intent": intent,
        "parent": parent,
        "domain": domain,
        "seq": seq,
        "tool": tool,
        "args": args,
        "result": result,
        "vector_clock": dict(vector_clock),
        "read_set": [[d, s] for d, s in read_set],
        "agent": agent,
    }


def _hash_body(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_bytes(body, max_depth=CERT_MAX_DEPTH)).hexdigest()


_FORMAT_JSON = CERT_FORMAT_JSON = string_bytes(CERT_FORMAT)
name_json = name_bytes  # agents, domains and tools repeat: encoded once, remembered


def clock_bytes(clock: dict[str, int]) -> bytes:
    """RFC 8785 form of a vector clock: ASCII agent names sort the same in every order, so
    the sorted encoder is exact for them; anything else takes the full path."""
    for agent in clock:
        if not agent.isascii():
            return canonical_bytes(clock)
    return sort_keys_bytes(clock)


def _c_cert_hash() -> Any:
    """``effectfence._certhash.cert_hash`` bound to the C encoder and hashlib, or None: the
    one place that decides whether :func:`spliced_hash` has a compiled twin."""
    from effectfence import _accel

    ch, sp = _accel.certhash, _accel.speedups
    if ch is None or sp is None or ch.FORMAT_JSON.encode() != _FORMAT_JSON:
        return None
    ch.bind(sp.string, sp.canonical, hashlib.sha256)
    return ch.cert_hash


_C_CERT_HASH = _c_cert_hash()


def spliced_hash(
    intent: str,
    parent: str | None,
    domain: str,
    seq: int,
    tool: str,
    args_json: bytes,
    result_json: bytes,
    vector_clock: dict[str, int],
    read_set: Sequence[tuple[str, int]],
    agent: str,
) -> str:
    """The certificate hash from parts already in canonical form (see
    :func:`spliced_hash_py`, the definition). The compiled twin (csrc/effectfence_certhash.c)
    answers when it is built and sure of its bytes; tests/test_certhash.py proves them equal."""
    if _C_CERT_HASH is not None:
        out: str | None = _C_CERT_HASH(
            intent, parent, domain, seq, tool, args_json, result_json, vector_clock, read_set, agent
        )
        if out is not None:
            return out
    return spliced_hash_py(
        intent, parent, domain, seq, tool, args_json, result_json, vector_clock, read_set, agent
    )


def spliced_hash_py(
    intent: str,
    parent: str | None,
    domain: str,
    seq: int,
    tool: str,
    args_json: bytes,
    result_json: bytes,
    vector_clock: dict[str, int],
    read_set: Sequence[tuple[str, int]],
    agent: str,
) -> str:
    """The certificate hash from parts already in canonical form.

    RFC 8785 of an object is its members in key order, each value in canonical form, so the
    body can be assembled from the canonical bytes of its parts: the fence canonicalized
    ``args`` at prepare and ``result`` when it checked it, and need not walk them again.
    ``tests/test_cert_clock.py`` proves this equals ``canonical_bytes(cert_body(...))``.
    The keys below are in RFC 8785 order (all ASCII, so code-point order).
    """
    body = b"".join(
        (
            b'{"agent":',
            name_json(agent),
            b',"args":',
            args_json,
            b',"domain":',
            name_json(domain),
            b',"format":',
            _FORMAT_JSON,
            b',"intent":',
            string_bytes(intent),  # unique per certificate: not worth caching
            b',"parent":',
            b"null" if parent is None else string_bytes(parent),
            b',"read_set":',
            canonical_bytes([[d, s] for d, s in read_set]) if read_set else b"[]",
            b',"result":',
            result_json,
            b',"seq":',
            str(seq).encode(),  # a safe integer (the fence caps seqs at 2**53-2)
            b',"tool":',
            name_json(tool),
            b',"vector_clock":',
            clock_bytes(vector_clock),
            b"}",
        )
    )
    return hashlib.sha256(body).hexdigest()


ClockItems = tuple[tuple[str, int], ...]


def _frozen_clock(vector_clock: Mapping[str, int] | tuple[tuple[str, int], ...]) -> ClockItems:
    """The clock as a tuple of ``(agent, counter)`` pairs: immutable, and (holding only str
    and int) never part of a reference cycle."""
    if type(vector_clock) is dict:
        return tuple(vector_clock.items())
    if type(vector_clock) is tuple and all(type(pair) is tuple for pair in vector_clock):
        return vector_clock
    return tuple(dict(vector_clock).items())


class EffectCert(tuple[Any, ...]):
    """Proof that one effect ran, what it was built on, and what it returned.

    Immutable all the way down: a tuple of str, int, bytes, None and tuples of those.
    ``args`` and ``result`` are kept as their RFC 8785 bytes (the very bytes the hash
    covers) and the vector clock as ``(agent, counter)`` pairs; every access hands out a
    fresh decoded copy. So no caller, whether through a property, indexing, iteration,
    ``copy`` or pickling, can change a certificate that the fence replays to others (G3).
    """

    __slots__ = ()

    def __new__(
        cls,
        *,
        intent: str,
        parent: str | None,
        domain: str,
        seq: int,
        tool: str,
        args: Any,
        result: Any,
        vector_clock: Mapping[str, int],
        read_set: Iterable[tuple[str, int]],
        agent: str,
        hash: str | None = None,
    ) -> EffectCert:
        rs = tuple((d, s) for d, s in read_set)
        vc = _frozen_clock(vector_clock)
        if not all(type(a) is str and type(n) is int for a, n in vc):
            raise InvalidRequest("certificate field 'vector_clock' must map agents to integers")
        if not all(type(d) is str and type(s) is int for d, s in rs):
            raise InvalidRequest("certificate field 'read_set' must be a list of [domain, seq]")
        try:
            args_json = canonical_bytes(args, max_depth=MAX_PAYLOAD_DEPTH)
            result_json = canonical_bytes(result, max_depth=MAX_PAYLOAD_DEPTH)
            if hash is None:
                hash = _hash_body(
                    cert_body(intent, parent, domain, seq, tool, args, result, vc, rs, agent)
                )
        except CanonicalError as exc:
            raise InvalidRequest(f"certificate is not canonical JSON: {exc}") from exc
        # A given hash is kept as-is so verify() can tell a tampered certificate apart.
        return tuple.__new__(
            cls, (intent, parent, domain, seq, tool, args_json, result_json, vc, rs, agent, hash)
        )

    @classmethod
    def _trusted(
        cls,
        intent: str,
        parent: str | None,
        domain: str,
        seq: int,
        tool: str,
        args_json: bytes,
        result_json: bytes,
        vector_clock: Mapping[str, int] | ClockItems,
        read_set: tuple[tuple[str, int], ...],
        agent: str,
        hash: str,
    ) -> EffectCert:
        """Assemble from canonical parts the fence already validated and hashed (the clock
        as a dict, or as the pairs a certificate keeps: pickling hands those back)."""
        return tuple.__new__(
            cls,
            (
                intent,
                parent,
                domain,
                seq,
                tool,
                args_json,
                result_json,
                _frozen_clock(vector_clock),
                read_set,
                agent,
                hash,
            ),
        )

    @property
    def intent(self) -> str:
        return self[0]  # type: ignore[no-any-return]

    @property
    def parent(self) -> str | None:
        return self[1]  # type: ignore[no-any-return]

    @property
    def domain(self) -> str:
        return self[2]  # type: ignore[no-any-return]

    @property
    def seq(self) -> int:
        return self[3]  # type: ignore[no-any-return]

    @property
    def tool(self) -> str:
        return self[4]  # type: ignore[no-any-return]

    @property
    def args(self) -> Any:
        """A fresh copy of the arguments, decoded from the hashed bytes."""
        return json_loads(self[5])

    @property
    def result(self) -> Any:
        """A fresh copy of the result, decoded from the hashed bytes."""
        return json_loads(self[6])

    @property
    def args_json(self) -> bytes:
        """The canonical bytes of ``args``, exactly as hashed."""
        return self[5]  # type: ignore[no-any-return]

    @property
    def result_json(self) -> bytes:
        """The canonical bytes of ``result``, exactly as hashed."""
        return self[6]  # type: ignore[no-any-return]

    @property
    def vector_clock(self) -> dict[str, int]:
        return dict(self[7])

    @property
    def read_set(self) -> tuple[tuple[str, int], ...]:
        return self[8]  # type: ignore[no-any-return]

    @property
    def agent(self) -> str:
        return self[9]  # type: ignore[no-any-return]

    @property
    def hash(self) -> str:
        return self[10]  # type: ignore[no-any-return]

    def body(self) -> dict[str, Any]:
        return cert_body(
            self.intent,
            self.parent,
            self.domain,
            self.seq,
            self.tool,
            self.args,
            self.result,
            self[7],
            self.read_set,
            self.agent,
        )

    def compute_hash(self) -> str:
        return _hash_body(self.body())

    def verify(self) -> bool:
        """Recompute the hash: False if any field (or the hash) was changed."""
        try:
            return self.compute_hash() == self.hash
        except (CanonicalError, TypeError, ValueError):
            return False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form, the same on the wire and in durable stores."""
        d = self.body()
        d["hash"] = self.hash
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EffectCert:
        """Parse a certificate from its JSON form; the hash is kept, not recomputed."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("a certificate must be a JSON object")
        fmt = data.get("format", CERT_FORMAT)
        if fmt != CERT_FORMAT:
            raise InvalidRequest(f"unknown certificate format {fmt!r}; expected {CERT_FORMAT!r}")
        missing = [f for f in (*_FIELDS, "hash") if f not in data]
        if missing:
            raise InvalidRequest(f"certificate is missing fields: {', '.join(missing)}")
        extra = sorted(set(data) - {*_FIELDS, "hash", "format"})
        if extra:
            raise InvalidRequest(f"certificate has unknown fields: {', '.join(extra)}")
        _expect(data, "intent", str)
        _expect(data, "domain", str)
        _expect(data, "tool", str)
        _expect(data, "agent", str)
        _expect(data, "hash", str)
        if data["parent"] is not None:
            _expect(data, "parent", str)
        if type(data["seq"]) is not int:
            raise InvalidRequest("certificate field 'seq' must be an integer")
        vc = data["vector_clock"]
        if not isinstance(vc, Mapping) or not all(
            type(k) is str and type(v) is int for k, v in vc.items()
        ):
            raise InvalidRequest("certificate field 'vector_clock' must map agents to integers")
        rs = data["read_set"]
        if not isinstance(rs, list | tuple) or not all(
            isinstance(e, list | tuple) and len(e) == 2 and type(e[0]) is str and type(e[1]) is int
            for e in rs
        ):
            raise InvalidRequest("certificate field 'read_set' must be a list of [domain, seq]")
        return cls(
            intent=data["intent"],
            parent=data["parent"],
            domain=data["domain"],
            seq=data["seq"],
            tool=data["tool"],
            args=data["args"],
            result=data["result"],
            vector_clock=vc,
            read_set=[(d, s) for d, s in rs],
            agent=data["agent"],
            hash=data["hash"],
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EffectCert):
            return NotImplemented
        return self.hash == other.hash and self.body() == other.body()

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        # Never print args or result: they may carry card numbers or secrets.
        return (
            f"EffectCert(intent={self.intent!r}, domain={self.domain!r}, seq={self.seq}, "
            f"hash={self.hash[:16]!r}...)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (EffectCert._trusted, tuple(self))

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy/pickle go through __reduce__
        return ()


def _expect(data: Mapping[str, Any], field: str, typ: type) -> None:
    if type(data[field]) is not typ:
        raise InvalidRequest(f"certificate field {field!r} must be {typ.__name__}")


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What :func:`verify_chain` found; ``broken_at`` is the first bad index.

    ``concurrent`` lists the pairs ``(i, j)``, ``i < j``, of certificates whose attempts
    overlapped: ``j`` was admitted before ``i`` committed, so neither saw the other (``j``'s
    clock does not follow ``i``'s). That is what happened, not damage: it never makes a
    chain fail. ``concurrent_complete`` is False when the list stops short of every such
    pair (see :data:`MAX_REPORTED_OVERLAPS`, :data:`MAX_OPEN_OVERLAPS`).
    """

    ok: bool
    length: int
    broken_at: int | None = None
    reason: str = ""
    concurrent: tuple[tuple[int, int], ...] = ()
    concurrent_complete: bool = True

    def __bool__(self) -> bool:
        return self.ok


_FIRST_PARENT: Final[Any] = object()

#: The overlap report's bounds, which keep a chain check linear whatever it is given: a
#: chain of certificates whose clocks order none of the others (a caller's, through
#: fence_verify) made it quadratic in time and memory, 10,000 of them a minute on the
#: server's loop (found by review). Attempts overlap as far as they are in flight at once,
#: far below these on a real trail; past them the list says it is incomplete.
MAX_REPORTED_OVERLAPS: Final = 1_000
MAX_OPEN_OVERLAPS: Final = 128


def _happened_before(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    """``a < b`` in the causal order of vector clocks (a missing agent is at 0)."""
    return all(n <= b.get(agent, 0) for agent, n in a.items()) and any(
        n > a.get(agent, 0) for agent, n in b.items()
    )


def out_of_line(certs: Sequence[EffectCert]) -> tuple[int, str] | None:
    """The first certificate that is not of the first one's domain or does not come after
    the one before it in seq order, with why; None when every one is in line. A chain is
    one domain's certificates in the order the fence admitted them: fence_verify took
    certificates of two domains, or one twice, for a sound chain that ``certs --verify``
    refused (found by review), so both judge by this."""
    if not certs:
        return None
    domain = certs[0].domain
    for i, cert in enumerate(certs):
        if cert.domain != domain:
            return i, f"seq {cert.seq} belongs to domain {cert.domain!r}, not {domain!r}"
        if i and cert.seq <= certs[i - 1].seq:
            return i, f"seq {cert.seq} comes after seq {certs[i - 1].seq}: not in seq order"
    return None


def verify_chain(
    certs: Sequence[EffectCert],
    *,
    root: str | None = _FIRST_PARENT,
    outside: Iterable[str] = (),
) -> ChainReport:
    """Check a domain's certificates, in seq order (the order the fence admitted them).

    Fails (``ok`` False, ``broken_at`` the first bad index) when a certificate is out of
    line (:func:`out_of_line`: another domain, or not after the one before it), does not
    verify (an edited field or hash), or when its parent is neither ``root`` (the head the
    chain starts from; by default the first certificate's parent) nor the hash of an
    earlier certificate of the chain (a broken or forged link). ``outside``: hashes of
    certificates before a window of the trail, checked by the caller to be there, that
    certificates in it may follow too (overlapping attempts across the cut do).

    Passes for a line and for the DAG that overlapping attempts make (several certificates
    naming one parent), and reports each overlap in ``concurrent``. An effect committed
    before another was admitted is in that one's past: its clock is behind, and once a
    certificate has seen an effect, every later one has too. So only the certificates that
    some later certificate has not yet seen are compared, and a line costs one comparison
    per certificate; at most :data:`MAX_OPEN_OVERLAPS` of them, and at most
    :data:`MAX_REPORTED_OVERLAPS` pairs are listed. The links and hashes are always
    checked in full.
    """
    n = len(certs)
    if not n:
        return ChainReport(True, 0)
    stray = out_of_line(certs)
    if stray is not None:
        return ChainReport(False, n, stray[0], f"certificate {stray[0]}: {stray[1]}")
    known: set[str | None] = {certs[0].parent if root is _FIRST_PARENT else root, *outside}
    clocks: list[dict[str, int]] = []
    unseen: list[int] = []  # earlier certificates that not every later one has seen
    concurrent: list[tuple[int, int]] = []
    complete = True
    for j, cert in enumerate(certs):
        if not cert.verify():
            return ChainReport(False, n, j, f"certificate {j} does not verify")
        if cert.parent not in known:
            return ChainReport(
                False, n, j, f"certificate {j} follows no earlier certificate of the chain"
            )
        known.add(cert.hash)
        clock = cert.vector_clock
        clocks.append(clock)
        still: list[int] = []
        for i in unseen:
            if not _happened_before(clocks[i], clock):
                if len(concurrent) < MAX_REPORTED_OVERLAPS:
                    concurrent.append((i, j))
                else:
                    complete = False
                still.append(i)
        still.append(j)
        if len(still) > MAX_OPEN_OVERLAPS:  # the oldest are no longer compared
            del still[: len(still) - MAX_OPEN_OVERLAPS]
            complete = False
        unseen = still
    return ChainReport(True, n, concurrent=tuple(concurrent), concurrent_complete=complete)
