"""Python tool discovery with ``ast``: decorators, ``add_tool``/``self.tool(fn)`` and
low-level ``Tool(...)``.

The ``ast`` module gives exact function extents, so a tool's body never runs into the
next definition, and docstrings are told apart from code.  A tool's name is what a
client sees in ``tools/list``: ``name=GitTools.COMMIT.value`` is looked up in the enum,
never replaced by the Python function's name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .modules import resolve_py
from .source import Import, Segment, Source, ToolDecl

if TYPE_CHECKING:
    from .package import Package

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


def _dotted(node: ast.expr) -> str | None:
    """``GitTools.COMMIT.value`` -> ``GitTools.COMMIT``; None for anything but names."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    parts.reverse()
    if len(parts) > 1 and parts[-1] == "value":
        parts.pop()  # a str Enum member and its ``.value`` reach the client as one string
    return ".".join(parts)


def _collect_constants(src: Source, tree: ast.Module) -> None:
    """Module-level string constants and string members of module-level classes (enums)."""

    def assigned(stmt: ast.stmt) -> tuple[list[str], ast.expr | None]:
        if isinstance(stmt, ast.Assign):
            return [t.id for t in stmt.targets if isinstance(t, ast.Name)], stmt.value
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            return [stmt.target.id], stmt.value
        return [], None

    for stmt in tree.body:
        names, value = assigned(stmt)
        if (text := _const_str(value)) is not None:
            for n in names:
                src.constants[n] = text
        if isinstance(stmt, ast.ClassDef):
            for inner in stmt.body:
                names, value = assigned(inner)
                if (text := _const_str(value)) is not None:
                    for n in names:
                        src.constants[f"{stmt.name}.{n}"] = text


def _collect_imports(src: Source, tree: ast.Module, root: Path) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                local = alias.asname or alias.name
                # ``from . import files`` binds a module, ``from .lib import f`` a name
                sub = resolve_py(src.path, f"{module}.{alias.name}", node.level, root)
                if sub is not None:
                    src.imports[local] = Import(sub, None)
                    continue
                path = resolve_py(src.path, module, node.level, root)
                if path is not None:
                    src.imports[local] = Import(path, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                path = resolve_py(src.path, alias.name, 0, root)
                if path is not None:
                    src.imports[alias.asname or alias.name.rsplit(".", 1)[-1]] = Import(path, None)


def index(src: Source, root: Path) -> ast.Module | None:
    """Fill ``src.functions``, ``src.constants`` and ``src.imports``; the parsed tree."""
    try:
        tree = ast.parse(src.text)
    except SyntaxError as exc:  # Python 2, a template, a file cut short
        src.unparsed = f"Python that does not parse (line {exc.lineno}: {exc.msg}); not read"
        return None
    except (ValueError, RecursionError, MemoryError) as exc:  # generated tables, NUL bytes
        src.unparsed = f"Python that cannot be parsed ({type(exc).__name__}); not read"
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            spans = src.functions.setdefault(node.name, [])
            spans.extend(s for s in _func_segments(src, node) if s not in spans)
        if isinstance(node, ast.ClassDef):
            src.methods.update(
                f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    _collect_constants(src, tree)
    _collect_imports(src, tree, root)
    return tree


def constant(src: Source, node: ast.expr | None, package: Package | None) -> str | None:
    """The string a name expression stands for: a literal, a constant, an enum member,
    here or in a module this file imports."""
    if node is None:
        return None
    if (text := _const_str(node)) is not None:
        return text
    dotted = _dotted(node)
    if dotted is None:
        return None
    if dotted in src.constants:
        return src.constants[dotted]
    head, _, rest = dotted.partition(".")
    imp = src.imports.get(head)
    if imp is None or package is None:
        return None
    other = package.load(imp.path)
    if other is None:
        return None
    key = ".".join(p for p in (imp.name, rest) if p)
    return other.constants.get(key)


def _aliases(tree: ast.Module) -> dict[str, list[str]]:
    """``store_foo = store`` and ``find_foo = wrap(find_foo, ...)``: what a name may hold."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name):
            continue
        value = node.value
        if isinstance(value, ast.Call) and value.args:
            value = value.args[0]  # a wrapper keeps the wrapped function's body
        if isinstance(value, ast.Name) and value.id != target.id:
            out.setdefault(target.id, []).append(value.id)
    return out


def _function_of(
    node: ast.expr, funcs: dict[str, list[_FuncNode]], aliases: dict[str, list[str]]
) -> str | None:
    """The function a registration argument names, following aliases a few steps."""
    if not isinstance(node, ast.Name):
        return None
    todo, seen = [node.id], set[str]()
    while todo:
        name = todo.pop(0)
        if name in funcs:
            return name
        if name in seen or len(seen) > 8:
            continue
        seen.add(name)
        todo.extend(aliases.get(name, []))
    return None


def find_tools(src: Source, package: Package | None = None) -> list[ToolDecl]:
    root = package.root if package is not None else src.path.parent
    tree = index(src, root)
    if tree is None:
        return []
    funcs: dict[str, list[_FuncNode]] = {}
    assigns: dict[str, ast.Assign] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            funcs.setdefault(node.name, []).append(node)
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    assigns[target.id] = stmt
    aliases = _aliases(tree)
    mentions_mcp = "mcp" in src.text.lower()
    tools: list[ToolDecl] = []

    def decl_segments(call: ast.Call | None, node: ast.AST) -> list[Segment]:
        segs = [_lines(src, getattr(node, "lineno", 1), getattr(node, "end_lineno", 1) or 1)]
        ann = _kw(call, "annotations") if call else None
        if isinstance(ann, ast.Name) and ann.id in assigns:
            a = assigns[ann.id]
            segs.append(_lines(src, a.lineno, a.end_lineno or a.lineno))
        return segs

    def tool_name(expr: ast.expr | None) -> str | None:
        """The client-visible name, or the expression's text when it cannot be resolved
        (never the Python function's name, which no client can call)."""
        if expr is None:
            return None
        found = constant(src, expr, package)
        if found:
            return found
        try:
            text = ast.unparse(expr)
        except RecursionError:  # a name built of hundreds of terms
            text = "expression"
        return f"<{text[:200]}>"

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
                name = tool_name(call.args[0] if call.args else _kw(call, "name"))
                desc = constant(src, _kw(call, "description"), package)
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
        # ``mcp.add_tool(fn)``, ``self.tool(fn, name=...)``, ``mcp.tool(name="x")(fn)``
        reg: ast.Call | None = None
        if callee == "add_tool" or (callee == "tool" and isinstance(node.func, ast.Attribute)):
            reg = node
        elif isinstance(node.func, ast.Call) and _callee(node.func.func) == "tool":
            reg = node.func
        fn_name = _function_of(node.args[0], funcs, aliases) if reg and node.args else None
        if reg is not None and fn_name is not None:
            body = [s for f in funcs.get(fn_name, []) for s in _func_segments(src, f)]
            doc = next((ast.get_docstring(f) for f in funcs.get(fn_name, [])), None)
            tools.append(
                ToolDecl(
                    name=tool_name(_kw(reg, "name")) or fn_name,
                    line=node.lineno,
                    decl=decl_segments(reg, node),
                    body=body,
                    description=constant(src, _kw(reg, "description"), package) or doc or "",
                )
            )
        elif callee == "Tool":
            name = tool_name(_kw(node, "name") or (node.args[0] if node.args else None))
            if name:
                tools.append(
                    ToolDecl(
                        name=name,
                        line=node.lineno,
                        decl=decl_segments(node, node),
                        body=_dispatch(src, tree, funcs, name, package),
                        description=constant(src, _kw(node, "description"), package) or "",
                    )
                )
    return tools


def _dispatch(
    src: Source,
    tree: ast.Module,
    funcs: dict[str, list[_FuncNode]],
    name: str,
    package: Package | None,
) -> list[Segment]:
    """Find the code a low-level ``call_tool`` handler runs for ``name``; the branch may
    compare with a constant (``case GitTools.STATUS:``) as well as with a literal."""
    segs: list[Segment] = []

    def block(stmts: list[ast.stmt]) -> None:
        if stmts:
            segs.append(_lines(src, stmts[0].lineno, stmts[-1].end_lineno or stmts[-1].lineno))

    def means(node: ast.expr | None) -> bool:
        return constant(src, node, package) == name

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            test = node.test
            sides = [test.left, *test.comparators]
            if len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq) and any(map(means, sides)):
                block(node.body)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                pat = case.pattern
                if isinstance(pat, ast.MatchValue) and means(pat.value):
                    block(case.body)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and means(key):
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
