"""The architecture, enforced: the core does no I/O and never imports the rooms around it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "effectfence"
CORE = [
    "protocol.py",
    "fence.py",
    "model.py",
    "cert.py",
    "clock.py",
    "canonical.py",
    "errors.py",
    "tickets.py",
    "counters.py",
    "_atomic.py",
    "decorator.py",
    "store/base.py",
    "store/memory.py",
]
ROOMS = (
    "effectfence.mcp",
    "effectfence.scan",
    "effectfence.storm",
    "effectfence.cli",
    "effectfence.wrap",
    "effectfence.operator",
)
IO_MODULES = {"socket", "subprocess", "sqlite3", "http", "urllib", "asyncio.subprocess", "mcp"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_imports_no_room_and_no_io() -> None:
    for rel in CORE:
        mods = imported_modules(PKG / rel)
        rooms = {m for m in mods if m.startswith(ROOMS)}
        io = {m for m in mods if m.split(".")[0] in IO_MODULES or m in IO_MODULES}
        assert not rooms, f"{rel} imports {rooms}: rooms depend on the core, not the reverse"
        assert not io, f"{rel} imports {io}: the core does no I/O"


def test_importing_the_package_does_not_import_mcp() -> None:
    code = "import sys, effectfence; print('mcp' in sys.modules, 'effectfence.mcp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_wrap_never_imports_mcp() -> None:
    """The proxy is a line-level relay: it must start without paying ~1.5 s for ``mcp``."""
    code = (
        "import sys, effectfence.wrap.proxy, effectfence.wrap.probe, effectfence.wrap.demo; "
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_console_never_imports_mcp() -> None:
    """The console shares the bind rules with ``serve --http`` (``effectfence.binding``), not
    the server: an operator's page must start without paying ~1.5 s for ``mcp``."""
    code = (
        "import sys, effectfence.operator.console; "
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
