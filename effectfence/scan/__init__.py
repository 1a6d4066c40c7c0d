"""``effectfence scan``: list MCP tools that could fire a side effect twice, with evidence.

A reader outside the repository cannot prove a double fire (guards may live in the
services a tool calls), so the scan reports what it saw and what it cannot see, and
ranks tools by a score instead of passing a verdict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from . import golang, python, rust, typescript
from .evidence import analyze
from .model import CANNOT_SEE, Evidence, Finding, ScanReport
from .source import Source, ToolDecl

__all__ = ["CANNOT_SEE", "SKIP_DIRS", "Evidence", "Finding", "ScanReport", "scan_path"]

LANGUAGES: dict[str, str] = {
    ".py": "python",
    ".ts": "typescript",
    ".tsx": "typescript",
    ".mts": "typescript",
    ".cts": "typescript",
    ".js": "typescript",
    ".jsx": "typescript",
    ".mjs": "typescript",
    ".cjs": "typescript",
    ".go": "go",
    ".rs": "rust",
}
_FINDERS: dict[str, Callable[[Source], list[ToolDecl]]] = {
    "python": python.find_tools,
    "typescript": typescript.find_tools,
    "go": golang.find_tools,
    "rust": rust.find_tools,
}
# Dependencies, build output, caches and tests: their tools are not the server's own.
SKIP_DIRS = frozenset(
    {
        ".git", ".hg", ".svn", "node_modules", "bower_components", "venv", ".venv", ".tox",
        ".nox", "site-packages", "__pycache__", ".mypy_cache",
        ".pytest_cache", ".ruff_cache", "build", "dist", "out", ".next", ".nuxt",
        "coverage", "vendor", "target", "third_party", "tests", "test", "__tests__",
        "testdata", "fixtures",
    }
)  # fmt: skip
_TEST_SUFFIXES = (
    "_test.go", "_test.py", ".test.ts", ".test.js", ".spec.ts", ".spec.js", ".d.ts",
    ".min.js", ".test.tsx", ".spec.tsx",
)  # fmt: skip
MAX_FILE_BYTES = 2_000_000
_HINTS = ("tool", "Tool")


def _skipped_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith(_TEST_SUFFIXES)


def iter_files(root: Path) -> Iterator[Path]:
    """Source files under ``root``; skip rules apply to components *below* the root only,
    so a repository that itself lives under ``.../build/`` is still scanned."""
    if root.is_file():
        if root.suffix in LANGUAGES:
            yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIP_DIRS
            and not d.startswith(".")
            and not (Path(dirpath) / d / "pyvenv.cfg").exists()  # a virtualenv by any name
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix in LANGUAGES and not _skipped_file(name):
                yield path


def scan_path(path: str | Path, *, min_score: int = 1) -> ScanReport:
    """Scan a file or directory tree; findings are sorted by score, highest first."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    findings: list[Finding] = []
    files = 0
    seen = 0
    for file in iter_files(root):
        try:
            if file.stat().st_size > MAX_FILE_BYTES:
                continue
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        files += 1
        if not any(h in text for h in _HINTS):
            continue
        rel = file.name if root.is_file() else file.relative_to(root).as_posix()
        src = Source(path=file, rel=rel, language=LANGUAGES[file.suffix], text=text)
        for decl in _FINDERS[src.language](src):
            seen += 1
            finding = analyze(src, decl)
            if finding.score >= min_score:
                findings.append(finding)
    findings.sort(key=lambda f: (-f.score, f.file, f.line))
    return ScanReport(
        root=str(root), min_score=min_score, files_scanned=files, findings=findings, tools_seen=seen
    )
