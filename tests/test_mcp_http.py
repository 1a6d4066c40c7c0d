"""``effectfence serve --http`` as a real subprocess on 127.0.0.1 (an ephemeral port).

Many agents, one fence: principals named by bearer tokens race for one intent, and only
the winner can finish it; requests without a valid token are refused before anything reads
them; DNS-rebinding protection holds; bytes no client would send change nothing; health,
metrics and the decision log say what happened, never with the args.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2 as httpx
import pytest
from mcp import ClientSession
from mcp.server import MCPServer
from mcp_support import HttpServer, child_env, http_server, http_session
from mcp_types import CallToolResult
from starlette.types import ASGIApp
from support import sqlite_path

from effectfence import EffectFence, FenceConfig
from effectfence.errors import StoreUnavailable
from effectfence.mcp.http import (
    Principals,
    build_app,
    check_exposure,
    is_loopback,
    listen_socket,
    parse_bind,
)
from effectfence.mcp.server import HTTP_CLEARER, build_server
from effectfence.mcp.telemetry import Metrics
from effectfence.store.memory import MemoryStore

pytestmark = pytest.mark.anyio

#: a session's opening request, as a raw client sends it
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}

SERVE = [sys.executable, "-m", "effectfence", "serve"]
TOKENS = {
    "alice": "alice-0123456789abcdef-token",
    "bob": "bob-0123456789abcdef-token-x",
}
OTHER_SERVER_TOKEN = "carol-0123456789abcdef-token"
SECRET_ARG = "tok_visa_SECRET_4242"
TIMEOUT = 30
MAX_BODY = 4 * 1024 * 1024  # the SDK's default request body limit
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """One shared server: alice by a plain token, bob by a hashed one."""
    import hashlib

    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    bob = hashlib.sha256(TOKENS["bob"].encode()).hexdigest()
    tokens.write_text(f"# principals\nalice {TOKENS['alice']}\n\nbob sha256:{bob}\n")
    tokens.chmod(0o600)
    with http_server([*SERVE, "--http", "127.0.0.1:0", "--tokens", str(tokens)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, str]]:
    """A server that lets its clients clear (--allow-clear) and mounts the console, on a
    SQLite file this test process opens too, to read the audit trail the server wrote; and
    the store's URL."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("".join(f"{p} {t}\n" for p, t in TOKENS.items()))
    tokens.chmod(0o600)
    store = f"sqlite:///{sqlite_path().lstrip('/')}"
    argv = [*SERVE, "--http", "127.0.0.1:0", "--tokens", str(tokens), "--allow-clear", "--console"]
    with http_server([*argv, "--store", store]) as srv:
        yield srv, store


def req(intent: str, agent: str = "typed-by-caller") -> dict[str, Any]:
    return {
        "intent": intent,
        "domain": "order:1",
        "tool": "charge_card",
        "args": {"cents": 500, "card": SECRET_ARG},
        "agent": agent,
    }


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def code(result: CallToolResult) -> str:
    assert result.is_error and result.structured_content is not None, result
    return str(result.structured_content["code"])


async def state(session: ClientSession, intent: str) -> tuple[Any, ...]:
    st = ok(await session.call_tool("fence_status", {"intent": intent}))
    stats = ok(await session.call_tool("fence_stats", {}))
    return (st.get("state"), st.get("token"), st.get("holder"), stats["size"], stats["events"])


# -- principals -----------------------------------------------------------------------------


async def test_two_principals_race_sixteen_prepares_and_only_the_winner_finishes(
    server: HttpServer,
) -> None:
    async with (
        http_session(server.url, TOKENS["alice"]) as alice,
        http_session(server.url, TOKENS["bob"]) as bob,
    ):
        sessions = {"alice": alice, "bob": bob}
        results: list[tuple[str, CallToolResult]] = []
        go = anyio.Event()

        async def attempt(who: str) -> None:
            await go.wait()  # all 16 start together
            results.append((who, await sessions[who].call_tool("fence_prepare", req("race:1"))))

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(attempt, "alice" if i % 2 else "bob")
            await anyio.sleep(0)
            go.set()
        fresh = [(who, r) for who, r in results if not r.is_error]
        assert len(results) == 16 and len(fresh) == 1
        assert {code(r) for _, r in results if r.is_error} == {"intent_in_flight"}
        winner, won = fresh[0]
        loser = "bob" if winner == "alice" else "alice"
        ticket = ok(won)["prepared"]

        # the other principal holds a genuine ticket string and still cannot use it
        before = await state(sessions[loser], "race:1")
        assert before[0] == "in_flight" and before[2] == winner
        for tool, extra in (
            ("fence_commit", {"result": {"charge": "ch_x"}}),
            ("fence_abort", {"reason": "mine now"}),
            ("fence_release", {}),
            ("fence_renew", {}),
        ):
            refused = await sessions[loser].call_tool(tool, {"prepared": ticket, **extra})
            assert code(refused) == "invalid_ticket", tool
            assert "another principal" in refused.structured_content["message"]  # type: ignore[index]
        assert await state(sessions[loser], "race:1") == before

        # the winner commits; the certificate names its principal, not the typed agent
        cert = ok(
            await sessions[winner].call_tool(
                "fence_commit", {"prepared": ticket, "result": {"charge": "ch_1"}}
            )
        )["cert"]
        assert cert["agent"] == winner and winner in cert["vector_clock"]
        replay = ok(await sessions[loser].call_tool("fence_prepare", req("race:1", loser)))
        assert replay["status"] == "replay" and replay["cert"] == cert


async def test_agent_is_optional_over_authenticated_http(server: HttpServer) -> None:
    async with http_session(server.url, TOKENS["bob"]) as bob:
        arguments = req("noagent:1")
        del arguments["agent"]
        tools = {t.name: t for t in (await bob.list_tools()).tools}
        assert "agent" not in tools["fence_prepare"].input_schema.get("required", [])
        fresh = ok(await bob.call_tool("fence_prepare", arguments))
        cert = ok(await bob.call_tool("fence_commit", {"prepared": fresh["prepared"], "result": 1}))
        assert cert["cert"]["agent"] == "bob"


async def test_requests_without_a_valid_token_are_refused_and_change_nothing(
    server: HttpServer,
) -> None:
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "fence_prepare", "arguments": req("unauth:1")},
    }
    init = INITIALIZE
    async with http_session(server.url, TOKENS["alice"]) as alice:
        before = await state(alice, "unauth:1")
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            for auth in (
                None,
                "Bearer",
                "Bearer wrong-token-0123456789abcdef",
                f"Bearer {OTHER_SERVER_TOKEN}",  # valid at another server, not here
                f"Basic {TOKENS['alice']}",
                f"Bearer sha256:{'0' * 64}",
                TOKENS["alice"],  # no scheme
            ):
                headers = dict(MCP_HEADERS)
                if auth is not None:
                    headers["Authorization"] = auth
                for body in (init, call):
                    r = await http.post(server.url, json=body, headers=headers)
                    assert r.status_code == 401, (auth, r.status_code, r.text)
                    assert r.headers["www-authenticate"].startswith("Bearer")
                    assert TOKENS["alice"] not in r.text
                r = await http.get(server.base + "/metrics", headers=headers)
                assert r.status_code == 401
            health = await http.get(server.base + "/healthz")
            assert health.status_code == 200 and health.json() == {"ok": True, "store": "memory"}
        assert await state(alice, "unauth:1") == before
        assert before[0] == "absent"


def test_a_non_loopback_bind_without_tokens_is_refused_at_start() -> None:
    for bind in ("0.0.0.0:0", "[::]:0", "192.0.2.7:8080", "example.com:80"):
        proc = subprocess.run(
            [*SERVE, "--http", bind],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=child_env(),
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 2, (bind, proc.stderr)
        assert "refusing to serve on" in proc.stderr and "--tokens FILE" in proc.stderr
        assert "listening" not in proc.stderr


def test_a_wildcard_bind_names_an_address_that_answers(tmp_path: Path) -> None:
    """Bound to 0.0.0.0, the listening line gave http://0.0.0.0:PORT/mcp, a URL that is
    answered 421, and nothing said that a wildcard answers only loopback names and
    --allow-host ones (found by a docs trial: the README's remote examples all got 421).
    The line names the loopback URL, which answers, and says what to add."""

    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKENS['alice']}\n")
    tokens.chmod(0o600)
    argv = [*SERVE, "--http", "0.0.0.0:0", "--tokens", str(tokens), "--store", "memory:"]
    with http_server(argv) as srv:
        line = json.loads(next(x for x in srv.lines if '"listening"' in x))
        assert srv.url.startswith("http://127.0.0.1:") and "--allow-host" in line["note"]
        health = srv.url.rsplit("/", 1)[0] + "/healthz"
        assert httpx.get(health, timeout=TIMEOUT).status_code == 200
    with http_server([*argv, "--allow-host", "fence.internal"]) as srv:
        line = json.loads(next(x for x in srv.lines if '"listening"' in x))
        assert "note" not in line  # the operator named the hosts
    # other spellings of the wildcard bind every address too (noted by review)
    from effectfence.binding import is_wildcard

    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "::0", "[::]", "0"))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "::1", "fence.internal", "10.0.0.1"))
    spelled = [*SERVE, "--http", "0:0", "--tokens", str(tokens), "--store", "memory:"]
    with http_server(spelled) as srv:
        line = json.loads(next(x for x in srv.lines if '"listening"' in x))
        assert srv.url.startswith("http://127.0.0.1:") and "--allow-host" in line["note"]


def test_bind_and_exposure_rules() -> None:
    assert parse_bind("8080") == ("127.0.0.1", 8080)
    assert parse_bind("0.0.0.0:1") == ("0.0.0.0", 1)
    assert parse_bind("[::1]:9") == ("::1", 9)
    for bad in ("", "x", "host:", "host:70000", "[::1]9", ":80"):
        with pytest.raises(ValueError):
            parse_bind(bad)
    check_exposure("127.0.0.1", None)
    check_exposure("localhost", None)
    check_exposure("::1", None)
    principals = Principals.parse(f"alice {TOKENS['alice']}")
    check_exposure("0.0.0.0", principals)
    with pytest.raises(ValueError, match="refusing to serve"):
        check_exposure("0.0.0.0", None)


def test_both_servers_judge_a_bind_by_one_rule() -> None:
    """serve --http and the console decide "needs tokens" by the same rule: they had a
    copy each, and the MCP server's took "[::1]" and "LOCALHOST" for remote addresses."""
    from effectfence.operator import console

    loopback = ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST")
    remote = ("0.0.0.0", "::", "10.0.0.1", "[2001:db8::1]", "fence.internal", "localhost.evil")
    for judge in (is_loopback, console.is_loopback):
        assert all(judge(h) for h in loopback), judge.__module__
        assert not any(judge(h) for h in remote), judge.__module__
    for h in loopback:
        check_exposure(h, None)
        console.check_bind(h, None)
    for h in remote:
        with pytest.raises(ValueError, match="refusing to serve"):
            check_exposure(h, None)
        with pytest.raises(ValueError, match="refusing to serve"):
            console.check_bind(h, None)


def test_serve_refused_for_a_port_in_use_makes_no_store(tmp_path: Path) -> None:
    """It opened the store before it listened: refused, it left a whole store file (the
    default ledger's directory too, with no --store; found by review)."""
    import os

    taken = listen_socket("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        env = {**os.environ, "EFFECTFENCE_STORE": "", "XDG_STATE_HOME": str(tmp_path / "state")}
        for store in ([], ["--store", f"sqlite:///{tmp_path.as_posix().lstrip('/')}/r.db"]):
            out = subprocess.run(
                [*SERVE, *store, "--http", f"127.0.0.1:{port}"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            assert out.returncode == 1 and "cannot listen on" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr
    finally:
        taken.close()
    assert list(tmp_path.iterdir()) == []


def test_tokens_file_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Principals.parse(f"alice {TOKENS['alice']}\n# c\n\nbob sha256:{'a' * 64}\n")
    assert p.names == {"alice", "bob"} and "alice-0123" not in repr(p)
    assert p.authenticate(f"Bearer {TOKENS['alice']}") == "alice"
    assert p.authenticate(f"bearer {TOKENS['alice']}") == "alice"
    assert p.authenticate(f"Bearer {TOKENS['alice']}x") is None
    assert p.authenticate(None) is None
    for bad, why in (
        ("", "no tokens"),
        ("alice short", "at least 16"),
        ("alice", "expected 'principal token'"),
        (f"al ice {TOKENS['alice']}", "expected"),
        (f"-x {TOKENS['alice']}", "a principal is"),
        ("alice sha256:abc", "64 lowercase hex"),
        (f"alice {TOKENS['alice']}\nbob {TOKENS['alice']}", "another principal"),
    ):
        with pytest.raises(ValueError, match=why):
            Principals.parse(bad)
    # a hash's label in another spelling: read as a plain token, the hash itself logged in
    # (found by review); refused at load, naming the label and never the hash
    labels = ("SHA256:", "Sha256:", "sha-256:", "{SHA256}", "sha_256=", "sha256-", "SHA256-")
    for label in (*labels, "sha256_", "sha256/", "SHA2-256:", "sha-2-256:"):
        with pytest.raises(ValueError, match="written sha256:") as raised:
            Principals.parse(f"alice {label}{'b' * 64}")
        assert "b" * 16 not in str(raised.value)
    # the message quotes the label alone: what follows it may be the secret itself, and
    # the message reaches stderr and the SIGHUP reload's log line (found by review)
    secret = "Zq8vK2pLx9Wm4Tn7Rb"
    for token in (f"sha256-{secret}:v2", f"{{SHA256}}{secret}:x", f"sha-256={secret}"):
        with pytest.raises(ValueError, match="written sha256:") as raised:
            Principals.parse(f"alice {token}")
        assert secret[:4] not in str(raised.value), raised.value
    # 64 hex digits anywhere in a plain token: a hash pasted some other way, warned of
    assert Principals.parse(f"alice x{'c' * 64}").hash_like == ("tokens:1",)
    bom = tmp_path / "tokens-with-bom"
    bom.write_text(f"\ufeffalice {TOKENS['alice']}\n", encoding="utf-8")
    bom.chmod(0o600)
    assert Principals.load(bom).authenticate(f"Bearer {TOKENS['alice']}") == "alice"
    hashed = tmp_path / "hash-pasted-without-prefix"
    hashed.write_text(f"alice {'a' * 64}\nbob {TOKENS['alice']}\n")
    hashed.chmod(0o600)
    assert Principals.load(hashed).hash_like == (f"{hashed}:1",)
    assert "64 hex digits" in capsys.readouterr().err
    missing = tmp_path / "nope"
    proc = subprocess.run(
        [*SERVE, "--http", "0", "--tokens", str(missing)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=child_env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2 and "cannot read the tokens file" in proc.stderr


def _event(srv: HttpServer, name: str, after: int) -> dict[str, Any]:
    """The first ``name`` event the server logged after line ``after`` (bounded wait)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for line in srv.lines[after:]:
            if f'"{name}"' in line:
                found: dict[str, Any] = json.loads(line)
                return found
        time.sleep(0.02)
    raise AssertionError(f"no {name} event: {srv.lines[-10:]}")


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX's")
def test_sighup_reloads_the_tokens_and_a_file_that_does_not_parse_changes_nothing(
    tmp_path: Path,
) -> None:
    """An operator rotates or revokes a token without restarting the server (and dropping
    every agent's session): rewrite the file, send SIGHUP."""
    tokens = tmp_path / "tokens"
    old, new = TOKENS["alice"], "alice-rotated-fedcba9876543210"
    tokens.write_text(f"alice {old}\n")
    tokens.chmod(0o600)
    with http_server([*SERVE, "--http", "127.0.0.1:0", "--tokens", str(tokens)]) as srv:

        def status(token: str) -> int:
            auth = {"Authorization": f"Bearer {token}"}
            return httpx.get(srv.base + "/metrics", headers=auth, timeout=TIMEOUT).status_code

        assert (status(old), status(new)) == (200, 401)
        tokens.write_text(f"alice {new}\nbob sha256:{'b' * 64}\n")
        seen = len(srv.lines)
        srv.proc.send_signal(signal.SIGHUP)
        assert _event(srv, "tokens_reloaded", seen) == {
            "event": "tokens_reloaded",
            "tokens": 2,
            "principals": 2,
        }
        assert (status(old), status(new)) == (401, 200), "the revoked token still works"
        tokens.write_text("alice short\n")
        seen = len(srv.lines)
        srv.proc.send_signal(signal.SIGHUP)
        failed = _event(srv, "tokens_reload_failed", seen)
        assert "at least 16" in failed["error"] and failed["kept"] == 2
        assert (status(old), status(new)) == (401, 200)
        assert srv.proc.poll() is None  # a bad file never stops the server


@pytest.mark.parametrize("how", ["emptied", "commented out", "deleted", "unreadable"])
def test_a_reload_that_finds_no_token_revokes_every_token(tmp_path: Path, how: str) -> None:
    """Revoking the last token is the revocation that matters most: a file that names no
    token (or is gone) names nobody, instead of keeping the tokens it no longer lists."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKENS['alice']}\n")
    principals = Principals.load(tokens)
    bearer = f"Bearer {TOKENS['alice']}"
    assert principals.authenticate(bearer) == "alice"
    if how == "emptied":
        tokens.write_text("")
    elif how == "commented out":
        tokens.write_text(f"# alice {TOKENS['alice']}\n")
    elif how == "deleted":
        tokens.unlink()
    else:  # a directory in its place: unreadable, even to root
        tokens.unlink()
        tokens.mkdir()
    said = principals.reload()
    assert said["event"] == "tokens_reloaded" and said["tokens"] == 0, said
    assert "refused 401" in said["warning"]
    assert principals.authenticate(bearer) is None
    if tokens.is_dir():
        tokens.rmdir()
    tokens.write_text(f"alice {TOKENS['alice']}\n")  # named again: works again
    assert principals.reload()["tokens"] == 1 and principals.authenticate(bearer) == "alice"


# -- the operator's clear over HTTP -------------------------------------------------------------


async def test_clear_over_http_records_the_tokens_principal_and_the_reason(
    operator_server: tuple[HttpServer, str],
) -> None:
    srv, store = operator_server
    fence = EffectFence.from_url(store, FenceConfig())
    try:
        async with (
            http_session(srv.url, TOKENS["alice"]) as alice,
            http_session(srv.url, TOKENS["bob"]) as bob,
        ):
            held = ok(await alice.call_tool("fence_prepare", req("clear:1")))
            before = await state(bob, "clear:1")
            for arguments, refused in (
                ({"intent": "clear:1"}, "invalid_request"),
                ({"intent": "clear:1", "reason": ""}, "invalid_request"),
                ({"intent": "clear:1", "reason": "stuck?"}, "intent_in_flight"),
                ({"intent": "clear:1", "reason": "stuck?", "force": False}, "intent_in_flight"),
            ):
                assert code(await bob.call_tool("fence_clear", arguments)) == refused, arguments
            assert await state(bob, "clear:1") == before and fence.audit("clear:1") == []

            why = "alice's worker host was replaced; the charge never left"
            forced = ok(
                await bob.call_tool(
                    "fence_clear", {"intent": "clear:1", "reason": why, "force": True}
                )
            )
            [entry] = fence.audit("clear:1")
            assert (entry.who, entry.reason, entry.forced) == ("bob (mcp)", why, True)
            assert entry.previous["holder"] == "alice" and entry.previous["state"] == "in_flight"
            assert forced["audit_id"] == entry.id and forced["who"] == "bob (mcp)"
            commit = {"prepared": held["prepared"], "result": 1}
            assert code(await alice.call_tool("fence_commit", commit)) == "lease_lost"

            # a failed intent needs no force; the caller cannot name someone else
            t = ok(await alice.call_tool("fence_prepare", req("clear:2")))["prepared"]
            ok(await alice.call_tool("fence_abort", {"prepared": t, "reason": "timeout"}))
            impostor = {"intent": "clear:2", "reason": "x", "who": "root"}
            assert code(await alice.call_tool("fence_clear", impostor)) == "invalid_request"
            out = ok(await alice.call_tool("fence_clear", {"intent": "clear:2", "reason": "ok"}))
            assert out["who"] == "alice (mcp)" and out["forced"] is False
            [entry] = fence.audit("clear:2")
            assert (entry.who, entry.reason, entry.previous["failure"]) == (
                "alice (mcp)",
                "ok",
                "timeout",
            )
    finally:
        fence.close()


async def test_clear_over_http_without_tokens_names_the_transport() -> None:
    with http_server([*SERVE, "--http", "127.0.0.1:0", "--allow-clear"]) as srv:
        async with http_session(srv.url) as session:
            t = ok(await session.call_tool("fence_prepare", req("clear:1")))["prepared"]
            ok(await session.call_tool("fence_abort", {"prepared": t}))
            out = ok(
                await session.call_tool("fence_clear", {"intent": "clear:1", "reason": "checked"})
            )
    assert out["who"] == HTTP_CLEARER == "mcp client (http, no token)"


# -- the console on the server (--console) ----------------------------------------------------

COUNTERS = ("attempts", "admitted", "replayed", "commits", "aborts")


def _listening(srv: HttpServer) -> dict[str, Any]:
    """The line the server wrote once listening."""
    return next(json.loads(x) for x in srv.lines if '"listening"' in x)


def _counters(stats: dict[str, Any]) -> dict[str, int]:
    """fence_stats' answer, as the console's series name its counters."""
    prepare, events = stats["prepare"], stats["events"]
    return {
        "attempts": stats["attempts"],
        "admitted": prepare["admitted"],
        "replayed": prepare["replayed"],
        "commits": events["commits"],
        "aborts": events["aborts"],
    }


async def _sample_after(
    http: httpx.AsyncClient, base: str, auth: dict[str, str], after: float
) -> dict[str, Any]:
    """The first sample the server's sampler took after ``after`` (its clock: time.time)."""
    with anyio.fail_after(TIMEOUT):
        while True:
            r = await http.get(base + "/console/api/stats", headers=auth)
            assert r.status_code == 200, r.text
            data = r.json()
            assert set(COUNTERS) <= set(data["series"])
            later = [p for p in data["samples"] if p["t"] > after]
            if later:
                return later[0]
            await anyio.sleep(0.2)


async def test_console_is_not_mounted_without_the_flag(server: HttpServer) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
        for path in ("/console", "/console/", "/console/api/stats", "/console/login"):
            assert (await http.get(server.base + path, headers=auth)).status_code == 404, path
            assert (await http.get(server.base + path)).status_code == 401, path
        assert "console" not in _listening(server)


async def test_console_on_the_server_needs_its_tokens(
    operator_server: tuple[HttpServer, str],
) -> None:
    srv, _ = operator_server
    console = srv.base + "/console"
    assert _listening(srv)["console"] == console + "/"
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        for auth in (None, "Bearer wrong-token-0123456789abcdef", f"Bearer {OTHER_SERVER_TOKEN}"):
            headers = {} if auth is None else {"Authorization": auth}
            for path in ("/api/stats", "/api/intents", "/api/intent?id=x"):
                r = await http.get(console + path, headers=headers)
                assert r.status_code == 401, (auth, path)
            r = await http.post(console + "/api/clear", json={"intent": "x"}, headers=headers)
            assert r.status_code == 401
            r = await http.get(console + "/", headers=headers)
            assert r.status_code == 303 and r.headers["location"] == "/console/login"
        login = await http.get(console + "/login")
        assert login.status_code == 200 and "action='/console/login'" in login.text
        assert login.headers["content-security-policy"].startswith("default-src 'none'")
        assert login.headers["x-content-type-options"] == "nosniff"
        # the same hosts as /mcp; a login from another site's page is refused
        r = await http.get(console + "/", headers={"Host": "evil.example"})
        assert r.status_code == 421
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        r = await http.post(
            console + "/login",
            content=f"token={TOKENS['bob']}",
            headers={**form, "Origin": "http://evil.example"},
        )
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = await http.post(console + "/login", content="token=not-a-token-000000", headers=form)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        # a token logs the browser in: a session cookie for its own path below /console
        r = await http.post(console + "/login", content=f"token={TOKENS['bob']}", headers=form)
        home = r.headers["location"]
        assert r.status_code == 303 and home.startswith("/console/s/") and home.endswith("/")
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and f"Path={home}" in cookie
        session = {"Cookie": cookie.split(";")[0]}
        page = await http.get(srv.base + home, headers=session)
        assert page.status_code == 200 and "signed in as bob" in page.text
        assert f'const BASE="{home[:-1]}"' in page.text
        assert (await http.get(console + "/", headers=session)).status_code == 303
        # the cookie is the console's: it opens nothing else
        assert (await http.get(srv.base + "/metrics", headers=session)).status_code == 401
        # bodies are bounded before anything reads them
        big = {"Authorization": f"Bearer {TOKENS['bob']}", "Content-Type": "application/json"}
        r = await http.post(console + "/api/clear", content=b"x" * (65 * 1024), headers=big)
        assert r.status_code == 413


async def test_console_charts_the_servers_fence_stats_and_clears_as_the_principal(
    operator_server: tuple[HttpServer, str],
) -> None:
    """What the brief of the console on the server is: the counters fence_stats reports,
    sampled while it runs, moving with real prepares and commits over MCP."""
    srv, store = operator_server
    auth = {"Authorization": f"Bearer {TOKENS['bob']}"}
    fence = EffectFence.from_url(store, FenceConfig())
    try:
        async with (
            http_session(srv.url, TOKENS["alice"]) as alice,
            httpx.AsyncClient(timeout=TIMEOUT) as http,
        ):
            before = _counters(ok(await alice.call_tool("fence_stats", {})))
            t = ok(await alice.call_tool("fence_prepare", req("chart:1")))["prepared"]
            ok(await alice.call_tool("fence_commit", {"prepared": t, "result": {"ch": 1}}))
            assert ok(await alice.call_tool("fence_prepare", req("chart:1")))["status"] == "replay"
            t = ok(await alice.call_tool("fence_prepare", req("chart:2")))["prepared"]
            ok(await alice.call_tool("fence_abort", {"prepared": t, "reason": "timeout"}))
            stats = ok(await alice.call_tool("fence_stats", {}))
            after = _counters(stats)
            assert {k: after[k] - before[k] for k in COUNTERS} == {
                "attempts": 3,
                "admitted": 2,
                "replayed": 1,
                "commits": 1,
                "aborts": 1,
            }
            point = await _sample_after(http, srv.base, auth, time.time())
            assert {k: point[k] for k in COUNTERS} == after  # the very counters of fence_stats
            assert point["failed"] >= 1

            # the failed intent is listed, without its args; cleared with a reason by bob
            listed = (await http.get(srv.base + "/console/api/intents", headers=auth)).json()
            assert "chart:2" in {r["intent"] for r in listed["intents"]}
            assert SECRET_ARG not in json.dumps(listed)
            clear = {"intent": "chart:2", "reason": "the bank shows no charge"}
            r = await http.post(srv.base + "/console/api/clear", json=clear, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json()["audit"]["who"] == "bob (console)"
            [entry] = fence.audit("chart:2")
            assert (entry.who, entry.reason) == ("bob (console)", "the bank shows no charge")
            assert ok(await alice.call_tool("fence_status", {"intent": "chart:2"}))["state"] == (
                "absent"
            )
    finally:
        fence.close()


async def test_console_without_tokens_is_loopbacks_and_clears_only_with_allow_clear() -> None:
    argv = [*SERVE, "--http", "127.0.0.1:0", "--console"]
    with http_server(argv) as srv:
        console = srv.base + "/console"
        async with (
            http_session(srv.url) as session,
            httpx.AsyncClient(timeout=TIMEOUT) as http,
        ):
            assert "fence_clear" not in {t.name for t in (await session.list_tools()).tools}
            t = ok(await session.call_tool("fence_prepare", req("look:1")))["prepared"]
            ok(await session.call_tool("fence_abort", {"prepared": t}))
            page = await http.get(console + "/intent?id=look%3A1")
            assert page.status_code == 200 and "id=clear-off" in page.text
            assert "id=clear-form" not in page.text and "effectfence intents clear" in page.text
            csrf = page.text.split('"csrf": "')[1].split('"')[0]
            r = await http.post(
                console + "/api/clear",
                json={"intent": "look:1", "reason": "done"},
                headers={"X-EffectFence-CSRF": csrf},
            )
            assert r.status_code == 403 and r.json()["error"] == "clear_disabled"
            status = ok(await session.call_tool("fence_status", {"intent": "look:1"}))
            assert status["state"] == "failed"


# -- transport security and bytes no client would send ---------------------------------------


async def _raw_session(http: httpx.AsyncClient, url: str, token: str) -> dict[str, str]:
    """Initialize a session by hand; the headers every later request carries."""
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {token}"}
    init = INITIALIZE
    r = await http.post(url, json=init, headers=headers)
    assert r.status_code == 200, r.text
    headers["mcp-session-id"] = r.headers["mcp-session-id"]
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    r = await http.post(url, json=note, headers=headers)
    assert r.status_code in (200, 202), r.text
    return headers


async def test_dns_rebinding_protection_stays_on(server: HttpServer) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
        r = await http.post(
            server.url, content=b"{}", headers={**MCP_HEADERS, **auth, "Host": "evil.example"}
        )
        assert r.status_code == 421
        r = await http.post(
            server.url,
            content=b"{}",
            headers={**MCP_HEADERS, **auth, "Origin": "http://evil.example"},
        )
        assert r.status_code == 403
        r = await http.get(server.base + "/metrics", headers={**auth, "Host": "evil.example"})
        assert r.status_code == 421
        r = await http.get(server.base + "/healthz", headers={"Host": "evil.example:80"})
        assert r.status_code == 421


async def test_a_session_is_bound_to_the_principal_that_opened_it(server: HttpServer) -> None:
    """A session id is no credential: bob's own valid token with alice's session id is
    answered as if the session did not exist, and cannot end it."""
    stats_call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "fence_stats", "arguments": {}},
    }
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        alice = await _raw_session(http, server.url, TOKENS["alice"])
        bob = {**alice, "Authorization": f"Bearer {TOKENS['bob']}"}
        r = await http.post(server.url, json=stats_call, headers=bob)
        assert r.status_code == 404, r.text
        assert "attempts" not in r.text
        r = await http.delete(server.url, headers=bob)
        assert r.status_code == 404, r.text
        # alice's session is alive, and alice (only) can end it
        r = await http.post(server.url, json=stats_call, headers=alice)
        assert r.status_code == 200 and "attempts" in r.text, r.text
        assert (await http.delete(server.url, headers=alice)).status_code == 200
        r = await http.post(server.url, json=stats_call, headers=alice)
        assert r.status_code == 404


async def test_an_oversized_body_is_answered_in_json_rpc(server: HttpServer) -> None:
    """A body over the bound got the SDK's plain-text 413, which no MCP client can read as
    an error (found by review); declared or sent chunked, it is now a JSON-RPC error, and
    nothing is decided."""
    async with (
        http_session(server.url, TOKENS["alice"]) as alice,
        httpx.AsyncClient(timeout=TIMEOUT) as http,
    ):
        before = await state(alice, "big:1")
        headers = await _raw_session(http, server.url, TOKENS["alice"])
        call = {
            "jsonrpc": "2.0",
            "id": 9,
            "method": "tools/call",
            "params": {"name": "fence_prepare", "arguments": req("big:1")},
        }
        call["params"]["arguments"]["args"] = {"pad": "x" * MAX_BODY}
        body = json.dumps(call).encode()

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            for i in range(0, len(body), 256 * 1024):
                yield body[i : i + 256 * 1024]

        for content in (body, chunks()):
            r = await http.post(server.url, content=content, headers=headers)
            assert r.status_code == 413, r.text[:200]
            assert r.headers["content-type"].startswith("application/json")
            error = r.json()
            assert error["jsonrpc"] == "2.0" and error["id"] is None
            assert error["error"]["code"] == -32600
            assert f"at most {MAX_BODY} bytes" in error["error"]["message"]
        assert await state(alice, "big:1") == before
        # the session goes on: a call of a sane size is answered
        call["params"]["arguments"]["args"] = {"pad": "x"}
        r = await http.post(server.url, json=call, headers=headers)
        assert r.status_code == 200 and '"fresh"' in r.text, r.text[:200]


def test_a_chunked_body_declaring_a_small_length_is_judged_as_chunked(server: HttpServer) -> None:
    """A body sent chunked with a small Content-Length as well is read by its chunks; the
    gate trusted the length, so past the bound the SDK answered its plain-text 413, which
    no MCP client reads as an error (found by review). It is the JSON-RPC error now."""
    import socket

    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(
            f"POST /mcp HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {TOKENS['alice']}\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Type: application/json\r\n"
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"x" * (1 << 20)
        with contextlib.suppress(OSError):  # the server may answer and close mid-body
            for _ in range(MAX_BODY // len(chunk) + 1):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        got = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                got += data
                if b"\r\n\r\n" in got and b"}" in got.partition(b"\r\n\r\n")[2]:
                    break
    head, _, body = got.partition(b"\r\n\r\n")
    assert b" 413 " in head.split(b"\r\n")[0], head
    assert b"application/json" in head.lower(), (head, body[:80])
    assert json.loads(body.decode())["error"]["code"] == -32600


async def test_one_principal_cannot_take_every_session() -> None:
    """The SDK bounds sessions only all together (10,000, kept 30 minutes idle): one
    principal opening that many locked every other principal out of new sessions (found
    by review). Each principal may hold SESSIONS_PER_PRINCIPAL (here 2); past that a new
    session is refused 429 and nothing else changes, other principals open theirs, and
    ending one makes room."""
    fence = EffectFence()
    principals = Principals.parse(f"alice {TOKENS['alice']}\nbob {TOKENS['bob']}\n")
    app = build_app(
        build_server(fence),
        fence,
        Metrics(),
        host="127.0.0.1",
        principals=principals,
        sessions_per_principal=2,
    )
    async with _in_process(app) as base, httpx.AsyncClient(timeout=TIMEOUT) as http:
        url = base + "/mcp"
        first = await _raw_session(http, url, TOKENS["alice"])
        await _raw_session(http, url, TOKENS["alice"])
        with pytest.raises(AssertionError, match="429"):
            await _raw_session(http, url, TOKENS["alice"])
        r = await http.post(
            url, json={}, headers={**MCP_HEADERS, "Authorization": f"Bearer {TOKENS['alice']}"}
        )
        assert r.status_code == 429 and r.json()["error"] == "too_many_sessions"
        await _raw_session(http, url, TOKENS["bob"])  # bob is not locked out
        assert (await http.delete(url, headers=first)).status_code == 200
        await _raw_session(http, url, TOKENS["alice"])  # room again
    assert fence.stats()["attempts"] == 0


async def test_openings_whose_bodies_come_late_cannot_pass_the_session_cap() -> None:
    """The cap was checked before the body was read, and the SDK registers a session only
    once it has the body: N openings whose bodies all came late each found no session
    and all opened (found by review: 6 with a cap of 2). Here every request that passes
    the gate is held at its body until all N have been judged; only the cap's number open,
    the rest are refused 429."""
    n, cap = 6, 2
    fence = EffectFence()
    server = build_server(fence, authenticated=True)
    app = build_app(
        server,
        fence,
        Metrics(),
        host="127.0.0.1",
        principals=Principals.parse(f"alice {TOKENS['alice']}\n"),
        sessions_per_principal=cap,
    )
    init = json.dumps(INITIALIZE).encode()
    headers = [
        (b"host", b"127.0.0.1:80"),
        (b"accept", b"application/json, text/event-stream"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(init)).encode()),
        (b"authorization", f"Bearer {TOKENS['alice']}".encode()),
    ]
    judged = 0  # requests held at their body, or answered without reading it
    everyone_judged = anyio.Event()
    statuses: list[int] = []
    sessions: list[str] = []

    def one_judged() -> None:
        nonlocal judged
        judged += 1
        if judged == n:
            everyone_judged.set()

    async def opening() -> None:
        read = False

        async def receive() -> dict[str, Any]:
            nonlocal read
            if read:
                await anyio.sleep_forever()
            read = True
            one_judged()
            await everyone_judged.wait()
            return {"type": "http.request", "body": init, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
                if not read:
                    one_judged()  # answered without its body: refused at the gate
                for k, v in message["headers"]:
                    if k == b"mcp-session-id":
                        sessions.append(v.decode())

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/mcp",
            "raw_path": b"/mcp",
            "query_string": b"",
            "root_path": "",
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": headers,
        }
        await app(scope, receive, send)  # type: ignore[arg-type]

    to_app, from_test = anyio.create_memory_object_stream[dict[str, Any]](4)
    started = anyio.Event()

    async def lifespan_send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            app, {"type": "lifespan", "asgi": {"version": "3.0"}}, from_test.receive, lifespan_send
        )
        await to_app.send({"type": "lifespan.startup"})
        with anyio.fail_after(TIMEOUT):
            await started.wait()
            async with anyio.create_task_group() as requests:
                for _ in range(n):
                    requests.start_soon(opening)
                while len(statuses) < n:
                    await anyio.sleep(0.01)  # bounded by fail_after; no outcome hangs on it
                requests.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    assert sorted(statuses) == [200] * cap + [429] * (n - cap), statuses
    assert len(set(sessions)) == cap
    assert fence.stats()["attempts"] == 0


async def test_http_survives_bytes_no_client_would_send(server: HttpServer) -> None:
    """Malformed JSON-RPC, oversized bodies, wrong content types and methods, and a few
    hundred mutations of a real call: each answered (no hang), the server alive, and no
    state changed."""
    async with (
        http_session(server.url, TOKENS["alice"]) as alice,
        httpx.AsyncClient(timeout=TIMEOUT) as http,
    ):
        before = await state(alice, "fuzz:1")
        headers = await _raw_session(http, server.url, TOKENS["alice"])
        status_call = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 7,
                "method": "tools/call",
                "params": {"name": "fence_status", "arguments": {"intent": "fuzz:1"}},
            }
        ).encode()
        prepare_call = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 8,
                "method": "tools/call",
                "params": {"name": "fence_prepare", "arguments": {**req("fuzz:1"), "x": 1}},
            }
        ).encode()
        bodies: list[tuple[bytes, dict[str, str]]] = [
            (b"", headers),
            (b"{", headers),
            (b"null", headers),
            (b"[]", headers),
            (b"[1,2,3]", headers),
            (b'{"jsonrpc":"2.0"}', headers),
            (b'{"jsonrpc":"1.0","id":1,"method":"tools/list"}', headers),
            (b'{"jsonrpc":"2.0","id":{},"method":"tools/call"}', headers),
            (b"[" * 100_000 + b"]" * 100_000, headers),
            (b"\xff\xfe\x00garbage", headers),
            (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"x":NaN}}', headers),
            (prepare_call, headers),  # an unknown field: refused invalid_request, no trace
            (status_call, {**headers, "Content-Type": "text/plain"}),
            (status_call, {**headers, "Content-Type": "application/x-www-form-urlencoded"}),
            (status_call, {k: v for k, v in headers.items() if k != "Content-Type"}),
            (status_call, {**headers, "Accept": "text/html"}),
            (status_call, {**headers, "mcp-session-id": "not-a-session"}),
            (b"x" * (MAX_BODY + 1), headers),
            (b'{"jsonrpc":"2.0","id":1,"method":"ping","pad":"' + b"x" * MAX_BODY + b'"}', headers),
        ]
        rng = random.Random(1313)
        for _ in range(300):
            b = bytearray(status_call)
            for _ in range(rng.randint(1, 4)):
                op = rng.randint(0, 2)
                i = rng.randrange(len(b))
                if op == 0:
                    b[i] = rng.randrange(256)
                elif op == 1:
                    del b[i:]
                    if not b:
                        b = bytearray(b"{")
                else:
                    b[i:i] = bytes([rng.randrange(256)])
            bodies.append((bytes(b), headers))
        statuses: dict[int, int] = {}
        with anyio.fail_after(240):
            for body, h in bodies:
                r = await http.post(server.url, content=body, headers=h)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (body[:80], r.status_code, r.text[:200])
            for method in ("PUT", "PATCH"):
                r = await http.request(method, server.url, headers=headers)
                assert 400 <= r.status_code < 500
        assert statuses.get(413, 0) >= 2  # the oversized bodies
        assert statuses.get(400, 0) + statuses.get(415, 0) > 0
        health = await http.get(server.base + "/healthz")
        assert health.status_code == 200
        assert await state(alice, "fuzz:1") == before


# -- health, metrics, decision log -----------------------------------------------------------


async def test_metrics_and_decision_log(server: HttpServer) -> None:
    async with http_session(server.url, TOKENS["alice"]) as alice:
        t = ok(await alice.call_tool("fence_prepare", req("metrics:1")))["prepared"]
        assert code(await alice.call_tool("fence_prepare", req("metrics:1"))) == (
            "intent_in_flight"
        )
        ok(await alice.call_tool("fence_abort", {"prepared": t, "reason": SECRET_ARG}))
        assert code(await alice.call_tool("fence_prepare", req("metrics:1"))) == "intent_failed"
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        r = await http.get(
            server.base + "/metrics", headers={"Authorization": f"Bearer {TOKENS['bob']}"}
        )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['effectfence_prepare_attempts_total{outcome="intent_failed"}'] >= 1
    assert samples['effectfence_prepare_attempts_total{outcome="admitted"}'] >= 1
    assert samples['effectfence_tool_calls_total{tool="fence_abort",outcome="aborted"}'] >= 1
    assert samples["effectfence_aborts_total"] >= 1
    assert "effectfence_commits_total" in samples and "effectfence_takeovers_total" in samples
    assert "effectfence_in_flight" in samples
    assert samples['effectfence_fence_seconds_count{tool="fence_prepare"}'] >= 3
    assert samples['effectfence_fence_seconds_bucket{tool="fence_prepare",le="+Inf"}'] >= 3

    # one JSON line per decision, with the principal; never the args or the result
    with anyio.fail_after(TIMEOUT):
        while not any(d.get("outcome") == "intent_failed" for d in server.decisions()):
            await anyio.sleep(0.05)
    mine = [d for d in server.decisions() if d["intent"] == "metrics:1"]
    assert [d["outcome"] for d in mine] == ["fresh", "intent_in_flight", "aborted", "intent_failed"]
    for d in mine:
        assert d["principal"] == "alice" and d["domain"] == "order:1"
        assert set(d) >= {"tool", "intent", "domain", "principal", "outcome", "token", "latency_ms"}
    assert mine[0]["token"] == mine[2]["token"] and mine[0]["latency_ms"] >= 0
    assert not any(SECRET_ARG in line for line in server.lines)


@asynccontextmanager
async def _in_process(app: ASGIApp) -> AsyncIterator[str]:
    """``app`` served by uvicorn on 127.0.0.1 in this process, for what a subprocess cannot
    be handed (a failing store, a lifespan that ends); its base URL."""
    import uvicorn

    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    srv = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(srv.serve, [sock])
        with anyio.fail_after(TIMEOUT):
            while not srv.started:
                await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            srv.should_exit = True


async def test_healthz_is_not_ok_once_the_mcp_apps_lifespan_has_ended() -> None:
    """An error in the lifespan's task group (the idle sweeper's, once) ends it and with it
    the SDK's session manager, while uvicorn serves on: /healthz must say so, for a
    supervisor to restart the server, and /mcp answers 503 rather than a traceback."""
    end = anyio.Event()

    @asynccontextmanager
    async def lifespan(_app: MCPServer[None]) -> AsyncIterator[None]:
        async def fail() -> None:
            await end.wait()
            raise StoreUnavailable("the store went away; nothing was decided")

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail)
            yield None

    fence = EffectFence()
    app = build_app(
        MCPServer("ends", lifespan=lifespan), fence, Metrics(), host="127.0.0.1", principals=None
    )
    async with _in_process(app) as base, httpx.AsyncClient(timeout=TIMEOUT) as http:
        health = await http.get(base + "/healthz")
        assert health.status_code == 200 and health.json()["ok"] is True
        await _raw_session(http, base + "/mcp", "no-token-needed-on-loopback")
        end.set()
        with anyio.fail_after(TIMEOUT):
            while (health := await http.get(base + "/healthz")).status_code == 200:
                await anyio.sleep(0.01)
        assert health.status_code == 503
        assert health.json() == {"ok": False, "store": "memory", "error": "mcp_not_serving"}
        r = await http.post(base + "/mcp", json={}, headers=MCP_HEADERS)
        assert r.status_code == 503 and r.json()["error"] == "unavailable"


async def test_a_call_in_progress_when_the_server_is_told_to_stop_gets_its_answer() -> None:
    """SIGTERM lets uvicorn finish the requests in progress, but each call's answer went on
    an SSE stream, which sse-starlette ends the moment the server is told to stop: the
    caller got "stream ended without a response" for a ticket the fence had handed out
    (found by review). Answers are plain JSON now, and finish."""
    import threading

    import uvicorn
    from sse_starlette.sse import AppStatus
    from sse_starlette.sse import _get_shutdown_state as sse_shutdown_state

    fence = EffectFence.from_url(f"sqlite:///{sqlite_path().lstrip('/')}")
    entered, go = threading.Event(), threading.Event()
    request = fence.request

    def parked(*a: Any, **kw: Any) -> Any:  # the step waits in its thread until told
        entered.set()
        go.wait(TIMEOUT)
        return request(*a, **kw)

    fence.request = parked  # type: ignore[method-assign]
    app = build_app(build_server(fence), fence, Metrics(), host="127.0.0.1", principals=None)
    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    srv = uvicorn.Server(config)
    got: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(srv.serve, [sock])
            with anyio.fail_after(TIMEOUT):
                while not srv.started:
                    await anyio.sleep(0.01)
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
            async with http_session(url) as session:
                # listed first, as an agent does: the SDK's call_tool checks the answer
                # against the tool's output schema, and lists the tools itself if it has
                # not, a second request sent after the answer, to a server that has stopped
                # listening by then (refused: ConnectError, and the SDK's transport fails)
                await session.list_tools()

                async def call() -> None:
                    try:
                        got.append(await session.call_tool("fence_prepare", req("drain:1")))
                    except Exception as exc:  # the failure under test: kept, then asserted
                        got.append(exc)

                async with anyio.create_task_group() as calls:
                    calls.start_soon(call)
                    with anyio.fail_after(TIMEOUT):
                        while not entered.is_set():
                            await anyio.sleep(0.01)
                    # what SIGTERM does, without the signal uvicorn would raise again in
                    # this process on its way out: uvicorn's flag, and sse-starlette's
                    # (its patched handle_exit sets it; it is process-wide: reset below)
                    srv.should_exit = True
                    AppStatus.should_exit = True
                    # the step goes on only once both have acted on their flags, each of
                    # which polls for it: uvicorn (every 0.1 s: then its listening socket
                    # is closed and each connection told to finish, in one step) and
                    # sse-starlette (every 0.5 s: its watcher, once it has told every
                    # open stream to end, is gone). Else whether the answer went out
                    # before or after either looked was luck (a flake, with the call above)
                    state = sse_shutdown_state()
                    with anyio.fail_after(TIMEOUT):
                        while state.watcher_started or any(s.is_serving() for s in srv.servers):
                            await anyio.sleep(0.01)
                    go.set()
    finally:
        AppStatus.should_exit = False
        go.set()
        fence.close()
    assert len(got) == 1 and isinstance(got[0], CallToolResult), got
    assert ok(got[0])["status"] == "fresh"


class _ProbedStore(MemoryStore):
    """Counts /healthz's probes; a probe waits for ``gate`` (in its thread), and raises
    StoreUnavailable while ``down``."""

    name = "probed"  # not "memory": the probe runs on a thread, as for a real store

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0
        self.gate = threading.Event()
        self.down = False

    def read(self, intent: str) -> Any:
        if intent == "effectfence:healthz":
            self.probes += 1
            self.gate.wait(TIMEOUT)
            if self.down:
                raise StoreUnavailable("the test store is down; nothing was decided")
        return super().read(intent)


async def test_a_flood_of_healthz_requests_costs_the_store_one_probe() -> None:
    """/healthz answers anyone, and each request was a thread and a store round trip: a
    flood of them loaded the store and filled the thread pool (found by review)."""
    store = _ProbedStore()
    fence = EffectFence(store=store)
    app = build_app(build_server(fence), fence, Metrics(), host="127.0.0.1", principals=None)
    now = [1000.0]
    app.clock = lambda: now[0]  # type: ignore[attr-defined]
    async with _in_process(app) as base, httpx.AsyncClient(timeout=TIMEOUT) as http:
        answers: list[httpx.Response] = []

        async def health() -> None:
            answers.append(await http.get(base + "/healthz"))

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(health)
            with anyio.fail_after(TIMEOUT):
                while store.probes == 0:
                    await anyio.sleep(0.01)
            store.gate.set()  # the others share its answer, or reuse it: either way, no probe
        assert [r.status_code for r in answers] == [200] * 20
        assert store.probes == 1, "one probe for every request that came while it ran"
        assert (await http.get(base + "/healthz")).status_code == 200
        assert store.probes == 1, "reused while fresh"
        now[0] += 1.0
        store.down = True
        down = await http.get(base + "/healthz")
        assert down.status_code == 503 and down.json()["error"] == "StoreUnavailable"
        assert store.probes == 2, "probed again once stale"


class _SizeOutageStore(MemoryStore):
    """A memory store whose size() raises StoreUnavailable while ``down``."""

    down = False

    def size(self) -> dict[str, int]:
        if self.down:
            raise StoreUnavailable("the test store is down; nothing was decided")
        return super().size()


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_answer_during_a_store_outage_without_the_stores_figures() -> None:
    """A scrape during an outage once answered 500 and logged a traceback each time."""
    store = _SizeOutageStore()
    fence, metrics = EffectFence(store=store), Metrics()
    server = build_server(fence, metrics=metrics)
    app = build_app(server, fence, metrics, host="127.0.0.1", principals=None)
    async with _in_process(app) as base, httpx.AsyncClient(timeout=TIMEOUT) as http:
        async with http_session(base + "/mcp") as session:
            t = ok(await session.call_tool("fence_prepare", req("outage:1")))["prepared"]
            ok(await session.call_tool("fence_commit", {"prepared": t, "result": 1}))
        up = await http.get(base + "/metrics")
        assert up.status_code == 200, up.text
        before = _samples(up.text)
        assert before["effectfence_store_up"] == 1 and before["effectfence_store_records"] == 1
        store.down = True
        down = await http.get(base + "/metrics")
        assert down.status_code == 200, down.text
        assert down.headers["content-type"].startswith("text/plain; version=0.0.4")
        during = _samples(down.text)
        assert during["effectfence_store_up"] == 0
        # this server's own counters are all there; what needs the store is left out
        calls = {k: v for k, v in during.items() if k.startswith("effectfence_tool_calls_total")}
        assert calls == {
            k: v for k, v in before.items() if k.startswith("effectfence_tool_calls_total")
        }
        assert calls['effectfence_tool_calls_total{tool="fence_commit",outcome="committed"}'] == 1
        assert during['effectfence_fence_seconds_count{tool="fence_prepare"}'] == 1
        assert 'effectfence_info{version="' in down.text
        assert "effectfence_store_records" not in during
        # the fence's own counters live in this process: still there
        attempts = {k: v for k, v in during.items() if "prepare_attempts_total" in k}
        assert attempts and attempts == {
            k: v for k, v in before.items() if "prepare_attempts_total" in k
        }
        assert during["effectfence_commits_total"] == 1
        store.down = False
        back = _samples((await http.get(base + "/metrics")).text)
        assert back["effectfence_store_up"] == 1 and back["effectfence_store_records"] == 1


# -- the socket ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nagle_off(host: str) -> None:
    """The listening socket must say TCP, or asyncio leaves Nagle on for what it accepts, and
    each answer on a kept-alive connection waits ~40 ms for the client's delayed ACK."""
    import asyncio
    import socket

    from effectfence.mcp.http import listen_socket

    try:
        sock = listen_socket(host, 0)
    except SystemExit as exc:  # no IPv6 on this machine
        pytest.skip(str(exc))
    seen: list[int] = []

    async def main() -> None:
        accepted = asyncio.Event()

        def on_connect(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            conn = w.get_extra_info("socket")
            seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            w.close()
            accepted.set()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, w = await asyncio.open_connection(host, sock.getsockname()[1])
            await asyncio.wait_for(accepted.wait(), 10)
            w.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
