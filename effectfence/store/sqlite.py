"""The SQLite store: one file shared by every process on a host, durable across restarts.

It decides nothing (the rules are in :mod:`effectfence.protocol`); each step of
:mod:`effectfence.store.base` runs whole inside ONE ``BEGIN IMMEDIATE`` transaction (alone, or
with the steps that waited for the lock with it, each in its own savepoint) whose conditions
are the plain comparisons the decider chose, so a process killed at any instant leaves either
the whole step or none of it.

Design
------
- WAL, so readers (replays) never wait for the writer, and ``BEGIN IMMEDIATE`` for every
  write step (steps that wait for it together share one: see :meth:`SQLiteStore._write`):
  it takes the write lock up front, where ``busy_timeout`` waits for it. A
  deferred transaction that reads and then writes fails with "database is locked" when
  another writer got there first, and no timeout helps (issue #12 measured ~108k such
  errors with four processes).
- ``synchronous=FULL`` by default: a step that answered APPLIED survives a power cut.
  ``?synchronous=normal`` in the URL trades the last few commits on power loss (never on a
  process crash) for speed; :meth:`SQLiteStore.describe` reports which one runs.
- Connections are not thread-safe: a small pool hands each call its own connection, and
  takes it back afterwards (threads come and go; their connections stay few).
- Tables: ``intents`` (one row per record, codec columns), ``domains`` (seq and head per
  domain), ``fence`` (one row: the token counter, the eviction floor and the clock state),
  ``certs`` (append-only audit trail, written in the same transaction as the commit),
  ``audit`` (operator clears: who, when, why; written in the transaction that clears),
  ``meta`` (schema version, store id, sealing key).
- Sweep is O(expired): an index on ``reclaim_at``; each batch deletes rows whose deadline
  passed inside one transaction, so the version deleted is the version that set it.

Time
----
Leases are judged by the host's boot-time clock (Linux ``CLOCK_BOOTTIME``): every process on
the host reads the same one, it counts suspend, and no wall-clock step (NTP, an operator, a
VM resumed) moves it. It restarts with the machine and the file outlives it, so the
``fence`` row keeps ``(boot id, offset, last reading)``, updated inside every write step
under the write lock: store time is ``reading + offset``. The first write after a reboot
(a new ``/proc/sys/kernel/random/boot_id``) rebases the offset so that store time goes on
from where the last boot left it, plus the downtime as the wall clock measured it (never
minus: a wall clock that went back across the reboot adds nothing). Every holder on the
host died with the reboot, so that one wall-clock reading can lapse no lease of a
living holder. A reading below the last one (only an injected clock does that) leaves store
time standing, as with the wall clock before. Where there is no boot-time clock (not
Linux) the wall clock is used as before (``boot id "wall"``), and a wall-clock step forward
lapses leases early there.

The ``clock_offset``/``clock_last`` pair (store time by the wall clock) is still kept up
for processes of older versions sharing the file during an upgrade; a file written by an
older version gains the boot columns when next opened, set so that store time goes on
unchanged.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import sqlite3
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from effectfence.clock import merge_head
from effectfence.errors import StoreUnavailable
from effectfence.protocol import IntentRecord, State
from effectfence.store import _fork, query_pairs, sqlite_url
from effectfence.store.base import (
    APPLIED,
    BUSY,
    EMPTY_HEAD,
    MOVED,
    RACE,
    STALE,
    FenceStore,
    Head,
    Step,
    StoreMissing,
    same_record,
)
from effectfence.store.codec import (
    NEVER,
    RECORD_FIELDS,
    CertCache,
    cert_from_json,
    cert_to_json,
    encode_deadline,
    entry_from_json,
    entry_to_json,
)

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "SCHEMA_VERSION",
    "SQLiteStore",
    "StoreSchemaError",
]

#: the schema this code writes; a file with a newer one is refused, never half-understood
SCHEMA_VERSION = 1
#: how long a step waits for another process's write lock before reporting unavailable
DEFAULT_BUSY_TIMEOUT = 10.0
_MAX_BUSY_TIMEOUT = (2**31 - 1) / 1000  # SQLite's timeout is a C int of milliseconds
#: SQLITE_BUSY and SQLITE_LOCKED: the low byte of an extended result code names its class
_BUSY_CODES = (5, 6)
#: a clock reading this far behind the last one is a step back: readers rebase
_REBASE_AFTER = 1.0
#: the boot clock's columns, added to the ``fence`` row of a file of an older version
_BOOT_COLUMNS = (
    "boot_id TEXT NOT NULL DEFAULT ''",
    "boot_offset REAL NOT NULL DEFAULT 0",
    "boot_last REAL NOT NULL DEFAULT 0",
)
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_TIMENS = "/proc/self/timens_offsets"


def _boot_clock() -> tuple[Callable[[], float], str]:
    """The host's boot-time clock and this boot's id; ``(time.time, "wall")`` where there is
    none. A process in a time namespace has its namespace's offset taken back off, so it
    reads the host's clock like every other process sharing the file."""
    clk = getattr(time, "CLOCK_BOOTTIME", None)
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except (OSError, ValueError):
        boot = ""
    if clk is None or not boot:
        return time.time, "wall"
    shift = 0.0
    try:
        with open(_TIMENS, encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] in ("boottime", "7"):  # 7: CLOCK_BOOTTIME
                    shift = int(parts[1]) + int(parts[2]) / 1e9
    except (OSError, ValueError):
        pass  # no time namespaces here: the host's clock

    def boottime() -> float:
        return time.clock_gettime(clk) - shift

    return boottime, boot


#: rows a sweep deletes per transaction, so the write lock is never held for long
_SWEEP_BATCH = 1000
_CERT_CACHE = 4096
#: replays of recently read intents, each kept with the WAL-index header it was read under
_READ_CACHE = 4096
#: a chain of read caches this deep is merged into one by the commit that would deepen it,
#: and a read served from this many levels down merges it (each merge copies the cache:
#: ~3 us per 1,000 records)
_MERGE_DEPTH = 8
_MERGE_WALK = 4
#: the WAL-index header: two copies of 48 bytes at the start of the ``-shm`` file
_WAL_HEADER = 96

#: one writer lock per database file per process. Threads of one process queue on it and are
#: woken the moment the writer before them commits; without it they meet SQLite's busy
#: handler, which sleeps 1, 2, 5 ... 100 ms between polls (measured: p99 0.44 s, against
#: 0.04 s with it, at 8 HTTP clients on one server). Other processes still wait in the busy
#: handler, as they must. Reentrant, so a nested write fails in SQLite, never hangs here.
_WRITERS: dict[str, threading.RLock] = {}
_WRITERS_LOCK = threading.Lock()


def _writer_lock(path: str) -> threading.RLock:
    with _WRITERS_LOCK:
        return _WRITERS.setdefault(path, threading.RLock())


#: One read-only descriptor per ``-shm`` file per process, never closed while it names the
#: file SQLite uses: closing ANY descriptor of a file drops every POSIX lock this process
#: holds on it, SQLite's WAL locks included (its own ``unixInodeInfo`` exists for this).
#: Kept with the identity (st_dev, st_ino) of the file it was opened on: a number closed
#: behind our back (a forked child closing what it inherited, as daemons do) can be reused
#: by SQLite itself, and is then neither read through nor closed.
_SHM_FDS: dict[str, tuple[int, int, int]] = {}
#: The header of each such file, mapped (mmap(2) on that descriptor itself, read-only,
#: shared): a replay reads it from memory instead of with a pread, which was ~0.55 us of a
#: ~4 us cached replay. Not Python's ``mmap``: it keeps a duplicate of the descriptor and
#: closes it when a map fails, is collected or the interpreter exits, dropping the locks
#: as surely as closing the descriptor itself would. A page is never unmapped (a reader
#: may still hold it); it is only forgotten when its descriptor is closed.
_SHM_PAGES: dict[int, Any] = {}
_SHM_LOCK = threading.Lock()


def _shm_fd(path: str) -> int:
    """The descriptor of ``path``'s current ``-shm`` file (call with a connection open on
    it, so the file cannot be replaced meanwhile). A kept descriptor of a file since
    replaced (every connection closed, the file deleted, a new one made) holds no lock of
    SQLite's (those are on the new file), so it is closed and the new file opened."""
    shm = path + "-shm"
    with _SHM_LOCK:
        now = os.stat(shm)
        kept = _SHM_FDS.pop(path, None)
        if kept is not None:
            fd, dev, ino = kept
            ours = _still_names(fd, dev, ino)
            if ours and (dev, ino) == (now.st_dev, now.st_ino):
                _SHM_FDS[path] = kept
                return fd
            _SHM_PAGES.pop(fd, None)  # the number may be reused; the old page stays mapped
            if ours:  # ours, on a file since replaced: no lock of SQLite's is on it
                os.close(fd)
        fd = os.open(shm, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino):
            os.close(fd)  # replaced between stat and open: not SQLite's file, no lock on it
            raise FileNotFoundError(shm)
        _SHM_FDS[path] = (fd, opened.st_dev, opened.st_ino)
        return fd


def _forget_shm(path: str) -> None:
    """After a store on ``path`` closed: its kept ``-shm`` descriptor is closed if that file
    is gone or replaced. SQLite deletes it with the last connection anywhere, so then no
    lock of anyone's is on it; otherwise it stays (a connection still uses the file). A
    process opening and closing stores on many files kept one descriptor per file for
    ever (found by review). The header page stays mapped (a reader may still hold it, as
    in :func:`_shm_fd`), forgotten."""
    with _SHM_LOCK:
        kept = _SHM_FDS.get(path)
        if kept is None:
            return
        fd, dev, ino = kept
        try:
            now = os.stat(path + "-shm")
            if (now.st_dev, now.st_ino) == (dev, ino):
                return  # still the file SQLite uses
        except OSError:
            pass
        del _SHM_FDS[path]
        _SHM_PAGES.pop(fd, None)  # the number may be reused
        if _still_names(fd, dev, ino):
            os.close(fd)


def _still_names(fd: int, dev: int, ino: int) -> bool:
    """Whether descriptor ``fd`` is still the one kept for file (dev, ino): a number closed
    behind our back may have been reused (see :data:`_SHM_FDS`), and is then never closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _shm_map(fd: int) -> Any:
    """The header of the ``-shm`` file behind ``fd``, mapped (see :data:`_SHM_PAGES`): a
    ctypes array whose slice is the header's bytes. None where it cannot be mapped (then
    the header is read with pread)."""
    with _SHM_LOCK:
        page = _SHM_PAGES.get(fd)
        if page is None:
            page = _map_header(fd)
            if page is None:
                return None
            _SHM_PAGES[fd] = page
        return page


def _bind_mmap() -> tuple[Any, Any, int] | None:
    """mmap(2) through ctypes, the array type of a header over a mapped page, and
    MAP_FAILED; bound once, at import (ctypes imported later, under memory pressure, was
    seen to fail with MemoryError). None where there is no ctypes, libc or mmap."""
    try:
        import ctypes
        import mmap  # its constants only: no map object, no duplicate descriptor

        call = ctypes.CDLL(None, use_errno=True).mmap
        call.restype = ctypes.c_void_p
        call.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        )
        prot, flags = mmap.PROT_READ, mmap.MAP_SHARED

        def map_page(fd: int) -> Any:
            return call(None, _WAL_HEADER, prot, flags, fd, 0)

        failed = ctypes.c_void_p(-1).value or -1  # MAP_FAILED, as the call returns it
        return map_page, ctypes.c_char * _WAL_HEADER, failed
    except (ImportError, OSError, AttributeError):
        return None


_MMAP = _bind_mmap()


def _map_header(fd: int) -> Any:
    if _MMAP is None:
        return None
    map_page, header_array, map_failed = _MMAP
    try:
        if os.fstat(fd).st_size < _WAL_HEADER:
            return None  # a page past the end of the file would fault (SIGBUS) when read
        addr = map_page(fd)
        if addr is None or addr == map_failed:
            return None
        return header_array.from_address(addr)
    except (OSError, ValueError, MemoryError):  # then the header is read with pread
        return None


def _whole(header: bytes) -> bool:
    """A WAL-index header read whole: both copies, initialised (not short, not torn by a
    writer between its two copies)."""
    half = _WAL_HEADER // 2
    return len(header) == _WAL_HEADER and header[12] == 1 and header[:half] == header[half:]


def _change(header: bytes) -> int:
    """The header's commit counter (``iChange``): every commit adds one, nothing else does."""
    return int.from_bytes(header[8:12], sys.byteorder)


def _newer(header: bytes, than: bytes) -> bool:
    """``header`` names a later commit than ``than`` (the counter wraps at 2**32)."""
    return 0 < (_change(header) - _change(than)) % (1 << 32) < (1 << 31)


def _row(rec: IntentRecord, cert_json: bytes | None) -> tuple[Any, ...]:
    """A record's columns after ``intent``, then the intent: the parameters of _INSERT,
    _INSERT_NEW and _UPDATE."""
    return (
        rec.state.value,
        rec.token,
        rec.fingerprint,
        rec.domain,
        rec.agent,
        encode_deadline(rec.lease_until),
        cert_json,
        encode_deadline(rec.until),
        rec.reason,
        rec.since,
        rec.seq,
        encode_deadline(rec.reclaim_at),
        rec.intent,
    )


class _Kept:
    """The read cache for one state of the database: the header that names it, the clock
    state of the ``fence`` row in it, and the records read (or written) in it.

    Published once, never changed under a reader who holds it, except to add reads of the
    same state. A commit made here does not copy the cache: it starts a new one holding what
    it wrote, over the old one as ``parent`` (frozen from then on); lookups go down the
    chain, and a chain grown deep is merged into one again (see ``SQLiteStore._rekey``)."""

    __slots__ = ("base", "depth", "header", "last", "offset", "parent", "records")

    def __init__(
        self,
        header: bytes | None,
        offset: float,
        last: float,
        records: dict[str, IntentRecord | None],
        parent: _Kept | None = None,
    ) -> None:
        self.header, self.offset, self.last, self.records = header, offset, last, records
        self.parent = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        #: records held below this one (frozen: counted once)
        self.base: int = 0 if parent is None else parent.base + len(parent.records)

    def below(self, intent: str) -> tuple[object, int]:
        """``intent`` looked up under this level: (record or ``_ABSENT``, levels walked)."""
        kept, walked = self.parent, 1
        while kept is not None:
            rec = kept.records.get(intent, _ABSENT)
            if rec is not _ABSENT:
                return rec, walked
            kept, walked = kept.parent, walked + 1
        return _ABSENT, walked

    def merged(self) -> dict[str, IntentRecord | None]:
        """The whole chain in one dict, newer levels over older ones."""
        levels: list[dict[str, IntentRecord | None]] = []
        kept: _Kept | None = self
        while kept is not None:
            levels.append(kept.records)
            kept = kept.parent
        out: dict[str, IntentRecord | None] = {}
        for records in reversed(levels):
            out.update(records)
        return out


#: the operations whose writes a transaction tracks (see SQLiteStore._rekey); a batch with
#: any other (sweep, clear, evict...) lets the header change invalidate the read cache
_TRACKED = frozenset({"claim", "complete", "fail", "release", "renew"})
_ABSENT = object()


class _SlotTaken(Exception):
    """An insert-first claim found the slot taken. Its transaction (or its savepoint in a
    batch) is rolled back, so its domain reservation and token never happened, and the
    claim runs again the checked way, which answers with what is there."""


class _Step:
    """One caller's write step, run by whichever caller leads the next transaction."""

    __slots__ = ("args", "body", "done", "error", "op", "out")

    def __init__(self, op: str, body: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.op, self.body, self.args = op, body, args
        self.out: Any = None
        self.error: BaseException | None = None
        self.done = False


#: SQLite keeps one table per process of the files it has open and of the locks it holds on
#: them (POSIX locks belong to a process). A forked child inherits the table but none of the
#: locks, so its connections to such a file, new ones too, take no real lock: the parent's
#: last close deletes the WAL under the child, and another process admits an intent the
#: child admitted (G1). So: every store of this process (each counts its connections, one
#: too many rather than one too few: counted before opening, uncounted after closing; a
#: store collected without close() had its connections closed with it), and the files the
#: process this one was forked from had open, which this process must not use.
_STORES: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()
_INHERITED: set[str] = set()


def _reset_writers_after_fork() -> None:
    # a thread of the parent may have held one at fork: the child's copy would stay held
    _WRITERS_LOCK._at_fork_reinit()  # type: ignore[attr-defined]
    _SHM_LOCK._at_fork_reinit()  # type: ignore[attr-defined]
    for lock in _WRITERS.values():
        lock._at_fork_reinit()  # type: ignore[attr-defined]
    # the parent's -shm descriptors and pages are forgotten, never closed: the child may
    # close or reuse those numbers, and its own locks are on descriptors it opens itself
    _SHM_FDS.clear()
    _SHM_PAGES.clear()
    _INHERITED.update(store._real for store in list(_STORES) if store._live)


os.register_at_fork(after_in_child=_reset_writers_after_fork)

_STATES = {s.value: s for s in State}
_IN_FLIGHT = State.IN_FLIGHT.value
_COLS = ", ".join(RECORD_FIELDS)
_ICOLS = ", ".join(f"i.{c}" for c in RECORD_FIELDS)
# a record's columns after ``intent``, then the intent: the parameters of both statements
_INSERT = (
    f"INSERT INTO intents ({', '.join(RECORD_FIELDS[1:])}, intent) "
    f"VALUES ({', '.join('?' * len(RECORD_FIELDS))})"
)
_UPDATE = f"UPDATE intents SET {', '.join(f'{c} = ?' for c in RECORD_FIELDS[1:])} WHERE intent = ?"
#: the insert-first claim's insert: a slot already taken writes nothing (see _claim_empty)
_INSERT_NEW = _INSERT + " ON CONFLICT (intent) DO NOTHING"
#: the domain's next seq, reserved (an absent domain starts at the floor), and its head
_RESERVE_NEXT = (
    "INSERT INTO domains (domain, seq) SELECT ?, floor + 1 FROM fence WHERE id = 0 "
    "ON CONFLICT (domain) DO UPDATE SET seq = seq + 1 RETURNING seq, head, clock"
)
_SYNC = {"full": "FULL", "normal": "NORMAL"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value NOT NULL);
CREATE TABLE IF NOT EXISTS fence (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    token INTEGER NOT NULL,         -- last fencing token handed out
    floor INTEGER NOT NULL,         -- where new domains start (raised by evictions, G5)
    clock_offset REAL NOT NULL,     -- wall + clock_offset: store time by wall (older versions)
    clock_last REAL NOT NULL,       -- the last wall reading a write step made
    boot_id TEXT NOT NULL DEFAULT '',     -- the boot whose clock boot_last was read on
    boot_offset REAL NOT NULL DEFAULT 0,  -- store time = boot-time clock + boot_offset
    boot_last REAL NOT NULL DEFAULT 0     -- the last boot-time reading a write step made
);
CREATE TABLE IF NOT EXISTS intents (
    intent TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    token INTEGER NOT NULL,
    fingerprint BLOB NOT NULL,
    domain TEXT NOT NULL,
    agent TEXT NOT NULL,
    lease_until REAL NOT NULL,
    cert BLOB,
    until REAL NOT NULL,
    reason TEXT NOT NULL,
    since REAL NOT NULL,
    seq INTEGER NOT NULL,
    reclaim_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS intents_reclaim ON intents (reclaim_at);
CREATE INDEX IF NOT EXISTS intents_in_flight ON intents (domain) WHERE state = 'in_flight';
CREATE TABLE IF NOT EXISTS domains (
    domain TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    head TEXT,                      -- hash of the last committed certificate
    clock TEXT                      -- JSON: merged vector clock of the commits
);
CREATE TABLE IF NOT EXISTS certs (
    domain TEXT NOT NULL,
    seq INTEGER NOT NULL,
    hash TEXT NOT NULL,
    cert BLOB NOT NULL,
    committed_at REAL NOT NULL,
    keep_until REAL NOT NULL,
    PRIMARY KEY (domain, seq)
);
-- partial: certificates kept forever (the default) cost no index write
CREATE INDEX IF NOT EXISTS certs_keep ON certs (keep_until) WHERE keep_until < 1e300;
-- the operator's audit trail: who cleared what and why, written by the step that cleared
-- it, and kept forever (clears are rare). Older files gain it when next opened.
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    intent TEXT NOT NULL,
    at REAL NOT NULL,
    entry TEXT NOT NULL             -- JSON (codec.entry_to_json)
);
CREATE INDEX IF NOT EXISTS audit_intent ON audit (intent, id);
-- where retention cut each domain's trail: every certificate with seq <= through is gone
-- (only ever a prefix: see _sweep_batch). Older files gain it when next opened.
CREATE TABLE IF NOT EXISTS trail_cuts (
    domain TEXT PRIMARY KEY,
    through INTEGER NOT NULL
);
"""


#: the sweep's certificates: a batch of those due, each with the keep_until of one before it
#: in its domain that is not due yet (NULL: none, it may go; see _sweep_batch)
_SWEEP_CERTS = (
    "SELECT c.domain, c.seq, (SELECT e.keep_until FROM certs e WHERE e.domain = c.domain "
    "AND e.seq < c.seq AND e.keep_until > ?1 LIMIT 1) FROM (SELECT domain, seq FROM certs "
    "WHERE keep_until <= ?1 AND keep_until < 1e300 ORDER BY keep_until LIMIT ?2) c"
)


def _ours(conn: sqlite3.Connection, tables: set[str]) -> bool:
    """Whether a non-empty file is a fence store: its tables, and the marks its creation
    wrote (an integer schema version and a store id), read without writing anything."""
    if not {"meta", "fence", "intents"} <= tables:
        return False
    try:
        marks = dict(
            conn.execute(
                "SELECT key, value FROM meta WHERE key IN ('schema_version', 'store_id')"
            ).fetchall()
        )
    except sqlite3.Error:  # a meta table of another shape
        return False
    return type(marks.get("schema_version")) is int and type(marks.get("store_id")) is str


class StoreSchemaError(RuntimeError):
    """The database file was written by a newer effectfence, or is not a fence store."""

    def __init__(self, message: str, *, path: str, found: Any, supported: int) -> None:
        super().__init__(message)
        self.path = path
        self.found = found
        self.supported = supported


def _parse_url(url: str) -> tuple[str, dict[str, str]]:
    """``sqlite:///abs/path.db`` (absolute), ``sqlite:///./rel.db`` (relative) -> path, query."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != "sqlite" or not sep or not rest.startswith("/"):
        raise ValueError(f"a SQLite store URL looks like sqlite:///abs/path/fence.db, got {url!r}")
    rest, _, query = rest.partition("?")
    path = unquote(rest[1:], errors="surrogateescape")
    if not path:
        raise ValueError(f"the SQLite store URL {url!r} names no file")
    if path == ":memory:" or path.startswith("file:"):
        raise ValueError(
            "an in-memory SQLite database is private to one connection: use 'memory:' for an "
            "in-process store, or a file path to share one between processes"
        )
    if path.startswith(("./", "../", "~")):
        path = os.path.expanduser(path)
    else:
        path = "/" + path.lstrip("/")
    return path, dict(query_pairs(query, url))


class SQLiteStore(FenceStore):
    """Durable store in one SQLite file, shared by every process on the host.

    ``create=False`` opens only a store that is there (:class:`StoreMissing` otherwise):
    the operator's commands look without creating. ``clock`` is the clock leases are judged
    by: by default the host's boot-time clock, which no wall-clock step moves (see the
    module's "Time"). Tests inject a fake one, with
    ``wall`` (default: ``clock`` itself when injected, else ``time.time``) and ``boot_id``
    (default: this boot's id, or ``"injected"`` with an injected clock) to model steps
    and reboots. The store's own clock (:meth:`now`) never goes backwards.
    """

    name = "sqlite"
    counters_backend = "sql"
    shared = True

    def __init__(
        self,
        path: str,
        *,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] | None = None,
        boot_id: str | None = None,
        create: bool = True,
        synchronous: str = "full",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        cert_retention: float | None = None,
    ) -> None:
        sync = _SYNC.get(str(synchronous).lower())
        if sync is None:
            raise ValueError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        if not 0 <= busy_timeout <= _MAX_BUSY_TIMEOUT:
            # sqlite3 passes it on as int milliseconds: past 2**31-1 the count wraps
            # negative and SQLite stops waiting for the lock at all (found by review)
            raise ValueError(
                f"busy_timeout must be 0 to {_MAX_BUSY_TIMEOUT:g} seconds, got {busy_timeout!r}"
            )
        if cert_retention is not None and not cert_retention >= 0:
            raise ValueError("cert_retention must be >= 0 seconds, or None to keep forever")
        self.path = os.path.abspath(path)
        self._create = create
        if not create and not os.path.exists(self.path):
            raise StoreMissing(
                f"no store at {self.path}: nothing has used it yet (serve and wrap create "
                "it), or the URL names another file"
            )
        self._real = os.path.realpath(self.path)  # the name SQLite's -wal and -shm follow
        self.synchronous = sync
        self.busy_timeout = float(busy_timeout)
        self.cert_retention = math.inf if cert_retention is None else float(cert_retention)
        if clock is None:
            self._clock, self._boot = _boot_clock()
            self._wall = wall or time.time
        else:
            self._clock, self._boot = clock, "injected"
            self._wall = wall or clock
        if boot_id is not None:
            self._boot = boot_id
        self._free: list[sqlite3.Connection] = []
        self._all: list[sqlite3.Connection] = []
        # reentrant: close() from a signal handler may interrupt a step of this thread that
        # holds it (handing its connection back), which a plain lock deadlocked (review)
        self._all_lock = _fork.rlock()
        self._fork = _fork.generation()
        self._closed = False
        self._certs = CertCache(_CERT_CACHE)
        self._kept = _Kept(None, 0.0, 0.0, {})  # the read cache (see read)
        self._kept_lock = _fork.lock()
        self._wrote: dict[str, IntentRecord | None] = {}  # by the steps of one transaction
        self._ticked: tuple[float, float] | None = None  # its last (clock_offset, clock_last)
        self._shm: int | None = None  # fd of the -shm file; -1: no read cache here
        self._mapped: Any = None  # its header, mapped (see _SHM_PAGES)
        self._keeper: sqlite3.Connection | None = None
        self._key: bytes | None = None
        self._key_lock = _fork.lock()
        self._writer = _writer_lock(self._real)
        self._live: list[None] = []  # one item per connection open (append and pop: atomic)
        _STORES.add(self)
        self._queue: list[_Step] = []  # steps waiting for the next transaction
        self._queue_lock = _fork.lock()
        if not os.path.exists(self.path):
            # the file holds the ticket sealing key: readable by its owner only
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            except OSError as exc:
                raise StoreUnavailable(
                    f"can't create the SQLite store {self.path}: {exc}", path=self.path
                ) from exc
        store_id, self.journal_mode = self._init_schema()
        self.store_id = store_id
        self.ticket_scope = f"sqlite:{store_id}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteStore:
        """``sqlite:///abs/path/fence.db?synchronous=normal&busy_timeout=5``; options given
        as keywords win over the query."""
        path, query = _parse_url(url)
        opts: dict[str, Any] = {}
        for key, value in query.items():
            if key == "synchronous":
                opts[key] = value
            elif key in ("busy_timeout", "cert_retention"):
                try:
                    opts[key] = float(value)
                except ValueError:
                    raise ValueError(f"{key} in {url!r} must be a number of seconds") from None
            else:
                raise ValueError(
                    f"unknown option {key!r} in {url!r}; known: synchronous, busy_timeout, "
                    "cert_retention"
                )
        opts.update(options)
        return cls(path, **opts)

    def __repr__(self) -> str:
        return f"SQLiteStore(path={self.path!r}, synchronous={self.synchronous!r})"

    def describe(self) -> dict[str, Any]:
        """Name, file and durability settings, for ``effectfence info`` and stats."""
        return {
            "store": self.name,
            "path": self.path,
            "url": sqlite_url(self.path)
            + ("?synchronous=normal" if self.synchronous == "NORMAL" else ""),
            "journal_mode": self.journal_mode,
            "synchronous": self.synchronous.lower(),
            "schema_version": SCHEMA_VERSION,
            "ticket_scope": self.ticket_scope,
            "cert_retention": None if self.cert_retention == math.inf else self.cert_retention,
        }

    # -- connections ------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreUnavailable(f"the SQLite store {self.path} is closed", path=self.path)
        conn = self._open_conn()
        with self._all_lock:
            if not self._closed:
                self._all.append(conn)
                return conn
        self._close_conn(conn)  # close() ran meanwhile: it must not outlive the store
        raise StoreUnavailable(f"the SQLite store {self.path} is closed", path=self.path)

    def _open_conn(self) -> sqlite3.Connection:
        if self._real in _INHERITED:
            raise self._inherited()
        self._live.append(None)  # before: a fork while it opens must count it
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout,
                isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE ... COMMIT
                check_same_thread=False,  # the pool hands a connection to one thread at a time
                cached_statements=64,
            )
        except BaseException:
            self._live.pop()
            raise
        try:
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
        except BaseException:
            self._close_conn(conn)
            raise
        return conn

    def _close_conn(self, conn: sqlite3.Connection) -> None:
        try:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        finally:
            self._live.pop()  # after: a fork while it closes must still count it

    def _inherited(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"the SQLite store {self.path} was open in the process this one was forked "
            "from: SQLite takes no lock for a forked child on a file its parent had open, so "
            "the fence could not hold here. Open the store only in processes started after "
            "it was closed, or start them with multiprocessing's 'spawn' method",
            path=self.path,
            retryable=False,
            recover="open the store in a process not forked from one that had it open "
            "(e.g. multiprocessing's 'spawn' start method)",
        )

    def _acquire(self) -> sqlite3.Connection:
        if self._fork != _fork.generation():
            self._forked()
        if self._closed:  # a connection handed back as close() ran is never used again
            raise StoreUnavailable(f"the SQLite store {self.path} is closed", path=self.path)
        try:
            return self._free.pop()
        except IndexError:
            return self._connect()

    def _forked(self) -> None:
        """First use in a forked child. If the parent had the file open, refused (see
        :data:`_INHERITED`): the child holds none of SQLite's locks on it, through inherited
        connections or new ones, so the parent closing its store (or exiting) checkpoints
        and deletes the WAL under it, the child's claims and commits land in a deleted file,
        and an intent it admitted is admitted again elsewhere (G1). Otherwise (the parent
        had closed it) the parent's connections are set aside and the child opens its own."""
        with _fork.LOCK:
            if self._fork == _fork.generation():  # another thread of the child came first
                return
            if self._real in _INHERITED:  # the parent had it open: refused, every time
                raise self._inherited()
            _fork.abandon(*self._all)  # never closed: that could delete the WAL
            self._all, self._free = [], []
            self._queue = []  # the parent's threads' steps: theirs to run, never ours
            # the parent's keeper holds no lock for us: open our own before reading -shm
            self._keeper, self._shm, self._kept = None, None, _Kept(None, 0.0, 0.0, {})
            self._mapped = None
            self._fork = _fork.generation()

    def _unavailable(self, op: str, exc: BaseException | str) -> StoreUnavailable:
        return StoreUnavailable(
            f"the SQLite store {self.path} failed during {op}: {exc}; nothing was decided",
            path=self.path,
            operation=op,
        )

    def _drop(self, conn: sqlite3.Connection) -> None:
        """A connection whose transaction state is unknown is closed, never reused (once:
        whoever takes it out of ``_all`` closes it)."""
        with self._all_lock:
            if conn not in self._all:
                return  # closed already
            self._all.remove(conn)
            if conn in self._free:  # an interrupted hand-back may have pooled it
                self._free.remove(conn)
        self._close_conn(conn)

    def _release(self, conn: sqlite3.Connection) -> None:
        """A connection back to the pool; once the store is closed, closed instead: close()
        closes only idle connections, as closing one another thread is using crashes the
        interpreter (found by review: a segfault closing a store during a write)."""
        with self._all_lock:
            if not self._closed:
                self._free.append(conn)
                if not self._closed:
                    return
                # close() ran in between, from a signal handler in this very thread (the
                # lock is reentrant): it drained the list before this one joined it
        self._drop(conn)

    def _write(self, op: str, body: Callable[..., Any], *args: Any) -> Any:
        """Run ``body(conn, *args)`` atomically, durable before it returns: all or none.

        Group commit: a step asked for while another holds the write lock waits for it,
        and the next caller to get the lock runs every waiting step of this store in ONE
        ``BEGIN IMMEDIATE`` transaction, each in a savepoint of its own (a step that raises
        is rolled back alone), and commits them with one fsync. Each step still runs whole
        under the write lock, one after another, so it decides exactly as it would alone;
        its caller hears back only after the commit. A transaction that fails applies none
        of its steps: each is ``store_unavailable``, nothing decided."""
        if self._fork != _fork.generation():
            self._forked()  # before queueing: a child never runs its parent's steps
        step = _Step(op, body, args)
        try:
            with self._queue_lock:
                self._queue.append(step)
            with self._writer:
                if not step.done:  # no transaction took it yet: this caller leads the next
                    with self._queue_lock:
                        steps, self._queue = self._queue, []
                    self._commit_steps(steps, step)
        except BaseException:
            # interrupted while it waited (KeyboardInterrupt): a step nobody waits for must
            # not run later in another caller's transaction
            with self._queue_lock, contextlib.suppress(ValueError):
                self._queue.remove(step)
            raise
        if not step.done:  # cannot happen: its caller leads a batch holding it (fail closed)
            raise StoreUnavailable(
                f"the SQLite store {self.path} did not run {op}; nothing was decided",
                path=self.path,
                operation=op,
            )
        if step.error is not None:
            raise step.error
        return step.out

    def _commit_steps(self, steps: list[_Step], mine: _Step) -> None:
        """Under the write lock: ``steps`` in one transaction (see :meth:`_write`).

        What each body returned is kept aside and handed to its caller only once the
        transaction is known to have committed; until a step is marked done its caller
        reads "did not run" (so an interrupt anywhere here can cost an answer, never make
        one up). A step ends with its answer, its own error (a Python error in its body,
        rolled back to its savepoint), ``store_unavailable`` when the transaction did not
        commit, or, for the leader's own step alone, an interrupt the leader received."""
        conn: sqlite3.Connection | None = None
        committed = sent = False
        failure: BaseException | None = None
        results: list[tuple[Any, BaseException | None]] = []
        try:
            conn = self._acquire()
            conn.execute("BEGIN IMMEDIATE")
            # the header now names the state this transaction starts from (we hold the
            # write lock: nobody else can commit until we do); see _rekey
            before = self._header_for(steps)
            base = conn.total_changes
            if len(steps) == 1:  # alone: no savepoint to pay for
                only = steps[0]
                try:
                    results.append((only.body(conn, *only.args), None))
                except sqlite3.Error:
                    raise
                except BaseException as exc:
                    conn.execute("ROLLBACK")
                    results.append((None, exc))
            else:
                for s in steps:
                    conn.execute("SAVEPOINT step")
                    try:
                        results.append((s.body(conn, *s.args), None))
                    except sqlite3.Error:
                        raise  # the transaction's state is unknown: none of it commits
                    except Exception as exc:
                        conn.execute("ROLLBACK TO step")
                        results.append((None, exc))
                    conn.execute("RELEASE step")
            # a transaction that changed no row commits no frame and leaves the commit
            # counter where it was: then a move by one is somebody else's commit
            changed = conn.total_changes != base
            if conn.in_transaction:
                sent = True
                conn.execute("COMMIT")
            committed = True
            if before is not None and changed and all(own is None for _, own in results):
                after = self._wal_header()
                if after is not None and _change(after) == (_change(before) + 1) % (1 << 32):
                    self._rekey(before, after)
        except BaseException as exc:
            failure = exc
            if not isinstance(exc, Exception) and sent and conn is not None:
                committed = not conn.in_transaction  # raised as COMMIT returned, committed
        finally:
            # every step's answer first: an interrupt while the connection goes back must
            # not leave a committed step to read "did not run" (found by review). Nobody
            # reads them before this leader lets go of the write lock.
            interrupted = failure is not None and not isinstance(failure, Exception)
            for i, s in enumerate(steps):
                out, own = results[i] if i < len(results) else (None, None)
                if s is mine and interrupted:
                    s.out, s.error = (out if committed else None), failure
                elif committed:
                    s.out, s.error = out, own
                else:
                    s.out = None
                    s.error = own or self._unavailable(s.op, failure or "it did not commit")
                s.done = True
            if conn is not None:
                try:
                    if committed:
                        self._release(conn)
                    else:
                        self._discard(conn)  # rolled back (or dropped)
                except BaseException:
                    self._drop(conn)  # interrupted: closing rolls back, the lock is let go
                    raise

    def _header_for(self, steps: list[_Step]) -> bytes | None:
        """Inside the transaction: the header, when the read cache can follow it (a read
        cache in use, and only steps whose writes are tracked); the tracking starts."""
        self._wrote, self._ticked = {}, None
        shm = self._shm
        if shm is None or shm < 0 or any(s.op not in _TRACKED for s in steps):
            return None
        return self._wal_header()

    def _discard(self, conn: sqlite3.Connection) -> None:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error:
            self._drop(conn)
            return
        self._release(conn)

    def _query(self, op: str, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """One read statement (autocommit: its own consistent snapshot)."""
        try:
            conn = self._acquire()
        except sqlite3.Error as exc:
            raise self._unavailable(op, exc) from exc
        try:
            rows = conn.execute(sql, params).fetchall()
        except BaseException as exc:
            # any error (a name that does not encode, an interrupt) gives the connection
            # back rolled back: left out, it stayed open past close() (found by review)
            try:
                self._discard(conn)
            except BaseException:
                self._drop(conn)
                raise
            if isinstance(exc, sqlite3.Error):
                raise self._unavailable(op, exc) from exc
            raise
        self._release(conn)
        return rows

    def _init_schema(self) -> tuple[str, str]:
        """Open (and on first use create) the schema, waiting out other openers.

        Switching a new file to WAL, and the checkpoint that deletes the WAL when the last
        connection closes, hold locks that SQLite reports as "database is locked" at once,
        without consulting ``busy_timeout``: two processes started together (two wrappers,
        a restart) would otherwise fail to open. Such a refusal changes nothing, so it is
        retried, with a growing pause, until ``busy_timeout`` has passed."""
        deadline = time.monotonic() + self.busy_timeout
        pause = 0.001
        while True:
            try:
                return self._init_schema_once()
            except StoreUnavailable as exc:
                cause = exc.__cause__
                code = getattr(cause, "sqlite_errorcode", None)
                busy = isinstance(code, int) and code & 0xFF in _BUSY_CODES
                if not busy or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _init_schema_once(self) -> tuple[str, str]:
        try:
            conn = self._connect()
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
                raise self._foreign("is not a SQLite database") from exc
            raise self._unavailable("open", exc) from exc
        try:
            # a file that is not ours is refused before anything is written to it (the
            # switch to WAL below is persistent: it would change another program's file)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            if not tables and not self._create:  # an empty file: looking must not make it one
                raise StoreMissing(f"no store at {self.path}: the file is empty")
            if tables and not _ours(conn, tables):
                # a table named meta is not enough: another program's file was switched to
                # WAL, or adopted, on that alone (found by review)
                tables_list = ", ".join(sorted(tables))
                raise self._foreign(
                    f"is a SQLite database but not an effectfence store (tables: {tables_list})"
                )
            mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
            if mode != "wal":  # WAL is persistent: only the first opener of a file sets it
                mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            if mode != "wal":
                raise StoreUnavailable(
                    f"the SQLite store {self.path} can't use WAL (journal_mode={mode}); "
                    "is it on a network file system?",
                    path=self.path,
                )
            conn.execute("BEGIN IMMEDIATE")
            try:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
                if "meta" in tables:
                    row = conn.execute(
                        "SELECT value FROM meta WHERE key = 'schema_version'"
                    ).fetchone()
                    found = None if row is None else row[0]
                    if type(found) is not int or found > SCHEMA_VERSION:
                        raise StoreSchemaError(
                            f"{self.path} has effectfence schema version {found!r}; this "
                            f"effectfence reads version {SCHEMA_VERSION}: upgrade effectfence "
                            "(or point it at another file)",
                            path=self.path,
                            found=found,
                            supported=SCHEMA_VERSION,
                        )
                elif tables:
                    raise self._foreign(
                        "is a SQLite database but not an effectfence store "
                        f"(tables: {', '.join(sorted(tables))})"
                    )
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?), "
                    "('store_id', ?), ('created_at', ?)",
                    (SCHEMA_VERSION, secrets.token_hex(16), time.time()),
                )
                if "boot_id" not in {r[1] for r in conn.execute("PRAGMA table_info(fence)")}:
                    for column in _BOOT_COLUMNS:  # a file of an older version
                        conn.execute(f"ALTER TABLE fence ADD COLUMN {column}")
                conn.execute(
                    "INSERT OR IGNORE INTO fence (id, token, floor, clock_offset, clock_last) "
                    "VALUES (0, 0, 0, 0.0, ?)",
                    (float(self._wall()),),
                )
                # new, or written by a version before the boot clock: store time goes on
                # from what it is by the wall clock, now on the boot clock
                conn.execute(
                    "UPDATE fence SET boot_id = ?1, boot_last = ?2, "
                    "boot_offset = max(?3, clock_last) + clock_offset - ?2 "
                    "WHERE id = 0 AND boot_id = ''",
                    (self._boot, float(self._clock()), float(self._wall())),
                )
                store_id = conn.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self._drop(conn)
            raise self._unavailable("open", exc) from exc
        except BaseException:
            self._drop(conn)
            raise
        self._release(conn)
        return str(store_id[0]), mode

    def _foreign(self, what: str) -> StoreSchemaError:
        return StoreSchemaError(
            f"{self.path} {what}", path=self.path, found=None, supported=SCHEMA_VERSION
        )

    # -- the clock --------------------------------------------------------------------------
    def _tick(self, conn: sqlite3.Connection, token: bool = False) -> tuple[float, int]:
        """Inside a write step: read the clock once, under the write lock, advance the
        persisted clock state, and return (store now, new token if ``token``).

        Same boot: the offset stays (it grows only if the reading went back, which holds
        store time still). Another boot: store time goes on from the last boot's, plus the
        downtime by the wall clock, never minus (see the module's "Time"). The wall-clock
        pair is kept up for older versions sharing the file."""
        reading = float(self._clock())  # an injected clock may answer ints
        row = conn.execute(
            "UPDATE fence SET token = token + ?4, "
            "clock_offset = clock_offset + max(0.0, clock_last - ?1), clock_last = ?1, "
            "boot_offset = CASE WHEN boot_id = ?3 THEN boot_offset + max(0.0, boot_last - ?2) "
            "ELSE boot_last + boot_offset + max(0.0, ?1 - clock_last) - ?2 END, "
            "boot_last = ?2, boot_id = ?3 WHERE id = 0 RETURNING boot_offset, token",
            (float(self._wall()), reading, self._boot, 1 if token else 0),
        ).fetchall()[0]
        offset = float(row[0])
        self._ticked = (offset, reading)
        return reading + offset, row[1] if token else 0

    def _now_from(self, offset: float, last: float, boot: str) -> float:
        reading = self._clock()
        if boot != self._boot or last - reading > _REBASE_AFTER:
            # a reboot, or the clock read back: rebase now, so readers (waiters, takers of
            # a lapsed lease) see time moving on without waiting for some write
            now: float = self._write("now", lambda c: self._tick(c)[0])
            return now
        return offset + (reading if reading > last else last)

    def now(self) -> float:
        (row,) = self._query(
            "now", "SELECT boot_offset, boot_last, boot_id FROM fence WHERE id = 0"
        )
        return self._now_from(row[0], row[1], row[2])

    # -- records ----------------------------------------------------------------------------
    def _decode(self, row: Sequence[Any]) -> IntentRecord:
        (intent, state, token, fp, domain, agent, lease_until, cert, until, reason, since, seq,
         reclaim_at) = row  # fmt: skip
        c = None if cert is None else self._certs.decode(cert)
        return IntentRecord(
            intent,
            _STATES[state],
            token,
            fp,
            domain,
            agent,
            lease_until if lease_until < NEVER else math.inf,
            c,
            until if until < NEVER else math.inf,
            reason,
            since,
            seq,
            reclaim_at if reclaim_at < NEVER else math.inf,
        )

    def _put(
        self, conn: sqlite3.Connection, rec: IntentRecord, cert_json: bytes | None, *, new: bool
    ) -> None:
        """Write a whole record: an UPDATE in place of one that exists (not INSERT OR
        REPLACE, which deletes the row and inserts it again: every index written twice)."""
        self._wrote[rec.intent] = rec  # for the read cache, if this commits (see _rekey)
        conn.execute(_INSERT if new else _UPDATE, _row(rec, cert_json))

    @staticmethod
    def _fetch(conn: sqlite3.Connection, intent: str) -> Any:
        return conn.execute(f"SELECT {_COLS} FROM intents WHERE intent = ?", (intent,)).fetchone()

    # -- reads ------------------------------------------------------------------------------
    def get(self, intent: str) -> IntentRecord | None:
        rows = self._query("get", f"SELECT {_COLS} FROM intents WHERE intent = ?", (intent,))
        return self._decode(rows[0]) if rows else None

    def read(self, intent: str) -> tuple[IntentRecord | None, float]:
        """The record and the clock state in one statement: one snapshot, one round trip.

        A replay reads the same row again and again, so answers are kept with the WAL-index
        header of the state they were read in, and served again while the header is
        unchanged. Every commit, by any connection of any process, rewrites that header, so
        an unchanged header means an unchanged database: the kept answer is the one the
        statement would return. A commit made here carries the cache over to the header it
        wrote (see :meth:`_rekey`), so a replay right after a commit reads nothing. Time is
        not kept: ``now`` is computed afresh from the kept clock state, so leases and TTLs
        lapse on a kept record exactly as on a read one. (Were the check ever wrong, the
        harm is bounded: a decision to run goes through a write step that re-reads under
        the write lock; only a read-only answer could be stale.)"""
        header = self._raw_header()
        if header is not None:
            kept = self._kept
            if kept.header == header:  # equal to one judged whole: whole
                rec = kept.records.get(intent, _ABSENT)
                if rec is _ABSENT and kept.parent is not None:
                    rec, walked = kept.below(intent)
                    if walked >= _MERGE_WALK and rec is not _ABSENT:
                        self._merge(kept)  # served from deep down: the next one is not
                if rec is not _ABSENT:
                    now = self._now_from(kept.offset, kept.last, self._boot)
                    return rec, now  # type: ignore[return-value]
            if not _whole(header):
                header = None
        (row,) = self._query(
            "read",
            f"SELECT f.boot_offset, f.boot_last, f.boot_id, {_ICOLS} FROM fence f "
            "LEFT JOIN intents i ON i.intent = ? WHERE f.id = 0",
            (intent,),
        )
        rec = None if row[3] is None else self._decode(row[3:])
        if row[2] != self._boot:
            header = None  # the clock state of another boot is never kept: rebased below
        # kept only when the header is the same after the statement: then no commit came
        # between, and the statement read exactly the state the header names (a later
        # state kept under it would pair its record with the clock state of this one)
        if header is not None and self._raw_header() == header:
            with self._kept_lock:  # nothing in here may wait for the writer (see _rekey)
                kept = self._kept
                if kept.header != header:
                    if kept.header is None or not _newer(kept.header, header):
                        kept = self._kept = _Kept(header, row[0], row[1], {intent: rec})
                    # else a late reader: the cache has moved on, this is not kept
                elif kept.base + len(kept.records) >= _READ_CACHE:
                    # bounded: start again (a new object: a reader may hold this one)
                    self._kept = _Kept(header, kept.offset, kept.last, {intent: rec})
                else:
                    kept.records[intent] = rec
        return rec, self._now_from(row[0], row[1], row[2])  # may write (a rebase): unlocked

    def _kept_record(self, intent: str) -> Any:
        """What the read cache holds for ``intent`` now (for tests: ``_ABSENT`` if none)."""
        kept = self._kept
        rec = kept.records.get(intent, _ABSENT)
        return kept.below(intent)[0] if rec is _ABSENT else rec

    def _merge(self, kept: _Kept) -> None:
        """Replace a deep chain, if still the cache in use, by one level holding the same."""
        with self._kept_lock:
            if self._kept is kept:
                self._kept = _Kept(kept.header, kept.offset, kept.last, kept.merged())

    def _rekey(self, before: bytes, after: bytes) -> None:
        """Under the write lock, after a transaction of tracked steps committed: carry the
        read cache over to the header that commit wrote.

        ``before`` was read inside the transaction (no other writer can commit then),
        ``after`` once it committed; the commit counter moving by exactly one means no
        other commit came between, so the state named by ``after`` is the state named by
        ``before`` plus this transaction's writes, which the steps recorded as they made
        them (``_wrote``, and the clock state of the last tick). Kept records of the state
        before stay right, those written are replaced, and the cache lives on."""
        wrote, ticked = self._wrote, self._ticked
        with self._kept_lock:
            kept = self._kept
            if kept.header == after:  # a reader was first: it read the new state already
                kept.records.update(wrote)
                return
            same = kept.header == before
            if ticked is not None:
                offset, last = ticked
            elif same:
                offset, last = kept.offset, kept.last
            else:
                return  # the clock state is not known: the next read runs its statement
            # a new level over the old one, never a change to it: a reader holding the old
            # one would pair a record written here with the clock state of before
            if not same or kept.base + len(kept.records) + len(wrote) > _READ_CACHE:
                self._kept = _Kept(after, offset, last, dict(wrote))
            elif kept.depth + 1 >= _MERGE_DEPTH:
                records = kept.merged()
                records.update(wrote)
                self._kept = _Kept(after, offset, last, records)
            else:
                self._kept = _Kept(after, offset, last, dict(wrote), kept)

    def _wal_header(self) -> bytes | None:
        """The WAL-index header (https://sqlite.org/walformat.html#the_wal_index_header):
        the commit counter, last frame and salts of the WAL, rewritten by every commit.
        None when it cannot be read whole and consistent (a writer is between its two
        copies, or there is no ``-shm`` file to read): then the statement runs."""
        header = self._raw_header()
        return header if header is not None and _whole(header) else None

    def _raw_header(self) -> bytes | None:
        """The header's bytes as read, torn or not (see :func:`_whole`)."""
        if self._fork != _fork.generation():
            return None  # the statement's _acquire moves a forked child onto its own first
        fd = self._shm
        if fd is None:
            fd = self._open_shm()
        if fd < 0:
            return None
        mapped = self._mapped
        if mapped is not None:
            header: bytes = mapped[:_WAL_HEADER]  # a mapped page: no system call
            return header
        try:
            return os.pread(fd, _WAL_HEADER, 0)
        except OSError:
            return None

    def _open_shm(self) -> int:
        """Open the ``-shm`` file for reading, behind a connection of our own kept open.

        The keeper holds the locks that stop any process from deleting or truncating the
        ``-shm`` file (SQLite does both only when it holds the last connection), so the file
        read stays the one every writer updates. Without ``os.pread`` (Windows) there is no
        read cache: every replay runs its statement."""
        if not hasattr(os, "pread"):
            self._shm = -1
            return -1
        with self._all_lock:
            if self._shm is not None:
                return self._shm
            if self._closed:
                return -1
            try:
                keeper = self._keeper
                if keeper is None:
                    keeper = self._keeper = self._open_conn()
                    self._all.append(keeper)
                keeper.execute("SELECT 1 FROM fence WHERE id = 0").fetchall()  # maps the WAL
                fd = _shm_fd(self._real)
            except (OSError, sqlite3.Error):
                return -1  # tried again on the next read
            self._mapped = _shm_map(fd)
            self._shm = fd
            return fd

    def current(self, domain: str) -> int:
        (row,) = self._query(
            "current",
            "SELECT coalesce((SELECT seq FROM domains WHERE domain = ?), floor) "
            "FROM fence WHERE id = 0",
            (domain,),
        )
        return int(row[0])

    def in_flight(self, domain: str) -> int:
        (row,) = self._query(
            "in_flight",
            "SELECT count(*) FROM intents WHERE domain = ? AND state = 'in_flight'",
            (domain,),
        )
        return int(row[0])

    def size(self) -> dict[str, int]:
        (row,) = self._query(
            "size",
            "SELECT (SELECT count(*) FROM intents), (SELECT count(*) FROM domains), "
            "(SELECT count(*) FROM domains WHERE head IS NOT NULL), (SELECT count(*) FROM certs)",
        )
        return {"records": row[0], "domains": row[1], "heads": row[2], "certs": row[3]}

    def records(
        self, *, states: Sequence[State] = (), domain: str | None = None, limit: int = 1000
    ) -> Iterator[IntentRecord]:
        where: list[str] = []
        params: list[Any] = []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            params.extend(s.value for s in states)
        if domain is not None:
            where.append("domain = ?")
            params.append(domain)
        sql = f"SELECT {_COLS} FROM intents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY intent LIMIT ?"
        rows = self._query("records", sql, (*params, max(0, int(limit))))
        for row in rows:
            yield self._decode(row)

    def certs(self, domain: str, *, after_seq: int = 0, limit: int = 1000) -> Iterator[Any]:
        """Committed certificates of ``domain`` after ``after_seq``, in seq order."""
        rows = self._query(
            "certs",
            "SELECT cert FROM certs WHERE domain = ? AND seq > ? ORDER BY seq LIMIT ?",
            (domain, after_seq, max(0, int(limit))),
        )
        for (cert,) in rows:
            yield cert_from_json(cert)

    def trail_cut(self, domain: str) -> int:
        (row,) = self._query(
            "trail_cut",
            "SELECT coalesce((SELECT through FROM trail_cuts WHERE domain = ?), 0)",
            (domain,),
        )
        return int(row[0])

    def sealing_key(self) -> bytes:
        """Kept in the file (get-or-create in one transaction): every process sharing the
        store seals and opens tickets with the same key."""
        if self._key is None:
            with self._key_lock:
                if self._key is None:
                    self._key = self._write("sealing_key", self._get_or_create_key)
        return self._key

    @staticmethod
    def _get_or_create_key(conn: sqlite3.Connection) -> bytes:
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('sealing_key', ?)",
            (secrets.token_bytes(32),),
        )
        row = conn.execute("SELECT value FROM meta WHERE key = 'sealing_key'").fetchone()
        return bytes(row[0])

    # -- steps ------------------------------------------------------------------------------
    @staticmethod
    def _at(conn: sqlite3.Connection, domain: str) -> int:
        row = conn.execute(
            "SELECT coalesce((SELECT seq FROM domains WHERE domain = ?), floor) "
            "FROM fence WHERE id = 0",
            (domain,),
        ).fetchone()
        return int(row[0])

    def _compare(
        self, conn: sqlite3.Connection, pairs: Sequence[tuple[str, int]]
    ) -> tuple[str, int, int | None] | None:
        for d, s in pairs:
            actual = self._at(conn, d)
            if actual != s:
                return (d, s, actual)
        return None

    def claim(
        self,
        intent: str,
        *,
        expect: IntentRecord | None,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        reserve_at: int | None,
    ) -> Step:
        if expect is None and not compare and reserve_at is None:
            # the common case, a slot the decider saw empty: the insert is the compare
            try:
                empty: Step = self._write(
                    "claim",
                    self._claim_empty,
                    intent,
                    fingerprint,
                    domain,
                    agent,
                    lease_ttl,
                    reclaim_after,
                )
                return empty
            except _SlotTaken:
                pass  # rolled back whole: the checked claim below answers with what is there
        step: Step = self._write(
            "claim",
            self._claim,
            intent,
            expect,
            fingerprint,
            domain,
            agent,
            lease_ttl,
            reclaim_after,
            compare,
            reserve_at,
        )
        return step

    def _claim(
        self,
        conn: sqlite3.Connection,
        intent: str,
        expect: IntentRecord | None,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        reserve_at: int | None,
    ) -> Step:
        row = self._fetch(conn, intent)
        cur = None if row is None else self._decode(row)
        # condition 1: the slot still holds the version the decider observed
        if not same_record(cur, expect):
            return Step(MOVED, found=cur)
        # condition 2: the compared pairs hold (an absent domain is at the floor)
        if compare:
            stale = self._compare(conn, compare)
            if stale is not None:
                return Step(STALE, found=cur, stale=stale)
        # condition 3: reserve: compare-exchange at reserve_at, else the next seq
        if reserve_at is None:
            got = conn.execute(_RESERVE_NEXT, (domain,)).fetchall()[0]
        else:
            at = self._at(conn, domain)
            if at != reserve_at:  # lost: nothing written, no domain created (G7)
                return Step(RACE, found=cur, stale=(domain, reserve_at, at))
            got = conn.execute(
                "INSERT INTO domains (domain, seq) VALUES (?, ?) "
                "ON CONFLICT (domain) DO UPDATE SET seq = excluded.seq RETURNING seq, head, clock",
                (domain, reserve_at + 1),
            ).fetchall()[0]
        rec, head = self._held(
            conn, intent, fingerprint, domain, agent, lease_ttl, reclaim_after, got
        )
        self._put(conn, rec, None, new=cur is None)
        return Step(APPLIED, rec, cur, head)

    def _claim_empty(
        self,
        conn: sqlite3.Connection,
        intent: str,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
    ) -> Step:
        """A claim of a slot the decider saw empty, with nothing compared and no seq asked
        for: reserve, draw the token, and insert, the insert being condition 1 (a slot
        taken meanwhile inserts nothing). One statement less than the checked claim, and no
        record to decode. A slot found taken raises :class:`_SlotTaken`, which rolls back
        the reservation and the token with the rest of the transaction (or savepoint)."""
        got = conn.execute(_RESERVE_NEXT, (domain,)).fetchall()[0]
        rec, head = self._held(
            conn, intent, fingerprint, domain, agent, lease_ttl, reclaim_after, got
        )
        if conn.execute(_INSERT_NEW, _row(rec, None)).rowcount != 1:
            raise _SlotTaken(intent)
        self._wrote[intent] = rec  # for the read cache, if this commits (see _rekey)
        return Step(APPLIED, rec, None, head)

    def _held(
        self,
        conn: sqlite3.Connection,
        intent: str,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
        reserved: Sequence[Any],
    ) -> tuple[IntentRecord, Head]:
        """A claim's record once its seq is ``reserved`` (seq, head hash, head clock): the
        token and the lease from one tick of the clock, under the write lock."""
        seq, head_hash, head_clock = reserved
        now, token = self._tick(conn, token=True)
        rec = IntentRecord(
            intent,
            State.IN_FLIGHT,
            token,
            fingerprint,
            domain,
            agent,
            now + lease_ttl,
            None,
            0.0,
            "",
            0.0,
            seq,
            now + reclaim_after,
        )
        head = EMPTY_HEAD if head_hash is None else Head(head_hash, json.loads(head_clock))
        return rec, head

    def complete(
        self,
        intent: str,
        token: int,
        cert: Any,
        *,
        fingerprint: bytes,
        result_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        own_seq: int | None,
        stale_reason: str,
        stale_reclaim_after: float,
    ) -> Step:
        cert_json = cert_to_json(cert)  # encoded before the lock is taken
        self._certs.keep(cert_json, cert)  # the first replay here decodes nothing
        step: Step = self._write(
            "complete",
            self._complete,
            intent,
            token,
            bytes(fingerprint),
            cert,
            cert_json,
            result_ttl,
            reclaim_after,
            compare,
            own_seq,
            stale_reason,
            stale_reclaim_after,
        )
        return step

    def _complete(
        self,
        conn: sqlite3.Connection,
        intent: str,
        token: int,
        fingerprint: bytes,
        cert: Any,
        cert_json: bytes,
        result_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        own_seq: int | None,
        stale_reason: str,
        stale_reclaim_after: float,
    ) -> Step:
        row = self._fetch(conn, intent)
        cur = None if row is None else self._decode(row)
        if (
            cur is None
            or cur.state is not State.IN_FLIGHT
            or cur.token != token
            or cur.fingerprint != fingerprint
        ):
            return Step(MOVED, found=cur)
        stale = self._compare(conn, compare) if compare else None
        if stale is None and own_seq is not None:
            actual = self._at(conn, cur.domain)
            if actual != own_seq:
                stale = (cur.domain, own_seq, actual)
        now, _ = self._tick(conn)
        if stale is not None:
            rec = IntentRecord(
                intent,
                State.FAILED,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                reason=stale_reason,
                since=now,
                seq=cur.seq,
                reclaim_at=now + stale_reclaim_after,
            )
            self._put(conn, rec, None, new=False)
            return Step(STALE, rec, cur, stale=stale)
        until = now + result_ttl
        rec = IntentRecord(
            intent,
            State.DONE,
            token,
            cur.fingerprint,
            cur.domain,
            cur.agent,
            0.0,
            cert,
            until,
            "",
            0.0,
            cur.seq,
            now + reclaim_after,
        )
        self._put(conn, rec, cert_json, new=False)
        old = conn.execute("SELECT clock FROM domains WHERE domain = ?", (cur.domain,)).fetchone()
        merged = merge_head(
            json.loads(old[0]) if old is not None and old[0] is not None else {},
            cert.vector_clock,
        )
        conn.execute(
            "UPDATE domains SET head = ?, clock = ? WHERE domain = ?",
            (cert.hash, json.dumps(merged, separators=(",", ":")), cur.domain),
        )
        conn.execute(
            "INSERT INTO certs (domain, seq, hash, cert, committed_at, keep_until) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                cert.domain,
                cert.seq,
                cert.hash,
                cert_json,
                now,
                encode_deadline(until + self.cert_retention),
            ),
        )
        return Step(APPLIED, rec, cur)

    def _finish(
        self,
        conn: sqlite3.Connection,
        intent: str,
        token: int,
        make: Callable[[IntentRecord, float], IntentRecord | None],
    ) -> Step:
        """Compare-by-token: replace the in-flight record of ``token`` (None deletes it)."""
        row = self._fetch(conn, intent)
        cur = None if row is None else self._decode(row)
        if cur is None or cur.state is not State.IN_FLIGHT or cur.token != token:
            return Step(MOVED, found=cur)
        now, _ = self._tick(conn)
        new = make(cur, now)
        if new is None:
            conn.execute("DELETE FROM intents WHERE intent = ? AND token = ?", (intent, token))
            self._wrote[intent] = None
        else:
            self._put(conn, new, None, new=False)
        return Step(APPLIED, new, cur)

    def fail(self, intent: str, token: int, reason: str, *, reclaim_after: float) -> Step:
        def failed(cur: IntentRecord, now: float) -> IntentRecord:
            return IntentRecord(
                intent,
                State.FAILED,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                reason=reason,
                since=now,
                seq=cur.seq,
                reclaim_at=now + reclaim_after,
            )

        step: Step = self._write("fail", self._finish, intent, token, failed)
        return step

    def release(self, intent: str, token: int) -> Step:
        step: Step = self._write("release", self._finish, intent, token, lambda cur, now: None)
        return step

    def renew(self, intent: str, token: int, *, lease_ttl: float, reclaim_after: float) -> Step:
        def renewed(cur: IntentRecord, now: float) -> IntentRecord:
            return IntentRecord(
                intent,
                State.IN_FLIGHT,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                lease_until=now + lease_ttl,
                seq=cur.seq,
                reclaim_at=now + reclaim_after,
            )

        step: Step = self._write("renew", self._finish, intent, token, renewed)
        return step

    def clear(self, intent: str) -> IntentRecord | None:
        def body(conn: sqlite3.Connection) -> IntentRecord | None:
            rows = conn.execute(
                f"DELETE FROM intents WHERE intent = ? RETURNING {_COLS}", (intent,)
            ).fetchall()
            return self._decode(rows[0]) if rows else None

        out: IntentRecord | None = self._write("clear", body)
        return out

    def clear_if(self, intent: str, *, expect: IntentRecord, entry: Mapping[str, Any]) -> Step:
        data = entry_to_json(entry)

        def body(conn: sqlite3.Connection) -> Step:
            row = self._fetch(conn, intent)
            cur = None if row is None else self._decode(row)
            # the condition: still the version the decider judged
            if cur is None or not same_record(cur, expect):
                return Step(MOVED, found=cur)
            now, _ = self._tick(conn)
            conn.execute("DELETE FROM intents WHERE intent = ?", (intent,))
            (audit_id,) = conn.execute(
                "INSERT INTO audit (intent, at, entry) VALUES (?, ?, ?) RETURNING id",
                (intent, now, data),
            ).fetchall()[0]
            return Step(APPLIED, None, cur, entry=entry_from_json(data, audit_id, now))

        step: Step = self._write("clear", body)
        return step

    def audit(
        self, *, intent: str | None = None, after: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        where = ["id > ?"]
        params: list[Any] = [-1 if after is None else int(after)]
        if intent is not None:
            where.append("intent = ?")
            params.append(intent)
        order = "ASC" if after is not None else "DESC"
        rows = self._query(
            "audit",
            f"SELECT id, at, entry FROM audit WHERE {' AND '.join(where)} "
            f"ORDER BY id {order} LIMIT ?",
            (*params, max(0, int(limit))),
        )
        if after is None:
            rows.reverse()
        return [entry_from_json(data, i, at) for i, at, data in rows]

    def evict_domain(self, domain: str) -> Step:
        def body(conn: sqlite3.Connection) -> Step:
            (busy,) = conn.execute(
                "SELECT count(*) FROM intents WHERE domain = ? AND state = 'in_flight'", (domain,)
            ).fetchone()
            if busy:
                return Step(BUSY, count=busy)
            rows = conn.execute(
                "DELETE FROM domains WHERE domain = ? RETURNING seq", (domain,)
            ).fetchall()
            if not rows:
                return Step(APPLIED, value=None)
            row = rows[0]
            # raise the floor above every seq the domain handed out: no (domain, seq) pair
            # can match again, and a re-created domain starts above them all (G5)
            conn.execute("UPDATE fence SET floor = max(floor, ?) WHERE id = 0", (row[0] + 1,))
            return Step(APPLIED, value=int(row[0]))

        step: Step = self._write("evict_domain", body)
        return step

    def sweep(self, limit: int | None = None) -> int:
        """Delete due records in batches, each one transaction; also drops certificates
        whose retention ended. Returns how many records went."""
        total = 0
        while True:
            batch = _SWEEP_BATCH if limit is None else min(_SWEEP_BATCH, limit - total)
            if batch <= 0:
                return total
            n: int = self._write("sweep", self._sweep_batch, batch)
            total += n
            if n < batch:
                return total

    def _sweep_batch(self, conn: sqlite3.Connection, batch: int) -> int:
        now, _ = self._tick(conn)
        cur = conn.execute(
            "DELETE FROM intents WHERE intent IN (SELECT intent FROM intents "
            "WHERE reclaim_at <= ?1 ORDER BY reclaim_at LIMIT ?2) AND reclaim_at <= ?1",
            (now, batch),
        )
        # Certificates go only as a prefix of their domain's trail. keep_until follows each
        # commit's time and result_ttl, not seq, so a certificate goes only when none
        # before it in its domain is still kept, and with it go all those before it (due,
        # then): a batch that stops short leaves no hole. A hole broke the parent link over
        # it and the trail check called a sound trail tampered (found by review). One that
        # must wait for an earlier one is kept until that one's keep_until (retention is a
        # least time), so no later sweep looks it over again. A batch is the first due ones
        # from the certs_keep index: certificates kept for ever cost the sweep nothing (a
        # scan of them all under the write lock, found by review). Where each trail now
        # starts is kept in trail_cuts (see check_trail for commits landing below it).
        tops: dict[str, int] = {}
        later: list[tuple[float, str, int]] = []
        for domain, seq, blocker in conn.execute(_SWEEP_CERTS, (now, batch)).fetchall():
            if blocker is None:
                tops[domain] = max(seq, tops.get(domain, 0))
            else:
                later.append((blocker, domain, seq))
        conn.executemany("UPDATE certs SET keep_until = ? WHERE domain = ? AND seq = ?", later)
        left = batch  # a batch deletes at most that many, in seq order: still a prefix
        for domain, through in sorted(tops.items()):
            if left <= 0:
                break
            gone = conn.execute(
                "DELETE FROM certs WHERE (domain, seq) IN (SELECT domain, seq FROM certs "
                "WHERE domain = ?1 AND seq <= ?2 AND keep_until <= ?3 ORDER BY seq LIMIT ?4) "
                "RETURNING seq",
                (domain, through, now, left),
            ).fetchall()
            if not gone:
                continue
            left -= len(gone)
            conn.execute(
                "INSERT INTO trail_cuts (domain, through) VALUES (?, ?) ON CONFLICT (domain) "
                "DO UPDATE SET through = max(through, excluded.through)",
                (domain, max(s for (s,) in gone)),
            )
        return cur.rowcount

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Close every idle connection now, and each one in use when its step ends; later
        calls report the store unavailable."""
        with self._all_lock:
            self._closed = True
            keeper, idle, self._free = self._keeper, self._free, []
            self._shm, self._keeper = -1, None  # its descriptor: see _forget_shm
            self._mapped = None
        if keeper is not None:
            self._drop(keeper)
        while True:  # one by one: a caller that took one from the old list just now keeps it
            try:
                conn = idle.pop()
            except IndexError:
                break
            self._drop(conn)
        _forget_shm(self._real)
