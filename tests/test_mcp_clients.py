"""Every result validates against its tool's declared output schema, refusals included, in
every client: the official MCP Inspector CLI (TypeScript SDK; validates isError results too)
and the Python SDK, over stdio and over streamable HTTP.

The server is ``tests/mcp_seeded.py``: a fence seeded into every state, identical in every
process, so a client that spawns a fresh stdio server per call (the Inspector CLI does)
still reaches every refusal code and every answer shape (``mcp_seeded.cases``).

The Inspector is pinned (``mcp_inspector.VERSION``) and installed from the npm registry into
a cache on first use; without node/npm these tests skip, unless EFFECTFENCE_REQUIRE_SERVICES
is set (CI), which makes a missing Inspector a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import mcp_inspector
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp_seeded import PRINCIPAL, TOKENS, Case, cases, seeded
from mcp_support import PAYLOAD_KEYS, ROOT, child_env, http_server, http_session
from mcp_types import CallToolResult

SEEDED = str(Path(__file__).with_name("mcp_seeded.py"))
CASES = cases(seeded()[2])
CALL_TIMEOUT = 90
SCHEMA_VIOLATION = ("must have required property", "must NOT have additional properties")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def inspector() -> list[str]:
    try:
        return mcp_inspector.command()
    except mcp_inspector.Unavailable as exc:
        if mcp_inspector.required():
            pytest.fail(f"the MCP Inspector is required here: {exc}")
        pytest.skip(str(exc))


def test_the_seeded_cases_reach_every_refusal_code_and_every_tool() -> None:
    from effectfence.errors import REFUSAL_TYPES

    assert {c.code for c in CASES if c.code} == set(REFUSAL_TYPES)
    assert {c.tool for c in CASES} == {
        "fence_prepare",
        "fence_commit",
        "fence_abort",
        "fence_release",
        "fence_renew",
        "fence_status",
        "fence_stats",
        "fence_verify",
        "fence_clear",
    }


# -- the Inspector CLI ------------------------------------------------------------------------


def _inspector_env(home: Path) -> dict[str, str]:
    # its catalog, client config and secrets live in a throwaway home, never the user's
    return child_env(
        HOME=str(home),
        MCP_CATALOG_PATH=str(home / "catalog.json"),
        MCP_CLIENT_CONFIG_PATH=str(home / "client.json"),
    )


def _run(cmd: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
        env=_inspector_env(home),
        stdin=subprocess.DEVNULL,
    )


def _judge(case: Case, proc: subprocess.CompletedProcess[str]) -> str | None:
    """None if the Inspector accepted the result and it is what the case expects."""
    where = f"{case.name}: rc={proc.returncode} stdout={proc.stdout[:400]!r} "
    where += f"stderr={proc.stderr[-400:]!r}"
    if any(v in proc.stdout + proc.stderr for v in SCHEMA_VIOLATION):
        return "schema violation: " + where
    try:
        result = json.loads(proc.stdout)["result"]
    except (ValueError, KeyError):
        return "no result: " + where
    content = result.get("structuredContent")
    if not isinstance(content, dict):
        return "no structuredContent: " + where
    if case.code is not None:
        # the Inspector reports a tool's isError result with exit status 5 (tool_is_error)
        if proc.returncode != 5 or "tool_is_error" not in proc.stderr:
            return "not reported as a tool error: " + where
        if result.get("isError") is not True or set(content) != PAYLOAD_KEYS:
            return "not a typed refusal: " + where
        if content["code"] != case.code:
            return f"expected {case.code}: " + where
        return None
    if proc.returncode != 0 or result.get("isError"):
        return "refused: " + where
    assert case.expect is not None
    wrong = {k: content.get(k) for k, v in case.expect.items() if content.get(k) != v}
    return f"expected {dict(case.expect)}, got {wrong}: " + where if wrong else None


def _call(case: Case, target: list[str]) -> list[str]:
    # the target last: a stdio command follows "--"
    return [
        "--format",
        "json",
        "--method",
        "tools/call",
        "--tool-name",
        case.tool,
        "--tool-args-json",
        json.dumps(case.arguments),
        *target,
    ]


def _all_cases(inspector: list[str], target: list[str], home: Path) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = list(pool.map(lambda c: _run([*inspector, *_call(c, target)], home), CASES))
    problems = [p for c, proc in zip(CASES, procs, strict=True) if (p := _judge(c, proc))]
    assert not problems, "\n".join(problems)


def test_inspector_over_stdio_accepts_every_answer_and_every_refusal(
    inspector: list[str], tmp_path: Path
) -> None:
    target = ["-e", f"PYTHONPATH={ROOT}", "--", sys.executable, SEEDED]
    _all_cases(inspector, target, tmp_path)


def test_inspector_over_http_accepts_every_answer_and_every_refusal(
    inspector: list[str], tmp_path: Path
) -> None:
    argv = [sys.executable, SEEDED, "--http", "127.0.0.1:0", "--tokens"]
    with http_server(argv) as srv:
        target = [
            "--server-url",
            srv.url,
            "--transport",
            "http",
            "--header",
            f"Authorization: Bearer {TOKENS[PRINCIPAL]}",
        ]
        _all_cases(inspector, target, tmp_path)


def test_inspector_finds_nothing_to_report_in_the_real_servers_schemas(
    inspector: list[str], tmp_path: Path
) -> None:
    """``--strict`` lints every schema for portability across clients: none may fail it."""
    serve = [sys.executable, "-m", "effectfence", "serve", "--allow-clear"]
    proc = _run([*inspector, "--method", "tools/list", "--strict", "--", *serve], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Warning" not in proc.stderr and "Issue:" not in proc.stderr, proc.stderr[-2000:]
    names = {t["name"] for t in json.loads(proc.stdout)["tools"]}
    assert "fence_clear" in names and "fence_prepare" in names


# -- the Python SDK ---------------------------------------------------------------------------


async def _sdk_all_cases(session: ClientSession) -> None:
    """Python's SDK skips validation on isError results, so we validate them ourselves,
    with the same library it uses, against the schema the server lists."""
    schemas = {t.name: t.output_schema for t in (await session.list_tools()).tools}
    for case in CASES:
        result: CallToolResult = await session.call_tool(case.tool, case.arguments)
        content: Any = result.structured_content
        schema = schemas[case.tool]
        assert schema is not None and isinstance(content, dict), case.name
        jsonschema.validate(content, schema, cls=jsonschema.Draft202012Validator)
        if case.code is not None:
            assert result.is_error and content["code"] == case.code, (case.name, content)
        else:
            assert not result.is_error, (case.name, content)
            assert case.expect is not None
            for k, v in case.expect.items():
                assert content[k] == v, (case.name, k, content)
        # and the schema really tells the two apart: an answer is not a refusal, and back
        other = {"code": "x", "message": "m", "retryable": False, "recover": "r", "details": {}}
        wrong = {"status": "fresh"} if case.code else {**content, **other}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.anyio
async def test_python_sdk_over_stdio_every_result_validates() -> None:
    params = StdioServerParameters(command=sys.executable, args=[SEEDED], env=child_env())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await _sdk_all_cases(session)


@pytest.mark.anyio
async def test_python_sdk_over_http_every_result_validates() -> None:
    argv = [sys.executable, SEEDED, "--http", "127.0.0.1:0", "--tokens"]
    with http_server(argv) as srv:
        async with http_session(srv.url, TOKENS[PRINCIPAL]) as session:
            await _sdk_all_cases(session)
