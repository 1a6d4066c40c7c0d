"""Where an import points, inside the scanned tree only.

A published server keeps its effects one import away from its tool table (GitHub's
``push_files`` calls ``files.pushFiles`` in ``operations/files.js``), so the scan
follows imports, but only to files under the scanned root: a dependency's code is
not the server's, and reading it would turn every SDK call into evidence.
"""

from __future__ import annotations

from pathlib import Path

_JS_SUFFIXES = ("", ".js", ".ts", ".mjs", ".cjs", ".tsx", ".jsx", ".mts", ".cts")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return path.is_file()


def resolve_js(file: Path, spec: str, root: Path) -> Path | None:
    """``./operations/files.js`` from ``file``; TypeScript sources import ``x.js`` for
    ``x.ts``, so the suffix is swapped as well as added. Bare specifiers are packages."""
    if not spec.startswith("."):
        return None
    base = file.parent / spec
    stem = base.with_suffix("") if base.suffix in (".js", ".mjs", ".cjs") else base
    candidates = [base] + [Path(str(stem) + s) for s in _JS_SUFFIXES[1:]]
    candidates += [base / ("index" + s) for s in (".js", ".ts", ".mjs")]
    return next((c for c in candidates if _inside(c, root)), None)


def resolve_py(file: Path, module: str, level: int, root: Path) -> Path | None:
    """``from .qdrant import x`` (level 1) or ``from mcp_server_qdrant.qdrant import x``.

    An absolute name is tried against every folder from the file's own up to the root,
    which finds the package's own top level without knowing where it was installed.
    """
    parts = [p for p in module.split(".") if p]
    if level:
        bases = [file.parents[level - 1]] if level <= len(file.parents) else []
    else:
        bases = []
        folder = file.parent
        root_r = root.resolve() if root.is_dir() else root.parent.resolve()
        while True:
            bases.append(folder)
            if folder.resolve() == root_r or folder.parent == folder:
                break
            folder = folder.parent
    for base in bases:
        target = base.joinpath(*parts)
        for cand in (target.with_suffix(".py") if parts else None, target / "__init__.py"):
            if cand is not None and _inside(cand, root):
                return cand
    return None
