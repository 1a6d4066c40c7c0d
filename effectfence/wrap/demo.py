"""``effectfence demo``: a payment server that double-fires, probed raw and through ``wrap``.

The bundled server (``python -m effectfence.wrap.demo serve``) is a plain stdio MCP server
with a ``charge_card`` tool that does what many real tools do: it takes a while, then
charges, with nothing to stop two identical calls from both charging. Every charge gets a
new id, so the probe can count them. ``get_charges`` is read-only. A charge of zero or fewer
cents is declined (an ``isError`` result: nothing was charged).

It speaks the handshake-era protocol by hand (no ``mcp`` import): it starts in ~0.1 s and
shows that ``wrap`` needs nothing from a child's SDK. With ``--ledger FILE`` every charge is
also appended to FILE as one JSON line, so tests count effects, not answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import uuid
from typing import Any

import orjson

__all__ = ["main", "serve_main"]

TOOLS = [
    {
        "name": "charge_card",
        "title": "Charge a card",
        "description": "Charge `cents` to the card on file for `order_id`. Takes a moment.",
        "inputSchema": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}, "cents": {"type": "integer"}},
            "required": ["order_id", "cents"],
        },
        "annotations": {"destructiveHint": False, "idempotentHint": False, "openWorldHint": True},
    },
    {
        "name": "get_charges",
        "title": "List charges",
        "description": "The charges this server made so far.",
        "inputSchema": {"type": "object", "properties": {}},
        "annotations": {"readOnlyHint": True, "openWorldHint": False},
    },
]


class DemoServer:
    def __init__(self, delay: float, ledger: str | None) -> None:
        self.delay = delay
        self.ledger = ledger
        self.charges: list[dict[str, Any]] = []

    def answer(self, rid: Any, result: Any = None, error: dict[str, Any] | None = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid}
        if error is not None:
            msg["error"] = error
        else:
            msg["result"] = result
        sys.stdout.buffer.write(orjson.dumps(msg) + b"\n")
        sys.stdout.buffer.flush()

    async def handle(self, msg: dict[str, Any]) -> None:
        method, rid, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
        if "id" not in msg:
            return  # notifications: nothing to do
        if method == "initialize":
            version = params.get("protocolVersion") or "2025-06-18"
            self.answer(
                rid,
                {
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "effectfence-demo-payments", "version": "1"},
                },
            )
        elif method == "ping":
            self.answer(rid, {})
        elif method == "tools/list":
            self.answer(rid, {"tools": TOOLS})
        elif method == "tools/call":
            await self.call(rid, params.get("name"), params.get("arguments") or {})
        else:
            self.answer(rid, error={"code": -32601, "message": f"method not found: {method}"})

    async def call(self, rid: Any, name: Any, args: dict[str, Any]) -> None:
        if name == "get_charges":
            text = json.dumps(self.charges)
            self.answer(
                rid,
                {
                    "content": [{"type": "text", "text": text}],
                    "structuredContent": {"charges": self.charges},
                },
            )
            return
        if name != "charge_card":
            self.answer(
                rid,
                {"content": [{"type": "text", "text": f"unknown tool {name}"}], "isError": True},
            )
            return
        cents = args.get("cents")
        if type(cents) is not int or cents <= 0:
            self.answer(
                rid,
                {
                    "content": [{"type": "text", "text": "declined: cents must be > 0"}],
                    "isError": True,
                },
            )
            return
        await asyncio.sleep(self.delay)  # the payment network takes its time...
        charge = {
            "charge_id": "ch_" + secrets.token_hex(6),
            "order_id": args.get("order_id"),
            "cents": cents,
        }
        self.charges.append(charge)  # ...and nothing here stops a second identical call
        if self.ledger:
            with open(self.ledger, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({**charge, "pid": os.getpid()}) + "\n")
        text = f"charged {cents} cents for order {charge['order_id']}: {charge['charge_id']}"
        self.answer(rid, {"content": [{"type": "text", "text": text}], "structuredContent": charge})


async def _serve(delay: float, ledger: str | None) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    server = DemoServer(delay, ledger)
    tasks: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        try:
            msg = orjson.loads(line)
        except orjson.JSONDecodeError:
            server.answer(None, error={"code": -32700, "message": "parse error"})
            continue
        if isinstance(msg, dict):
            task = asyncio.ensure_future(server.handle(msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=10)


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="effectfence demo serve")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds a charge takes")
    parser.add_argument("--ledger", help="append every charge to this file (JSON lines)")
    opts = parser.parse_args(argv)
    asyncio.run(_serve(opts.delay, opts.ledger))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``effectfence demo``: probe the double-firing server raw, then through ``wrap``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    from effectfence.wrap.client import RPCError
    from effectfence.wrap.probe import probe

    parser = argparse.ArgumentParser(
        prog="effectfence demo",
        description="Fire identical concurrent charges at a server that double-fires, raw and "
        "through effectfence wrap. (effectfence demo serve: run that server alone.)",
    )
    parser.add_argument("--calls", type=int, default=12, help="identical calls (12)")
    parser.add_argument("--store", default="memory:", help="the wrapper's store (memory:)")
    opts = parser.parse_args(argv)
    if opts.calls < 1:
        parser.error("--calls must be at least 1")  # as probe's (found by review)
    server = [sys.executable, "-m", "effectfence.wrap.demo", "serve"]
    wrapped = [sys.executable, "-m", "effectfence", "wrap", "--store", opts.store, "--", *server]
    args = {"order_id": f"demo-{uuid.uuid4().hex[:8]}", "cents": 4200}
    print(f"charge_card({json.dumps(args)}) x {opts.calls}, all at once:")
    for label, cmd in (("raw", server), ("through wrap", wrapped)):
        try:
            rep = asyncio.run(probe(cmd, "charge_card", args, opts.calls))
        except (OSError, RPCError, TimeoutError, ConnectionError) as exc:
            # a wrapper that cannot start (a bad --store) printed a traceback (found by
            # review); what it wrote on stderr is above this line
            print(
                f"effectfence demo: the server {label} did not answer "
                f"({exc or type(exc).__name__}); check --store {opts.store!r}",
                file=sys.stderr,
            )
            return 2
        print(
            f"  {label:<13} {rep.distinct:>3} distinct charge(s), {rep.replayed} replayed, "
            f"{rep.errors} errors"
        )
    # what the demonstration shows, checked: it exited 0 whatever came back through the
    # fence (an error, a second charge), so a script running it learnt nothing (found by
    # review)
    if (rep.distinct, rep.errors) != (1, 0):
        print(
            f"effectfence demo: FAILED: through wrap, {opts.calls} identical calls should "
            f"charge once and all succeed; they made {rep.distinct} distinct charge(s) with "
            f"{rep.errors} error(s)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
