"""Result types of ``effectfence scan``.

They carry observations only: a score and the evidence behind it, never a verdict,
because a reader of the source cannot see the guards that live elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CANNOT_SEE: tuple[str, ...] = (
    "guards inside the services a tool calls (a payment API deduplicating on its own key, "
    "a unique constraint declared in a database schema outside these files)",
    "guards in sibling SDKs, wrappers, middleware or helpers defined in other files or "
    "packages (helpers are followed only inside the same file)",
    "idempotency the downstream API enforces by itself (PUT semantics, natural keys, "
    "upserts configured server-side)",
    "runtime configuration: client retry and timeout settings, environment variables, "
    "feature flags",
    "proxies, gateways, queues and load balancers in front of the server that retry or "
    "deduplicate requests",
    "whether the MCP client or agent re-sends a call after a timeout, and how often",
    "locks, transactions and isolation levels configured outside the tool's code",
    "tools registered dynamically (names built at runtime, loops over configuration) and "
    "handlers that live in another file",
    "languages other than Python, TypeScript/JavaScript, Go and Rust, and folders the scan "
    "skips (dependencies, build output, tests)",
)


@dataclass(frozen=True)
class Evidence:
    """One observation: what kind, what was seen, and on which line."""

    kind: str
    detail: str
    line: int
    weight: int = 0


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
            return [{k: v for k, v in asdict(e).items() if k != "weight"} for e in xs]

        return {
            "tool": self.tool,
            "file": self.file,
            "line": self.line,
            "language": self.language,
            "score": self.score,
            "evidence": items(self.evidence),
            "guards": items(self.guards),
        }


@dataclass
class ScanReport:
    """Everything one scan saw, filtered by ``min_score``."""

    root: str
    min_score: int
    files_scanned: int
    findings: list[Finding] = field(default_factory=list)
    tools_seen: int = 0
    cannot_see: tuple[str, ...] = CANNOT_SEE

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "min_score": self.min_score,
            "files_scanned": self.files_scanned,
            "tools_seen": self.tools_seen,
            "findings": [f.to_json() for f in self.findings],
            "cannot_see": list(self.cannot_see),
        }
