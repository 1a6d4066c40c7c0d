/*
 * effectfence_certhash.c -- the certificate hash as one C call: a pure function.
 * Optional: without it effectfence.cert.spliced_hash runs its Python body.
 *
 * cert_hash(intent, parent, domain, seq, tool, args_json, result_json, vector_clock,
 *           read_set, agent) assembles the same RFC 8785 body effectfence.cert.spliced_hash
 * assembles (members in key order, each value already canonical) and returns the lowercase
 * hex SHA-256 of it.  It encodes nothing itself beyond punctuation and safe integers: every
 * string goes through effectfence._speedups.string and the vector clock through
 * effectfence._speedups.canonical (the one C encoder), and the digest is hashlib's
 * (OpenSSL), all handed over by bind().  Whenever it is not sure -- a subclass, an unsafe or
 * non-int seq, a string the encoder declines, a read-set entry that is not (str, int) --
 * it returns None and the Python body runs, which is the definition and names the error.
 * tests/test_certhash.py proves the two byte-identical (hypothesis and the frozen vectors).
 * No rule of the protocol lives here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdio.h>
#include <string.h>

#ifdef Py_GIL_DISABLED
#error "effectfence._certhash needs the GIL; the free-threaded build uses the Python path"
#endif

#define EF_CERTHASH_ABI 1
#define MAX_SAFE_INTEGER 9007199254740991LL /* 2**53 - 1 */
#define FORMAT_JSON "\"effectfence.cert/1\"" /* CERT_FORMAT, checked by the tests */

static PyObject *string_fn, *canonical_fn, *sha256_fn, *s_hexdigest, *max_depth;

/* ------------------------------------------------------------------------------ buffer */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
    char stack[1024];
} Buf;

static int put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->cap - b->len < n) {
        Py_ssize_t cap = b->cap;
        while (cap - b->len < n) {
            if (cap > PY_SSIZE_T_MAX / 2) {
                PyErr_NoMemory();
                return -1;
            }
            cap *= 2;
        }
        char *q = b->p == b->stack ? PyMem_Malloc((size_t)cap) : PyMem_Realloc(b->p, (size_t)cap);
        if (q == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (b->p == b->stack) {
            memcpy(q, b->stack, (size_t)b->len);
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

/* Append exact bytes; 1 (not sure) for anything else. */
static int put_bytes(Buf *b, PyObject *o) {
    if (!PyBytes_CheckExact(o)) {
        return 1;
    }
    return put(b, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
}

/* Append fn(o) (bytes, or None: not sure). */
static int put_encoded(Buf *b, PyObject *fn, PyObject *o, PyObject *extra) {
    PyObject *args[2] = {o, extra};
    PyObject *enc = PyObject_Vectorcall(fn, args, extra ? 2 : 1, NULL);
    if (enc == NULL) {
        return -1;
    }
    int r = put_bytes(b, enc); /* None is not bytes: 1 */
    Py_DECREF(enc);
    return r;
}

/* Append an exact int within [lo, MAX_SAFE_INTEGER] in decimal; 1 otherwise. */
static int put_int(Buf *b, PyObject *o, long long lo) {
    if (!PyLong_CheckExact(o)) {
        return 1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || v < lo || v > MAX_SAFE_INTEGER) {
        return 1;
    }
    char text[32];
    int n = snprintf(text, sizeof(text), "%lld", v);
    return put(b, text, n);
}

/* "[[d,s],...]" for a read set of (str, safe int) pairs; 1 for anything else. */
static int put_read_set(Buf *b, PyObject *rs) {
    if (!PyTuple_CheckExact(rs) && !PyList_CheckExact(rs)) {
        return 1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rs);
    if (PUT_LIT(b, "[") < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(rs, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0))) {
            return 1;
        }
        int r;
        if ((i && PUT_LIT(b, ",") < 0) || PUT_LIT(b, "[") < 0 ||
            (r = put_encoded(b, string_fn, PyTuple_GET_ITEM(pair, 0), NULL)) != 0 ||
            PUT_LIT(b, ",") < 0 ||
            (r = put_int(b, PyTuple_GET_ITEM(pair, 1), -MAX_SAFE_INTEGER)) != 0 ||
            PUT_LIT(b, "]") < 0) {
            return PyErr_Occurred() ? -1 : 1;
        }
    }
    return PUT_LIT(b, "]");
}

/* A dict of exact str to exact int: the shape whose encodings agree (clock_bytes). */
static int plain_clock(PyObject *vc) {
    if (!PyDict_CheckExact(vc)) {
        return 0;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(vc, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k) || !PyLong_CheckExact(v)) {
            return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------- hash */

enum { A_INTENT, A_PARENT, A_DOMAIN, A_SEQ, A_TOOL, A_ARGS, A_RESULT, A_CLOCK, A_RS, A_AGENT };

static int assemble(Buf *b, PyObject *const *a) {
    int r;
#define STEP(expr)                                                                           \
    if ((r = (expr)) != 0) {                                                                 \
        return r;                                                                            \
    }
    /* the keys in RFC 8785 order, as in spliced_hash */
    STEP(PUT_LIT(b, "{\"agent\":"));
    STEP(put_encoded(b, string_fn, a[A_AGENT], NULL));
    STEP(PUT_LIT(b, ",\"args\":"));
    STEP(put_bytes(b, a[A_ARGS]));
    STEP(PUT_LIT(b, ",\"domain\":"));
    STEP(put_encoded(b, string_fn, a[A_DOMAIN], NULL));
    STEP(PUT_LIT(b, ",\"format\":" FORMAT_JSON ",\"intent\":"));
    STEP(put_encoded(b, string_fn, a[A_INTENT], NULL));
    STEP(PUT_LIT(b, ",\"parent\":"));
    if (a[A_PARENT] == Py_None) {
        STEP(PUT_LIT(b, "null"));
    } else {
        STEP(put_encoded(b, string_fn, a[A_PARENT], NULL));
    }
    STEP(PUT_LIT(b, ",\"read_set\":"));
    STEP(put_read_set(b, a[A_RS]));
    STEP(PUT_LIT(b, ",\"result\":"));
    STEP(put_bytes(b, a[A_RESULT]));
    STEP(PUT_LIT(b, ",\"seq\":"));
    STEP(put_int(b, a[A_SEQ], 0)); /* the fence's seqs are safe and positive */
    STEP(PUT_LIT(b, ",\"tool\":"));
    STEP(put_encoded(b, string_fn, a[A_TOOL], NULL));
    STEP(PUT_LIT(b, ",\"vector_clock\":"));
    STEP(plain_clock(a[A_CLOCK]) ? put_encoded(b, canonical_fn, a[A_CLOCK], max_depth) : 1);
    STEP(PUT_LIT(b, "}"));
#undef STEP
    return 0;
}

static PyObject *py_cert_hash(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "cert_hash() takes the ten certificate fields");
        return NULL;
    }
    if (string_fn == NULL) {
        Py_RETURN_NONE; /* not bound: the Python path */
    }
    Buf b = {.p = NULL, .len = 0, .cap = (Py_ssize_t)sizeof(b.stack)};
    b.p = b.stack;
    int r = assemble(&b, args);
    PyObject *out = NULL;
    if (r == 0) {
        PyObject *body = PyBytes_FromStringAndSize(b.p, b.len);
        PyObject *h = body == NULL ? NULL : PyObject_CallOneArg(sha256_fn, body);
        Py_XDECREF(body);
        if (h != NULL) {
            out = PyObject_CallMethodNoArgs(h, s_hexdigest);
            Py_DECREF(h);
        }
    } else if (r > 0) {
        out = Py_NewRef(Py_None);
    }
    if (b.p != b.stack) {
        PyMem_Free(b.p);
    }
    return out;
}

static PyObject *py_bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bind(string, canonical, sha256)");
        return NULL;
    }
    Py_XSETREF(string_fn, Py_NewRef(args[0]));
    Py_XSETREF(canonical_fn, Py_NewRef(args[1]));
    Py_XSETREF(sha256_fn, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"cert_hash", (PyCFunction)(void (*)(void))py_cert_hash, METH_FASTCALL,
     "cert_hash(intent, parent, domain, seq, tool, args_json, result_json, vector_clock, "
     "read_set, agent) -> hex SHA-256 of the certificate body, or None (ask Python)."},
    {"bind", (PyCFunction)(void (*)(void))py_bind, METH_FASTCALL,
     "bind(string, canonical, sha256): the encoders and the digest cert_hash calls."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "effectfence._certhash",
    "The certificate hash in one C call (see csrc/effectfence_certhash.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__certhash(void) {
    s_hexdigest = PyUnicode_InternFromString("hexdigest");
    max_depth = PyLong_FromLong(64);
    if (s_hexdigest == NULL || max_depth == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", EF_CERTHASH_ABI) < 0 ||
        PyModule_AddStringConstant(m, "FORMAT_JSON", FORMAT_JSON) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
