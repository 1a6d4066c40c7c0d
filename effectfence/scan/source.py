"""Source views and bracket matching shared by the per-language scanners.

Regexes over raw source trip on braces inside strings and on commented-out code,
so every scanner works on two views of the text with identical offsets: ``code``
(comments blanked) and ``skeleton`` (comments and string bodies blanked).  Structure
(brackets, calls, keys) is read from the skeleton, literal values from ``code``.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

_REGEX_BEFORE = set("(,=:[!&|?{};+-*%<>~^")
_REGEX_KEYWORDS = ("return", "typeof", "case", "in", "of", "delete", "void", "throw", "yield")


@dataclass(frozen=True)
class Segment:
    """A half-open offset range of a file that belongs to one tool.

    ``src`` is set only when the range lies in another file than the tool's own (an
    imported helper); it takes no part in equality, so spans still compare by offsets.
    """

    start: int
    end: int
    label: str = ""
    src: Source | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Import:
    """A name bound by an import: the module file it comes from, and the name it has
    there (None when the whole module is bound, ``import * as files``)."""

    path: Path
    name: str | None


@dataclass
class ToolDecl:
    """A tool declaration found by a language scanner, before scoring."""

    name: str
    line: int
    decl: list[Segment]
    body: list[Segment]
    description: str = ""


@dataclass
class Source:
    """One file with its masked views and a line index."""

    path: Path
    rel: str
    language: str
    text: str
    code: str = ""
    skeleton: str = ""
    functions: dict[str, list[Segment]] = field(default_factory=dict)
    # ``GitTools.COMMIT`` -> ``git_commit``: string constants a tool name may be spelled with
    constants: dict[str, str] = field(default_factory=dict)
    imports: dict[str, Import] = field(default_factory=dict)
    # Python names defined in a class body: ``repo.commit()`` may call one of these, but
    # never a same-named nested tool function (the scan cannot know ``repo``'s type)
    methods: set[str] = field(default_factory=set)
    # why the file could not be parsed ("" when it was): said in the report, never silent
    unparsed: str = ""
    _newlines: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.code, self.skeleton = mask(self.text, self.language)
        self._newlines = [m.start() for m in re.finditer("\n", self.text)]

    def line_of(self, offset: int) -> int:
        return bisect_left(self._newlines, offset) + 1

    def line_start(self, line: int) -> int:
        return 0 if line <= 1 else self._newlines[line - 2] + 1

    def line_end(self, line: int) -> int:
        """Offset just past the end of ``line`` (its newline excluded)."""
        if line - 1 < len(self._newlines):
            return self._newlines[line - 1]
        return len(self.text)


def mask(text: str, language: str) -> tuple[str, str]:
    """Return (code, skeleton) views; see the module docstring."""
    code = list(text)
    skel = list(text)
    n = len(text)

    def blank(a: int, b: int, *, comment: bool) -> None:
        for k in range(a, min(b, n)):
            if text[k] != "\n":
                skel[k] = " "
                if comment:
                    code[k] = " "

    def quoted_end(i: int, quote: str, *, escapes: bool = True, multiline: bool = False) -> int:
        """Index just past the closing quote of a string opened at ``i``."""
        j = i + len(quote)
        while j < n:
            c = text[j]
            if escapes and c == "\\":
                j += 2
                continue
            if text.startswith(quote, j):
                return j + len(quote)
            if c == "\n" and not multiline:
                return j
            j += 1
        return n

    python = language == "python"
    i = 0
    while i < n:
        c = text[i]
        if python:
            if c == "#":
                end = text.find("\n", i)
                end = n if end < 0 else end
                blank(i, end, comment=True)
                i = end
                continue
            if c in "'\"":
                triple = text[i : i + 3]
                if triple in ('"""', "'''"):
                    end = quoted_end(i, triple, multiline=True)
                    blank(i + 3, end - 3, comment=False)
                else:
                    end = quoted_end(i, c)
                    blank(i + 1, end - 1, comment=False)
                i = end
                continue
            i += 1
            continue
        # C-like languages: TypeScript/JavaScript, Go, Rust.
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            blank(i, end, comment=True)
            i = end
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if language == "rust" and text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j, comment=True)
            i = j
            continue
        if language == "rust" and c in "rb" and (i == 0 or not _ident(text[i - 1])):
            m = re.compile(r'b?r(#*)"').match(text, i)
            if m:
                closing = '"' + m.group(1)
                end = text.find(closing, m.end())
                end = n if end < 0 else end + len(closing)
                blank(m.end(), end - len(closing), comment=False)
                i = end
                continue
        if c == '"':
            end = quoted_end(i, c, multiline=language == "rust")
            blank(i + 1, end - 1, comment=False)
            i = end
            continue
        if c == "'":
            if language == "typescript" or text.startswith("\\", i + 1):
                end = quoted_end(i, c)
            elif i + 2 < n and text[i + 2] == "'":
                end = i + 3
            elif language == "go":
                end = quoted_end(i, c)
            else:  # a Rust lifetime such as 'a
                i += 1
                continue
            blank(i + 1, end - 1, comment=False)
            i = end
            continue
        if c == "`" and language in ("go", "typescript"):
            end = (
                _template_end(text, i)
                if language == "typescript"
                else quoted_end(i, c, escapes=False, multiline=True)
            )
            blank(i + 1, end - 1, comment=False)
            i = end
            continue
        if c == "/" and language == "typescript" and _regex_allowed(text, i):
            j = i + 1
            in_class = False
            while j < n and text[j] != "\n":
                if text[j] == "\\":
                    j += 2
                    continue
                if text[j] == "[":
                    in_class = True
                elif text[j] == "]":
                    in_class = False
                elif text[j] == "/" and not in_class:
                    break
                j += 1
            if j < n and text[j] == "/":
                blank(i + 1, j, comment=False)
                i = j + 1
                continue
        i += 1
    return "".join(code), "".join(skel)


def _ident(c: str) -> bool:
    return c.isalnum() or c == "_"


def _regex_allowed(text: str, i: int) -> bool:
    """Guess whether ``/`` at ``i`` opens a JavaScript regex literal rather than a division."""
    j = i - 1
    while j >= 0 and text[j] in " \t\r\n":
        j -= 1
    if j < 0 or text[j] in _REGEX_BEFORE:
        return True
    k = j
    while k >= 0 and _ident(text[k]):
        k -= 1
    return text[k + 1 : j + 1] in _REGEX_KEYWORDS


def _template_end(text: str, i: int) -> int:
    """Index just past a JavaScript template literal, allowing ``${...}`` with braces inside."""
    n = len(text)
    j = i + 1
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "`":
            return j + 1
        if text.startswith("${", j):
            depth = 1
            j += 2
            while j < n and depth:
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                elif text[j] == "`":
                    j = _template_end(text, j) - 1
                j += 1
            continue
        j += 1
    return n


_PAIRS = {"(": ")", "[": "]", "{": "}"}


def match_bracket(skel: str, open_at: int) -> int:
    """Index of the bracket closing the one at ``open_at`` (or end of text if unbalanced)."""
    opener = skel[open_at]
    closer = _PAIRS[opener]
    depth = 0
    for j in range(open_at, len(skel)):
        ch = skel[j]
        if ch == opener:
            depth += 1
        elif ch == closer:
            depth -= 1
            if depth == 0:
                return j
    return len(skel) - 1


def enclosing_open(skel: str, pos: int, opener: str = "{") -> int:
    """Index of the innermost unmatched ``opener`` before ``pos``, or -1."""
    closer = _PAIRS[opener]
    depth = 0
    for j in range(pos - 1, -1, -1):
        ch = skel[j]
        if ch == closer:
            depth += 1
        elif ch == opener:
            if depth == 0:
                return j
            depth -= 1
    return -1


def split_top_level(skel: str, start: int, end: int) -> list[tuple[int, int]]:
    """Split ``skel[start:end]`` at depth-0 commas; returns stripped (start, end) pairs."""
    parts: list[tuple[int, int]] = []
    depth = 0
    begin = start
    for j in range(start, end):
        ch = skel[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append((begin, j))
            begin = j + 1
    parts.append((begin, end))
    out: list[tuple[int, int]] = []
    for a, b in parts:
        while a < b and skel[a].isspace():
            a += 1
        while b > a and skel[b - 1].isspace():
            b -= 1
        if a < b:
            out.append((a, b))
    return out


_STRING_AT = re.compile(r"""\s*(?:[A-Za-z_][\w:]*\(\s*)?(["'`])""")


def string_at(src: Source, pos: int, end: int) -> str | None:
    """The string literal at ``pos``; one wrapping call is allowed (``Cow::from("x")``)."""
    m = _STRING_AT.match(src.code, pos, end)
    if not m:
        return None
    q = m.end(1) - 1
    close = src.code.find(m.group(1), q + 1, end)
    if close < 0:
        return None
    value = src.code[q + 1 : close]
    return value if value and "\n" not in value else None


def top_level_key(src: Source, open_at: int, close_at: int, key: str) -> tuple[int, int] | None:
    """Value range of ``key: value`` or ``key = value`` directly inside braces at ``open_at``."""
    pattern = re.compile(r"""["']?\b""" + re.escape(key) + r"""\b["']?\s*[:=](?![:=])""")
    for a, b in split_top_level(src.skeleton, open_at + 1, close_at):
        m = pattern.match(src.code, a, b)
        if m:
            return m.end(), b
    return None


def body_after(src: Source, pos: int, limit: int | None = None) -> Segment | None:
    """The ``{...}`` block that starts after ``pos``; None if a ``;`` comes first."""
    skel = src.skeleton
    stop = len(skel) if limit is None else limit
    for j in range(pos, stop):
        ch = skel[j]
        if ch == "{":
            close = match_bracket(skel, j)
            if (
                re.search(r"\b(?:interface|struct)\s*$", skel[max(0, j - 12) : j])
                and not skel[j + 1 : close].strip()
            ):
                continue  # Go ``interface{}`` / ``struct{}`` in a signature
            return Segment(j, close + 1)
        if ch == ";":
            return None
    return None


def expr_end(skel: str, pos: int) -> int:
    """End of the expression starting at ``pos``: the first depth-0 ``,`` or ``;``, or an
    unmatched closing bracket."""
    depth = 0
    for j in range(pos, len(skel)):
        ch = skel[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j
            depth -= 1
        elif ch in ",;" and depth == 0:
            return j
    return len(skel)


def block_or_expr(src: Source, pos: int) -> Segment:
    """A ``{...}`` block if one starts at ``pos`` (after spaces), else the expression there."""
    skel = src.skeleton
    j = pos
    while j < len(skel) and skel[j].isspace():
        j += 1
    if j < len(skel) and skel[j] == "{":
        return Segment(j, match_bracket(skel, j) + 1)
    return Segment(j, expr_end(skel, j))


def callable_after_params(src: Source, paren: int) -> Segment | None:
    """Body of a function or arrow whose parameter list opens at ``paren``."""
    skel = src.skeleton
    close = match_bracket(skel, paren)
    m = re.compile(r"\s*(?::[^{;=]*?)?\s*(=>|\{)").match(skel, close + 1)
    if not m:
        return None
    if m.group(1) == "{":
        brace = m.end() - 1
        return Segment(brace, match_bracket(skel, brace) + 1)
    return block_or_expr(src, m.end())


def norm(name: str) -> str:
    """Compare names across naming styles: ``chargeCard`` == ``charge_card``."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def by_norm_name(src: Source, tool: str) -> list[Segment]:
    """Functions named like the tool (``charge_card``, ``handleChargeCard``...)."""
    base = norm(tool.rsplit(".", 1)[-1].rsplit("/", 1)[-1])
    wanted = {base, "handle" + base, base + "handler", base + "tool", "tool" + base}
    out: list[Segment] = []
    for fname, spans in src.functions.items():
        if norm(fname) in wanted:
            out.extend(spans)
    return out


def resolve_handler(src: Source, start: int, end: int) -> list[Segment]:
    """Segments for a handler argument: an inline function, or a same-file function name."""
    text = src.skeleton[start:end].strip()
    m = re.fullmatch(r"&?\s*([\w$]+(?:\s*(?:\.|::)\s*[\w$]+)*)", text)
    if m:
        name = re.split(r"\.|::", m.group(1))[-1].strip()
        return list(src.functions.get(name, []))
    return [Segment(start, end, "")] if text else []
