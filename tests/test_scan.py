"""Tests for ``effectfence scan`` against fixture MCP servers in four languages."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from effectfence.scan import CANNOT_SEE, COULD_FIRE_TWICE, Finding, scan_path
from effectfence.scan.evidence import _name_verbs, tokens
from effectfence.scan.source import mask

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "scan"
EXPECTED = json.loads((FIXTURES / "EXPECTED.json").read_text())
THRESHOLD: int = EXPECTED["threshold"]
assert THRESHOLD == COULD_FIRE_TWICE
# What README_SECTION.md states; the fixtures include one known miss and one known false alarm.
MIN_PRECISION = 0.9
MIN_RECALL = 0.9


def _scan(fixture: str, min_score: int = 0) -> dict[str, Finding]:
    report = scan_path(FIXTURES / fixture, min_score=min_score)
    return {f.tool: f for f in report.findings}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "effectfence.scan", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def test_every_expected_tool_is_found() -> None:
    for fixture, tools in EXPECTED["fixtures"].items():
        found = _scan(fixture)
        missing = set(tools) - set(found)
        assert not missing, f"{fixture}: tools not discovered: {missing}"
        extra = set(found) - set(tools)
        assert not extra, f"{fixture}: unexpected tools: {extra}"


def test_precision_and_recall_on_fixtures() -> None:
    tp = fp = fn = 0
    for fixture, tools in EXPECTED["fixtures"].items():
        found = _scan(fixture)
        for tool, label in tools.items():
            predicted = found[tool].score >= THRESHOLD
            actual = label == "fires"
            tp += predicted and actual
            fp += predicted and not actual
            fn += actual and not predicted
    precision = tp / (tp + fp)
    recall = tp / (tp + fn)
    print(f"precision={precision:.3f} recall={recall:.3f} tp={tp} fp={fp} fn={fn}")
    assert precision >= MIN_PRECISION
    assert recall >= MIN_RECALL


def test_guarded_tools_score_lower_and_list_their_guard() -> None:
    for fixture, tools in EXPECTED["fixtures"].items():
        listed = _scan(fixture, min_score=1)
        for tool, label in tools.items():
            if label != "guarded":
                continue
            assert tool in listed, f"{tool} should stay visible at the default --min-score"
            finding = listed[tool]
            assert finding.guards, tool
            assert finding.score < THRESHOLD, tool


def test_read_tools_are_not_listed_by_default() -> None:
    for fixture, tools in EXPECTED["fixtures"].items():
        listed = _scan(fixture, min_score=1)
        for tool, label in tools.items():
            if label == "read" and tool not in ("create_preview",):
                assert tool not in listed, f"{fixture}:{tool}"


def test_no_bleed_from_the_previous_tool() -> None:
    for fixture, tool in (("py_fastmcp", "forecast"), ("ts_server", "weather")):
        finding = _scan(fixture)[tool]
        assert finding.score == 0
        assert not [e for e in finding.evidence if e.kind == "http_write"]


def test_read_verb_vetoes_a_post_but_money_words_lift_the_veto() -> None:
    found = _scan("py_fastmcp")
    assert found["search_orders"].score == 0
    assert any(e.kind == "read_name" for e in found["search_orders"].evidence)
    assert any(e.kind == "money_word" for e in found["lookup_invoice"].evidence)


def test_camel_case_idempotency_helper_is_a_guard() -> None:
    finding = _scan("ts_server")["chargeCustomer"]
    details = " ".join(g.detail for g in finding.guards)
    assert "deriveIdempotencyKey" in details
    assert "Idempotency-Key" in details


def test_writes_in_same_file_helpers_count() -> None:
    create = _scan("py_fastmcp")["create_ticket"]
    assert any("helper _post_json()" in e.detail for e in create.evidence if e.kind == "http_write")
    assert any(e.kind == "retry" for e in create.evidence)
    book = _scan("ts_server")["book_room"]
    assert any("helper callApi()" in e.detail for e in book.evidence)


def test_conditional_http_method_on_the_raw_line() -> None:
    finding = _scan("ts_server")["sync_contact"]
    http = [e for e in finding.evidence if e.kind == "http_write"]
    assert http and "conditional" in http[0].detail and "PUT" in http[0].detail


def test_docstring_only_python_tool() -> None:
    finding = _scan("py_docstring")["slack_message"]
    assert any(e.detail == "description says 'post'" for e in finding.evidence)
    assert finding.score >= THRESHOLD


def test_handlers_referenced_by_name_are_followed() -> None:
    invoice = _scan("go_mark3labs")["create_invoice"]
    assert any(e.kind == "http_write" and e.line == 36 for e in invoice.evidence)
    delete = _scan("ts_server")["delete_file"]
    assert any("deleteObject" in e.detail for e in delete.evidence)
    deploy = _scan("go_official")["deploy_service"]
    assert any("exec.CommandContext" in e.detail for e in deploy.evidence)
    write = _scan("rust_legacy")["write_config"]
    assert any("fs.write" in e.detail for e in write.evidence)


def test_annotations_are_read_in_every_language() -> None:
    assert any(g.kind == "read_only_hint" for g in _scan("go_mark3labs")["get_invoice"].guards)
    assert any(g.kind == "read_only_hint" for g in _scan("go_official")["list_services"].guards)
    assert any(g.kind == "idempotent_hint" for g in _scan("rust_rmcp")["cancel_order"].guards)
    assert any(g.kind == "read_only_hint" for g in _scan("py_fastmcp")["ticket_summary"].guards)
    assert any(g.kind == "read_only_hint" for g in _scan("ts_server")["list_files"].guards)


def test_skip_rules_apply_below_the_root_only(tmp_path: Path) -> None:
    repo = tmp_path / "home" / "build" / "repo"
    shutil.copytree(FIXTURES / "py_fastmcp", repo)
    tool = "from mcp.server.fastmcp import FastMCP\nmcp = FastMCP('x')\n\n@mcp.tool()\n"
    for sub, name in (("build", "gen.py"), ("node_modules/pkg", "srv.py"), ("tests", "fake.py")):
        (repo / sub).mkdir(parents=True)
        (repo / sub / name).write_text(tool + "def send_spam() -> None:\n    pass\n")
    (repo / "venv_custom").mkdir()
    (repo / "venv_custom" / "pyvenv.cfg").write_text("home = /usr\n")
    (repo / "venv_custom" / "lib.py").write_text(tool + "def send_spam() -> None:\n    pass\n")
    report = scan_path(repo, min_score=0)
    tools = {f.tool for f in report.findings}
    assert "charge_card" in tools
    assert "send_spam" not in tools
    assert all(not f.file.startswith(("build/", "node_modules/")) for f in report.findings)


def test_single_file_and_missing_path() -> None:
    report = scan_path(FIXTURES / "rust_rmcp" / "src" / "main.rs")
    assert {f.file for f in report.findings} == {"main.rs"}
    with pytest.raises(FileNotFoundError):
        scan_path(FIXTURES / "does-not-exist")


def test_mask_keeps_offsets_and_hides_strings_and_comments() -> None:
    src = 'let s = "a { b"; // }\nlet r: &\'static str = r#"}"#; let c = \'{\';'
    code, skel = mask(src, "rust")
    assert len(code) == len(skel) == len(src)
    assert "//" not in code and '"a { b"' in code  # comments go, strings stay in ``code``
    assert skel.count("{") == skel.count("}") == 0  # neither survives in the skeleton
    js = "const re = /[{]/g; const t = `x ${ {a: 1}.a } y`; // {"
    _, jskel = mask(js, "typescript")
    assert jskel.count("{") == 0 and jskel.count("}") == 0


def test_cli_json_shape_and_exit_code() -> None:
    proc = _run(str(FIXTURES), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["cannot_see"] == list(CANNOT_SEE)
    assert data["findings"]
    for item in data["findings"]:
        assert set(item) == {"tool", "file", "line", "language", "score", "evidence", "guards"}
        assert item["language"] in {"python", "typescript", "go", "rust"}
        for ev in item["evidence"] + item["guards"]:
            # ``file`` appears only on evidence seen in another file than the tool's
            assert set(ev) - {"file"} == {"kind", "detail", "line"}
    high = json.loads(_run(str(FIXTURES), "--json", "--min-score", "8").stdout)
    assert high["findings"] and all(f["score"] >= 8 for f in high["findings"])


def test_cli_table_has_no_verdict_words() -> None:
    proc = _run(str(FIXTURES / "ts_server"))
    assert proc.returncode == 0
    assert "could fire" in proc.stdout
    assert "cannot see" in proc.stdout
    lowered = proc.stdout.lower()
    assert " bug" not in lowered and " safe" not in lowered and "vulnerab" not in lowered


def test_cli_exit_code_when_nothing_is_found(tmp_path: Path) -> None:
    proc = _run(str(tmp_path))
    assert proc.returncode == 0
    assert "No tool scored" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["/definitely/not/here"],
        [str(FIXTURES), "--min-score", "high"],
        [str(FIXTURES), "--frobnicate"],
    ],
)
def test_cli_bad_arguments_exit_2(args: list[str]) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip()
    assert proc.stdout == ""


# --- issue #16: published servers -------------------------------------------------------


def test_names_resolve_through_enums_constants_and_value() -> None:
    """A client calls ``notes_record``, never the Python function ``record``."""
    assert set(_scan("py_enum_names")) == {"notes_status", "notes_record", "notes_stage"}
    lowlevel = _scan("py_enum_lowlevel")
    assert set(lowlevel) == {"ledger_show", "ledger_post_entry", "ledger_purge", "ledger_archive"}
    # the ``case Kind.POST_ENTRY:`` and ``ARCHIVE_TOOL == name`` branches are the bodies
    assert any(e.kind == "http_write" for e in lowlevel["ledger_post_entry"].evidence)
    assert any(e.kind == "http_write" for e in lowlevel["ledger_archive"].evidence)
    assert not any(e.kind == "http_write" for e in lowlevel["ledger_show"].evidence)
    assert set(_scan("ts_tool_per_file")) == {"invite_member", "member_email"}


def test_annotation_helper_keywords_are_hints_not_writes() -> None:
    stage = _scan("py_enum_names")["notes_stage"]
    assert any(g.kind == "idempotent_hint" for g in stage.guards)
    record = _scan("py_enum_names")["notes_record"]
    assert not any("writes()" in e.detail for e in record.evidence)


def test_a_name_the_scan_cannot_resolve_is_marked_not_guessed(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(
        "from mcp.server.fastmcp import FastMCP\nfrom elsewhere import Names\n"
        "mcp = FastMCP('x')\n\n@mcp.tool(name=Names.SEND.value)\n"
        "def send() -> None:\n    pass\n"
    )
    (finding,) = scan_path(tmp_path, min_score=0).findings
    assert finding.tool == "<Names.SEND.value>"
    assert any(e.kind == "unresolved_name" for e in finding.evidence)


def test_published_build_output_is_scanned_when_no_source_is_beside_it() -> None:
    report = scan_path(FIXTURES / "js_published", min_score=0)
    assert {f.tool for f in report.findings} == {
        "write_note",
        "edit_note",
        "stream_note",
        "sync_notes",
    }
    assert [(s.path, s.reason) for s in report.skipped] == [
        ("package/dist/", "scanned: build output with no source beside it")
    ]
    beside = scan_path(FIXTURES / "ts_src_and_dist", min_score=0)
    assert {f.file for f in beside.findings} == {"src/index.ts"}
    assert [s.path for s in beside.skipped] == ["dist/"]
    assert "source (src)" in beside.skipped[0].reason
    table = _run(str(FIXTURES / "ts_src_and_dist")).stdout
    assert "dist/ build output; its source (src) is beside it" in table


def test_effects_are_followed_into_imported_files() -> None:
    found = _scan("js_published")
    sync = [e for e in found["sync_notes"].evidence if e.kind == "http_write"]
    assert {e.file for e in sync} == {"package/dist/ops/files.js"}
    assert {"POST:", "PATCH:"} == {e.detail.split()[2] for e in sync}  # "HTTP method POST: ..."
    write = found["write_note"].evidence
    assert any(e.file == "package/dist/lib.js" and "writeFile" in e.detail for e in write)
    keep = _scan("py_self_tool")["vault-keep"]
    assert any(e.file == "vault/connector.py" and "upsert" in e.detail for e in keep.evidence)
    assert keep.score >= THRESHOLD


def test_self_tool_registers_aliased_function_objects() -> None:
    found = _scan("py_self_tool")
    assert set(found) == {"vault-find", "vault-keep"}
    assert found["vault-keep"].line == 36 and found["vault-find"].score == 0


def test_forge_verbs_count_in_names() -> None:
    assert any(
        e.detail == "tool name contains 'fork'"
        for e in _scan("py_evidence")["fork_project"].evidence
    )
    assert any(
        e.detail == "tool name contains 'edit'" for e in _scan("js_published")["edit_note"].evidence
    )


def test_a_request_id_counts_as_a_guard_only_when_used() -> None:
    found = _scan("py_evidence")
    assert not found["approve_merge_request"].guards  # ``merge_request_id`` names a resource
    assert not found["submit_report"].guards  # ``client_request_id`` is never read
    assert found["submit_report"].score >= THRESHOLD
    ticket = found["submit_ticket"]
    assert [g.kind for g in ticket.guards] == ["request_token"]


def test_a_noun_in_a_name_is_not_a_verb() -> None:
    assert not [
        e for e in _scan("ts_tool_per_file")["member_email"].evidence if e.kind == "effect_verb"
    ]
    assert _name_verbs(tokens("get_user_email")) == ("get", None, 0)
    assert _name_verbs(tokens("user_email")) == (None, None, 0)
    assert _name_verbs(tokens("add_issue_comment")) == (None, "add", 1)
    assert _name_verbs(tokens("slack_post_message")) == (None, "post", 2)
    assert _name_verbs(tokens("email_customer")) == (None, "email", 2)


def test_constructors_named_create_are_not_effects() -> None:
    stream = _scan("js_published")["stream_note"]
    assert not [e for e in stream.evidence if e.kind == "effect_call"]
    assert stream.score == 0
    edit = _scan("js_published")["edit_note"]
    assert not [e for e in edit.evidence if "createTwoFilesPatch" in e.detail]


def test_skipping_items_already_present_is_a_dedupe_guard() -> None:
    tags = _scan("js_evidence")
    assert any(g.kind == "dedupe_check" for g in tags["add_tags"].guards)
    assert tags["add_tags"].score < THRESHOLD
    assert not tags["append_note"].guards and tags["append_note"].score >= THRESHOLD
    facts = _scan("py_evidence")["remember_facts"]
    assert any(g.kind == "dedupe_check" for g in facts.guards)


def test_updates_that_set_values_rank_below_creates() -> None:
    found = _scan("py_evidence")
    update = found["update_issue"]
    assert any(e.kind == "sets_values" for e in update.evidence)
    assert 1 <= update.score < THRESHOLD  # listed, below the line
    assert found["create_issue"].score >= THRESHOLD
    write = _scan("js_published")["write_note"]
    assert write.score < THRESHOLD and any(e.kind == "sets_values" for e in write.evidence)
    assert _scan("js_published")["edit_note"].score >= THRESHOLD


def test_corpus_label_file_is_well_formed(tmp_path: Path) -> None:
    """The benchmark's labels parse and say, for every tool, a label, a line and why."""
    spec = importlib.util.spec_from_file_location(
        "scan_corpus", ROOT / "benchmarks" / "scan_corpus.py"
    )
    assert spec is not None and spec.loader is not None
    corpus = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = corpus  # dataclasses look their module up
    try:
        spec.loader.exec_module(corpus)
        servers = corpus.load_corpus()
        assert len(servers) >= 10
        assert {s["registry"] for s in servers} == {"pypi", "npm"}
        assert len({(s["name"], s["version"]) for s in servers}) == len(servers)
        text = (ROOT / "benchmarks" / "scan_corpus.toml").read_text()
        broken = tmp_path / "broken.toml"
        broken.write_text(text.replace('label = "read"', 'label = "reads"', 1))
        with pytest.raises(corpus.CorpusError, match="label must be one of"):
            corpus.load_corpus(broken)
    finally:
        del sys.modules[spec.name]


def test_a_method_on_a_chained_value_is_not_an_effect() -> None:
    """``createHash(...).update(...)`` in an imported key helper updates a hash, not a record."""
    charge = _scan("ts_server")["chargeCustomer"]
    assert not [e for e in charge.evidence if "update()" in e.detail]
    assert charge.score < THRESHOLD


def test_odd_files_are_left_out_and_the_scan_still_runs(tmp_path: Path) -> None:
    """Found by review, each ended the scan in a traceback (exit 1, where the docs say 0
    whenever it ran), or worse: a link loop named *.py; a generated table too deep for
    ast.parse; a tool name of 600 terms (ast.unparse); a tool name with a lone surrogate
    (the table output); a FIFO named *.py (read for ever); and a link to a file outside
    the root, which was read and reported as the server's own."""
    tool = 'from mcp.server.fastmcp import FastMCP\nmcp = FastMCP("x")\n'
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text(
        tool + "@mcp.tool()\ndef outside_refund(x):\n    requests.post('u')\n"
    )
    root = tmp_path / "server"
    root.mkdir()
    (root / "server.py").write_text(
        tool + "@mcp.tool()\ndef charge_card(x):\n    requests.post('u')\n"
    )
    os.symlink(outside / "secret.py", root / "pay.py")
    os.symlink("l2", root / "l1")
    os.symlink("l1", root / "l2")
    os.symlink("l1", root / "loop.py")
    (root / "gen.py").write_text("# tool table\nX = " + "1+" * 50_000 + "1\n")
    long_name = "+".join(["a"] * 600)
    (root / "long.py").write_text(
        tool + f"@mcp.tool(name={long_name})\ndef refund(x):\n    requests.post('u')\n"
    )
    (root / "odd.py").write_text(
        tool + '@mcp.tool(name="\\ud800")\ndef pay(x):\n    requests.post("u")\n'
    )
    os.mkfifo(root / "pipe.py")
    for extra in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "effectfence", "scan", str(root), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "charge_card" in out.stdout and "outside_refund" not in out.stdout
        assert "Traceback" not in out.stderr
    report = scan_path(root)
    left_out = {s.path: s.reason for s in report.skipped}
    assert left_out["pay.py"] == "a link out of the scanned tree"  # said, never silent
    assert "pipe.py" in left_out and "loop.py" in left_out


def test_files_the_scan_could_not_read_whole_are_listed_with_why(tmp_path: Path) -> None:
    """A tool module that does not parse (Python 2, a template) or is too large to read
    was counted, or dropped, without a word (found by review): its tools went unseen."""
    from effectfence.scan.package import MAX_FILE_BYTES

    tool = 'from mcp.server.fastmcp import FastMCP\nmcp = FastMCP("x")\n'
    (tmp_path / "server.py").write_text(
        tool + "@mcp.tool()\ndef charge_card(x):\n    requests.post('u')\n"
    )
    (tmp_path / "legacy.py").write_text(tool + "@mcp.tool()\ndef refund(x):\n    print x\n")
    (tmp_path / "huge.py").write_text(tool + "# " + "x" * MAX_FILE_BYTES + "\n")
    (tmp_path / "notes.py").write_text("print 'hello'\n")  # no tool in it: not listed
    report = scan_path(tmp_path)
    left_out = {s.path: s.reason for s in report.skipped}
    assert left_out["legacy.py"].startswith("Python that does not parse (line 5:"), left_out
    assert "larger than 2,000,000 bytes" in left_out["huge.py"]
    assert "notes.py" not in left_out and "server.py" not in left_out
    assert [f.tool for f in report.findings] == ["charge_card"]


# -- found by review: what the walk meets --------------------------------------------------

_FASTMCP_TOOL = (
    'from mcp.server.fastmcp import FastMCP\nmcp = FastMCP("x")\n'
    "@mcp.tool()\ndef charge_card(x):\n    requests.post('u')\n"
)


def test_a_folder_the_scan_may_not_enter_is_listed_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder without search permission made Path.exists raise PermissionError out of the
    walk (a traceback, exit 1), and os.walk dropped an unreadable folder without a word.
    (Root reads every folder: the refusal is the one the kernel gives another user.)"""
    (tmp_path / "server.py").write_text(_FASTMCP_TOOL)
    private = tmp_path / "private"
    private.mkdir()
    (private / "more.py").write_text(_FASTMCP_TOOL.replace("charge_card", "refund"))
    denied = PermissionError(13, "Permission denied")
    exists, scandir = Path.exists, os.scandir

    def no_search(self: Path, *a: Any, **k: Any) -> bool:
        if private in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self, *a, **k)

    def no_listing(path: Any = ".") -> Any:
        if Path(path) == private:
            denied.filename = str(private)
            raise denied
        return scandir(path)

    monkeypatch.setattr(Path, "exists", no_search)
    monkeypatch.setattr(os, "scandir", no_listing)
    report = scan_path(tmp_path)
    assert [f.tool for f in report.findings] == ["charge_card"]
    reasons = {s.path: s.reason for s in report.skipped}
    assert reasons["private/"] == "unreadable folder (Permission denied)"


_JS_TOOL = (
    'server.tool("charge_card", "Charge", {}, async () => { await fetch(u, {method: "POST"}) })\n'
)


def test_a_link_to_a_scanned_file_counts_its_tools_once(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(_FASTMCP_TOOL)
    os.symlink("server.py", tmp_path / "main.py")
    outside = tmp_path.parent / (tmp_path.name + "-handlers")
    outside.mkdir()
    (outside / "h.py").write_text(_FASTMCP_TOOL.replace("charge_card", "refund"))
    os.symlink(outside, tmp_path / "handlers")
    report = scan_path(tmp_path)
    assert [(f.tool, f.file) for f in report.findings] == [("charge_card", "server.py")]
    reasons = {s.path: s.reason for s in report.skipped}
    assert reasons["main.py"] == "a link to server.py, scanned under that name"
    assert reasons["handlers/"] == "a link to a folder: not followed"


def test_javascript_without_semicolons_scans_in_linear_time(tmp_path: Path) -> None:
    """An "import " in a string scanned to the end of the file, once per string: 190 KB
    of such code took 23 s, a file under the size limit hung the scan."""
    text = _JS_TOOL
    text += "".join(f'log("import step {i}")\n' for i in range(20_000))
    (tmp_path / "server.js").write_text(text)
    import time

    t0 = time.process_time()
    report = scan_path(tmp_path)
    spent = time.process_time() - t0
    assert [f.tool for f in report.findings] == ["charge_card"]
    assert spent < 10, f"{spent:.1f} s of CPU for {len(text):,} bytes"  # was minutes


def test_a_file_nested_past_the_stack_is_left_out_not_the_scan(tmp_path: Path) -> None:
    (tmp_path / "server.js").write_text(_JS_TOOL)
    depth = 3000
    (tmp_path / "gen.js").write_text("const t = " + "`${" * depth + "x" + "}`" * depth + ";\n")
    report = scan_path(tmp_path)
    assert [f.tool for f in report.findings] == ["charge_card"]
    assert any(s.path == "gen.js" and "nested too deep" in s.reason for s in report.skipped)
