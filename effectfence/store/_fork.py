"""Which side of a ``fork()`` this process is on, for stores opened before one.

A store's connections belong to the process that opened them: a forked child that used
them would share a socket with its parent (PostgreSQL: two processes' messages interleaved
on one session) or hold none of SQLite's locks (POSIX locks are not inherited). Stores
compare :func:`generation` with the value they were opened at and, when it moved, open
their own connections (PostgreSQL, Redis) or refuse (SQLite, whose per-process table of
open files a child inherits without the locks, so even its new connections to a file the
parent had open hold none). The inherited ones go to :func:`abandon`: never used again and
never closed, since closing them in the child would act on the parent's session or file.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["LOCK", "abandon", "generation", "lock", "rlock"]

_GENERATION = [0]
_ABANDONED: list[Any] = []
_LOCKS: weakref.WeakSet[Any] = weakref.WeakSet()

#: held while a store moves off its inherited connections (reset in every child)
LOCK = threading.Lock()


def generation() -> int:
    """Bumped in every forked child: a store opened at another value was opened before."""
    return _GENERATION[0]


def lock() -> threading.Lock:
    """A lock a forked child finds released. A thread of the parent that held it at the
    fork does not exist in the child, which would wait for it forever; the structures such
    a lock guards change in single bytecodes, so they are whole at any fork."""
    new = threading.Lock()
    _LOCKS.add(new)
    return new


def rlock() -> Any:
    """:func:`lock`, reentrant: for state a signal handler may touch while the thread it
    interrupted holds the lock (a plain lock would deadlock that thread on itself)."""
    new = threading.RLock()
    _LOCKS.add(new)
    return new


def abandon(*objs: Any) -> None:
    """Keep ``objs`` alive and untouched for the life of this process."""
    _ABANDONED.extend(o for o in objs if o is not None)


def _after_fork_in_child() -> None:
    LOCK._at_fork_reinit()  # type: ignore[attr-defined]
    for held in list(_LOCKS):
        held._at_fork_reinit()
    _GENERATION[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)
