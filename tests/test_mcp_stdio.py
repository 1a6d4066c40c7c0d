"""The MCP server as a real subprocess over stdio (``effectfence serve``).

Each test spawns ``python -m effectfence serve`` and talks to it with the SDK's own
``stdio_client`` + ``ClientSession`` (or, for bytes no client would send, raw JSON-RPC lines).
Spawning costs ~1.5 s (``import mcp``), so each test covers a whole flow.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp_types import CallToolResult

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "effectfence", "serve"]
TIMEOUT = 30


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _env(**extra: str) -> dict[str, str]:
    # each server its own memory unless a test names a store: the default store is a file
    # in the user's state directory, which tests must never share by accident
    env = {
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "EFFECTFENCE_STORE": "memory:",
    }
    env.update(extra)
    return env


@asynccontextmanager
async def serve(*args: str, **env: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=SERVE[0], args=[*SERVE[1:], *args], env=_env(**env))
    with anyio.fail_after(TIMEOUT):
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def code(result: CallToolResult) -> str:
    assert result.is_error and result.structured_content is not None
    text = result.content[0].text  # type: ignore[union-attr]
    assert json.loads(text.splitlines()[-1]) == result.structured_content
    return str(result.structured_content["code"])


def req(intent: str = "charge:1", agent: str = "a") -> dict[str, Any]:
    return {
        "intent": intent,
        "domain": "order:1",
        "tool": "charge_card",
        "args": {"cents": 500},
        "agent": agent,
    }


async def test_stdio_schemas_and_the_whole_protocol() -> None:
    async with serve() as s:
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert "fence_clear" not in tools
        assert set(tools["fence_prepare"].input_schema["required"]) == {
            "intent",
            "domain",
            "tool",
            "args",
            "agent",
        }
        for t in tools.values():
            assert t.output_schema is not None and t.annotations is not None
            assert t.input_schema["additionalProperties"] is False

        # prepare -> commit -> duplicate replays the identical cert
        fresh = ok(await s.call_tool("fence_prepare", req()))
        assert fresh["status"] == "fresh"
        committed = ok(
            await s.call_tool("fence_commit", {"prepared": fresh["prepared"], "result": {"id": 9}})
        )
        replay = ok(await s.call_tool("fence_prepare", req(agent="b")))
        assert replay["status"] == "replay" and replay["result"] == {"id": 9}
        assert replay["cert"] == committed["cert"]
        assert ok(await s.call_tool("fence_verify", {"cert": replay["cert"]}))["ok"] is True

        # abort fences the intent; release frees it
        t = ok(await s.call_tool("fence_prepare", req("email:1")))["prepared"]
        ok(await s.call_tool("fence_abort", {"prepared": t, "reason": "smtp timeout"}))
        assert code(await s.call_tool("fence_prepare", req("email:1", "b"))) == "intent_failed"
        t = ok(await s.call_tool("fence_prepare", req("ship:1")))["prepared"]
        ok(await s.call_tool("fence_release", {"prepared": t}))
        assert ok(await s.call_tool("fence_prepare", req("ship:1", "b")))["status"] == "fresh"

        # a forged (edited) ticket is refused and changes nothing
        body, mac = t.rsplit(".", 1)
        edited = body[:-2] + ("A" if body[-2] != "A" else "B") + body[-1] + "." + mac
        before = ok(await s.call_tool("fence_status", {"intent": "ship:1"}))
        assert code(await s.call_tool("fence_commit", {"prepared": edited, "result": 1})) in (
            "invalid_ticket"
        )
        # the released ticket is spent
        assert code(await s.call_tool("fence_commit", {"prepared": t, "result": 1})) == "lease_lost"
        after = ok(await s.call_tool("fence_status", {"intent": "ship:1"}))
        assert before["state"] == after["state"] == "in_flight"
        assert before["token"] == after["token"]

        # malformed arguments: a clear error, nothing decided
        bad = await s.call_tool("fence_prepare", {**req("x:1"), "surprise": 1})
        assert code(bad) == "invalid_request"
        assert ok(await s.call_tool("fence_status", {"intent": "x:1"}))["state"] == "absent"

        stats = ok(await s.call_tool("fence_stats", {}))
        assert stats["events"]["commits"] == 1 and stats["events"]["aborts"] == 1
        assert stats["events"]["releases"] == 1


async def test_stdio_sixteen_concurrent_duplicates_admit_exactly_one() -> None:
    async with serve() as s:
        for round_ in range(3):
            results: list[CallToolResult] = []

            async def call(i: int, intent: str, out: list[CallToolResult]) -> None:
                out.append(await s.call_tool("fence_prepare", req(intent, f"agent-{i}")))

            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(call, i, f"pay:{round_}", results)
            fresh = [r for r in results if not r.is_error]
            assert len(results) == 16 and len(fresh) == 1
            assert {code(r) for r in results if r.is_error} == {"intent_in_flight"}
        stats = ok(await s.call_tool("fence_stats", {}))
        assert stats["prepare"]["admitted"] == 3
        assert stats["prepare"]["intent_in_flight"] == 45


async def test_stdio_allow_clear_by_flag_or_environment() -> None:
    async with serve("--allow-clear") as s:
        names = {t.name for t in (await s.list_tools()).tools}
        assert "fence_clear" in names
        t = ok(await s.call_tool("fence_prepare", req()))["prepared"]
        # a live lease: refused without force, and a clear always needs a reason
        live = await s.call_tool("fence_clear", {"intent": "charge:1", "reason": "stuck?"})
        assert code(live) == "intent_in_flight"
        assert code(await s.call_tool("fence_clear", {"intent": "charge:1"})) == ("invalid_request")
        ok(await s.call_tool("fence_abort", {"prepared": t}))
        cleared = ok(
            await s.call_tool("fence_clear", {"intent": "charge:1", "reason": "never charged"})
        )
        assert cleared["cleared"] is True and cleared["previous_state"] == "failed"
        assert cleared["who"] == "mcp client (stdio)" and cleared["reason"] == "never charged"
        assert cleared["forced"] is False and cleared["audit_id"] >= 1
        assert ok(await s.call_tool("fence_prepare", req()))["status"] == "fresh"
    async with serve(EFFECTFENCE_ALLOW_CLEAR="1") as s:
        assert "fence_clear" in {t.name for t in (await s.list_tools()).tools}


async def test_stdio_tickets_are_bound_to_their_store_even_with_a_shared_key() -> None:
    key = "0123456789abcdef0123456789abcdef"
    async with (
        serve(EFFECTFENCE_TICKET_KEY=key) as a,
        serve(EFFECTFENCE_TICKET_KEY=key) as b,
        serve() as c,
    ):
        ticket = ok(await a.call_tool("fence_prepare", req()))["prepared"]
        # b shares the key but not the store (each process has its own memory, whose tokens
        # come from an unrelated counter): the ticket is bound to a's store and refused
        assert code(await b.call_tool("fence_commit", {"prepared": ticket, "result": 1})) == (
            "invalid_ticket"
        )
        assert code(await c.call_tool("fence_commit", {"prepared": ticket, "result": 1})) == (
            "invalid_ticket"
        )
        ok(await a.call_tool("fence_commit", {"prepared": ticket, "result": 1}))


async def test_two_clients_each_spawning_serve_share_the_default_store(tmp_path: Path) -> None:
    """The way every client config runs it: each agent process spawns its own server over
    stdio, with no store configured. They meet in the default SQLite ledger of the user's
    state directory: one fresh, the other told it is in flight; a ticket sealed by one opens
    in the other (the sealing key lives in the store); a restarted server replays."""
    state = {"EFFECTFENCE_STORE": "", "XDG_STATE_HOME": str(tmp_path)}
    async with serve(**state) as a, serve(**state) as b:
        first, second = await asyncio.gather(
            a.call_tool("fence_prepare", req("charge:777", "agent-a")),
            b.call_tool("fence_prepare", req("charge:777", "agent-b")),
        )
        results = [first, second]
        fresh = [r for r in results if not r.is_error]
        assert len(fresh) == 1, [r.structured_content for r in results]
        loser = next(r for r in results if r.is_error)
        assert code(loser) == "intent_in_flight"
        ticket = ok(fresh[0])["prepared"]
        other = b if fresh[0] is first else a
        cert = ok(await other.call_tool("fence_commit", {"prepared": ticket, "result": "ch_1"}))
    assert (tmp_path / "effectfence" / "fence.db").is_file()
    async with serve(**state) as again:  # a restart forgets nothing
        replay = ok(await again.call_tool("fence_prepare", req("charge:777", "agent-c")))
        assert replay["status"] == "replay"
        assert replay["cert"]["hash"] == cert["cert"]["hash"]


def test_stdio_serve_refuses_unknown_stores() -> None:
    proc = subprocess.run(
        [*SERVE, "--store", "mongodb://user:secret@host/0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, **_env()},
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert "unknown store scheme" in proc.stderr and "secret" not in proc.stderr
    assert proc.stdout == ""


async def test_stdio_survives_bytes_no_client_would_send() -> None:
    """Non-JSON numbers, absurd nesting and broken JSON: no crash, no hang, no state change."""
    async with await anyio.open_process(
        SERVE, env={**os.environ, **_env()}, stderr=subprocess.DEVNULL
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        buffered = b""

        async def send(obj: dict[str, Any] | str) -> None:
            line = obj if isinstance(obj, str) else json.dumps(obj)
            await proc.stdin.send(line.encode() + b"\n")  # type: ignore[union-attr]

        async def answer(id_: int) -> dict[str, Any]:
            nonlocal buffered
            with anyio.fail_after(TIMEOUT):
                while True:
                    while b"\n" in buffered:
                        line, buffered = buffered.split(b"\n", 1)
                        msg = json.loads(line)
                        if msg.get("id") == id_:
                            return dict(msg)
                    buffered += await proc.stdout.receive()  # type: ignore[union-attr]

        def call(id_: int, name: str, arguments: str) -> str:
            return (
                f'{{"jsonrpc":"2.0","id":{id_},"method":"tools/call",'
                f'"params":{{"name":"{name}","arguments":{arguments}}}}}'
            )

        await send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-11-25",
                    "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"},
                },
            }
        )
        assert "result" in await answer(1)
        await send({"jsonrpc": "2.0", "method": "notifications/initialized"})

        base = '"intent":"i","domain":"d","tool":"t","agent":"a"'
        refused = {
            2: call(2, "fence_prepare", "{" + base + ',"args":{"x":NaN}}'),
            3: call(3, "fence_prepare", "{" + base + ',"args":{"x":Infinity}}'),
            4: call(4, "fence_prepare", "{" + base + ',"args":{"x":-1e999}}'),
            5: call(
                5, "fence_prepare", "{" + base + ',"args":{"x":' + "[" * 100 + "]" * 100 + "}}"
            ),
            6: call(6, "fence_prepare", "{" + base + ',"args":{"x":1},"expected_seq":1e3}'),
            7: call(7, "fence_prepare", "{" + base + ',"args":{"x":1},"expected_seq":1e999}'),
            8: call(8, "fence_commit", '{"prepared":"x.y","result":NaN}'),
        }
        for line in refused.values():
            await send(line)
        # lines the transport cannot parse at all get no answer (no id to answer to)
        await send('{"jsonrpc":"2.0","id":90,"method":"tools/call", broken')
        await send(call(91, "fence_prepare", '{"args":' + "[" * 300 + "]" * 300 + "}"))
        await send("[" * 100_000 + "]" * 100_000)
        await send("\x00\x01 not json")
        for id_ in refused:
            msg = await answer(id_)
            if "error" in msg:  # refused by the transport as invalid params: also fine
                continue
            result = msg["result"]
            assert result["isError"] is True, (id_, result)
            codes = ("invalid_request", "invalid_ticket")  # 8 has both a bad ticket and NaN
            assert result["structuredContent"]["code"] in codes, (id_, result)
        # still alive, and nothing was decided
        await send(call(50, "fence_status", '{"intent":"i"}'))
        status = (await answer(50))["result"]["structuredContent"]
        assert status == {"intent": "i", "state": "absent"}
        await send(call(51, "fence_stats", "{}"))
        stats = (await answer(51))["result"]["structuredContent"]
        assert stats["prepare"]["admitted"] == 0 and stats["size"]["records"] == 0
        await proc.stdin.aclose()
        with anyio.fail_after(TIMEOUT):
            assert await proc.wait() == 0
