/*
 * effectfence_counters.c -- see effectfence_counters.h for the contract.
 *
 * Memory ordering: counter operations are sequentially consistent (the default), because the
 * fence builds its exactly-once argument on them and the cost on x86/ARM64 for a single RMW is
 * the same locked instruction either way.  Segment pointers are published with release and read
 * with acquire so a thread that sees a segment also sees it zero-initialised; likewise a cell's
 * handle is published (release) only after its value is initialised, and checked with acquire.
 * The handle check and the operation are two steps: a handle released *during* an operation on
 * it is the caller's bug (ef_release's precondition), not something the check can catch.
 */
#include "effectfence_counters.h"

#include <stdatomic.h>
#include <stdlib.h>

#define EF_VERSION_STRING "2.0.0"
#define EF_MAX ((int64_t)(INT64_MAX - 1))
#define EF_FAIL INT64_MIN
#define EF_CAPACITY ((int64_t)EF_SEGMENT_SIZE * (int64_t)EF_MAX_SEGMENTS)

typedef _Atomic int64_t ef_counter;

/* One counter and the handle it is lent under: `live` > 0 is the live handle, < 0 is minus the
 * last released handle, 0 means the cell was never handed out (or is being reclaimed). */
typedef struct {
    ef_counter value;
    _Atomic int64_t live;
} ef_cell;

_Static_assert(EF_CAPACITY == ((int64_t)1 << EF_INDEX_BITS), "EF_INDEX_BITS must match capacity");

static _Atomic(ef_cell *) ef_segments[EF_MAX_SEGMENTS];
static _Atomic int64_t ef_next_slot;

int64_t ef_abi_version(void) { return EF_ABI_VERSION; }
const char *ef_version(void) { return EF_VERSION_STRING; }
int64_t ef_max_value(void) { return EF_MAX; }
int64_t ef_capacity(void) { return EF_CAPACITY; }
int64_t ef_fail_code(void) { return EF_FAIL; }

/* The cell a handle points into (live or not), or NULL when its index has no segment.  Every
 * handle is >= EF_CAPACITY (generation >= 1), so negatives and bare indices are refused here. */
static inline ef_cell *ef_cell_at(int64_t slot) {
    if (slot < EF_CAPACITY) {
        return NULL;
    }
    int64_t index = slot & (EF_CAPACITY - 1);
    ef_cell *seg = atomic_load_explicit(&ef_segments[index / EF_SEGMENT_SIZE],
                                        memory_order_acquire);
    return seg == NULL ? NULL : &seg[index % EF_SEGMENT_SIZE];
}

/* The counter behind `slot`, or NULL unless `slot` is its cell's live handle. */
static inline ef_counter *ef_counter_at(int64_t slot) {
    ef_cell *cell = ef_cell_at(slot);
    if (cell == NULL || atomic_load_explicit(&cell->live, memory_order_acquire) != slot) {
        return NULL;
    }
    return &cell->value;
}

/* Make sure segment `index` exists.  Lock-free: whoever installs first wins, the loser frees. */
static int ef_ensure_segment(int64_t index) {
    if (atomic_load_explicit(&ef_segments[index], memory_order_acquire) != NULL) {
        return 1;
    }
    ef_cell *fresh = calloc(EF_SEGMENT_SIZE, sizeof(ef_cell));
    if (fresh == NULL) {
        return 0;
    }
    for (int64_t i = 0; i < EF_SEGMENT_SIZE; i++) {
        atomic_init(&fresh[i].value, 0);
        atomic_init(&fresh[i].live, 0);
    }
    ef_cell *expected = NULL;
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
    int64_t index = atomic_load(&ef_next_slot);
    do {
        if (index >= EF_CAPACITY) {
            return EF_ERR_NOMEM;
        }
    } while (!atomic_compare_exchange_weak(&ef_next_slot, &index, index + 1));
    if (!ef_ensure_segment(index / EF_SEGMENT_SIZE)) {
        return EF_ERR_NOMEM; /* the slot index is lost; only on out-of-memory */
    }
    int64_t handle = EF_CAPACITY | index; /* generation 1 */
    ef_cell *cell = ef_cell_at(handle);
    atomic_store(&cell->value, initial);
    atomic_store_explicit(&cell->live, handle, memory_order_release); /* publish last */
    return handle;
}

int64_t ef_release(int64_t slot) {
    ef_cell *cell = ef_cell_at(slot);
    int64_t expected = slot;
    if (cell == NULL || !atomic_compare_exchange_strong(&cell->live, &expected, -slot)) {
        return EF_ERR_SLOT;
    }
    return 0;
}

int64_t ef_reclaim(int64_t slot, int64_t initial) {
    ef_cell *cell = ef_cell_at(slot);
    if (cell == NULL || atomic_load(&cell->live) != -slot) {
        return EF_ERR_SLOT;
    }
    if (initial < 0 || initial > EF_MAX) {
        return EF_ERR_VALUE;
    }
    if (slot > INT64_MAX - EF_CAPACITY) {
        return EF_ERR_NOMEM; /* 2**39 generations of this cell used up: leave it retired */
    }
    /* Claim (-slot -> 0) so no one else can reclaim it, initialise, then publish the handle. */
    int64_t expected = -slot;
    if (!atomic_compare_exchange_strong(&cell->live, &expected, 0)) {
        return EF_ERR_SLOT;
    }
    int64_t handle = slot + EF_CAPACITY; /* same index, next generation */
    atomic_store(&cell->value, initial);
    atomic_store_explicit(&cell->live, handle, memory_order_release);
    return handle;
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
