"""The benchmark page is generated, never typed: its structure, and the README block.

Nothing here measures: the page generator runs on a small synthetic results JSON.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.suite import SECTIONS  # noqa: E402


def s(median: float, lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    return {"median": median, "min": lo if lo is not None else median * 0.9,
            "max": hi if hi is not None else median * 1.1, "n": 3}  # fmt: skip


def dist() -> dict[str, float]:
    return {f"p{q}": 0.1 + q / 100 for q in (0, 5, 10, 25, 50, 75, 90, 95, 99, 100)}


def synthetic(quick: bool = False) -> dict[str, Any]:
    machine = {
        "cpu_model": "Test CPU 9000", "cpus": 2, "os": "Linux-test", "python": "3.11.7",
        "python_impl": "CPython", "compiler": "cc (test) 12", "cffi": "2.0.0",
        "build_flags": "['-std=c11', '-O2']", "python_cflags": "-O3", "effectfence": "0.1.0",
        "git_commit": "abc1234", "sqlite": "3.40.1", "loadavg_start": [0.5, 0, 0],
        "loadavg_end": [0.7, 0, 0],
        "counters": {"backend": "atomic", "speedups": True},
    }  # fmt: skip
    lat = {"p50": s(0.002), "p99": s(0.004)}
    sections: dict[str, Any] = {
        "counters": {"rounds": 2, "ops_per_thread": 100, "rows": [
            {"op": "reserve", "call": "slot", "threads": t, "counter": "hot",
             "atomic": s(5e6), "pure": s(1e6), "ratio": 5.0} for t in (1, 2, 4, 8)]},
        "fence": {"rounds": 2, "ops": 100, "builds": {"compiled": {"backend": "atomic",
                  "speedups": True}, "pure": {"backend": "pure", "speedups": False}},
                  "rows": [{"scenario": sc, "threads": 1,
                            "compiled": {**s(1e5), "p50_us": 8.0, "p99_us": 20.0},
                            "pure": {**s(3e4), "p50_us": 25.0, "p99_us": 60.0}, "ratio": 3.33}
                           for sc in ("fresh", "replay", "in_flight")]},
        "storm": {"runs": 2, "reference_ms": 22.33, "ratio_pure_over_compiled": 2.5,
                  "builds": {b: {"attempts": 1000, "executions": [1, 1], "replays": s(999),
                                 "fence_ms": s(5.0), "harness_ms": s(200.0),
                                 "fence_over_harness": s(0.025), "prepare_p50_us": s(4.0),
                                 "prepare_p99_us": s(40.0)} for b in ("compiled", "pure")}},
        "stores": {"rounds": 1, "fresh_ops": 10, "replay_ops": 100, "modes": ["1 client"],
                   "rows": [{"store": "sqlite FULL", "kind": "fence", "durability": "FULL",
                             "fresh 1 client": s(150), "replay 1 client": s(30000)}],
                   "skipped_rows": {"redis": "server down"},
                   "servers": {"sqlite": {"version": "3.40.1"}}},
        "mcp": {"store": "memory", "rounds": 1, "calls": 10,
                "stdio": {"latency_s": {k: lat for k in ("noop", "prepare", "prepare+commit",
                                                         "replay")},
                          "calls_per_s": {"noop x8": s(900), "storm x8": s(700)},
                          "overhead": {"prepare": 0.05, "replay": 0.02,
                                       "prepare+commit vs 2x noop": 0.04},
                          "distribution_ms": {"noop": dist(), "prepare": dist()}},
                "http": {"results": {f"{t} x{c}": {"p50": s(0.01), "p99": s(0.02),
                                                   "calls/s": s(500)}
                                     for t in ("noop", "fence_prepare") for c in (1, 8)},
                         "overhead": {"x1": 0.03, "x8": 0.06},
                         "distribution_ms": {"noop x1": dist()}}},
        "wrap": {"rounds": 1, "calls": 10, "sqlite": {
            **{k: {"direct_p50_ms": 0.2, "wrapped_p50_ms": 0.5, "added_p50_ms": 0.3,
                   "added_p99_ms": 0.9, "direct_calls_per_s_8": 4000,
                   "wrapped_calls_per_s_8": 2000} for k in ("pass", "fenced")},
            "replay": {"wrapped_p50_ms": 0.3}, "distribution_ms": {"pass_d": dist()}}},
        "peers": {"rounds": 1, "storms": 1, "ops_memory": [10, 20], "ops_durable": [5, 10],
                  "effectfence_does": "everything", "effectfence_version": "0.1.0",
                  "stores": ["memory"],
                  "peers": {"once-kernel": {"spec": "once-kernel==0.2.1", "version": "0.2.1",
                                            "does_less": "no certificate"},
                            "idempotency": {"spec": "idempotency==0.1.0",
                                            "missing": "pip install failed: no network",
                                            "does_less": "no payload check"}},
                  "rows": [{"store": "memory", "scenario": "fresh", "contender": c,
                            "ops_s": s(v), "effectfence_over": 1e5 / v}
                           for c, v in (("effectfence", 1e5), ("once-kernel", 2e4))],
                  "storm_rows": [{"store": "memory", "contender": "once-kernel",
                                  "attempts": 1000, "executions": [1], "refused": s(0),
                                  "guard_ms": s(300), "over_effectfence": 30.0}],
                  "skipped": {"memory": {"idempotency": "not installed"}}, "servers": {}},
    }  # fmt: skip
    doc: dict[str, Any] = {
        "format": "effectfence.bench/1", "date": "2026-01-02 03:04 UTC",
        "command": "python -m benchmarks" + (" --quick" if quick else ""), "quick": quick,
        "peers": True, "seconds": 42.0, "machine": machine,
        "sections": {n: {"status": "ok", "data": sections[n], "checks": [f"{n} was checked"],
                         "seconds": 1.0} for n in sections},
    }  # fmt: skip
    doc["sections"]["scan"] = {"status": "skipped", "reason": "corpus not cached",
                               "checks": [], "seconds": 0.0}  # fmt: skip
    doc["sections"] = {n: doc["sections"][n] for n in SECTIONS}
    return doc


STORM_OUT = """effectfence storm: charge order #777 ($777.00), 40 waves x 25 new OS threads
table   attempts executions replays refused elapsed_ms harness_ms share_ms* fence_ms**
atomic      1000          1     999       0     203.4     190.3       13.1     17.90
[atomic] exactly one execution; replays served 999; refused: none
"""


def with_new_keys(doc: dict[str, Any]) -> dict[str, Any]:
    """The synthetic doc with what the storm, fence and scan sections add for the README."""
    doc = copy.deepcopy(doc)
    runs = [{"counters": c, "waves": 40, "racers": 25, "attempts": 1000, "executions": 1,
             "replays": 999, "harness_ms": h, "elapsed_ms": h + 13.0, "fence_sum_ms": 17.9}
            for c, h in (("atomic", 190.3), ("pure", 203.7))]  # fmt: skip
    doc["sections"]["storm"]["data"]["transcript"] = {
        "command": "effectfence storm", "stdout": STORM_OUT, "runs": runs}  # fmt: skip
    doc["sections"]["stores"]["data"]["rows"].append(
        {**doc["sections"]["stores"]["data"]["rows"][0], "store": "memory"}
    )
    doc["sections"]["fence"]["data"]["kept_result"] = {
        "compiled": {"n": 100_000, "bytes_per_result": 1020.4},
        "pure": {"n": 100_000, "bytes_per_result": 1021.2},
    }
    row = {"registry": "pypi", "effects_flagged": 1, "effects": 1, "reads_flagged": 0,
           "reads": 7, "idempotent_flagged": 2, "idempotent": 4, "wrong_names": 0,
           "scan_ms": s(30.0), "artifact_bytes": 40_000}  # fmt: skip
    rows = [
        {**row, "server": "mcp-server-git", "version": "2026.10.19", "style": "decorators"},
        {**row, "server": "@modelcontextprotocol/server-github", "version": "2025.4.8",
         "registry": "npm", "style": "compiled, `switch`", "effects": 5, "effects_flagged": 5,
         "reads": 14, "artifact_bytes": 120_000},
    ]  # fmt: skip
    total = {k: sum(r[k] for r in rows) for k in ("effects", "effects_flagged", "reads",
             "reads_flagged", "idempotent", "idempotent_flagged", "wrong_names")}  # fmt: skip
    fixtures = {"servers": 18, "tools": 65, "tp": 28, "fp": 0, "fn": 1,
                "missed": ["send_digest"], "false_alarms": [],
                "labels": {"fires": 29, "guarded": 12, "idempotent": 8, "read": 16}}  # fmt: skip
    doc["sections"]["scan"] = {
        "status": "ok", "checks": ["scan was checked"], "seconds": 1.0,
        "data": {"rows": rows, "missing": ["mcp-server-time (npm not installed)"],
                 "total": total, "repeats": 5, "threshold": 4, "fixtures": fixtures},
    }  # fmt: skip
    return doc


def blocked(names: list[str]) -> str:
    """A page with the given blocks, each holding stale text, between prose."""
    parts = ["# x\n"]
    for name in names:
        begin, end = report.markers(name)
        parts.append(f"before {name}\n\n{begin}\nstale {name} 17.90 ms\n{end}\n\nafter {name}\n")
    return "\n".join(parts)


README_BLOCKS = ["results", "storm", "memory", "scan", "scan-fixtures"]
DOCS_BLOCKS = {"stores-sqlite.md": ["stores-sqlite"], "wrap.md": ["wrap-cost"]}


def http2(store: str, prepares: float) -> dict[str, Any]:
    """An HTTP measurement as bench_mcp writes it since the raw client (format 2)."""
    results = {
        f"{c} {t} x{n}": {"p50": s(0.001), "p99": s(0.003), "calls/s": s(prepares)}
        for c, ns in (("sdk", (1,)), ("raw", (1, 8)))
        for n in ns
        for t in ("noop", "fence_prepare")
    }
    cpu = {
        f"{w} {k}": s(0.5)
        for w in ("server", "client")
        for k in ("sdk x1", "raw x1", "raw noop x8", "raw fence_prepare x8")
    }
    sqlite = store == "sqlite"
    return {"format": 2, "store": "sqlite:///tmp/x.db" if sqlite else "memory",
            "store_name": store, "counters": "atomic", "rounds": 2, "calls_per_round": 10,
            "per_client_x8": 5, "clients": {"raw": "raw processes.", "sdk": "the SDK."},
            "results": results, "overhead": {"raw x1": 0.04, "raw x8": 0.06, "sdk x1": 0.02},
            "overhead_per_round": {k: s(0.05) for k in ("raw x1", "raw x8", "sdk x1")},
            "throughput_ratio_x8": 0.9, "prepares_per_s_x8": prepares,
            "cpu_ms_per_call": cpu,
            "targets": {"overhead": {"limit": 0.1, "on": ["raw x1", "raw x8"],
                                     "applies": not sqlite},
                        "overhead_met": None if sqlite else True,
                        "prepares_per_s": {"limit": 500.0, "applies": sqlite},
                        "prepares_per_s_met": prepares >= 500 if sqlite else None},
            "target_met": True, "distribution_ms": {"raw noop x8": dist()}, "correct": True,
            "checks": {"calls": 40, "prepares": 20, "failed": 0, "failures": [],
                       "server_admitted": 20}}  # fmt: skip


def test_mcp_over_http_by_client_processes_shows_both_stores_and_the_targets() -> None:
    doc = synthetic()
    mcp = doc["sections"]["mcp"]["data"]
    mcp["http"], mcp["http_sqlite"] = http2("memory", 1000), http2("sqlite", 400)
    page, block = report.render_page(doc), report.readme_block(doc)
    for text in (page, block):
        assert "MCP over HTTP, 8 client processes, memory store: fence_prepare calls/s" in text
        assert "SQLite store: fence_prepare calls/s | 400/s (360\N{EN DASH}440)" in text
        assert "target >= 500/s NOT met" in text
        # the overhead target is judged where no synchronous commit is in every prepare
        assert "memory store: fence_prepare calls/s | 1,000/s" in text
        assert "over a no-op (+4.0% with 1 client); target < 10.0% over the no-op met" in text
        assert "over the no-op n/a on a durable store" in text
    assert "| HTTP SQLite raw fence_prepare x8 | 1.000 ms" in page
    assert "`raw` rows: raw processes." in page and "`sdk` rows: the SDK." in page
    assert "raw x8 +6.0%" in page and "CPU per call, server / clients" in page
    assert "| HTTP memory raw noop x8 | 0.150 |" in page  # its distribution


def test_page_has_every_section_the_machine_and_the_command() -> None:
    page = report.render_page(synthetic())
    assert page.startswith("# effectfence: benchmark results\n")
    assert report.GENERATED in page
    assert "**Date:** 2026-01-02 03:04 UTC" in page
    assert "**Command:** `python -m benchmarks`" in page
    assert "Test CPU 9000, 2 CPUs" in page and "cffi 2.0.0" in page and "cc (test) 12" in page
    for name, title in report.TITLES.items():
        assert f"\n## {title}\n" in page, name
    assert "## Headline figures" in page and "## Correctness checked while measuring" in page
    assert "- fence: fence was checked" in page
    assert "Quick run" not in page
    # figures come with their min-max, and the ratio beside them
    assert "100,000/s (90,000\N{EN DASH}110,000); 3.33x the pure twin" in page


def test_page_says_why_a_section_or_a_peer_did_not_run() -> None:
    page = report.render_page(synthetic())
    assert "**skipped**: corpus not cached" in page
    assert "- redis: skipped: server down" in page
    assert "MISSING: pip install failed: no network" in page
    assert "memory, idempotency: skipped: not installed" in page
    assert "no certificate" in page  # what a peer does less is said beside it


def test_quick_page_says_its_figures_are_indicative() -> None:
    assert "Quick run: indicative figures only" in report.render_page(synthetic(quick=True))


def test_failed_section_is_shown_not_dropped() -> None:
    doc = synthetic()
    doc["sections"]["storm"] = {"status": "failed", "reason": "AssertionError: 2 executions",
                                "checks": [], "seconds": 1.0}  # fmt: skip
    page = report.render_page(doc)
    assert "**failed**: AssertionError: 2 executions" in page
    assert "failed: AssertionError: 2 executions" in report.readme_block(doc)


def test_charts_are_linked_when_drawn_and_said_when_not() -> None:
    page = report.render_page(synthetic(), {"counters": "results/charts/counters.png"})
    assert "![throughput vs threads, both counter tables](results/charts/counters.png)" in page
    page = report.render_page(synthetic(), {}, "not drawn: matplotlib is not installed")
    assert "Charts: not drawn: matplotlib is not installed" in page


def test_readme_block_is_replaced_between_its_markers() -> None:
    doc = synthetic()
    block = report.readme_block(doc)
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    text = f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n"
    assert report.replace_block(text, block) == f"intro\n{block}\noutro\n"
    with pytest.raises(ValueError):
        report.replace_block("no markers", block)


def test_publish_writes_the_page_and_the_readme_block(tmp_path: Path) -> None:
    doc = synthetic()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\n{report.END}\n")
    written = report.publish(copy.deepcopy(doc), tmp_path / "RESULTS.md", None, readme)
    assert (tmp_path / "RESULTS.md").read_text() == report.render_page(doc)
    assert report.readme_block(doc) in readme.read_text()
    assert len(written) == 2


def test_committed_page_comes_from_the_committed_json() -> None:
    latest = ROOT / "benchmarks" / "results" / "latest.json"
    doc = json.loads(latest.read_text())
    page = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert not doc["quick"], "the published page must come from a full run"
    charts = {n: f"results/charts/{f}" for n, (f, _) in report.CHARTS.items()
              if f"(results/charts/{f})" in page}  # fmt: skip
    if "mcp" in charts:  # the latency chart sits under MCP, or under wrap when MCP did not run
        charts.pop("wrap", None)
    note = "" if charts else report.NO_CHARTS
    assert page == report.render_page(doc, charts, note)
    for _, path in charts.items():
        assert (ROOT / "benchmarks" / path).is_file(), path


def test_effectfence_bench_runs_the_suite_from_a_checkout() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "effectfence", "bench", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--peers" in out.stdout


def test_publish_replaces_every_block_in_the_readme_and_docs(tmp_path: Path) -> None:
    doc = with_new_keys(synthetic())
    readme = tmp_path / "README.md"
    readme.write_text(blocked(README_BLOCKS))
    docs = []
    for name, blocks in DOCS_BLOCKS.items():
        docs.append(tmp_path / name)
        docs[-1].write_text(blocked(blocks))
    (tmp_path / "plain.md").write_text("no blocks here\n")
    written = report.publish(
        doc, tmp_path / "RESULTS.md", None, readme, [*docs, tmp_path / "plain.md"]
    )
    assert written == [str(tmp_path / "RESULTS.md"), str(readme), *map(str, docs)]
    assert (tmp_path / "plain.md").read_text() == "no blocks here\n"
    for path, names in [(readme, README_BLOCKS)] + [
        (tmp_path / n, b) for n, b in DOCS_BLOCKS.items()
    ]:
        text = path.read_text()
        assert "stale" not in text and "17.90 ms" not in text
        for name in names:
            assert report.block(doc, name) in text
            assert f"before {name}\n\n{report.block(doc, name)}\n\nafter {name}" in text
    text = readme.read_text()
    # the storm: the transcript as the CLI printed it, its date, and the harness from the JSON
    assert f"```\n$ effectfence storm\n{STORM_OUT}```" in text
    assert "(2026-01-02 03:04 UTC, `python -m benchmarks`, Test CPU 9000 x2" in text
    assert "took 190 ms (atomic) and 204 ms (pure) in that run with no fence at all" in text
    # memory: per build, and the day's worth at 10,000 effects a second
    assert "costs 1,020 bytes compiled, 1,021 bytes pure, measured with tracemalloc over " in text
    assert "100,000 commits in each build" in text and "need about 882 GB" in text
    # scan: the corpus table, recall per server, overall, the fixtures
    assert "| @modelcontextprotocol/server-github | npm 2025.4.8 | compiled, `switch` | " in text
    assert "| mcp-server-git | PyPI 2026.10.19 | decorators | 12 (1 / 4 / 7) |" in text
    assert "scanned 2 artifacts, 160 KB in all" in text
    assert "per server that has any: git 1/1, github 5/5; read tools flagged: none" in text
    assert "| recall on effect tools | **1.00** (6/6) |" in text
    assert "| read tools flagged | **0%** (0/21) |" in text
    assert "| wrong names | **0** (none reported, none missing) |" in text
    assert "| idempotent tools flagged (not scored) | 4/8 |" in text
    assert "- not scanned: mcp-server-time (npm not installed)" in text
    assert "precision is **1.00** and recall **0.97** (28 true positives, 0 false positives" in text
    assert "1 false negative: `send_digest`); from the run of 2026-01-02 03:04 UTC." in text
    # docs: the SQLite rows against the limit and once-kernel; wrap's table
    stores = (tmp_path / "stores-sqlite.md").read_text()
    assert "| sqlite FULL | 150/s (135\N{EN DASH}165) | FULL |" in stores
    assert "| memory |" not in stores  # the SQLite page shows the SQLite rows
    assert "once-kernel did not run on SQLite at NORMAL in the peers section" in stores
    wrap = (tmp_path / "wrap.md").read_text()
    # a run before the x8 rates were kept per round says its figure is one run's
    assert (
        "| sqlite | fenced | 0.200 ms | 0.500 ms | 0.300 ms | 0.900 ms | 4,000/s (one run) / "
        "2,000/s (one run) |"
    ) in wrap


def test_blocks_say_which_section_lacks_their_data() -> None:
    doc = synthetic()  # an older run: the sections ran, without the new keys
    assert "the storm section of the run of 2026-01-02 03:04 UTC predates it" in report.block(
        doc, "storm"
    )
    assert "the fence section of the run of" in report.block(doc, "memory")
    assert "skipped: corpus not cached" in report.block(doc, "scan")
    assert "skipped: corpus not cached" in report.block(doc, "scan-fixtures")
    doc["sections"]["storm"] = {"status": "failed", "reason": "AssertionError: 2 executions",
                                "checks": [], "seconds": 1.0}  # fmt: skip
    assert "failed: AssertionError: 2 executions" in report.block(doc, "storm")
    doc["sections"]["wrap"] = {"status": "skipped", "reason": "not selected (--only/--skip)",
                               "checks": [], "seconds": 0.0}  # fmt: skip
    assert "skipped: not selected" in report.block(doc, "wrap-cost")
    for name in report.BLOCKS:  # every block renders, whatever is missing
        begin, end = report.markers(name)
        b = report.block(doc, name)
        assert b.startswith(begin + "\n" + report.WRITTEN) and b.endswith(end)


def test_page_shows_the_new_figures() -> None:
    page = report.render_page(with_new_keys(synthetic()))
    assert f"```\n$ effectfence storm\n{STORM_OUT}```" in page
    assert "costs 1,020 bytes compiled, 1,021 bytes pure" in page
    assert "The fixtures (`tests/fixtures/scan`): 18 fixture servers, 65 labelled tools" in page


def test_merge_takes_a_full_run_s_sections_and_says_when_they_ran() -> None:
    doc = synthetic()
    run = with_new_keys(synthetic())
    run["date"], run["command"] = "2026-02-03 04:05 UTC", "python -m benchmarks --only storm,scan"
    run["machine"]["git_commit"] = "def5678"
    for name in run["sections"]:
        if name not in ("storm", "scan"):
            run["sections"][name] = {"status": "skipped", "reason": "not selected",
                                     "checks": [], "seconds": 0.0}  # fmt: skip
    assert report.merge(doc, run) == ["storm", "scan"]
    assert doc["sections"]["storm"]["run"]["date"] == "2026-02-03 04:05 UTC"
    assert doc["sections"]["fence"].get("run") is None  # the rest keeps the document's run
    assert "(2026-02-03 04:05 UTC, `python -m benchmarks --only storm,scan`" in report.block(
        doc, "storm"
    )
    assert "from the run of 2026-02-03 04:05 UTC" in report.block(doc, "scan-fixtures")
    assert ("storm: 1,000 attempts at one intent (run of 2026-02-03 04:05 UTC)"
            in report.readme_block(doc))  # fmt: skip
    page = report.render_page(doc)
    assert "*Measured in a separate run: 2026-02-03 04:05 UTC, " in page and "def5678" in page
    run["quick"] = True
    with pytest.raises(ValueError, match="quick"):
        report.merge(doc, run)


def test_readme_and_docs_blocks_are_what_report_makes_of_the_committed_json() -> None:
    """Every generated block of README.md and docs/*.md is exactly what the generator makes
    of the committed JSON, so no figure there is typed by hand (python -m benchmarks, or
    python -m benchmarks.report, rewrites them)."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    found: set[str] = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        names = [n for n in report.BLOCKS if report.markers(n)[0] in text]
        found.update(names)
        assert report.rewrite(text, doc) == text, f"{path.name}: a block is not generated"
        if path.name == "README.md":
            assert names == README_BLOCKS
        elif path.name in DOCS_BLOCKS:
            assert names == DOCS_BLOCKS[path.name]
    assert found == set(report.BLOCKS), "a block that no page shows"


def test_replays_by_another_client_start_from_an_empty_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peers' SQLite replays were timed on the client that committed the intents, whose
    store answered every one from its cache of its own writes, which once-kernel has not
    (found by review). `replay, other client` times a second client: when its clock
    starts, none of the intents it replays is in its store's cache."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import contenders

    from effectfence.store import sqlite as sq

    made: list[Any] = []
    real = contenders.GUARDS["effectfence"]

    def factory(url: str) -> Any:
        made.append(real(url))
        return made[-1]

    monkeypatch.setitem(contenders.GUARDS, "effectfence", factory)
    cached: list[int] = []

    def at_t0() -> None:  # _replay_other collects garbage right before its clock starts
        reader = made[-1]
        cached.append(
            sum(reader.fence.store._kept_record(k) is not sq._ABSENT for k in reader.hashes)
        )

    monkeypatch.setattr(contenders.gc, "collect", at_t0)
    url = f"sqlite:///{str(tmp_path / 'ef.db').lstrip('/')}?synchronous=normal"
    got = contenders.replay_other(contender="effectfence", url=url, n=300, rnd=0)
    assert len(made) == 2 and len(made[1].hashes) == 300  # a second client, told what to expect
    assert cached == [0] and got["re_executions"] == 0
