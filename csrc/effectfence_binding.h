/*
 * effectfence_binding.h -- the Python-facing shim over effectfence_counters.c.
 *
 * Included as the cffi `set_source` preamble (build_ffi.py), i.e. after <Python.h> and before
 * the wrappers cffi generates.  It does two things the plain C core cannot:
 *
 * 1. It keeps the GIL.  cffi wraps every call in Py_BEGIN/END_ALLOW_THREADS; for an operation
 *    of a few nanoseconds, dropping and re-taking the GIL costs far more than the work and makes
 *    threads convoy.  The macros are redefined below: BEGIN becomes a plain block, END closes
 *    it and returns NULL when the shim has set a Python exception.  Nothing here blocks or calls
 *    back into Python, so holding the GIL is safe.  ef_gil_held() lets the tests prove it.
 *
 * 2. It turns the core's negative return codes into Python exceptions in this one place, so the
 *    hot calls need no Python wrapper around them (that wrapper would cost more than the call).
 *    Because the GIL is held, raising from here is legal; the redefined END macro makes the
 *    generated wrapper return NULL instead of a value, which is how CPython signals an error.
 *    tests/test_build.py checks that every generated wrapper still has that shape.
 *
 * 3. It converts the arguments.  cffi's own int64_t conversion raises OverflowError("int too big
 *    to convert") for an int outside int64, before the shim runs, where the pure table says
 *    ValueError for a bad slot or a negative value.  _cffi_to_c_int is redefined below to clamp
 *    such an int to INT64_MIN or INT64_MAX instead, which no slot and no value accepts, so the
 *    shim refuses it like any other out-of-range argument, in the same order and with the same
 *    exception type as the pure table.  Non-ints still go through cffi's conversion (TypeError).
 *
 * Everything between the CDEF markers is the cffi cdef, read by build_ffi.py and skipped by the
 * C compiler (`#if 0`): keep it to what pycparser accepts.  `...` lets cffi take the value from
 * the compiler, so Python sees the constants the C was built with.
 */
#ifndef EFFECTFENCE_BINDING_H
#define EFFECTFENCE_BINDING_H

#include "effectfence_counters.h"

#undef Py_BEGIN_ALLOW_THREADS
#undef Py_END_ALLOW_THREADS
#define Py_BEGIN_ALLOW_THREADS {
#define Py_END_ALLOW_THREADS } if (PyErr_Occurred() != NULL) { return NULL; }

/* Not in the limited API cffi compiles against, but exported by every CPython 3. */
PyAPI_FUNC(int) PyGILState_Check(void);

#if 0
/* CDEF-BEGIN */
#define EF_ABI_VERSION ...
#define EF_SEGMENT_SIZE ...
#define EF_MAX_SEGMENTS ...

int ef_gil_held(void);
int64_t ef_abi_version(void);
const char *ef_version(void);
int64_t ef_max_value(void);
int64_t ef_capacity(void);

int64_t efpy_alloc_slot(int64_t initial);
int64_t efpy_release(int64_t slot);
int64_t efpy_reclaim(int64_t slot, int64_t initial);
int64_t efpy_load(int64_t slot);
int64_t efpy_reserve(int64_t slot);
int64_t efpy_advance_if(int64_t slot, int64_t expected);
int64_t efpy_compare_exchange(int64_t slot, int64_t expected, int64_t desired);
int64_t efpy_fetch_max(int64_t slot, int64_t value);
/* CDEF-END */
#endif

static int ef_gil_held(void) { return PyGILState_Check(); }

/* See 3. above.  Every argument in the CDEF block is an int64_t; the sizeof trick refuses to
 * compile a wrapper that would convert anything else through this. */
static int64_t efpy_to_int64(PyObject *o) {
    if (PyLong_Check(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow != 0) {
            return overflow > 0 ? INT64_MAX : INT64_MIN;
        }
        return (int64_t)v;
    }
    /* Not through cffi's conversion, which takes __int__: Fraction(1, 2) became 0 and the
     * operation went ahead, where the pure table refuses anything but an int (review). */
    PyErr_SetString(PyExc_TypeError, "counter arguments must be ints");
    return -1;
}
#undef _cffi_to_c_int
#define _cffi_to_c_int(o, type) \
    ((void)sizeof(char[sizeof(type) == sizeof(int64_t) ? 1 : -1]), (type)efpy_to_int64(o))

/* An argument as the message shows it: the two clamped ends may stand for any int beyond them. */
static const char *efpy_num(int64_t v, char *buf, size_t size) {
    if (v == INT64_MIN) {
        return "-2**63 or less";
    }
    if (v == INT64_MAX) {
        return "2**63-1 or more";
    }
    PyOS_snprintf(buf, size, "%lld", (long long)v);
    return buf;
}

/* Name what was wrong.  The caller returns any int64; the wrapper discards it and raises. */
static int64_t efpy_fail_slot(int64_t slot) {
    char buf[32];
    PyErr_Format(PyExc_ValueError,
                 "counter slot %s is not live: never handed out by slot()/find(), or its "
                 "domain was evicted",
                 efpy_num(slot, buf, sizeof buf));
    return -1;
}

static int64_t efpy_check_value(const char *what, int64_t value) {
    char buf[32];
    if (value < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %s", what,
                     efpy_num(value, buf, sizeof buf));
    } else if (value > ef_max_value()) {
        PyErr_Format(PyExc_OverflowError, "%s %s exceeds the counter maximum 2**63-2", what,
                     efpy_num(value, buf, sizeof buf));
    }
    return -1;
}

static int64_t efpy_fail_nomem(void) {
    PyErr_SetString(PyExc_MemoryError, "effectfence counter table is full or out of memory");
    return -1;
}

static int64_t efpy_alloc_slot(int64_t initial) {
    int64_t r = ef_alloc_slot(initial);
    if (r == EF_ERR_VALUE) {
        return efpy_check_value("initial value", initial);
    }
    return r < 0 ? efpy_fail_nomem() : r;
}

static int64_t efpy_release(int64_t slot) {
    int64_t r = ef_release(slot);
    return r < 0 ? efpy_fail_slot(slot) : r;
}

static int64_t efpy_reclaim(int64_t slot, int64_t initial) {
    int64_t r = ef_reclaim(slot, initial);
    if (r == EF_ERR_SLOT) {
        char buf[32];
        PyErr_Format(PyExc_ValueError, "counter slot %s is not a released slot",
                     efpy_num(slot, buf, sizeof buf));
        return r;
    }
    if (r == EF_ERR_VALUE) {
        return efpy_check_value("initial value", initial);
    }
    return r < 0 ? efpy_fail_nomem() : r;
}

static int64_t efpy_load(int64_t slot) {
    int64_t r = ef_load(slot);
    return r < 0 ? efpy_fail_slot(slot) : r;
}

static int64_t efpy_reserve(int64_t slot) {
    int64_t r = ef_reserve(slot);
    if (r == EF_ERR_OVERFLOW) {
        PyErr_Format(PyExc_OverflowError,
                     "counter at slot %lld is at its maximum 2**63-2 and cannot advance",
                     (long long)slot);
        return r;
    }
    return r < 0 ? efpy_fail_slot(slot) : r;
}

static int64_t efpy_advance_if(int64_t slot, int64_t expected) {
    int64_t r = ef_advance_if(slot, expected);
    if (r != ef_fail_code()) {
        return r; /* success (> 0) or the encoded current value (< 0): both are answers */
    }
    if (ef_load(slot) < 0) {
        return efpy_fail_slot(slot);
    }
    if (expected == ef_max_value()) {
        PyErr_SetString(PyExc_OverflowError,
                        "expected is at the counter maximum 2**63-2 and cannot advance");
        return r;
    }
    return efpy_check_value("expected", expected);
}

static int64_t efpy_compare_exchange(int64_t slot, int64_t expected, int64_t desired) {
    int64_t r = ef_compare_exchange(slot, expected, desired);
    if (r != ef_fail_code()) {
        return r;
    }
    if (ef_load(slot) < 0) {
        return efpy_fail_slot(slot);
    }
    if (expected < 0 || expected > ef_max_value()) {
        return efpy_check_value("expected", expected);
    }
    return efpy_check_value("new", desired);
}

static int64_t efpy_fetch_max(int64_t slot, int64_t value) {
    int64_t r = ef_fetch_max(slot, value);
    if (r == EF_ERR_SLOT) {
        return efpy_fail_slot(slot);
    }
    return r < 0 ? efpy_check_value("value", value) : r;
}

#endif /* EFFECTFENCE_BINDING_H */
