"""Build the cffi extension ``effectfence._effectfence_atomic`` (API mode, out-of-line).

This module only builds the FFI; ``effectfence/_atomic.py`` is the one module that uses it.
The C lives in ``csrc/``: the lock-free counter core (plain C11) and the Python-facing shim
``effectfence_binding.h``, whose CDEF block is the cdef (one source of truth for both sides).

Run ``python build_ffi.py`` to build in place, or let setuptools do it through
``cffi_modules=["build_ffi.py:ffi"]`` in setup.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BINDING_HEADER = CSRC / "effectfence_binding.h"
SOURCES = [CSRC / "effectfence_counters.c"]


def cdef_from_header(text: str) -> str:
    """The declarations between the CDEF markers of the binding header."""
    match = re.search(r"/\* CDEF-BEGIN \*/(.*?)/\* CDEF-END \*/", text, re.S)
    if match is None:
        raise RuntimeError(f"{BINDING_HEADER} has no CDEF-BEGIN/CDEF-END block")
    return match.group(1)


ffi = FFI()
ffi.cdef(cdef_from_header(BINDING_HEADER.read_text(encoding="utf-8")))
ffi.set_source(
    "effectfence._effectfence_atomic",
    # Pasted after <Python.h> and before the generated wrappers: the header redefines
    # Py_BEGIN/END_ALLOW_THREADS there so the GIL is kept (see its opening comment).
    '#include "effectfence_binding.h"\n',
    # Relative paths: setuptools refuses absolute ones in a source build.
    sources=[str(path.relative_to(HERE)) for path in SOURCES],
    include_dirs=[str(CSRC.relative_to(HERE))],
    depends=[str(path.relative_to(HERE)) for path in sorted(CSRC.glob("effectfence_*.h"))],
    extra_compile_args=["-std=c11", "-O2"],
)

if __name__ == "__main__":
    ffi.compile(tmpdir=str(HERE), verbose=True)
