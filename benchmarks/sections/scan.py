"""``effectfence scan`` on the labelled corpus of published MCP servers: ``scan_corpus``'s
``fetch`` (sha256-pinned), ``unpack`` and ``score_server``, plus how long one scan takes.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from benchmarks.stats import summary
from benchmarks.suite import Context, Skip

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
            folder = scan_corpus.unpack(scan_corpus.fetch(server, cache, offline=offline), cache)
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
    }
