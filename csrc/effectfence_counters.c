/*
 * effectfence_counters.c -- see effectfence_counters.h for the contract.
 *
 * Memory ordering: counter operations are sequentially consistent (the default), because the
 * fence builds its exactly-once argument on them and the cost on x86/ARM64 for a single RMW is
 * the same locked instruction either way.  Segment pointers are published with release and read
 * with acquire so a thread that sees a segment also sees it zero-initialised.
 */
#include "effectfence_counters.h"

#include <stdatomic.h>
#include <stdlib.h>

#define EF_VERSION_STRING "1.0.0"
#define EF_MAX ((int64_t)(INT64_MAX - 1))
#define EF_FAIL INT64_MIN
#define EF_CAPACITY ((int64_t)EF_SEGMENT_SIZE * (int64_t)EF_MAX_SEGMENTS)

typedef _Atomic int64_t ef_counter;

static _Atomic(ef_counter *) ef_segments[EF_MAX_SEGMENTS];
static _Atomic int64_t ef_next_slot;

int64_t ef_abi_version(void) { return EF_ABI_VERSION; }
const char *ef_version(void) { return EF_VERSION_STRING; }
int64_t ef_max_value(void) { return EF_MAX; }
int64_t ef_capacity(void) { return EF_CAPACITY; }
int64_t ef_fail_code(void) { return EF_FAIL; }

/* The counter behind `slot`, or NULL when the slot was never allocated. */
static inline ef_counter *ef_counter_at(int64_t slot) {
    if (slot < 0 || slot >= EF_CAPACITY) {
        return NULL;
    }
    ef_counter *seg = atomic_load_explicit(&ef_segments[slot / EF_SEGMENT_SIZE],
                                           memory_order_acquire);
    return seg == NULL ? NULL : &seg[slot % EF_SEGMENT_SIZE];
}

/* Make sure segment `index` exists.  Lock-free: whoever installs first wins, the loser frees. */
static int ef_ensure_segment(int64_t index) {
    if (atomic_load_explicit(&ef_segments[index], memory_order_acquire) != NULL) {
        return 1;
    }
    ef_counter *fresh = calloc(EF_SEGMENT_SIZE, sizeof(ef_counter));
    if (fresh == NULL) {
        return 0;
    }
    for (int64_t i = 0; i < EF_SEGMENT_SIZE; i++) {
        atomic_init(&fresh[i], 0);
    }
    ef_counter *expected = NULL;
    if (!atomic_compare_exchange_strong_explicit(&ef_segments[index], &expected, fresh,
                                                 memory_order_acq_rel, memory_order_acquire)) {
        free(fresh); /* lost the race: someone else's segment is installed */
    }
    return 1;
}

int64_t ef_alloc_slot(int64_t initial) {
    if (initial < 0 || initial > EF_MAX) {
        return EF_ERR_VALUE;
    }
    /* CAS loop instead of fetch_add so a full table does not keep bumping the index. */
    int64_t slot = atomic_load(&ef_next_slot);
    do {
        if (slot >= EF_CAPACITY) {
            return EF_ERR_NOMEM;
        }
    } while (!atomic_compare_exchange_weak(&ef_next_slot, &slot, slot + 1));
    if (!ef_ensure_segment(slot / EF_SEGMENT_SIZE)) {
        return EF_ERR_NOMEM; /* the slot index is lost; only on out-of-memory */
    }
    atomic_store(ef_counter_at(slot), initial);
    return slot;
}

int64_t ef_store(int64_t slot, int64_t value) {
    ef_counter *c = ef_counter_at(slot);
    if (c == NULL) {
        return EF_ERR_SLOT;
    }
    if (value < 0 || value > EF_MAX) {
        return EF_ERR_VALUE;
    }
    atomic_store(c, value);
    return 0;
}

int64_t ef_load(int64_t slot) {
    ef_counter *c = ef_counter_at(slot);
    return c == NULL ? EF_ERR_SLOT : atomic_load(c);
}

int64_t ef_reserve(int64_t slot) {
    ef_counter *c = ef_counter_at(slot);
    if (c == NULL) {
        return EF_ERR_SLOT;
    }
    /* A CAS loop rather than a bare fetch_add so the overflow refusal is exact and leaves the
     * counter untouched; uncontended it is the same single locked instruction. */
    int64_t old = atomic_load_explicit(c, memory_order_relaxed);
    do {
        if (old >= EF_MAX) {
            return EF_ERR_OVERFLOW;
        }
    } while (!atomic_compare_exchange_weak(c, &old, old + 1));
    return old + 1;
}

int64_t ef_advance_if(int64_t slot, int64_t expected) {
    ef_counter *c = ef_counter_at(slot);
    if (c == NULL || expected < 0 || expected >= EF_MAX) {
        return EF_FAIL;
    }
    int64_t observed = expected;
    if (atomic_compare_exchange_strong(c, &observed, expected + 1)) {
        return expected + 1;
    }
    return -observed - 1; /* observed <= EF_MAX, so this is in [-(EF_MAX + 1), -1] */
}

int64_t ef_compare_exchange(int64_t slot, int64_t expected, int64_t desired) {
    ef_counter *c = ef_counter_at(slot);
    if (c == NULL || expected < 0 || expected > EF_MAX || desired < 0 || desired > EF_MAX) {
        return EF_FAIL;
    }
    int64_t observed = expected;
    atomic_compare_exchange_strong(c, &observed, desired);
    return observed;
}

int64_t ef_fetch_max(int64_t slot, int64_t value) {
    ef_counter *c = ef_counter_at(slot);
    if (c == NULL) {
        return EF_ERR_SLOT;
    }
    if (value < 0 || value > EF_MAX) {
        return EF_ERR_VALUE;
    }
    int64_t old = atomic_load(c);
    while (old < value && !atomic_compare_exchange_weak(c, &old, value)) {
        /* `old` was refreshed by the failed CAS; retry while it is still below `value` */
    }
    return old;
}
