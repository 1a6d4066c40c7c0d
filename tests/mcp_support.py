"""Helpers shared by the in-memory MCP server tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mcp import Client

PAYLOAD_KEYS = {"code", "message", "retryable", "recover", "details"}


@asynccontextmanager
async def connect(server: Any) -> AsyncIterator[Client]:
    async with Client(server) as client:
        yield client


def req(intent: str = "charge:1", **over: Any) -> dict[str, Any]:
    """fence_prepare arguments for a small card charge, with fields overridden."""
    base: dict[str, Any] = {
        "intent": intent,
        "domain": "order:1",
        "tool": "charge_card",
        "args": {"cents": 500, "card": "tok_visa"},
        "agent": "agent-a",
    }
    base.update(over)
    return base
