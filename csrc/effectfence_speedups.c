/*
 * effectfence_speedups.c -- the CPython accelerator: RFC 8785 encoding and the memory fence's
 * common paths, in C.  Optional: without it effectfence runs the same protocol in Python.
 *
 * Two things live here.
 *
 * 1. canonical(value, max_depth): RFC 8785 (JCS) bytes for exact dict/list/tuple/str/int/
 *    float/bool/None, or None when it cannot be sure (subclasses, unsafe ints, NaN, lone
 *    surrogates, depth).  None means "ask the Python encoder", which is the reference and
 *    the one that names what is wrong.  It never raises except MemoryError.
 *
 * 2. FastPath: prepare and commit of an EffectFence over the default MemoryStore, for the
 *    common cases (no read set): a fresh claim (strict expected_seq included), a replay, a
 *    commit by the current token.  It works on the store's own dicts under the store's own stripe locks,
 *    so it is one more writer among the Python ones, never a second source of truth.
 *    Anything else (a refusal, a takeover, an expired result, a store-level surprise) is
 *    handed, untouched, to the Python method it shadows, which decides and explains it.
 *    The rule that keeps this honest: the fast path changes nothing before it is sure it
 *    will finish; every fallback happens before the first write.
 *
 * Objects are built by writing their __slots__ directly (offsets read from the classes'
 * member descriptors at construction), the way CPython's own tuple subclass constructor
 * fills a fresh tuple: a Python __init__ per object would cost more than the rest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Reads of the store's dicts outside its stripe locks (the same reads the Python code makes)
 * hand out borrowed references that only the GIL keeps alive.  A free-threaded interpreter
 * has no GIL: refuse to build there, and effectfence runs its Python paths instead. */
#ifdef Py_GIL_DISABLED
#error "effectfence._speedups needs the GIL; the free-threaded build uses the Python paths"
#endif

#define EF_SPEEDUPS_ABI 1
#define MAX_SAFE_INTEGER 9007199254740991LL /* 2**53 - 1 */
/* Deeper input goes to the Python encoder: C recursion stays under ~25 KiB of stack even on
 * a 128 KiB thread stack (musl's default, or threading.stack_size). */
#define DEPTH_CAP 128

/* ------------------------------------------------------------------------------ buffer */

typedef struct {
    char *p;
    Py_ssize_t len;
    Py_ssize_t cap;
    char stack[1024];
} Buf;

static void buf_init(Buf *b) {
    b->p = b->stack;
    b->len = 0;
    b->cap = (Py_ssize_t)sizeof(b->stack);
}

static void buf_free(Buf *b) {
    if (b->p != b->stack) {
        PyMem_Free(b->p);
    }
    b->p = b->stack;
}

static int buf_grow(Buf *b, Py_ssize_t need) {
    Py_ssize_t cap = b->cap;
    while (cap - b->len < need) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *q;
    if (b->p == b->stack) {
        q = PyMem_Malloc((size_t)cap);
        if (q != NULL) {
            memcpy(q, b->stack, (size_t)b->len);
        }
    } else {
        q = PyMem_Realloc(b->p, (size_t)cap);
    }
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = q;
    b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->cap - b->len < n && buf_grow(b, n) < 0) {
        return -1;
    }
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) buf_put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static inline int buf_byte(Buf *b, char c) {
    if (b->cap == b->len && buf_grow(b, 1) < 0) {
        return -1;
    }
    b->p[b->len++] = c;
    return 0;
}

static PyObject *buf_bytes(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->p, b->len);
    buf_free(b);
    return out;
}

/* ----------------------------------------------------------------------- canonical JSON */
/* Encoders return 0 (written), -1 (a Python exception is set) or 1 (not sure: fall back). */

enum { ENC_OK = 0, ENC_ERR = -1, ENC_FALLBACK = 1 };

/* RFC 8785 3.2.2.2: escape '"', '\\', the five short forms, other controls as \u00xx
 * (lowercase hex); everything else, non-ASCII included, is written as UTF-8. */
static int enc_utf8_string(Buf *b, const char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    if (buf_byte(b, '"') < 0) {
        return ENC_ERR;
    }
    Py_ssize_t run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            continue;
        }
        if (buf_put(b, s + run, i - run) < 0) {
            return ENC_ERR;
        }
        run = i + 1;
        char esc[6] = {'\\', 0, 0, 0, 0, 0};
        Py_ssize_t len = 2;
        switch (c) {
            case '"': esc[1] = '"'; break;
            case '\\': esc[1] = '\\'; break;
            case '\b': esc[1] = 'b'; break;
            case '\t': esc[1] = 't'; break;
            case '\n': esc[1] = 'n'; break;
            case '\f': esc[1] = 'f'; break;
            case '\r': esc[1] = 'r'; break;
            default:
                esc[1] = 'u';
                esc[2] = '0';
                esc[3] = '0';
                esc[4] = hex[c >> 4];
                esc[5] = hex[c & 15];
                len = 6;
        }
        if (buf_put(b, esc, len) < 0) {
            return ENC_ERR;
        }
    }
    if (buf_put(b, s + run, n - run) < 0 || buf_byte(b, '"') < 0) {
        return ENC_ERR;
    }
    return ENC_OK;
}

static int enc_str(Buf *b, PyObject *s) {
    if (PyUnicode_IS_COMPACT_ASCII(s)) { /* the common case: the str's data is its UTF-8 */
        return enc_utf8_string(b, (const char *)PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s));
    }
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear(); /* a lone surrogate: the Python encoder names it */
            return ENC_FALLBACK;
        }
        return ENC_ERR;
    }
    return enc_utf8_string(b, u, n);
}

static int enc_int(Buf *b, PyObject *o) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return ENC_ERR;
    }
    if (overflow || v > MAX_SAFE_INTEGER || v < -MAX_SAFE_INTEGER) {
        return ENC_FALLBACK; /* outside I-JSON's safe range: refused, by the Python path */
    }
    char tmp[24];
    int i = (int)sizeof(tmp);
    unsigned long long u = v < 0 ? (unsigned long long)(-v) : (unsigned long long)v;
    do {
        tmp[--i] = (char)('0' + (int)(u % 10));
        u /= 10;
    } while (u);
    if (v < 0) {
        tmp[--i] = '-';
    }
    return buf_put(b, tmp + i, (Py_ssize_t)sizeof(tmp) - i) < 0 ? ENC_ERR : ENC_OK;
}

/* ES6 Number::toString (ECMA-262 7.1.12.1) of a finite double.  repr's shortest round-trip
 * digits are the digits ES6 requires; only the layout differs, and that is redone here from
 * the digit string and the decimal exponent, as in canonical._es6_number. */
static int enc_float(Buf *b, double v) {
    if (!isfinite(v)) {
        return ENC_FALLBACK; /* NaN and infinities are not JSON: the Python path says so */
    }
    if (v == 0.0) {
        return PUT_LIT(b, "0") < 0 ? ENC_ERR : ENC_OK; /* -0.0 too */
    }
    char *r = PyOS_double_to_string(v, 'r', 0, 0, NULL);
    if (r == NULL) {
        return ENC_ERR;
    }
    const char *s = r;
    int neg = 0;
    if (*s == '-') {
        neg = 1;
        s++;
    }
    char digits[48];
    int k = 0, intlen = 0, seen_point = 0;
    for (; *s && *s != 'e' && *s != 'E'; s++) {
        if (*s == '.') {
            seen_point = 1;
            continue;
        }
        if (k >= (int)sizeof(digits) - 1) {
            PyMem_Free(r);
            return ENC_FALLBACK; /* cannot happen for a repr; stay exact regardless */
        }
        digits[k++] = *s;
        if (!seen_point) {
            intlen++;
        }
    }
    long exp = 0;
    if (*s == 'e' || *s == 'E') {
        exp = strtol(s + 1, NULL, 10);
    }
    PyMem_Free(r);
    long n = intlen + exp; /* value = 0.DIGITS * 10**n */
    int lead = 0;
    while (lead < k - 1 && digits[lead] == '0') {
        lead++;
        n--;
    }
    memmove(digits, digits + lead, (size_t)(k - lead));
    k -= lead;
    while (k > 1 && digits[k - 1] == '0') {
        k--;
    }
    char out[64];
    int m = 0;
    if (neg) {
        out[m++] = '-';
    }
    if (k <= n && n <= 21) {
        memcpy(out + m, digits, (size_t)k);
        m += k;
        for (long i = k; i < n; i++) {
            out[m++] = '0';
        }
    } else if (0 < n && n <= 21) {
        memcpy(out + m, digits, (size_t)n);
        m += (int)n;
        out[m++] = '.';
        memcpy(out + m, digits + n, (size_t)(k - n));
        m += (int)(k - n);
    } else if (-6 < n && n <= 0) {
        out[m++] = '0';
        out[m++] = '.';
        for (long i = 0; i < -n; i++) {
            out[m++] = '0';
        }
        memcpy(out + m, digits, (size_t)k);
        m += k;
    } else {
        long e10 = n - 1;
        out[m++] = digits[0];
        if (k > 1) {
            out[m++] = '.';
            memcpy(out + m, digits + 1, (size_t)(k - 1));
            m += k - 1;
        }
        m += snprintf(out + m, sizeof(out) - (size_t)m, "e%c%ld", e10 >= 0 ? '+' : '-',
                      e10 >= 0 ? e10 : -e10);
    }
    return buf_put(b, out, m) < 0 ? ENC_ERR : ENC_OK;
}

/* UTF-16 code-unit order of two str, for keys with characters beyond the BMP. */
static inline Py_UCS4 utf16_first_unit(Py_UCS4 c) {
    return c < 0x10000 ? c : 0xD800 + ((c - 0x10000) >> 10);
}

static int utf16_cmp(PyObject *a, PyObject *b) {
    Py_ssize_t na = PyUnicode_GET_LENGTH(a), nb = PyUnicode_GET_LENGTH(b);
    int ka = PyUnicode_KIND(a), kb = PyUnicode_KIND(b);
    const void *da = PyUnicode_DATA(a), *db = PyUnicode_DATA(b);
    Py_ssize_t n = na < nb ? na : nb;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 x = PyUnicode_READ(ka, da, i), y = PyUnicode_READ(kb, db, i);
        if (x == y) {
            continue;
        }
        Py_UCS4 ux = utf16_first_unit(x), uy = utf16_first_unit(y);
        if (ux != uy) {
            return ux < uy ? -1 : 1;
        }
        /* same high surrogate: both beyond the BMP, the low surrogates order like x, y */
        return x < y ? -1 : 1;
    }
    return na < nb ? -1 : (na > nb ? 1 : 0);
}

typedef struct {
    PyObject *key;
    PyObject *value;
} Member;

static int member_cmp_utf16(const void *x, const void *y) {
    return utf16_cmp(((const Member *)x)->key, ((const Member *)y)->key);
}

/* Code-point order: equal to UTF-16 order when no key has a character beyond the BMP. */
static int member_cmp_codepoint(const void *x, const void *y) {
    PyObject *a = ((const Member *)x)->key, *b = ((const Member *)y)->key;
    Py_ssize_t na = PyUnicode_GET_LENGTH(a), nb = PyUnicode_GET_LENGTH(b);
    int ka = PyUnicode_KIND(a), kb = PyUnicode_KIND(b);
    Py_ssize_t n = na < nb ? na : nb;
    if (ka == PyUnicode_1BYTE_KIND && kb == PyUnicode_1BYTE_KIND) {
        int c = memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n);
        if (c != 0) {
            return c;
        }
    } else {
        const void *da = PyUnicode_DATA(a), *db = PyUnicode_DATA(b);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_UCS4 p = PyUnicode_READ(ka, da, i), q = PyUnicode_READ(kb, db, i);
            if (p != q) {
                return p < q ? -1 : 1;
            }
        }
    }
    return na < nb ? -1 : (na > nb ? 1 : 0);
}

static int enc_value(Buf *b, PyObject *o, int depth);

static int enc_dict(Buf *b, PyObject *o, int depth) {
    if (depth <= 0) {
        return ENC_FALLBACK; /* depth or a cycle: the Python encoder tells which */
    }
    Py_ssize_t n = PyDict_GET_SIZE(o);
    if (n == 0) {
        return PUT_LIT(b, "{}") < 0 ? ENC_ERR : ENC_OK;
    }
    Member local[8];
    Member *items = local;
    if (n > 8) {
        items = PyMem_Malloc(sizeof(Member) * (size_t)n);
        if (items == NULL) {
            PyErr_NoMemory();
            return ENC_ERR;
        }
    }
    int rc = ENC_OK, astral = 0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(o, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k) || i >= n) {
            rc = ENC_FALLBACK; /* non-str keys are refused (or coerced) by the Python path */
            goto done;
        }
        if (PyUnicode_KIND(k) == PyUnicode_4BYTE_KIND) {
            astral = 1; /* a 4-byte str holds a character beyond the BMP */
        }
        items[i].key = k;
        items[i].value = v;
        i++;
    }
    if (i != n) {
        rc = ENC_FALLBACK;
        goto done;
    }
    int (*cmp)(const void *, const void *) = astral ? member_cmp_utf16 : member_cmp_codepoint;
    if (n <= 8) { /* insertion sort: the usual few keys, without qsort's setup */
        for (Py_ssize_t j = 1; j < n; j++) {
            Member m = items[j];
            Py_ssize_t at = j;
            while (at > 0 && cmp(&items[at - 1], &m) > 0) {
                items[at] = items[at - 1];
                at--;
            }
            items[at] = m;
        }
    } else {
        qsort(items, (size_t)n, sizeof(Member), cmp);
    }
    for (i = 0; i < n; i++) {
        if (buf_byte(b, i ? ',' : '{') < 0) {
            rc = ENC_ERR;
            goto done;
        }
        rc = enc_str(b, items[i].key);
        if (rc != ENC_OK) {
            goto done;
        }
        if (buf_byte(b, ':') < 0) {
            rc = ENC_ERR;
            goto done;
        }
        rc = enc_value(b, items[i].value, depth - 1);
        if (rc != ENC_OK) {
            goto done;
        }
    }
    if (buf_byte(b, '}') < 0) {
        rc = ENC_ERR;
    }
done:
    if (items != local) {
        PyMem_Free(items);
    }
    return rc;
}

static int enc_array(Buf *b, PyObject *const *items, Py_ssize_t n, int depth) {
    if (depth <= 0) {
        return ENC_FALLBACK;
    }
    if (n == 0) {
        return PUT_LIT(b, "[]") < 0 ? ENC_ERR : ENC_OK;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (buf_byte(b, i ? ',' : '[') < 0) {
            return ENC_ERR;
        }
        int rc = enc_value(b, items[i], depth - 1);
        if (rc != ENC_OK) {
            return rc;
        }
    }
    return buf_byte(b, ']') < 0 ? ENC_ERR : ENC_OK;
}

static int enc_value(Buf *b, PyObject *o, int depth) {
    if (PyUnicode_CheckExact(o)) {
        return enc_str(b, o);
    }
    if (o == Py_True) {
        return PUT_LIT(b, "true") < 0 ? ENC_ERR : ENC_OK;
    }
    if (o == Py_False) {
        return PUT_LIT(b, "false") < 0 ? ENC_ERR : ENC_OK;
    }
    if (o == Py_None) {
        return PUT_LIT(b, "null") < 0 ? ENC_ERR : ENC_OK;
    }
    if (PyLong_CheckExact(o)) {
        return enc_int(b, o);
    }
    if (PyFloat_CheckExact(o)) {
        return enc_float(b, PyFloat_AS_DOUBLE(o));
    }
    if (PyDict_CheckExact(o)) {
        return enc_dict(b, o, depth);
    }
    if (PyList_CheckExact(o)) {
        /* encoding runs no Python code, so the list cannot change under the loop */
        return enc_array(b, ((PyListObject *)o)->ob_item, PyList_GET_SIZE(o), depth);
    }
    if (PyTuple_CheckExact(o)) {
        return enc_array(b, ((PyTupleObject *)o)->ob_item, PyTuple_GET_SIZE(o), depth);
    }
    return ENC_FALLBACK; /* subclasses, bytes, sets, objects: the Python path decides */
}

/* bytes, Py_None (not sure), or NULL with an exception. */
static PyObject *canonical_or_none(PyObject *value, int max_depth) {
    Buf b;
    buf_init(&b);
    int rc = enc_value(&b, value, max_depth > DEPTH_CAP ? DEPTH_CAP : max_depth);
    if (rc == ENC_OK) {
        return buf_bytes(&b);
    }
    buf_free(&b);
    if (rc == ENC_ERR) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_canonical(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "canonical(value, max_depth) takes 2 arguments");
        return NULL;
    }
    int overflow = 0;
    long depth = PyLong_AsLongAndOverflow(args[1], &overflow);
    if (depth == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow > 0 || depth > DEPTH_CAP) {
        depth = DEPTH_CAP + 1; /* capped below; deeper input falls back */
    }
    if (overflow < 0 || depth < 0) {
        depth = 0;
    }
    return canonical_or_none(args[0], (int)depth);
}

static PyObject *py_string(PyObject *module, PyObject *arg) {
    if (!PyUnicode_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    return canonical_or_none(arg, 0); /* a str needs no container budget */
}

/* ---------------------------------------------------------------------- slotted objects */

/* Where each __slots__ field of a class lives, read from its member descriptors. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t off[16];
    int n;
} Layout;

static int layout_init(Layout *L, PyObject *type, const char *const *fields) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "FastPath: expected a class");
        return -1;
    }
    L->type = (PyTypeObject *)type;
    L->n = 0;
    for (int i = 0; fields[i] != NULL; i++) {
        PyObject *d = PyObject_GetAttrString(type, fields[i]);
        if (d == NULL) {
            return -1;
        }
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "FastPath: %R.%s is not a __slots__ field", type,
                         fields[i]);
            Py_DECREF(d);
            return -1;
        }
        L->off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        L->n = i + 1;
    }
    return 0;
}

#define SLOT(obj, L, i) (*(PyObject **)((char *)(obj) + (L).off[i]))

/* Records, certificates, heads, clocks and wheel entries hold only strings, numbers, bytes,
 * enum members and one another, never anything a caller can make point back at them: they
 * cannot be part of a reference cycle.  Untracked, the cyclic GC never walks them, and a
 * store of a million records no longer makes every full collection walk a million records.
 * (CPython untracks tuples and dicts of atoms itself, for the same reason.) */
static inline PyObject *acyclic(PyObject *o) {
    if (o != NULL && PyObject_GC_IsTracked(o)) {
        PyObject_GC_UnTrack(o);
    }
    return o;
}

/* A new instance with every field set (references stolen; a NULL value fails the whole). */
static PyObject *layout_new(Layout *L, PyObject **values) {
    PyObject *obj = NULL;
    for (int i = 0; i < L->n; i++) {
        if (values[i] == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_SystemError, "FastPath: %s built without a field",
                             L->type->tp_name);
            }
            goto fail;
        }
    }
    obj = L->type->tp_alloc(L->type, 0);
    if (obj == NULL) {
        goto fail;
    }
    for (int i = 0; i < L->n; i++) {
        SLOT(obj, *L, i) = values[i];
    }
    return obj;
fail:
    for (int i = 0; i < L->n; i++) {
        Py_XDECREF(values[i]);
    }
    return NULL;
}

/* Field orders: must match the names passed to layout_init below. */
static const char *const REQUEST_FIELDS[] = {"intent", "domain", "tool", "args", "agent",
                                             "read_set", "parent", "known_clock",
                                             "expected_seq", NULL};
enum { RQ_INTENT, RQ_DOMAIN, RQ_TOOL, RQ_ARGS, RQ_AGENT, RQ_READ_SET, RQ_PARENT, RQ_KNOWN,
       RQ_EXPECTED };

static const char *const TICKET_FIELDS[] = {
    "intent", "domain", "seq", "token", "agent", "tool", "args", "read_set", "parent",
    "vector_clock", "expected_seq", "lease_until", "fingerprint", "args_json", NULL};
enum { TK_INTENT, TK_DOMAIN, TK_SEQ, TK_TOKEN, TK_AGENT, TK_TOOL, TK_ARGS, TK_READ_SET,
       TK_PARENT, TK_CLOCK, TK_EXPECTED, TK_LEASE_UNTIL, TK_FP, TK_ARGS_JSON, TK_N };

static const char *const RECORD_FIELDS[] = {"intent", "state", "token", "fingerprint",
                                            "domain", "agent", "lease_until", "cert",
                                            "until", "reason", "since", NULL};
enum { RC_INTENT, RC_STATE, RC_TOKEN, RC_FP, RC_DOMAIN, RC_AGENT, RC_LEASE_UNTIL, RC_CERT,
       RC_UNTIL, RC_REASON, RC_SINCE, RC_N };

static const char *const HEAD_FIELDS[] = {"hash", "clock", NULL};
enum { HD_HASH, HD_CLOCK };
static const char *const CLOCK_FIELDS[] = {"_c", NULL};
static const char *const FRESH_FIELDS[] = {"_ticket", "takeover", NULL};
static const char *const REPLAY_FIELDS[] = {"_cert", NULL};

#define CERT_ITEMS 11 /* EffectCert's tuple: intent .. agent, hash */

/* ------------------------------------------------------------------------------ FastPath */

typedef int64_t (*reserve_fn)(int64_t);
typedef int64_t (*advance_if_fn)(int64_t, int64_t);
/* OpenSSL's one-shot SHA256(data, len, out), as loaded for hashlib (effectfence._accel) */
typedef unsigned char *(*sha256_fn)(const unsigned char *, size_t, unsigned char *);

/* Every object FastPath holds, listed once: the struct, traverse and clear expand it.
 * The store's structures are shared with its Python methods, never copied. */
#define FP_OBJECTS(X)                                                                    \
    /* the memory store */                                                               \
    X(records) X(locks) X(inflight) X(heads) X(heads_lock) X(wheel) X(seq_slots)         \
    X(store_schedule) X(seqs_reserve) X(clock_fn)                                        \
    /* the fence */                                                                      \
    X(sweep_due) X(waiters) X(wake) X(slow_prepare) X(slow_prepare_payload) X(slow_commit) X(admit)                  \
    /* constants */                                                                      \
    X(in_flight) X(done) X(empty_head) X(empty_tuple) X(zero) X(zero_int) X(one) X(empty_str) X(false_)     \
    X(sha256) X(format_json)

#define FP_DECLARE(name) PyObject *name;
#define FP_VISIT(name) Py_VISIT(self->name);
#define FP_CLEAR(name) Py_CLEAR(self->name);

typedef struct {
    PyObject_HEAD
    Layout request, ticket, record, head, clock, fresh, replay;
    PyTypeObject *cert_type;
    FP_OBJECTS(FP_DECLARE)
    Py_ssize_t mask;
    double granularity;
    int auto_sweep;
    double lease_ttl, result_ttl;
    int max_depth;
    Py_ssize_t max_args_bytes, max_result_bytes;
    /* counters: the process's C table, by slot */
    reserve_fn reserve;
    advance_if_fn advance_if;
    reserve_fn load;
    sha256_fn sha256_direct; /* NULL: hash through hashlib (self->sha256) */
    int64_t token_slot, slot_admitted, slot_replayed, slot_commits;
} FastPath;

static PyObject *s_acquire, *s_release, *s_hexdigest;

static int fp_traverse(FastPath *self, visitproc visit, void *arg) {
    FP_OBJECTS(FP_VISIT)
    return 0;
}

static int fp_clear(FastPath *self) {
    FP_OBJECTS(FP_CLEAR)
    return 0;
}

static void fp_dealloc(FastPath *self) {
    PyObject_GC_UnTrack(self);
    fp_clear(self);
    for (int i = 0; i < 7; i++) {
        Layout *L = &self->request + i;
        Py_CLEAR(L->type);
    }
    Py_CLEAR(self->cert_type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_item(PyObject *cfg, const char *key, PyObject **out) {
    PyObject *v = PyDict_GetItemString(cfg, key); /* borrowed */
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "FastPath config lacks %s", key);
        return -1;
    }
    Py_INCREF(v);
    *out = v;
    return 0;
}

static int get_double(PyObject *cfg, const char *key, double *out) {
    PyObject *v = PyDict_GetItemString(cfg, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "FastPath config lacks %s", key);
        return -1;
    }
    *out = PyFloat_AsDouble(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static int get_ssize(PyObject *cfg, const char *key, Py_ssize_t *out) {
    PyObject *v = PyDict_GetItemString(cfg, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "FastPath config lacks %s", key);
        return -1;
    }
    *out = PyLong_AsSsize_t(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int get_layout(PyObject *cfg, const char *key, Layout *L, const char *const *fields) {
    PyObject *t = PyDict_GetItemString(cfg, key);
    if (t == NULL) {
        PyErr_Format(PyExc_KeyError, "FastPath config lacks %s", key);
        return -1;
    }
    if (layout_init(L, t, fields) < 0) {
        L->type = NULL;
        return -1;
    }
    Py_INCREF(t);
    return 0;
}

static PyObject *fp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *cfg;
    if (!PyArg_ParseTuple(args, "O!:FastPath", &PyDict_Type, &cfg)) {
        return NULL;
    }
    FastPath *self = (FastPath *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_ssize_t reserve_addr, advance_addr, load_addr, sha_addr, token_slot, sa, sr, sc, max_depth, auto_sweep;
    if (get_layout(cfg, "EffectRequest", &self->request, REQUEST_FIELDS) < 0 ||
        get_layout(cfg, "PreparedEffect", &self->ticket, TICKET_FIELDS) < 0 ||
        get_layout(cfg, "IntentRecord", &self->record, RECORD_FIELDS) < 0 ||
        get_layout(cfg, "Head", &self->head, HEAD_FIELDS) < 0 ||
        get_layout(cfg, "VectorClock", &self->clock, CLOCK_FIELDS) < 0 ||
        get_layout(cfg, "Fresh", &self->fresh, FRESH_FIELDS) < 0 ||
        get_layout(cfg, "Replay", &self->replay, REPLAY_FIELDS) < 0 ||
        get_item(cfg, "EffectCert", (PyObject **)&self->cert_type) < 0 ||
        get_item(cfg, "records", &self->records) < 0 ||
        get_item(cfg, "locks", &self->locks) < 0 ||
        get_item(cfg, "inflight", &self->inflight) < 0 ||
        get_item(cfg, "heads", &self->heads) < 0 ||
        get_item(cfg, "heads_lock", &self->heads_lock) < 0 ||
        get_item(cfg, "wheel", &self->wheel) < 0 ||
        get_item(cfg, "seq_slots", &self->seq_slots) < 0 ||
        get_item(cfg, "store_schedule", &self->store_schedule) < 0 ||
        get_item(cfg, "seqs_reserve", &self->seqs_reserve) < 0 ||
        get_item(cfg, "clock", &self->clock_fn) < 0 ||
        get_ssize(cfg, "mask", &self->mask) < 0 ||
        get_double(cfg, "granularity", &self->granularity) < 0 ||
        get_item(cfg, "sweep_due", &self->sweep_due) < 0 ||
        get_item(cfg, "waiters", &self->waiters) < 0 ||
        get_item(cfg, "wake", &self->wake) < 0 ||
        get_item(cfg, "slow_prepare", &self->slow_prepare) < 0 ||
        get_item(cfg, "slow_prepare_payload", &self->slow_prepare_payload) < 0 ||
        get_item(cfg, "slow_commit", &self->slow_commit) < 0 ||
        get_item(cfg, "admit", &self->admit) < 0 ||
        get_ssize(cfg, "auto_sweep", &auto_sweep) < 0 ||
        get_double(cfg, "lease_ttl", &self->lease_ttl) < 0 ||
        get_double(cfg, "result_ttl", &self->result_ttl) < 0 ||
        get_ssize(cfg, "max_depth", &max_depth) < 0 ||
        get_ssize(cfg, "max_args_bytes", &self->max_args_bytes) < 0 ||
        get_ssize(cfg, "max_result_bytes", &self->max_result_bytes) < 0 ||
        get_ssize(cfg, "reserve_address", &reserve_addr) < 0 ||
        get_ssize(cfg, "advance_if_address", &advance_addr) < 0 ||
        get_ssize(cfg, "load_address", &load_addr) < 0 ||
        get_ssize(cfg, "sha256_address", &sha_addr) < 0 ||
        get_ssize(cfg, "token_slot", &token_slot) < 0 ||
        get_ssize(cfg, "slot_admitted", &sa) < 0 ||
        get_ssize(cfg, "slot_replayed", &sr) < 0 ||
        get_ssize(cfg, "slot_commits", &sc) < 0 ||
        get_item(cfg, "IN_FLIGHT", &self->in_flight) < 0 ||
        get_item(cfg, "DONE", &self->done) < 0 ||
        get_item(cfg, "EMPTY_HEAD", &self->empty_head) < 0 ||
        get_item(cfg, "sha256", &self->sha256) < 0 ||
        get_item(cfg, "format_json", &self->format_json) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (!PyDict_CheckExact(self->records) || !PyList_CheckExact(self->locks) ||
        !PyList_CheckExact(self->inflight) || !PyDict_CheckExact(self->heads) ||
        !PyDict_CheckExact(self->wheel) || !PyDict_CheckExact(self->seq_slots) ||
        !PyDict_CheckExact(self->waiters) || !PyBytes_CheckExact(self->format_json) ||
        !PyList_CheckExact(self->sweep_due) || PyList_GET_SIZE(self->sweep_due) != 1 ||
        !PyType_Check(self->cert_type) ||
        !PyType_IsSubtype(self->cert_type, &PyTuple_Type) ||
        PyList_GET_SIZE(self->locks) != self->mask + 1 ||
        PyList_GET_SIZE(self->inflight) != self->mask + 1 || reserve_addr == 0 ||
        advance_addr == 0 || load_addr == 0 ||
        !(self->granularity > 0)) {
        PyErr_SetString(PyExc_TypeError, "FastPath: config does not describe a memory fence");
        Py_DECREF(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i <= self->mask; i++) {
        if (!PyDict_CheckExact(PyList_GET_ITEM(self->inflight, i))) {
            PyErr_SetString(PyExc_TypeError, "FastPath: in-flight counts must be dicts");
            Py_DECREF(self);
            return NULL;
        }
    }
    self->auto_sweep = auto_sweep != 0;
    self->max_depth = max_depth > DEPTH_CAP ? DEPTH_CAP : (int)max_depth;
    self->reserve = (reserve_fn)(uintptr_t)reserve_addr;
    self->advance_if = (advance_if_fn)(uintptr_t)advance_addr;
    self->load = (reserve_fn)(uintptr_t)load_addr;
    self->sha256_direct = sha_addr ? (sha256_fn)(uintptr_t)sha_addr : NULL;
    self->token_slot = token_slot;
    self->slot_admitted = sa;
    self->slot_replayed = sr;
    self->slot_commits = sc;
    self->empty_tuple = PyTuple_New(0);
    self->zero = PyFloat_FromDouble(0.0);
    self->one = PyLong_FromLong(1);
    self->zero_int = PyLong_FromLong(0);
    self->empty_str = PyUnicode_FromString("");
    self->false_ = Py_NewRef(Py_False);
    if (self->empty_tuple == NULL || self->zero == NULL || self->one == NULL ||
        self->zero_int == NULL ||
        self->empty_str == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* -- helpers ------------------------------------------------------------------------------ */

static int lock_acquire(PyObject *lock) {
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_acquire);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* The intent's stripe lock (the store's _lock(intent)), acquired; NULL on error. */
static PyObject *lock_stripe(FastPath *self, PyObject *intent, Py_ssize_t *stripe) {
    Py_hash_t h = PyObject_Hash(intent);
    if (h == -1) {
        return NULL;
    }
    *stripe = (Py_ssize_t)((size_t)h & (size_t)self->mask);
    PyObject *lock = PyList_GET_ITEM(self->locks, *stripe);
    return lock_acquire(lock) < 0 ? NULL : lock;
}

static void lock_release(PyObject *lock) {
    /* A release that fails would be a bug in this file; keep any exception already set. */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_XDECREF(r);
    if (exc_type != NULL) {
        PyErr_Restore(exc_type, exc_value, exc_tb);
    } else if (r == NULL) {
        PyErr_WriteUnraisable(lock);
    }
}

static int now_of(FastPath *self, double *out) {
    PyObject *t = PyObject_CallNoArgs(self->clock_fn);
    if (t == NULL) {
        return -1;
    }
    double v = PyFloat_AsDouble(t);
    Py_DECREF(t);
    if (v == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

/* A statistics / token counter: the process's C table, by slot (raises on overflow). */
static int64_t bump(FastPath *self, int64_t slot) {
    int64_t v = self->reserve(slot);
    if (v < 0 && PyErr_Occurred()) {
        return -1;
    }
    return v;
}

/* The store's timing wheel: append (intent, token) to the due bucket, as _schedule does,
 * handing the rare cases (a new bucket, a bucket a sweep just took) to the Python method. */
static int schedule(FastPath *self, double deadline, PyObject *intent, PyObject *token) {
    double q = ceil(deadline / self->granularity);
    if (isfinite(q) && fabs(q) < 4.0e18) {
        PyObject *key = PyLong_FromDouble(q);
        if (key == NULL) {
            return -1;
        }
        PyObject *bucket = PyDict_GetItemWithError(self->wheel, key); /* borrowed */
        if (bucket != NULL && PyList_CheckExact(bucket)) {
            Py_INCREF(bucket);
            PyObject *entry = acyclic(PyTuple_Pack(2, intent, token));
            int rc = entry == NULL ? -1 : PyList_Append(bucket, entry);
            Py_XDECREF(entry);
            PyObject *again = rc < 0 ? NULL : PyDict_GetItemWithError(self->wheel, key);
            Py_DECREF(key);
            Py_DECREF(bucket);
            if (rc < 0) {
                return -1;
            }
            if (again == bucket) {
                return 0;
            }
            /* swept meanwhile: the entry went to a list nobody reads; schedule it again */
        } else {
            Py_DECREF(key);
            if (PyErr_Occurred()) {
                return -1;
            }
        }
    }
    PyObject *dl = PyFloat_FromDouble(deadline);
    if (dl == NULL) {
        return -1;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(self->store_schedule, dl, intent, token, NULL);
    Py_DECREF(dl);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* canonical args -> the payload {"args":..,"domain":..,"tool":..} (the memory store's
 * fingerprint) and the args' own bytes.  0 done, 1 fall back, -1 error. */
static int build_payload(FastPath *self, PyObject *args, PyObject *domain, PyObject *tool,
                         PyObject **payload, PyObject **args_json) {
    Buf b;
    buf_init(&b);
    if (PUT_LIT(&b, "{\"args\":") < 0) {
        return -1;
    }
    Py_ssize_t start = b.len;
    int rc = enc_value(&b, args, self->max_depth);
    if (rc == ENC_OK && b.len - start > self->max_args_bytes) {
        rc = ENC_FALLBACK; /* the Python path refuses it with the sizes */
    }
    Py_ssize_t end = b.len;
    if (rc == ENC_OK) {
        rc = PUT_LIT(&b, ",\"domain\":") < 0 ? ENC_ERR : enc_str(&b, domain);
    }
    if (rc == ENC_OK) {
        rc = PUT_LIT(&b, ",\"tool\":") < 0 ? ENC_ERR : enc_str(&b, tool);
    }
    if (rc == ENC_OK && buf_byte(&b, '}') < 0) {
        rc = ENC_ERR;
    }
    if (rc != ENC_OK) {
        buf_free(&b);
        return rc;
    }
    *args_json = PyBytes_FromStringAndSize(b.p + start, end - start);
    *payload = *args_json == NULL ? NULL : PyBytes_FromStringAndSize(b.p, b.len);
    buf_free(&b);
    if (*payload == NULL) {
        Py_CLEAR(*args_json);
        return -1;
    }
    return 0;
}

static int bytes_equal(PyObject *a, PyObject *b) {
    if (a == b) {
        return 1;
    }
    if (!PyBytes_CheckExact(a) || !PyBytes_CheckExact(b)) {
        return -1; /* not what this path stores: let Python compare */
    }
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b),
                                              (size_t)n) == 0;
}

/* -- prepare -------------------------------------------------------------------------------- */

static PyObject *fall_back_prepare(FastPath *self, PyObject *request) {
    return PyObject_CallOneArg(self->slow_prepare, request);
}

/* The same, once the payload is built (it equals the Python encoder's: proven by tests). */
static PyObject *fall_back_with_payload(FastPath *self, PyObject *request, PyObject *payload,
                                        PyObject *args_json) {
    return PyObject_CallFunctionObjArgs(self->slow_prepare_payload, request, payload, args_json,
                                        NULL);
}

/* into[a] = n when n > into.get(a, 0): the merge of VectorClock.merge and _admit, exactly
 * (an entry of 0 is never added).  0 or -1. */
static int merge_max(FastPath *self, PyObject *into, PyObject *a, PyObject *n) {
    PyObject *have = PyDict_GetItemWithError(into, a);
    if (have == NULL && PyErr_Occurred()) {
        return -1;
    }
    int gt = PyObject_RichCompareBool(n, have != NULL ? have : self->zero_int, Py_GT);
    if (gt < 0) {
        return -1;
    }
    return gt ? PyDict_SetItem(into, a, n) : 0;
}

/* 1 when every entry of a clock dict is an exact str agent with an exact int counter in
 * [1, 2**53-1] (what VectorClock keeps and a certificate can encode), else 0.  Merging such
 * clocks runs no Python code. */
static int plain_clock(PyObject *clock) {
    Py_ssize_t pos = 0;
    PyObject *a, *n;
    while (PyDict_Next(clock, &pos, &a, &n)) {
        int overflow = 0;
        long long v = PyLong_CheckExact(n) ? PyLong_AsLongLongAndOverflow(n, &overflow) : -1;
        if (!PyUnicode_CheckExact(a) || overflow || v < 1 || v > MAX_SAFE_INTEGER) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* A copy of a VectorClock's counters, owned, if it is a plain clock; NULL without an
 * exception if not (only private state gets there: the Python path decides), NULL with one
 * on error.  Taken before any write, so nothing another thread does to the request or
 * ticket afterwards can reach it. */
static PyObject *clock_snapshot(FastPath *self, PyObject *vclock) {
    PyObject *c = SLOT(vclock, self->clock, 0);
    if (c == NULL || !PyDict_CheckExact(c)) {
        return NULL;
    }
    PyObject *copy = PyDict_Copy(c);
    if (copy != NULL && !plain_clock(copy)) {
        Py_CLEAR(copy);
    }
    return copy;
}

/* dict(head.clock), merged with the known-clock snapshot (or NULL), ticked at the agent;
 * *at_edge set when the tick went past 2**53-1 (the caller refuses, as _admit does). */
static PyObject *ticket_clock(FastPath *self, PyObject *head, PyObject *known, PyObject *agent,
                              int *at_edge) {
    PyObject *head_clock = SLOT(head, self->head, HD_CLOCK);
    if (head_clock == NULL || !PyDict_Check(head_clock)) {
        PyErr_SetString(PyExc_TypeError, "FastPath: a domain head without a clock");
        return NULL;
    }
    PyObject *counters = PyDict_Copy(head_clock);
    if (counters == NULL) {
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *a, *n;
    while (known != NULL && PyDict_Next(known, &pos, &a, &n)) {
        /* str keys and int values on both sides: no Python code runs in this loop */
        if (merge_max(self, counters, a, n) < 0) {
            goto fail;
        }
    }
    PyObject *have = PyDict_GetItemWithError(counters, agent);
    if (have == NULL && PyErr_Occurred()) {
        goto fail;
    }
    /* Python's + (no fixed-width overflow), as _admit's counters.get(agent, 0) + 1 */
    PyObject *t = have == NULL ? PyLong_FromLong(1) : PyNumber_Add(have, self->one);
    if (t == NULL || PyDict_SetItem(counters, agent, t) < 0) {
        Py_XDECREF(t);
        goto fail;
    }
    int overflow = 0;
    long long tick = PyLong_AsLongLongAndOverflow(t, &overflow);
    Py_DECREF(t);
    if (tick == -1 && PyErr_Occurred()) {
        goto fail;
    }
    *at_edge = overflow || tick > MAX_SAFE_INTEGER;
    PyObject *values[1] = {counters};
    return acyclic(layout_new(&self->clock, values));
fail:
    Py_DECREF(counters);
    return NULL;
}

/* Rule 2 for the one row the fast path decides: a DONE record whose result has not expired
 * (results end at ``until``) and whose payload is byte-for-byte this request's -> its
 * certificate (borrowed), to replay (G3, G4).  NULL: not that row; the Python path decides. */
static PyObject *replayable(FastPath *self, PyObject *rec, double now, PyObject *payload) {
    if (Py_TYPE(rec) != self->record.type || SLOT(rec, self->record, RC_STATE) != self->done) {
        return NULL;
    }
    PyObject *until = SLOT(rec, self->record, RC_UNTIL);
    PyObject *fp = SLOT(rec, self->record, RC_FP);
    PyObject *cert = SLOT(rec, self->record, RC_CERT);
    if (until == NULL || fp == NULL || cert == NULL || !PyFloat_CheckExact(until)) {
        return NULL;
    }
    if (!(now < PyFloat_AS_DOUBLE(until))) {
        return NULL; /* expired: claimable again, by the Python path */
    }
    if (bytes_equal(fp, payload) != 1) {
        return NULL; /* another payload: a conflict, refused by the Python path */
    }
    return cert;
}

/* What a claim hands to the rest of prepare (new references). */
typedef struct {
    PyObject *seq, *token, *lease, *head;
    double lease_until;
} Claim;

static void claim_clear(Claim *c) {
    Py_CLEAR(c->seq);
    Py_CLEAR(c->token);
    Py_CLEAR(c->lease);
    Py_CLEAR(c->head);
}

/* MemoryStore.claim for a request without a read set; the caller holds the intent's stripe
 * lock.  0: claimed (*c filled).  1: the Python claim must judge (someone claimed first, a
 * lost expected_seq race, a domain never counted): nothing changed.  -1: an error, raised
 * at the same step as the Python claim would raise it. */
static int claim_locked(FastPath *self, Py_ssize_t stripe, PyObject *intent, PyObject *domain,
                        PyObject *agent, PyObject *payload, int64_t strict, Claim *c) {
    double now;
    if (now_of(self, &now) < 0) {
        return -1;
    }
    /* condition 1: the slot is still free (the unlocked read saw it free) */
    PyObject *rec = PyDict_GetItemWithError(self->records, intent);
    if (rec != NULL || PyErr_Occurred()) {
        return PyErr_Occurred() ? -1 : 1;
    }
    /* condition 3: reserve (compare-and-advance with expected_seq, fetch-add without) */
    PyObject *slot = PyDict_GetItemWithError(self->seq_slots, domain);
    int64_t s = slot == NULL ? -1 : PyLong_AsLongLong(slot);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (strict >= 0) {
        if (slot == NULL) {
            return 1; /* a domain never counted: judged against the floor, by Python */
        }
        int64_t got = self->advance_if(s, strict);
        if (PyErr_Occurred()) {
            return -1;
        }
        if (got < 0) {
            return 1; /* lost: nothing moved; the Python claim refuses domain_race */
        }
        c->seq = PyLong_FromLongLong(got);
    } else if (slot != NULL) {
        int64_t v = self->reserve(s);
        c->seq = (v < 0 && PyErr_Occurred()) ? NULL : PyLong_FromLongLong(v);
    } else {
        c->seq = PyObject_CallOneArg(self->seqs_reserve, domain); /* a new domain */
    }
    int64_t tok = c->seq == NULL ? -1 : bump(self, self->token_slot);
    c->token = tok < 0 ? NULL : PyLong_FromLongLong(tok);
    c->lease_until = now + self->lease_ttl;
    c->lease = c->token == NULL ? NULL : PyFloat_FromDouble(c->lease_until);
    if (c->lease == NULL) {
        return -1;
    }
    /* the two writes: the record, then the domain's in-flight count */
    PyObject *counts = PyList_GET_ITEM(self->inflight, stripe);
    PyObject *have = PyDict_GetItemWithError(counts, domain);
    long long n_in = have == NULL ? 0 : PyLong_AsLongLong(have);
    if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *n_obj = PyLong_FromLongLong(n_in + 1);
    PyObject *rv[RC_N] = {Py_NewRef(intent),     Py_NewRef(self->in_flight),
                          Py_NewRef(c->token),   Py_NewRef(payload),
                          Py_NewRef(domain),     Py_NewRef(agent),
                          Py_NewRef(c->lease),   Py_NewRef(Py_None),
                          Py_NewRef(self->zero), Py_NewRef(self->empty_str),
                          Py_NewRef(self->zero)};
    PyObject *record = acyclic(layout_new(&self->record, rv));
    if (n_obj == NULL || record == NULL || PyDict_SetItem(self->records, intent, record) < 0) {
        Py_XDECREF(n_obj);
        Py_XDECREF(record);
        return -1;
    }
    Py_DECREF(record);
    if (PyDict_SetItem(counts, domain, n_obj) < 0) {
        /* cannot leave a record without its count: take the record back out */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        if (PyDict_DelItem(self->records, intent) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(exc_type, exc_value, exc_tb);
        Py_DECREF(n_obj);
        return -1;
    }
    Py_DECREF(n_obj);
    PyObject *head = PyDict_GetItemWithError(self->heads, domain);
    if (head == NULL && PyErr_Occurred()) {
        return -1;
    }
    c->head = Py_NewRef(head != NULL ? head : self->empty_head);
    return 0;
}

static PyObject *fp_prepare(FastPath *self, PyObject *request) {
    if (Py_TYPE(request) != self->request.type) {
        return fall_back_prepare(self, request);
    }
    PyObject *intent = SLOT(request, self->request, RQ_INTENT);
    PyObject *domain = SLOT(request, self->request, RQ_DOMAIN);
    PyObject *tool = SLOT(request, self->request, RQ_TOOL);
    PyObject *args = SLOT(request, self->request, RQ_ARGS);
    PyObject *agent = SLOT(request, self->request, RQ_AGENT);
    PyObject *read_set = SLOT(request, self->request, RQ_READ_SET);
    PyObject *parent = SLOT(request, self->request, RQ_PARENT);
    PyObject *known = SLOT(request, self->request, RQ_KNOWN);
    PyObject *expected = SLOT(request, self->request, RQ_EXPECTED);
    if (intent == NULL || domain == NULL || tool == NULL || args == NULL || agent == NULL ||
        read_set == NULL || parent == NULL || known == NULL || expected == NULL ||
        !PyUnicode_CheckExact(intent) || !PyUnicode_CheckExact(domain) ||
        !PyUnicode_CheckExact(tool) || !PyUnicode_CheckExact(agent) ||
        (expected != Py_None && !PyLong_CheckExact(expected)) || !PyTuple_CheckExact(read_set) ||
        PyTuple_GET_SIZE(read_set) || (known != Py_None && Py_TYPE(known) != self->clock.type)) {
        return fall_back_prepare(self, request); /* read sets: Python */
    }
    /* strict OCC: expected_seq (checked at the door: an int in [0, 2**53-2]); -1 if none */
    int64_t strict = expected == Py_None ? -1 : PyLong_AsLongLong(expected);
    if (strict < 0 && expected != Py_None) {
        PyErr_Clear();
        return fall_back_prepare(self, request);
    }
    /* Own the fields: a finalizer run by an allocation below may let another thread rebind
     * the request's slots, and a borrowed field would then dangle. */
    PyObject *owned[] = {intent, domain, tool, args, agent, read_set, parent, known, expected};
    const int n_owned = (int)(sizeof(owned) / sizeof(owned[0]));
    for (int i = 0; i < n_owned; i++) {
        Py_INCREF(owned[i]);
    }
    PyObject *payload = NULL, *args_json = NULL, *result = NULL, *known_copy = NULL;
    Claim c = {NULL, NULL, NULL, NULL, 0.0};
    int rc = build_payload(self, args, domain, tool, &payload, &args_json);
    if (rc != 0) {
        if (rc > 0) {
            result = fall_back_prepare(self, request);
        }
        goto out;
    }
    if (known != Py_None && (known_copy = clock_snapshot(self, known)) == NULL) {
        if (!PyErr_Occurred()) {
            result = fall_back_with_payload(self, request, payload, args_json);
        }
        goto out;
    }
    double now;
    if (now_of(self, &now) < 0) {
        goto out;
    }
    if (self->auto_sweep) {
        /* the fence's _sweep_due[0]; a list that is not one float (only private meddling
         * makes it so) goes to the Python path, which says what is wrong with it */
        PyObject *due = PyList_GET_SIZE(self->sweep_due) == 1
                            ? PyList_GET_ITEM(self->sweep_due, 0)
                            : NULL;
        if (due == NULL || !PyFloat_CheckExact(due)) {
            result = fall_back_with_payload(self, request, payload, args_json);
            goto out;
        }
        double next = PyFloat_AS_DOUBLE(due);
        if (now >= next) {
            result = fall_back_with_payload(self, request, payload, args_json); /* it sweeps */
            goto out;
        }
    }
    PyObject *rec = PyDict_GetItemWithError(self->records, intent); /* borrowed */
    if (rec != NULL) {
        /* the only row decided here: DONE_LIVE with the same payload -> replay */
        PyObject *cert = replayable(self, rec, now, payload);
        if (cert != NULL) {
            Py_INCREF(cert);
            PyObject *values[1] = {cert};
            result = layout_new(&self->replay, values);
            if (result != NULL && bump(self, self->slot_replayed) < 0) {
                Py_CLEAR(result);
            }
            goto out;
        }
        /* every refusal, a takeover, an expired result: the Python path decides */
        result = fall_back_with_payload(self, request, payload, args_json);
        goto out;
    }
    if (PyErr_Occurred()) {
        goto out;
    }
    /* ABSENT -> claim: the store's claim, as one step under the intent's stripe lock */
    Py_ssize_t stripe;
    PyObject *lock = lock_stripe(self, intent, &stripe);
    if (lock == NULL) {
        goto out;
    }
    rc = claim_locked(self, stripe, intent, domain, agent, payload, strict, &c);
    lock_release(lock);
    if (rc != 0) {
        if (rc > 0) {
            result = fall_back_with_payload(self, request, payload, args_json);
        }
        goto out;
    }
    /* claimed: from here on the attempt holds a lease; what remains cannot refuse */
    if (schedule(self, c.lease_until, intent, c.token) < 0) {
        goto out;
    }
    /* _admit: the ticket's clock, and the last refusal there is (a value no certificate
     * could record) */
    int at_edge = 0;
    PyObject *clock = ticket_clock(self, c.head, known_copy, agent, &at_edge);
    int64_t seq = PyLong_AsLongLong(c.seq);
    if (clock != NULL && (at_edge || seq > MAX_SAFE_INTEGER || (seq == -1 && PyErr_Occurred()))) {
        PyErr_Clear();
        Py_DECREF(clock);
        /* the Python _admit releases the claim and refuses (fail closed, before the effect) */
        result = PyObject_CallFunctionObjArgs(self->admit, request, payload, args_json, c.seq,
                                              c.token, c.lease, c.head, Py_False, NULL);
        goto out;
    }
    PyObject *tparent = parent;
    if (parent == Py_None) {
        tparent = SLOT(c.head, self->head, HD_HASH);
        if (tparent == NULL) {
            tparent = Py_None;
        }
    }
    PyObject *tv[TK_N] = {Py_NewRef(intent),   Py_NewRef(domain),   Py_NewRef(c.seq),
                          Py_NewRef(c.token),  Py_NewRef(agent),    Py_NewRef(tool),
                          Py_NewRef(args),     Py_NewRef(read_set), Py_NewRef(tparent),
                          clock,               Py_NewRef(expected), Py_NewRef(c.lease),
                          Py_NewRef(payload),  Py_NewRef(args_json)};
    PyObject *ticket = layout_new(&self->ticket, tv);
    if (ticket == NULL) {
        goto out;
    }
    PyObject *fv[2] = {ticket, Py_NewRef(Py_False)};
    result = layout_new(&self->fresh, fv);
    if (result != NULL && bump(self, self->slot_admitted) < 0) {
        Py_CLEAR(result);
    }
out:
    claim_clear(&c);
    Py_XDECREF(known_copy);
    Py_XDECREF(payload);
    Py_XDECREF(args_json);
    for (int i = 0; i < n_owned; i++) {
        Py_DECREF(owned[i]);
    }
    return result;
}

/* -- commit --------------------------------------------------------------------------------- */

/* A strict ticket (expected_seq) commits only if its domain is still at the ticket's own
 * seq: the complete step's own_seq check, judged under the stripe lock.  1 holds, 0 moved
 * (or a domain not counted: the Python complete judges it, marks FAILED and refuses), -1
 * error. */
static int own_seq_holds(FastPath *self, PyObject *domain, PyObject *seq) {
    PyObject *slot = PyDict_GetItemWithError(self->seq_slots, domain);
    if (slot == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    int64_t s = PyLong_AsLongLong(slot);
    if (s == -1 && PyErr_Occurred()) {
        return -1;
    }
    int64_t at = self->load(s);
    if (at < 0 && PyErr_Occurred()) {
        return -1;
    }
    int64_t own = PyLong_AsLongLong(seq);
    if (own == -1 && PyErr_Occurred()) {
        return -1;
    }
    return at == own;
}

/* Rule 3 for the one row the fast path decides: the record is IN_FLIGHT (live or lapsed:
 * a lapsed lease nobody took over is still its holder's) and ``token`` is its current
 * token.  1 yes, 0 no (the Python path then refuses), -1 error.  Judged before the result
 * is encoded and again under the stripe lock, where the write happens (G2). */
static int holds_lease(FastPath *self, PyObject *rec, PyObject *token) {
    if (Py_TYPE(rec) != self->record.type || SLOT(rec, self->record, RC_STATE) != self->in_flight) {
        return 0;
    }
    PyObject *current = SLOT(rec, self->record, RC_TOKEN);
    if (current == NULL) {
        return 0;
    }
    return PyObject_RichCompareBool(current, token, Py_EQ);
}

static PyObject *fall_back_commit(FastPath *self, PyObject *ticket, PyObject *result) {
    return PyObject_CallFunctionObjArgs(self->slow_commit, ticket, result, NULL);
}

/* A member: its literal prefix (',"key":'), then bytes already in canonical form. */
static int put_raw(Buf *b, const char *prefix, PyObject *bytes) {
    if (buf_put(b, prefix, (Py_ssize_t)strlen(prefix)) < 0 ||
        buf_put(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes)) < 0) {
        return ENC_ERR;
    }
    return ENC_OK;
}

/* A member whose value is one str (a non-str, e.g. a forged parent, goes to Python). */
static int put_str(Buf *b, const char *prefix, PyObject *text) {
    if (!PyUnicode_CheckExact(text)) {
        return ENC_FALLBACK;
    }
    if (buf_put(b, prefix, (Py_ssize_t)strlen(prefix)) < 0) {
        return ENC_ERR;
    }
    return enc_str(b, text);
}

/* The certificate hash over the body assembled from canonical parts (cert.spliced_hash). */
static PyObject *cert_digest(FastPath *self, PyObject *agent, PyObject *args_json,
                             PyObject *domain, PyObject *intent, PyObject *parent,
                             PyObject *result_json, PyObject *seq, PyObject *tool,
                             PyObject *vc, int *fallback) {
    /* members in RFC 8785 key order (all ASCII keys: code-point order) */
    Buf b;
    buf_init(&b);
    int rc = put_str(&b, "{\"agent\":", agent);
    if (rc == ENC_OK) {
        rc = put_raw(&b, ",\"args\":", args_json);
    }
    if (rc == ENC_OK) {
        rc = put_str(&b, ",\"domain\":", domain);
    }
    if (rc == ENC_OK) {
        rc = put_raw(&b, ",\"format\":", self->format_json);
    }
    if (rc == ENC_OK) {
        rc = put_str(&b, ",\"intent\":", intent);
    }
    if (rc == ENC_OK) {
        rc = parent == Py_None ? (PUT_LIT(&b, ",\"parent\":null") < 0 ? ENC_ERR : ENC_OK)
                               : put_str(&b, ",\"parent\":", parent);
    }
    if (rc == ENC_OK) {
        rc = put_raw(&b, ",\"read_set\":[],\"result\":", result_json);
    }
    if (rc == ENC_OK) {
        rc = PUT_LIT(&b, ",\"seq\":") < 0 ? ENC_ERR : enc_int(&b, seq);
    }
    if (rc == ENC_OK) {
        rc = put_str(&b, ",\"tool\":", tool);
    }
    if (rc == ENC_OK) {
        rc = PUT_LIT(&b, ",\"vector_clock\":") < 0 ? ENC_ERR : enc_dict(&b, vc, 1);
    }
    if (rc == ENC_OK && buf_byte(&b, '}') < 0) {
        rc = ENC_ERR;
    }
    if (rc != ENC_OK) {
        buf_free(&b);
        *fallback = rc == ENC_FALLBACK;
        return NULL;
    }
    if (self->sha256_direct != NULL) {
        static const char hexdigits[] = "0123456789abcdef";
        unsigned char md[32];
        if (self->sha256_direct((const unsigned char *)b.p, (size_t)b.len, md) == NULL) {
            goto through_hashlib; /* OpenSSL could not (no memory, no provider): md is junk */
        }
        buf_free(&b);
        PyObject *hex = PyUnicode_New(64, 127);
        if (hex == NULL) {
            return NULL;
        }
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(hex);
        for (int i = 0; i < 32; i++) {
            out[2 * i] = (Py_UCS1)hexdigits[md[i] >> 4];
            out[2 * i + 1] = (Py_UCS1)hexdigits[md[i] & 15];
        }
        return hex;
    }
through_hashlib:;
    PyObject *body = buf_bytes(&b);
    if (body == NULL) {
        return NULL;
    }
    PyObject *h = PyObject_CallOneArg(self->sha256, body);
    Py_DECREF(body);
    if (h == NULL) {
        return NULL;
    }
    PyObject *hex = PyObject_CallMethodNoArgs(h, s_hexdigest);
    Py_DECREF(h);
    return hex;
}

/* The domain's new head: this certificate's hash, and the old head's clock merged with the
 * certificate's clock (MemoryStore.complete, under heads_lock).  0 or -1. */
static int advance_head(FastPath *self, PyObject *domain, PyObject *hash, PyObject *vc) {
    if (lock_acquire(self->heads_lock) < 0) {
        return -1;
    }
    PyObject *old = PyDict_GetItemWithError(self->heads, domain);
    if (old == NULL && !PyErr_Occurred()) {
        old = self->empty_head;
    }
    PyObject *old_clock = old == NULL ? NULL : SLOT(old, self->head, HD_CLOCK);
    if (old != NULL && (old_clock == NULL || !PyDict_Check(old_clock))) {
        old_clock = NULL;
        PyErr_SetString(PyExc_SystemError, "FastPath: a domain head without a clock");
    }
    PyObject *merged = old_clock == NULL ? NULL : PyDict_Copy(old_clock);
    Py_ssize_t pos = 0;
    PyObject *a, *n;
    while (merged != NULL && PyDict_Next(vc, &pos, &a, &n)) {
        if (merge_max(self, merged, a, n) < 0) {
            Py_CLEAR(merged);
        }
    }
    PyObject *hv[2] = {Py_NewRef(hash), merged};
    PyObject *new_head = acyclic(layout_new(&self->head, hv)); /* NULL merged: an error */
    int rc = new_head == NULL ? -1 : PyDict_SetItem(self->heads, domain, new_head);
    Py_XDECREF(new_head);
    lock_release(self->heads_lock);
    return rc;
}

/* MemoryStore.complete for a ticket without a read set; the caller holds the intent's
 * stripe lock.  0: done (record DONE, in-flight count down, head advanced).  1: the record
 * moved, or a strict ticket's domain did: nothing changed, the Python commit judges (and
 * fails the intent for a moved domain).  -1: an error. */
static int complete_locked(FastPath *self, Py_ssize_t stripe, PyObject *intent, PyObject *token,
                           PyObject **tk, PyObject *cert, PyObject *vc, PyObject *until_obj) {
    /* the condition (in flight, this token) judged again, where the write happens */
    PyObject *cur = PyDict_GetItemWithError(self->records, intent);
    PyObject *cur_domain = NULL;
    int ok = cur != NULL && holds_lease(self, cur, token) == 1 &&
             (cur_domain = SLOT(cur, self->record, RC_DOMAIN)) != NULL &&
             (tk[TK_EXPECTED] == Py_None || own_seq_holds(self, cur_domain, tk[TK_SEQ]) == 1);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (!ok) {
        return 1;
    }
    PyObject *counts = PyList_GET_ITEM(self->inflight, stripe);
    PyObject *have = PyDict_GetItemWithError(counts, cur_domain);
    long long n_in = have == NULL ? -1 : PyLong_AsLongLong(have);
    if (have == NULL || n_in < 1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_SystemError,
                            "FastPath: an in-flight record without its in-flight count");
        }
        return -1;
    }
    PyObject *n_obj = n_in > 1 ? PyLong_FromLongLong(n_in - 1) : NULL;
    PyObject *rv[RC_N] = {Py_NewRef(intent),
                          Py_NewRef(self->done),
                          Py_NewRef(token),
                          Py_XNewRef(SLOT(cur, self->record, RC_FP)),
                          Py_NewRef(cur_domain),
                          Py_XNewRef(SLOT(cur, self->record, RC_AGENT)),
                          Py_NewRef(self->zero),
                          Py_NewRef(cert),
                          Py_NewRef(until_obj),
                          Py_NewRef(self->empty_str),
                          Py_NewRef(self->zero)};
    PyObject *record = acyclic(layout_new(&self->record, rv));
    if (record == NULL || (n_in > 1 && n_obj == NULL)) {
        Py_XDECREF(n_obj);
        Py_XDECREF(record);
        return -1;
    }
    Py_INCREF(cur_domain); /* the old record may die at the next line */
    int rc = PyDict_SetItem(self->records, intent, record);
    Py_DECREF(record);
    if (rc == 0) {
        rc = n_in > 1 ? PyDict_SetItem(counts, cur_domain, n_obj)
                      : PyDict_DelItem(counts, cur_domain);
    }
    Py_XDECREF(n_obj);
    if (rc == 0) {
        rc = advance_head(self, cur_domain, PyTuple_GET_ITEM(cert, CERT_ITEMS - 1), vc);
    }
    Py_DECREF(cur_domain);
    return rc;
}

static PyObject *fp_commit_owned(FastPath *self, PyObject *ticket, PyObject *result,
                                 PyObject **tk);

static PyObject *fp_commit(FastPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "commit(ticket, result) takes 2 arguments");
        return NULL;
    }
    PyObject *ticket = args[0], *result = args[1];
    if (Py_TYPE(ticket) != self->ticket.type) {
        return fall_back_commit(self, ticket, result);
    }
    PyObject *tk[TK_N];
    for (int i = 0; i < TK_N; i++) {
        tk[i] = SLOT(ticket, self->ticket, i);
        if (tk[i] == NULL) {
            return fall_back_commit(self, ticket, result);
        }
    }
    PyObject *intent = tk[TK_INTENT], *token = tk[TK_TOKEN], *vclock = tk[TK_CLOCK];
    if (!PyUnicode_CheckExact(intent) || !PyBytes_CheckExact(tk[TK_FP]) ||
        !PyBytes_CheckExact(tk[TK_ARGS_JSON]) ||
        (tk[TK_EXPECTED] != Py_None && !PyLong_CheckExact(tk[TK_EXPECTED])) ||
        !PyTuple_CheckExact(tk[TK_READ_SET]) || PyTuple_GET_SIZE(tk[TK_READ_SET]) ||
        !PyLong_CheckExact(token) || !PyUnicode_CheckExact(tk[TK_DOMAIN]) ||
        !PyUnicode_CheckExact(tk[TK_TOOL]) || !PyUnicode_CheckExact(tk[TK_AGENT]) ||
        !PyLong_CheckExact(tk[TK_SEQ]) || Py_TYPE(vclock) != self->clock.type ||
        SLOT(vclock, self->clock, 0) == NULL || !PyDict_CheckExact(SLOT(vclock, self->clock, 0))) {
        return fall_back_commit(self, ticket, result); /* read sets, crossed tickets: Python */
    }
    for (int i = 0; i < TK_N; i++) {
        Py_INCREF(tk[i]); /* owned: see fp_prepare */
    }
    PyObject *out = fp_commit_owned(self, ticket, result, tk);
    for (int i = 0; i < TK_N; i++) {
        Py_DECREF(tk[i]);
    }
    return out;
}

static PyObject *fp_commit_owned(FastPath *self, PyObject *ticket, PyObject *result,
                                 PyObject **tk) {
    PyObject *intent = tk[TK_INTENT], *token = tk[TK_TOKEN], *vclock = tk[TK_CLOCK];
    /* rule 3 for the one row decided here: IN_FLIGHT (live or lapsed) with this token */
    PyObject *rec = PyDict_GetItemWithError(self->records, intent);
    if (rec == NULL) {
        return PyErr_Occurred() ? NULL : fall_back_commit(self, ticket, result);
    }
    if (holds_lease(self, rec, token) != 1 || SLOT(rec, self->record, RC_FP) == NULL ||
        bytes_equal(SLOT(rec, self->record, RC_FP), tk[TK_FP]) != 1) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        return fall_back_commit(self, ticket, result); /* every refusal */
    }
    Buf rb;
    buf_init(&rb);
    int rc = enc_value(&rb, result, self->max_depth);
    if (rc == ENC_OK && rb.len > self->max_result_bytes) {
        rc = ENC_FALLBACK;
    }
    if (rc != ENC_OK) {
        buf_free(&rb);
        return rc < 0 ? NULL : fall_back_commit(self, ticket, result);
    }
    PyObject *result_json = buf_bytes(&rb);
    if (result_json == NULL) {
        return NULL;
    }
    PyObject *vc = clock_snapshot(self, vclock);
    if (vc == NULL) {
        Py_DECREF(result_json);
        return PyErr_Occurred() ? NULL : fall_back_commit(self, ticket, result);
    }
    int fallback = 0;
    PyObject *digest =
        cert_digest(self, tk[TK_AGENT], tk[TK_ARGS_JSON], tk[TK_DOMAIN], intent, tk[TK_PARENT],
                    result_json, tk[TK_SEQ], tk[TK_TOOL], vc, &fallback);
    if (digest == NULL) {
        Py_DECREF(result_json);
        Py_DECREF(vc);
        return fallback ? fall_back_commit(self, ticket, result) : NULL;
    }
    PyObject *cert = self->cert_type->tp_alloc(self->cert_type, CERT_ITEMS);
    if (cert == NULL) {
        Py_DECREF(result_json);
        Py_DECREF(vc);
        Py_DECREF(digest);
        return NULL;
    }
    PyObject *cv[CERT_ITEMS] = {intent,          tk[TK_PARENT],     tk[TK_DOMAIN], tk[TK_SEQ],
                                tk[TK_TOOL],     tk[TK_ARGS_JSON],  result_json,   vc,
                                self->empty_tuple, tk[TK_AGENT],    digest};
    for (int i = 0; i < CERT_ITEMS; i++) {
        Py_INCREF(cv[i]);
        PyTuple_SET_ITEM(cert, i, cv[i]);
    }
    acyclic(cert);
    Py_DECREF(result_json);
    Py_DECREF(digest);
    /* the certificate owns its own copy of the clock (vc); the head merges from it */
    PyObject *out = NULL, *until_obj = NULL;
    double now;
    if (now_of(self, &now) < 0) {
        goto done;
    }
    double until = now + self->result_ttl;
    until_obj = PyFloat_FromDouble(until);
    if (until_obj == NULL) {
        goto done;
    }
    Py_ssize_t stripe;
    PyObject *lock = lock_stripe(self, intent, &stripe);
    if (lock == NULL) {
        goto done;
    }
    rc = complete_locked(self, stripe, intent, token, tk, cert, vc, until_obj);
    lock_release(lock);
    if (rc != 0) {
        if (rc > 0) {
            out = fall_back_commit(self, ticket, result); /* moved meanwhile: Python judges */
        }
        goto done;
    }
    if (until < INFINITY && schedule(self, until, intent, token) < 0) {
        goto done;
    }
    if (bump(self, self->slot_commits) < 0) {
        goto done;
    }
    if (PyDict_GET_SIZE(self->waiters)) {
        PyObject *r = PyObject_CallOneArg(self->wake, intent);
        if (r == NULL) {
            goto done;
        }
        Py_DECREF(r);
    }
    out = Py_NewRef(cert);
done:
    Py_XDECREF(until_obj);
    Py_DECREF(cert);
    Py_DECREF(vc);
    return out;
}

static PyMethodDef fp_methods[] = {
    {"prepare", (PyCFunction)fp_prepare, METH_O,
     "prepare(request): the fence's prepare, common paths in C."},
    {"commit", (PyCFunction)(void (*)(void))fp_commit, METH_FASTCALL,
     "commit(ticket, result): the fence's commit, common path in C."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "effectfence._speedups.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "prepare/commit of an EffectFence over a MemoryStore, common paths in C.",
    .tp_new = fp_new,
    .tp_dealloc = (destructor)fp_dealloc,
    .tp_traverse = (traverseproc)fp_traverse,
    .tp_clear = (inquiry)fp_clear,
    .tp_methods = fp_methods,
};

/* ------------------------------------------------------------------------ RequestInit */

/* EffectRequest.__init__ for the call every duplicate makes: 3 to 5 positional arguments,
 * ASCII names within MAX_NAME_LENGTH, args a dict or None.  Any other call (keywords, a
 * Mapping, a name to check for surrogates, a refusal to explain) goes to the Python
 * __init__ unchanged.  A method descriptor, so type() calls it without a bound method. */
typedef struct {
    PyObject_HEAD
    Layout request;
    PyObject *py_init;       /* the Python __init__: the definition, and every other call */
    PyObject *default_agent; /* its default for ``agent`` */
    PyObject *empty_tuple;
    Py_ssize_t max_name;
    vectorcallfunc vectorcall;
} RequestInit;

static int plain_name(PyObject *o, Py_ssize_t max_name) {
    return PyUnicode_CheckExact(o) && PyUnicode_IS_ASCII(o) && PyUnicode_GET_LENGTH(o) > 0 &&
           PyUnicode_GET_LENGTH(o) <= max_name;
}

static PyObject *ri_vectorcall(RequestInit *ri, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf); /* self, intent, domain, tool[, args[, agent]] */
    if (n < 4 || n > 6 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) ||
        !PyObject_TypeCheck(args[0], ri->request.type)) {
        return PyObject_Vectorcall(ri->py_init, args, nargsf, kwnames);
    }
    PyObject *self = args[0];
    PyObject *a = n > 4 ? args[4] : Py_None;
    PyObject *agent = n > 5 ? args[5] : ri->default_agent;
    if (!plain_name(args[1], ri->max_name) || !plain_name(args[2], ri->max_name) ||
        !plain_name(args[3], ri->max_name) || !plain_name(agent, ri->max_name) ||
        !(a == Py_None || PyDict_CheckExact(a))) {
        return PyObject_Vectorcall(ri->py_init, args, nargsf, kwnames);
    }
    PyObject *fresh_args = a == Py_None ? PyDict_New() : Py_NewRef(a);
    if (fresh_args == NULL) {
        return NULL;
    }
    PyObject *values[] = {args[1], args[2], args[3], fresh_args, agent,
                          ri->empty_tuple, Py_None, Py_None, Py_None};
    for (int i = 0; i < ri->request.n; i++) { /* REQUEST_FIELDS order */
        PyObject **slot = &SLOT(self, ri->request, i);
        PyObject *old = *slot;
        *slot = i == RQ_ARGS ? values[i] : Py_NewRef(values[i]);
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}

static PyObject *ri_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *cls, *py_init, *agent;
    Py_ssize_t max_name;
    if (!PyArg_ParseTuple(args, "OOUn:RequestInit", &cls, &py_init, &agent, &max_name)) {
        return NULL;
    }
    RequestInit *ri = (RequestInit *)type->tp_alloc(type, 0);
    if (ri == NULL) {
        return NULL;
    }
    if (layout_init(&ri->request, cls, REQUEST_FIELDS) < 0) {
        ri->request.type = NULL;
        Py_DECREF(ri);
        return NULL;
    }
    Py_INCREF(cls);
    ri->py_init = Py_NewRef(py_init);
    ri->default_agent = Py_NewRef(agent);
    ri->empty_tuple = PyTuple_New(0);
    ri->max_name = max_name;
    ri->vectorcall = (vectorcallfunc)ri_vectorcall;
    if (ri->empty_tuple == NULL) {
        Py_DECREF(ri);
        return NULL;
    }
    return (PyObject *)ri;
}

static void ri_dealloc(RequestInit *ri) {
    Py_XDECREF(ri->request.type);
    Py_XDECREF(ri->py_init);
    Py_XDECREF(ri->default_agent);
    Py_XDECREF(ri->empty_tuple);
    Py_TYPE(ri)->tp_free((PyObject *)ri);
}

static PyObject *ri_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static PyMemberDef ri_members[] = {
    /* inspect.signature() and help() follow __wrapped__ to the Python definition */
    {"__wrapped__", T_OBJECT, offsetof(RequestInit, py_init), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RequestInitType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "effectfence._speedups.RequestInit",
    .tp_basicsize = sizeof(RequestInit),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "EffectRequest.__init__ with the common positional call in C.",
    .tp_new = ri_new,
    .tp_dealloc = (destructor)ri_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(RequestInit, vectorcall),
    .tp_descr_get = ri_get,
    .tp_members = ri_members,
};

/* ------------------------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"canonical", (PyCFunction)(void (*)(void))py_canonical, METH_FASTCALL,
     "canonical(value, max_depth) -> RFC 8785 bytes, or None to ask the Python encoder."},
    {"string", (PyCFunction)py_string, METH_O,
     "string(text) -> RFC 8785 bytes of one str, or None (a lone surrogate, a subclass)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "effectfence._speedups",
    "effectfence's optional CPython accelerator (see csrc/effectfence_speedups.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    s_acquire = PyUnicode_InternFromString("acquire");
    s_release = PyUnicode_InternFromString("release");
    s_hexdigest = PyUnicode_InternFromString("hexdigest");
    if (s_acquire == NULL || s_release == NULL || s_hexdigest == NULL) {
        return NULL;
    }
    if (PyType_Ready(&FastPathType) < 0 || PyType_Ready(&RequestInitType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", EF_SPEEDUPS_ABI) < 0 ||
        PyModule_AddObjectRef(m, "FastPath", (PyObject *)&FastPathType) < 0 ||
        PyModule_AddObjectRef(m, "RequestInit", (PyObject *)&RequestInitType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
