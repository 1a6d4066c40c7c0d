"""TypeScript/JavaScript tool discovery: ``server.tool``/``registerTool``/``addTool``
calls and low-level ``{ name, inputSchema }`` lists dispatched by ``switch``/``if``.
"""

from __future__ import annotations

import re

from .source import (
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


def find_tools(src: Source) -> list[ToolDecl]:
    _functions(src)
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
        name = string_at(src, a0, b0)
        if name is None and skel[a0] == "{":
            key = top_level_key(src, a0, b0 - 1, "name")
            if key:
                name = string_at(src, key[0], key[1])
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
        name = string_at(src, key[0], key[1]) if key else None
        if not key or not name:
            continue
        decl = Segment(open_at, close + 1)
        spans.append((decl.start, decl.end))
        desc_key = top_level_key(src, open_at, close, "description")
        desc = string_at(src, desc_key[0], desc_key[1]) if desc_key else None
        tools.append(
            ToolDecl(name, src.line_of(key[0]), [decl], _dispatch(src, name, spans), desc or "")
        )
    return tools


def _description(src: Source, args: list[tuple[int, int]]) -> str:
    if len(args) > 1:
        return string_at(src, *args[1]) or ""
    return ""


def _dispatch(src: Source, name: str, decls: list[tuple[int, int]]) -> list[Segment]:
    """The code a low-level ``CallToolRequestSchema`` handler runs for ``name``."""
    code, skel = src.code, src.skeleton
    q = r"""["'`]""" + re.escape(name) + r"""["'`]"""
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
