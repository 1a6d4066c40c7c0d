"""Go tool discovery: mark3labs ``mcp.NewTool`` + ``s.AddTool(tool, handler)`` and the
official SDK's ``mcp.AddTool(server, &mcp.Tool{Name: ...}, handler)``.
"""

from __future__ import annotations

import re

from .source import (
    Segment,
    Source,
    ToolDecl,
    body_after,
    by_norm_name,
    enclosing_open,
    match_bracket,
    resolve_handler,
    split_top_level,
    string_at,
    top_level_key,
)

_FUNC = re.compile(r"(?m)^func\s+(?:\([^)]*\)\s*)?([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\(")
_CLOSURE = re.compile(r"\b([A-Za-z_]\w*)\s*:?=\s*func\s*\(")
_NEW_TOOL = re.compile(r"\bNewTool\s*\(")
_TOOL_LIT = re.compile(r"&?\s*\bmcp\s*\.\s*Tool\s*\{")


def _functions(src: Source) -> None:
    for regex in (_FUNC, _CLOSURE):
        for m in regex.finditer(src.skeleton):
            params_close = match_bracket(src.skeleton, m.end() - 1)
            body = body_after(src, params_close + 1)
            if body is not None:
                src.functions.setdefault(m.group(1), []).append(Segment(m.start(), body.end))


def _handler_for(src: Source, start: int, end: int) -> list[Segment]:
    """Find the handler registered with the tool expression at ``start:end``."""
    skel = src.skeleton
    # 1. The tool expression is itself an argument of AddTool(...).
    paren = enclosing_open(skel, start, "(")
    if paren >= 0 and re.search(r"\bAddTools?\s*$", skel[max(0, paren - 20) : paren]):
        args = split_top_level(skel, paren + 1, match_bracket(skel, paren))
        for i, (a, b) in enumerate(args):
            if a <= start < b and i + 1 < len(args):
                return resolve_handler(src, *args[i + 1])
    # 2. A composite literal such as server.ServerTool{Tool: ..., Handler: h}.
    brace = enclosing_open(skel, start, "{")
    if brace >= 0:
        key = top_level_key(src, brace, match_bracket(skel, brace), "Handler")
        if key:
            return resolve_handler(src, *key)
    # 3. Assigned to a variable that a later AddTool call uses.
    line_start = skel.rfind("\n", 0, start) + 1
    assigned = re.search(r"\b([A-Za-z_]\w*)\s*:?=\s*&?\s*(?:\w+\s*\.\s*)?$", skel[line_start:start])
    if assigned:
        var = re.escape(assigned.group(1))
        for m in re.finditer(r"\bAddTools?\s*\(", skel):
            close = match_bracket(skel, m.end() - 1)
            args = split_top_level(skel, m.end(), close)
            for i, (a, b) in enumerate(args):
                if re.fullmatch(r"&?\s*" + var, skel[a:b]) and i + 1 < len(args):
                    return resolve_handler(src, *args[i + 1])
    return []


def index(src: Source) -> None:
    """Fill ``src.functions`` (imports are not followed in this language)."""
    if not src.functions:
        _functions(src)


def find_tools(src: Source, package: object = None) -> list[ToolDecl]:
    index(src)
    skel = src.skeleton
    tools: list[ToolDecl] = []
    for m in _NEW_TOOL.finditer(skel):
        close = match_bracket(skel, m.end() - 1)
        args = split_top_level(skel, m.end(), close)
        name = string_at(src, *args[0]) if args else None
        if not name:
            continue
        decl = Segment(m.start(), close + 1)
        desc_m = re.search(r'WithDescription\s*\(\s*"([^"\n]*)"', src.code[decl.start : decl.end])
        body = _handler_for(src, m.start(), decl.end) or by_norm_name(src, name)
        tools.append(
            ToolDecl(name, src.line_of(m.start()), [decl], body, desc_m.group(1) if desc_m else "")
        )
    for m in _TOOL_LIT.finditer(skel):
        brace = m.end() - 1
        close = match_bracket(skel, brace)
        key = top_level_key(src, brace, close, "Name")
        name = string_at(src, *key) if key else None
        if not key or not name:
            continue
        decl = Segment(m.start(), close + 1)
        dkey = top_level_key(src, brace, close, "Description")
        desc = string_at(src, *dkey) if dkey else None
        body = _handler_for(src, m.start(), decl.end) or by_norm_name(src, name)
        tools.append(ToolDecl(name, src.line_of(key[0]), [decl], body, desc or ""))
    return tools
