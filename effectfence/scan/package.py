"""The scanned tree as one package: each file parsed once, imports followed inside it.

Following an import is how the scan sees that ``edit_file`` writes in ``lib.js``.
Files are loaded lazily and cached, so a helper module imported by twenty tools is
read once; only files under the scanned root are ever loaded.
"""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from . import golang, python, rust, typescript
from .source import Segment, Source

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
MAX_FILE_BYTES = 2_000_000


@dataclass
class Package:
    """Every file of one scan, parsed on demand."""

    root: Path
    _sources: dict[Path, Source | None] = field(default_factory=dict)

    def load(self, path: Path) -> Source | None:
        """The file's :class:`Source` with its functions, constants and imports indexed."""
        try:
            key = path.resolve()
        except (OSError, RuntimeError):  # a link loop
            return None
        if key in self._sources:
            return self._sources[key]
        self._sources[key] = None  # an import cycle finds the file "loading" and stops
        language = LANGUAGES.get(path.suffix)
        if language is None:
            return None
        try:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                return None  # a FIFO or a device would be read for ever
            with open(path, "rb") as fh:
                text = fh.read(MAX_FILE_BYTES + 1).decode("utf-8", errors="replace")
        except OSError:
            return None
        if self.root.is_file():
            rel = path.name
        else:
            try:
                rel = path.relative_to(self.root).as_posix()
            except ValueError:
                rel = path.name
        try:
            src = Source(path=path, rel=rel, language=language, text=text)
            if language == "python":
                python.index(src, self.root)
            elif language == "typescript":
                typescript.index(src, self.root)
            elif language == "go":
                golang.index(src)
            else:
                rust.index(src)
        except RecursionError:
            # nested past the stack (generated code, template literals in templates): left
            # out and said so, where the whole scan died (found by review)
            return None
        self._sources[key] = src
        return src

    def imported(self, src: Source, receiver: str, name: str) -> list[Segment]:
        """Bodies of ``receiver.name(...)`` or ``name(...)`` that live in another file of
        the package: a namespace import (``files.pushFiles``), a named import
        (``writeFileContent``), or, for Python method calls on objects whose type the
        scan cannot know (``self.connector.store``), a function of that name in a module
        this file imports."""
        targets: list[tuple[Path, str]] = []
        if receiver:
            imp = src.imports.get(receiver)
            if imp is not None:  # ``files.pushFiles`` or a class: ``Connector.store``
                targets.append((imp.path, name))
            elif src.language == "python" and not re.fullmatch(r"[A-Z]\w*", receiver):
                paths = dict.fromkeys(i.path for i in src.imports.values())
                targets.extend((path, name) for path in paths)
        else:
            named = src.imports.get(name)
            if named is not None and named.name is not None:
                targets.append((named.path, named.name))
        out: list[Segment] = []
        for path, fname in targets:
            if path.resolve() == src.path.resolve():
                continue
            other = self.load(path)
            if other is None:
                continue
            for span in other.functions.get(fname, []):
                out.append(Segment(span.start, span.end, f"{fname}()", other))
        return out
