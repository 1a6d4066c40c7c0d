"""The memory store with its claim and complete steps in C, and the one place that chooses
the default memory store.

:class:`CMemoryStore` is :class:`~effectfence.store.memory.MemoryStore` with two methods
replaced by ``effectfence._memstore.Core`` (csrc/effectfence_memstore.c): the same
compare-and-set steps, the same locks, no rule. ``Core`` owns the store's structures and
exposes them as the attributes MemoryStore's Python methods use, so every other step (get,
fail, release, renew, clear, evict_domain, sweep, ...) is MemoryStore's own code.

:func:`memory_store` is what ``EffectFence()`` and ``open_store("memory:")`` build: the C
store when the extension is loaded (``EFFECTFENCE_COUNTERS`` is not ``pure``) and the counter
table is the atomic one, otherwise the Python store.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

from effectfence import _accel
from effectfence.cert import EffectCert
from effectfence.clock import merge_head
from effectfence.counters import CounterTable, new_table
from effectfence.protocol import IntentRecord, State
from effectfence.store.base import APPLIED, EMPTY_HEAD, MOVED, RACE, STALE, Head, Step
from effectfence.store.memory import (
    DEFAULT_AUDIT_KEEP,
    DEFAULT_STRIPES,
    DEFAULT_WHEEL_GRANULARITY,
    MemoryStore,
)

__all__ = ["CMemoryStore", "memory_store", "memory_store_kind"]


class _NotBuilt:
    """Stands in for ``Core`` when the extension is not loaded (CMemoryStore refuses)."""


_Core: Any = _NotBuilt
if _accel.memstore is not None:
    _Core = _accel.memstore.Core
    _accel.memstore.bind(
        IntentRecord,
        Step,
        Head,
        EMPTY_HEAD,
        APPLIED,
        MOVED,
        STALE,
        RACE,
        State.IN_FLIGHT,
        State.DONE,
        State.FAILED,
        merge_head,  # the head merge the C step calls (its slot is named merge_counts)
        heapq.heappush,
        EffectCert,
    )


class CMemoryStore(_Core, MemoryStore):  # type: ignore[misc]
    """MemoryStore whose claim and complete run in C (``effectfence._memstore``)."""

    # the same store to every caller (stats, the MCP server's "no thread hop for memory");
    # which implementation runs is reported by ``effectfence info`` (default_store)
    name = "memory"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        counters: CounterTable | None = None,
        stripes: int = DEFAULT_STRIPES,
        granularity: float = DEFAULT_WHEEL_GRANULARITY,
        audit_keep: int = DEFAULT_AUDIT_KEEP,
    ) -> None:
        if _accel.memstore is None:
            raise RuntimeError(f"the C memory store is {_accel.memstore_error}")
        MemoryStore.__init__(
            self,
            clock=clock,
            counters=counters,
            stripes=stripes,
            granularity=granularity,
            audit_keep=audit_keep,
        )


def memory_store_kind(counters: CounterTable | None = None) -> str:
    """Which memory store :func:`memory_store` builds for this table ("memory-c" when its
    claim and complete run in C, else "memory"); both call themselves "memory" in stats."""
    backend = counters.backend if counters is not None else new_table().backend
    if _accel.memstore is not None and backend == "atomic":
        return "memory-c"
    return "memory"


def memory_store(**options: Any) -> MemoryStore:
    """The default in-process store (see the module docstring); options go to its
    constructor (``clock``, ``counters``, ``stripes``, ``granularity``)."""
    counters = options.get("counters")
    if counters is None:
        counters = options["counters"] = new_table()
    if memory_store_kind(counters) == "memory-c":
        return CMemoryStore(**options)
    return MemoryStore(**options)
