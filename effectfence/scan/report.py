"""Rendering of a :class:`ScanReport` as a table for people or JSON for machines."""

from __future__ import annotations

import json
import textwrap

from .model import COULD_FIRE_TWICE, Evidence, ScanReport

_HEADER = (
    "Tools that could fire a side effect twice under retries or concurrent calls.\n"
    "The score ranks what the source shows; it is not a verdict. "
    f"A score of {COULD_FIRE_TWICE} or more\n"
    "(marked *) means a write was seen and no guard offsets it."
)


def _where(e: Evidence) -> str:
    return f"{e.file}:L{e.line}" if e.file else f"L{e.line}"


def _short(items: list[Evidence], limit: int = 4) -> str:
    parts = [f"{e.kind}: {e.detail} ({_where(e)})" for e in items[:limit]]
    if len(items) > limit:
        parts.append(f"... {len(items) - limit} more")
    return "; ".join(parts)


def render_table(report: ScanReport, width: int = 100) -> str:
    lines = [_HEADER, ""]
    if not report.findings:
        lines.append(
            f"No tool scored {report.min_score} or more "
            f"({report.tools_seen} tools in {report.files_scanned} files)."
        )
    else:
        rows = [
            (
                f.tool,
                f"{f.file}:{f.line}",
                ("*" if f.score >= COULD_FIRE_TWICE else "") + str(f.score),
            )
            for f in report.findings
        ]
        w_tool = max(4, *(len(r[0]) for r in rows))
        w_loc = max(9, *(len(r[1]) for r in rows))
        lines.append(f"{'TOOL':<{w_tool}}  {'FILE:LINE':<{w_loc}}  SCORE  EVIDENCE")
        indent = " " * (w_tool + w_loc + 11)
        for finding, (tool, loc, score) in zip(report.findings, rows, strict=True):
            text = _short(finding.evidence) or "-"
            if finding.guards:
                text += " | guards: " + _short(finding.guards, 3)
            wrapped = textwrap.wrap(
                text, max(30, width - len(indent)), break_long_words=False, break_on_hyphens=False
            ) or ["-"]
            lines.append(f"{tool:<{w_tool}}  {loc:<{w_loc}}  {score:>5}  {wrapped[0]}")
            lines.extend(indent + more for more in wrapped[1:])
        lines.append("")
        lines.append(
            f"{len(report.findings)} of {report.tools_seen} tools scored {report.min_score} "
            f"or more ({report.files_scanned} files scanned)."
        )
    if report.skipped:
        lines.append("")
        lines.append("Folders:")
        lines.extend(f"  - {folder.path} {folder.reason}" for folder in report.skipped)
    lines.append("")
    lines.append("What this scan cannot see:")
    for item in report.cannot_see:
        lines.extend(textwrap.wrap(item, width, initial_indent="  - ", subsequent_indent="    "))
    return "\n".join(lines) + "\n"


def render_json(report: ScanReport) -> str:
    return json.dumps(report.to_json(), indent=2) + "\n"
