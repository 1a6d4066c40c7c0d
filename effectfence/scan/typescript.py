"""TypeScript/JavaScript tool discovery: ``server.tool``/``registerTool``/``addTool``
calls and low-level ``{ name, inputSchema }`` lists dispatched by ``switch``/``if``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from .modules import resolve_js
from .source import (
    Import,
    Segment,
    Source,
    ToolDecl,
    block_or_expr,
    body_after,
    by_norm_name,
    callable_after_params,
    enclosing_open,
    match_bracket,
    resolve_handler,
    split_top_level,
    string_at,
    top_level_key,
)

if TYPE_CHECKING:
    from .package import Package

_ID = r"[A-Za-z_$][\w$]*"
_NOT_FUNCS = frozenset(
    ["if", "for", "while", "switch", "catch", "return", "function", "await", "typeof", "new"]
)
_FUNCTION = re.compile(r"\bfunction\s*\*?\s*(" + _ID + r")\s*(?:<[^>()]*>)?\s*\(")
_BINDING = re.compile(
    r"\b(?:const|let|var)\s+(" + _ID + r")\s*(?::[^=\n]+)?=\s*(?:async\s+)?"
    r"(?:function\b\s*\*?\s*(?:" + _ID + r")?\s*)?(\(|" + _ID + r"\s*=>)"
)
_METHOD = re.compile(
    r"(?m)^[ \t]*(?:(?:public|private|protected|static|async|override|readonly|export|default)"
    r"\s+)*(" + _ID + r")\s*(?:<[^>()]*>)?\("
)
_PROPERTY_FN = re.compile(
    r"""["']?("""
    + _ID
    + r""")["']?\s*:\s*(?:async\s+)?(?:function\b\s*\*?\s*(?:"""
    + _ID
    + r""")?\s*)?\("""
)
_TOOL_CALL = re.compile(r"\.\s*(tool|registerTool|addTool)\s*\(")
_INPUT_SCHEMA = re.compile(r"""["']?\b(inputSchema|input_schema)\b["']?\s*:""")


def _functions(src: Source) -> None:
    skel = src.skeleton
    for regex in (_FUNCTION, _BINDING, _METHOD, _PROPERTY_FN):
        for m in regex.finditer(skel):
            name = m.group(1)
            if name in _NOT_FUNCS:
                continue
            if regex is _BINDING and m.group(2).endswith("=>"):
                seg: Segment | None = block_or_expr(src, m.end())
            else:
                seg = callable_after_params(src, m.end() - 1)
            if seg is None:
                continue
            span = Segment(m.start(), seg.end)
            if span not in src.functions.get(name, []):
                src.functions.setdefault(name, []).append(span)


_STR = r"""(?P<q>["'`])(?P<v>[^"'`\n]+)(?P=q)"""
_CONST = re.compile(
    r"\b(?:export\s+)?(?:const|let|var)\s+(" + _ID + r")\s*(?::[^=\n]+)?=\s*" + _STR
)
# compiled TypeScript enum: ToolName["ECHO"] = "echo";
_ENUM_JS = re.compile(r"\b(" + _ID + r")\[\s*[\"'](" + _ID + r")[\"']\s*\]\s*=\s*" + _STR)
_ENUM_TS = re.compile(r"\benum\s+(" + _ID + r")\s*\{")
_OBJ_CONST = re.compile(r"\b(?:const|let|var)\s+(" + _ID + r")\s*(?::[^=\n]+)?=\s*\{")
_MEMBER = re.compile(r"""\s*["']?(""" + _ID + r""")["']?\s*[:=]\s*""" + _STR + r"\s*$")
_IMPORT = re.compile(
    # ``what`` never crosses a quote: in code without semicolons, an "import " inside a
    # string scanned to the end of the file, for every one (found by review: quadratic)
    r"""\bimport\s+(?:type\s+)?(?P<what>[^;"'`]*?)\s+from\s+["'](?P<spec>[^"']+)["']"""
    r"""|\b(?:const|let|var)\s+(?P<lhs>\{[^}]*\}|""" + _ID + r""")\s*=\s*require\s*\(\s*"""
    r"""["'](?P<rspec>[^"']+)["']\s*\)"""
)


def _constants(src: Source) -> None:
    """String constants and enum members a tool name may be written with."""
    code, skel = src.code, src.skeleton
    for m in _CONST.finditer(code):
        if skel[m.start(1)] != " ":  # not inside a string
            src.constants.setdefault(m.group(1), m.group("v"))
    for m in _ENUM_JS.finditer(code):
        src.constants.setdefault(f"{m.group(1)}.{m.group(2)}", m.group("v"))
    for regex in (_ENUM_TS, _OBJ_CONST):
        for m in regex.finditer(skel):
            open_at = m.end() - 1
            close = match_bracket(skel, open_at)
            for a, b in split_top_level(skel, open_at + 1, close):
                mm = _MEMBER.match(code[a:b])
                if mm:
                    src.constants.setdefault(f"{m.group(1)}.{mm.group(1)}", mm.group("v"))


def _imports(src: Source, root: Path) -> None:
    for m in _IMPORT.finditer(src.code):
        if src.skeleton[m.start()] == " ":
            continue
        spec = m.group("spec") or m.group("rspec")
        path = resolve_js(src.path, spec, root)
        if path is None:
            continue
        what = (m.group("what") or m.group("lhs") or "").strip()
        ns = re.search(r"\*\s*as\s+(" + _ID + r")", what)
        if ns:
            src.imports[ns.group(1)] = Import(path, None)
        named = re.search(r"\{([^}]*)\}", what)
        if named:
            for part in named.group(1).split(","):
                bits = re.split(r"\s+as\s+|\s*:\s*", part.strip())
                if bits and re.fullmatch(_ID, bits[0]):
                    src.imports[bits[-1].strip()] = Import(path, bits[0])
        default = re.match(r"(" + _ID + r")\s*(?:,|$)", what)
        if default and not what.startswith("{"):
            src.imports[default.group(1)] = Import(path, None)


def index(src: Source, root: Path) -> None:
    """Fill ``src.functions``, ``src.constants`` and ``src.imports``."""
    if src.functions or src.constants or src.imports:
        return
    _functions(src)
    _constants(src)
    _imports(src, root)


def constant(src: Source, expr: str, package: Package | None) -> str | None:
    """The string an identifier or ``Enum.MEMBER`` stands for, here or in an import."""
    expr = re.sub(r"\s+", "", expr)
    if expr in src.constants:
        return src.constants[expr]
    head, _, rest = expr.partition(".")
    imp = src.imports.get(head)
    if imp is None or package is None:
        return None
    other = package.load(imp.path)
    if other is None:
        return None
    key = ".".join(p for p in (imp.name, rest) if p)
    return other.constants.get(key)


def _name_at(src: Source, a: int, b: int, package: Package | None) -> str | None:
    """A tool name written as a literal, or as a constant that resolves to one."""
    literal = string_at(src, a, b)
    if literal:
        return literal
    text = src.skeleton[a:b].strip()
    if not re.fullmatch(_ID + r"(?:\s*\.\s*" + _ID + r")*", text):
        return None
    found = constant(src, text, package)
    if found is None and re.match(r"[A-Z]", text):
        return f"<{text}>"  # a constant the scan could not read: say so, never guess
    return found


def find_tools(src: Source, package: Package | None = None) -> list[ToolDecl]:
    index(src, package.root if package is not None else src.path.parent)
    skel = src.skeleton
    tools: list[ToolDecl] = []
    spans: list[tuple[int, int]] = []

    for m in _TOOL_CALL.finditer(skel):
        open_at = m.end() - 1
        close = match_bracket(skel, open_at)
        args = split_top_level(skel, open_at + 1, close)
        if not args:
            continue
        a0, b0 = args[0]
        name_at = a0
        name = _name_at(src, a0, b0, package) if skel[a0] != "{" else None
        if name is None and skel[a0] == "{":
            key = top_level_key(src, a0, b0 - 1, "name")
            if key:
                name = _name_at(src, key[0], key[1], package)
                name_at = key[0]
        if not name:
            continue
        call = Segment(m.start(), close + 1)
        body = [call]
        for a, b in args[1:]:
            if re.fullmatch(r"[\w$.]+", skel[a:b]):
                body.extend(resolve_handler(src, a, b))
        spans.append((call.start, call.end))
        tools.append(ToolDecl(name, src.line_of(name_at), [call], body, _description(src, args)))

    for m in _INPUT_SCHEMA.finditer(skel):
        open_at = enclosing_open(skel, m.start())
        if open_at < 0 or any(a <= open_at < b for a, b in spans):
            continue
        close = match_bracket(skel, open_at)
        key = top_level_key(src, open_at, close, "name")
        name = _name_at(src, key[0], key[1], package) if key else None
        if not key or not name:
            continue
        decl = Segment(open_at, close + 1)
        spans.append((decl.start, decl.end))
        desc_key = top_level_key(src, open_at, close, "description")
        desc = string_at(src, desc_key[0], desc_key[1]) if desc_key else None
        tools.append(
            ToolDecl(
                name,
                src.line_of(key[0]),
                [decl],
                _dispatch(src, name, spans, src.code[key[0] : key[1]].strip()),
                desc or "",
            )
        )
    return tools


def _description(src: Source, args: list[tuple[int, int]]) -> str:
    if len(args) > 1:
        return string_at(src, *args[1]) or ""
    return ""


def _dispatch(
    src: Source, name: str, decls: list[tuple[int, int]], spelled: str = ""
) -> list[Segment]:
    """The code a low-level ``CallToolRequestSchema`` handler runs for ``name``; the
    ``case`` may spell it as a literal or as the constant the declaration used."""
    code, skel = src.code, src.skeleton
    q = r"""["'`]""" + re.escape(name) + r"""["'`]"""
    if spelled and re.fullmatch(_ID + r"(?:\s*\.\s*" + _ID + r")*", spelled):
        q = "(?:" + q + r"|(?<![\w$.])" + re.escape(spelled) + r"(?![\w$]))"
    segs: list[Segment] = []
    for m in re.finditer(r"\bcase\s+" + q + r"\s*:", code):
        start = m.end()
        depth = 0
        end = len(skel)
        j = start
        while j < len(skel):
            ch = skel[j]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
                if depth < 0:
                    end = j
                    break
            elif (
                depth == 0
                and re.match(r"\b(?:case|default)\b", skel[j : j + 8])
                and (j == 0 or not skel[j - 1].isalnum())
            ):
                end = j
                break
            j += 1
        segs.append(Segment(start, end))
    for m in re.finditer(r"===?\s*" + q + r"|" + q + r"\s*===?", code):
        block = body_after(src, m.end())
        if block is not None:
            segs.append(block)
    for m in re.finditer(r"""(?<![\w$])["']?""" + re.escape(name) + r"""["']?\s*:(?!:)""", code):
        if any(a <= m.start() < b for a, b in decls):
            continue
        value = block_or_expr(src, m.end())
        segs.extend(resolve_handler(src, value.start, value.end))
    return segs or by_norm_name(src, name)
