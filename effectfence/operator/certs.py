"""``effectfence certs``: export a domain's certificates and verify them as a chain.

    effectfence certs DOMAIN [--store URL] [--after SEQ] [--limit N]    # JSON lines, seq order
    effectfence certs DOMAIN --verify                                   # check the store's trail
    effectfence certs --file trail.jsonl --verify                       # check an export offline

An export holds each certificate's args and result only with ``--show-payload`` (they may
hold personal data); without them a certificate cannot be verified offline, so an export
meant for ``--file`` needs it. ``--verify`` prints where the chain breaks (the seq, and the
line of a file), every certificate whose hash does not match, the seq gaps and the
overlapping attempts; it never prints a payload. Exit status: 0 ok; 1 broken or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, cast

from effectfence.canonical import canonical_bytes
from effectfence.cert import CERT_MAX_DEPTH
from effectfence.errors import InvalidRequest, StoreUnavailable
from effectfence.fence import EffectFence, _check_name
from effectfence.operator.trail import (
    TrailNotKept,
    TrailReport,
    check_trail,
    kept_after_cut,
    load_file,
    outside_parents,
    read_trail,
)
from effectfence.operator.views import open_fence, printable, whole_number

__all__ = ["NOT_FOUND", "main"]

#: ``--verify`` found no certificate to check (as ``intents show`` of no such intent)
NOT_FOUND = 3


_seq = whole_number(0, "a seq")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="effectfence certs",
        description="Export a domain's certificates (JSON lines, seq order) and verify the chain.",
    )
    p.add_argument("domain", nargs="?", help="the domain (not with --file)")
    p.add_argument("--store", metavar="URL", help="the store (default: the servers' default)")
    p.add_argument("--file", type=Path, help="verify this export instead of a store's trail")
    p.add_argument("--verify", action="store_true", help="check hashes, links, order and gaps")
    p.add_argument("--after", type=_seq, default=0, metavar="SEQ", help="only seqs after this")
    p.add_argument("--limit", type=_seq, help="at most this many certificates")
    p.add_argument("--json", action="store_true", help="--verify: print the report as JSON")
    p.add_argument(
        "--show-payload",
        action="store_true",
        help="export args and results (needed to verify the export offline; may hold "
        "personal data)",
    )
    return p


def redacted(cert: Any) -> dict[str, Any]:
    """A certificate's JSON form with args and result replaced by their SHA-256."""
    d: dict[str, Any] = cert.to_dict()
    for key, raw in (("args", cert.args_json), ("result", cert.result_json)):
        del d[key]
        d[f"{key}_sha256"] = hashlib.sha256(raw).hexdigest()
    return d


def print_report(report: TrailReport, out: TextIO, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_dict(), sort_keys=True), file=out)
        return
    span = "" if not report.length else f", seq {report.first_seq}..{report.last_seq}"
    print(
        f"{'OK' if report.ok else 'BROKEN'}: {report.length} certificate(s) of "
        f"{report.domain!r}{span}",
        file=out,
    )
    if not report.ok:
        line = "" if report.broken_at_line is None else f" (line {report.broken_at_line})"
        # the reason may quote a file's own text (a field name): escaped for the terminal
        print(f"breaks at seq {report.broken_at_seq}{line}: {printable(report.reason)}", file=out)
    if report.tampered:
        print(f"hash does not match at seq {', '.join(map(str, report.tampered))}", file=out)
    for a, b in report.gaps:
        seqs = f"seq {a}" if a == b else f"seqs {a}..{b}"
        print(
            f"gap: no certificate for {seqs} (released, aborted or lapsed attempts, or pruned)",
            file=out,
        )
    if report.cut:
        linked = ""
        if report.after_cut:
            shown = ", ".join(map(str, report.after_cut[:20]))
            more = "" if len(report.after_cut) <= 20 else f" (+{len(report.after_cut) - 20})"
            linked = f"; seq {shown}{more} follow certificates that went with it"
        print(
            f"retention deleted the trail through seq {report.cut} (cert_retention or "
            f"certs_per_domain){linked}",
            file=out,
        )
    if report.concurrent:
        pairs = ", ".join(f"{a}~{b}" for a, b in report.concurrent[:20])
        more = "" if len(report.concurrent) <= 20 else f" (+{len(report.concurrent) - 20})"
        if not report.concurrent_complete:
            more += " (and more, not listed)"
        print(f"overlapping attempts (not damage): {pairs}{more}", file=out)


def _nothing(what: str, report: TrailReport, out: TextIO, as_json: bool) -> int:
    """Nothing to verify is not "OK": a mistyped domain must not pass for a sound trail."""
    if as_json:
        print(json.dumps({**report.to_dict(), "found": False}, sort_keys=True), file=out)
    else:
        print(f"NOTHING TO VERIFY: {what}", file=out)
    return NOT_FOUND


#: exit status when the output cannot be written (0, 1 and 3 are the verdicts, 2 usage)
CANT_WRITE = 4


class _CantWrite(Exception):
    """The output refused a write (a full disk, a closed pipe)."""


class _Output:
    """``out`` whose write errors are :class:`_CantWrite`: a full disk ended an export in a
    traceback, and ``--verify``'s exit 1 could not be told from a broken chain (found by
    review)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, text: str) -> int:
        try:
            return self._out.write(text)
        except OSError as exc:
            raise _CantWrite(exc.strerror or str(exc)) from exc

    def flush(self) -> None:
        try:
            self._out.flush()
        except OSError as exc:
            raise _CantWrite(exc.strerror or str(exc)) from exc


def main(
    argv: list[str] | None = None, *, fence: EffectFence | None = None, out: TextIO | None = None
) -> int:
    target = out or sys.stdout
    sink = _Output(target)
    try:
        code = _main(argv, fence=fence, out=cast(TextIO, sink))
        sink.flush()  # a buffered stdout fails here, not at exit with a traceback
        return code
    except _CantWrite as exc:
        print(f"effectfence certs: can't write the output: {exc}", file=sys.stderr)
        if target is sys.stdout:
            # what is still buffered would fail again at exit: drop it
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CANT_WRITE


def _main(argv: list[str] | None, *, fence: EffectFence | None, out: TextIO) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.file is None) == (args.domain is None):
        parser.error("name a DOMAIN (from a store) or --file (an export), one of them")
    if args.file is not None:
        if not args.verify:
            parser.error("--file is read to be verified: add --verify")
        try:
            certs, lines, complaint = load_file(args.file)
        except OSError as exc:
            print(f"effectfence certs: can't read {args.file}: {exc.strerror}", file=sys.stderr)
            return 1
        report = check_trail(certs, lines)
        if not certs and not complaint:
            return _nothing(f"no certificate in {args.file}", report, out, args.json)
        if complaint:
            if "missing fields" in complaint:
                complaint += " (an export without --show-payload cannot be verified)"
            bad_line = int(complaint.split()[1]) if complaint.startswith("line ") else None
            report = replace(report, ok=False, broken_at_line=bad_line, reason=complaint)
        print_report(report, out, as_json=args.json)
        return 0 if report.ok else 1
    try:
        _check_name("domain", args.domain)  # typed, not a driver's error (argv not UTF-8)
    except InvalidRequest as exc:
        print(f"effectfence certs: {printable(exc.message)}", file=sys.stderr)
        return 2
    own = fence is None
    try:
        if fence is None:
            fence = open_fence(args.store)
    except (ValueError, RuntimeError, StoreUnavailable) as exc:
        print(f"effectfence certs: can't open the store: {exc}", file=sys.stderr)
        return 1
    try:
        trail = read_trail(fence.store, args.domain, after_seq=args.after, limit=args.limit)
        if args.verify:
            window = list(trail)
            cut = fence.store.trail_cut(args.domain)
            before = outside_parents(fence.store, args.domain, window, cut=cut)
            report = check_trail(
                window,
                outside=before,
                cut=cut,
                kept_before=kept_after_cut(fence.store, args.domain, cut, args.after),
                root=None,  # the store's trail: its first parent is looked up like the rest
            )
            if report.domain is None:
                report = TrailReport(True, 0, args.domain)
                where = "" if args.after == 0 else f" after seq {args.after}"
                return _nothing(
                    f"no certificate of {args.domain!r} in this store{where} (a domain "
                    "nothing has committed in, a mistyped one, or a trail pruned by "
                    "cert_retention)",
                    report,
                    out,
                    args.json,
                )
            print_report(report, out, as_json=args.json)
            return 0 if report.ok else 1
        for cert in trail:
            body = cert.to_dict() if args.show_payload else redacted(cert)
            out.write(canonical_bytes(body, max_depth=CERT_MAX_DEPTH).decode() + "\n")
        return 0
    except TrailNotKept as exc:
        print(f"effectfence certs: {exc}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:
        print(f"effectfence certs: {exc}", file=sys.stderr)
        return 1
    finally:
        if own:
            fence.close()
