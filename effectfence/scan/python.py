"""Python tool discovery with ``ast``: decorators, ``add_tool`` and low-level ``Tool(...)``.

The ``ast`` module gives exact function extents, so a tool's body never runs into the
next definition, and docstrings are told apart from code.
"""

from __future__ import annotations

import ast
import re

from .source import Segment, Source, ToolDecl

_FuncNode = ast.FunctionDef | ast.AsyncFunctionDef


def _lines(src: Source, first: int, last: int) -> Segment:
    return Segment(src.line_start(first), src.line_end(last))


def _func_segments(src: Source, node: _FuncNode) -> list[Segment]:
    """The function's lines from its first decorator, minus the docstring."""
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    last = node.end_lineno or node.lineno
    body0 = node.body[0] if node.body else None
    if (
        isinstance(body0, ast.Expr)
        and isinstance(body0.value, ast.Constant)
        and isinstance(body0.value.value, str)
    ):
        doc_first, doc_last = body0.lineno, body0.end_lineno or body0.lineno
        parts = []
        if doc_first > first:
            parts.append(_lines(src, first, doc_first - 1))
        if last > doc_last:
            parts.append(_lines(src, doc_last + 1, last))
        return parts
    return [_lines(src, first, last)]


def _const_str(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _callee(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_tools(src: Source) -> list[ToolDecl]:
    try:
        tree = ast.parse(src.text)
    except (SyntaxError, ValueError):
        return []
    funcs: dict[str, list[_FuncNode]] = {}
    assigns: dict[str, ast.Assign] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            funcs.setdefault(node.name, []).append(node)
            src.functions.setdefault(node.name, []).extend(_func_segments(src, node))
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    assigns[target.id] = stmt
    mentions_mcp = "mcp" in src.text.lower()
    tools: list[ToolDecl] = []

    def decl_segments(call: ast.Call | None, node: ast.AST) -> list[Segment]:
        segs = [_lines(src, getattr(node, "lineno", 1), getattr(node, "end_lineno", 1) or 1)]
        ann = _kw(call, "annotations") if call else None
        if isinstance(ann, ast.Name) and ann.id in assigns:
            a = assigns[ann.id]
            segs.append(_lines(src, a.lineno, a.end_lineno or a.lineno))
        return segs

    for fnode in (n for ns in funcs.values() for n in ns):
        for dec in fnode.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            is_tool = (isinstance(target, ast.Attribute) and target.attr == "tool") or (
                isinstance(target, ast.Name) and target.id == "tool" and mentions_mcp
            )
            if not is_tool:
                continue
            call = dec if isinstance(dec, ast.Call) else None
            name = None
            desc = None
            if call:
                name = _const_str(call.args[0]) if call.args else None
                name = name or _const_str(_kw(call, "name"))
                desc = _const_str(_kw(call, "description"))
            tools.append(
                ToolDecl(
                    name=name or fnode.name,
                    line=fnode.lineno,
                    decl=decl_segments(call, dec),
                    body=_func_segments(src, fnode),
                    description=desc or ast.get_docstring(fnode) or "",
                )
            )
            break

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node.func)
        if (
            callee == "add_tool"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in funcs  # a parameter named ``fn`` is the SDK, not a tool
        ):
            fn_name = node.args[0].id
            body = [s for f in funcs.get(fn_name, []) for s in _func_segments(src, f)]
            doc = next((ast.get_docstring(f) for f in funcs.get(fn_name, [])), None)
            tools.append(
                ToolDecl(
                    name=_const_str(_kw(node, "name")) or fn_name,
                    line=node.lineno,
                    decl=decl_segments(node, node),
                    body=body,
                    description=_const_str(_kw(node, "description")) or doc or "",
                )
            )
        elif callee == "Tool":
            name = _const_str(_kw(node, "name"))
            if name:
                tools.append(
                    ToolDecl(
                        name=name,
                        line=node.lineno,
                        decl=decl_segments(node, node),
                        body=_dispatch(src, tree, funcs, name),
                        description=_const_str(_kw(node, "description")) or "",
                    )
                )
    return tools


def _dispatch(
    src: Source, tree: ast.Module, funcs: dict[str, list[_FuncNode]], name: str
) -> list[Segment]:
    """Find the code a low-level ``call_tool`` handler runs for ``name``."""
    segs: list[Segment] = []

    def block(stmts: list[ast.stmt]) -> None:
        if stmts:
            segs.append(_lines(src, stmts[0].lineno, stmts[-1].end_lineno or stmts[-1].lineno))

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            test = node.test
            sides = [test.left, *test.comparators]
            if (
                len(test.ops) == 1
                and isinstance(test.ops[0], ast.Eq)
                and any(_const_str(s) == name for s in sides)
            ):
                block(node.body)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                pat = case.pattern
                if isinstance(pat, ast.MatchValue) and _const_str(pat.value) == name:
                    block(case.body)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and _const_str(key) == name:
                    for f in funcs.get(_callee(value), []):
                        segs.extend(_func_segments(src, f))
    if not segs:
        base = _norm(name)
        wanted = {base, "handle" + base, base + "handler", base + "tool"}
        for fname, nodes in funcs.items():
            if _norm(fname) in wanted:
                for f in nodes:
                    segs.extend(_func_segments(src, f))
    return segs
