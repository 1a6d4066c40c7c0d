"""setup() exists only because cffi's ``cffi_modules`` hook needs it; metadata is in pyproject.

The C extension is optional for a source install: if it fails to compile, the install still
succeeds and effectfence runs on the pure-Python counter table (effectfence.counters reports
why).  Wheel builds for distribution set ``EFFECTFENCE_REQUIRE_EXTENSION=1`` so a broken
compiler fails the build instead of shipping a wheel without the extension.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE_ENV = "EFFECTFENCE_REQUIRE_EXTENSION"


def _extension_required() -> bool:
    value = os.environ.get(REQUIRE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"{REQUIRE_ENV}={value!r} is not valid: use 1 (required) or 0/unset")
    return value == "1"


class OptionalBuildExt(build_ext):
    """build_ext that turns a compiler failure into a quiet fallback, unless required."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all, broken toolchain, ...
            self._fall_back(exc)

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # this extension failed to compile or link
            self._fall_back(exc)

    def _fall_back(self, exc: BaseException) -> None:
        if _extension_required():
            raise exc
        print(
            f"effectfence: C extension not built ({type(exc).__name__}: {exc}); "
            f"using the pure-Python counter table. Set {REQUIRE_ENV}=1 to make this an error.",
            file=sys.stderr,
        )


_extension_required()  # reject a bad value before doing any work
setup(
    cffi_modules=["build_ffi.py:ffi"],
    # The CPython accelerator (canonical JSON, the memory fence's common paths); optional
    # like the counters: effectfence runs the same protocol in Python without it.
    ext_modules=[
        Extension(
            "effectfence._speedups",
            sources=["csrc/effectfence_speedups.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        # The memory store's claim and complete steps (a store, no rule: see the file's
        # header); effectfence.store.cmemory uses it only when it built.
        # The certificate hash in one call (a pure function over the accelerator's encoder
        # and hashlib); effectfence.cert.spliced_hash uses it only when it built.
        Extension(
            "effectfence._certhash",
            sources=["csrc/effectfence_certhash.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "effectfence._memstore",
            sources=["csrc/effectfence_memstore.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
