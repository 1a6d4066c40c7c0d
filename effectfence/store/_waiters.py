"""Waiters of a shared store, woken by the store's notifications (LISTEN, pub/sub).

The server stores publish "intent X changed" on every transition; one listener thread per
store object (on a connection of its own) hands each message to the waiters of that intent.
A waiter registers *before* it re-reads the record, so a transition between its read and
its wait is never missed; it never waits past its timeout, and it re-reads at least every
``poll`` seconds, so a notification lost with a dropped listener connection costs latency,
not correctness.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from effectfence.protocol import IntentRecord
from effectfence.store import _fork
from effectfence.store.base import same_record

__all__ = ["Waiters"]

#: re-read at least this often while waiting, in case a notification was lost
DEFAULT_POLL = 1.0


class Waiters:
    """intent key -> events of the threads waiting for it."""

    def __init__(self, poll: float = DEFAULT_POLL) -> None:
        self._lock = _fork.lock()
        self._events: dict[str, list[threading.Event]] = {}
        self.poll = poll

    def wake(self, key: str) -> None:
        """A notification arrived for ``key`` (called by the listener thread)."""
        with self._lock:
            events = self._events.pop(key, None)
        for ev in events or ():
            ev.set()

    def wake_all(self) -> None:
        """The listener reconnected: anything may have changed meanwhile."""
        with self._lock:
            all_events, self._events = self._events, {}
        for events in all_events.values():
            for ev in events:
                ev.set()

    def wait(
        self,
        key: str,
        seen: IntentRecord | None,
        timeout: float,
        get: Callable[[], IntentRecord | None],
        listening: Callable[[], bool],
    ) -> bool:
        """Block up to ``timeout`` s until ``get()`` is no longer ``seen``; True if changed.

        ``listening()`` starts the listener if needed and says whether it runs; when it does
        not, the waiter polls every ``poll`` seconds (bounded by the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            ev = threading.Event()
            with self._lock:
                self._events.setdefault(key, []).append(ev)
            try:
                live = listening()
                if not same_record(get(), seen):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ev.wait(min(left, self.poll if live else min(self.poll, 0.05)))
            finally:
                with self._lock:
                    events = self._events.get(key)
                    if events is not None and ev in events:
                        events.remove(ev)
                        if not events:
                            del self._events[key]
            if time.monotonic() >= deadline:
                return not same_record(get(), seen)
