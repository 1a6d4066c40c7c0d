"""The MCP server in memory (``mcp.Client(server)``): schemas, the protocol, tickets, refusals.

Every refusal test also checks that nothing changed: the fence's records and event counters
are snapshotted before the refused call and compared after it.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_support import PAYLOAD_KEYS, connect, req
from mcp_types import CallToolResult
from support import REDIS_URL, FakeClock, drop_redis_prefix, need, unique_name

from effectfence import EffectCert, EffectFence, EffectRequest, FenceConfig
from effectfence.errors import StoreUnavailable
from effectfence.fence import MAX_CLEAR_TEXT
from effectfence.mcp.models import MAX_VERIFY_CHAIN, CertModel, CommitOutput, PrepareOutput
from effectfence.mcp.server import STDIO_CLEARER, build_server, main
from effectfence.mcp.telemetry import Decision, Metrics
from effectfence.operator.views import clear_view
from effectfence.store.memory import MemoryStore
from effectfence.tickets import TicketSigner

pytestmark = pytest.mark.anyio

TOOLS = {
    "fence_prepare",
    "fence_commit",
    "fence_abort",
    "fence_release",
    "fence_renew",
    "fence_status",
    "fence_stats",
    "fence_verify",
}
EVENTS = ("commits", "aborts", "releases", "renewals", "takeovers", "clears")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def snapshot(fence: EffectFence, *intents: str) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was (statistics of prepare excepted)."""
    stats = fence.stats()
    states = []
    for i in intents:
        st = fence.intent_status(i)
        states.append(
            (st.state, st.token, st.holder, st.domain, st.cert and st.cert.hash, st.reason)
        )
    return (stats["size"], tuple(stats[e] for e in EVENTS), tuple(states))


def refusal(result: CallToolResult, code: str) -> dict[str, Any]:
    """Assert ``result`` is a typed refusal with ``code``, in structured content and text."""
    assert result.is_error, result
    payload = result.structured_content
    assert payload is not None and set(payload) == PAYLOAD_KEYS, payload
    assert payload["code"] == code, payload
    text = result.content[0].text  # type: ignore[union-attr]
    assert code in text.splitlines()[0]
    assert json.loads(text.splitlines()[-1]) == payload
    return payload


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    data = result.structured_content
    assert data is not None
    text = result.content[0].text  # type: ignore[union-attr]
    assert json.loads(text.splitlines()[-1]) == data
    return data


async def prepare(client: Client, **kw: Any) -> CallToolResult:
    return await client.call_tool("fence_prepare", req(**kw))


# -- tools/list ------------------------------------------------------------------------------


async def test_list_tools_publishes_full_schemas_and_truthful_annotations() -> None:
    async with connect(build_server()) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS  # fence_clear only when the operator allows it
    for tool in tools.values():
        assert tool.description and len(tool.description) > 80
        schema = tool.input_schema
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False, tool.name
        for name, prop in schema["properties"].items():
            assert prop.get("description"), (tool.name, name)
        out = tool.output_schema
        assert out is not None and out["type"] == "object", tool.name
        # the answer and the refusal, both declared: clients validate isError results too
        answer, refused = out["anyOf"]
        assert set(refused["required"]) == PAYLOAD_KEYS, tool.name
        for branch in (answer, refused):
            assert branch["type"] == "object" and branch["additionalProperties"] is False
            for name, prop in branch["properties"].items():
                assert prop.get("description"), (tool.name, name)
        ann = tool.annotations
        assert ann is not None and ann.open_world_hint is False
    prep = tools["fence_prepare"].input_schema
    assert set(prep["required"]) == {"intent", "domain", "tool", "args", "agent"}
    assert {"read_set", "parent", "known_clock", "expected_seq"} <= set(prep["properties"])
    assert prep["properties"]["args"]["type"] == "object"
    assert set(tools["fence_commit"].input_schema["required"]) == {"prepared", "result"}
    assert "prepared" in tools["fence_abort"].input_schema["properties"]
    assert "reason" in tools["fence_abort"].input_schema["properties"]
    desc = tools["fence_prepare"].description or ""
    assert "Do NOT run" in desc and "fresh" in desc and "replay" in desc
    for name in ("fence_status", "fence_stats", "fence_verify"):
        assert tools[name].annotations.read_only_hint is True  # type: ignore[union-attr]
    for name in ("fence_prepare", "fence_commit", "fence_abort", "fence_release"):
        assert tools[name].annotations.read_only_hint is False  # type: ignore[union-attr]
    assert tools["fence_prepare"].annotations.idempotent_hint is False  # type: ignore[union-attr]
    assert tools["fence_release"].annotations.destructive_hint is True  # type: ignore[union-attr]


async def test_fence_clear_is_registered_only_when_allowed() -> None:
    async with connect(build_server(allow_clear=True)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == TOOLS | {"fence_clear"}
    clear = tools["fence_clear"]
    schema = clear.input_schema
    assert set(schema["required"]) == {"intent", "reason"}  # no clear without a reason
    assert schema["properties"]["reason"]["maxLength"] == MAX_CLEAR_TEXT
    force = schema["properties"]["force"]
    assert force["type"] == "boolean" and force["default"] is False
    answer = clear.output_schema["anyOf"][0]  # type: ignore[index]
    assert {"audit_id", "who", "reason", "forced"} <= set(answer["properties"])
    desc = clear.description or ""
    assert "reason" in desc and "force" in desc and "intent_in_flight" in desc
    assert clear.annotations.destructive_hint is True  # type: ignore[union-attr]
    async with connect(build_server()) as client:
        result = await client.call_tool("fence_clear", {"intent": "x", "reason": "r"})
        assert result.is_error


async def test_fence_clear_without_a_reason_is_refused_and_changes_nothing() -> None:
    fence = EffectFence()
    async with connect(build_server(fence, allow_clear=True)) as client:
        ticket = ok(await prepare(client))["prepared"]
        ok(await client.call_tool("fence_abort", {"prepared": ticket, "reason": "timeout"}))
        before = snapshot(fence, "charge:1")
        for arguments, field in (
            ({"intent": "charge:1"}, "reason"),
            ({"intent": "charge:1", "reason": ""}, "reason"),
            ({"intent": "charge:1", "reason": " \t\n"}, "reason"),
            ({"intent": "charge:1", "reason": 81}, "reason"),
            ({"intent": "charge:1", "reason": None}, "reason"),
            ({"intent": "charge:1", "reason": "x" * (MAX_CLEAR_TEXT + 1)}, "reason"),
            ({"intent": "charge:1", "reason": "ok", "force": "yes"}, "force"),
            ({"intent": "charge:1", "reason": "ok", "who": "someone else"}, "who"),
        ):
            result = await client.call_tool("fence_clear", arguments)
            payload = refusal(result, "invalid_request")
            assert field in payload["message"], (arguments, payload)
            assert snapshot(fence, "charge:1") == before, arguments
        assert fence.audit() == [], "a refused clear records nothing"
        refusal(await prepare(client), "intent_failed")  # still fenced


async def test_fence_clear_clears_only_the_version_fence_status_showed() -> None:
    """expect_state / expect_token: what fence_status showed. A record that moved since (a
    lease taken over, a commit) is refused intent_in_flight, retryable, and unchanged; a
    lapsed lease is still the in-flight record looked at."""
    from support import FakeClock

    from effectfence.store.memory import MemoryStore

    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=10.0), store=MemoryStore(clock=clock))
    async with connect(build_server(fence, allow_clear=True)) as client:
        held = ok(await prepare(client))
        shown = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert (shown["state"], shown["token"]) == ("in_flight", held["token"])
        before = snapshot(fence, "charge:1")
        wrong = {"intent": "charge:1", "reason": "stuck", "force": True}
        for expect in ({"expect_token": held["token"] + 1}, {"expect_state": "failed"}):
            payload = refusal(
                await client.call_tool("fence_clear", {**wrong, **expect}), "intent_in_flight"
            )
            assert payload["retryable"] is True and "look at the record again" in payload["recover"]
            assert snapshot(fence, "charge:1") == before and fence.audit() == []
        refusal(
            await client.call_tool("fence_clear", {**wrong, "expect_token": True}),
            "invalid_request",
        )
        clock.advance(11.0)  # the lease lapses: fence_status says in_flight_lapsed now
        lapsed = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert lapsed["state"] == "in_flight_lapsed"
        cleared = ok(
            await client.call_tool(
                "fence_clear",
                {**wrong, "expect_state": lapsed["state"], "expect_token": lapsed["token"]},
            )
        )
        assert cleared["cleared"] is True and cleared["previous_state"] == "in_flight_lapsed"


async def test_fence_clear_refuses_a_live_lease_unless_forced_and_records_who_and_why() -> None:
    fence = EffectFence()
    async with connect(build_server(fence, allow_clear=True)) as client:
        held = ok(await prepare(client))
        before = snapshot(fence, "charge:1")
        arguments = {"intent": "charge:1", "reason": "looks stuck"}
        payload = refusal(await client.call_tool("fence_clear", arguments), "intent_in_flight")
        assert payload["details"]["holder"] == "agent-a" and "force" in payload["recover"]
        assert payload["retryable"] is True
        assert snapshot(fence, "charge:1") == before and fence.audit() == []
        refusal(
            await client.call_tool("fence_clear", {**arguments, "force": False}),
            "intent_in_flight",
        )
        assert snapshot(fence, "charge:1") == before and fence.audit() == []

        forced = ok(
            await client.call_tool(
                "fence_clear", {"intent": "charge:1", "reason": "its host is gone", "force": True}
            )
        )
        [entry] = fence.audit("charge:1")
        assert forced == clear_view("charge:1", entry)  # the answer is the recorded entry
        assert forced["previous_state"] == "in_flight" and forced["forced"] is True
        assert (entry.who, entry.reason, entry.forced) == (STDIO_CLEARER, "its host is gone", True)
        assert entry.previous["holder"] == "agent-a" and entry.previous["token"] == held["token"]
        assert fence.stats()["clears"] == 1
        # the holder's ticket is powerless now; a retry runs afresh
        refusal(
            await client.call_tool("fence_commit", {"prepared": held["prepared"], "result": 1}),
            "lease_lost",
        )
        again = ok(await prepare(client))
        assert again["status"] == "fresh" and again["token"] > held["token"]
        # force on a record that needs none (lapsed, done, failed) is not recorded as forced
        ok(await client.call_tool("fence_commit", {"prepared": again["prepared"], "result": 2}))
        done = ok(
            await client.call_tool(
                "fence_clear", {"intent": "charge:1", "reason": "re-run it", "force": True}
            )
        )
        assert done["previous_state"] == "done" and done["forced"] is False
        # nothing left: nothing cleared, nothing recorded
        nothing = ok(await client.call_tool("fence_clear", {**arguments, "force": True}))
        assert nothing == {"intent": "charge:1", "cleared": False, "previous_state": "absent"}
        assert [e.reason for e in fence.audit("charge:1")] == ["its host is gone", "re-run it"]


# -- the protocol ---------------------------------------------------------------------------


async def test_hot_path_answers_are_exactly_what_their_output_models_describe() -> None:
    """fence_prepare and fence_commit build their answers as plain dicts (a model round trip
    cost more than the fence step): each must be what its model validates and dumps."""
    async with connect(build_server(EffectFence())) as client:
        fresh = ok(await prepare(client))
        committed = ok(
            await client.call_tool(
                "fence_commit", {"prepared": fresh["prepared"], "result": {"id": [1, 2]}}
            )
        )
        replay = ok(await prepare(client, agent="agent-b"))
    for model, answer in (
        (PrepareOutput, fresh),
        (CommitOutput, committed),
        (PrepareOutput, replay),
    ):
        dumped = model.model_validate(answer).model_dump(mode="json", exclude_unset=True)
        assert dumped == answer, model.__name__
        assert list(dumped) == list(answer)  # and in the model's field order
    assert list(replay["cert"]) == list(CertModel.model_fields)


async def test_prepare_commit_then_duplicates_replay_the_identical_cert() -> None:
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        first = ok(await prepare(client))
        assert first["status"] == "fresh" and first["intent"] == "charge:1"
        assert first["token"] >= 1 and first["seq"] == 1 and first["takeover"] is False
        assert 0 < first["lease_expires_in"] <= 30
        assert "cert" not in first and "result" not in first
        committed = ok(
            await client.call_tool(
                "fence_commit", {"prepared": first["prepared"], "result": "[1, 2]"}
            )
        )
        cert = committed["cert"]
        assert committed["status"] == "committed"
        assert cert["result"] == "[1, 2]"  # a string result stays a string (no JSON pre-parse)
        for agent in ("agent-b", "agent-c"):
            dup = ok(await prepare(client, agent=agent))
            assert dup["status"] == "replay" and dup["intent"] == "charge:1"
            assert "prepared" not in dup
            assert dup["cert"] == cert and dup["result"] == "[1, 2]"
        verified = ok(await client.call_tool("fence_verify", {"cert": cert}))
        assert verified == {"ok": True, "kind": "cert", "length": 1, "reason": "", "recorded": True}
        status = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert status["state"] == "done" and status["cert"] == cert
    stats = fence.stats()
    assert stats["prepare"]["admitted"] == 1 and stats["prepare"]["replayed"] == 2
    assert stats["commits"] == 1


async def test_sixteen_concurrent_duplicates_over_one_connection_admit_exactly_one() -> None:
    fence = EffectFence()
    results: list[CallToolResult] = []
    async with connect(build_server(fence)) as client:

        async def call(i: int) -> None:
            results.append(await prepare(client, agent=f"agent-{i}"))

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(call, i)
        fresh = [r for r in results if not r.is_error]
        assert len(results) == 16 and len(fresh) == 1
        for r in results:
            if r.is_error:
                refusal(r, "intent_in_flight")
        ticket = ok(fresh[0])["prepared"]
        cert = ok(await client.call_tool("fence_commit", {"prepared": ticket, "result": 1}))
        replays: list[dict[str, Any]] = []

        async def dup(i: int) -> None:
            replays.append(ok(await prepare(client, agent=f"late-{i}")))

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(dup, i)
        assert {r["status"] for r in replays} == {"replay"}
        assert {r["cert"]["hash"] for r in replays} == {cert["cert"]["hash"]}
    assert fence.stats()["prepare"]["admitted"] == 1


async def test_sixteen_concurrent_duplicates_over_several_connections_admit_exactly_one() -> None:
    fence = EffectFence()
    server = build_server(fence)
    results: list[CallToolResult] = []

    async def connection(c: int) -> None:
        async with connect(server) as client:

            async def call(i: int) -> None:
                results.append(await prepare(client, agent=f"agent-{c}-{i}"))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(call, i)

    async with anyio.create_task_group() as tg:
        for c in range(4):
            tg.start_soon(connection, c)
    assert len(results) == 16
    assert sum(not r.is_error for r in results) == 1
    assert fence.stats()["prepare"]["admitted"] == 1


async def test_abort_fences_the_intent_until_an_operator_clears_it() -> None:
    fence = EffectFence()
    async with connect(build_server(fence, allow_clear=True)) as client:
        ticket = ok(await prepare(client))["prepared"]
        aborted = ok(
            await client.call_tool("fence_abort", {"prepared": ticket, "reason": "gateway timeout"})
        )
        assert aborted["status"] == "aborted" and aborted["reason"] == "gateway timeout"
        before = snapshot(fence, "charge:1")
        payload = refusal(await prepare(client, agent="agent-b"), "intent_failed")
        assert payload["details"]["reason"] == "gateway timeout"
        assert payload["retryable"] is False
        assert snapshot(fence, "charge:1") == before
        status = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert status["state"] == "failed" and status["reason"] == "gateway timeout"
        assert status["failed_for"] >= 0
        # the ticket is spent: a second abort or a commit is refused and changes nothing
        refusal(
            await client.call_tool("fence_commit", {"prepared": ticket, "result": 1}), "lease_lost"
        )
        assert snapshot(fence, "charge:1") == before
        cleared = ok(
            await client.call_tool("fence_clear", {"intent": "charge:1", "reason": "no charge"})
        )
        [entry] = fence.audit("charge:1")
        assert cleared == clear_view("charge:1", entry)  # the answer is the recorded entry
        assert cleared["previous_state"] == "failed" and cleared["audit_id"] == entry.id
        assert (entry.who, entry.reason, entry.forced) == (STDIO_CLEARER, "no charge", False)
        assert ok(await prepare(client))["status"] == "fresh"


async def test_release_frees_the_intent_for_a_retry() -> None:
    async with connect(build_server()) as client:
        first = ok(await prepare(client))
        released = ok(await client.call_tool("fence_release", {"prepared": first["prepared"]}))
        assert released["status"] == "released"
        status = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert status == {"intent": "charge:1", "state": "absent"}
        again = ok(await prepare(client, agent="agent-b"))
        assert again["status"] == "fresh" and again["token"] > first["token"]
        # the released ticket cannot finish the new attempt
        refusal(
            await client.call_tool("fence_commit", {"prepared": first["prepared"], "result": 1}),
            "lease_lost",
        )


async def test_renew_extends_the_lease_and_returns_a_fresh_ticket() -> None:
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=10.0, clock=clock, auto_sweep=False))
    server = build_server(fence)
    async with connect(server) as client:
        ticket = ok(await prepare(client))["prepared"]
        clock.advance(8)
        renewed = ok(await client.call_tool("fence_renew", {"prepared": ticket, "ttl": 60}))
        assert 59 < renewed["lease_expires_in"] <= 60
        clock.advance(30)  # past the original lease, inside the renewed one
        refusal(await prepare(client, agent="agent-b"), "intent_in_flight")
        done = await client.call_tool(
            "fence_commit", {"prepared": renewed["prepared"], "result": 7}
        )
        assert ok(done)["cert"]["result"] == 7
        for ttl in (float("nan"), float("inf"), 0, True):  # called directly: exact values
            bad = await server.call_tool("fence_renew", {"prepared": ticket, "ttl": ttl})
            refusal(bad, "invalid_request")  # type: ignore[arg-type]


async def test_lease_left_is_answered_without_reading_the_store_clock() -> None:
    """A fresh prepare and a renew report the lease they were just granted, less the time
    since the call began: never more than was granted, and no extra store round trip."""
    fence = EffectFence(FenceConfig(lease_ttl=10.0, auto_sweep=False))
    reads: list[float] = []
    real_now = fence.store.now

    def counted_now() -> float:
        reads.append(1)
        return real_now()

    fence.store.now = counted_now  # type: ignore[method-assign]
    async with connect(build_server(fence)) as client:
        reads.clear()
        first = ok(await prepare(client))
        renewed = ok(await client.call_tool("fence_renew", {"prepared": first["prepared"]}))
        assert 9.0 < first["lease_expires_in"] <= 10.0
        assert 9.0 < renewed["lease_expires_in"] <= 10.0
    assert fence.store.get("charge:1") is not None
    assert reads == [], f"{len(reads)} store clock reads for a prepare and a renew"


async def test_conflicts_races_and_stale_reads_are_refused_without_a_trace() -> None:
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        t = ok(await prepare(client, intent="a", domain="acct"))["prepared"]
        ok(await client.call_tool("fence_commit", {"prepared": t, "result": None}))
        before = snapshot(fence, "a", "b", "c")
        refusal(
            await prepare(client, intent="a", domain="acct", args={"cents": 1}), "intent_conflict"
        )
        payload = refusal(
            await prepare(client, intent="b", domain="acct", expected_seq=0), "domain_race"
        )
        assert payload["retryable"] is True
        refusal(
            await prepare(client, intent="c", domain="other", read_set=[["acct", 0]]),
            "read_set_stale",
        )
        refusal(
            await prepare(
                client, intent="c", domain="other", read_set=[{"domain": "acct", "seq": 0}]
            ),
            "read_set_stale",
        )
        assert snapshot(fence, "a", "b", "c") == before
        # and the happy paths of the same options
        fresh = ok(
            await prepare(
                client,
                intent="b",
                domain="acct",
                expected_seq=1,
                read_set=[{"domain": "acct", "seq": 1}],
                known_clock={"agent-z": 3},
            )
        )
        cert = ok(
            await client.call_tool("fence_commit", {"prepared": fresh["prepared"], "result": 2})
        )
        assert cert["cert"]["vector_clock"]["agent-z"] == 3
        assert cert["cert"]["read_set"] == [["acct", 1]]


# -- tickets ------------------------------------------------------------------------------------


def _edit_body(ticket: str, **changes: Any) -> str:
    body, mac = ticket.rsplit(".", 1)
    data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    data.update(changes)
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=") + "." + mac


async def test_forged_edited_and_truncated_tickets_are_refused_and_change_nothing() -> None:
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        ticket = ok(await prepare(client))["prepared"]
        # a well-formed ticket for the same intent, sealed by another server's key
        elsewhere = EffectFence().prepare(EffectRequest(**req(agent="x")))
        forged_ticket = TicketSigner(b"k" * 32).seal(elsewhere.ticket)
        body, mac = ticket.rsplit(".", 1)
        flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
        cases = {
            "forged under another key": forged_ticket,
            "edited token, old mac": _edit_body(ticket, token=99),
            "edited args, old mac": _edit_body(ticket, args={"cents": 1}),
            "edited mac": f"{body}.{flipped}",
            "truncated": ticket[: len(ticket) // 2],
            "mac cut off": body,
            "empty": "",
            "garbage": "not a ticket at all",
        }
        before = snapshot(fence, "charge:1")
        for name, bad in cases.items():
            for tool, extra in (
                ("fence_commit", {"result": 1}),
                ("fence_abort", {"reason": "x"}),
                ("fence_release", {}),
                ("fence_renew", {}),
            ):
                res = await client.call_tool(tool, {"prepared": bad, **extra})
                assert refusal(res, "invalid_ticket"), (name, tool)
                assert snapshot(fence, "charge:1") == before, (name, tool)
        # the genuine ticket still works
        ok(await client.call_tool("fence_commit", {"prepared": ticket, "result": 1}))


async def test_a_ticket_whose_mac_is_not_hex_is_refused_invalid_ticket_and_counted() -> None:
    """Such a MAC once raised TypeError in the signer: an untyped error to the caller, the
    call neither logged nor counted."""
    fence, metrics = EffectFence(), Metrics()
    async with connect(build_server(fence, metrics=metrics)) as client:
        ticket = ok(await prepare(client))["prepared"]
        before = snapshot(fence, "charge:1")
        for tool, extra in (
            ("fence_commit", {"result": 1}),
            ("fence_abort", {"reason": "x"}),
            ("fence_release", {}),
            ("fence_renew", {}),
        ):
            res = await client.call_tool(tool, {"prepared": "eyJ9." + "\u00e9" * 64, **extra})
            assert "malformed" in refusal(res, "invalid_ticket")["message"], tool
            assert metrics.calls[(tool, "invalid_ticket")] == 1, tool
            assert snapshot(fence, "charge:1") == before, tool
        ok(await client.call_tool("fence_commit", {"prepared": ticket, "result": 1}))


async def test_the_in_flight_gauge_counts_tickets_not_answers() -> None:
    """A retried commit is answered "committed" again (G3); the gauge went down once per
    answer, so two retries hid another caller's live ticket (found by review)."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=5.0, clock=clock, auto_sweep=False))
    metrics = Metrics()
    async with connect(build_server(fence, metrics=metrics)) as client:
        one = ok(await prepare(client, intent="charge:1"))["prepared"]
        ok(await prepare(client, intent="charge:2"))
        assert metrics.in_flight == 2
        for _ in range(3):  # the first commit, then two retries of it
            ok(await client.call_tool("fence_commit", {"prepared": one, "result": 1}))
        assert metrics.calls[("fence_commit", "committed")] == 3
        assert metrics.in_flight == 1, "charge:2 is still held"
        clock.advance(6)  # charge:2's lease lapses; a takeover replaces its ticket
        taken = ok(await prepare(client, intent="charge:2", agent="b"))["prepared"]
        assert metrics.in_flight == 1
        ok(await client.call_tool("fence_release", {"prepared": taken}))
        assert metrics.in_flight == 0


def test_the_in_flight_gauge_forgets_the_oldest_ticket_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Abandoned tickets nobody takes over must not grow the gauge for ever: past MAX_HELD
    the oldest is forgotten (a ticket handed out again counts as the newest), and a commit
    of a forgotten one changes nothing."""
    monkeypatch.setattr("effectfence.mcp.telemetry.MAX_HELD", 3)
    metrics = Metrics()

    def observe(intent: str, outcome: str, token: int) -> None:
        d = Decision("fence_commit" if outcome == "committed" else "fence_prepare", None)
        d.intent, d.outcome, d.token = intent, outcome, token
        metrics.observe(d)

    for i in range(3):
        observe(f"i{i}", "fresh", i)
    observe("i0", "takeover", 10)  # i0 again: now the newest
    observe("i3", "fresh", 3)  # over the bound: i1, the oldest, is forgotten
    assert metrics.in_flight == 3
    observe("i1", "committed", 1)
    assert metrics.in_flight == 3, "i1 was forgotten already"
    observe("i0", "committed", 0)  # the ticket taken over finishes nothing
    assert metrics.in_flight == 3
    for intent, token in (("i0", 10), ("i2", 2), ("i3", 3)):
        observe(intent, "committed", token)
    assert metrics.in_flight == 0


async def test_the_in_flight_gauge_lets_go_of_a_cleared_ticket() -> None:
    """A ticket whose record fence_clear removed can never finish, and the gauge counted it
    for ever (found by review). It ends with the clear; one cleared elsewhere (the console,
    the library) ends when its holder is refused lease_lost; the lease_lost of a ticket
    taken over leaves the new holder's counted."""
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=5.0, clock=clock, auto_sweep=False))
    metrics = Metrics()
    async with connect(build_server(fence, metrics=metrics, allow_clear=True)) as client:
        ok(await prepare(client, intent="charge:1"))
        assert metrics.in_flight == 1
        args = {"intent": "charge:1", "reason": "stuck", "force": True}
        ok(await client.call_tool("fence_clear", args))
        assert metrics.in_flight == 0
        two = ok(await prepare(client, intent="charge:2"))["prepared"]
        assert fence.clear_intent("charge:2")  # cleared elsewhere
        assert metrics.in_flight == 1
        refusal(await client.call_tool("fence_release", {"prepared": two}), "lease_lost")
        assert metrics.in_flight == 0
        old = ok(await prepare(client, intent="charge:3"))["prepared"]
        clock.advance(6)
        ok(await prepare(client, intent="charge:3", agent="b"))  # takes it over
        refusal(await client.call_tool("fence_release", {"prepared": old}), "lease_lost")
        assert metrics.in_flight == 1, "the takeover's ticket is still held"


async def test_a_ticket_replayed_after_a_takeover_is_refused_lease_lost() -> None:
    clock = FakeClock()
    fence = EffectFence(FenceConfig(lease_ttl=5.0, clock=clock, auto_sweep=False))
    async with connect(build_server(fence)) as client:
        old = ok(await prepare(client, agent="slow"))
        clock.advance(6)  # the lease lapses
        lapsed = ok(await client.call_tool("fence_status", {"intent": "charge:1"}))
        assert lapsed["state"] == "in_flight_lapsed"
        new = ok(await prepare(client, agent="fast"))
        assert new["status"] == "fresh" and new["takeover"] is True
        assert new["token"] > old["token"]
        before = snapshot(fence, "charge:1")
        for tool, extra in (
            ("fence_commit", {"result": "stale"}),
            ("fence_abort", {"reason": "stale"}),
            ("fence_release", {}),
            ("fence_renew", {}),
        ):
            payload = refusal(
                await client.call_tool(tool, {"prepared": old["prepared"], **extra}), "lease_lost"
            )
            assert payload["details"]["holder"] == "fast"
            assert snapshot(fence, "charge:1") == before
        cert = ok(
            await client.call_tool("fence_commit", {"prepared": new["prepared"], "result": 1})
        )
        assert cert["cert"]["agent"] == "fast"
        # and after the commit, the winner's own ticket is spent too
        refusal(
            await client.call_tool("fence_commit", {"prepared": new["prepared"], "result": 2}),
            "lease_lost",
        )


async def test_servers_sharing_a_ticket_key_accept_each_others_tickets() -> None:
    key = b"shared-secret-key-0123456789"
    a = build_server(EffectFence(), signer=TicketSigner(key))
    b = build_server(EffectFence(), signer=TicketSigner(key))
    c = build_server(EffectFence())
    async with connect(a) as ca, connect(b) as cb, connect(c) as cc:
        ticket = ok(await prepare(ca))["prepared"]
        # same key: authenticated, judged by b's own (empty) store
        refusal(await cb.call_tool("fence_commit", {"prepared": ticket, "result": 1}), "lease_lost")
        refusal(
            await cc.call_tool("fence_commit", {"prepared": ticket, "result": 1}), "invalid_ticket"
        )


# -- bad input ---------------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


BAD_PREPARES: dict[str, dict[str, Any]] = {
    "missing intent": {k: v for k, v in req().items() if k != "intent"},
    "missing args": {k: v for k, v in req().items() if k != "args"},
    "intent not a string": req(intent=7),
    "empty intent": req(intent=""),
    "huge intent": req(intent="i" * 10_000),
    "args not an object": req(args=[1, 2]),
    "args a JSON string": req(args='{"cents": 500}'),
    "unknown field": {**req(), "priority": "high"},
    "nested under a name": {"request": req()},
    "bool for int": req(expected_seq=True),
    "string for int": req(expected_seq="3"),
    "negative seq": req(expected_seq=-1),
    "seq too large": req(expected_seq=2**64),
    "float seq": req(expected_seq=1.5),
    "NaN in args": req(args={"x": float("nan")}),
    "infinity in args": req(args={"x": float("inf")}),
    "huge int in args": req(args={"x": 2**80}),
    "non-string key in args": req(args={1: "x"}),
    "deep nesting": req(args={"x": _nested(200)}),
    "oversized args": req(args={"x": "y" * (2 << 20)}),
    "bad read_set entry": req(read_set=[["d"]]),
    "read_set seq string": req(read_set=[["d", "1"]]),
    "read_set unknown key": req(read_set=[{"domain": "d", "seq": 1, "x": 1}]),
    "known_clock non-int": req(known_clock={"a": "1"}),
    "known_clock negative": req(known_clock={"a": -1}),
    "empty parent": req(parent=""),
    # written into the certificate as given, it broke the domain's trail for good
    "parent not a hash": req(parent="oops-not-a-hash"),
    "parent in capitals": req(parent="AB" * 32),
    "parent too short": req(parent="0" * 63),
}


@pytest.mark.parametrize("case", sorted(BAD_PREPARES))
async def test_malformed_prepare_arguments_get_a_clear_error_and_change_nothing(case: str) -> None:
    # Called on the server directly, so values JSON cannot carry (NaN, a non-string key)
    # arrive exactly; the in-memory client would normalize them (NaN -> null) on the way.
    fence = EffectFence()
    server = build_server(fence)
    before = snapshot(fence, "charge:1")
    result = await server.call_tool("fence_prepare", BAD_PREPARES[case])
    assert isinstance(result, CallToolResult)
    payload = refusal(result, "invalid_request")
    assert payload["message"] and payload["recover"]
    assert snapshot(fence, "charge:1") == before
    assert fence.stats()["prepare"]["admitted"] == 0
    if "errors" in payload["details"]:  # pydantic-level: names fields, never echoes values
        assert all({"field", "problem", "type"} == set(e) for e in payload["details"]["errors"])
        assert "tok_visa" not in payload["message"]


_ONE_CERT = EffectCert(
    intent="i", parent=None, domain="d", seq=1, tool="t", args={}, result=None,
    vector_clock={}, read_set=[], agent="a",
).to_dict()  # fmt: skip


async def test_malformed_commit_arguments_leave_the_ticket_usable() -> None:
    fence = EffectFence()
    server = build_server(fence)
    async with connect(server) as client:
        ticket = ok(await prepare(client))["prepared"]
        before = snapshot(fence, "charge:1")
        bad_commits: list[dict[str, Any]] = [
            {"prepared": ticket},  # missing result
            {"result": 1},  # missing ticket
            {"prepared": ticket, "result": 1, "extra": True},
            {"prepared": 5, "result": 1},
            {"prepared": ticket, "result": float("nan")},
            {"prepared": ticket, "result": {"x": float("-inf")}},
            {"prepared": ticket, "result": _nested(200)},
            {"prepared": ticket, "result": "z" * (2 << 20)},
            {"prepared": ticket, "result": {1: "non-string key"}},
        ]
        for args in bad_commits:
            result = await server.call_tool("fence_commit", args)
            refusal(result, "invalid_request")  # type: ignore[arg-type]
            assert snapshot(fence, "charge:1") == before, args
        for tool, args in (
            ("fence_abort", {"prepared": ticket, "reason": ""}),
            ("fence_abort", {"prepared": ticket, "reason": 3}),
            ("fence_renew", {"prepared": ticket, "ttl": -1}),
            ("fence_renew", {"prepared": ticket, "ttl": "10"}),
            ("fence_status", {}),
            ("fence_status", {"intent": ""}),
            ("fence_stats", {"verbose": True}),
            ("fence_verify", {}),
            ("fence_verify", {"cert": {"hash": "x"}}),
            # longer than one call checks on the server's loop (review): the CLI's work
            ("fence_verify", {"chain": [_ONE_CERT] * (MAX_VERIFY_CHAIN + 1)}),
        ):
            refusal(await client.call_tool(tool, args), "invalid_request")
            assert snapshot(fence, "charge:1") == before, (tool, args)
        ok(await client.call_tool("fence_commit", {"prepared": ticket, "result": {"ok": True}}))


# -- queries ------------------------------------------------------------------------------------


async def test_status_never_creates_state() -> None:
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        for i in range(50):
            st = ok(await client.call_tool("fence_status", {"intent": f"nobody:{i}"}))
            assert st == {"intent": f"nobody:{i}", "state": "absent"}
    assert fence.stats()["size"]["records"] == 0
    assert fence.stats()["attempts"] == 0


async def test_stats_report_buckets_backend_and_config() -> None:
    fence = EffectFence()
    async with connect(build_server(fence)) as client:
        ok(await prepare(client))
        refusal(await prepare(client, agent="b"), "intent_in_flight")
        stats = ok(await client.call_tool("fence_stats", {}))
    assert stats["attempts"] == 2
    assert stats["prepare"]["admitted"] == 1 and stats["prepare"]["intent_in_flight"] == 1
    assert stats["counters"] in ("atomic", "pure")
    assert stats["counters_info"]["backend"] == stats["counters"]
    assert stats["server"]["clear_enabled"] is False
    assert stats["events"]["commits"] == 0
    assert stats["size"]["records"] == 1
    assert stats["store_info"]["store"] == "memory"


async def test_stats_say_whether_the_store_keeps_what_it_acknowledged() -> None:
    """The docs promised the store's durability in the server's stats; fence_stats left
    it out (found by review). On Redis it is the persistence settings and their verdict."""
    need("redis")
    prefix = unique_name("t")
    fence = EffectFence.from_url(f"{REDIS_URL}?prefix={prefix}")
    try:
        async with connect(build_server(fence)) as client:
            info = ok(await client.call_tool("fence_stats", {}))["store_info"]
    finally:
        fence.close()
        drop_redis_prefix(prefix)
    assert info["store"] == "redis"
    assert info["durability"] == fence.store.durability()
    assert "verdict" in info["durability"] and "appendonly" in info["durability"]


async def test_verify_detects_tampering_and_broken_chains() -> None:
    async with connect(build_server()) as client:
        certs = []
        for i in range(3):
            t = ok(await prepare(client, intent=f"step:{i}"))["prepared"]
            done = ok(await client.call_tool("fence_commit", {"prepared": t, "result": i}))
            certs.append(done["cert"])
        assert certs[1]["parent"] == certs[0]["hash"]
        chain = ok(await client.call_tool("fence_verify", {"chain": certs}))
        assert chain["ok"] is True and chain["length"] == 3
        tampered = {**certs[1], "result": 999}
        one = ok(await client.call_tool("fence_verify", {"cert": tampered}))
        assert one["ok"] is False and one["recorded"] is False
        broken = ok(
            await client.call_tool("fence_verify", {"chain": [certs[0], tampered, certs[2]]})
        )
        assert broken["ok"] is False and broken["broken_at"] == 1
        skipped = ok(await client.call_tool("fence_verify", {"chain": [certs[0], certs[2]]}))
        assert skipped["ok"] is False and skipped["broken_at"] == 1
        both = await client.call_tool("fence_verify", {"cert": certs[0], "chain": certs})
        refusal(both, "invalid_request")


async def test_verify_judges_a_chain_as_the_trail_check_does() -> None:
    """fence_verify called certificates of two domains, and one certificate twice, a sound
    chain, which ``certs --verify`` refused (found by review); and it refused a genuine,
    recorded certificate whose args held 1e16, once a client's JSON parser had read the
    canonical ``10000000000000000`` back as an int."""
    import json

    from effectfence.canonical import canonical_bytes
    from effectfence.operator.trail import check_trail

    async with connect(build_server()) as client:
        certs = []
        for i, domain in enumerate(("order:1", "order:2")):
            t = ok(await prepare(client, intent=f"pay:{i}", domain=domain))["prepared"]
            done = ok(await client.call_tool("fence_commit", {"prepared": t, "result": i}))
            certs.append(done["cert"])
        for chain, why in (
            ([certs[0], certs[1]], "belongs to domain 'order:2'"),
            ([certs[0], certs[0]], "not in seq order"),
        ):
            verdict = ok(await client.call_tool("fence_verify", {"chain": chain}))
            assert verdict["ok"] is False and verdict["broken_at"] == 1, verdict
            assert why in verdict["reason"]
            trail = check_trail([EffectCert.from_dict(c) for c in chain])
            assert not trail.ok and why in trail.reason  # one rule, one verdict

        t = ok(await prepare(client, intent="big", domain="order:3", args={"amount": 1e16}))
        done = ok(await client.call_tool("fence_commit", {"prepared": t["prepared"], "result": 1}))
        read_back = json.loads(canonical_bytes(done["cert"]))  # any JSON parser's reading
        assert read_back["args"]["amount"] == 10**16 and type(read_back["args"]["amount"]) is int
        one = ok(await client.call_tool("fence_verify", {"cert": read_back}))
        assert one["ok"] is True and one["recorded"] is True, one
        chain = ok(await client.call_tool("fence_verify", {"chain": [read_back]}))
        assert chain["ok"] is True, chain


async def test_an_idle_server_sweeps_expired_records() -> None:
    # Leases and results are judged by the fence's (fake) clock; only the sweeper's own
    # pace is real time. With real-time TTLs a slow moment between prepare and commit
    # would let the sweeper reclaim the lease first.
    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(result_ttl=10.0, lease_ttl=10.0, sweep_interval=0.05, clock=clock)
    )
    async with connect(build_server(fence)) as client:
        t = ok(await prepare(client, intent="done"))["prepared"]
        ok(await client.call_tool("fence_commit", {"prepared": t, "result": 1}))
        ok(await prepare(client, intent="abandoned"))
        assert fence.stats()["size"]["records"] == 2
        clock.advance(20.0)  # both the result and the abandoned lease are now expired
        with anyio.fail_after(5):
            while fence.stats()["size"]["records"]:
                await anyio.sleep(0.05)
        stats = ok(await client.call_tool("fence_stats", {}))
        assert stats["server"]["idle_sweeps"] >= 1
        assert stats["events"]["reclaimed"] == 2


class _SweepOutageStore(MemoryStore):
    """A memory store whose sweep raises StoreUnavailable while ``down``, as a server
    store's does while it is unreachable."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.down = True
        self.failed = 0
        self.failing = anyio.Event()  # set at the third failed sweep
        self.swept = anyio.Event()  # set at the first sweep once back

    def sweep(self, limit: int | None = None) -> int:
        if self.down:
            self.failed += 1
            if self.failed >= 3:
                self.failing.set()
            raise StoreUnavailable("the test store is down; nothing was decided")
        self.swept.set()
        return super().sweep(limit)


async def test_the_idle_sweeper_survives_a_store_outage_and_logs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An error out of the sweeper once ended the server's lifespan, and with it every
    later call, the store's return notwithstanding."""
    store = _SweepOutageStore(clock=FakeClock())
    fence = EffectFence(FenceConfig(sweep_interval=0.01), store=store)
    with caplog.at_level(logging.WARNING, logger="effectfence.mcp.server"):
        async with connect(build_server(fence)) as client:
            with anyio.fail_after(10):
                await store.failing.wait()
            # still answering during the outage
            assert ok(await client.call_tool("fence_status", {"intent": "x"}))["state"] == "absent"
            store.down = False
            with anyio.fail_after(10):
                await store.swept.wait()
            fresh = ok(await prepare(client))
            ok(await client.call_tool("fence_commit", {"prepared": fresh["prepared"], "result": 1}))
            stats = ok(await client.call_tool("fence_stats", {}))
            assert stats["server"]["idle_sweeps"] >= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "effectfence.mcp.server"]
    assert store.failed >= 3 and len(lines) == 2, lines  # when it failed, when it recovered
    assert lines[0].startswith("idle sweep failed") and "the test store is down" in lines[0]
    assert lines[1] == f"idle sweep recovered after {store.failed} failed attempts"
    assert not any(r.exc_info for r in caplog.records)  # an outage is no bug: no traceback


@pytest.mark.parametrize("freeze", [False, True])
async def test_a_serving_process_freezes_its_startup_heap_once_before_the_first_call(
    monkeypatch: pytest.MonkeyPatch, freeze: bool
) -> None:
    import gc

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    async with connect(build_server(freeze_heap=freeze)) as client:
        assert calls == (["collect", "freeze"] if freeze else [])
        ok(await prepare(client, intent="after the freeze"))
    assert calls == (["collect", "freeze"] if freeze else [])


# -- the command line ---------------------------------------------------------------------------


def test_serve_refuses_unknown_stores_without_echoing_credentials(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--store", "mongodb://admin:hunter2@db/fence"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown store scheme" in err and "mongodb://admin:***@db/fence" in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--lease-ttl", "0"],
        ["--result-ttl", "-5"],
        ["--bogus"],
        ["--console"],  # the console is mounted on the HTTP server only
        ["--http", "0", "--show-payload"],  # payloads are the console's, and only with it
        ["--store", ""],  # an unset variable: never the shared default ledger by accident
        ["--store", "  "],
    ],
)
def test_serve_refuses_bad_options(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_serve_that_cannot_open_its_store_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing directory (or an unreachable server) printed a traceback."""
    assert main(["--store", f"sqlite:///{tmp_path}/no-such-dir/fence.db"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("effectfence serve: can't open the store: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_serve_refuses_a_short_ticket_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EFFECTFENCE_TICKET_KEY", "short")
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "EFFECTFENCE_TICKET_KEY" in capsys.readouterr().err


def test_serve_freezes_the_heap_of_the_process_it_runs_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the command freezes: build_server leaves a host process's collector alone."""
    import effectfence.mcp.server as srv

    seen: dict[str, Any] = {}

    class Stub:
        def run(self, transport: str) -> None:
            seen["transport"] = transport

    def build(fence: EffectFence, **kwargs: Any) -> Stub:
        seen.update(kwargs)
        return Stub()

    monkeypatch.setattr(srv, "build_server", build)
    assert srv.main(["--store", "memory:"]) == 0
    assert seen["freeze_heap"] is True and seen["transport"] == "stdio"


@pytest.mark.anyio
async def test_a_prepare_whose_caller_went_away_is_logged_counted_and_released(
    tmp_path: Path,
) -> None:
    """The step of a cancelled call runs on in its worker thread. A fresh prepare was
    claimed for nobody: its ticket never left the server, yet the intent stayed in flight
    until its lease lapsed, and neither the decision log nor the metrics saw it (found by
    review). It is now logged and counted, and released: the effect cannot have run."""
    import threading

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=60))
    metrics = Metrics()
    server = build_server(fence, metrics=metrics)
    entered, go = threading.Event(), threading.Event()
    request = fence.request

    def parked(*a: Any, **kw: Any) -> Any:  # the step waits in its thread until told
        entered.set()
        go.wait(10)
        return request(*a, **kw)

    fence.request = parked  # type: ignore[method-assign]
    try:
        async with Client(server) as client:
            args = {"intent": "p1", "domain": "d", "tool": "t", "args": {}, "agent": "a"}
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.call_tool, "fence_prepare", args)
                    while not entered.is_set():
                        await anyio.sleep(0.01)
                    tg.cancel_scope.cancel()  # the caller goes away mid-step
            go.set()
            with anyio.fail_after(10):
                while metrics.calls.get(("fence_release", "released")) != 1:
                    await anyio.sleep(0.01)
        assert metrics.calls[("fence_prepare", "fresh")] == 1 and metrics.in_flight == 0
        assert fence.intent_status("p1").state == "absent"
    finally:
        go.set()
        fence.close()


async def test_a_read_never_waits_behind_writes_parked_on_the_store(tmp_path: Path) -> None:
    """Every worker thread parked on a store step (a lock held by another process) kept
    fence_status waiting as long (found by review: 4 s behind 8 parked prepares). Reads
    run on threads of their own."""
    import threading

    from effectfence.driver import OFFLOAD_THREADS

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=60))
    server = build_server(fence, metrics=Metrics())
    parked, go = threading.Semaphore(0), threading.Event()
    request = fence.request

    def blocked(*a: Any, **kw: Any) -> Any:
        parked.release()
        go.wait(20)
        return request(*a, **kw)

    fence.request = blocked  # type: ignore[method-assign]
    try:
        async with Client(server) as client, anyio.create_task_group() as tg:
            for n in range(OFFLOAD_THREADS):
                args = {"intent": f"w{n}", "domain": "d", "tool": "t", "args": {}, "agent": "a"}
                tg.start_soon(client.call_tool, "fence_prepare", args)
            with anyio.fail_after(10):
                for _ in range(OFFLOAD_THREADS):  # every writer thread is parked
                    await anyio.to_thread.run_sync(parked.acquire)
            with anyio.fail_after(5):  # answered while they wait
                status = await client.call_tool("fence_status", {"intent": "w0"})
            assert status.structured_content["state"] == "absent"
            go.set()
    finally:
        go.set()
        fence.close()


def _gone_after_a_fresh_prepare(tools: Any, fence: EffectFence, req: EffectRequest) -> None:
    """On the loop: a fresh prepare whose step finished for a caller gone (after_cancel)."""
    import asyncio

    from effectfence.mcp.telemetry import Decision

    d = Decision("fence_prepare", None)
    d.intent, d.domain = req.intent, req.domain
    d.ticket = fence.prepare(req).ticket
    d.outcome, d.token = "fresh", d.ticket.token
    job = asyncio.get_running_loop().create_future()
    job.set_result(None)
    tools.after_cancel(d, job)


def test_an_undelivered_tickets_release_is_queued_before_a_shutdown_can_cancel_it(
    tmp_path: Path,
) -> None:
    """A fresh ticket whose caller went away is released by the server (after_cancel). The
    release was handed to a task of its own: a shutdown cancelling every task reached it
    before its first step, and the intent stayed held by nobody until its lease lapsed
    (the driver's case, found by review; this one by reading the server after it)."""
    import asyncio

    from effectfence.mcp.server import _FenceTools
    from effectfence.tickets import TicketSigner

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db")
    tools = _FenceTools(
        fence, TicketSigner.for_store(fence.store), False, metrics=Metrics(), authenticated=False
    )
    req = EffectRequest("charge:1", "order:1", "charge", {"cents": 1}, "a")

    async def main() -> None:
        _gone_after_a_fresh_prepare(tools, fence, req)
        for task in asyncio.all_tasks():  # a shutdown, as a SIGTERM handler does
            if task is not asyncio.current_task():
                task.cancel()

    assert _run_then_settle(main, tools, fence, "charge:1") == "absent"


@pytest.mark.parametrize("blips", [1, 3])
def test_an_undelivered_tickets_release_rides_out_a_store_blip(tmp_path: Path, blips: int) -> None:
    """The release of a fresh ticket nobody received had one try: a store blip then left
    the intent held by nobody until its lease lapsed, and identical calls were refused
    intent_in_flight meanwhile (noted by review). It is tried again as the driver settles
    its own, the pauses on a thread of their own, and the release is logged and counted."""
    import asyncio
    import threading

    from effectfence.errors import StoreUnavailable
    from effectfence.mcp.server import _FenceTools
    from effectfence.tickets import TicketSigner

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=60))
    metrics = Metrics()
    tools = _FenceTools(
        fence, TicketSigner.for_store(fence.store), False, metrics=metrics, authenticated=False
    )
    req = EffectRequest("charge:1", "order:1", "charge", {"cents": 1}, "a")
    real, tried, done = fence.release, [], threading.Event()

    def flaky(ticket: Any) -> None:
        tried.append(ticket.token)
        if len(tried) <= blips:
            raise StoreUnavailable("a blip", operation="release")
        real(ticket)

    fence.release = flaky  # type: ignore[method-assign]
    noted = tools._note_release

    def note(d: Any, failed: Any) -> None:
        noted(d, failed)
        done.set()

    tools._note_release = note  # type: ignore[method-assign]

    async def main() -> None:
        _gone_after_a_fresh_prepare(tools, fence, req)
        while not done.is_set():  # noted on the loop, after the last try
            await asyncio.sleep(0.01)

    try:
        asyncio.run(asyncio.wait_for(main(), 20.0))
        assert len(tried) == blips + 1
        assert fence.intent_status("charge:1").state == "absent"
        assert metrics.calls[("fence_release", "released")] == 1
    finally:
        tools.offloader.close()
        fence.close(timeout=0)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_an_undelivered_tickets_release_rides_out_a_store_blip(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The same on trio, where the cancelled call releases in its own task (one try)."""
    from effectfence.errors import StoreUnavailable
    from effectfence.mcp.server import _FenceTools
    from effectfence.mcp.telemetry import Decision
    from effectfence.tickets import TicketSigner

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=60))
    metrics = Metrics()
    tools = _FenceTools(
        fence, TicketSigner.for_store(fence.store), False, metrics=metrics, authenticated=False
    )
    real, tried = fence.release, []

    def flaky(ticket: Any) -> None:
        tried.append(ticket.token)
        if len(tried) == 1:
            raise StoreUnavailable("a blip", operation="release")
        real(ticket)

    fence.release = flaky  # type: ignore[method-assign]
    try:
        d = Decision("fence_prepare", None)
        d.intent, d.domain = "charge:1", "order:1"
        d.ticket = fence.prepare(EffectRequest("charge:1", "order:1", "charge", {}, "a")).ticket
        d.outcome, d.token = "fresh", d.ticket.token
        await tools._undelivered(d)
        assert len(tried) == 2 and fence.intent_status("charge:1").state == "absent"
        assert metrics.calls[("fence_release", "released")] == 1
    finally:
        fence.close(timeout=0)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_releases_riding_out_an_outage_hold_up_no_other_step(
    tmp_path: Path, anyio_backend: str
) -> None:
    """On trio the retried releases ran in anyio's shared pool (40 threads), where every
    step of every call runs: 40 cancelled prepares pausing through an outage held up all
    other steps, renewals included (found by review). Each has a limiter of its own."""
    import threading

    import anyio

    from effectfence.errors import StoreUnavailable
    from effectfence.mcp.server import _FenceTools
    from effectfence.mcp.telemetry import Decision
    from effectfence.tickets import TicketSigner

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db", FenceConfig(lease_ttl=60))
    tools = _FenceTools(
        fence, TicketSigner.for_store(fence.store), False, metrics=Metrics(), authenticated=False
    )
    shared = anyio.to_thread.current_default_thread_limiter().total_tokens
    entered, go = threading.Semaphore(0), threading.Event()

    def down(ticket: Any) -> None:  # the store, down until the test lets it be
        entered.release()
        go.wait(30)
        raise StoreUnavailable("down", operation="release")

    fence.release = down  # type: ignore[method-assign]
    try:
        async with anyio.create_task_group() as tg:
            for n in range(int(shared)):
                d = Decision("fence_prepare", None)
                req = EffectRequest(f"c:{n}", "order:1", "charge", {}, "a")
                d.intent, d.domain = req.intent, req.domain
                d.ticket = fence.prepare(req).ticket
                d.outcome, d.token = "fresh", d.ticket.token
                tg.start_soon(tools._undelivered, d)
            with anyio.fail_after(20):
                for _ in range(int(shared)):
                    await anyio.to_thread.run_sync(
                        entered.acquire, limiter=anyio.CapacityLimiter(1)
                    )
            try:
                with anyio.fail_after(5):  # another call's step, while they wait
                    assert await tools.off_loop(lambda: 42) == 42
            finally:
                go.set()
    finally:
        go.set()
        fence.close(timeout=0)


def test_a_prepare_a_shutdown_cancels_in_its_worker_leaves_nothing_held(tmp_path: Path) -> None:
    """The prepare was carried by a task of its own: a shutdown cancelling every task
    cancelled it while the claim went on in its worker, and after_cancel, seeing a cancelled
    task, let the fresh ticket nobody received be: held by nobody until its lease lapsed
    (found by review). The step is a future now, which a shutdown does not cancel."""
    import asyncio
    import contextlib
    import threading

    from effectfence.mcp.models import PrepareInput
    from effectfence.mcp.server import _FenceTools
    from effectfence.mcp.telemetry import Decision
    from effectfence.tickets import TicketSigner

    fence = EffectFence.from_url(f"sqlite:///{tmp_path}/f.db")
    tools = _FenceTools(
        fence, TicketSigner.for_store(fence.store), False, metrics=Metrics(), authenticated=False
    )
    entered, go, claimed = threading.Event(), threading.Event(), threading.Event()
    real = fence.request

    def held_request(*a: Any, **kw: Any) -> Any:
        entered.set()
        assert go.wait(20.0)
        try:
            return real(*a, **kw)
        finally:
            claimed.set()

    fence.request = held_request  # type: ignore[method-assign]
    req = PrepareInput(
        intent="charge:1", domain="order:1", tool="charge", args={"cents": 1}, agent="a"
    )

    async def main() -> None:
        call = asyncio.ensure_future(
            tools.off_loop_to_the_end(tools.prepare, req, Decision("fence_prepare", None))
        )
        async with asyncio.timeout(20.0):
            while not entered.is_set():
                await asyncio.sleep(0.005)
        for task in asyncio.all_tasks():  # a shutdown, as a SIGTERM handler does
            if task is not asyncio.current_task():
                task.cancel()
        go.set()  # the prepare, already in its worker, goes on and claims the intent
        with contextlib.suppress(asyncio.CancelledError):
            await call
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):  # claimed, then released by after_cancel
                while not claimed.is_set() or fence.intent_status("charge:1").state != "absent":
                    await asyncio.sleep(0.01)

    assert _run_then_settle(main, tools, fence, "charge:1") == "absent"


def _run_then_settle(main: Any, tools: Any, fence: EffectFence, intent: str) -> str:
    """``asyncio.run(main())``, then the server's workers closed and waited for (what
    they had queued has run): ``intent``'s state then; the fence closed after."""
    import asyncio
    import threading

    try:
        asyncio.run(main())
        tools.offloader.close()
        for th in threading.enumerate():
            if th.name.startswith("effectfence-mcp"):
                th.join(20.0)
        return fence.intent_status(intent).state
    finally:
        fence.close(timeout=0)


def test_the_request_scope_is_found_through_the_sdks_context_either_way() -> None:
    """The principal comes from the HTTP request's scope. It is read from the private dict
    where pydantic keeps the SDK Context's request context (the property cost ~3 us a
    call); a context without that dict (another SDK or pydantic) goes through the public
    property, and no request at all means no scope."""
    from mcp.server.context import ServerRequestContext
    from mcp.server.mcpserver import Context

    from effectfence.mcp.server import _request_scope

    class Request:
        def __init__(self) -> None:
            self.scope = {"type": "http", "effectfence.principal": "alice"}

    request = Request()

    real = ServerRequestContext(
        session=None,
        lifespan_context=None,
        protocol_version="2025-06-18",
        method="tools/call",
        request=request,
    )
    assert _request_scope(Context(request_context=real)) == request.scope
    assert _request_scope(Context()) is None  # a direct call: no request context
    assert _request_scope(None) is None

    class Plain:  # no pydantic private dict: the public property is asked
        def __init__(self, rc: Any) -> None:
            self._rc = rc

        @property
        def request_context(self) -> Any:
            if self._rc is None:
                raise ValueError("Context is not available outside of a request")
            return self._rc

    assert _request_scope(Plain(real)) == request.scope
    assert _request_scope(Plain(None)) is None


async def test_fence_tools_are_called_directly_and_other_tools_the_sdks_way() -> None:
    """The server answers its fence tools without the SDK's per-call Context and tool
    machinery (benchmarks/bench_mcp.py: ~4% of an HTTP call); a tool someone added to it
    still runs the SDK's way. Fails if an SDK stops routing tools/call through the
    handler the server overrides (every call would then take the slower way)."""
    server = build_server()

    async def added(x: int) -> dict[str, Any]:
        """A tool of the caller's own."""
        return {"x": x}

    server.add_tool(added, name="added")
    async with Client(server) as client:
        fresh = await client.call_tool("fence_prepare", req("direct:1"))
        again = await client.call_tool("fence_prepare", req("direct:1", agent="agent-b"))
        theirs = await client.call_tool("added", {"x": 3})
        bad = await client.call_tool("added", {"x": "three"})
    assert fresh.structured_content is not None and fresh.structured_content["status"] == "fresh"
    assert again.is_error and again.structured_content is not None
    assert again.structured_content["code"] == "intent_in_flight"
    assert theirs.structured_content == {"x": 3} and not theirs.is_error
    assert bad.is_error  # the SDK's own argument validation, unchanged
    assert server.fast_calls == 2  # type: ignore[attr-defined]


async def test_a_fault_in_a_fence_tool_is_an_error_result_its_text_only_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault (not a refusal) inside a fence tool is answered as the SDK answers one: an
    isError result naming the tool, the exception's text kept on the server's log."""
    fence = EffectFence()
    server = build_server(fence)

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("the secret detail")

    fence.request = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="effectfence.mcp.server"):
        async with Client(server) as client:
            result = await client.call_tool("fence_prepare", req("fault:1"))
    assert result.is_error and result.structured_content is None
    assert [c.text for c in result.content] == ["Error executing tool fence_prepare"]  # type: ignore[union-attr]
    assert "the secret detail" in caplog.text and "fence_prepare" in caplog.text


async def test_a_removed_fence_tool_answers_nothing_and_a_replacement_is_called() -> None:
    """The direct calls must follow the tools the server has now: a fence_clear removed
    with remove_tool still cleared a committed intent (whose effect then ran again), and a
    tool put in fence_prepare's place was never called (found by review)."""
    fence = EffectFence()
    server = build_server(fence, allow_clear=True)
    server.remove_tool("fence_clear")
    server.remove_tool("fence_prepare")

    async def fence_prepare(intent: str) -> dict[str, Any]:
        """A caller's own tool under the name."""
        return {"mine": intent}

    server.add_tool(fence_prepare, name="fence_prepare")
    adm = fence.prepare(EffectRequest("pay:1", "acct:1", "pay", {"cents": 5}, "a"))
    assert adm.fresh
    fence.commit(adm.ticket, {"ok": True})
    async with Client(server) as client:
        cleared = await client.call_tool(
            "fence_clear", {"intent": "pay:1", "reason": "should not be reachable"}
        )
        theirs = await client.call_tool("fence_prepare", {"intent": "pay:1"})
        listed = {t.name for t in (await client.list_tools()).tools}
    assert cleared.is_error and "fence_clear" in cleared.content[0].text  # type: ignore[union-attr]
    assert fence.intent_status("pay:1").state == "done"  # not cleared
    assert theirs.structured_content == {"mine": "pay:1"}
    assert "fence_clear" not in listed
    assert server.fast_calls == 0  # type: ignore[attr-defined]
