"""The optional CPython accelerators, compiled from csrc/ (each optional, each with an ABI):

- ``effectfence._speedups`` (csrc/effectfence_speedups.c): pure functions only (RFC 8785
  encoding, the request constructor, wrap's JSON nesting walk);
- ``effectfence._certhash`` (csrc/effectfence_certhash.c): the certificate hash, a pure
  function over the first one's encoder and hashlib (used by effectfence.cert.spliced_hash);
- ``effectfence._memstore`` (csrc/effectfence_memstore.c): the memory store's claim and
  complete steps, a store implementation (effectfence.store.cmemory) that decides nothing.

Neither holds a rule of the protocol, which is written once in Python (docs/design.md).
They belong to the compiled core with the atomic counter table, so ``EFFECTFENCE_COUNTERS``
governs them all: ``pure`` turns them off (the whole pure-Python twin runs, as on a machine
without a compiler) and ``atomic`` makes a missing one an error instead of a quiet slowdown.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Final

from effectfence.counters import ENV_VAR, CounterBackendUnavailable

__all__ = [
    "EXPECTED_ABI",
    "EXPECTED_CERTHASH_ABI",
    "EXPECTED_MEMSTORE_ABI",
    "certhash",
    "certhash_error",
    "import_error",
    "memstore",
    "memstore_error",
    "speedups",
]

#: The ABI of csrc/effectfence_speedups.c this package was written against.
EXPECTED_ABI: Final = 4
#: The ABI of csrc/effectfence_certhash.c this package was written against.
EXPECTED_CERTHASH_ABI: Final = 1
#: The ABI of csrc/effectfence_memstore.c this package was written against.
EXPECTED_MEMSTORE_ABI: Final = 2

_forced = os.environ.get(ENV_VAR, "").strip().lower()


def _load(name: str, abi: int) -> tuple[Any, str | None]:
    """(module, None) or (None, why not)."""
    if _forced == "pure":
        return None, f"turned off by {ENV_VAR}=pure"
    try:
        mod: Any = importlib.import_module(f"effectfence.{name}")
    except ImportError as exc:
        return None, f"not built or not importable ({exc})"
    if getattr(mod, "ABI", None) != abi:
        return None, (
            f"built with ABI {getattr(mod, 'ABI', None)}, expected {abi}: "
            "rebuild it (pip install -e . or python setup.py build_ext --inplace)"
        )
    return mod, None


speedups: Any
import_error: str | None
certhash: Any
certhash_error: str | None
memstore: Any
memstore_error: str | None
speedups, import_error = _load("_speedups", EXPECTED_ABI)
certhash, certhash_error = _load("_certhash", EXPECTED_CERTHASH_ABI)
memstore, memstore_error = _load("_memstore", EXPECTED_MEMSTORE_ABI)

if _forced == "atomic":
    for _name, _mod, _why in (
        ("_speedups", speedups, import_error),
        ("_certhash", certhash, certhash_error),
        ("_memstore", memstore, memstore_error),
    ):
        if _mod is None:
            raise CounterBackendUnavailable(
                f"{ENV_VAR}=atomic but the C accelerator effectfence.{_name} is {_why}"
            )
