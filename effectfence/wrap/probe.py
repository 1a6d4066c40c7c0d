"""``effectfence probe --tool NAME -- CMD ...``: a double-fire detector.

Fires N identical calls at once at a stdio MCP server and counts the distinct results that
came back. A tool whose every run returns something new (a charge id, a row id, a time)
shows one distinct result per execution: more than one means it fired more than once. A
tool whose results never vary (``"1 row affected"``) hides double fires from this count;
check its effect downstream instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from effectfence.wrap.client import RPCError, StdioClient
from effectfence.wrap.proxy import META_KEY

__all__ = ["NOTHING_COUNTED", "ProbeReport", "main", "probe"]

#: exit status when no call succeeded: no verdict either way
NOTHING_COUNTED = 3


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What N identical calls brought back."""

    calls: int
    ok: int
    errors: int
    distinct: int  # distinct successful results: executions, for a tool whose results vary
    replayed: int  # results the fence marked as replays
    seconds: float


def effect_key(result: dict[str, Any]) -> bytes:
    """A result's identity without its envelope (``_meta``, ``resultType``)."""
    body = {k: v for k, v in result.items() if k not in ("_meta", "resultType")}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


async def probe(
    argv: list[str], tool: str, args: dict[str, Any], calls: int, *, timeout: float = 60.0
) -> ProbeReport:
    """Start ``argv``, initialize, fire ``calls`` identical calls concurrently, stop it."""
    client = await StdioClient.start(argv)
    try:
        await asyncio.wait_for(client.initialize(), timeout)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answers = await asyncio.gather(
            *(client.call_tool(tool, args, timeout=timeout) for _ in range(calls)),
            return_exceptions=True,
        )
        elapsed = loop.time() - t0
    finally:
        await client.close()
    good = [a for a in answers if isinstance(a, dict) and a.get("isError") is not True]
    replayed = sum(
        1
        for a in good
        if isinstance(a.get("_meta"), dict) and a["_meta"].get(META_KEY, {}).get("replayed")
    )
    return ProbeReport(
        calls=calls,
        ok=len(good),
        errors=calls - len(good),
        distinct=len({effect_key(a) for a in good}),
        replayed=replayed,
        seconds=round(elapsed, 3),
    )


def main(argv: list[str] | None = None) -> int:
    """Exit 0: at most one distinct effect; 1: more than one (it fired twice); 2: usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, cmd = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="effectfence probe",
        description="Fire N identical concurrent tool calls at a stdio MCP server and report "
        "how many distinct effects came back (a double-fire detector).",
        usage="effectfence probe --tool NAME [--args JSON] [--calls N] [--timeout S] [--json] "
        "-- CMD [ARGS...]",
    )
    parser.add_argument("--tool", required=True, help="the tool to call")
    parser.add_argument("--args", default="{}", metavar="JSON", help="its arguments (an object)")
    parser.add_argument("--calls", type=int, default=12, metavar="N", help="how many (12)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long the server may take to start and to answer each call (60)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    opts = parser.parse_args(ours)
    if not cmd:
        parser.error("name the server after --")
    try:
        args = json.loads(opts.args)
    except json.JSONDecodeError as exc:
        parser.error(f"--args is not JSON: {exc}")
    if not isinstance(args, dict) or opts.calls < 1:
        parser.error("--args must be a JSON object and --calls at least 1")
    if not 0 < opts.timeout < float("inf"):  # NaN too: it timed out at once, unexplained
        parser.error(f"--timeout must be a positive number of seconds, got {opts.timeout}")
    try:
        report = asyncio.run(probe(cmd, opts.tool, args, opts.calls, timeout=opts.timeout))
    except (OSError, RPCError, TimeoutError, ConnectionError) as exc:
        # a timeout's text is empty: it printed "effectfence probe: " alone (review)
        why = str(exc) or ("no answer within --timeout" if isinstance(exc, TimeoutError) else "")
        print(f"effectfence probe: {why or type(exc).__name__}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps(asdict(report)))
    else:
        print(
            f"{report.calls} identical calls of {opts.tool}: {report.ok} ok, {report.errors} "
            f"errors, {report.distinct} distinct effect(s), {report.replayed} replayed "
            f"({report.seconds:.2f}s)"
        )
    if report.distinct > 1:
        return 1
    if report.ok == 0:
        # nothing came back to count: a gate must not read "no double fire" here (a server
        # that died after its handshake exited 0; found by review)
        print(
            "effectfence probe: INCONCLUSIVE: no call succeeded, so nothing was counted",
            file=sys.stderr,
        )
        return NOTHING_COUNTED
    return 0
