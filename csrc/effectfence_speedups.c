/*
 * effectfence_speedups.c -- the CPython accelerator: pure functions only.
 * Optional: without it effectfence runs the same code in Python.
 *
 * Two things live here, and neither holds a rule of the protocol (those are written once,
 * in effectfence/protocol.py and effectfence/fence.py; see docs/design.md):
 *
 * 1. canonical(value, max_depth, max_bytes=-1): RFC 8785 (JCS) bytes for exact dict/list/
 *    tuple/str/int/float/bool/None, or None when it cannot be sure (subclasses, unsafe ints,
 *    NaN, lone surrogates, depth).  None means "ask the Python encoder", which is the
 *    reference and the one that names what is wrong.  False means "longer than max_bytes":
 *    the buffer never grows past the limit, so shared sub-lists that expand to hundreds of
 *    megabytes cost max_bytes of work.  It never raises except MemoryError.
 *
 * 2. RequestInit: EffectRequest.__init__ for the plain positional call every duplicate
 *    makes (a pure constructor: it stores already-valid names and hands every other call,
 *    and every refusal, to the Python __init__, which stays the definition).
 *
 * 3. nesting_over(line, limit): whether a JSON text nests deeper than limit, brackets in
 *    strings not counted (effectfence.wrap.proxy._shallow's byte walk, at C speed; a 10 MB
 *    tool result took the wrapper's event loop ~0.5 s in Python).
 *
 * The request's fields are written to its __slots__ directly (offsets read from the class's
 * member descriptors at construction): a Python __init__ per duplicate costs more than the
 * rest of a replay.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The encoder walks caller-owned containers holding borrowed references that only the GIL
 * keeps alive.  A free-threaded interpreter has no GIL: refuse to build there, and
 * effectfence runs its Python paths instead. */
#ifdef Py_GIL_DISABLED
#error "effectfence._speedups needs the GIL; the free-threaded build uses the Python paths"
#endif

#define EF_SPEEDUPS_ABI 4 /* 3: canonical() takes max_bytes; 4: nesting_over() */
#define MAX_SAFE_INTEGER 9007199254740991LL /* 2**53 - 1 */
/* Deeper input goes to the Python encoder: C recursion stays under ~25 KiB of stack even on
 * a 128 KiB thread stack (musl's default, or threading.stack_size). */
#define DEPTH_CAP 128

/* ------------------------------------------------------------------------------ buffer */

/* cap <= limit always, so the one capacity test of buf_put/buf_byte also enforces the limit:
 * only buf_grow compares against it.  Passing the limit sets `over` and fails with no
 * Python exception set (the callers' ENC_ERR; canonical_or_none tells the two apart). */
typedef struct {
    char *p;
    Py_ssize_t len;
    Py_ssize_t cap;
    Py_ssize_t limit;
    int over;
    char stack[1024];
} Buf;

static void buf_init_limit(Buf *b, Py_ssize_t limit) {
    b->p = b->stack;
    b->len = 0;
    b->limit = limit < 0 ? 0 : limit;
    b->cap = (Py_ssize_t)sizeof(b->stack) < b->limit ? (Py_ssize_t)sizeof(b->stack) : b->limit;
    b->over = 0;
}

static void buf_free(Buf *b) {
    if (b->p != b->stack) {
        PyMem_Free(b->p);
    }
    b->p = b->stack;
}

static int buf_grow(Buf *b, Py_ssize_t need) {
    if (need > b->limit - b->len) {
        b->over = 1; /* no exception: the caller reports "over max_bytes" */
        return -1;
    }
    Py_ssize_t cap = b->cap < 64 ? 64 : b->cap;
    while (cap - b->len < need) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    if (cap > b->limit) {
        cap = b->limit; /* >= len + need, checked above */
    }
    if (cap <= (Py_ssize_t)sizeof(b->stack)) {
        b->cap = cap; /* still fits the stack buffer (a limit below its size) */
        return 0;
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
        /* One read of every container: encoding runs no Python code (only exact types are
         * handled, with calls that never call back, and the GIL is held throughout), so no
         * thread can change a list or dict while it is read here.  A dict's members are
         * collected in one PyDict_Next pass; a size that disagrees falls back. */
        return enc_array(b, ((PyListObject *)o)->ob_item, PyList_GET_SIZE(o), depth);
    }
    if (PyTuple_CheckExact(o)) {
        return enc_array(b, ((PyTupleObject *)o)->ob_item, PyTuple_GET_SIZE(o), depth);
    }
    return ENC_FALLBACK; /* subclasses, bytes, sets, objects: the Python path decides */
}

/* bytes, Py_None (not sure), Py_False (longer than max_bytes), or NULL with an exception.
 * Over the limit is decisive: what was written is a prefix of the canonical form, so the
 * whole is longer still (or the value is refused anyway, for what made us unsure). */
static PyObject *canonical_or_none(PyObject *value, int max_depth, Py_ssize_t max_bytes) {
    Buf b;
    buf_init_limit(&b, max_bytes);
    int rc = enc_value(&b, value, max_depth > DEPTH_CAP ? DEPTH_CAP : max_depth);
    if (rc == ENC_OK) {
        return buf_bytes(&b);
    }
    buf_free(&b);
    if (rc == ENC_ERR) {
        if (b.over && !PyErr_Occurred()) {
            Py_RETURN_FALSE;
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_canonical(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "canonical(value, max_depth, max_bytes=-1) takes 2 or 3 arguments");
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
    Py_ssize_t max_bytes = PY_SSIZE_T_MAX; /* negative or absent: no limit */
    if (nargs == 3) {
        Py_ssize_t n = PyLong_AsSsize_t(args[2]);
        if (n == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return NULL;
            }
            PyErr_Clear();
            n = PY_SSIZE_T_MAX; /* beyond ssize_t: no output is that long */
        } else if (n < 0) {
            n = PY_SSIZE_T_MAX;
        }
        max_bytes = n;
    }
    return canonical_or_none(args[0], (int)depth, max_bytes);
}

static PyObject *py_string(PyObject *module, PyObject *arg) {
    if (!PyUnicode_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    return canonical_or_none(arg, 0, PY_SSIZE_T_MAX); /* no container budget, no limit */
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
        PyErr_SetString(PyExc_TypeError, "RequestInit: expected a class");
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
            PyErr_Format(PyExc_TypeError, "RequestInit: %R.%s is not a __slots__ field", type,
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

/* Field order: must match the names passed to layout_init below. */
static const char *const REQUEST_FIELDS[] = {"intent", "domain", "tool", "args", "agent",
                                             "read_set", "parent", "known_clock",
                                             "expected_seq", NULL};
enum { RQ_INTENT, RQ_DOMAIN, RQ_TOOL, RQ_ARGS, RQ_AGENT, RQ_READ_SET, RQ_PARENT, RQ_KNOWN,
       RQ_EXPECTED };

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

/* A name the Python __init__ would take as it is: ASCII, 1..max_name long, no NUL (a
 * store's text cannot hold one; the Python __init__ refuses it, naming it). */
static int plain_name(PyObject *o, Py_ssize_t max_name) {
    if (!PyUnicode_CheckExact(o) || !PyUnicode_IS_ASCII(o)) {
        return 0;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(o);
    return len > 0 && len <= max_name && memchr(PyUnicode_1BYTE_DATA(o), 0, (size_t)len) == NULL;
}

static PyObject *ri_vectorcall(RequestInit *ri, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf); /* self, intent, domain, tool[, args[, agent]] */
    /* the exact class only: a subclass's __setattr__ or descriptors run in the Python
     * __init__, which writes through them (found by review) */
    if (n < 4 || n > 6 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) ||
        !Py_IS_TYPE(args[0], ri->request.type)) {
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

/* -------------------------------------------------------------------------- nesting_over */

/* The same walk as effectfence.wrap.proxy._shallow (the definition; tests compare the two):
 * a quote opens or closes a string, a backslash in a string escapes the next byte, and
 * outside strings [ { go one level down and ] } one up.  Only bytes are read: the text
 * need not be valid JSON. */
static int nesting_over_impl(const unsigned char *p, Py_ssize_t n, long long limit) {
    long long depth = 0;
    int in_string = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (in_string) {
            if (c == '\\') {
                i++; /* the escaped byte, whatever it is */
            } else if (c == '"') {
                in_string = 0;
            }
        } else if (c == '"') {
            in_string = 1;
        } else if (c == '[' || c == '{') {
            if (++depth > limit) {
                return 1;
            }
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return 0;
}

/* A large line is walked without the GIL (the bytes object is immutable and held by the
 * caller): the wrapper's store steps run in other threads meanwhile. */
#define NESTING_RELEASE_GIL (1 << 16)

static PyObject *py_nesting_over(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "nesting_over(line: bytes, limit: int)");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    int over;
    if (n >= NESTING_RELEASE_GIL) {
        Py_BEGIN_ALLOW_THREADS over = nesting_over_impl(p, n, limit);
        Py_END_ALLOW_THREADS
    } else {
        over = nesting_over_impl(p, n, limit);
    }
    return PyBool_FromLong(over);
}

/* ------------------------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"canonical", (PyCFunction)(void (*)(void))py_canonical, METH_FASTCALL,
     "canonical(value, max_depth) -> RFC 8785 bytes, or None to ask the Python encoder."},
    {"string", (PyCFunction)py_string, METH_O,
     "string(text) -> RFC 8785 bytes of one str, or None (a lone surrogate, a subclass)."},
    {"nesting_over", (PyCFunction)(void (*)(void))py_nesting_over, METH_FASTCALL,
     "nesting_over(line, limit) -> whether the JSON text nests deeper than limit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "effectfence._speedups",
    "effectfence's optional CPython accelerator (see csrc/effectfence_speedups.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&RequestInitType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", EF_SPEEDUPS_ABI) < 0 ||
        PyModule_AddObjectRef(m, "RequestInit", (PyObject *)&RequestInitType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
