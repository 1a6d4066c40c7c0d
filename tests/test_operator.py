"""The operator's side (issue #15): clear with a recorded reason, list, show, watch, certs.

Every test runs on every store of ``support.STORES`` (memory in-process, SQLite,
PostgreSQL, Redis) through the commands' ``main`` with the fence injected; one test runs
the real ``effectfence`` processes against a SQLite file, as an operator would.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import FakeClock, FenceFactory, sqlite_path

from effectfence import EffectFence, EffectRequest, FenceConfig, IntentFailed, IntentInFlight
from effectfence.cli import info_main
from effectfence.errors import CLEAR_COMMAND, InvalidRequest
from effectfence.operator import certs, intents
from effectfence.operator.trail import check_trail, load_lines
from effectfence.store import open_store

SECRET = "4111-1111-1111-1111"  # what must never show without --show-payload


def req(n: int | str, domain: str = "order:1", agent: str = "agent-a") -> EffectRequest:
    return EffectRequest(f"charge:{n}", domain, "charge", {"card": SECRET, "n": str(n)}, agent)


def aborted(fence: EffectFence, n: int | str, reason: str = "bank timeout") -> None:
    fence.abort(fence.prepare(req(n)).ticket, reason)  # type: ignore[union-attr]


def committed(fence: EffectFence, n: int | str, domain: str = "order:1") -> Any:
    t = fence.prepare(req(n, domain)).ticket  # type: ignore[union-attr]
    return fence.commit(t, {"receipt": SECRET})


def run(main: Any, fence: EffectFence, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), fence=fence, out=out)
    return code, out.getvalue()


# -- the rule, in the core -------------------------------------------------------------------------


def test_clear_of_a_live_lease_is_refused_without_force(fence: EffectFence) -> None:
    fence.prepare(req(1))
    before = fence.intent_status("charge:1")
    with pytest.raises(IntentInFlight) as ei:
        fence.clear("charge:1", reason="looks stuck", who="ops")
    assert "force" in ei.value.recover and ei.value.holder == "agent-a"
    assert fence.intent_status("charge:1") == before, "a refused clear changes nothing"
    assert fence.audit() == [], "and records nothing"
    entry = fence.clear("charge:1", reason="holder host is dead", who="ops", force=True)
    assert entry is not None and entry.forced and entry.previous["state"] == "in_flight"
    assert fence.intent_status("charge:1").state == "absent"


@pytest.mark.parametrize("force", ["yes", 1, None])
def test_clear_refuses_a_force_that_is_not_a_bool(fence: EffectFence, force: Any) -> None:
    """A truthy string must not force a live lease open: every surface passes force here."""
    fence.prepare(req(1))
    before = fence.intent_status("charge:1")
    with pytest.raises(InvalidRequest):
        fence.clear("charge:1", reason="looks stuck", who="ops", force=force)
    assert fence.intent_status("charge:1") == before and fence.audit() == []


def test_clear_of_a_lapsed_lease_needs_no_force(fence: EffectFence, clock: FakeClock) -> None:
    fence.prepare(req(1))
    clock.advance(11.0)  # lease_ttl is 10
    entry = fence.clear("charge:1", reason="holder gone", who="ops")
    assert entry is not None and not entry.forced
    assert entry.previous["state"] == "in_flight_lapsed"


def test_cleared_intent_records_who_when_why(fence: EffectFence, clock: FakeClock) -> None:
    aborted(fence, 1)
    with pytest.raises(IntentFailed) as ei:
        fence.prepare(req(1))
    assert CLEAR_COMMAND in ei.value.recover  # the hint names what an operator runs
    assert CLEAR_COMMAND in ei.value.to_payload()["recover"]  # and so does MCP's payload
    clock.advance(5.0)
    entry = fence.clear("charge:1", reason="refunded by hand, ticket #81", who="alice")
    assert entry is not None
    assert (entry.who, entry.reason, entry.intent) == (
        "alice",
        "refunded by hand, ticket #81",
        "charge:1",
    )
    assert entry.at == pytest.approx(fence.store.now())
    assert entry.previous["failure"] == "bank timeout"
    assert entry.previous["failed_for"] == pytest.approx(5.0)
    assert SECRET not in json.dumps(entry.to_dict())
    assert fence.audit("charge:1") == [entry]
    assert fence.prepare(req(1)).fresh, "cleared: a retry may run"
    assert fence.stats()["clears"] == 1


def test_clear_wants_a_reason_and_who(fence: EffectFence) -> None:
    aborted(fence, 1)
    for bad in ("", "   ", "x" * 5000):
        with pytest.raises(InvalidRequest):
            fence.clear("charge:1", reason=bad, who="ops")
    with pytest.raises(InvalidRequest):
        fence.clear("charge:1", reason="ok", who="")
    assert fence.intent_status("charge:1").state == "failed"
    assert fence.clear("charge:nothing", reason="typo?", who="ops") is None
    assert fence.audit() == []


def test_clear_intent_keeps_its_meaning_and_is_recorded(fence: EffectFence) -> None:
    fence.prepare(req(1))  # a live lease: the library's one-argument form clears it, as before
    assert fence.clear_intent("charge:1")
    (entry,) = fence.audit()
    assert entry.who == "library" and entry.forced and "without a reason" in entry.reason


# -- the commands, on every store ------------------------------------------------------------------


def test_intents_list_filters_and_hides_payloads(fence: EffectFence, clock: FakeClock) -> None:
    aborted(fence, 1)
    committed(fence, 2)
    fence.prepare(req(3, agent="agent-b"))
    clock.advance(60.0)
    aborted(fence, 4)
    code, text = run(intents.main, fence, "list", "--json")
    rows = {r["intent"]: r for r in json.loads(text)}
    assert code == 0 and set(rows) == {"charge:1", "charge:2", "charge:3", "charge:4"}
    assert rows["charge:3"]["state"] == "in_flight_lapsed"
    assert SECRET not in text
    _, text = run(intents.main, fence, "list", "--json", "--state", "failed")
    assert {r["intent"] for r in json.loads(text)} == {"charge:1", "charge:4"}
    _, text = run(intents.main, fence, "list", "--json", "--state", "failed", "--older-than", "1m")
    assert [r["intent"] for r in json.loads(text)] == ["charge:1"]
    _, text = run(intents.main, fence, "list", "--json", "--agent", "agent-b")
    assert [r["intent"] for r in json.loads(text)] == ["charge:3"]
    _, text = run(intents.main, fence, "list", "--json", "--domain", "elsewhere")
    assert json.loads(text) == []
    code, text = run(intents.main, fence, "list")
    assert code == 0 and "bank timeout" in text and "(4 intents)" in text and SECRET not in text


def test_agent_and_age_filters_find_matches_past_the_first_limit_records(
    fence: EffectFence, clock: FakeClock
) -> None:
    """The store was asked for ``--limit`` records and the agent and age filters judged
    only those: a match past them was silently missing, exit 0 (found by review)."""
    for n in range(12):
        aborted(fence, f"a{n:02}")
    clock.advance(120.0)
    fence.abort(fence.prepare(req("z", agent="ops-bot")).ticket, "late")  # type: ignore[union-attr]
    _, text = run(intents.main, fence, "list", "--json", "--limit", "5", "--agent", "ops-bot")
    assert [r["intent"] for r in json.loads(text)] == ["charge:z"]
    _, text = run(intents.main, fence, "list", "--json", "--limit", "3", "--older-than", "1m")
    assert len(json.loads(text)) == 3  # the limit still bounds what is shown
    with pytest.raises(SystemExit) as bad:
        run(intents.main, fence, "watch", "--interval", "-1")
    assert bad.value.code == 2  # refused at parse time, not a traceback after the first look


def test_intents_show_says_when_older_audit_entries_are_left_out(fence: EffectFence) -> None:
    """show printed the 20 newest audit entries and said nothing of older ones: 25 clears
    showed as 20, the first five nowhere (found by a docs trial). It says so now, and
    --audit N shows more."""
    for n in range(25):
        aborted(fence, 7)
        fence.clear("charge:7", reason=f"clear {n}", who="ops")
    code, text = run(intents.main, fence, "show", "charge:7")
    assert code == 0 and "older audit entries not shown: the 20 newest follow" in text
    assert "clear 24" in text and "clear 5" in text and "clear 4:" not in text
    view = json.loads(run(intents.main, fence, "show", "charge:7", "--json")[1])
    assert view["audit_older"] is True and len(view["audit"]) == 20
    view = json.loads(run(intents.main, fence, "show", "charge:7", "--json", "--audit", "25")[1])
    assert view["audit_older"] is False and [e["reason"] for e in view["audit"]] == [
        f"clear {n}" for n in range(25)
    ]
    code, text = run(intents.main, fence, "show", "charge:7", "--audit", "30")
    assert "older audit entries" not in text and "clear 0" in text


def test_intents_show_and_clear_with_reason(fence: EffectFence) -> None:
    aborted(fence, 1)
    committed(fence, 2)
    code, text = run(intents.main, fence, "show", "charge:1", "--json")
    view = json.loads(text)
    assert code == 0 and view["state"] == "failed" and view["failure"] == "bank timeout"
    assert view["holder"] == "agent-a" and view["token"] >= 1 and view["audit"] == []
    code, text = run(intents.main, fence, "show", "charge:2", "--json")
    cert = json.loads(text)["cert"]
    assert cert["verifies"] and "args" not in cert and SECRET not in text
    code, text = run(intents.main, fence, "show", "charge:2", "--json", "--show-payload")
    assert json.loads(text)["cert"]["result"] == {"receipt": SECRET}  # only when asked
    code, text = run(
        intents.main, fence, "clear", "charge:1", "--reason", "refunded", "--who", "alice"
    )
    assert code == 0 and "audit #" in text
    code, text = run(intents.main, fence, "show", "charge:1", "--json")
    view = json.loads(text)
    assert view["state"] == "absent"
    (entry,) = view["audit"]
    assert (entry["reason"], entry["who"], entry["previous"]["state"]) == (
        "refunded",
        "alice",
        "failed",
    )
    code, text = run(intents.main, fence, "show", "charge:nope")
    assert code == intents.NOT_FOUND
    code, _ = run(intents.main, fence, "clear", "charge:nope", "--reason", "x")
    assert code == intents.NOT_FOUND


def test_intents_clear_of_a_live_lease_refused_without_force(
    fence: EffectFence, capsys: pytest.CaptureFixture[str]
) -> None:
    fence.prepare(req(1))
    code, _ = run(intents.main, fence, "clear", "charge:1", "--reason", "stuck?")
    assert code == 1
    assert "intent_in_flight" in capsys.readouterr().err
    assert fence.intent_status("charge:1").state == "in_flight"
    code, text = run(
        intents.main, fence, "clear", "charge:1", "--reason", "host died", "--force", "--json"
    )
    out = json.loads(text)
    assert code == 0 and out["cleared"] and out["audit"]["forced"]


def test_intents_watch_reports_changes(fence: EffectFence) -> None:
    aborted(fence, 1)
    fence.prepare(req(2))

    # two looks; between them (in the first sleep) an intent fails and one is cleared
    class Changing(io.StringIO):
        looks = 0

        def flush(self) -> None:
            Changing.looks += 1
            if Changing.looks == 1:
                aborted(fence, 3)
                fence.clear("charge:1", reason="reconciled", who="bob")

    out = Changing()
    code = intents.main(
        ["watch", "--json", "--count", "2", "--interval", "0"], fence=fence, out=out
    )
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    first = {(e["event"], e["intent"]) for e in events[:2]}
    assert code == 0 and first == {("appeared", "charge:1"), ("appeared", "charge:2")}
    later = {(e["event"], e["intent"]) for e in events[2:]}
    assert later == {("appeared", "charge:3"), ("gone", "charge:1"), ("audit", "charge:1")}
    assert SECRET not in out.getvalue()


def test_certs_export_and_verify_from_the_store(
    fence: EffectFence, store_kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for n in range(1, 5):
        committed(fence, n)
    aborted(fence, 5)  # reserves seq 5 and commits nothing: a gap, not damage
    committed(fence, 6)
    if store_kind.startswith("memory"):
        code, _ = run(certs.main, fence, "order:1", "--verify")
        assert code == 1 and "keeps no certificate trail" in capsys.readouterr().err
        return
    code, text = run(certs.main, fence, "order:1", "--verify", "--json")
    report = json.loads(text)
    assert code == 0 and report["ok"] and report["length"] == 5, report
    assert report["gaps"] == [[5, 5]] and report["first_seq"] == 1
    code, redacted = run(certs.main, fence, "order:1")
    assert code == 0 and len(redacted.splitlines()) == 5 and SECRET not in redacted
    code, full = run(certs.main, fence, "order:1", "--show-payload")
    lines = full.splitlines()
    assert [json.loads(x)["seq"] for x in lines] == [1, 2, 3, 4, 6] and SECRET in full
    code, text = run(certs.main, fence, "order:1", "--after", "2", "--limit", "2", "--show-payload")
    assert [json.loads(x)["seq"] for x in text.splitlines()] == [3, 4]
    # the export verifies offline; a redacted one is refused, with the reason
    assert check_trail(*load_lines(lines)[:2]).ok
    certs_, _lines, complaint = load_lines(redacted.splitlines())
    assert certs_ == [] and "missing fields" in complaint


def test_verify_with_nothing_to_verify_is_not_ok(
    fence: EffectFence, store_kind: str, tmp_path: Path
) -> None:
    """A mistyped domain (or an empty export) must not pass for a sound trail."""
    committed(fence, 1)
    if not store_kind.startswith("memory"):
        code, text = run(certs.main, fence, "order:typo", "--verify")
        assert code == certs.NOT_FOUND and text.startswith("NOTHING TO VERIFY"), text
        assert "OK" not in text
        code, text = run(certs.main, fence, "order:typo", "--verify", "--json")
        assert code == certs.NOT_FOUND and json.loads(text)["found"] is False
        code, text = run(certs.main, fence, "order:1", "--verify", "--after", "1")
        assert code == certs.NOT_FOUND and "after seq 1" in text
        assert run(certs.main, fence, "order:1", "--verify")[0] == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, text = run(certs.main, fence, "--file", str(empty), "--verify")
    assert code == certs.NOT_FOUND and "no certificate in" in text


def _store_url(kind: str, name: str, tmp_path: Path) -> str:
    from support import PG_DSN, REDIS_URL, need

    if kind == "sqlite":
        return f"sqlite:///{str(tmp_path / name).lstrip('/')}"
    need("pg" if kind == "postgresql" else "redis")
    base = PG_DSN if kind == "postgresql" else REDIS_URL
    return f"{base}?{'schema' if kind == 'postgresql' else 'prefix'}={name}"


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "redis"])
@pytest.mark.parametrize("command", ["intents", "certs", "info"])
def test_looking_at_a_store_that_is_not_there_creates_none(
    kind: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --store was created empty and shown as "no intents" (found by review)."""
    from support import unique_name

    # named so that the exit hook drops it from the shared server, should a failure stop
    # this test before its own cleanup
    prefix = {"postgresql": "pgtypo", "redis": "redistypo"}.get(kind, "typo")
    name = unique_name(prefix)
    url = _store_url(kind, name, tmp_path)
    argv = {"intents": ["list"], "certs": ["order:1", "--verify"], "info": []}[command]
    main = {"intents": intents.main, "certs": certs.main, "info": info_main}[command]
    try:
        code = main([*argv, "--store", url])
        err = capsys.readouterr().err
        assert code == 1 and "no store" in err, err
        if kind == "sqlite":
            assert not (tmp_path / name).exists()
        elif kind == "postgresql":
            import psycopg
            from support import PG_DSN

            with psycopg.connect(PG_DSN) as conn:
                found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (name,))
                assert found.fetchone() is None, "the schema was created"
        else:
            import redis
            from support import REDIS_URL

            with redis.Redis.from_url(REDIS_URL) as r:
                assert r.keys("{" + name + "}*") == []
        # once something has used it, the same command reads it
        EffectFence.from_url(url).close()
        assert main([*argv, "--store", url]) in (0, certs.NOT_FOUND)
    finally:
        if kind == "postgresql":
            from support import drop_pg_schema

            drop_pg_schema(name)
        elif kind == "redis":
            from support import drop_redis_prefix

            drop_redis_prefix(name)


def test_info_creates_a_store_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``info --store`` reports a store nothing has used yet (exit 1, nothing made);
    ``--create`` makes it, as serve and wrap would, and then describes it."""
    path = tmp_path / "new.db"
    url = f"sqlite:///{str(path).lstrip('/')}"
    assert info_main(["--store", url]) == 1
    assert "--create creates it now" in capsys.readouterr().err
    assert not path.exists()
    assert info_main(["--store", url, "--create", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["store"] == "sqlite" and described["store_synchronous"] == "full"
    assert path.exists()
    assert info_main(["--store", url]) == 0  # there now: looking needs no --create
    with pytest.raises(SystemExit):
        info_main(["--create"])  # nothing to create
    assert "--create needs --store" in capsys.readouterr().err
    assert info_main(["--store", "memory:"]) == 0  # always there: nothing to create


@pytest.mark.parametrize("command", ["intents", "info"])
def test_looking_at_an_older_postgres_schema_does_not_upgrade_it(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Looking (create=False) upgraded an older schema; an effectfence of that older
    version then refused to open it, so the fleet's next restarts failed because an
    operator looked with a newer CLI (found in last session's notes). Refused, named;
    ``info --create`` upgrades on purpose."""
    import psycopg
    from support import PG_DSN, drop_pg_schema, need, unique_name

    from effectfence.store.postgres import SCHEMA_VERSION

    need("pg")
    name = unique_name("pgold")
    url = f"{PG_DSN}?schema={name}"
    EffectFence.from_url(url).close()
    older = str(SCHEMA_VERSION - 1)

    def version() -> str:
        with psycopg.connect(PG_DSN) as conn:
            row = conn.execute(
                f"SELECT value FROM \"{name}\".meta WHERE key = 'schema_version'"
            ).fetchone()
            assert row is not None
            return str(row[0])

    try:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(
                f"UPDATE \"{name}\".meta SET value = %s WHERE key = 'schema_version'", (older,)
            )
        main = {"intents": intents.main, "info": info_main}[command]
        argv = {"intents": ["list"], "info": []}[command]
        assert main([*argv, "--store", url]) == 1
        err = capsys.readouterr().err
        assert f"version {older}" in err and "would upgrade it" in err and "--create" in err, err
        assert version() == older, "looking upgraded the schema"
        assert info_main(["--store", url, "--create"]) == 0
        assert version() == str(SCHEMA_VERSION)
        assert main([*argv, "--store", url]) == 0
    finally:
        drop_pg_schema(name)


def test_looking_at_an_empty_file_leaves_it_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    assert intents.main(["list", "--store", f"sqlite:///{str(empty).lstrip('/')}"]) == 1
    assert empty.stat().st_size == 0 and not Path(f"{empty}-wal").exists()


def _trail(fence: EffectFence) -> list[str]:
    for n in range(1, 6):
        committed(fence, n)
    return [json.dumps(c.to_dict()) for c in fence.store.certs("order:1")]  # type: ignore[attr-defined]


def test_tampered_and_broken_exports_are_reported_at_their_seq(tmp_path: Path) -> None:
    fence = EffectFence.from_url(f"sqlite:///{sqlite_path().lstrip('/')}")
    lines = _trail(fence)
    fence.close()
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines) + "\n")
    out = io.StringIO()
    assert certs.main(["--file", str(good), "--verify"], out=out) == 0
    assert out.getvalue().startswith("OK: 5 certificate(s)")

    tampered = [json.loads(x) for x in lines]
    tampered[2]["result"] = {"receipt": "refunded"}  # an edit to seq 3
    bad = tmp_path / "tampered.jsonl"
    bad.write_text("\n".join(json.dumps(x) for x in tampered) + "\n")
    out = io.StringIO()
    assert certs.main(["--file", str(bad), "--verify", "--json"], out=out) == 1
    report = json.loads(out.getvalue())
    assert report["broken_at_seq"] == 3 and report["broken_at_line"] == 3
    assert report["tampered"] == [3] and "hash does not match" in report["reason"]

    broken = tmp_path / "broken.jsonl"  # seq 3 removed: seq 4's parent links to nothing
    broken.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    out = io.StringIO()
    assert certs.main(["--file", str(broken), "--verify", "--json"], out=out) == 1
    report = json.loads(out.getvalue())
    assert report["broken_at_seq"] == 4 and report["broken_at_line"] == 3
    assert report["tampered"] == [] and report["gaps"] == [[3, 3]]

    swapped = tmp_path / "swapped.jsonl"  # out of seq order
    swapped.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    out = io.StringIO()
    assert certs.main(["--file", str(swapped), "--verify"], out=out) == 1
    assert "breaks at seq 1 (line 2)" in out.getvalue()


def test_an_export_holding_an_integral_float_past_2_53_verifies_offline(tmp_path: Path) -> None:
    """Review 2, bug 1: an export is canonical JSON (1.7e18 written 1700000000000000000);
    read back with a plain parser it was an int, and the certificate was refused."""
    fence = EffectFence.from_url(f"sqlite:///{sqlite_path().lstrip('/')}")
    for n in range(1, 4):
        ticket = fence.prepare(req(n)).ticket  # type: ignore[union-attr]
        fence.commit(ticket, {"ts_ns": 1.7e18 + n * 1000.0})
    code, full = run(certs.main, fence, "order:1", "--show-payload")
    fence.close()
    assert code == 0 and '"ts_ns":1700000000000001000' in full
    export = tmp_path / "trail.jsonl"
    export.write_text(full)
    out = io.StringIO()
    assert certs.main(["--file", str(export), "--verify"], out=out) == 0, out.getvalue()
    assert out.getvalue().startswith("OK: 3 certificate(s)")


def test_a_deeply_nested_line_is_a_complaint_not_a_traceback(tmp_path: Path) -> None:
    """Review 2, bug 3: json.loads raised RecursionError out of ``certs --file --verify``."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    out = io.StringIO()
    assert certs.main(["--file", str(deep), "--verify", "--json"], out=out) == 1
    report = json.loads(out.getvalue())
    assert not report["ok"] and report["broken_at_line"] == 1
    assert "line 1 is not a certificate" in report["reason"]
    certs_, lines, complaint = load_lines(['{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    assert certs_ == [] and lines == [] and complaint.startswith("line 1 is not a certificate")


def test_commands_as_processes_against_sqlite(tmp_path: Path) -> None:
    """What an operator types, against the file the servers share."""
    url = f"sqlite:///{sqlite_path().lstrip('/')}"
    fence = EffectFence.from_url(url, FenceConfig())
    aborted(fence, 1)
    fence.prepare(req(2))
    committed(fence, 3)
    env = {**os.environ, "EFFECTFENCE_STORE": url}  # the servers' default store
    base = [sys.executable, "-m", "effectfence"]

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *argv], capture_output=True, text=True, env=env, timeout=60)

    listed = cli("intents", "list", "--state", "failed")
    assert (
        listed.returncode == 0 and "charge:1" in listed.stdout and "charge:2" not in listed.stdout
    )
    refused = cli("intents", "clear", "charge:2", "--reason", "stuck")
    assert refused.returncode == 1 and "--force" in refused.stderr
    cleared = cli("intents", "clear", "charge:1", "--reason", "refunded by hand", "--who", "carol")
    assert cleared.returncode == 0, cleared.stderr
    shown = cli("intents", "show", "charge:1")
    assert "clear by carol (was failed): refunded by hand" in shown.stdout
    # the fence in this process (another process, for the store) sees the clear
    assert fence.intent_status("charge:1").state == "absent"
    assert fence.audit()[-1].who == "carol"
    verified = cli("certs", "order:1", "--verify")
    assert verified.returncode == 0 and verified.stdout.startswith("OK: 1 certificate(s)")
    for p in (listed, shown, verified):
        assert SECRET not in p.stdout
    fence.close()


@pytest.fixture
def fence(make_fence: FenceFactory) -> EffectFence:
    return make_fence(lease_ttl=10.0, result_ttl=100.0)


def _committed_in_overlap(fence: EffectFence) -> None:
    """Seqs 1..7 of domain d, 6 and 7 admitted before 5 and 6 committed: 7 follows 5."""

    def prep(n: int) -> Any:
        return fence.prepare(EffectRequest(f"i{n}", "d", "t", {"n": n}, "a")).ticket

    for n in range(1, 5):
        fence.commit(prep(n), n)
    a, b = prep(5), prep(6)  # overlap: both built on seq 4
    fence.commit(a, 5)
    c = prep(7)  # its parent is seq 5
    fence.commit(b, 6)
    fence.commit(c, 7)


def test_verify_after_a_seq_passes_a_sound_trail_whose_attempts_overlap_the_cut(
    tmp_path: Path,
) -> None:
    """certs --verify --after 5 checked seqs 6..7 alone, and seq 7 follows seq 5, before the
    cut: a sound trail reported BROKEN (found by review). The parents before the cut are
    looked up in the store; a tampered one still breaks it."""
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{sqlite_path().lstrip('/')}"))
    _committed_in_overlap(fence)
    out = io.StringIO()
    assert certs.main(["d", "--verify"], fence=fence, out=out) == 0, out.getvalue()
    out = io.StringIO()
    assert certs.main(["d", "--verify", "--after", "5"], fence=fence, out=out) == 0, out.getvalue()
    out = io.StringIO()  # an export of the same window names where the rest is
    assert certs.main(["d", "--after", "5", "--show-payload"], fence=fence, out=out) == 0
    export = tmp_path / "after5.jsonl"
    export.write_text(out.getvalue())
    out = io.StringIO()
    assert certs.main(["--file", str(export), "--verify"], out=out) == 1
    assert "verify it against the store" in out.getvalue()


def test_the_console_checks_the_newest_certificates_of_a_busy_domain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The intent page checked the domain's OLDEST CHAIN_LIMIT certificates: the newest,
    the one on the page among them, went unchecked, and a tampered one passed (found by
    review)."""
    import sqlite3

    from effectfence.operator import console

    monkeypatch.setattr(console, "CHAIN_LIMIT", 4)
    path = sqlite_path()
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{path.lstrip('/')}"))
    _committed_in_overlap(fence)  # the window is seqs 4..7; 7 follows 5, 5 and 6 follow 4
    chain = console.Console(fence, who="ops").api_intent("i7")["chain"]
    assert chain["ok"] and (chain["first_seq"], chain["last_seq"]) == (4, 7), chain
    con = sqlite3.connect(path)
    (raw,) = con.execute("SELECT cert FROM certs WHERE seq = 7").fetchone()
    body = json.loads(raw)
    body["result"] = 999
    con.execute("UPDATE certs SET cert = ? WHERE seq = 7", (json.dumps(body),))
    con.commit()
    con.close()
    chain = console.Console(fence, who="ops").api_intent("i7")["chain"]
    assert not chain["ok"] and chain["tampered"] == [7], chain


def test_clear_expecting_a_version_refuses_a_record_that_moved(
    fence: EffectFence, clock: FakeClock
) -> None:
    """expect_state / expect_token: what the operator looked at. A record no longer in
    that state or under that token is refused, retryable, and stays; one that is, clears.
    A commit that lands under the same token is a new state: also refused."""
    t = fence.prepare(req(1)).ticket
    assert t is not None
    with pytest.raises(IntentInFlight) as raised:
        fence.clear(
            "charge:1",
            reason="r",
            who="ops",
            force=True,
            expect_state="failed",
            expect_token=t.token,
        )
    assert raised.value.retryable and "changed since you looked" in raised.value.message
    fence.commit(t, {"ok": 1})
    with pytest.raises(IntentInFlight):  # it was in flight when looked at; now it is done
        fence.clear(
            "charge:1", reason="r", who="ops", expect_state="in_flight", expect_token=t.token
        )
    with pytest.raises(IntentInFlight):
        fence.clear("charge:1", reason="r", who="ops", expect_token=t.token + 1)
    assert fence.intent_status("charge:1").state == "done"
    for bad in ({"expect_state": "gone"}, {"expect_token": -1}, {"expect_token": True}):
        with pytest.raises(InvalidRequest):
            fence.clear("charge:1", reason="r", who="ops", **bad)  # type: ignore[arg-type]
    entry = fence.clear(
        "charge:1", reason="r", who="ops", expect_state="done", expect_token=t.token
    )
    assert entry is not None and fence.intent_status("charge:1").state == "absent"
    out = io.StringIO()
    t2 = fence.prepare(req(2)).ticket
    assert t2 is not None
    fence.abort(t2, "bank timeout")
    argv = ["clear", "charge:2", "--reason", "r", "--expect-state", "failed", "--expect-token"]
    assert intents.main([*argv, str(t2.token + 1)], fence=fence, out=out) == 1
    assert intents.main([*argv, str(t2.token)], fence=fence, out=out) == 0


def _line_of(fence: EffectFence, n: int) -> None:
    for i in range(1, n + 1):
        t = fence.prepare(EffectRequest(f"i{i}", "d", "t", {"n": i}, "a")).ticket
        fence.commit(t, i)  # type: ignore[arg-type]


@pytest.mark.parametrize("after", [None, "4", "5"])
def test_a_certificate_deleted_just_before_a_checked_window_is_a_break(
    after: str | None,
) -> None:
    """Seqs 1..6 in a line, then certificate 5 deleted from the store. The whole check said
    BROKEN at 6, but `--after 5` (and `--after 4`, whose window holds the place of 5) said
    OK: the window's first certificate was accepted with whatever parent it named, never
    looked up (found by review). A trail read from the store is now checked from its
    first parent on; so is one missing its start (no cut explains a trail that begins
    past seq 1 with a parent nowhere)."""
    import sqlite3

    path = sqlite_path()
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{path.lstrip('/')}"))
    try:
        _line_of(fence, 6)
        assert run(certs.main, fence, "d", "--verify")[0] == 0
        con = sqlite3.connect(path)
        con.execute("DELETE FROM certs WHERE domain = 'd' AND seq IN (1, 5)")
        con.commit()
        con.close()
        argv = ["d", "--verify", "--json", *(() if after is None else ("--after", after))]
        code, text = run(certs.main, fence, *argv)
        assert code == 1, text
        assert json.loads(text)["broken_at_seq"] == (2 if after is None else 6), text
    finally:
        fence.close()


def test_the_consoles_chain_finds_a_long_effects_parent_far_before_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long effect P (seq 2) commits after 1,010 others; the next attempt follows P. The
    console looked for parents only one page (1,000 seqs) before its window and called the
    sound trail BROKEN (found by review); it now reads back as far as it takes."""
    from effectfence.operator import console

    monkeypatch.setattr(console, "CHAIN_LIMIT", 4)
    fence = EffectFence(
        FenceConfig(lease_ttl=3600.0),
        store=open_store(f"sqlite:///{sqlite_path().lstrip('/')}"),
    )
    try:

        def prep(n: int) -> Any:
            return fence.prepare(EffectRequest(f"i{n}", "d", "t", {"n": n}, "a")).ticket

        fence.commit(prep(1), 1)
        p = prep(2)
        for n in range(3, 1013):
            fence.commit(prep(n), n)
        parent = fence.commit(p, 2)
        assert fence.commit(prep(1013), 1013).parent == parent.hash
        assert run(certs.main, fence, "d", "--verify", "--after", "1009")[0] == 0
        chain = console.Console(fence, who="ops").api_intent("i1013")["chain"]
        assert chain["ok"], chain
    finally:
        fence.close()


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        # a name from a command line that is not UTF-8 (Python's surrogateescape)
        ("intents", ["show", "order\udcff"]),
        ("intents", ["list", "--domain", "order\udcff"]),
        ("intents", ["list", "--agent", "a\udcff"]),
        ("certs", ["order\udcff", "--verify"]),
        ("certs", ["order\udcff"]),
        # a seq no store can hold
        ("certs", ["d", "--verify", "--after", "99999999999999999999"]),
        ("certs", ["d", "--after", "-1"]),
        ("certs", ["d", "--limit", "1e3"]),
    ],
)
def test_operator_commands_refuse_bad_input_with_a_message(command: str, argv: list[str]) -> None:
    """Each of these ended in a traceback (found by review): a name no store can encode
    reached the driver, a seq past 64 bits overflowed it. Refused with a message, exit 2."""
    main = intents.main if command == "intents" else certs.main
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{sqlite_path().lstrip('/')}"))
    try:
        try:
            code = main(argv, fence=fence, out=io.StringIO())
        except SystemExit as exc:  # argparse's usage error
            code = exc.code  # type: ignore[assignment]
        assert code == 2
    finally:
        fence.close()


def test_agent_chosen_names_cannot_forge_the_operators_terminal_output(
    fence: EffectFence,
) -> None:
    """Intent names, agents and reasons come from agents; printed raw, a newline in one
    name forged a whole row of `intents list`, and escape sequences reached the operator's
    terminal (found by review). Text output escapes what is not printable; --json is
    JSON."""
    forged = "charge:1\nrefund:9  failed  order:9  1  agent-x  7  1m00s  reconciled"
    fence.prepare(EffectRequest(forged, "order:1", "charge", {}, "agent-a"))
    t = fence.prepare(EffectRequest("charge:2\x1b[2K\r", "order:1", "charge", {}, "a\tb")).ticket
    fence.abort(t, "bank\x1b[31m timeout\nFAKE LINE")  # type: ignore[arg-type]
    for argv in (["list"], ["show", "charge:2\x1b[2K\r"]):
        code, text = run(intents.main, fence, *argv)
        assert code == 0 and "\x1b" not in text and "\r" not in text and "\t" not in text, text
        assert "FAKE LINE" not in text.splitlines()
    code, text = run(intents.main, fence, "list")
    assert len(text.splitlines()) == 1 + 2 + 1  # header, two intents, the count
    assert "charge:1\\nrefund:9" in text
    code, text = run(intents.main, fence, "list", "--json")
    assert {row["intent"] for row in json.loads(text)} == {forged, "charge:2\x1b[2K\r"}


def test_a_cut_trail_is_checked_without_reading_back_through_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first certificate kept after a retention cut follows a deleted one: its parent
    is never found, and the backward search paged through every deleted seq to the start,
    one query per page (found by review: a trail cut at seq N cost N / PAGE reads at every
    check). Below the cut it now reads only what the store kept, in one pass."""
    from effectfence.operator import trail
    from effectfence.store.sqlite import SQLiteStore

    monkeypatch.setattr(trail, "PAGE", 10)
    clock = FakeClock()
    store = SQLiteStore(sqlite_path(), clock=clock, cert_retention=1.0)
    fence = EffectFence(FenceConfig(result_ttl=1.0, auto_sweep=False), store=store)
    try:
        for n in range(1, 201):
            fence.commit(fence.prepare(EffectRequest(f"i{n}", "d", "t", {}, "a")).ticket, n)  # type: ignore[arg-type]
        clock.advance(10.0)
        fence.sweep()
        assert store.trail_cut("d") == 200
        for n in range(201, 204):
            fence.commit(fence.prepare(EffectRequest(f"i{n}", "d", "t", {}, "a")).ticket, n)  # type: ignore[arg-type]
        calls = 0
        real = store.certs

        def counting(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(*a, **k)

        monkeypatch.setattr(store, "certs", counting)
        assert run(certs.main, fence, "d", "--verify")[0] == 0  # sound
        assert calls <= 5, f"{calls} reads for a trail of 3 certificates"
    finally:
        fence.close()


@pytest.mark.parametrize("how", ["lapsed", "expired"])
def test_clear_takes_the_state_show_printed(how: str) -> None:
    """`show` says in_flight_lapsed for a lapsed lease and done_expired for an expired
    result; --expect-state takes what it said (the same version looked at)."""
    from effectfence.store.memory import MemoryStore

    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=10.0, result_ttl=10.0, auto_sweep=False),
        store=MemoryStore(clock=clock),
    )
    t = fence.prepare(EffectRequest("x", "d", "t", {}, "a")).ticket
    if how == "expired":
        fence.commit(t, 1)  # type: ignore[arg-type]
    clock.advance(11.0)
    view = json.loads(run(intents.main, fence, "show", "x", "--json")[1])
    assert view["state"] == {"lapsed": "in_flight_lapsed", "expired": "done_expired"}[how]
    argv = ["clear", "x", "--reason", "r", "--expect-state", view["state"]]
    assert run(intents.main, fence, *argv, "--expect-token", str(view["token"]))[0] == 0


@pytest.mark.parametrize("cmd", [["list"], ["watch", "--count", "1", "--interval", "0"]])
def test_intents_limit_past_64_bits_is_refused_with_a_message(cmd: list[str]) -> None:
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{sqlite_path().lstrip('/')}"))
    try:
        with pytest.raises(SystemExit) as raised:  # argparse's usage error
            run(intents.main, fence, *cmd, "--limit", str(2**64))
        assert raised.value.code == 2
    finally:
        fence.close()


def test_certs_file_not_utf8_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "trail.jsonl"
    bad.write_bytes(b'\xff\xfe{"seq": 1}\n')
    code, text = run(certs.main, None, "--file", str(bad), "--verify", "--json")  # type: ignore[arg-type]
    assert code == 1 and "not UTF-8" in json.loads(text)["reason"]


def test_certs_file_check_does_not_print_the_files_control_characters(tmp_path: Path) -> None:
    """An export may come from elsewhere; a complaint naming one of its fields printed it
    raw (found by review: a clear-screen and a forged 'OK' line after the BROKEN one)."""
    fence = EffectFence(FenceConfig(), store=open_store(f"sqlite:///{sqlite_path().lstrip('/')}"))
    try:
        fence.commit(fence.prepare(EffectRequest("i1", "d", "t", {}, "a")).ticket, 1)  # type: ignore[arg-type]
        _, line = run(certs.main, fence, "d", "--show-payload")
    finally:
        fence.close()
    body = json.loads(line)
    body["\x1b[2J\x1b[H\nOK: 1 certificate(s) of 'd'"] = 1
    export = tmp_path / "trail.jsonl"
    export.write_text(json.dumps(body) + "\n")
    code, text = run(certs.main, None, "--file", str(export), "--verify")  # type: ignore[arg-type]
    assert code == 1 and "\x1b" not in text and "\nOK:" not in text, repr(text)


def test_looking_at_the_default_store_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no store in the state directory, the operator's commands said "no store at"
    and created nothing but the directory it would live in (found by a docs trial):
    looking leaves the state directory as it was."""
    state = tmp_path / "state"
    monkeypatch.delenv("EFFECTFENCE_STORE", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    assert intents.main(["list"]) == 1 and certs.main(["order:1"]) == 1
    assert "no store at" in capsys.readouterr().err
    assert not state.exists()


def test_certs_output_that_cannot_be_written_is_its_own_exit_status(tmp_path: Path) -> None:
    """A full disk ended an export in a traceback, and --verify's exit 1 could not be told
    from a broken chain (found by review): one line, and exit 4, for both."""
    path = tmp_path / "f.db"
    url = f"sqlite:///{path.as_posix().lstrip('/')}"
    fence = EffectFence.from_url(url)
    for i in range(3):
        t = fence.prepare(EffectRequest(f"i{i}", "order:1", "t", {"n": i}, "a")).ticket
        fence.commit(t, {"ok": i})
    fence.close()
    for extra in (["--show-payload"], ["--verify"], ["--verify", "--json"]):
        with open("/dev/full", "w") as full:
            out = subprocess.run(
                [sys.executable, "-m", "effectfence", "certs", "order:1", "--store", url, *extra],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert out.returncode == certs.CANT_WRITE == 4, (extra, out.stderr)
        assert "can't write the output: No space left on device" in out.stderr
        assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
