/*
 * effectfence_memstore.c -- the memory store's two hot steps, claim and complete, in C.
 * Optional: without it the Python MemoryStore (effectfence/store/memory.py) runs.
 *
 * This is a store implementation, not a decider.  It holds no rule of the protocol (those
 * live once, in effectfence/protocol.py, applied by effectfence/fence.py): every step
 * below is the same compare-and-set as MemoryStore.claim / MemoryStore.complete, line for
 * line -- identity compare with ``expect``, compare (domain, seq) pairs, reserve through
 * the counter table, install the record, in-flight bookkeeping, head merge, wheel
 * scheduling -- and every duration arrives as an argument.  Records, steps and heads are
 * built by calling their Python classes; the counter table, the token table, the clock and
 * the head merge (effectfence.clock.merge_counts) are called through their Python
 * interfaces.  What C saves is the interpreter's work between those calls.
 *
 * ``Core`` owns the store's structures (the fields below).  It is the first base of
 * effectfence.store.cmemory.CMemoryStore, whose other base is MemoryStore: the fields are
 * exposed as the very attributes MemoryStore's Python methods use (``self._records``,
 * ``self._locks``, ...), so MemoryStore.__init__ fills them and every other step (get,
 * fail, release, renew, clear, evict_domain, sweep, size, records) runs unchanged on them.
 * Atomicity is the Python store's: each step holds the intent's stripe lock (the same
 * threading.Lock objects), the heads lock and the wheel lock exactly where MemoryStore
 * holds them, so C and Python steps interleave as two Python steps would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <math.h>

#ifdef Py_GIL_DISABLED
#error "effectfence._memstore needs the GIL; the free-threaded build uses the Python store"
#endif

#define EF_MEMSTORE_ABI 2 /* 2: bind() takes EffectCert */

/* Python objects handed over once by bind() (effectfence/store/cmemory.py). */
static struct {
    PyObject *IntentRecord, *Step, *Head, *EMPTY_HEAD;
    PyObject *APPLIED, *MOVED, *STALE, *RACE;
    PyObject *IN_FLIGHT, *DONE, *FAILED;
    PyObject *merge_counts, *heappush, *EffectCert;
    PyObject *zero, *empty; /* 0.0 and "" */
    int bound;
} K;

/* interned names: attributes, methods and keyword arguments */
static PyObject *s_acquire, *s_release, *s_state, *s_token, *s_domain, *s_fingerprint,
    *s_agent, *s_seq, *s_clock, *s_hash, *s_vector_clock, *s_reclaim_at, *s_load, *s_floor,
    *s_find, *s_reserve, *s_advance_if, *s_reserve_slot, *s_get, *s_append;
static PyObject *s_expect, *s_fingerprint_kw, *s_lease_ttl, *s_reclaim_after, *s_compare,
    *s_reserve_at, *s_result_ttl, *s_own_seq, *s_stale_reason, *s_stale_reclaim_after;

typedef struct {
    PyObject_HEAD
    PyObject *records;    /* _records: dict intent -> IntentRecord */
    PyObject *locks;      /* _locks: list of threading.Lock, one per stripe */
    PyObject *inflight;   /* _inflight: list of dict domain -> attempts in flight */
    PyObject *heads;      /* _heads: dict domain -> Head */
    PyObject *heads_lock; /* _heads_lock */
    PyObject *wheel;      /* _wheel: dict bucket -> list of (intent, token) */
    PyObject *due;        /* _due: heap of bucket numbers */
    PyObject *wheel_lock; /* _wheel_lock */
    PyObject *clock;      /* _clock: () -> float */
    PyObject *seqs;       /* _seqs: the counter table of domain seqs */
    PyObject *tokens;     /* _tokens: the process's token table */
    PyObject *token_slot; /* _token_slot */
    Py_ssize_t mask;      /* _mask: stripes - 1 */
    double g;             /* _g: wheel granularity, seconds */
    double next_due;      /* _next_due: first bucket not yet due, as a deadline */
} Core;

/* ------------------------------------------------------------------------------ helpers */

static PyObject *call_method0(PyObject *obj, PyObject *name) {
    return PyObject_VectorcallMethod(name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static PyObject *call_method1(PyObject *obj, PyObject *name, PyObject *a) {
    PyObject *args[2] = {obj, a};
    return PyObject_VectorcallMethod(name, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static PyObject *call_method2(PyObject *obj, PyObject *name, PyObject *a, PyObject *b) {
    PyObject *args[3] = {obj, a, b};
    return PyObject_VectorcallMethod(name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static int lock_acquire(PyObject *lock) {
    PyObject *r = call_method0(lock, s_acquire); /* blocks with the GIL released */
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Release ``lock``, keeping an exception already set (as ``with lock:`` does). */
static int lock_release(PyObject *lock) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = call_method0(lock, s_release);
    if (r == NULL) {
        if (et != NULL) { /* the first error wins */
            PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return et == NULL ? 0 : -1;
}

static int check_core(Core *c) {
    if (!K.bound) {
        PyErr_SetString(PyExc_RuntimeError, "effectfence._memstore: bind() was not called");
        return -1;
    }
    if (c->records == NULL || !PyDict_CheckExact(c->records) || c->locks == NULL ||
        !PyList_CheckExact(c->locks) || c->inflight == NULL || !PyList_CheckExact(c->inflight) ||
        PyList_GET_SIZE(c->locks) != c->mask + 1 ||
        PyList_GET_SIZE(c->inflight) != c->mask + 1 || c->heads == NULL ||
        !PyDict_CheckExact(c->heads) || c->wheel == NULL || !PyDict_CheckExact(c->wheel) ||
        c->due == NULL || c->heads_lock == NULL || c->wheel_lock == NULL || c->clock == NULL ||
        c->seqs == NULL || c->tokens == NULL || c->token_slot == NULL) {
        PyErr_SetString(PyExc_TypeError, "effectfence._memstore: the store is not initialised");
        return -1;
    }
    return 0;
}

static Py_ssize_t stripe_of(Core *c, PyObject *intent) {
    Py_hash_t h = PyObject_Hash(intent); /* hash(intent) & self._mask, as in Python */
    if (h == -1) {
        return -1;
    }
    return (Py_ssize_t)((Py_uhash_t)h & (Py_uhash_t)c->mask);
}

/* counts[domain] += delta, deleting the entry at zero (MemoryStore._enter/_leave). */
static int inflight_add(Core *c, Py_ssize_t stripe, PyObject *domain, long delta) {
    PyObject *counts = PyList_GET_ITEM(c->inflight, stripe);
    if (!PyDict_CheckExact(counts)) {
        PyErr_SetString(PyExc_TypeError, "in-flight counts must be dicts");
        return -1;
    }
    PyObject *n = PyDict_GetItemWithError(counts, domain); /* borrowed */
    long v;
    if (n == NULL) {
        if (PyErr_Occurred()) {
            return -1;
        }
        if (delta < 0) { /* counts[domain] on a missing key: KeyError, as in Python */
            PyErr_SetObject(PyExc_KeyError, domain);
            return -1;
        }
        v = 0;
    } else {
        v = PyLong_AsLong(n);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    v += delta;
    if (v == 0) {
        return PyDict_DelItem(counts, domain);
    }
    PyObject *nv = PyLong_FromLong(v);
    if (nv == NULL) {
        return -1;
    }
    int r = PyDict_SetItem(counts, domain, nv);
    Py_DECREF(nv);
    return r;
}

/* MemoryStore._at: a domain's seq, the floor for an absent domain. New reference. */
static PyObject *seq_at(Core *c, PyObject *domain) {
    PyObject *v = call_method1(c->seqs, s_load, domain);
    if (v == Py_None) {
        Py_DECREF(v);
        return call_method0(c->seqs, s_floor);
    }
    return v;
}

/* MemoryStore._compare: the first pair not at its seq as (d, s, actual), or None. Returns a
 * new reference (Py_None when all hold) or NULL. */
static PyObject *compare_pairs(Core *c, PyObject *pairs) {
    PyObject *fast = PySequence_Fast(pairs, "compare must be a sequence of (domain, seq)");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Tuple(PySequence_Fast_GET_ITEM(fast, i)); /* d, s = */
        if (pair == NULL || PyTuple_GET_SIZE(pair) != 2) {
            if (pair != NULL) {
                PyErr_SetString(PyExc_ValueError, "compare must hold (domain, seq) pairs");
            }
            Py_XDECREF(pair);
            Py_DECREF(fast);
            return NULL;
        }
        PyObject *d = PyTuple_GET_ITEM(pair, 0), *s = PyTuple_GET_ITEM(pair, 1);
        PyObject *actual = seq_at(c, d);
        int ne = actual == NULL ? -1 : PyObject_RichCompareBool(actual, s, Py_NE);
        if (ne != 0) {
            PyObject *out = ne < 0 ? NULL : PyTuple_Pack(3, d, s, actual);
            Py_XDECREF(actual);
            Py_DECREF(pair);
            Py_DECREF(fast);
            return out;
        }
        Py_DECREF(actual);
        Py_DECREF(pair);
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* MemoryStore._schedule: put (intent, token) in the wheel bucket of ``deadline``. */
static int schedule(Core *c, PyObject *deadline, PyObject *intent, PyObject *token) {
    double d = PyFloat_AsDouble(deadline);
    if (d == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (d == INFINITY) {
        return 0; /* kept until cleared: nothing to schedule */
    }
    PyObject *b = PyLong_FromDouble(ceil(d / c->g)); /* math.ceil(deadline / self._g) */
    if (b == NULL) {
        return -1;
    }
    PyObject *entry = PyTuple_Pack(2, intent, token);
    if (entry == NULL) {
        Py_DECREF(b);
        return -1;
    }
    int rc = -1;
    for (;;) {
        PyObject *bucket = Py_XNewRef(PyDict_GetItemWithError(c->wheel, b));
        if (bucket == NULL) {
            if (PyErr_Occurred() || lock_acquire(c->wheel_lock) < 0) {
                break;
            }
            bucket = Py_XNewRef(PyDict_GetItemWithError(c->wheel, b));
            int err = bucket == NULL && PyErr_Occurred();
            if (bucket == NULL && !err) {
                bucket = PyList_New(0);
                PyObject *r = NULL;
                if (bucket != NULL && PyDict_SetItem(c->wheel, b, bucket) == 0) {
                    r = PyObject_CallFunctionObjArgs(K.heappush, c->due, b, NULL);
                }
                if (r == NULL) {
                    err = 1;
                } else {
                    Py_DECREF(r);
                    PyObject *first = PySequence_GetItem(c->due, 0);
                    double f = first == NULL ? -1.0 : PyFloat_AsDouble(first);
                    Py_XDECREF(first);
                    if (f == -1.0 && PyErr_Occurred()) {
                        err = 1;
                    } else if (f * c->g < c->next_due) {
                        /* never later than it was: a limited sweep that stopped in a due
                         * bucket left next_due at its own now, and it must stay due */
                        c->next_due = f * c->g;
                    }
                }
            }
            if (lock_release(c->wheel_lock) < 0 || err) {
                Py_XDECREF(bucket);
                break;
            }
        }
        if (!PyList_CheckExact(bucket) || PyList_Append(bucket, entry) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "wheel buckets must be lists");
            }
            Py_DECREF(bucket);
            break;
        }
        /* A sweep may have taken this bucket between the lookup and the append (only if
         * the deadline is already due): schedule again, into a bucket a sweep will see. */
        PyObject *now_there = PyDict_GetItemWithError(c->wheel, b);
        Py_DECREF(bucket);
        if (now_there == bucket) {
            rc = 0;
            break;
        }
        if (PyErr_Occurred()) {
            break;
        }
    }
    Py_DECREF(entry);
    Py_DECREF(b);
    return rc;
}

/* Step(outcome, record, found, head, stale): a new reference. */
/* A stored record, and the certificate a commit keeps, hold only immutable scalars, enum
 * members and tuples of scalars: they cannot be part of a reference cycle, so the cyclic
 * GC has nothing to find in them. Left tracked, every full collection walks all kept
 * results again (measured: ~10% of a fresh prepare+commit); CPython untracks tuples of
 * atomics for the same reason. Memory management only: no condition depends on it. */
static void untrack_immutable(PyObject *o) {
    if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o)) {
        PyObject_GC_UnTrack(o);
    }
}

static PyObject *make_step(PyObject *outcome, PyObject *record, PyObject *found, PyObject *head,
                           PyObject *stale) {
    PyObject *args[5] = {outcome, record ? record : Py_None, found ? found : Py_None,
                         head ? head : K.EMPTY_HEAD, stale ? stale : Py_None};
    return PyObject_Vectorcall(K.Step, args, stale ? 5 : (head ? 4 : 3), NULL);
}

/* Keyword arguments: match kwnames to ``names`` (interned: identity first). */
static int parse_kw(const char *fn, PyObject *kwnames, PyObject *const *kwvalues,
                    PyObject **names, PyObject **out, int n) {
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (int j = 0; j < n; j++) {
        out[j] = NULL;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        int j = 0;
        for (; j < n; j++) {
            if (k == names[j]) {
                break;
            }
        }
        if (j == n) {
            for (j = 0; j < n; j++) {
                int eq = PyUnicode_Compare(k, names[j]) == 0;
                if (PyErr_Occurred()) {
                    return -1;
                }
                if (eq) {
                    break;
                }
            }
        }
        if (j == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fn, k);
            return -1;
        }
        if (out[j] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument %R", fn, k);
            return -1;
        }
        out[j] = kwvalues[i];
    }
    for (int j = 0; j < n; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required keyword-only argument: %R", fn,
                         names[j]);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------- claim */

enum { C_EXPECT, C_FP, C_DOMAIN, C_AGENT, C_LEASE, C_RECLAIM, C_COMPARE, C_RESERVE_AT, C_N };

/* The locked part of MemoryStore.claim; returns the Step, or NULL with an exception. On
 * APPLIED, rec_out, reclaim_out and token_out receive new references for the scheduling. */
static PyObject *claim_locked(Core *c, Py_ssize_t stripe, PyObject *intent, PyObject **a,
                              PyObject **rec_out, PyObject **reclaim_out,
                              PyObject **token_out) {
    PyObject *domain = a[C_DOMAIN];
    PyObject *cur = PyDict_GetItemWithError(c->records, intent);
    if (cur == NULL && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *curp = cur ? cur : Py_None;
    /* condition 1: the slot still holds the record the decider observed */
    if (curp != a[C_EXPECT]) {
        return make_step(K.MOVED, NULL, cur, NULL, NULL);
    }
    Py_XINCREF(cur); /* held across the calls below, which run Python code */
    PyObject *seq = NULL, *step = NULL, *now = NULL, *token = NULL, *lease_until = NULL,
             *reclaim_at = NULL, *rec = NULL, *stale = NULL;
    /* condition 2: the compared pairs hold */
    int has_compare = PyObject_IsTrue(a[C_COMPARE]);
    if (has_compare < 0) {
        goto done;
    }
    if (has_compare) {
        stale = compare_pairs(c, a[C_COMPARE]);
        if (stale == NULL) {
            goto done;
        }
        if (stale != Py_None) {
            step = make_step(K.STALE, NULL, cur, K.EMPTY_HEAD, stale);
            goto done;
        }
    }
    /* condition 3: reserve (compare-exchange at reserve_at, fetch-add without) */
    PyObject *reserve_at = a[C_RESERVE_AT];
    if (reserve_at == Py_None) {
        seq = call_method1(c->seqs, s_reserve, domain);
        if (seq == NULL) {
            goto done;
        }
    } else {
        PyObject *lost = NULL;
        PyObject *found = call_method1(c->seqs, s_find, domain);
        if (found == NULL) {
            goto done;
        }
        long slot = PyLong_AsLong(found);
        Py_DECREF(found);
        if (slot == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (slot < 0) {
            PyObject *floor = call_method0(c->seqs, s_floor);
            if (floor == NULL) {
                goto done;
            }
            int ne = PyObject_RichCompareBool(reserve_at, floor, Py_NE);
            if (ne < 0) {
                Py_DECREF(floor);
                goto done;
            }
            if (ne) { /* lose without creating the domain (G7) */
                lost = floor;
            } else {
                Py_DECREF(floor);
            }
        }
        if (lost == NULL) {
            PyObject *got = call_method2(c->seqs, s_advance_if, domain, reserve_at);
            if (got == NULL) {
                goto done;
            }
            int neg = PyObject_RichCompareBool(got, K.zero, Py_LT);
            if (neg < 0) {
                Py_DECREF(got);
                goto done;
            }
            if (neg) { /* lost = -got - 1 */
                PyObject *minus = PyNumber_Negative(got);
                Py_DECREF(got);
                PyObject *one = PyLong_FromLong(1);
                lost = minus && one ? PyNumber_Subtract(minus, one) : NULL;
                Py_XDECREF(minus);
                Py_XDECREF(one);
                if (lost == NULL) {
                    goto done;
                }
            } else {
                seq = got;
            }
        }
        if (lost != NULL) {
            PyObject *race = PyTuple_Pack(3, domain, reserve_at, lost);
            Py_DECREF(lost);
            if (race != NULL) {
                step = make_step(K.RACE, NULL, cur, K.EMPTY_HEAD, race);
                Py_DECREF(race);
            }
            goto done;
        }
    }
    now = PyObject_CallNoArgs(c->clock);
    if (now == NULL) {
        goto done;
    }
    token = call_method1(c->tokens, s_reserve_slot, c->token_slot);
    if (token == NULL || (lease_until = PyNumber_Add(now, a[C_LEASE])) == NULL ||
        (reclaim_at = PyNumber_Add(now, a[C_RECLAIM])) == NULL) {
        goto done;
    }
    {
        PyObject *args[13] = {intent,  K.IN_FLIGHT, token,   a[C_FP], domain,
                              a[C_AGENT], lease_until, Py_None, K.zero,  K.empty,
                              K.zero,  seq,         reclaim_at};
        rec = PyObject_Vectorcall(K.IntentRecord, args, 13, NULL);
    }
    if (rec != NULL) {
        untrack_immutable(rec);
    }
    if (rec == NULL || PyDict_SetItem(c->records, intent, rec) < 0) {
        goto done;
    }
    /* in-flight bookkeeping: a takeover replaces an in-flight record (same domain: same
     * payload), anything else adds one */
    if (cur == NULL) {
        if (inflight_add(c, stripe, domain, 1) < 0) {
            goto done;
        }
    } else {
        PyObject *st = PyObject_GetAttr(cur, s_state);
        if (st == NULL) {
            goto done;
        }
        int was_in_flight = st == K.IN_FLIGHT;
        Py_DECREF(st);
        if (!was_in_flight) {
            if (inflight_add(c, stripe, domain, 1) < 0) {
                goto done;
            }
        } else {
            PyObject *cd = PyObject_GetAttr(cur, s_domain);
            if (cd == NULL) {
                goto done;
            }
            int ne = PyObject_RichCompareBool(cd, domain, Py_NE);
            int err = ne < 0 || (ne && (inflight_add(c, stripe, cd, -1) < 0 ||
                                        inflight_add(c, stripe, domain, 1) < 0));
            Py_DECREF(cd);
            if (err) {
                goto done;
            }
        }
    }
    PyObject *head = PyDict_GetItemWithError(c->heads, domain);
    if (head == NULL && PyErr_Occurred()) {
        goto done;
    }
    step = make_step(K.APPLIED, rec, cur, head ? head : K.EMPTY_HEAD, NULL);
    if (step != NULL) {
        *rec_out = Py_NewRef(rec);
        *reclaim_out = Py_NewRef(reclaim_at);
        *token_out = Py_NewRef(token);
    }
done:
    Py_XDECREF(cur);
    Py_XDECREF(seq);
    Py_XDECREF(stale);
    Py_XDECREF(now);
    Py_XDECREF(token);
    Py_XDECREF(lease_until);
    Py_XDECREF(reclaim_at);
    Py_XDECREF(rec);
    return step;
}

static PyObject *core_claim(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static PyObject **names[C_N] = {&s_expect,      &s_fingerprint_kw, &s_domain,
                                    &s_agent,       &s_lease_ttl,      &s_reclaim_after,
                                    &s_compare,     &s_reserve_at};
    PyObject *nm[C_N], *a[C_N];
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "claim() takes the intent as its one positional argument");
        return NULL;
    }
    for (int i = 0; i < C_N; i++) {
        nm[i] = *names[i];
    }
    if (parse_kw("claim", kwnames, args + nargs, nm, a, C_N) < 0 || check_core(c) < 0) {
        return NULL;
    }
    PyObject *intent = args[0];
    Py_ssize_t stripe = stripe_of(c, intent);
    if (stripe < 0) {
        return NULL;
    }
    PyObject *lock = Py_NewRef(PyList_GET_ITEM(c->locks, stripe));
    if (lock_acquire(lock) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    PyObject *rec = NULL, *reclaim_at = NULL, *token = NULL;
    PyObject *step = claim_locked(c, stripe, intent, a, &rec, &reclaim_at, &token);
    if (lock_release(lock) < 0) {
        Py_CLEAR(step);
    }
    Py_DECREF(lock);
    if (step != NULL && rec != NULL && schedule(c, reclaim_at, intent, token) < 0) {
        Py_CLEAR(step);
    }
    Py_XDECREF(rec);
    Py_XDECREF(reclaim_at);
    Py_XDECREF(token);
    return step;
}

/* ---------------------------------------------------------------------------- complete */

enum { K_FP, K_RESULT_TTL, K_RECLAIM, K_COMPARE, K_OWN_SEQ, K_REASON, K_STALE_RECLAIM, K_N };

/* The head merge of MemoryStore.complete, under the heads lock. */
static int merge_head(Core *c, PyObject *domain, PyObject *cert) {
    if (lock_acquire(c->heads_lock) < 0) {
        return -1;
    }
    int rc = -1;
    PyObject *hash = NULL, *vc = NULL, *old_clock = NULL, *merged = NULL, *head = NULL;
    PyObject *old = PyDict_GetItemWithError(c->heads, domain);
    if (old == NULL && PyErr_Occurred()) {
        goto out;
    }
    old_clock = PyObject_GetAttr(old ? old : K.EMPTY_HEAD, s_clock);
    if (old_clock == NULL || (hash = PyObject_GetAttr(cert, s_hash)) == NULL ||
        (vc = PyObject_GetAttr(cert, s_vector_clock)) == NULL ||
        (merged = PyObject_CallFunctionObjArgs(K.merge_counts, old_clock, vc, NULL)) == NULL ||
        (head = PyObject_CallFunctionObjArgs(K.Head, hash, merged, NULL)) == NULL) {
        goto out;
    }
    rc = PyDict_SetItem(c->heads, domain, head);
out:
    Py_XDECREF(hash);
    Py_XDECREF(vc);
    Py_XDECREF(old_clock);
    Py_XDECREF(merged);
    Py_XDECREF(head);
    return lock_release(c->heads_lock) < 0 ? -1 : rc;
}

static PyObject *complete_locked(Core *c, Py_ssize_t stripe, PyObject *intent, PyObject *token,
                                 PyObject *cert, PyObject **a, PyObject **rec_out) {
    PyObject *cur = PyDict_GetItemWithError(c->records, intent);
    if (cur == NULL) {
        return PyErr_Occurred() ? NULL : make_step(K.MOVED, NULL, NULL, NULL, NULL);
    }
    Py_INCREF(cur);
    PyObject *step = NULL, *stale = NULL, *now = NULL, *rec = NULL, *until = NULL,
             *reclaim_at = NULL, *f_token = NULL, *fp = NULL, *domain = NULL, *agent = NULL,
             *seq = NULL, *state = NULL;
    if ((state = PyObject_GetAttr(cur, s_state)) == NULL ||
        (f_token = PyObject_GetAttr(cur, s_token)) == NULL) {
        goto done;
    }
    /* compare-by-token, and the ticket's payload is the admitted one */
    int moved = state != K.IN_FLIGHT;
    if (!moved) {
        moved = PyObject_RichCompareBool(f_token, token, Py_NE);
        if (moved < 0) {
            goto done;
        }
    }
    if (!moved) {
        if ((fp = PyObject_GetAttr(cur, s_fingerprint)) == NULL) {
            goto done;
        }
        moved = PyObject_RichCompareBool(fp, a[K_FP], Py_NE);
        if (moved < 0) {
            goto done;
        }
    }
    if (moved) {
        step = make_step(K.MOVED, NULL, cur, NULL, NULL);
        goto done;
    }
    if ((domain = PyObject_GetAttr(cur, s_domain)) == NULL ||
        (agent = PyObject_GetAttr(cur, s_agent)) == NULL ||
        (seq = PyObject_GetAttr(cur, s_seq)) == NULL) {
        goto done;
    }
    int has_compare = PyObject_IsTrue(a[K_COMPARE]);
    if (has_compare < 0) {
        goto done;
    }
    stale = has_compare ? compare_pairs(c, a[K_COMPARE]) : Py_NewRef(Py_None);
    if (stale == NULL) {
        goto done;
    }
    if (stale == Py_None && a[K_OWN_SEQ] != Py_None) {
        PyObject *actual = seq_at(c, domain);
        if (actual == NULL) {
            goto done;
        }
        int ne = PyObject_RichCompareBool(actual, a[K_OWN_SEQ], Py_NE);
        if (ne > 0) {
            Py_SETREF(stale, PyTuple_Pack(3, domain, a[K_OWN_SEQ], actual));
        }
        Py_DECREF(actual);
        if (ne < 0 || stale == NULL) {
            goto done;
        }
    }
    if ((now = PyObject_CallNoArgs(c->clock)) == NULL) {
        goto done;
    }
    if (stale == Py_None) {
        if ((until = PyNumber_Add(now, a[K_RESULT_TTL])) == NULL ||
            (reclaim_at = PyNumber_Add(now, a[K_RECLAIM])) == NULL) {
            goto done;
        }
        PyObject *args[13] = {intent, K.DONE, token,   fp,     domain, agent,     K.zero,
                              cert,   until,  K.empty, K.zero, seq,    reclaim_at};
        rec = PyObject_Vectorcall(K.IntentRecord, args, 13, NULL);
        if (rec == NULL || merge_head(c, domain, cert) < 0) {
            goto done;
        }
    } else {
        if ((reclaim_at = PyNumber_Add(now, a[K_STALE_RECLAIM])) == NULL) {
            goto done;
        }
        PyObject *args[13] = {intent,  K.FAILED, token,      fp,  domain, agent, K.zero,
                              Py_None, K.zero,   a[K_REASON], now, seq,    reclaim_at};
        rec = PyObject_Vectorcall(K.IntentRecord, args, 13, NULL);
        if (rec == NULL) {
            goto done;
        }
    }
    /* only a certificate the fence made (and a record holding only such a one): a cert
     * of another type may be in a cycle, or be a type whose own dealloc untracks it
     * unchecked (a function: a crash; found by review) */
    if (stale != Py_None || Py_IS_TYPE(cert, (PyTypeObject *)K.EffectCert)) {
        untrack_immutable(rec);
    }
    if (stale == Py_None && Py_IS_TYPE(cert, (PyTypeObject *)K.EffectCert)) {
        untrack_immutable(cert);
    }
    if (PyDict_SetItem(c->records, intent, rec) < 0 ||
        inflight_add(c, stripe, domain, -1) < 0) { /* one attempt fewer in flight */
        goto done;
    }
    step = stale == Py_None ? make_step(K.APPLIED, rec, cur, NULL, NULL)
                            : make_step(K.STALE, rec, cur, K.EMPTY_HEAD, stale);
    if (step != NULL) {
        *rec_out = Py_NewRef(rec);
    }
done:
    Py_DECREF(cur);
    Py_XDECREF(state);
    Py_XDECREF(f_token);
    Py_XDECREF(fp);
    Py_XDECREF(domain);
    Py_XDECREF(agent);
    Py_XDECREF(seq);
    Py_XDECREF(stale);
    Py_XDECREF(now);
    Py_XDECREF(until);
    Py_XDECREF(reclaim_at);
    Py_XDECREF(rec);
    return step;
}

static PyObject *core_complete(Core *c, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static PyObject **names[K_N] = {&s_fingerprint_kw, &s_result_ttl,   &s_reclaim_after,
                                    &s_compare,        &s_own_seq,      &s_stale_reason,
                                    &s_stale_reclaim_after};
    PyObject *nm[K_N], *a[K_N];
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "complete() takes intent, token and cert as positional arguments");
        return NULL;
    }
    for (int i = 0; i < K_N; i++) {
        nm[i] = *names[i];
    }
    if (parse_kw("complete", kwnames, args + nargs, nm, a, K_N) < 0 || check_core(c) < 0) {
        return NULL;
    }
    PyObject *intent = args[0], *token = args[1], *cert = args[2];
    Py_ssize_t stripe = stripe_of(c, intent);
    if (stripe < 0) {
        return NULL;
    }
    PyObject *lock = Py_NewRef(PyList_GET_ITEM(c->locks, stripe));
    if (lock_acquire(lock) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    PyObject *rec = NULL;
    PyObject *step = complete_locked(c, stripe, intent, token, cert, a, &rec);
    if (lock_release(lock) < 0) {
        Py_CLEAR(step);
    }
    Py_DECREF(lock);
    if (step != NULL && rec != NULL) {
        PyObject *reclaim_at = PyObject_GetAttr(rec, s_reclaim_at);
        if (reclaim_at == NULL || schedule(c, reclaim_at, intent, token) < 0) {
            Py_CLEAR(step);
        }
        Py_XDECREF(reclaim_at);
    }
    Py_XDECREF(rec);
    return step;
}

/* -------------------------------------------------------------------------------- reads */
/* MemoryStore.get/now/due and FenceStore.read: one C call each instead of a Python frame
 * (prepare and every ticket operation read). */

static PyObject *core_get(Core *c, PyObject *intent) {
    if (c->records == NULL || !PyDict_CheckExact(c->records)) {
        check_core(c); /* sets the error */
        return NULL;
    }
    PyObject *rec = PyDict_GetItemWithError(c->records, intent);
    if (rec == NULL && PyErr_Occurred()) {
        return NULL;
    }
    return Py_NewRef(rec ? rec : Py_None);
}

static PyObject *core_now(Core *c, PyObject *unused) {
    if (c->clock == NULL) {
        PyErr_SetString(PyExc_TypeError, "effectfence._memstore: the store is not initialised");
        return NULL;
    }
    return PyObject_CallNoArgs(c->clock);
}

static PyObject *core_due(Core *c, PyObject *now) {
    if (PyFloat_CheckExact(now)) { /* now >= self._next_due */
        return PyBool_FromLong(PyFloat_AS_DOUBLE(now) >= c->next_due);
    }
    PyObject *next_due = PyFloat_FromDouble(c->next_due);
    if (next_due == NULL) {
        return NULL;
    }
    PyObject *r = PyObject_RichCompare(now, next_due, Py_GE);
    Py_DECREF(next_due);
    return r;
}

static PyObject *core_read(Core *c, PyObject *intent) {
    PyObject *rec = core_get(c, intent);
    if (rec == NULL) {
        return NULL;
    }
    PyObject *now = core_now(c, NULL);
    if (now == NULL) {
        Py_DECREF(rec);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, rec, now);
    Py_DECREF(rec);
    Py_DECREF(now);
    return out;
}

/* ------------------------------------------------------------------------------- type */

/* A heap subtype's type object is visited and released by CPython's subtype_traverse and
 * subtype_dealloc (Core is a static type), so neither function below touches it. */
static int core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->records);
    Py_VISIT(c->locks);
    Py_VISIT(c->inflight);
    Py_VISIT(c->heads);
    Py_VISIT(c->heads_lock);
    Py_VISIT(c->wheel);
    Py_VISIT(c->due);
    Py_VISIT(c->wheel_lock);
    Py_VISIT(c->clock);
    Py_VISIT(c->seqs);
    Py_VISIT(c->tokens);
    Py_VISIT(c->token_slot);
    return 0;
}

static int core_clear(Core *c) {
    Py_CLEAR(c->records);
    Py_CLEAR(c->locks);
    Py_CLEAR(c->inflight);
    Py_CLEAR(c->heads);
    Py_CLEAR(c->heads_lock);
    Py_CLEAR(c->wheel);
    Py_CLEAR(c->due);
    Py_CLEAR(c->wheel_lock);
    Py_CLEAR(c->clock);
    Py_CLEAR(c->seqs);
    Py_CLEAR(c->tokens);
    Py_CLEAR(c->token_slot);
    return 0;
}

static void core_dealloc(Core *c) {
    PyTypeObject *tp = Py_TYPE(c);
    PyObject_GC_UnTrack(c);
    core_clear(c);
    tp->tp_free((PyObject *)c);
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c != NULL) {
        c->next_due = INFINITY;
        c->g = 1.0;
    }
    return (PyObject *)c;
}

#define MEMBER(name, field) {name, T_OBJECT_EX, offsetof(Core, field), 0, NULL}
static PyMemberDef core_members[] = {
    MEMBER("_records", records),       MEMBER("_locks", locks),
    MEMBER("_inflight", inflight),     MEMBER("_heads", heads),
    MEMBER("_heads_lock", heads_lock), MEMBER("_wheel", wheel),
    MEMBER("_due", due),               MEMBER("_wheel_lock", wheel_lock),
    MEMBER("_clock", clock),           MEMBER("_seqs", seqs),
    MEMBER("_tokens", tokens),         MEMBER("_token_slot", token_slot),
    {"_mask", T_PYSSIZET, offsetof(Core, mask), 0, NULL},
    {"_g", T_DOUBLE, offsetof(Core, g), 0, NULL},
    {"_next_due", T_DOUBLE, offsetof(Core, next_due), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef core_methods[] = {
    {"claim", (PyCFunction)(void (*)(void))core_claim, METH_FASTCALL | METH_KEYWORDS,
     "MemoryStore.claim, in C."},
    {"complete", (PyCFunction)(void (*)(void))core_complete, METH_FASTCALL | METH_KEYWORDS,
     "MemoryStore.complete, in C."},
    {"get", (PyCFunction)core_get, METH_O, "MemoryStore.get, in C."},
    {"now", (PyCFunction)core_now, METH_NOARGS, "MemoryStore.now, in C."},
    {"due", (PyCFunction)core_due, METH_O, "MemoryStore.due, in C."},
    {"read", (PyCFunction)core_read, METH_O, "FenceStore.read (get and now), in C."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "effectfence._memstore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The memory store's structures, and its claim and complete steps in C.",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_members = core_members,
    .tp_methods = core_methods,
};

/* ------------------------------------------------------------------------------- module */

static PyObject *py_bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14 || !PyType_Check(args[13])) {
        PyErr_SetString(PyExc_TypeError,
                        "bind(IntentRecord, Step, Head, EMPTY_HEAD, APPLIED, MOVED, STALE, RACE, "
                        "IN_FLIGHT, DONE, FAILED, merge_counts, heappush, EffectCert)");
        return NULL;
    }
    PyObject **dst[14] = {&K.IntentRecord, &K.Step,  &K.Head,      &K.EMPTY_HEAD, &K.APPLIED,
                          &K.MOVED,        &K.STALE, &K.RACE,      &K.IN_FLIGHT,  &K.DONE,
                          &K.FAILED,       &K.merge_counts, &K.heappush, &K.EffectCert};
    for (int i = 0; i < 14; i++) {
        Py_XSETREF(*dst[i], Py_NewRef(args[i]));
    }
    K.bound = 1;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))py_bind, METH_FASTCALL,
     "Hand over the Python classes and functions the steps call (once, at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "effectfence._memstore",
    "The memory store's claim and complete steps in C (see csrc/effectfence_memstore.c).", -1,
    module_methods,
};

static int intern_all(void) {
    struct {
        PyObject **p;
        const char *s;
    } t[] = {
        {&s_acquire, "acquire"},       {&s_release, "release"},
        {&s_state, "state"},           {&s_token, "token"},
        {&s_domain, "domain"},         {&s_fingerprint, "fingerprint"},
        {&s_agent, "agent"},           {&s_seq, "seq"},
        {&s_clock, "clock"},           {&s_hash, "hash"},
        {&s_vector_clock, "vector_clock"}, {&s_reclaim_at, "reclaim_at"},
        {&s_load, "load"},             {&s_floor, "floor"},
        {&s_find, "find"},             {&s_reserve, "reserve"},
        {&s_advance_if, "advance_if"}, {&s_reserve_slot, "reserve_slot"},
        {&s_get, "get"},               {&s_append, "append"},
        {&s_expect, "expect"},         {&s_fingerprint_kw, "fingerprint"},
        {&s_lease_ttl, "lease_ttl"},   {&s_reclaim_after, "reclaim_after"},
        {&s_compare, "compare"},       {&s_reserve_at, "reserve_at"},
        {&s_result_ttl, "result_ttl"}, {&s_own_seq, "own_seq"},
        {&s_stale_reason, "stale_reason"}, {&s_stale_reclaim_after, "stale_reclaim_after"},
    };
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
        *t[i].p = PyUnicode_InternFromString(t[i].s);
        if (*t[i].p == NULL) {
            return -1;
        }
    }
    K.zero = PyFloat_FromDouble(0.0);
    K.empty = PyUnicode_InternFromString("");
    return K.zero != NULL && K.empty != NULL ? 0 : -1;
}

PyMODINIT_FUNC PyInit__memstore(void) {
    if (intern_all() < 0 || PyType_Ready(&CoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", EF_MEMSTORE_ABI) < 0 ||
        PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
