"""wrap under faults, in process: a Proxy fed by a StreamReader, relaying to a real child.

A store that fails after the child ran, a restarted child that fails its handshake: what
the client is told must match what happened (it ran / it did not), and nothing hangs.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from effectfence.canonical import canonical_bytes
from effectfence.errors import StoreUnavailable
from effectfence.wrap.policy import Policy
from effectfence.wrap.proxy import LINE_LIMIT, META_KEY, UNLISTED, Child, Proxy

ROOT = Path(__file__).resolve().parent.parent
CHILD = [sys.executable, str(ROOT / "tests" / "fixtures" / "wrap_raw_child.py")]
BOUND = 20.0

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the proxy is asyncio's


class Harness:
    def __init__(
        self,
        tmp: Path,
        monkeypatch: pytest.MonkeyPatch,
        *,
        child: list[str] = CHILD,
        policy: Policy | None = None,
        **env: str,
    ) -> None:
        self.ledger_path = tmp / "ledger.jsonl"
        monkeypatch.setenv("RAW_LEDGER", str(self.ledger_path))
        monkeypatch.setenv("RAW_STARTS", str(tmp / "starts"))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        self.out: list[bytes] = []
        self.fail_writes = 0  # the next writes to the client raise, after keeping the bytes
        self.proxy = Proxy(child, self._write, store_url="memory:", policy=policy)
        self.reader = asyncio.StreamReader(limit=LINE_LIMIT)  # as the wrapper's stdin
        self.task = asyncio.ensure_future(self.proxy.run(self.reader))
        self.next_id = 0

    def send(self, method: str, params: dict[str, Any] | None = None) -> int:
        self.next_id += 1
        msg = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params or {}}
        self.reader.feed_data(json.dumps(msg).encode() + b"\n")
        return self.next_id

    def _write(self, data: bytes) -> None:
        self.out.append(data)
        if self.fail_writes:
            self.fail_writes -= 1
            raise OSError(28, "No space left on device")

    def raw(self, *lines: bytes) -> None:
        """Lines as the client wrote them, in one read."""
        self.reader.feed_data(b"".join(line + b"\n" for line in lines))

    def notify(self, method: str) -> None:
        msg = {"jsonrpc": "2.0", "method": method, "params": {}}
        self.reader.feed_data(json.dumps(msg).encode() + b"\n")

    async def answer(self, rid: int) -> dict[str, Any]:
        async with asyncio.timeout(BOUND):
            while True:
                for line in self.out:
                    try:
                        msg = json.loads(line)
                    except ValueError:  # a line relayed as the child wrote it (not UTF-8)
                        continue
                    if isinstance(msg, dict) and msg.get("id") == rid:
                        return msg  # type: ignore[no-any-return]
                await asyncio.sleep(0.01)

    async def start(self, *, list_tools: bool = True) -> None:
        init = {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "faults", "version": "1"},
        }
        await self.answer(self.send("initialize", init))
        self.notify("notifications/initialized")
        if list_tools:
            await self.answer(self.send("tools/list"))

    def ledger(self) -> list[Any]:
        if not self.ledger_path.exists():
            return []
        return [json.loads(x) for x in self.ledger_path.read_text().splitlines()]

    async def stop(self) -> int:
        self.reader.feed_eof()
        async with asyncio.timeout(BOUND):
            return await self.task


def text(msg: dict[str, Any]) -> str:
    return "\n".join(c.get("text", "") for c in msg["result"].get("content", []))


def mark(msg: dict[str, Any]) -> dict[str, Any]:
    return msg["result"]["_meta"][META_KEY]  # type: ignore[no-any-return]


async def test_a_commit_the_store_never_takes_is_answered_as_ran_never_as_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child charged; the ledger could not record it. Telling the client "NOT run"
    would invite the retry that charges twice: the client gets the child's answer, marked
    unrecorded, and identical calls are refused (the intent is fenced as failed)."""
    monkeypatch.setattr("effectfence.driver.COMMIT_RETRY_PAUSES", (0.0, 0.0), raising=False)
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    fence = h.proxy.any_fence()
    attempts: list[str] = []

    def down(ticket: Any, result: Any) -> Any:
        attempts.append(ticket.intent)
        raise StoreUnavailable("the store is down (simulated)")

    monkeypatch.setattr(fence, "commit", down)
    first = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert len(attempts) == 3  # the commit was tried again before giving up
    assert "isError" not in first["result"] and text(first) == "charged"
    assert "NOT run" not in text(first)
    marker = mark(first)
    assert marker["recorded"] is False and marker["refused"] == "store_unavailable"
    assert "RAN" in marker["reason"]
    again = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert again["result"].get("isError") is True
    assert mark(again)["refused"] == "intent_failed"
    assert len(h.ledger()) == 1
    assert await h.stop() == 0


async def test_a_restart_that_fails_its_handshake_neither_hangs_nor_fences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child dies; its restart dies during the replayed handshake. The call that
    triggered the restart never reached a child: it is told so and its intent released,
    later messages are still answered, and the wrapper exits when the client hangs up."""
    h = Harness(tmp_path, monkeypatch, RAW_DIE_AT_START="2")
    await h.start()
    h.send("tools/call", {"name": "die", "arguments": {}})  # read-only: relayed; child exits
    async with asyncio.timeout(BOUND):
        while h.proxy.child is not None:
            await asyncio.sleep(0.01)
    call = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 7}}))
    assert call["result"].get("isError") is True
    assert "NOT run" in text(call) and mark(call)["outcome"] == "not_run"
    # stopped before any decision (the new child's tools are listed first), or released
    intent = mark(call).get("intent")
    if intent is not None:
        assert h.proxy.any_fence().intent_status(intent).state == "absent"  # not failed
    ping = await h.answer(h.send("ping"))
    assert "result" in ping or "error" in ping
    # the third start works: the identical call runs, once
    ran = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 7}}))
    assert text(ran) == "charged" and mark(ran)["replayed"] is False
    assert h.ledger() == [{"order": 7}]
    assert await h.stop() == 0


async def test_a_batch_that_calls_a_tool_is_refused_whole_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relayed as a batch, its tools/call would reach the child unfenced: twins in one
    batch would both charge. Every request in it is refused, and nothing reaches the child."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    call = {"name": "charge", "arguments": {"order": 9}}
    batch = [
        {"jsonrpc": "2.0", "id": 101, "method": "tools/call", "params": call},
        {"jsonrpc": "2.0", "id": 102, "method": "tools/call", "params": call},
        {"jsonrpc": "2.0", "id": 103, "method": "ping"},
    ]
    h.reader.feed_data(json.dumps(batch).encode() + b"\n")
    async with asyncio.timeout(BOUND):
        while not any(line.startswith(b"[") for line in h.out):
            await asyncio.sleep(0.01)
    [answer] = [json.loads(line) for line in h.out if line.startswith(b"[")]
    assert sorted(a["id"] for a in answer) == [101, 102, 103]
    assert all(a["error"]["code"] == -32600 for a in answer)
    one = await h.answer(h.send("tools/call", call))  # one by one, the call is fenced
    assert text(one) == "charged"
    assert h.ledger() == [{"order": 9}]
    assert await h.stop() == 0


async def test_a_client_id_shaped_like_the_wrappers_own_still_gets_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper tells its own requests' answers from the client's by id. A client id that
    looked like one of them would have its answer swallowed, and the client would wait
    forever: the wrapper's ids carry a random part no client can know."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    for rid in ("effectfence-wrap:1", "effectfence-wrap:2", "effectfence-wrap:"):
        msg = {"jsonrpc": "2.0", "id": rid, "method": "ping", "params": {}}
        h.reader.feed_data(json.dumps(msg).encode() + b"\n")
        async with asyncio.timeout(BOUND):
            while not any(json.loads(line).get("id") == rid for line in h.out):
                await asyncio.sleep(0.01)
    assert await h.stop() == 0


async def test_a_call_cancelled_while_the_tools_are_learned_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call makes the wrapper ask the child for its tools. A cancel that comes
    during that wait stops the call: nothing is claimed, nothing runs, no answer is sent,
    and the same call made again runs once."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_LIST_GATE=str(gate))
    await h.start(list_tools=False)  # the call below is what asks the child for its tools
    call = {"name": "charge", "arguments": {"order": 11}}
    first = h.send("tools/call", call)
    asked = Path(str(gate) + ".asked")
    async with asyncio.timeout(BOUND):
        while not asked.exists():  # the wrapper is waiting for the child's tools now
            await asyncio.sleep(0.01)
    cancel = {"requestId": first, "reason": "changed my mind"}
    h.reader.feed_data(
        json.dumps(
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel}
        ).encode()
        + b"\n"
    )
    async with asyncio.timeout(BOUND):
        while first in h.proxy.calls:
            await asyncio.sleep(0.01)
    gate.touch()
    again = await h.answer(h.send("tools/call", call))
    assert text(again) == "charged"
    assert h.ledger() == [{"order": 11}], "the cancelled call ran"
    assert not [line for line in h.out if json.loads(line).get("id") == first]
    assert await h.stop() == 0


# -- what a client may write that the wrapper must still read right (found by review) ------------


async def test_a_call_orjson_cannot_read_is_still_fenced_and_a_line_that_is_no_json_goes_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """orjson refuses NaN, 1e400 and lone surrogates, which Python's json and JavaScript
    send. Such a tools/call was relayed as it came, unfenced: three identical calls charged
    three times. An integer past 64 bits was read as a float, so two different orders named
    one intent and the second was answered with the first's result. Both are now read
    exactly and refused typed (the fence cannot hold such numbers); a line that is no JSON
    at all is answered -32700 and never reaches the child."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    odd = (b"NaN", b"1e400", b'"\\ud83d"', b"18446744073709551616", b"18446744073709551617")
    ids = []
    for n, value in enumerate(odd * 2, 100):
        h.raw(
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call",' % n
            + b'"params":{"name":"charge","arguments":{"order":%s}}}' % value
        )
        ids.append(n)
    for n in ids:
        answer = await h.answer(n)
        assert answer["result"]["isError"] is True, answer
        assert mark(answer)["refused"] == "invalid_request", answer
    h.raw(b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge"')
    async with asyncio.timeout(BOUND):
        while not any(b"-32700" in line for line in h.out):
            await asyncio.sleep(0.01)
    error = json.loads(next(line for line in h.out if b"-32700" in line))
    assert error["id"] is None
    assert "result" in await h.answer(h.send("ping"))
    assert h.ledger() == []
    assert await h.stop() == 0


async def test_ids_the_wrapper_cannot_track_are_refused_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object or array id crashed the wrapper (unhashable), taking every call in flight
    and the child with it. Such a request is refused -32600; such a cancel is relayed."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    h.raw(
        b'{"jsonrpc":"2.0","id":{"x":1},"method":"ping"}',
        b'{"jsonrpc":"2.0","id":[1],"method":"tools/call","params":{"name":"charge"}}',
        b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":[1]}}',
    )
    async with asyncio.timeout(BOUND):
        while sum(b"-32600" in line for line in h.out) < 2:
            await asyncio.sleep(0.01)
    ok = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert text(ok) == "charged"
    assert h.ledger() == [{"order": 1}]
    assert await h.stop() == 0


async def test_a_call_cancelled_in_the_same_read_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel read right after its call (no await between them) found no call yet and
    was relayed to the child, which never saw that id: the call ran and was answered."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    h.raw(
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call",'
        b'"params":{"name":"charge","arguments":{"order":5}}}',
        b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":5}}',
    )
    after = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 6}}))
    assert text(after) == "charged"
    assert not any(json.loads(line).get("id") == 5 for line in h.out)
    assert h.ledger() == [{"order": 6}]
    assert h.proxy.calls == {}
    assert await h.stop() == 0


async def test_a_domain_template_that_cannot_be_filled_is_refused_not_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """str.format raised TypeError for an argument named ``tool`` (or ``{order[0]}`` on a
    number), which nothing caught: the call was never answered."""
    policy = Policy.from_dict({"tools": {"charge": {"domain": "pay:{tool}:{order[0]}"}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    await h.start()
    refused = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 3}}))
    assert mark(refused)["refused"] == "invalid_request" and "domain template" in text(refused)
    named = {"name": "charge", "arguments": {"order": "ab", "tool": "x"}}
    ran = await h.answer(h.send("tools/call", named))
    assert text(ran) == "charged"
    status = {"name": "effectfence_status", "arguments": {"tool": "charge", "arguments": {}}}
    assert "result" in await h.answer(h.send("tools/call", status))
    assert h.ledger() == [{"order": "ab", "tool": "x"}]
    assert await h.stop() == 0


async def test_escaped_2026_keys_are_stripped_for_a_handshake_era_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strip was decided on the raw bytes, so ``io.modelcontextprotocol\\/...`` (the
    same key, legally escaped) reached a child that rejects such keys."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    child = h.proxy.child
    assert child is not None
    sent: list[bytes] = []
    write = child.write
    monkeypatch.setattr(child, "write", lambda data: (sent.append(data), write(data))[1])
    h.raw(
        b'{"jsonrpc":"2.0","id":8,"method":"ping","params":{"_meta":'
        b'{"io.modelcontextprotocol\\/protocolVersion":"2026-07-28","keep":1},'
        b'"n":18446744073709551617}}'
    )
    assert "result" in await h.answer(8)
    [forwarded] = [json.loads(line) for line in sent]
    assert forwarded["params"]["_meta"] == {"keep": 1}
    assert forwarded["params"]["n"] == 18446744073709551617  # written again, exactly
    assert await h.stop() == 0


async def test_a_result_with_an_id_past_2_53_is_recorded_and_replayed_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Database and snowflake ids pass 2**53, which a certificate's canonical JSON cannot
    hold: the call ran, its commit was refused, and the intent was fenced as "nobody
    knows whether it took effect". Its JSON text is recorded instead, replayed exactly."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    call = {"name": "charge", "arguments": {"order": 4, "big_id": True}}
    first = await h.answer(h.send("tools/call", call))
    assert first["result"]["structuredContent"] == {"id": 2**60 + 4}
    assert mark(first)["replayed"] is False
    again = await h.answer(h.send("tools/call", call))
    assert mark(again)["replayed"] is True, again
    assert again["result"]["structuredContent"] == {"id": 2**60 + 4}
    assert h.ledger() == [{"order": 4, "big_id": True}]
    assert await h.stop() == 0


async def test_a_line_past_the_limit_from_the_child_stops_it_and_later_calls_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader gave up on the child but left it running and counted alive: every later
    request was written to it and never answered."""
    monkeypatch.setattr("effectfence.wrap.proxy.LINE_LIMIT", 4096)
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    big = await h.answer(
        h.send("tools/call", {"name": "charge", "arguments": {"order": 1, "pad": 10_000}})
    )
    assert mark(big)["outcome"] == "unknown"
    later = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 2}}))
    assert text(later) == "charged"
    assert h.ledger() == [{"order": 1, "pad": 10_000}, {"order": 2}]
    assert await h.stop() == 0


async def test_a_child_that_dies_while_something_holds_its_stdout_is_seen_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Death was seen only as the end of the child's output. A launcher script's
    background process keeps that open: a call to a child that died was never answered,
    and no restart came."""
    pid_file = tmp_path / "sleep.pid"
    launcher = [
        "/bin/sh",
        "-c",
        f'sleep 120 & echo $! >> "{pid_file}"; exec "{CHILD[0]}" "{CHILD[1]}"',
    ]
    h = Harness(tmp_path, monkeypatch, child=launcher)
    try:
        await h.start()
        died = await h.answer(h.send("tools/call", {"name": "die", "arguments": {}}))
        assert died["error"]["code"] == -32603, died
        ran = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
        assert text(ran) == "charged"
    finally:  # first: the pipes they hold close while the loop still runs
        for pid in pid_file.read_text().split() if pid_file.exists() else ():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    assert await h.stop() == 0


async def test_a_dead_childs_leftovers_are_its_own_not_those_of_the_child_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests relayed to the child were kept in one set for every child: a dead child's
    late death handling (a restart whose handshake failed, then a new start) answered the
    NEXT child's requests "the server exited", and then their real answers came too."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    first = await _kill_child(h)
    gate = tmp_path / "gate"
    monkeypatch.setenv("RAW_LIST_GATE", str(gate))  # the next child holds its tools/list
    listing = h.send("tools/list")
    await _asked(gate)
    pinged = h.send("ping")  # relayed to the new child, unanswered until its list is done
    h.proxy._orphaned(first, -9)  # the first child's death handling, once more, late
    gate.touch()
    assert "tools" in (await h.answer(listing))["result"]
    assert "result" in await h.answer(pinged)
    answers = [json.loads(line) for line in h.out]
    assert [a.get("id") for a in answers].count(listing) == 1
    assert [a.get("id") for a in answers].count(pinged) == 1
    assert await h.stop() == 0


async def test_what_the_standard_parser_admits_is_answered_and_never_kills_the_wrapper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """orjson writes neither a lone surrogate nor an integer past 64 bits, which the
    standard parser reads: a batch refusal naming such an id, a stripped request holding
    one, or a result holding one raised out of the relay and killed the wrapper (or left
    the call unanswered); a call nested past what the exact parser reads was never
    answered. Each is now answered, and the wrapper lives on."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    h.raw(
        b'[{"jsonrpc":"2.0","id":"c\\ud800","method":"tools/call","params":{"name":"charge"}},'
        b'{"jsonrpc":"2.0","id":18446744073709551616,"method":"ping","x":NaN}]'
    )
    async with asyncio.timeout(BOUND):
        while not any(line.startswith(b"[") for line in h.out):
            await asyncio.sleep(0.01)
    h.raw(
        b'{"jsonrpc":"2.0","id":9,"method":"ping","params":{"_meta":'
        b'{"io.modelcontextprotocol/protocolVersion":"2026-07-28","k":"\\ud800"}}}'
    )
    assert "result" in await h.answer(9)
    deep = b'{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{"name":"charge",'
    deep += b'"arguments":{"order":' + b"[" * 1010 + b"]" * 1010 + b"}}}"
    h.raw(deep)
    assert (await h.answer(10))["error"]["code"] == -32600
    deep_id = b"[" * 1015 + b"]" * 1015  # read by orjson, past what the encoders write
    h.raw(
        b'[{"jsonrpc":"2.0","id":' + deep_id + b',"method":"tools/call","params":{}}]',
        b'{"jsonrpc":"2.0","id":11,"method":"ping","params":{"_meta":'
        b'{"io.modelcontextprotocol/protocolVersion":"2026-07-28"},"x":' + deep_id + b"}}",
    )
    assert "error" in await h.answer(11)
    h.raw(b'{"jsonrpc":"2.0","id":12,"method":"tools/list","params":{"x":' + deep_id + b"}}")
    assert (await h.answer(12))["error"]["code"] == -32600
    nested = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"deep": 600}}))
    assert mark(nested)["outcome"] == "unknown"  # it ran; its answer can't be recorded
    call = {"name": "charge", "arguments": {"order": 3, "undecodable": True}}
    for replayed in (False, True):
        got = await h.answer(h.send("tools/call", call))
        assert text(got) == "charged\udcff" and mark(got)["replayed"] is replayed, got
    assert h.ledger() == [{"deep": 600}, {"order": 3, "undecodable": True}]
    assert await h.stop() == 0


async def test_a_writer_fault_neither_answers_twice_nor_ends_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault on a client line is answered -32603 only if nothing was written for it, and
    a writer failing again must not end the relay: close() drains fenced calls and stops
    the child (found by re-review: two answers for one id, and a run() that raised)."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    deep = b"[" * 600 + b"]" * 600
    h.fail_writes = 1  # its refusal is kept, then the write reports a fault
    h.raw(b'{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"x":' + deep + b"}}")
    ping = await h.answer(h.send("ping"))
    assert "result" in ping
    assert [json.loads(line).get("id") for line in h.out].count(7) == 1
    h.fail_writes = 2  # the refusal and the fallback both fail
    h.raw(b'{"jsonrpc":"2.0","id":8,"method":"tools/list","params":{"x":' + deep + b"}}")
    assert "result" in await h.answer(h.send("ping"))
    assert await h.stop() == 0
    assert h.proxy.closing


async def test_a_cancel_handled_with_the_childs_answer_keeps_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child answered, and the client's cancel was handled in the same loop turn,
    before the call's task resumed: the task was cancelled, and an effect whose result had
    come back was fenced as "nobody knows whether it took effect" (found by review)."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    real = h.proxy.on_child_line

    def answer_then_cancel(line: bytes, child: Any = None) -> None:
        real(line, child)
        msg = json.loads(line)
        rid = msg.get("id") if isinstance(msg, dict) else None
        if isinstance(rid, str) and rid.startswith(h.proxy._own_prefix) and "result" in msg:
            h.proxy._cancel(7, "user")  # the client's cancel, read in the same turn

    monkeypatch.setattr(h.proxy, "on_child_line", answer_then_cancel)
    h.raw(
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call",'
        b'"params":{"name":"charge","arguments":{"order":7}}}'
    )
    async with asyncio.timeout(BOUND):
        while not h.ledger() or h.proxy.calls:
            await asyncio.sleep(0.01)
    again = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 7}}))
    assert "isError" not in again["result"], again
    assert mark(again)["replayed"] is True and text(again) == "charged"
    assert h.ledger() == [{"order": 7}]
    assert await h.stop() == 0


async def test_an_answer_that_is_not_utf8_is_answered_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's answer holding a byte that is not UTF-8 (Latin-1 text) was dropped: the
    request was never answered, and a fenced call's lease was renewed for ever, so every
    identical call was refused in flight (found by review). A relayed answer now goes on
    byte for byte; a fenced one ends as "nobody knows" (it ran; its answer cannot be read),
    and the client is told so."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    peek = h.send("tools/call", {"name": "peek", "arguments": {}})  # read-only: relayed
    async with asyncio.timeout(BOUND):
        while not any(b"caf\xe9" in line for line in h.out):
            await asyncio.sleep(0.01)
    relayed = next(line for line in h.out if b"caf\xe9" in line)
    assert json.loads(relayed.decode("latin-1"))["id"] == peek  # as it came
    call = {"name": "charge", "arguments": {"order": 1, "latin1": True}}
    first = await h.answer(h.send("tools/call", call))
    assert first["result"]["isError"] is True and "not valid UTF-8" in text(first)
    assert mark(first)["outcome"] == "unknown"
    again = await h.answer(h.send("tools/call", call))
    assert mark(again)["refused"] == "intent_failed"  # fenced, not "still running"
    assert h.ledger() == [{"order": 1, "latin1": True}]
    await h.stop()


async def test_a_result_nested_past_the_fences_default_depth_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result 40 lists deep (a tree, a parsed document) ran and came back, then was
    fenced as if nobody knew: wrap judged it recordable by one depth, the commit refused it
    by another (found by review). It is recorded and replayed."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    call = {"name": "charge", "arguments": {"order": 1, "deep": 40}}
    first = await h.answer(h.send("tools/call", call))
    assert mark(first).get("recorded", True) is True, mark(first)
    again = await h.answer(h.send("tools/call", call))
    assert mark(again)["replayed"] is True, mark(again)
    assert again["result"]["structuredContent"] == first["result"]["structuredContent"]
    assert h.ledger() == [{"order": 1, "deep": 40}]
    await h.stop()


async def test_a_call_with_two_megabytes_of_arguments_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arguments over the fence's default 1 MiB (a file to write) were refused and never
    ran, while the same call straight to the server worked (found by review)."""
    h = Harness(tmp_path, monkeypatch)
    h.reader = asyncio.StreamReader(limit=1 << 26)  # the client's lines, as wrap reads them
    h.task.cancel()
    h.task = asyncio.ensure_future(h.proxy.run(h.reader))
    await h.start()
    call = {"name": "charge", "arguments": {"order": 1, "note": "x" * (2 << 20)}}
    first = await h.answer(h.send("tools/call", call))
    assert "result" in first and not first["result"].get("isError"), str(first)[:300]
    again = await h.answer(h.send("tools/call", call))
    assert mark(again)["replayed"] is True
    assert len(h.ledger()) == 1
    await h.stop()


async def test_intent_args_that_name_no_argument_of_a_call_refuse_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt intent_args (orderId for order) made every call one intent: the first
    ran, every other was refused intent_conflict with no word why (found by review). A
    call with none of the named arguments is refused, naming them, and nothing runs; an
    empty intent_args is refused at load."""
    from effectfence.wrap.policy import PolicyError

    with pytest.raises(PolicyError, match="non-empty"):
        Policy.from_dict({"tools": {"charge": {"intent_args": []}}})
    policy = Policy.from_dict({"tools": {"charge": {"intent_args": ["orderId"]}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    await h.start()
    for order in (1, 2):
        got = await h.answer(
            h.send("tools/call", {"name": "charge", "arguments": {"order": order}})
        )
        assert mark(got)["refused"] == "invalid_request" and "orderId" in text(got)
    assert h.ledger() == []
    await h.stop()


def test_probe_gives_no_verdict_when_no_call_succeeded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that died after its handshake gave '0 ok, 3 errors, 0 distinct' and exit 0,
    which a CI gate reads as "no double fire" (found by review)."""
    from effectfence.wrap.probe import NOTHING_COUNTED, main

    monkeypatch.setenv("RAW_LEDGER", str(tmp_path / "ledger.jsonl"))
    monkeypatch.setenv("RAW_STARTS", str(tmp_path / "starts"))
    code = main(["--tool", "die", "--calls", "3", "--timeout", "20", "--", *CHILD])
    assert code == NOTHING_COUNTED == 3
    assert "INCONCLUSIVE" in capsys.readouterr().err


def test_demo_says_what_failed_on_a_store_it_cannot_open(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`effectfence demo --store bogus://x` ended in a ConnectionError traceback, and
    `--calls 0` was accepted where probe refuses it (found by review)."""
    from effectfence.wrap.demo import main

    with pytest.raises(SystemExit):
        main(["--calls", "0"])
    assert main(["--calls", "2", "--store", "bogus://x"]) == 2
    err = capsys.readouterr().err
    assert "did not answer" in err and "bogus://x" in err and "Traceback" not in err


async def test_calls_of_names_the_child_never_listed_share_one_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``by_tool`` kept an entry per tool name a client sent, listed or not: a client
    calling made-up names grew the wrapper's memory for ever. Names the child listed are
    counted each; every other name under one entry."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    made_up = [h.send("tools/call", {"name": f"made-up-{i}", "arguments": {}}) for i in range(20)]
    for rid in made_up:
        assert text(await h.answer(rid)) == "charged"  # relayed and run all the same
    await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    stats = await h.answer(h.send("tools/call", {"name": "effectfence_stats", "arguments": {}}))
    by_tool = stats["result"]["structuredContent"]["by_tool"]
    assert by_tool == {UNLISTED: {"executed": 20}, "charge": {"executed": 1}}
    assert await h.stop() == 0


async def _kill_child(h: Harness) -> Child:
    """Kill the harness's child and wait until the wrapper has handled its death."""
    child = h.proxy.child
    assert child is not None
    child.proc.kill()
    async with asyncio.timeout(BOUND):
        while h.proxy.child is not None:
            await asyncio.sleep(0.01)
    return child


def _spy_on_child(h: Harness, monkeypatch: pytest.MonkeyPatch) -> tuple[Child, list[bytes]]:
    """The harness's child, and every line the wrapper writes to it from now on."""
    child = h.proxy.child
    assert child is not None
    to_child: list[bytes] = []
    write = child.write
    monkeypatch.setattr(child, "write", lambda data: (to_child.append(data), write(data))[1])
    return child, to_child


async def _asked(gate: Path) -> None:
    """Until the raw child holds a request at ``gate`` (it touched ``gate``.asked)."""
    async with asyncio.timeout(BOUND):
        while not Path(str(gate) + ".asked").exists():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("then", ["answer", "death"])
async def test_a_cancelled_pass_through_request_is_owed_no_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The id of a relayed request the client cancelled stayed in the child's ``relayed``
    for ever (per MCP the child need not answer it), and a dying child's leftovers were
    answered an error the client no longer waited for. The cancel still reaches the child
    as it came, and an answer the child sends all the same still reaches the client."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_HOLD=str(gate))
    await h.start()
    child, to_child = _spy_on_child(h, monkeypatch)
    held = h.send("hold")
    await _asked(gate)
    assert held in child.relayed
    cancel = json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": held, "reason": "gave up"},
        }
    ).encode()
    h.raw(cancel)
    async with asyncio.timeout(BOUND):
        while cancel + b"\n" not in to_child:  # relayed byte for byte
            await asyncio.sleep(0.01)
    assert child.relayed == set()
    if then == "answer":
        gate.touch()
        assert (await h.answer(held))["result"] == {"held": True}  # late, relayed all the same
    else:
        child.proc.kill()
        async with asyncio.timeout(BOUND):
            while h.proxy.child is child:  # its death handled (orphans answered) by then
                await asyncio.sleep(0.01)
        assert not any(json.loads(line).get("id") == held for line in h.out)
    assert "result" in await h.answer(h.send("ping"))
    assert await h.stop() == 0


async def test_a_cancelled_tools_list_is_cancelled_in_the_child_under_the_id_it_knows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper sends a client's tools/list on under an id of its own. A cancel of it
    went to the child under the client's id, which the child never saw, so it answered
    anyway and the client got an answer it had cancelled. The cancel now names the
    wrapper's id, the listing is forgotten, and a late answer goes nowhere."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_LIST_GATE=str(gate))
    await h.start(list_tools=False)
    child, to_child = _spy_on_child(h, monkeypatch)
    listing = h.send("tools/list")
    await _asked(gate)
    (own,) = child.listings
    h.raw(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": listing, "reason": "gave up"},
            }
        ).encode()
    )
    async with asyncio.timeout(BOUND):
        while not any(b"notifications/cancelled" in data for data in to_child):
            await asyncio.sleep(0.01)
    (sent,) = [json.loads(d) for d in to_child if b"notifications/cancelled" in d]
    assert sent["params"] == {"requestId": own, "reason": "gave up"}
    assert child.listings == {}
    gate.touch()  # the child answers all the same: nobody is owed that answer
    assert "result" in await h.answer(h.send("ping"))
    assert not [line for line in h.out if json.loads(line).get("id") == listing]
    assert await h.stop() == 0


async def test_a_cancel_after_the_child_died_starts_no_child_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a cancel names died with the child (its client was answered an error), so a
    cancel then is dropped: it used to start a new child only to hand it the cancel."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_HOLD=str(gate))
    await h.start()
    held = h.send("hold")
    await _asked(gate)
    child = h.proxy.child
    assert child is not None
    child.proc.kill()
    assert "error" in await h.answer(held)  # told that the server stopped before answering
    async with asyncio.timeout(BOUND):
        while h.proxy.child is not None:
            await asyncio.sleep(0.01)
    starts = h.proxy.stats.child_starts
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": held}}
    await h.proxy.on_client_line(json.dumps(cancel).encode())  # handled whole on return
    assert h.proxy.child is None and h.proxy.stats.child_starts == starts
    assert "result" in await h.answer(h.send("ping"))  # a request starts the next child
    assert h.proxy.stats.child_starts == starts + 1
    assert await h.stop() == 0


# -- found by the second review of wrap ------------------------------------------------------


async def test_a_fenced_call_whose_arguments_are_no_object_is_refused_not_relayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relayed as it came, such a call ran unfenced in a child that reads `arguments or
    {}`: three identical calls, three charges."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    for _ in range(3):
        answer = await h.answer(h.send("tools/call", {"name": "charge", "arguments": []}))
        assert answer["error"]["code"] == -32602, answer
    assert h.ledger() == []
    assert await h.stop() == 0


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("refund_\u00e9", "refund_\\xe9"),  # escaped, it is the other's name
        ("\u652f\u4ed8" * 17 + "_A", "\u652f\u4ed8" * 17 + "_B"),  # alike for 200 escaped
        ("x" * 200 + "_charge", "x" * 200 + "_refund"),  # alike for 200 characters
    ],
    ids=["escape", "cjk", "long"],
)
async def test_two_tools_whose_labels_agree_are_two_intents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    """The tool's name in the intent was its escaped form cut at 200 characters: two
    tools could share an intent, and the second never ran but was answered the first's
    result as a replay."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    for name in (first, second):
        answer = await h.answer(h.send("tools/call", {"name": name, "arguments": {"order": 1}}))
        assert not mark(answer).get("replayed"), (name, mark(answer))
    assert len(h.ledger()) == 2
    assert await h.stop() == 0


async def test_arguments_nested_past_64_are_fenced_as_the_docs_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent's digest used the encoder's default depth (64), so arguments the fence
    takes (up to 512 deep, as docs/wrap.md says) were refused and never ran."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    tree: Any = []
    for _ in range(100):
        tree = [tree]
    call = {"name": "charge", "arguments": {"order": 1, "tree": tree}}
    assert text(await h.answer(h.send("tools/call", call))) == "charged"
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is True
    assert len(h.ledger()) == 1
    assert await h.stop() == 0


async def test_a_cancel_of_a_call_waiting_for_the_restarted_child_still_reaches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel that comes while no child runs is dropped (what it names died with the
    last one), but a pass-through call still on its way to the next child is not dead:
    dropping its cancel ran it regardless (found by review of that change)."""
    policy = Policy.from_dict({"tools": {"charge": {"fence": False}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    await h.start()
    await _kill_child(h)
    gate, held = asyncio.Event(), asyncio.Event()
    real = asyncio.create_subprocess_exec

    async def gated(*args: Any, **kw: Any) -> Any:
        held.set()
        await gate.wait()  # the next child starts only when the test says
        return await real(*args, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", gated)
    to_child: list[bytes] = []
    write = Child.write
    monkeypatch.setattr(
        Child, "write", lambda self, data: (to_child.append(data), write(self, data))[1]
    )
    rid = h.send("tools/call", {"name": "charge", "arguments": {"order": 1}})
    async with asyncio.timeout(BOUND):
        await held.wait()  # the call waits for the next child
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}}
    handled = asyncio.ensure_future(h.proxy.on_client_line(json.dumps(cancel).encode() + b"\n"))
    await asyncio.sleep(0)  # it decides (drop, or wait for the child) before its first wait
    gate.set()
    await handled
    await h.answer(h.send("ping"))  # relayed after the cancel (in order): it is there by now
    reached = any(b"notifications/cancelled" in data for data in to_child)
    sent = any(b'"charge"' in data for data in to_child)
    assert await h.stop() == 0
    # the call waits for the next child's tools to be listed: cancelled there, it is never
    # sent; sent, its cancel follows it
    assert reached or not sent, "the call reached the child, its cancel never did"


def test_the_default_scope_tells_servers_of_one_command_apart(tmp_path: Path) -> None:
    """The default namespace was the command line alone: the same command with another
    API key, database URL or relative data path was taken for the same server, so the
    second's calls never ran and were answered the first's results (found by review)."""
    from effectfence.wrap.proxy import default_namespace

    argv = ["uvx", "mcp-server-stripe"]
    same = default_namespace(argv, {"STRIPE_API_KEY": "sk_a", "SSH_AUTH_SOCK": "/tmp/1"}, "/")
    # another key, another database: other servers
    assert default_namespace(argv, {"STRIPE_API_KEY": "sk_b"}, "/") != same
    assert default_namespace(argv, {"STRIPE_API_KEY": "sk_a", "DATABASE_URL": "x"}, "/") != same
    # "DB" anywhere in the name, as docs/wrap.md says (DB_/_DB only took DBNAME=shop_a and
    # DBNAME=shop_b for one server: b's calls were answered a's results, found by review)
    for name in ("DB", "DBNAME", "MYDB", "MONGODB", "DB_NAME", "REDIS_DB"):
        assert default_namespace(argv, {name: "a"}, "/") != default_namespace(
            argv, {name: "b"}, "/"
        ), name
    # a restart in another login session, beside another wrapper's settings: the same one
    session = {"STRIPE_API_KEY": "sk_a", "SSH_AUTH_SOCK": "/tmp/2", "TERM_SESSION_ID": "9"}
    assert default_namespace(argv, {**session, "EFFECTFENCE_TICKET_KEY": "k" * 16}, "/") == same
    # a command with nothing of the sort keeps the scope it had (its ledger is found again)
    old = "cmd-" + hashlib.sha256(canonical_bytes(argv)).hexdigest()[:16]
    assert default_namespace(argv, {"HOME": "/root", "PATH": "/bin"}, "/") == old
    # a relative path in the arguments: the working directory is part of the server
    for here in ("a", "b"):
        (tmp_path / here).mkdir()
        (tmp_path / here / "shop.db").touch()
    rel = ["mcp-server-sqlite", "--db-path", "shop.db"]
    assert default_namespace(rel, {}, str(tmp_path / "a")) != default_namespace(
        rel, {}, str(tmp_path / "b")
    )
    assert default_namespace(["x", "--db=shop.db"], {}, str(tmp_path / "a")) != (
        default_namespace(["x", "--db=shop.db"], {}, str(tmp_path / "b"))
    )


@pytest.mark.parametrize("then", ["answer", "death"])
async def test_a_relayed_batch_is_owed_its_answers_and_gets_them_if_the_child_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A batch without tool calls (MCP 2025-03-26) is relayed as it came. Its requests'
    ids were never recorded as owed by the child, so when the child died first nobody
    answered them and the client waited for ever (found by review). Each is now owed: a
    dead child's are answered an error, as a single request's are, and the child's own
    batch answer settles them."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_HOLD=str(gate))
    await h.start()
    child = h.proxy.child
    assert child is not None
    h.raw(
        json.dumps(
            [
                {"jsonrpc": "2.0", "id": "b1", "method": "hold", "params": {}},
                {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}},
                {"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {}},
            ]
        ).encode()
    )
    await _asked(gate)
    assert child.relayed == {"b1", 7}
    if then == "answer":
        gate.touch()
        async with asyncio.timeout(BOUND):
            while child.relayed:  # the batch answer settles both
                await asyncio.sleep(0.01)
        answered = [m for line in h.out for m in _messages(line) if m.get("id") in ("b1", 7)]
        assert sorted(str(m["id"]) for m in answered) == ["7", "b1"]
        assert all("result" in m for m in answered)
    else:
        child.proc.kill()
        for rid in ("b1", 7):
            assert (
                "effectfence wrap: the server behind the fence"
                in (
                    await h.answer(rid)  # type: ignore[arg-type]
                )["error"]["message"]
            )
    assert "result" in await h.answer(h.send("ping"))
    assert await h.stop() == 0


def _messages(line: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a line written to the client (one, or a batch)."""
    msg = json.loads(line)
    return [m for m in (msg if isinstance(msg, list) else [msg]) if isinstance(m, dict)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_termination_signal_mid_call_leaves_the_intent_fenced(
    tmp_path: Path, signum: int
) -> None:
    """An MCP client shuts its server down by closing stdin, then SIGTERM two seconds
    later. The wrapper had no handler: the signal killed it with the intent in flight, and
    once the lease lapsed an identical call ran the charge again (found by review). Now the
    call in progress is cancelled and aborted (outcome unknown): the intent is fenced, a
    later identical call is refused, and the wrapper exits 128 + the signal."""
    from effectfence import EffectFence
    from effectfence.store import open_store
    from effectfence.wrap.client import StdioClient
    from effectfence.wrap.policy import ToolPolicy

    store, gate = f"sqlite:///{tmp_path / 'fence.db'}", tmp_path / "gate"
    env = {
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "RAW_LEDGER": str(tmp_path / "ledger.jsonl"),
        "RAW_STARTS": str(tmp_path / "starts"),
    }
    argv = [sys.executable, "-m", "effectfence", "wrap", "--store", store, "--namespace", "sig"]
    argv += ["--", *CHILD]
    client = await StdioClient.start(argv, env={**env, "RAW_CHARGE_GATE": str(gate)})
    await client.initialize("sig")
    call = asyncio.ensure_future(client.call_tool("charge", {"order": 1}, timeout=BOUND))
    await _asked(gate)  # the child is running the charge
    client.proc.send_signal(signum)  # the wrapper alone: its close stops the child
    async with asyncio.timeout(BOUND):
        code = await client.proc.wait()
    call.cancel()
    with contextlib.suppress(BaseException):
        await call
    await client.close()
    assert code == 128 + signum
    probe = Proxy(["x"], lambda _: None, store_url="memory:", namespace="sig")
    intent = probe.request_for("charge", {"order": 1}, ToolPolicy()).intent
    probe.offloader.close()
    fence = EffectFence(store=open_store(store))
    try:
        assert fence.intent_status(intent).state == "failed"
    finally:
        fence.close()
    again = await StdioClient.start(argv, env=env)  # no gate: a charge would run at once
    try:
        await again.initialize("sig")
        refused = await again.call_tool("charge", {"order": 1}, timeout=BOUND)
    finally:
        await again.close()
    assert refused.get("isError") and "intent_failed" in json.dumps(refused)
    assert len([json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]) == 1


async def test_a_termination_signal_while_closing_stops_the_drain_and_fences_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MCP client's order: stdin closes first (close() waits up to a minute for the
    fenced calls), SIGTERM comes two seconds later. The signal must end that wait with
    the call aborted, not leave it to be killed in flight."""
    gate = tmp_path / "gate"
    h = Harness(tmp_path, monkeypatch, RAW_CHARGE_GATE=str(gate))
    await h.start()
    rid = h.send("tools/call", {"name": "charge", "arguments": {"order": 2}})
    await _asked(gate)
    (call,) = h.proxy.calls.values()
    h.reader.feed_eof()
    async with asyncio.timeout(BOUND):
        while not h.proxy.closing:  # close() is draining the fenced call now
            await asyncio.sleep(0.01)
    assert not call.task.done()  # type: ignore[union-attr]
    fence = next(iter(h.proxy._fences.values()))
    h.proxy.terminate(signal.SIGTERM)
    async with asyncio.timeout(BOUND):
        assert await h.task == 128 + signal.SIGTERM
    assert not any(json.loads(line).get("id") == rid for line in h.out)  # cancelled: no answer
    (rec,) = list(fence.store.records())
    assert rec.state.value == "failed" and len(h.ledger()) == 1


async def test_a_pass_through_call_is_relayed_in_the_relays_turn_once_tools_are_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the child's tools are known, a call the policy does not fence is decided as it
    is read and relayed at once: no task of its own (that cost a pass-through call ~10%).
    Before they are known, the call waits in its task for the listing, as before."""
    policy = Policy.from_dict({"tools": {"charge": {"fence": False}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    spawned: list[Any] = []
    spawn = h.proxy._spawn

    def counted(coro: Any) -> Any:
        if getattr(coro, "__name__", "") == "_tool_call":  # a task of a tools/call's own
            spawned.append(coro)
        return spawn(coro)

    monkeypatch.setattr(h.proxy, "_spawn", counted)
    await h.start(list_tools=False)
    assert not h.proxy.tools_known
    first = h.send("tools/call", {"name": "charge", "arguments": {"order": 1}})
    assert "result" in await h.answer(first)
    assert len(spawned) == 1 and h.proxy.tools_known  # it learned the tools in its task
    again = h.send("tools/call", {"name": "charge", "arguments": {"order": 1}})
    assert "result" in await h.answer(again)
    assert len(spawned) == 1, "a pass-through call with the tools known got a task"
    assert h.proxy.stats.passed == 2 and len(h.ledger()) == 2  # passed through: both ran
    own = h.send("tools/call", {"name": "effectfence_stats", "arguments": {}})
    assert "result" in await h.answer(own)
    assert len(spawned) == 2  # the wrapper's own tools (and fenced calls) still get a task
    assert await h.stop() == 0


async def test_effectfence_clear_clears_only_the_version_status_showed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wrap's operator tools: effectfence_status shows the token, and effectfence_clear
    takes expect_state / expect_token back; a record that moved since is refused and
    stays (the console's and the CLI's rule, in the core)."""
    h = Harness(tmp_path, monkeypatch)
    h.proxy.allow_clear = True
    await h.start()
    charge = {"name": "charge", "arguments": {"order": 5}}
    assert "result" in await h.answer(h.send("tools/call", charge))
    target = {"tool": "charge", "arguments": {"order": 5}}
    status = await h.answer(
        h.send("tools/call", {"name": "effectfence_status", "arguments": target})
    )
    shown = status["result"]["structuredContent"]
    assert shown["state"] == "done" and isinstance(shown["token"], int)
    clear = {"name": "effectfence_clear", "arguments": {**target, "reason": "re-run it"}}
    moved = {**clear["arguments"], "expect_state": "done", "expect_token": shown["token"] + 1}
    refused = await h.answer(h.send("tools/call", {**clear, "arguments": moved}))
    assert refused["result"]["isError"] and refused["result"]["structuredContent"]["code"] == (
        "intent_in_flight"
    )
    seen = {**clear["arguments"], "expect_state": "done", "expect_token": shown["token"]}
    cleared = await h.answer(h.send("tools/call", {**clear, "arguments": seen}))
    assert cleared["result"]["structuredContent"]["cleared"] is True
    assert await h.stop() == 0


_GATED_START = """
import os, sys, time
starts, gate = os.environ["GATED_STARTS"], os.environ["GATED_START_GATE"]
n = (int(open(starts).read()) if os.path.exists(starts) else 0) + 1
open(starts, "w").write(str(n))
if n == 2:  # the restart: slow to come up (a launcher fetching, a server loading)
    open(gate + ".asked", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.01)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def _gated_restarts(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Harness, Path]:
    """A harness whose child, once restarted, comes up only when the test touches the gate."""
    gate = tmp / "start_gate"
    script = tmp / "gated_start.py"
    script.write_text(_GATED_START)
    h = Harness(
        tmp,
        monkeypatch,
        child=[sys.executable, str(script), *CHILD[1:]],
        GATED_STARTS=str(tmp / "gated_starts"),
        GATED_START_GATE=str(gate),
    )
    return h, gate


async def _its_child_dies(h: Harness) -> None:
    h.send("tools/call", {"name": "die", "arguments": {}})  # read-only: relayed; it exits
    async with asyncio.timeout(BOUND):
        while h.proxy.child is not None:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("trigger", ["pass-through call", "ping", "tools/list"])
@pytest.mark.parametrize("probe", ["own_tool", "sigterm"])
async def test_a_request_to_a_restarting_child_does_not_hold_up_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: str, trigger: str
) -> None:
    """The child died and its restart is slow. What waits for it waits aside: relayed in
    the relay's turn, a pass-through call (and then any other request: a ping, a listing)
    held up the relay for the whole handshake, so the wrapper's own tools went unanswered
    and a SIGTERM did not end the wrapper (found by review, twice). The fast path is taken
    only with the child up, and other messages queue in order for a task of their own."""
    h, gate = _gated_restarts(tmp_path, monkeypatch)
    try:
        await h.start()
        await _its_child_dies(h)
        if trigger == "pass-through call":  # starts the child again
            h.send("tools/call", {"name": "peek", "arguments": {}})
        else:
            first = h.send(trigger)
        await _asked(gate)  # the restarted child is not up yet
        if probe == "own_tool":  # needs no child: answered while the restart goes on
            stats = h.send("tools/call", {"name": "effectfence_stats", "arguments": {}})
            assert "passed_through" in text(await h.answer(stats))
            if trigger != "pass-through call":  # and what waited is sent, in order, once up
                later = h.send("ping")
                gate.touch()
                assert "result" in await h.answer(first)
                assert (await h.answer(later)).get("result") == {}
                assert [json.loads(x).get("id") for x in h.out].index(first) < [
                    json.loads(x).get("id") for x in h.out
                ].index(later)
            return
        h.proxy.terminate(signal.SIGTERM)
        async with asyncio.timeout(BOUND):
            assert await asyncio.shield(h.task) == 128 + signal.SIGTERM
    finally:
        gate.touch()
        with contextlib.suppress(BaseException):
            h.reader.feed_eof()
            async with asyncio.timeout(BOUND):
                await h.task


# -- lines every reader reads as the wrapper does -----------------------------------------------


def _charge_line(rid: int, order: int = 1, name: str = "charge") -> bytes:
    msg = {"name": name, "arguments": {"order": order}}
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": msg}).encode()


async def test_a_line_break_inside_a_relayed_line_never_splits_it_for_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON reads a bare CR as whitespace; Python's text streams (the mcp SDK's stdio
    server's among them) end a line there. A ping carrying a tools/call between two CRs was
    one ping to the wrapper and a ping, a tools/call and a fragment to the child: the call
    ran unfenced, and the identical fenced call charged again (found by review). Every line
    reaches the child whole; LS, PS and NEL (line ends to str.splitlines) inside strings go
    as escapes."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    assert h.proxy.child is not None and h.proxy.child.proc.stdin is not None
    stdin, to_child = h.proxy.child.proc.stdin, []
    write = stdin.write
    monkeypatch.setattr(stdin, "write", lambda data: (to_child.append(data), write(data))[1])
    smuggled = b'{"jsonrpc":"2.0","id":50,"method":"ping","params":{"x":\r' + _charge_line(51)
    h.raw(smuggled + b"\r}}")
    pong = await h.answer(50)
    assert pong.get("result") == {}, pong
    inside = {"jsonrpc": "2.0", "id": 53, "method": "ping", "params": {"t": "a\u2028b\u0085"}}
    h.raw(json.dumps(inside, ensure_ascii=False).encode())
    assert (await h.answer(53)).get("result") == {}
    # and in a fenced call's arguments, written again by the wrapper
    note = {"name": "charge", "arguments": {"order": 2, "note": "x\u2028\u2029y"}}
    assert text(await h.answer(h.send("tools/call", note))) == "charged"
    assert all(b"\r" not in line and "\u2028".encode() not in line for line in to_child)
    assert all("\u0085".encode() not in line for line in to_child)
    fenced = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert text(fenced) == "charged" and mark(fenced)["replayed"] is False
    assert h.ledger() == [note["arguments"], {"order": 1}], "the split-off call ran unfenced"
    assert await h.stop() == 0


_CALL = b'"params":{"name":"charge","arguments":{"order":1}}'


@pytest.mark.parametrize(
    "reader, line",
    [
        # the method twice: a ping to the wrapper (the last), a tools/call to the child
        (
            "first",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",' + _CALL + b',"method":"ping"}',
        ),
        # an escaped key: a byte search for "method" misses it
        (
            "first",
            b'{"jsonrpc":"2.0","id":60,"m\\u0065thod":"tools/call",' + _CALL + b',"method":"ping"}',
        ),
        # a response to the wrapper (no method it reads), a request to the child
        ("first", b'{"jsonrpc":"2.0","id":60,"method":"tools/call",' + _CALL + b',"method":5}'),
        # the tool's name twice: a read-only peek to the wrapper, a charge to the child
        (
            "first",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",'
            b'"params":{"name":"charge","arguments":{"order":1},"name":"peek"}}',
        ),
        # params twice, the last without a name
        ("first", b'{"jsonrpc":"2.0","id":60,"method":"tools/call",' + _CALL + b',"params":{}}'),
        # keys in another case, or folding to a field (the long s): one to Go's reader
        ("fold", b'{"jsonrpc":"2.0","id":60,"method":"ping","Method":"tools/call",' + _CALL + b"}"),
        (
            "fold",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",'
            b'"params":{"name":"peek","Name":"charge","arguments":{"order":1}}}',
        ),
        (
            "fold",
            '{"jsonrpc":"2.0","id":60,"method":"tools/call","params":{"name":"peek"},'
            '"param\u017f":{"name":"charge","arguments":{"order":1}}}'.encode(),
        ),
        (
            "fold",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",'
            b'"params":{"name":"charge","arguments":{"order":2},"Arguments":{"order":1}}}',
        ),
        ("fold", b'{"jsonrpc":"2.0","ID":60,"METHOD":"tools/call",' + _CALL + b"}"),
        # a charge for another order than the one fenced, to a case-insensitive reader
        (
            "fold",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",'
            b'"params":{"name":"charge","arguments":{"order":3,"Order":1}}}',
        ),
        # a NUL in a key: C readers (cJSON, json-c) cut the key there
        (
            "cstring",
            b'{"jsonrpc":"2.0","id":60,"method\\u0000":"tools/call","method":"ping",'
            + _CALL
            + b"}",
        ),
        (
            "cstring",
            b'{"jsonrpc":"2.0","id":60,"method":"tools/call",'
            b'"params":{"name\\u0000":"charge","name":"peek","arguments":{"order":1}}}',
        ),
        # a NUL in a value: "tools/call\u0000" is a tool call to a C reader
        ("cstring", b'{"jsonrpc":"2.0","id":60,"method":"tools/call\\u0000",' + _CALL + b"}"),
        # _ and - ignored by Go's encoding/json/v2 when it matches names without case
        ("fold", b'{"jsonrpc":"2.0","id":60,"me_thod":"tools/call",' + _CALL + b"}"),
        # sharp s and capital sharp s: one to Go's simple folding, two to full case folding
        (
            "fold",
            '{"jsonrpc":"2.0","id":60,"method":"tools/call","params":{"name":"charge",'
            '"arguments":{"stra\u00dfe":"A","stra\u1e9ee":"B"}}}'.encode(),
        ),
    ],
)
async def test_a_line_json_readers_read_differently_is_refused_never_relayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str, line: bytes
) -> None:
    """A key given twice is its last value to the wrapper and its first to some readers;
    keys alike but for case (or Unicode folding) are one key to Go's encoding/json, as is
    a key that folds to a field (CVE-2026-27896 against the Go SDK). Relayed, a line the
    wrapper judged a ping, a response or a read-only call was a charge to such a child,
    run unfenced; written again, the folded key went with it (found by review, twice). The
    line is refused, and nothing reaches the child."""
    env = {{"first": "RAW_FIRST_KEY", "fold": "RAW_FOLD_KEYS"}.get(reader, "RAW_CSTRING_KEYS"): "1"}
    h = Harness(tmp_path, monkeypatch, **env)
    await h.start()
    h.raw(line)
    fenced = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert mark(fenced)["replayed"] is False
    assert h.ledger() == [{"order": 1}], "a charge reached the child unfenced"
    refused = [json.loads(x) for x in h.out if b"ambiguous" in x]
    assert len(refused) == 1 and refused[0]["error"]["code"] == -32600, h.out[-3:]
    assert await h.stop() == 0


async def test_a_tools_call_sent_as_a_notification_is_dropped_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools/call without an id is a notification: never answered, but a JSON-RPC server
    runs it, so relayed it ran unfenced as often as it was sent (found by review)."""
    h = Harness(tmp_path, monkeypatch, RAW_RUN_NOTIFICATIONS="1")
    await h.start()
    note = {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "charge"}}
    note["params"] = {"name": "charge", "arguments": {"order": 1}}
    h.raw(json.dumps(note).encode(), json.dumps(note).encode())
    fenced = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert mark(fenced)["replayed"] is False
    assert h.ledger() == [{"order": 1}]
    assert h.proxy.stats.refused == 2
    assert await h.stop() == 0


@pytest.mark.parametrize("cursor", ['""', '"again"', "7"])
async def test_a_tool_listing_that_never_ends_is_read_once_and_the_call_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cursor: str
) -> None:
    """A next cursor of "" (a struct serialized without omitempty), one repeated, or one
    that is no string: the wrapper listed for ever and the call that asked waited for ever
    (found by review: "" asked 67,855 times in 5 s). What is listed is known."""
    h = Harness(tmp_path, monkeypatch, RAW_NEXT_CURSOR=cursor)
    await h.start(list_tools=False)
    _, to_child = _spy_on_child(h, monkeypatch)
    got = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    assert text(got) == "charged" and mark(got)["replayed"] is False
    listings = [x for x in to_child if b'"tools/list"' in x]
    assert 1 <= len(listings) <= 2, len(listings)
    assert h.proxy.tools_known
    assert await h.stop() == 0


@pytest.mark.parametrize("form", ["batch", "method"])
async def test_an_answer_to_the_wrappers_own_request_in_an_odd_form_ends_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """The child answered a fenced call inside a batch, or with a method named: the answer
    was relayed to a client that never used that id, and the call waited for ever, its
    lease renewed (found by review). An answer in a batch is read as if it came alone; one
    naming a method is no answer, so nobody knows whether it ran: fenced, and said so."""
    h = Harness(tmp_path, monkeypatch, RAW_ANSWER_FORM=form)
    await h.start()
    got = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    if form == "batch":
        assert text(got) == "charged" and mark(got)["replayed"] is False
        # the rest of that batch reaches the client as exactly as it came (written again from
        # orjson's reading, an integer past 64 bits became a float: found by review)
        note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": 2**70 + 1}}
        assert [json.loads(x) for x in h.out if b"notifications/message" in x] == [[note]]
        again = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
        assert mark(again)["replayed"] is True
    else:
        assert got["result"]["isError"] is True and mark(got)["outcome"] == "unknown"
        assert "nobody knows" in text(got)
    assert h.ledger() == [{"order": 1}]
    assert not any(h.proxy._own_prefix.encode() in line for line in h.out)
    assert await h.stop() == 0


async def test_a_cancel_of_a_request_waiting_for_the_restarted_child_drops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing queued while the child restarts went out under an id of the wrapper's own,
    which its cancel, relayed under the client's, never reached: the cancelled listing was
    answered (found by review). A cancel of a request still queued drops it unsent."""
    h, gate = _gated_restarts(tmp_path, monkeypatch)
    await h.start()
    await _its_child_dies(h)
    first = h.send("ping")  # starts the child again: being sent, it goes on
    listing = h.send("tools/list")
    queued = h.send("hold")
    await _asked(gate)  # the restarted child is not up yet
    for rid in (listing, queued):
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled"}
        h.raw(json.dumps({**cancel, "params": {"requestId": rid}}).encode())
    later = h.send("ping")
    gate.touch()
    assert (await h.answer(first)).get("result") == {}
    assert (await h.answer(later)).get("result") == {}
    ids = [json.loads(x).get("id") for x in h.out]
    assert listing not in ids and queued not in ids, "a cancelled request was answered"
    assert await h.stop() == 0


async def test_a_tools_call_whose_name_the_wrapper_cannot_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call without a string name was relayed as it came, for the child to make of it
    what it would (found by review): refused, -32602, and nothing reaches the child."""
    h = Harness(tmp_path, monkeypatch, RAW_FOLD_KEYS="1")
    await h.start()
    for params in ({"name": 5, "arguments": {"order": 1}}, {"arguments": {"order": 1}}, []):
        rid = h.send("tools/call", params)  # type: ignore[arg-type]
        assert (await h.answer(rid))["error"]["code"] == -32602
    assert h.ledger() == []
    assert await h.stop() == 0


async def test_keys_alike_but_for_case_where_no_decision_rests_are_relayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check stays where the fence's decisions rest: keys alike but for case deep in a
    message other than a tool call (a header map, say) are relayed, and so are keys that
    only full Unicode folding takes for one (straße, strasse), which no reader does."""
    h = Harness(tmp_path, monkeypatch)
    await h.start()
    deep = {"jsonrpc": "2.0", "id": 80, "method": "ping", "params": {"h": {"A": 1, "a": 2}}}
    h.raw(json.dumps(deep).encode())
    assert (await h.answer(80)).get("result") == {}
    args = {"order": 5, "stra\u00dfe": 1, "strasse": 2}
    got = await h.answer(h.send("tools/call", {"name": "charge", "arguments": args}))
    assert text(got) == "charged"
    assert h.ledger() == [args]
    assert await h.stop() == 0


async def test_a_cancel_of_one_request_of_a_queued_batch_keeps_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued batch was filed under its first request's id, and a cancel of that request
    dropped the whole batch: its other requests were never answered (found by review)."""
    h, gate = _gated_restarts(tmp_path, monkeypatch)
    await h.start()
    await _its_child_dies(h)
    first = h.send("ping")  # starts the child again
    await _asked(gate)  # the restarted child is not up yet
    batch = [{"jsonrpc": "2.0", "id": 70, "method": "ping"}]
    batch.append({"jsonrpc": "2.0", "id": 71, "method": "ping"})
    h.raw(json.dumps(batch).encode())
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 70}}
    h.raw(json.dumps(cancel).encode())
    gate.touch()
    assert (await h.answer(first)).get("result") == {}
    assert (await h.answer(h.send("ping"))).get("result") == {}
    seen = [m for x in h.out for m in (lambda v: v if isinstance(v, list) else [v])(json.loads(x))]
    assert 71 in [m.get("id") for m in seen], "request 71 (not cancelled) was never answered"
    assert await h.stop() == 0


async def test_a_nul_in_a_calls_name_or_arguments_never_makes_another_intent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A C reader cuts a string at a NUL: "A1\\u0000retry" is order A1 to it and another
    intent to the fence, and "charge\\u0000x" is charge, past a policy that fences by
    name (found by review): both charged again. A NUL anywhere is refused."""
    policy = Policy.from_dict(
        {
            "defaults": {"fence": False},
            "tools": {"charge": {"fence": True, "intent_args": ["order"]}},
        }
    )
    h = Harness(tmp_path, monkeypatch, policy=policy, RAW_CSTRING_KEYS="1")
    await h.start()
    first = await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": "A1"}}))
    assert mark(first)["replayed"] is False
    for params in (
        {"name": "charge", "arguments": {"order": "A1\x00retry"}},
        {"name": "charge\x00x", "arguments": {"order": "A1"}},
    ):
        got = await h.answer(h.send("tools/call", params))
        assert got["error"]["code"] == -32600 and "NUL" in got["error"]["message"], got
    assert h.ledger() == [{"order": "A1"}], "the fenced charge ran twice"
    assert await h.stop() == 0


# -- what the child's listing says, and which intent a call names --------------------------------

LISTING_CHILD = [sys.executable, str(ROOT / "tests" / "fixtures" / "wrap_listing_child.py")]
READ_ONLY = {"readOnlyHint": True}


def _tool(name: str, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": name, "inputSchema": {"type": "object"}}
    if annotations is not None:
        tool["annotations"] = annotations
    return tool


def _pages(path: Path, *pages: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps({"pages": list(pages)}))
    return str(path)


def _listing_runs(tmp: Path, name: str) -> int:
    ledger = tmp / "listing_ledger.jsonl"
    rows = ledger.read_text().splitlines() if ledger.exists() else []
    return sum(1 for x in rows if json.loads(x)["name"] == name)


@pytest.mark.parametrize("how", ["client page after the change", "own listing across it"])
async def test_a_listing_begun_before_a_change_does_not_pass_a_now_destructive_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """notifications/tools/list_changed only marked the tools unknown: the last page of any
    listing, begun before the change (the client's own, with a cursor; or the wrapper's,
    changed under it), made the stale readOnlyHint current again, and a tool that had
    become destructive was passed through, twice (found by review)."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    state = _pages(tmp_path / "s1.json", [_tool("sql", READ_ONLY)], [_tool("other")])
    changed = _pages(tmp_path / "s2.json", [_tool("sql", destructive)], [_tool("other")])
    env = {"WC_STATE": state, "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl")}
    if how == "own listing across it":
        env["WC_FLIP"] = changed
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    if how == "client page after the change":
        await h.start()
        Path(state).write_text(Path(changed).read_text())
        await h.answer(h.send("poke"))  # the child announces the change
        await h.answer(h.send("tools/list", {"cursor": "p1"}))  # the client's second page
    else:
        await h.start(list_tools=False)
    call = {"name": "sql", "arguments": {"q": "DELETE FROM orders"}}
    await h.answer(h.send("tools/call", call))
    again = await h.answer(h.send("tools/call", call))
    assert mark(again)["replayed"] is True
    assert _listing_runs(tmp_path, "sql") == 1, "a destructive call passed through, twice"
    assert await h.stop() == 0


async def test_a_tool_listed_twice_is_fenced_unless_read_only_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last entry won: `charge` listed destructive, then again read-only on a later
    page, was passed through (found by review). Contradicting annotations: fenced."""
    state = _pages(
        tmp_path / "s.json",
        [_tool("charge", {"destructiveHint": True}), _tool("peek", READ_ONLY)],
        [_tool("charge", READ_ONLY), _tool("peek", READ_ONLY)],
    )
    env = {"WC_STATE": state, "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl")}
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    for _ in range(2):
        await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
        await h.answer(h.send("tools/call", {"name": "peek", "arguments": {}}))
    assert _listing_runs(tmp_path, "charge") == 1, "charge ran twice: passed through"
    assert _listing_runs(tmp_path, "peek") == 2  # read-only both times: passed through
    assert await h.stop() == 0


async def test_a_domain_filled_from_an_object_is_the_same_whatever_its_key_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The domain template was filled with str() of an object argument, which keeps key
    order: the same call with its keys in another order named the same intent under
    another domain and was refused intent_conflict instead of replayed (found by review).
    Objects fill it as canonical JSON, an integral float as its integer."""
    policy = Policy.from_dict({"tools": {"charge": {"domain": "acct:{customer}:{n}"}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    await h.start()
    first = {"customer": {"id": 7, "region": "eu"}, "n": 1, "order": 1}
    again = {"order": 1, "n": 1.0, "customer": {"region": "eu", "id": 7}}
    assert text(await h.answer(h.send("tools/call", {"name": "charge", "arguments": first})))
    got = await h.answer(h.send("tools/call", {"name": "charge", "arguments": again}))
    assert mark(got)["replayed"] is True, got
    assert len(h.ledger()) == 1
    assert await h.stop() == 0


def test_the_default_scope_takes_in_a_relative_command_only(tmp_path: Path) -> None:
    """./server in a/ and in b/ are two programs: the command was skipped (found by
    review). A bare command is found on PATH, so a docker/ folder in the working directory
    does not change docker's scope, nor a test/ folder a variable's value "test" (the
    review of that fix: it changed the scope of commands that had not changed). And a
    relative data file that does not exist yet is named, as the scope changes once it
    does (the wrapper warns at start)."""
    from effectfence.wrap.proxy import _not_yet_there, default_namespace

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "server").write_text("#!/bin/sh\n")
        (d / "docker").mkdir()
        (d / "test").mkdir()
    command = ["./server"]
    assert default_namespace(command, {}, str(a)) != default_namespace(command, {}, str(b))
    docker = ["docker", "run", "-i", "--rm", "mcp/stripe"]
    old = "cmd-" + hashlib.sha256(canonical_bytes(docker)).hexdigest()[:16]
    assert default_namespace(docker, {}, str(a)) == old
    env = {"DATABASE": "test"}
    assert default_namespace(["srv"], env, str(a)) == default_namespace(["srv"], env, str(b))
    argv = ["uvx", "mcp-server-sqlite", "--db-path", "new.db", "@scope/pkg", "--x=data/out.csv"]
    assert _not_yet_there(argv, str(a)) == ["new.db", "data/out.csv"]


async def test_a_listing_page_answered_after_a_change_never_makes_stale_annotations_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page requested before a tools change but answered after a current listing had
    made the tools known (an asynchronous server answers out of order) still reset them to
    its stale readOnlyHint, and a destructive call passed through (found by review). A page
    requested before the change is relayed and never learned from."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    env = {
        "WC_STATE": _pages(tmp_path / "s1.json", [_tool("sql", READ_ONLY)]),
        "WC_POKE_STATE": _pages(tmp_path / "s2.json", [_tool("sql", destructive)]),
        "WC_HOLD_FIRST": "1",
        "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl"),
    }
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    stale = h.send("tools/list")  # the child holds it, with sql read-only
    await h.answer(h.send("poke"))  # sql becomes destructive: list_changed
    call = {"name": "sql", "arguments": {"q": "DELETE FROM orders"}}
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is False
    await h.answer(h.send("release"))
    await h.answer(stale)  # the stale page reaches the wrapper, and its client
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is True
    assert _listing_runs(tmp_path, "sql") == 1
    assert await h.stop() == 0


async def test_a_domain_template_still_indexes_an_object_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects fill a domain template as canonical JSON, but {customer[id]} and {items[0]}
    still index them (turned into JSON text first, every such call was refused: found by
    review of that change), and a float keeps its format spec."""
    domain = "acct:{customer[id]}:{items[0]}:{amount:.2f}"
    policy = Policy.from_dict({"tools": {"charge": {"domain": domain}}})
    h = Harness(tmp_path, monkeypatch, policy=policy)
    await h.start()
    args = {"customer": {"id": 7, "region": "eu"}, "items": ["A1"], "amount": 5.5, "order": 1}
    got = await h.answer(h.send("tools/call", {"name": "charge", "arguments": args}))
    assert text(got) == "charged", got
    assert h.proxy.request_for("charge", args, policy.for_tool("charge")).domain == (
        "acct:7:A1:5.50"
    )
    assert await h.stop() == 0


async def test_a_client_listing_again_keeps_a_tool_listed_twice_fenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """charge is read-only on page 1 and destructive on page 2: fenced. A client that lists
    again and reads page 1 only left page 1 alone known, and charge passed on its
    readOnlyHint, unfenced, twice (found by review). What is known changes only when a
    listing is whole."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    state = _pages(
        tmp_path / "s.json", [_tool("charge", READ_ONLY)], [_tool("charge", destructive)]
    )
    env = {"WC_STATE": state, "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl")}
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    await h.answer(h.send("tools/list"))
    await h.answer(h.send("tools/list", {"cursor": "p1"}))
    call = {"name": "charge", "arguments": {"order": 1}}
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is False
    await h.answer(h.send("tools/list"))  # page 1 again, and no more
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is True
    assert mark(await h.answer(h.send("tools/call", call)))["replayed"] is True
    assert _listing_runs(tmp_path, "charge") == 1
    assert await h.stop() == 0


async def test_a_tools_change_announced_in_a_batch_is_heard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child announcing its tools changed inside a JSON-RPC batch: the wrapper relayed the
    notice and kept the stale readOnlyHint, so a tool become destructive passed through
    unfenced, twice (found by review)."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    env = {
        "WC_STATE": _pages(tmp_path / "s1.json", [_tool("sql", READ_ONLY)]),
        "WC_POKE_STATE": _pages(tmp_path / "s2.json", [_tool("sql", destructive)]),
        "WC_POKE_BATCH": "1",
        "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl"),
    }
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start()  # lists: sql read-only
    await h.answer(h.send("poke"))  # sql becomes destructive, announced in a batch
    assert any(b"list_changed" in line for line in h.out)  # relayed to the client too
    call = {"name": "sql", "arguments": {"q": "DELETE FROM orders"}}
    await h.answer(h.send("tools/call", call))
    await h.answer(h.send("tools/call", call))
    assert _listing_runs(tmp_path, "sql") == 1
    assert await h.stop() == 0


async def test_two_listings_at_once_keep_their_pages_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """charge is read-only on page 0 and destructive on page 1. Listing A read p0 and p1;
    listing B's first page then emptied the one map all listings shared, and A's last page
    made that map known: charge read-only, unfenced, twice (found by review). A page now
    belongs to the listing whose cursor it was asked with."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    state = _pages(
        tmp_path / "s.json",
        [_tool("charge", READ_ONLY)],
        [_tool("charge", destructive)],
        [_tool("other")],
    )
    env = {"WC_STATE": state, "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl")}
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    await h.answer(h.send("tools/list"))  # A: p0
    await h.answer(h.send("tools/list", {"cursor": "p1"}))  # A: p1
    await h.answer(h.send("tools/list"))  # B: p0
    await h.answer(h.send("tools/list", {"cursor": "p2"}))  # A: p2, its last page
    call = {"name": "charge", "arguments": {"order": 1}}
    await h.answer(h.send("tools/call", call))
    await h.answer(h.send("tools/call", call))
    assert _listing_runs(tmp_path, "charge") == 1
    assert await h.stop() == 0


async def test_a_long_cursor_costs_the_wrapper_no_more_than_a_short_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listings in progress are remembered by their next cursor, up to MAX_CHAINS of them;
    kept as the child sent them, a child sending cursors as long as a line may be (64 MiB)
    could make the wrapper hold gigabytes. A cursor is remembered by its digest; the
    listing still goes on through it."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    pages = [_tool("charge", READ_ONLY)], [_tool("charge", destructive)]
    state = _pages(tmp_path / "s.json", *pages)
    env = {
        "WC_STATE": state,
        "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl"),
        "WC_CURSOR_PAD": str(1 << 20),
    }
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    first = await h.answer(h.send("tools/list"))
    cursor = first["result"]["nextCursor"]
    assert len(cursor) > 1 << 20
    held = sum(len(repr(key)) for key in h.proxy._chains)
    assert 0 < held < 1000, held
    await h.answer(h.send("tools/list", {"cursor": cursor}))  # the listing's last page
    call = {"name": "charge", "arguments": {"order": 1}}
    await h.answer(h.send("tools/call", call))
    await h.answer(h.send("tools/call", call))
    assert _listing_runs(tmp_path, "charge") == 1  # listed twice, once destructive: fenced
    assert await h.stop() == 0


async def test_a_restarted_child_is_listed_again_before_its_hints_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child dies and a new process serves sql as destructive. Nothing was forgotten on a
    restart: the dead child's readOnlyHint passed sql unfenced, twice (found by review)."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    state = tmp_path / "s.json"
    env = {
        "WC_STATE": _pages(state, [_tool("sql", READ_ONLY)]),
        "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl"),
    }
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start()  # lists: sql read-only
    _pages(state, [_tool("sql", destructive)])  # what the next process serves
    await _kill_child(h)
    call = {"name": "sql", "arguments": {"q": "DELETE FROM orders"}}
    await h.answer(h.send("tools/call", call))
    await h.answer(h.send("tools/call", call))
    assert _listing_runs(tmp_path, "sql") == 1
    assert await h.stop() == 0


@pytest.mark.parametrize("pair", ["\u0390\u1fd3", "\u03b0\u1fe3", "\ufb05\ufb06"])
async def test_keys_one_to_go_simple_folding_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pair: str
) -> None:
    """Unicode's simple case folding, Go's, maps U+1FD3 to U+0390, U+1FE3 to U+03B0, U+FB05
    to U+FB06 and capital sharp s to sharp s: one key each to Go, two to the check, which
    let such a line through (found by review, twice)."""
    a, b = pair
    line = (
        '{"jsonrpc":"2.0","id":60,"method":"tools/call","params":{"name":"charge",'
        f'"arguments":{{"stra{a}e":"A","stra{b}e":"B"}}}}}}'
    ).encode()
    h = Harness(tmp_path, monkeypatch, RAW_FOLD_KEYS="1")
    await h.start()
    h.raw(line)
    await h.answer(h.send("tools/call", {"name": "charge", "arguments": {"order": 1}}))
    refused = [json.loads(x) for x in h.out if b"ambiguous" in x]
    assert len(refused) == 1 and refused[0]["error"]["code"] == -32600, h.out[-3:]
    assert await h.stop() == 0


async def test_a_listing_cursor_in_another_case_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/list with "Cursor": no cursor to the wrapper (a first page), page 1 to a child
    that reads names without case. That listing, without its first page, became what was
    known, and charge (destructive on page 0) passed on page 1's readOnlyHint (found by
    review). Refused -32600, as a tool call's look-alike fields are; params by position
    -32602."""
    destructive = {"readOnlyHint": False, "destructiveHint": True}
    state = _pages(
        tmp_path / "s.json", [_tool("charge", destructive)], [_tool("charge", READ_ONLY)]
    )
    env = {
        "WC_STATE": state,
        "WC_LEDGER": str(tmp_path / "listing_ledger.jsonl"),
        "WC_CASE_BLIND": "1",
    }
    h = Harness(tmp_path, monkeypatch, child=LISTING_CHILD, **env)
    await h.start(list_tools=False)
    call = {"name": "charge", "arguments": {"order": 1}}
    await h.answer(h.send("tools/call", call))  # the wrapper's own listing: fenced
    for params, code in (({"Cursor": "p1"}, -32600), (["p1"], -32602)):
        got = await h.answer(h.send("tools/list", params))  # type: ignore[arg-type]
        assert got["error"]["code"] == code
    await h.answer(h.send("tools/call", call))
    await h.answer(h.send("tools/call", call))
    assert _listing_runs(tmp_path, "charge") == 1
    assert await h.stop() == 0
