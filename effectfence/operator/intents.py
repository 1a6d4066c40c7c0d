"""``effectfence intents``: list, show, clear (with a recorded reason) and watch intents.

    effectfence intents list [--state failed] [--domain D] [--agent A] [--older-than 10m]
    effectfence intents show INTENT
    effectfence intents clear INTENT --reason "refunded by hand, ticket #81" [--force]
        [--expect-state failed --expect-token 42]
    effectfence intents watch [--interval 1] [--count N]

Every subcommand takes ``--store URL`` (default: the servers' default store) and ``--json``.
Exit status: 0 done; 1 refused or failed (the message says why); 2 usage; 3 no such intent.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, TextIO

from effectfence.errors import InvalidRequest, Refusal, StoreUnavailable
from effectfence.fence import EffectFence
from effectfence.operator.views import (
    STATE_FILTERS,
    entry_view,
    format_age,
    intent_view,
    list_intents,
    open_fence,
    parse_duration,
    printable,
    whoami,
    whole_number,
)

__all__ = ["main"]

NOT_FOUND = 3


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


_positive = whole_number(1, "a count")
#: audit entries ``show`` prints by default, the newest; it says when there are older ones
AUDIT_SHOWN = 20
_token = whole_number(0, "a token")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store", metavar="URL", help="the store (default: the servers' default store)"
    )
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument(
        "--show-payload",
        action="store_true",
        help="include args and results (they may hold personal data; off by default)",
    )
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument(
        "--state", action="append", choices=sorted(STATE_FILTERS), help="repeatable; default all"
    )
    filters.add_argument("--domain", help="only this domain")
    filters.add_argument("--agent", action="append", default=[], help="only these holders")
    filters.add_argument(
        "--older-than",
        metavar="AGE",
        type=parse_duration,
        help="failed that long, or lease lapsed that long ago (90s, 10m, 2h, 1d)",
    )
    filters.add_argument("--limit", type=_positive, default=1000, help="at most this many records")

    p = argparse.ArgumentParser(
        prog="effectfence intents",
        description="See what is fenced, clear it with a recorded reason, follow changes.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", parents=[common, filters], help="intents by state, domain, agent, age")
    show = sub.add_parser("show", parents=[common], help="one intent, its certificate and audit")
    show.add_argument("intent")
    show.add_argument(
        "--audit",
        type=_positive,
        default=AUDIT_SHOWN,
        metavar="N",
        help=f"the N newest audit entries (default {AUDIT_SHOWN}); older ones are said to exist",
    )
    clear = sub.add_parser("clear", parents=[common], help="clear an intent, recording why")
    clear.add_argument("intent")
    clear.add_argument("--reason", required=True, help="why (recorded in the audit trail)")
    clear.add_argument("--who", help="who clears (default: the OS user)")
    clear.add_argument(
        "--force",
        action="store_true",
        help="also clear an intent in flight under a live lease (its holder may be running it)",
    )
    clear.add_argument(
        "--expect-state",
        choices=("in_flight", "in_flight_lapsed", "done", "done_expired", "failed"),
        help="clear only if the record is still in this state (what `show` said)",
    )
    clear.add_argument(
        "--expect-token",
        type=_token,
        metavar="N",
        help="clear only if the record is still under this token (what `show` said): a lease "
        "taken over since, or a new attempt, is not cleared",
    )
    watch = sub.add_parser("watch", parents=[common, filters], help="follow changes as they come")
    watch.add_argument("--interval", type=_seconds, default=1.0, help="seconds between looks")
    watch.add_argument(
        "--count", type=_positive, help="stop after this many looks (default: never)"
    )
    return p


def _table(rows: list[dict[str, Any]], out: TextIO) -> None:
    cols = ("intent", "state", "domain", "seq", "holder", "token", "age", "detail")
    cells = [
        [
            format_age(r.get("age"))
            if c == "age"
            else ("" if r.get(c) is None else printable(r[c]))
            for c in cols
        ]
        for r in rows
    ]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(cols)]
    header = "  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True))
    print(header.rstrip(), file=out)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), file=out)
    print(f"({len(rows)} intent{'s' if len(rows) != 1 else ''})", file=out)


def _show(
    fence: EffectFence, intent: str, show_payload: bool, audit: int = AUDIT_SHOWN
) -> dict[str, Any]:
    rec, now = fence.record(intent)
    view = intent_view(intent, rec, now, show_payload=show_payload)
    # one more than shown, to know whether older entries were left out: cut silently, 25
    # entries showed as 20, the first 5 clears nowhere (found by a docs trial)
    entries = fence.audit(intent, limit=audit + 1)
    view["audit_older"] = len(entries) > audit
    view["audit"] = [entry_view(e, now) for e in entries[-audit:]]
    return view


def _print_show(view: dict[str, Any], out: TextIO) -> None:
    skip = {"cert", "audit", "age", "detail", "lease_left", "result_left"}
    for key, value in view.items():
        if key not in skip and value is not None:
            print(f"{key:<12} {printable(value)}", file=out)
    if view.get("lease_left") is not None:
        print(f"{'lease left':<12} {format_age(view['lease_left'])}", file=out)
    if view.get("age") is not None:
        label = "failed for" if view["state"] == "failed" else "lapsed for"
        print(f"{label:<12} {format_age(view['age'])}", file=out)
    cert = view.get("cert")
    if cert:
        print("certificate", file=out)
        for key, value in cert.items():
            shown = json.dumps(value) if key in ("args", "result") else printable(value)
            print(f"  {key:<12} {shown}", file=out)
    if view["state"] == "absent" and not view.get("audit"):
        print("(no record and no audit entry: never seen, expired, or mistyped)", file=out)
    if view.get("audit_older"):
        print(
            f"(older audit entries not shown: the {len(view['audit'])} newest follow; "
            "--audit N shows more)",
            file=out,
        )
    for e in view.get("audit", []):
        forced = " (forced)" if e["forced"] else ""
        was = e["previous"].get("state", "?")
        print(
            f"audit #{e['id']}  {e['when']} ({format_age(e['age'])} ago)  {e['action']}{forced} "
            f"by {printable(e['who'])} (was {was}): {printable(e['reason'])}",
            file=out,
        )


def main(
    argv: list[str] | None = None, *, fence: EffectFence | None = None, out: TextIO | None = None
) -> int:
    """``fence`` and ``out`` are for in-process use (tests, a program embedding the command)."""
    out = out or sys.stdout
    args = _parser().parse_args(argv)
    own = fence is None
    try:
        if fence is None:
            fence = open_fence(args.store)
    except (ValueError, RuntimeError, StoreUnavailable) as exc:
        print(f"effectfence intents: can't open the store: {exc}", file=sys.stderr)
        return 1
    try:
        return _run(args, fence, out)
    except StoreUnavailable as exc:
        print(f"effectfence intents: {exc}", file=sys.stderr)
        return 1
    except InvalidRequest as exc:  # a name no store can hold (a command line not UTF-8)
        print(f"effectfence intents: {printable(exc.message)}", file=sys.stderr)
        return 2
    finally:
        if own:
            fence.close()


def _run(args: argparse.Namespace, fence: EffectFence, out: TextIO) -> int:
    if args.cmd == "list":
        rows = list_intents(
            fence,
            states=args.state or (),
            domain=args.domain,
            agents=args.agent,
            older_than=args.older_than,
            limit=args.limit,
            show_payload=args.show_payload,
        )
        if args.json:
            print(json.dumps(rows, indent=2, sort_keys=True), file=out)
        else:
            _table(rows, out)
        return 0
    if args.cmd == "show":
        view = _show(fence, args.intent, args.show_payload, args.audit)
        if args.json:
            print(json.dumps(view, indent=2, sort_keys=True), file=out)
        else:
            _print_show(view, out)
        return NOT_FOUND if view["state"] == "absent" and not view["audit"] else 0
    if args.cmd == "clear":
        return _clear(args, fence, out)
    return _watch(args, fence, out)


def _clear(args: argparse.Namespace, fence: EffectFence, out: TextIO) -> int:
    who = args.who or whoami()
    try:
        entry = fence.clear(
            args.intent,
            reason=args.reason,
            who=who,
            force=args.force,
            expect_state=args.expect_state,
            expect_token=args.expect_token,
        )
    except Refusal as exc:
        if args.json:
            print(json.dumps({"cleared": False, **exc.to_payload()}, sort_keys=True), file=out)
        else:
            print(f"effectfence intents clear: refused {exc.code}: {exc.message}", file=sys.stderr)
            if exc.recover:
                print(f"  what to do: {exc.recover}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidRequest) else 1
    if entry is None:
        if args.json:
            print(
                json.dumps({"cleared": False, "intent": args.intent, "state": "absent"}), file=out
            )
        else:
            print(f"nothing to clear: {args.intent!r} has no record", file=sys.stderr)
        return NOT_FOUND
    view = entry_view(entry, fence.store.now())
    if args.json:
        print(json.dumps({"cleared": True, "audit": view}, sort_keys=True), file=out)
    else:
        forced = " (forced)" if entry.forced else ""
        print(
            f"cleared {args.intent!r}{forced} (was {entry.previous.get('state')}); recorded as "
            f"audit #{entry.id} by {entry.who}: {entry.reason}",
            file=out,
        )
    return 0


def _watch(args: argparse.Namespace, fence: EffectFence, out: TextIO) -> int:
    """Look every ``interval`` seconds; print what appeared, changed or went, and every new
    audit entry. The first look prints what is there."""
    seen: dict[str, dict[str, Any]] = {}
    last = fence.audit(limit=1)
    after = last[-1].id if last else 0
    looks = 0
    keys = ("state", "token", "holder", "failure")
    try:
        while args.count is None or looks < args.count:
            if looks:
                time.sleep(args.interval)
            looks += 1
            rows = list_intents(
                fence,
                states=args.state or (),
                domain=args.domain,
                agents=args.agent,
                older_than=args.older_than,
                limit=args.limit,
                show_payload=args.show_payload,
            )
            now_seen = {r["intent"]: r for r in rows}
            events: list[dict[str, Any]] = []
            for name, r in now_seen.items():
                old = seen.get(name)
                if old is None:
                    events.append({"event": "appeared", **r})
                elif any(old.get(k) != r.get(k) for k in keys):
                    events.append({"event": "changed", "was": old["state"], **r})
            events.extend(
                {"event": "gone", **old} for name, old in seen.items() if name not in now_seen
            )
            now = fence.store.now()
            for e in fence.audit(after=after, limit=1000):
                after = e.id
                events.append({"event": "audit", **entry_view(e, now)})
            seen = now_seen
            for ev in events:
                if args.json:
                    print(json.dumps(ev, sort_keys=True), file=out)
                elif ev["event"] == "audit":
                    print(
                        f"audit  {printable(ev['intent'])}  {ev['action']} by "
                        f"{printable(ev['who'])}: {printable(ev['reason'])}",
                        file=out,
                    )
                else:
                    mark = {"appeared": "+", "changed": "~", "gone": "-"}[ev["event"]]
                    was = f" (was {ev['was']})" if ev["event"] == "changed" else ""
                    line = (
                        f"{mark} {ev['intent']}  {ev['state']}{was}  {ev.get('domain', '')}  "
                        f"{ev.get('holder', '')}  {ev.get('detail', '')}"
                    )
                    print(printable(line).rstrip(), file=out)
            out.flush()
    except KeyboardInterrupt:
        pass
    return 0
