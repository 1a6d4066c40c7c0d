"""PNG charts from the results JSON (matplotlib: ``pip install 'effect-fence[bench]'``).

Importing this module raises ImportError without matplotlib; the page then says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt


def _ok(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    sec = doc["sections"].get(name, {})
    return sec.get("data") if sec.get("status") == "ok" else None


def _footer(fig: Any, doc: dict[str, Any]) -> None:
    m = doc["machine"]
    fig.text(
        0.01,
        0.005,
        f"{doc['date']} · {m['cpu_model']} x{m['cpus']} · Python "
        f"{m['python']} · {doc['command']}" + (" · QUICK: indicative only" if doc["quick"] else ""),
        fontsize=7,
        color="gray",
    )


def counters(doc: dict[str, Any], out: Path) -> Path | None:
    d = _ok(doc, "counters")
    if not d:
        return None
    pairs = sorted({(r["op"], r["call"]) for r in d["rows"]})
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.4 * len(pairs), 3.6), squeeze=False)
    for ax, (op, call) in zip(axes[0], pairs, strict=True):
        for backend, color in (("atomic", "tab:blue"), ("pure", "tab:orange")):
            for counter, style in (("hot", "-"), ("distinct", "--")):
                rows = [
                    r
                    for r in d["rows"]
                    if (r["op"], r["call"]) == (op, call)
                    and (r["counter"] == counter or r["threads"] == 1)
                ]
                rows.sort(key=lambda r: r["threads"])
                t = [r["threads"] for r in rows]
                med = [r[backend]["median"] / 1e6 for r in rows]
                lo = [(r[backend]["median"] - r[backend]["min"]) / 1e6 for r in rows]
                hi = [(r[backend]["max"] - r[backend]["median"]) / 1e6 for r in rows]
                ax.errorbar(
                    t,
                    med,
                    yerr=[lo, hi],
                    fmt=style + "o",
                    color=color,
                    ms=3,
                    capsize=2,
                    label=f"{backend}, {counter}",
                )
        ax.set_title(f"{op} by {call}", fontsize=9)
        ax.set_xlabel("threads")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("M ops/s (median, min\N{EN DASH}max)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Counter tables: throughput vs threads", fontsize=10)
    _footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out / "counters.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fence(doc: dict[str, Any], out: Path) -> Path | None:
    d = _ok(doc, "fence")
    if not d:
        return None
    rows = d["rows"]
    labels = [f"{r['scenario']}\n{r['threads']}T" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 3.8))
    for i, (build, color) in enumerate((("compiled", "tab:blue"), ("pure", "tab:orange"))):
        med = [r[build]["median"] / 1e3 for r in rows]
        err = [
            [(r[build]["median"] - r[build]["min"]) / 1e3 for r in rows],
            [(r[build]["max"] - r[build]["median"]) / 1e3 for r in rows],
        ]
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in range(len(rows))],
            med,
            0.38,
            yerr=err,
            capsize=2,
            color=color,
            label=build,
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("k ops/s (median, min\N{EN DASH}max)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Fence operations: compiled core vs pure twin", fontsize=10)
    _footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out / "fence.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def peers(doc: dict[str, Any], out: Path) -> Path | None:
    d = _ok(doc, "peers")
    if not d:
        return None
    groups = sorted(
        {(r["store"], r["scenario"]) for r in d["rows"]},
        key=lambda g: (d["stores"].index(g[0]), g[1]),
    )
    names = ["effectfence"] + [n for n in d["peers"] if any(r["contender"] == n for r in d["rows"])]
    colors = ["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(groups)), 4))
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, med, lo, hi = [], [], [], []
        for j, g in enumerate(groups):
            r = [r for r in d["rows"] if (r["store"], r["scenario"], r["contender"]) == (*g, name)]
            if r:
                s = r[0]["ops_s"]
                xs.append(j + (i - (len(names) - 1) / 2) * w)
                med.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
        ax.bar(xs, med, w, yerr=[lo, hi], capsize=2, color=colors[i % len(colors)], label=name)
    ax.set_xticks(range(len(groups)), [f"{s}\n{sc}" for s, sc in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ops/s (median, min\N{EN DASH}max)")
    ax.legend(fontsize=7)
    ax.set_title(
        "effectfence vs peers, same work per store (see the page for what each peer does less)",
        fontsize=9,
    )
    _footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out / "peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency(doc: dict[str, Any], out: Path) -> Path | None:
    mcp, wrap = _ok(doc, "mcp"), _ok(doc, "wrap")
    panels: list[tuple[str, dict[str, dict[str, float]]]] = []
    if mcp:
        panels.append(("MCP over stdio", mcp["stdio"]["distribution_ms"]))
        panels.append(("MCP over HTTP", mcp["http"]["distribution_ms"]))
        if "http_sqlite" in mcp:
            panels.append(("MCP over HTTP, SQLite store", mcp["http_sqlite"]["distribution_ms"]))
    if wrap and wrap.get("sqlite"):
        panels.append(("wrap (SQLite store)", wrap["sqlite"]["distribution_ms"]))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, dist) in zip(axes[0], panels, strict=True):
        for name, q in dist.items():
            pts = sorted((float(k[1:]) / 100, v) for k, v in q.items())
            ax.plot([v for _, v in pts], [p for p, _ in pts], marker=".", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("latency, ms (log)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("fraction of calls at or below")
    fig.suptitle("Latency distributions (all rounds pooled)", fontsize=10)
    _footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out / "latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """Every chart the results allow; section -> file. Old charts are removed first."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    made: dict[str, Path] = {}
    latency_under = "mcp" if _ok(doc, "mcp") else "wrap"
    for section, fn in (
        ("counters", counters),
        ("fence", fence),
        ("peers", peers),
        (latency_under, latency),
    ):
        path = fn(doc, out)
        if path is not None:
            made[section] = path
    return made
