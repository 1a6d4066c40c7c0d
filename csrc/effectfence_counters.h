/*
 * effectfence_counters.h -- a lock-free table of 64-bit sequence counters (C11 <stdatomic.h>).
 *
 * Counters live in a segmented array: EF_MAX_SEGMENTS pointers to segments of EF_SEGMENT_SIZE
 * `_Atomic int64_t`.  A segment is allocated the first time a slot in it is handed out and is
 * installed with a compare-exchange on its (atomic) pointer; the loser of that race frees its
 * allocation.  Growth only adds segments, so a counter never moves and a slot index stays valid
 * for the life of the process.  There is no mutex anywhere.
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

/* Bumped whenever a signature or a return code below changes meaning; checked at import. */
#define EF_ABI_VERSION 1
#define EF_SEGMENT_SIZE 1024
#define EF_MAX_SEGMENTS 16384

/* Return codes (all negative; never a counter value). */
#define EF_ERR_SLOT -1      /* slot index out of range or never allocated */
#define EF_ERR_OVERFLOW -2  /* the result would exceed EF_MAX_VALUE */
#define EF_ERR_VALUE -3     /* an argument is outside [0, EF_MAX_VALUE] */
#define EF_ERR_NOMEM -4     /* segment allocation failed or the table is full */

int64_t ef_abi_version(void);
const char *ef_version(void);
int64_t ef_max_value(void);
int64_t ef_capacity(void);
int64_t ef_fail_code(void);

/* Hand out a never-used slot, initialised to `initial`; >= 0 or EF_ERR_NOMEM / EF_ERR_VALUE. */
int64_t ef_alloc_slot(int64_t initial);
/* Plain store (re-initialising a recycled slot); 0 or a negative code. */
int64_t ef_store(int64_t slot, int64_t value);
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
