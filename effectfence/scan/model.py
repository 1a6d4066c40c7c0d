"""Result types of ``effectfence scan``.

They carry observations only: a score and the evidence behind it, never a verdict,
because a reader of the source cannot see the guards that live elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The threshold the README and the corpus benchmark call "could fire twice": a write the
# scan saw (3) plus an effect verb in the tool's name or description (1-3), or two kinds
# of write, with no guard that offsets them.  A seen write with a guard stays at 1-3;
# a name verb with no write seen scores 1-3.  ``--min-score`` defaults to 1, so every tool
# with any effect evidence is listed, and rows at or above this line are marked.
COULD_FIRE_TWICE = 4

CANNOT_SEE: tuple[str, ...] = (
    "guards inside the services a tool calls (a payment API deduplicating on its own key, "
    "a unique constraint declared in a database schema outside these files)",
    "guards in sibling SDKs, wrappers and middleware in other packages (helpers are "
    "followed into the scanned tree's own files, three calls deep, never into dependencies)",
    "idempotency the downstream API enforces by itself (PUT semantics, natural keys, "
    "upserts configured server-side)",
    "runtime configuration: client retry and timeout settings, environment variables, "
    "feature flags",
    "proxies, gateways, queues and load balancers in front of the server that retry or "
    "deduplicate requests",
    "whether the MCP client or agent re-sends a call after a timeout, and how often",
    "locks, transactions and isolation levels configured outside the tool's code",
    "tools registered dynamically (names built at runtime, loops over configuration); a "
    "name the scan could not resolve is shown as <expression>",
    "languages other than Python, TypeScript/JavaScript, Go and Rust, and the folders the "
    "report lists as skipped (dependencies, tests, build output beside its source)",
)


@dataclass(frozen=True)
class Evidence:
    """One observation: what kind, what was seen, and on which line."""

    kind: str
    detail: str
    line: int
    weight: int = 0
    file: str = ""  # set only when the line is in another file than the tool's


@dataclass
class Finding:
    """A tool that could fire its side effect twice, with the evidence for it."""

    tool: str
    file: str
    line: int
    language: str
    score: int
    evidence: list[Evidence] = field(default_factory=list)
    guards: list[Evidence] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def items(xs: list[Evidence]) -> list[dict[str, Any]]:
            return [
                {k: v for k, v in asdict(e).items() if k != "weight" and (k != "file" or v)}
                for e in xs
            ]

        return {
            "tool": self.tool,
            "file": self.file,
            "line": self.line,
            "language": self.language,
            "score": self.score,
            "evidence": items(self.evidence),
            "guards": items(self.guards),
        }


@dataclass(frozen=True)
class Skipped:
    """A folder (or a file) below the root the scan left out (or, for build output, chose
    to read), and why."""

    path: str
    reason: str


@dataclass
class ScanReport:
    """Everything one scan saw, filtered by ``min_score``."""

    root: str
    min_score: int
    files_scanned: int
    findings: list[Finding] = field(default_factory=list)
    tools_seen: int = 0
    cannot_see: tuple[str, ...] = CANNOT_SEE
    skipped: list[Skipped] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "min_score": self.min_score,
            "files_scanned": self.files_scanned,
            "tools_seen": self.tools_seen,
            "could_fire_twice": COULD_FIRE_TWICE,
            "findings": [f.to_json() for f in self.findings],
            "skipped": [asdict(s) for s in self.skipped],
            "cannot_see": list(self.cannot_see),
        }
