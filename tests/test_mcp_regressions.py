"""Regressions from an adversarial review of the stdio MCP server: one test per finding.

Every test here failed on the code it was written against and passes since the fix; each
names the defect it pins.
"""

from __future__ import annotations

from typing import Any

import pytest
from mcp_support import PAYLOAD_KEYS, connect, req
from mcp_types import CallToolResult
from support import FakeClock

from effectfence import EffectFence, FenceConfig
from effectfence.mcp.server import INSTRUCTIONS, build_server, main

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if hasattr(c, "text"))  # type: ignore[union-attr]


def refused(result: CallToolResult, code: str) -> dict[str, Any]:
    assert result.is_error, result
    payload = result.structured_content
    assert payload is not None and set(payload) == PAYLOAD_KEYS, payload
    assert payload["code"] == code, payload
    return payload


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)[:500]
    assert result.structured_content is not None
    return result.structured_content


# -- 1. "fresh" with a ticket that can never be redeemed ----------------------------------------


async def test_fresh_is_never_answered_with_a_ticket_the_server_itself_refuses() -> None:
    """HIGH. known_clock (and read_set) are unbounded, so the sealed ticket can exceed the
    4 MiB that TicketSigner.open accepts. The agent is told FRESH (run it now), runs the
    real tool, and then fence_commit AND fence_abort are refused invalid_ticket: the effect
    that fired can be neither recorded nor fenced, and once the lease lapses the next
    attempt is told FRESH again -> the real tool runs twice for one intent."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(clock=clock))
    server = build_server(fence)
    first = await server.call_tool("fence_prepare", req(known_clock={"x" * (4 << 20): 1}))
    assert isinstance(first, CallToolResult)
    if first.is_error:  # acceptable fix: refused up front, nothing decided
        refused(first, "invalid_request")
        assert fence.intent_status("charge:1").state == "absent"
        return
    ticket = ok(first)["prepared"]
    # the real tool ran and timed out: the agent does what it was told
    aborted = await server.call_tool("fence_abort", {"prepared": ticket, "reason": "timeout"})
    assert isinstance(aborted, CallToolResult)
    assert not aborted.is_error, text_of(aborted)[:300]
    clock.advance(31.0)
    again = await server.call_tool("fence_prepare", req(agent="agent-b"))
    assert isinstance(again, CallToolResult)
    refused(again, "intent_failed")


async def test_a_fat_domain_head_clock_cannot_strand_an_innocent_later_agent() -> None:
    """HIGH (same root cause, worse reach). A committed effect's vector clock becomes the
    domain head and is merged into every later ticket on the domain. Agent A commits with
    a ~2.3 MB known_clock (its own ticket still fits). Agent B then prepares a different
    intent on the domain with ordinary, in-limit args (< max_args_bytes) and no clock: it
    is told FRESH but its ticket is over the wire limit, so it can neither commit nor
    abort the effect it just ran."""
    fence = EffectFence()
    server = build_server(fence)
    a = await server.call_tool("fence_prepare", req("a", known_clock={"k" * 2_300_000: 1}))
    assert isinstance(a, CallToolResult)
    if not a.is_error:  # a fix may bound known_clock; then there is nothing to strand
        done = await server.call_tool("fence_commit", {"prepared": ok(a)["prepared"], "result": 1})
        assert isinstance(done, CallToolResult)
        ok(done)
    b = await server.call_tool(
        "fence_prepare", req("b", agent="agent-b", args={"memo": "y" * 1_000_000})
    )
    assert isinstance(b, CallToolResult)
    ticket = ok(b)["prepared"]
    committed = await server.call_tool("fence_commit", {"prepared": ticket, "result": 2})
    assert isinstance(committed, CallToolResult)
    ok(committed)


# -- 2. a commit-time stale read is rendered "retryable: prepare again" ---------------------------


async def test_commit_time_read_set_stale_is_not_reported_retryable() -> None:
    """MEDIUM-HIGH. At commit, read_set_stale means the effect ALREADY RAN on a stale view
    and the intent is now FAILED. The typed payload still says retryable=true and
    recover='re-read the domains, re-decide, then prepare again' (the class constants of
    the prepare-time refusal). An agent acting on the structured fields re-decides and
    runs the action again (under a new intent, since this one is fenced) - a double fire.
    The commit tool's own description and the message say 'reconcile'; the payload
    contradicts them."""
    async with connect(build_server(EffectFence())) as client:
        first = ok(
            await client.call_tool(
                "fence_prepare", req("pay", domain="d1", read_set=[["balance", 0]])
            )
        )
        ok(await client.call_tool("fence_prepare", req("move", domain="balance")))
        stale = await client.call_tool(
            "fence_commit", {"prepared": first["prepared"], "result": {"ok": True}}
        )
        payload = refused(stale, "read_set_stale")
        assert payload["details"]["state"] == "failed"
        assert payload["retryable"] is False, payload
        assert "prepare again" not in payload["recover"], payload["recover"]


# -- 3. refusals echo payload values -------------------------------------------------------------


async def test_refusals_never_echo_argument_or_result_values() -> None:
    """MEDIUM. The server carefully never echoes values for schema errors
    (_invalid_arguments), but the fence's canonical-JSON errors do: an out-of-range integer
    in args or in a result (a 19+ digit account/card number, a big token) is quoted in full
    in `message` and in the text rendering, which agents log and forward."""
    secret_arg = 12345678901234567890123
    secret_result = 98765432109876543210
    fence = EffectFence()
    server = build_server(fence)
    bad = await server.call_tool("fence_prepare", req("p", args={"pan": secret_arg}))
    assert isinstance(bad, CallToolResult)
    refused(bad, "invalid_request")
    assert str(secret_arg) not in text_of(bad)
    async with connect(server) as client:
        ticket = ok(await client.call_tool("fence_prepare", req("q")))["prepared"]
        res = await client.call_tool(
            "fence_commit", {"prepared": ticket, "result": {"acct": secret_result}}
        )
        refused(res, "invalid_request")
        assert str(secret_result) not in text_of(res)


# -- 4. schema truthfulness ----------------------------------------------------------------------


async def test_expected_seq_at_the_published_schema_maximum_is_not_refused_as_invalid() -> None:
    """LOW. tools/list publishes expected_seq (and ReadSetItem.seq) with maximum 2**63-2,
    and [domain, seq] pairs with no bounds at all, but the core refuses anything above
    2**53-2 as invalid_request. A schema-conforming call must not be refused as malformed."""
    async with connect(build_server(EffectFence())) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        prop = tools["fence_prepare"].input_schema["properties"]["expected_seq"]
        maximum = next(b["maximum"] for b in prop["anyOf"] if b.get("type") == "integer")
        res = await client.call_tool("fence_prepare", req(expected_seq=maximum))
        # the domain is at 0: the honest answer is domain_race, not "fix the call"
        refused(res, "domain_race")


async def test_the_run_flag_agents_are_told_about_exists() -> None:
    """LOW. The server instructions and the fence_prepare description tell agents to read
    'status "fresh" (run=true)' / '"replay" (run=false)', but PrepareOutput has no `run`
    field: an agent keyed on `run` never sees true and stalls (or guesses)."""
    # fixed by telling agents only about fields that exist: `status` is the signal
    assert "run=" not in INSTRUCTIONS
    async with connect(build_server(EffectFence())) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert "run=" not in (tools["fence_prepare"].description or "")
        fresh = ok(await client.call_tool("fence_prepare", req()))
    assert fresh["status"] == "fresh" and "run" not in fresh


# -- 5. statistics -------------------------------------------------------------------------------


async def test_every_refused_prepare_lands_in_a_stats_bucket() -> None:
    """LOW. fence_stats promises 'every prepare attempt in exactly one bucket'. NaN args are
    counted invalid_request, but a schema-valid prepare that EffectRequest refuses (here
    expected_seq above 2**53-2) never reaches fence.prepare and is counted nowhere."""
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        refused(await client.call_tool("fence_prepare", req(expected_seq=2**60)), "invalid_request")
        stats = ok(await client.call_tool("fence_stats", {}))
    assert stats["prepare"]["invalid_request"] == 1, stats["prepare"]
    assert stats["attempts"] == 1


# -- 6. the command line -------------------------------------------------------------------------


def test_serve_never_echoes_a_keyword_dsn_password(capsys: pytest.CaptureFixture[str]) -> None:
    """LOW. _store_label hides credentials only for URL-shaped stores ('x://...'); a libpq
    keyword DSN has neither '://' nor ':' and is printed verbatim, password included."""
    with pytest.raises(SystemExit) as exc:
        main(["--store", "host=db user=admin password=hunter2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "a store URL looks like" in err
    assert "hunter2" not in err


# -- a ticket sealed shallower than the fence admits ---------------------------------------------


async def test_args_as_deep_as_the_fence_admits_get_a_ticket_that_commits() -> None:
    """Tickets were sealed at a fixed depth of 64 while a fence admits up to its max_depth:
    deeper args were claimed, then sealing raised a bare CanonicalError, so the caller got
    an untyped error and the intent stayed in flight under a token nobody held (found by
    review). They are sealed as deep as a certificate holds now."""
    deep: Any = 1
    for _ in range(99):  # args {"a": deep} nest 100 deep: what max_depth=100 admits
        deep = [deep]
    fence = EffectFence(FenceConfig(max_depth=100))
    server = build_server(fence)
    async with connect(server) as client:
        first = ok(await client.call_tool("fence_prepare", req(args={"a": deep})))
        assert first["status"] == "fresh"
        done = await client.call_tool(
            "fence_commit", {"prepared": first["prepared"], "result": {"a": deep}}
        )
        assert ok(done)["cert"]["args"] == {"a": deep}
        again = ok(await client.call_tool("fence_prepare", req(args={"a": deep})))
        assert again["status"] == "replay"


async def test_a_ticket_that_cannot_be_sealed_is_a_refusal_that_lets_the_claim_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Backstop: whatever keeps a ticket from being sealed is InvalidRequest, the refusal
    on which the server lets the claim go; a bare CanonicalError left it held."""
    from effectfence import tickets
    from effectfence.canonical import CanonicalError

    def unsealable(value: Any, **kw: Any) -> bytes:
        raise CanonicalError("$.args", "nesting is deeper than max_depth")

    fence = EffectFence()
    server = build_server(fence)
    monkeypatch.setattr(tickets, "canonical_bytes", unsealable)
    async with connect(server) as client:
        refused(await client.call_tool("fence_prepare", req()), "invalid_request")
    assert fence.intent_status("charge:1").state == "absent"


def test_a_read_set_that_is_not_a_list_is_a_counted_refusal() -> None:
    """read_set=5 raised a bare TypeError, past the count of refusals (found by review)."""
    from effectfence.errors import InvalidRequest

    fence = EffectFence()
    for bad in (5, 2.5, object()):
        with pytest.raises(InvalidRequest, match="read_set"):
            fence.request("i", "d", "t", {}, "a", read_set=bad)  # type: ignore[arg-type]
    assert fence.stats()["prepare"]["invalid_request"] == 3
    assert fence.intent_status("i").state == "absent"


async def test_a_cancel_that_lands_after_the_step_releases_the_fresh_ticket(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's cancel processed after an offloaded prepare finished but before its task
    resumed was not delivered at the await (the future was done): the tool answered fresh,
    the SDK dropped the answer as cancelled, and the intent stayed held by nobody until the
    lease lapsed (found by review). The cancel is fed through the server's own dispatcher
    in the very loop iteration the step's future is done; no sleep decides the race."""
    import asyncio

    import anyio
    from mcp import Client
    from mcp_types import JSONRPCNotification

    fence, metrics, server, dispatchers = _cancellable_server(tmp_path, monkeypatch)
    delivered = anyio.Event()
    answers: list[Any] = []
    loop = asyncio.get_running_loop()

    async def ignore(*_: Any) -> None:
        return None

    def poll() -> None:
        for dispatcher in dispatchers:
            for rid, entry in list(dispatcher._in_flight.items()):
                waiter = getattr(entry.scope._host_task, "_fut_waiter", None)
                if waiter is not None and waiter.done():
                    params = {"requestId": rid, "reason": "client timed out"}
                    note = JSONRPCNotification(
                        jsonrpc="2.0", method="notifications/cancelled", params=params
                    )
                    dispatcher._dispatch_notification(note, None, ignore, None)
                    delivered.set()
                    return
        loop.call_soon(poll)

    try:
        async with Client(server, mode="legacy") as client, anyio.create_task_group() as tg:

            async def call() -> None:
                answers.append(await client.call_tool("fence_prepare", req("c1")))

            tg.start_soon(call)
            loop.call_soon(poll)
            with anyio.fail_after(10):
                await delivered.wait()
                while fence.intent_status("c1").state != "absent":
                    await anyio.sleep(0.01)  # bounded: the release, or fail_after
            tg.cancel_scope.cancel()
        assert answers == []  # the ticket never reached the client
        assert metrics.calls.get(("fence_release", "released")) == 1
    finally:
        fence.close()


async def test_a_retried_abort_is_told_its_own_ticket_finished_the_intent() -> None:
    """An abort repeated after a lost answer was refused "token 1 is not the current lease;
    current token 1" (found by review): the code stays lease_lost, as the state table says,
    and the message says this ticket finished it."""
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        fresh = ok(await client.call_tool("fence_prepare", req("ab")))
        wire = {"prepared": fresh["prepared"], "reason": "gateway timeout"}
        ok(await client.call_tool("fence_abort", wire))
        payload = refused(await client.call_tool("fence_abort", wire), "lease_lost")
    assert "already finished it" in payload["message"], payload
    assert "is not the current lease" not in payload["message"]
    assert payload["details"]["finished_by_this_ticket"] is True


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_a_cancel_during_the_step_releases_the_fresh_ticket(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """The after-step cancel fix covered asyncio only: on trio the step ran unshielded in
    anyio's thread, the cancel was held back until it finished, the tool answered fresh and
    the SDK dropped the answer, leaving the intent held by nobody (found by review). The
    step's thread is held at a gate while the cancel lands; no sleep decides the race."""
    import threading

    import anyio
    from mcp import Client
    from mcp_types import JSONRPCNotification

    fence, metrics, server, dispatchers = _cancellable_server(tmp_path, monkeypatch)
    entered, gate = threading.Event(), threading.Event()
    real_request = fence.request

    def gated_request(*a: Any, **kw: Any) -> Any:
        out = real_request(*a, **kw)  # the claim is made, and the thread is still in the
        entered.set()  # step when the cancel lands
        gate.wait(10)
        return out

    monkeypatch.setattr(fence, "request", gated_request)

    async def ignore(*_: Any) -> None:
        return None

    answers: list[Any] = []
    try:
        async with Client(server, mode="legacy") as client, anyio.create_task_group() as tg:

            async def call() -> None:
                answers.append(await client.call_tool("fence_prepare", req("t1")))

            tg.start_soon(call)
            with anyio.fail_after(10):
                while not entered.is_set():
                    await anyio.sleep(0.01)
                (dispatcher,) = dispatchers
                (rid,) = list(dispatcher._in_flight)
                params = {"requestId": rid, "reason": "client timed out"}
                note = JSONRPCNotification(
                    jsonrpc="2.0", method="notifications/cancelled", params=params
                )
                dispatcher._dispatch_notification(note, None, ignore, None)
                gate.set()
                while fence.intent_status("t1").state != "absent":
                    await anyio.sleep(0.01)  # bounded: the release, or fail_after
            tg.cancel_scope.cancel()
        assert answers == []
        assert metrics.calls.get(("fence_release", "released")) == 1
    finally:
        gate.set()
        fence.close()


def _cancellable_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """A server on a SQLite store (its steps offloaded), its metrics, and the dispatchers
    that serve its tool calls (to feed them a client's cancel at a chosen moment)."""
    from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher

    from effectfence.mcp.telemetry import Metrics

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=600))
    metrics = Metrics()
    server = build_server(fence, metrics=metrics)
    dispatchers: list[Any] = []
    dispatch = JSONRPCDispatcher._dispatch_request

    async def capture(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        if request.method == "tools/call" and self not in dispatchers:
            dispatchers.append(self)
        return await dispatch(self, request, *a, **kw)

    monkeypatch.setattr(JSONRPCDispatcher, "_dispatch_request", capture)
    return fence, metrics, server, dispatchers
