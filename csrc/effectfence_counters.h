/*
 * effectfence_counters.h -- a lock-free table of 64-bit sequence counters (C11 <stdatomic.h>).
 *
 * Counters live in a segmented array: EF_MAX_SEGMENTS pointers to segments of EF_SEGMENT_SIZE
 * `_Atomic int64_t`.  A segment is allocated the first time a slot in it is handed out and is
 * installed with a compare-exchange on its (atomic) pointer; the loser of that race frees its
 * allocation.  Growth only adds segments, so a counter never moves.  There is no mutex anywhere.
 *
 * A *slot* is a handle, not a bare index: (generation << EF_INDEX_BITS) | index, generation >= 1,
 * so every handle is >= EF_CAPACITY and small integers are never slots.  Each cell records the
 * handle it is currently lent under; every operation refuses (EF_ERR_SLOT) a handle that is not
 * the cell's live one: never handed out, out of range, or released.  Releasing a handle and
 * reclaiming its cell gives the cell a new generation, so a stale handle stays dead even after
 * its index is reused (by any table of the process).  The check is one load from the cell's
 * cache line.  It is a liveness check, not a table check: the counter calls do not know which
 * Python table they are called through.
 *
 * Values are non-negative and never exceed EF_MAX_VALUE (2**63 - 2): an operation that would
 * store a larger value is refused, so a counter never wraps and every failure code below stays
 * distinct from every value.
 *
 * This is plain C11 with no Python dependency, so tests/test_build.py can compile it into a
 * threaded stress driver under ThreadSanitizer and AddressSanitizer.  The Python-facing shim
 * lives in effectfence_binding.h.
 */
#ifndef EFFECTFENCE_COUNTERS_H
#define EFFECTFENCE_COUNTERS_H

#include <stdint.h>

/* Bumped whenever a signature or a return code below changes meaning; checked at import.
 * 2: slots are generation-tagged handles; ef_release/ef_reclaim replace ef_store. */
#define EF_ABI_VERSION 2
#define EF_SEGMENT_SIZE 1024
#define EF_MAX_SEGMENTS 16384
/* log2(EF_SEGMENT_SIZE * EF_MAX_SEGMENTS): the low bits of a handle are the cell index. */
#define EF_INDEX_BITS 24

/* Return codes (all negative; never a counter value). */
#define EF_ERR_SLOT -1      /* not a live slot handle (never handed out, or released) */
#define EF_ERR_OVERFLOW -2  /* the result would exceed EF_MAX_VALUE */
#define EF_ERR_VALUE -3     /* an argument is outside [0, EF_MAX_VALUE] */
#define EF_ERR_NOMEM -4     /* segment allocation failed or the table is full */

int64_t ef_abi_version(void);
const char *ef_version(void);
int64_t ef_max_value(void);
int64_t ef_capacity(void);
int64_t ef_fail_code(void);

/* Hand out a never-used cell, initialised to `initial`: its live handle (>= EF_CAPACITY), or
 * EF_ERR_NOMEM / EF_ERR_VALUE. */
int64_t ef_alloc_slot(int64_t initial);
/* Retire a live handle: every later call with it gets EF_ERR_SLOT.  0, or EF_ERR_SLOT if it was
 * not live.  The caller guarantees no other thread still operates on it. */
int64_t ef_release(int64_t slot);
/* Lend the cell of a released handle out again, initialised to `initial`, under a new handle
 * (next generation).  The new handle, or EF_ERR_SLOT (`slot` is not the cell's last released
 * handle), EF_ERR_VALUE, or EF_ERR_NOMEM (the cell's generations are used up). */
int64_t ef_reclaim(int64_t slot, int64_t initial);
/* Every call below returns EF_ERR_SLOT (or ef_fail_code()) for a handle that is not live. */
/* Current value (>= 0) or EF_ERR_SLOT. */
int64_t ef_load(int64_t slot);
/* Atomic increment: the NEW value (>= 1), or EF_ERR_SLOT / EF_ERR_OVERFLOW. */
int64_t ef_reserve(int64_t slot);
/* Fused compare-and-increment.  If the value is `expected`, store expected + 1 and return it
 * (>= 1); otherwise return -(current + 1), which is always <= -1.  Errors (bad slot, expected
 * out of range or at EF_MAX_VALUE) return ef_fail_code() == INT64_MIN, which no failure result
 * can equal because current <= EF_MAX_VALUE. */
int64_t ef_advance_if(int64_t slot, int64_t expected);
/* Strong compare-exchange; returns the value observed before (== expected iff it swapped),
 * or ef_fail_code() on a bad slot / out-of-range argument. */
int64_t ef_compare_exchange(int64_t slot, int64_t expected, int64_t desired);
/* Atomic max: raise the value to at least `value`; returns the value observed before, or a
 * negative code. */
int64_t ef_fetch_max(int64_t slot, int64_t value);

#endif /* EFFECTFENCE_COUNTERS_H */
