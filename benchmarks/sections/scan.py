"""``effectfence scan`` on the labelled corpus of published MCP servers: ``scan_corpus``'s
``fetch`` (sha256-pinned), ``unpack`` and ``score_server``, plus how long one scan takes; and
on the labelled fixtures the tests use (``tests/fixtures/scan/EXPECTED.json``).
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from benchmarks.stats import summary
from benchmarks.suite import ROOT, Context, Skip

FIXTURES = ROOT / "tests" / "fixtures" / "scan"

TITLE = "scan: the labelled corpus"


def run(ctx: Context) -> dict[str, Any]:
    from benchmarks import scan_corpus
    from effectfence.scan import scan_path

    servers = scan_corpus.load_corpus()
    cache = scan_corpus.default_cache()
    offline = ctx.quick  # a quick run never downloads
    repeats = ctx.pick(1, 5)
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for server in servers:
        if (
            server["registry"] == "npm"
            and shutil.which("npm") is None
            and not (cache / "artifacts" / server["file"]).exists()
        ):
            missing.append(f"{server['name']} (npm not installed)")
            continue
        try:
            artifact = scan_corpus.fetch(server, cache, offline=offline)
            folder = scan_corpus.unpack(artifact, cache)
        except scan_corpus.CorpusError as exc:
            missing.append(f"{server['name']} ({exc})")
            continue
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            scan_path(folder, min_score=0)
            times.append((time.perf_counter() - t0) * 1e3)
        s = scan_corpus.score_server(server, folder)
        rows.append(
            {
                "server": s.name,
                "version": s.version,
                "registry": server["registry"],
                "style": server["style"],
                "artifact_bytes": artifact.stat().st_size,
                "effects": s.effects,
                "effects_flagged": s.effects_flagged,
                "reads": s.reads,
                "reads_flagged": s.reads_flagged,
                "idempotent": s.idempotent,
                "idempotent_flagged": s.idempotent_flagged,
                "wrong_names": len(s.wrong_names) + len(s.not_found),
                "scan_ms": summary(times),
            }
        )
        ctx.progress(f"{s.name}: {summary(times)['median']:.0f} ms")
    if not rows:
        hint = "run `python benchmarks/scan_corpus.py` once to fill the cache" if offline else ""
        raise Skip(
            f"no artifact of the corpus is available: {missing[0] if missing else ''}"
            f"{'; ' + hint if hint else ''}"
        )
    ctx.check(f"{len(rows)} artifacts matched their pinned sha256 before being scanned")
    total = {
        k: sum(r[k] for r in rows)
        for k in (
            "effects",
            "effects_flagged",
            "reads",
            "reads_flagged",
            "idempotent",
            "idempotent_flagged",
            "wrong_names",
        )
    }
    return {
        "rows": rows,
        "missing": missing,
        "total": total,
        "repeats": repeats,
        "threshold": scan_corpus.COULD_FIRE_TWICE,
        "fixtures": fixtures(ctx),
    }


def fixtures(ctx: Context) -> dict[str, Any]:
    """Precision and recall at the line on the fixtures the tests use ('fires' is positive),
    as ``tests/test_scan.py::test_precision_and_recall_on_fixtures`` counts them."""
    from effectfence.scan import COULD_FIRE_TWICE, scan_path

    expected = json.loads((FIXTURES / "EXPECTED.json").read_text())
    if expected["threshold"] != COULD_FIRE_TWICE:
        raise AssertionError("EXPECTED.json is labelled at another line than the scanner's")
    out: dict[str, Any] = {"servers": len(expected["fixtures"]), "tools": 0, "labels": {},
                           "tp": 0, "fp": 0, "fn": 0, "missed": [], "false_alarms": []}  # fmt: skip
    for fixture, tools in expected["fixtures"].items():
        scores = {f.tool: f.score for f in scan_path(FIXTURES / fixture, min_score=0).findings}
        for tool, label in tools.items():
            if tool not in scores:
                raise AssertionError(f"{fixture}: the scan did not find {tool}")
            flagged, fires = scores[tool] >= COULD_FIRE_TWICE, label == "fires"
            out["tools"] += 1
            out["labels"][label] = out["labels"].get(label, 0) + 1
            out["tp"] += flagged and fires
            out["fp"] += flagged and not fires
            out["fn"] += fires and not flagged
            if fires != flagged:
                out["missed" if fires else "false_alarms"].append(tool)
    ctx.check(f"every one of the {out['tools']} labelled fixture tools was found by the scan")
    return out
