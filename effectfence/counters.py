"""Per-domain 64-bit sequence counters: the C atomic table and its pure-Python twin.

Theory of operation
-------------------
A table maps a domain name to a *slot*, and a slot to a non-negative int64 counter.  The
fence reserves sequence numbers with ``reserve`` (fetch-add, returns the new value) and does
strict OCC with ``advance_if`` (``expected -> expected + 1`` in one step, or tell the caller
what the value really was).  Both tables implement exactly the same contract
(:class:`CounterTable`) and run the same test suite; which one ``new_table()`` returns is
decided once, here, and reported by :data:`BACKEND` and :func:`backend_info`.

- ``AtomicCounterTable``: counters live in C (``csrc/effectfence_counters.c``), in a segmented
  array of ``_Atomic int64_t`` that only grows and never moves.  Every counter operation is one
  C call holding the GIL and doing one atomic instruction; there is no lock anywhere.  The name
  -> slot map is a dict (``get`` then ``setdefault``: each one step under the GIL), and freed
  slots go to a process-wide free list (``list.append``/``pop``, also one step).
- ``PureCounterTable``: the same dict, Python ints in a list, and a ``threading.Lock`` around
  every compare-and-set.  It is the fallback when the extension cannot be built, and the
  baseline the benchmark compares against.

No ABA after eviction: ``evict`` raises a table-wide *floor* to at least the evicted counter's
last value + 1 before it forgets the domain, and a new counter starts at the floor.  So a
re-created domain is strictly above every value the old one ever had: an old
``(domain, seq)`` pair can never match again (neither as a current value nor as a reservation).
Precondition of ``evict``: no other thread is operating on that domain (the fence guarantees
this by refusing eviction while an attempt is in flight).

Slot calls (``*_slot``) skip the name lookup.  A slot is an opaque handle, valid from
``slot()``/``find()`` until the domain is evicted, and only on the table that handed it out.
Both tables refuse (ValueError) a slot that is not live: never handed out, out of range, or
whose domain was evicted (even once its storage is reused); handles are never small ints, so
an index is never mistaken for a slot.  One difference, by design: the atomic table's slot calls
are the raw C functions, which do not know the table they are called through, so a *live* slot
of another atomic table acts on that table's counter, where the pure table refuses it.
Checking that in C would need the table passed in, a two-argument call that costs about as
much as the operation itself.

Arguments beyond int64 are refused like any other out-of-range argument (a slot: ValueError; a
negative value: ValueError; a value past :data:`MAX_VALUE`: OverflowError), by both tables.

Backend choice: ``EFFECTFENCE_COUNTERS=pure|atomic`` forces one (forcing ``atomic`` without the
extension raises :class:`CounterBackendUnavailable`, an ImportError); unset or empty means
atomic when the extension imports, pure otherwise.
"""

from __future__ import annotations

import importlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, Protocol, runtime_checkable

__all__ = [
    "BACKEND",
    "ENV_VAR",
    "MAX_VALUE",
    "AtomicCounterTable",
    "CounterBackendUnavailable",
    "CounterTable",
    "PureCounterTable",
    "backend_info",
    "new_table",
]

#: Environment variable that forces a backend.
ENV_VAR: Final = "EFFECTFENCE_COUNTERS"
#: Largest value a counter may hold; anything that would go past it raises OverflowError.
MAX_VALUE: Final = 2**63 - 2
_BACKENDS: Final = ("atomic", "pure")


class CounterBackendUnavailable(ImportError):
    """``EFFECTFENCE_COUNTERS=atomic`` was set but the C extension cannot be imported."""


@runtime_checkable
class CounterTable(Protocol):
    """What the fence codes against.  Both tables implement exactly this."""

    backend: str

    def slot(self, domain: str) -> int:
        """Get-or-create; a new counter starts at ``floor()``."""
        ...

    def find(self, domain: str) -> int:
        """The domain's slot, or -1 if absent.  Never creates."""
        ...

    def load(self, domain: str) -> int | None:
        """Current value, or None if absent.  Never creates."""
        ...

    def load_slot(self, slot: int) -> int: ...

    def reserve(self, domain: str) -> int:
        """Increment and return the new value; creates the domain at the floor if absent."""
        ...

    def reserve_slot(self, slot: int) -> int: ...

    def advance_if(self, domain: str, expected: int) -> int:
        """``expected -> expected + 1`` and return it; else ``-(current + 1)`` (always < 0)."""
        ...

    def advance_if_slot(self, slot: int, expected: int) -> int: ...

    def compare_exchange(self, domain: str, expected: int, new: int) -> tuple[bool, int]:
        """Returns ``(swapped, value observed before)``."""
        ...

    def floor(self) -> int: ...

    def evict(self, domain: str) -> int | None:
        """Forget the domain, raising the floor above its last value; returns that value."""
        ...

    def __len__(self) -> int: ...

    def domains(self) -> list[str]: ...


# --- shared error reporting (only on the failure paths) -------------------------------------


def _domain_error(domain: object) -> TypeError:
    return TypeError(f"domain must be a str, got {type(domain).__name__}")


def _int_error(what: str, value: object) -> TypeError:
    return TypeError(f"{what} must be an int, got {type(value).__name__}")


def _check_value(what: str, value: object) -> None:
    """Raise the error the C shim raises for an out-of-range or non-int argument."""
    if not isinstance(value, int):
        raise _int_error(what, value)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    if value > MAX_VALUE:
        raise OverflowError(f"{what} {value} exceeds the counter maximum 2**63-2")


def _check_expected_advance(expected: object) -> None:
    _check_value("expected", expected)
    if expected == MAX_VALUE:
        raise OverflowError("expected is at the counter maximum 2**63-2 and cannot advance")


def _slot_error(slot: object) -> Exception:
    if not isinstance(slot, int):
        return _int_error("slot", slot)
    return ValueError(
        f"counter slot {slot} is not live: never handed out by slot()/find(), or its domain "
        f"was evicted"
    )


def _overflow_error(slot: int) -> OverflowError:
    return OverflowError(f"counter at slot {slot} is at its maximum 2**63-2 and cannot advance")


# --- pure-Python table ----------------------------------------------------------------------

#: Slot handles of every pure table in the process: never reused and never small (like the C
#: table's), so a slot of another table, an evicted one or a bare index is never a key of
#: ``_values`` and is refused.  Odd and above 2**53, so no float (and no bool) equals one and
#: the hot paths need no type check to refuse them.  ``next()`` is one step under the GIL.
_PURE_HANDLES: Final = itertools.count((1 << 53) + 1, 2)


class PureCounterTable:
    """Python ints in a dict keyed by slot handle, one ``threading.Lock`` around every
    read-modify-write."""

    backend: str = "pure"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._values: dict[int, int] = {}
        self._floor = 0

    def __repr__(self) -> str:
        return f"PureCounterTable(domains={len(self._slots)}, floor={self._floor})"

    def slot(self, domain: str) -> int:
        try:
            slot = self._slots.get(domain)
        except TypeError:
            raise _domain_error(domain) from None
        return self._create(domain) if slot is None else slot

    def _create(self, domain: str) -> int:
        if not isinstance(domain, str):
            raise _domain_error(domain)
        with self._lock:
            slot = self._slots.get(domain)
            if slot is not None:
                return slot
            slot = next(_PURE_HANDLES)
            self._values[slot] = self._floor
            self._slots[domain] = slot
            return slot

    def find(self, domain: str) -> int:
        try:
            slot = self._slots.get(domain)
        except TypeError:
            raise _domain_error(domain) from None
        if slot is None:
            if not isinstance(domain, str):
                raise _domain_error(domain)
            return -1
        return slot

    def load(self, domain: str) -> int | None:
        slot = self.find(domain)
        # .get: evicted since find() (a lock-free reader, the memory store's current(),
        # meets it; found by review): absent, as the C table answers
        return None if slot < 0 else self._values.get(slot)

    def load_slot(self, slot: int) -> int:
        if type(slot) is not int and not isinstance(slot, int):
            # a Fraction or float equal to a slot finds it in the dict: the C table takes
            # ints only (parity, found by review)
            raise _int_error("slot", slot)
        try:
            return self._values[slot]
        except (KeyError, TypeError):
            raise _slot_error(slot) from None

    def reserve(self, domain: str) -> int:
        slot = self._slots.get(domain) if type(domain) is str else None
        if slot is None:
            slot = self.slot(domain)
        return self.reserve_slot(slot)

    def reserve_slot(self, slot: int) -> int:
        if type(slot) is not int and not isinstance(slot, int):
            raise _int_error("slot", slot)  # see load_slot
        values = self._values
        with self._lock:
            try:
                value = values[slot]
            except (KeyError, TypeError):
                pass
            else:
                if value >= MAX_VALUE:
                    raise _overflow_error(slot)
                values[slot] = value + 1
                return value + 1
        raise _slot_error(slot)

    def advance_if(self, domain: str, expected: int) -> int:
        slot = self._slots.get(domain) if type(domain) is str else None
        if slot is None:
            _check_expected_advance(expected)  # refuse before creating: bad input changes nothing
            slot = self.slot(domain)
        return self.advance_if_slot(slot, expected)

    def advance_if_slot(self, slot: int, expected: int) -> int:
        if type(slot) is not int and not isinstance(slot, int):
            raise _int_error("slot", slot)  # see load_slot
        values = self._values
        if type(expected) is not int or not 0 <= expected < MAX_VALUE:
            self.load_slot(slot)  # a bad slot is reported first, as the C shim does
            _check_expected_advance(expected)
        with self._lock:
            try:
                current = values[slot]
            except (KeyError, TypeError):
                pass
            else:
                if current == expected:
                    values[slot] = expected + 1
                    return expected + 1
                return -current - 1
        raise _slot_error(slot)

    def compare_exchange(self, domain: str, expected: int, new: int) -> tuple[bool, int]:
        slot = self._slots.get(domain) if type(domain) is str else None
        if slot is None:
            _check_value("expected", expected)
            _check_value("new", new)
            slot = self.slot(domain)
        self.load_slot(slot)  # a bad slot is reported first, as the C shim does
        _check_value("expected", expected)
        _check_value("new", new)
        values = self._values
        with self._lock:
            try:
                current = values[slot]
            except (KeyError, TypeError):
                pass
            else:
                if current == expected:
                    values[slot] = new
                    return True, current
                return False, current
        raise _slot_error(slot)

    def floor(self) -> int:
        return self._floor

    def evict(self, domain: str) -> int | None:
        if self.find(domain) < 0:
            return None
        with self._lock:
            slot = self._slots.pop(domain, None)
            if slot is None:
                return None
            last = self._values.pop(slot)  # the handle dies with the domain
            self._floor = max(self._floor, min(last + 1, MAX_VALUE))
            return last

    def __len__(self) -> int:
        return len(self._slots)

    def domains(self) -> list[str]:
        return list(self._slots)


# --- C atomic table -------------------------------------------------------------------------

_atomic: Any = None
_import_error: ImportError | None = None
try:
    _atomic = importlib.import_module("effectfence._atomic")
except ImportError as exc:
    _import_error = exc

AtomicCounterTable: Any = None

if _atomic is not None:
    _a_alloc: Callable[[int], int] = _atomic.alloc_slot
    _a_release: Callable[[int], int] = _atomic.release
    _a_reclaim: Callable[[int, int], int] = _atomic.reclaim
    _a_load: Callable[[int], int] = _atomic.load
    _a_reserve: Callable[[int], int] = _atomic.reserve
    _a_advance_if: Callable[[int, int], int] = _atomic.advance_if
    _a_compare_exchange: Callable[[int, int, int], int] = _atomic.compare_exchange
    _a_fetch_max: Callable[[int, int], int] = _atomic.fetch_max

    #: Released slots of evicted domains and dead tables, shared by all atomic tables of the
    #: process.  ``append``/``pop`` are single steps under the GIL, so this needs no lock.  A
    #: slot enters only after its domain left the name map and the C table retired its handle
    #: (``_free_slot``), so a stale copy of it is refused from then on, even once its cell is
    #: lent out again under a new handle.
    _FREE_SLOTS: list[int] = []

    def _take_slot(initial: int) -> int:
        try:
            slot = _FREE_SLOTS.pop()
        except IndexError:
            return _a_alloc(initial)
        return _a_reclaim(slot, initial)

    def _free_slot(slot: int) -> None:
        _a_release(slot)
        _FREE_SLOTS.append(slot)

    def _release_slots(slots: dict[str, int], floor_slot: int) -> None:
        for slot in (*slots.values(), floor_slot):
            _free_slot(slot)

    class _AtomicCounterTable:
        """Counters in the C atomic table; the name map is a dict; no lock anywhere."""

        backend: str = "atomic"

        # The hot slot calls are the raw C functions: they validate (a slot must be a live
        # handle), raise and return exactly what the protocol says, and any Python wrapper
        # would cost more than the work.
        load_slot = staticmethod(_a_load)
        reserve_slot = staticmethod(_a_reserve)
        advance_if_slot = staticmethod(_a_advance_if)

        def __init__(self) -> None:
            self._slots: dict[str, int] = {}
            # The floor is itself a C counter, raised with an atomic max on eviction.
            self._floor_slot = _take_slot(0)
            # not at exit: atexit hooks and daemon threads still use tables then (the
            # process's token and stats slots among them), found by review
            weakref.finalize(self, _release_slots, self._slots, self._floor_slot).atexit = False

        def __repr__(self) -> str:
            return f"AtomicCounterTable(domains={len(self._slots)}, floor={self.floor()})"

        def slot(self, domain: str) -> int:
            try:
                slot = self._slots.get(domain)
            except TypeError:
                raise _domain_error(domain) from None
            return self._create(domain) if slot is None else slot

        def _create(self, domain: str) -> int:
            if not isinstance(domain, str):
                raise _domain_error(domain)
            fresh = _take_slot(_a_load(self._floor_slot))
            slot = self._slots.setdefault(domain, fresh)
            if slot != fresh:  # another thread created it first: give ours back
                _free_slot(fresh)
            return slot

        def find(self, domain: str) -> int:
            try:
                slot = self._slots.get(domain)
            except TypeError:
                raise _domain_error(domain) from None
            if slot is None:
                if not isinstance(domain, str):
                    raise _domain_error(domain)
                return -1
            return slot

        def load(self, domain: str) -> int | None:
            slot = self.find(domain)
            if slot < 0:
                return None
            try:
                return _a_load(slot)
            except ValueError:  # evicted since find(), lock-free readers meet it: absent
                return None

        def reserve(self, domain: str) -> int:
            slot = self._slots.get(domain) if type(domain) is str else None
            if slot is None:
                slot = self.slot(domain)
            return _a_reserve(slot)

        def advance_if(self, domain: str, expected: int) -> int:
            slot = self._slots.get(domain) if type(domain) is str else None
            if slot is None:
                _check_expected_advance(expected)  # refuse before creating
                slot = self.slot(domain)
            return _a_advance_if(slot, expected)

        def compare_exchange(self, domain: str, expected: int, new: int) -> tuple[bool, int]:
            slot = self._slots.get(domain) if type(domain) is str else None
            if slot is None:
                _check_value("expected", expected)
                _check_value("new", new)
                slot = self.slot(domain)
            observed = _a_compare_exchange(slot, expected, new)
            return observed == expected, observed

        def floor(self) -> int:
            return _a_load(self._floor_slot)

        def evict(self, domain: str) -> int | None:
            slot = self.find(domain)
            if slot < 0:
                return None
            # Raise the floor *before* the name disappears, so a re-creation racing with us
            # (which the precondition forbids, but cheaply) still starts above the old value.
            _a_fetch_max(self._floor_slot, min(_a_load(slot) + 1, MAX_VALUE))
            if self._slots.pop(domain, None) != slot:
                return None  # a concurrent evict won; it reports and frees the slot
            last = _a_load(slot)
            _a_fetch_max(self._floor_slot, min(last + 1, MAX_VALUE))
            _free_slot(slot)
            return last

        def __len__(self) -> int:
            return len(self._slots)

        def domains(self) -> list[str]:
            return list(self._slots)

    _AtomicCounterTable.__name__ = _AtomicCounterTable.__qualname__ = "AtomicCounterTable"
    AtomicCounterTable = _AtomicCounterTable


# --- backend choice (the one place) ---------------------------------------------------------


def _check_backend_name(name: str, source: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"{source}={name!r} is not valid: use 'atomic', 'pure' or leave it unset")
    return name


def _choose_backend() -> tuple[str, str | None]:
    """(backend, why it is not the default atomic table, or None)."""
    raw = os.environ.get(ENV_VAR, "")
    forced = raw.strip().lower()
    if forced:
        _check_backend_name(forced, ENV_VAR)
    if forced == "pure":
        return "pure", f"forced by {ENV_VAR}=pure"
    if AtomicCounterTable is None:
        if forced == "atomic":
            raise CounterBackendUnavailable(
                f"{ENV_VAR}=atomic but the C extension cannot be imported: {_import_error}"
            )
        return "pure", f"C extension unavailable: {_import_error}"
    return "atomic", None


_reason: str | None
BACKEND, _reason = _choose_backend()


def new_table(backend: str | None = None) -> CounterTable:
    """A fresh table: of the chosen :data:`BACKEND`, or of the named one ("atomic"/"pure").

    Naming "atomic" when the extension is unavailable raises CounterBackendUnavailable.
    """
    name = BACKEND if backend is None else _check_backend_name(backend, "backend")
    if name == "pure":
        return PureCounterTable()
    if AtomicCounterTable is None:
        raise CounterBackendUnavailable(
            f"the atomic counter table needs the C extension, which cannot be imported: "
            f"{_import_error}"
        )
    table: CounterTable = AtomicCounterTable()
    return table


def backend_info() -> dict[str, object]:
    """What ``effectfence info`` and the stats report about the counter backend."""
    from effectfence import _accel  # imports this module: resolved at call time

    return {
        "backend": BACKEND,
        "forced": os.environ.get(ENV_VAR, "").strip().lower() or None,
        "fallback_reason": _reason if BACKEND == "pure" else None,
        "extension_available": _atomic is not None,
        "gil_kept": _atomic.gil_held() if _atomic is not None else None,
        "c_version": _atomic.VERSION if _atomic is not None else None,
        "c_abi": _atomic.ABI if _atomic is not None else None,
        "max_value": MAX_VALUE,
        # the CPython accelerator (canonical JSON, the memory fence's common paths): on
        # with the atomic table, off with EFFECTFENCE_COUNTERS=pure (effectfence._accel)
        "speedups": _accel.speedups is not None,
        "speedups_off_reason": _accel.import_error,
        # the memory store's claim and complete in C (effectfence.store.cmemory), and which
        # memory store EffectFence() builds by default
        "memstore": _accel.memstore is not None,
        "memstore_off_reason": _accel.memstore_error,
        "default_store": _default_store(),
    }


def _default_store() -> str:
    from effectfence.store.cmemory import memory_store_kind  # imports this module

    return memory_store_kind()
