"""Rust tool discovery: rmcp ``#[tool(...)]`` methods (inside ``#[tool_router]`` or
``#[tool(tool_box)]`` impls) and low-level ``Tool::new("name", ...)`` with a ``match``.
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
    match_bracket,
    split_top_level,
    string_at,
    top_level_key,
)

_FN = re.compile(r"\bfn\s+([A-Za-z_]\w*)\s*")
_TOOL_ATTR = re.compile(r"#\s*\[\s*tool\s*(?=[(\]])")
_AFTER_ATTR = re.compile(
    r"(?:\s*#\s*\[[^\]]*\])*\s*(?:pub(?:\s*\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?"
    r"(?:unsafe\s+)?(?:extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_]\w*)"
)
_TOOL_NEW = re.compile(r"\bTool\s*::\s*new\s*\(")
_TOOL_STRUCT = re.compile(r"\bTool\s*\{")


def _fn_body(src: Source, after_name: int) -> Segment | None:
    skel = src.skeleton
    j = after_name
    while j < len(skel) and skel[j].isspace():
        j += 1
    if j < len(skel) and skel[j] == "<":  # generics, possibly nested
        depth = 0
        while j < len(skel):
            depth += {"<": 1, ">": -1}.get(skel[j], 0)
            j += 1
            if depth == 0:
                break
    paren = skel.find("(", j)
    if paren < 0:
        return None
    return body_after(src, match_bracket(skel, paren) + 1)


def _functions(src: Source) -> None:
    for m in _FN.finditer(src.skeleton):
        body = _fn_body(src, m.end())
        if body is not None:
            src.functions.setdefault(m.group(1), []).append(Segment(m.start(), body.end))


def index(src: Source) -> None:
    """Fill ``src.functions`` (imports are not followed in this language)."""
    if not src.functions:
        _functions(src)


def find_tools(src: Source, package: object = None) -> list[ToolDecl]:
    index(src)
    skel, code = src.skeleton, src.code
    tools: list[ToolDecl] = []
    for m in _TOOL_ATTR.finditer(skel):
        bracket = skel.rfind("[", m.start(), m.end())
        attr = Segment(m.start(), match_bracket(skel, bracket) + 1)
        attr_text = code[attr.start : attr.end]
        if re.search(r"\btool_box\b", attr_text) and "description" not in attr_text:
            continue  # ``#[tool(tool_box)]`` marks the impl block, not a tool
        fn = _AFTER_ATTR.match(skel, attr.end)
        if not fn:
            continue
        body = _fn_body(src, fn.end())
        if body is None:
            continue
        named = re.search(r'\bname\s*=\s*"([^"\n]+)"', attr_text)
        described = re.search(r'\bdescription\s*=\s*"([^"\n]*)"', attr_text)
        tools.append(
            ToolDecl(
                named.group(1) if named else fn.group(1),
                src.line_of(fn.start(1)),
                [attr],
                [Segment(attr.start, body.end)],
                described.group(1) if described else "",
            )
        )
    for regex in (_TOOL_NEW, _TOOL_STRUCT):
        for m in regex.finditer(skel):
            open_at = m.end() - 1
            close = match_bracket(skel, open_at)
            if regex is _TOOL_NEW:
                args = split_top_level(skel, open_at + 1, close)
                name = string_at(src, *args[0]) if args else None
                desc = string_at(src, *args[1]) if len(args) > 1 else None
            else:
                key = top_level_key(src, open_at, close, "name")
                name = string_at(src, *key) if key else None
                dkey = top_level_key(src, open_at, close, "description")
                desc = string_at(src, *dkey) if dkey else None
            if not name:
                continue
            decl = Segment(m.start(), close + 1)
            tools.append(
                ToolDecl(name, src.line_of(m.start()), [decl], _dispatch(src, name), desc or "")
            )
    return tools


def _dispatch(src: Source, name: str) -> list[Segment]:
    """Match arms ``"name" => ...`` of a ``call_tool`` implementation, else a same-named fn."""
    segs: list[Segment] = []
    for m in re.finditer(r'"' + re.escape(name) + r'"\s*(?:\|[^=]*)?=>', src.code):
        segs.append(block_or_expr(src, m.end()))
    return segs or by_norm_name(src, name)
