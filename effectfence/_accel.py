"""The optional CPython accelerator, ``effectfence._speedups`` (csrc/effectfence_speedups.c).

It encodes RFC 8785 JSON in C and runs the memory fence's common paths (a fresh claim, a
replay, a commit by the current token) in C, on the memory store's own structures under its
own locks; everything else stays with the Python code it shadows. It belongs to the compiled
core with the atomic counter table, so ``EFFECTFENCE_COUNTERS`` governs both: ``pure`` turns
it off (the whole pure-Python twin runs, as on a machine without a compiler) and ``atomic``
makes a missing accelerator an error instead of a quiet slowdown.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Final

from effectfence.counters import ENV_VAR, CounterBackendUnavailable

__all__ = ["EXPECTED_ABI", "import_error", "openssl_sha256_address", "speedups"]

#: The ABI of csrc/effectfence_speedups.c this package was written against.
EXPECTED_ABI: Final = 1

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


_SHA256_CHECKS = (b"", b"abc", bytes(range(256)) * 3)


@functools.cache
def openssl_sha256_address() -> int:
    """Address of OpenSSL's one-shot ``SHA256(data, len, out)`` in the libcrypto that hashlib
    already loaded, or 0 when it can't be found or doesn't agree with hashlib.

    A certificate's hash through hashlib is two Python calls and two context allocations,
    most of a commit's cost; the C path calls the same OpenSSL routine directly instead.
    Linux only (the loaded library is found in /proc/self/maps); elsewhere, and whenever
    the self-check fails, the C path keeps calling hashlib. Looked up once per process.
    """
    try:
        import _hashlib  # noqa: F401  (loads libcrypto, if hashlib uses OpenSSL)
        import ctypes
        import hashlib

        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/libcrypto" in line}
        if len(paths) != 1:  # none, or two OpenSSLs in one process: don't guess
            return 0
        fn = ctypes.CDLL(paths.pop()).SHA256
        fn.restype = ctypes.c_void_p
        fn.argtypes = (ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p)
        for data in _SHA256_CHECKS:
            out = ctypes.create_string_buffer(32)
            fn(data, len(data), out)
            if out.raw != hashlib.sha256(data).digest():
                return 0
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    except (ImportError, OSError, AttributeError, ValueError):
        return 0
