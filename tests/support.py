"""Test support shared by the suites: an injected clock and the registry of stores.

``STORES`` is the one registry the guarantee suites parametrize over: a store added to the
project adds itself here and joins every conformance, chaos and stateful test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from effectfence import EffectFence
from effectfence.counters import AtomicCounterTable, new_table
from effectfence.store.base import FenceStore
from effectfence.store.memory import MemoryStore


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _memory(backend: str) -> Callable[[FakeClock], FenceStore]:
    def make(clock: FakeClock) -> FenceStore:
        return MemoryStore(clock=clock, counters=new_table(backend))

    return make


STORES: dict[str, Callable[[FakeClock], FenceStore]] = {
    "memory-pure": _memory("pure"),
}
if AtomicCounterTable is not None:
    STORES["memory-atomic"] = _memory("atomic")


FenceFactory = Callable[..., EffectFence]


T = TypeVar("T")


def race(n: int, fn: Callable[[int], T]) -> list[T | BaseException]:
    """Run ``fn(i)`` in ``n`` real OS threads released together by a Barrier.

    The threads are built and parked first, so the collision is forced, not hoped for.
    Returns each thread's result or the exception it raised, in thread order.
    """
    barrier = threading.Barrier(n)
    out: list[T | BaseException | None] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as exc:  # collected, asserted on by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in out if o is not None]
