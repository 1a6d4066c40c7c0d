"""A domain's certificates as an audit trail: read them in seq order, check them as a whole.

The check is :func:`effectfence.cert.verify_chain`'s (every hash recomputed, every parent
a certificate of the chain); this module feeds it and says where it broke in the terms an
operator has (seqs, file lines), and adds what the trail itself shows: a seq out of order,
a certificate of another domain, and the seqs with no certificate (gaps). A gap is not
damage by itself: an attempt that was released, aborted or lapsed reserved a seq and
committed nothing. A missing certificate that another one was built on breaks a parent
link, and that the chain check reports.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from effectfence.canonical import json_loads
from effectfence.cert import _FIRST_PARENT as FIRST_PARENT
from effectfence.cert import MAX_OPEN_OVERLAPS, EffectCert, out_of_line, verify_chain
from effectfence.errors import InvalidRequest
from effectfence.store.base import FenceStore

__all__ = [
    "TrailNotKept",
    "TrailReport",
    "check_trail",
    "kept_after_cut",
    "load_lines",
    "outside_parents",
    "read_trail",
]

PAGE = 1000


class TrailNotKept(RuntimeError):
    """The store keeps no certificate trail (the memory store)."""


@dataclass(frozen=True, slots=True)
class TrailReport:
    """What the check found. ``broken_at_seq`` (and ``broken_at_line`` for a file) is the
    first place the trail breaks; ``tampered`` lists every seq whose hash does not match its
    fields; ``gaps`` the (first, last) seq ranges with no certificate; ``concurrent`` the
    seq pairs of attempts that overlapped (reported by the chain check, never damage);
    ``cut`` the seq through which the store's retention deleted the trail (0: none), and
    ``after_cut`` the seqs whose parent went with it (accepted, see :func:`check_trail`)."""

    ok: bool
    length: int
    domain: str | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    broken_at_seq: int | None = None
    broken_at_line: int | None = None
    reason: str = ""
    tampered: list[int] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)
    concurrent: list[tuple[int, int]] = field(default_factory=list)
    concurrent_complete: bool = True
    cut: int = 0
    after_cut: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "length": self.length,
            "domain": self.domain,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "broken_at_seq": self.broken_at_seq,
            "broken_at_line": self.broken_at_line,
            "reason": self.reason,
            "tampered": list(self.tampered),
            "gaps": [list(g) for g in self.gaps],
            "concurrent": [list(c) for c in self.concurrent],
            "concurrent_complete": self.concurrent_complete,
            "cut": self.cut,
            "after_cut": list(self.after_cut),
        }


def read_trail(
    store: FenceStore, domain: str, *, after_seq: int = 0, limit: int | None = None
) -> Iterator[EffectCert]:
    """The domain's certificates after ``after_seq`` in seq order, page by page."""
    left = limit
    while left is None or left > 0:
        page = PAGE if left is None else min(PAGE, left)
        try:
            got = list(store.certs(domain, after_seq=after_seq, limit=page))
        except NotImplementedError as exc:
            raise TrailNotKept(
                f"the {store.name} store keeps no certificate trail (it lives in one process "
                "and forgets at exit): export from a sqlite, postgresql or redis store, or "
                "verify a file with --file"
            ) from exc
        yield from got
        if len(got) < page:
            return
        after_seq = got[-1].seq
        if left is not None:
            left -= len(got)


def outside_parents(
    store: FenceStore, domain: str, window: list[EffectCert], *, since: int = 0, cut: int = 0
) -> set[str]:
    """The parents the certificates of a window of the trail name before it that the store
    holds, with seq in ``since+1 .. window[0].seq-1``: attempts admitted before the window
    and committed in it follow certificates before it, and a check of the window alone
    called a sound trail broken there (found by review). The first certificate's parent is
    looked up too: accepted unseen, a certificate deleted just before the window passed
    the check (found by review). Read a page at a time backwards from the window, where
    parents almost always are, and only while some parent is still unaccounted for; a
    parent the store does not hold stays out (a broken link). Below a retention ``cut``
    the store keeps only commits that landed after it ran: they are read forwards in one
    pass, not page by page back to the start (found by review: a trail cut at seq N cost
    N / PAGE reads at every check)."""
    if not window:
        return set()
    inside = {c.hash for c in window}
    wanted = {c.parent for c in window if c.parent is not None and c.parent not in inside}
    found: set[str] = set()
    first = window[0].seq
    floor = max(since, cut)
    below = first  # what is left to read backwards: seqs floor+1 .. below-1
    while found != wanted and below - 1 > floor:
        start = max(floor, below - 1 - PAGE)
        for cert in read_trail(store, domain, after_seq=start, limit=below - 1 - start):
            if cert.seq >= below:
                break
            if cert.hash in wanted:
                found.add(cert.hash)
        below = start + 1
    if found != wanted and cut > since:
        for cert in read_trail(store, domain, after_seq=since):  # the late commits below it
            if cert.seq > cut or cert.seq >= first:
                break
            if cert.hash in wanted:
                found.add(cert.hash)
                if found == wanted:
                    break
    return found


def load_lines(lines: Iterable[str]) -> tuple[list[EffectCert], list[int], str]:
    """Certificates from JSON lines (blank lines skipped): (certs, their line numbers, and
    the first unreadable line's complaint, which ends the reading).

    An export is canonical JSON, read back by the decoder that gives back what was encoded
    (an integral float such as 1.7e18 stays a float). Any line that is not a certificate,
    nested too deep for the parser included, is a complaint, never a traceback."""
    certs: list[EffectCert] = []
    where: list[int] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            line.encode()  # a file read with surrogateescape: bytes that are not UTF-8
        except UnicodeEncodeError:
            return certs, where, f"line {n} is not a certificate: it is not UTF-8 text"
        try:
            certs.append(EffectCert.from_dict(json_loads(line)))
        except (ValueError, RecursionError, InvalidRequest) as exc:
            return certs, where, f"line {n} is not a certificate: {exc}"
        where.append(n)
    return certs, where, ""


def load_file(path: Path) -> tuple[list[EffectCert], list[int], str]:
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        return load_lines(f)


def kept_after_cut(store: FenceStore, domain: str, cut: int, through: int) -> int:
    """How many certificates the store keeps with ``cut < seq <= through``, at most
    :data:`~effectfence.cert.MAX_OPEN_OVERLAPS`: ``kept_before`` for :func:`check_trail` of
    a part of the trail read after ``through``."""
    if cut <= 0 or through <= cut:
        return 0
    return sum(
        1
        for c in read_trail(store, domain, after_seq=cut, limit=MAX_OPEN_OVERLAPS)
        if c.seq <= through
    )


def check_trail(
    certs: list[EffectCert],
    lines: list[int] | None = None,
    *,
    outside: Iterable[str] = (),
    cut: int = 0,
    kept_before: int = 0,
    root: str | object | None = FIRST_PARENT,
) -> TrailReport:
    """Check a trail in the order given (it must be seq order). ``outside``: certificates
    before it that it may follow (see :func:`outside_parents`). ``root``: the head the
    first certificate may follow besides those; by default whatever it names (a file may
    hold any part of a trail), ``None`` for a trail read from a store, whose first
    certificate's parent must be found like any other's (or lie below the ``cut``).

    ``cut``: the seq through which the store's retention deleted this trail (its
    :meth:`~effectfence.store.base.FenceStore.trail_cut`). The first certificates kept
    name deleted ones as parents, and so do attempts admitted before the cut and committed
    after it (whose own seq may even be below it: the cut does not wait for an attempt in
    flight). Such a link is accepted for the certificates below the cut and the first
    :data:`~effectfence.cert.MAX_OPEN_OVERLAPS` above it (the overlaps the chain check
    follows), counted as kept, not by seq: released attempts leave seqs with no
    certificate (found by review). ``kept_before``: how many of those precede this part
    of the trail (:func:`kept_after_cut`, for a part read with ``after_seq``). The links
    accepted are listed in ``after_cut``; further on, a parent that is nowhere is a broken
    link as ever."""
    n = len(certs)
    if not n:
        return TrailReport(True, 0, cut=cut)
    after_cut: list[int] = []
    if cut > 0:
        seen: set[str | None] = set(outside)
        extra: set[str] = set()
        kept = kept_before
        for c in certs:
            if c.seq > cut:
                if kept >= MAX_OPEN_OVERLAPS:
                    break
                kept += 1
            if c.parent is not None and c.parent not in seen and c.parent not in extra:
                extra.add(c.parent)
            if c.parent in extra:
                after_cut.append(c.seq)
            seen.add(c.hash)
        outside = {*outside, *extra}
    domain = certs[0].domain
    seqs = [c.seq for c in certs]
    found = TrailReport(
        True,
        n,
        domain,
        seqs[0],
        seqs[-1],
        tampered=[c.seq for c in certs if not c.verify()],
        gaps=[(a + 1, b - 1) for a, b in itertools.pairwise(seqs) if b - a > 1],
        cut=cut,
        after_cut=after_cut,
    )

    def broken(i: int, reason: str) -> TrailReport:
        line = None if lines is None else lines[i]
        return replace(found, ok=False, broken_at_seq=seqs[i], broken_at_line=line, reason=reason)

    stray = out_of_line(certs)
    if stray is not None:
        return broken(*stray)
    report = verify_chain(certs, outside=outside, root=root)  # type: ignore[arg-type]
    pairs = getattr(report, "concurrent", ())  # reported by the DAG-aware chain check
    found = replace(
        found,
        concurrent=[(seqs[i], seqs[j]) for i, j in pairs],
        concurrent_complete=report.concurrent_complete,
    )
    if report.ok:
        return found
    at = report.broken_at if report.broken_at is not None else 0
    bad = certs[at]
    if not bad.verify():
        return broken(
            at, f"seq {bad.seq}: its hash does not match its fields (edited or corrupted)"
        )
    partial = (
        " or before the first one here: an export made with --after holds only part of the "
        "trail, verify it against the store"
        if lines is not None and seqs[0] > 1
        else ""
    )
    return broken(
        at,
        f"seq {bad.seq}: its parent {str(bad.parent)[:16]} does not link it to the "
        f"certificates before it (one is missing, replaced or out of place{partial})",
    )
