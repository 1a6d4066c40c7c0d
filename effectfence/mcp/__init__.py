"""The MCP server room: agents route side-effecting tool calls through the fence over stdio.

``build_server`` and ``main`` import the ``mcp`` package (slow to import), so they are
loaded on first use; ``effectfence.mcp.models`` stays importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effectfence.mcp.server import build_server, main

__all__ = ["build_server", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from effectfence.mcp import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
