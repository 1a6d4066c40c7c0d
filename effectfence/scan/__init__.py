"""``effectfence scan``: list MCP tools that could fire a side effect twice, with evidence.

A reader outside the repository cannot prove a double fire (guards may live in the
services a tool calls), so the scan reports what it saw and what it cannot see, and
ranks tools by a score instead of passing a verdict.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from . import golang, python, rust, typescript
from .evidence import analyze
from .model import CANNOT_SEE, COULD_FIRE_TWICE, Evidence, Finding, ScanReport, Skipped
from .package import LANGUAGES, MAX_FILE_BYTES, Package
from .source import Source, ToolDecl

__all__ = [
    "CANNOT_SEE",
    "COULD_FIRE_TWICE",
    "SKIP_DIRS",
    "Evidence",
    "Finding",
    "ScanReport",
    "Skipped",
    "scan_path",
]

_FINDERS: dict[str, Callable[[Source, Package], list[ToolDecl]]] = {
    "python": python.find_tools,
    "typescript": typescript.find_tools,
    "go": golang.find_tools,
    "rust": rust.find_tools,
}
# Dependencies, caches and tests: their tools are not the server's own.
SKIP_DIRS: dict[str, str] = {
    **dict.fromkeys(
        ("node_modules", "bower_components", "site-packages", "vendor", "third_party"),
        "dependencies",
    ),
    **dict.fromkeys(("venv", ".venv", ".tox", ".nox"), "virtualenv"),
    **dict.fromkeys(
        ("__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "coverage", ".next",
         ".nuxt", "target"),
        "cache or compiler output",
    ),
    **dict.fromkeys(("tests", "test", "__tests__", "testdata", "fixtures"), "tests"),
}  # fmt: skip
# Build output is what a published package *is* (an npm tarball holds only ``dist/``),
# so it is skipped only when the source it was built from sits beside it.
BUILD_DIRS = frozenset({"dist", "build", "out"})
_SOURCE_MARKERS = ("src", "tsconfig.json", "setup.py", "setup.cfg", "pyproject.toml")
_TEST_SUFFIXES = (
    "_test.go", "_test.py", ".test.ts", ".test.js", ".spec.ts", ".spec.js", ".d.ts",
    ".min.js", ".test.tsx", ".spec.tsx", ".test.mjs", ".spec.mjs", ".d.mts", ".d.cts",
    ".map",
)  # fmt: skip
_HINTS = ("tool", "Tool")


def _skipped_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith(_TEST_SUFFIXES)


def _source_beside(folder: Path) -> str | None:
    """What in ``folder`` shows that a build-output subfolder was built from it."""
    try:
        for marker in _SOURCE_MARKERS:
            if (folder / marker).exists():
                return marker
        for entry in sorted(folder.iterdir()):
            name = entry.name
            if (
                entry.suffix in LANGUAGES
                and not _skipped_file(name)
                and ".config." not in name  # jest.config.js and friends are not the source
                and not name.startswith(".")
            ):
                return name
    except OSError:
        return None
    return None


def walk(root: Path) -> tuple[list[Path], list[Skipped]]:
    """Source files under ``root`` and the folders left out, each with its reason.

    Skip rules apply to components *below* the root only, so a repository that itself
    lives under ``.../build/`` is still scanned."""
    if root.is_file():
        return ([root] if root.suffix in LANGUAGES else []), []
    files: list[Path] = []
    skipped: list[Skipped] = []

    def unreadable(exc: OSError) -> None:  # a folder the scan may not enter: said so
        where = Path(exc.filename or root)
        rel = where.relative_to(root).as_posix() + "/" if where != root else "./"
        skipped.append(Skipped(rel, f"unreadable folder ({exc.strerror or exc})"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        here = Path(dirpath)
        keep: list[str] = []
        for d in sorted(dirnames):
            rel = (here / d).relative_to(root).as_posix() + "/"
            if d.startswith("."):
                continue  # .git, editor and tool state: never worth a line in the report
            if (here / d).is_symlink():  # os.walk does not follow it: said so
                skipped.append(Skipped(rel, "a link to a folder: not followed"))
                continue
            try:
                venv = (here / d / "pyvenv.cfg").exists()
            except OSError:  # a folder it may not search (found by review: a traceback)
                venv = False
            if d in SKIP_DIRS:
                skipped.append(Skipped(rel, SKIP_DIRS[d]))
            elif venv:
                skipped.append(Skipped(rel, "virtualenv"))
            elif d in BUILD_DIRS and (marker := _source_beside(here)):
                skipped.append(Skipped(rel, f"build output; its source ({marker}) is beside it"))
            else:
                if d in BUILD_DIRS:
                    skipped.append(Skipped(rel, "scanned: build output with no source beside it"))
                keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            path = here / name
            if path.suffix in LANGUAGES and not _skipped_file(name):
                why = _unreadable(path, root)
                if why is None:
                    files.append(path)
                else:  # said in the report: a tool module left out is never silent
                    skipped.append(Skipped(path.relative_to(root).as_posix(), why))
    return files, skipped


def _unreadable(path: Path, root: Path) -> str | None:
    """Why a source file is left out, or None: the scan reads regular files under the
    root, after links. A link out of the tree (the scan reads the server, not what it
    points at), a link loop, a FIFO or a device (which read for ever) are left out, found
    by review."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return "a link that leads nowhere (a loop, or a missing file)"
    try:
        real.relative_to(root.resolve())
    except ValueError:
        return "a link out of the scanned tree"
    try:
        regular = stat.S_ISREG(real.stat().st_mode)
    except OSError:
        return "unreadable"
    return None if regular else "not a regular file (a FIFO or a device)"


def iter_files(root: Path) -> Iterator[Path]:
    """Source files under ``root``; see :func:`walk`."""
    yield from walk(root)[0]


def scan_path(path: str | Path, *, min_score: int = 1) -> ScanReport:
    """Scan a file or directory tree; findings are sorted by score, highest first."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    package = Package(root)
    findings: list[Finding] = []
    seen = 0
    paths, skipped = walk(root)
    files = 0
    scanned: dict[Path, str] = {}  # resolved path -> the name it was scanned under
    for file in sorted(paths, key=lambda p: (p.is_symlink(), p)):  # the file before its links
        rel = file.name if root.is_file() else file.relative_to(root).as_posix()
        real = file.resolve()
        if real in scanned:  # a link to a file scanned already: its tools once, not twice
            skipped.append(Skipped(rel, f"a link to {scanned[real]}, scanned under that name"))
            continue
        scanned[real] = rel
        src = package.load(file)
        if src is None:  # said in the report: a tool module left out is never silent
            skipped.append(
                Skipped(
                    rel, f"larger than {MAX_FILE_BYTES:,} bytes, unreadable, or nested too deep"
                )
            )
            continue
        files += 1
        if not any(h in src.text for h in _HINTS):
            continue
        for decl in _FINDERS[src.language](src, package):
            seen += 1
            finding = analyze(src, decl, package)
            if finding.score >= min_score:
                findings.append(finding)
        if src.unparsed:  # it may declare tools the scan cannot see
            skipped.append(Skipped(src.rel, src.unparsed))
    findings.sort(key=lambda f: (-f.score, f.file, f.line))
    return ScanReport(
        root=str(root),
        min_score=min_score,
        files_scanned=files,
        findings=findings,
        tools_seen=seen,
        skipped=skipped,
    )
