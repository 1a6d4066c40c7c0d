"""The optional CPython accelerator, ``effectfence._speedups`` (csrc/effectfence_speedups.c).

It holds pure functions only (RFC 8785 encoding, the request constructor); no rule of the
protocol, which is written once in Python (docs/design.md). It belongs to the compiled
core with the atomic counter table, so ``EFFECTFENCE_COUNTERS`` governs both: ``pure`` turns
it off (the whole pure-Python twin runs, as on a machine without a compiler) and ``atomic``
makes a missing accelerator an error instead of a quiet slowdown.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Final

from effectfence.counters import ENV_VAR, CounterBackendUnavailable

__all__ = ["EXPECTED_ABI", "import_error", "speedups"]

#: The ABI of csrc/effectfence_speedups.c this package was written against.
EXPECTED_ABI: Final = 3

speedups: Any = None
import_error: str | None = None

_forced = os.environ.get(ENV_VAR, "").strip().lower()
if _forced == "pure":
    import_error = f"turned off by {ENV_VAR}=pure"
else:
    try:
        _mod: Any = importlib.import_module("effectfence._speedups")
    except ImportError as exc:
        import_error = f"not built or not importable ({exc})"
    else:
        if getattr(_mod, "ABI", None) == EXPECTED_ABI:
            speedups = _mod
        else:
            import_error = (
                f"built with ABI {getattr(_mod, 'ABI', None)}, expected {EXPECTED_ABI}: "
                "rebuild it (pip install -e . or python setup.py build_ext --inplace)"
            )
    if speedups is None and _forced == "atomic":
        raise CounterBackendUnavailable(
            f"{ENV_VAR}=atomic but the C accelerator effectfence._speedups is {import_error}"
        )
