/*
 * stress_counters.c -- threads hammering the counter core, for ThreadSanitizer/ASan/UBSan.
 *
 * Built by tests/test_build.py together with effectfence_counters.c.  Each round:
 *   - every thread allocates slots (forcing concurrent segment growth and install races), then
 *     releases and reclaims each: the old handle must be dead, the new one live at its value,
 *   - every thread reserves on one shared hot counter; the values must be unique and gapless,
 *   - every thread races advance_if on one expected value; exactly one must win per trial,
 *   - every thread raises a shared counter with fetch_max; the result must be the maximum.
 * Exit status 0 means every check held; sanitizer reports make the run fail on their own.
 */
#include "effectfence_counters.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#define THREADS 8
#define RESERVES 20000
#define TRIALS 2000
#define ALLOCS 3000

static int64_t hot_slot;
static int64_t race_slot;
static int64_t max_slot;
static int64_t seen[THREADS][RESERVES];
static _Atomic int winners[TRIALS];
static _Atomic int trial_go[TRIALS];
static _Atomic int failures;

static void fail(const char *what) {
    fprintf(stderr, "stress: %s\n", what);
    atomic_fetch_add(&failures, 1);
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    for (int i = 0; i < ALLOCS; i++) {
        int64_t s = ef_alloc_slot(i);
        if (s < 0 || ef_load(s) != i || ef_reserve(s) != i + 1) {
            fail("alloc_slot/load/reserve on a fresh slot");
            break;
        }
        int64_t again = ef_release(s) == 0 ? ef_reclaim(s, i) : EF_ERR_SLOT;
        if (again < 0 || again == s || ef_load(again) != i || ef_load(s) != EF_ERR_SLOT ||
            ef_reserve(s) != EF_ERR_SLOT) {
            fail("release/reclaim: the old handle must be dead, the new one live");
            break;
        }
    }
    for (int i = 0; i < RESERVES; i++) {
        seen[id][i] = ef_reserve(hot_slot);
    }
    for (int t = 0; t < TRIALS; t++) {
        /* Wait until thread 0 opened the trial, then race on expected == t. */
        while (!atomic_load(&trial_go[t])) {
            sched_yield(); /* 2-core CI machines: let the opener run */
        }
        int64_t r = ef_advance_if(race_slot, t);
        if (r == t + 1) {
            atomic_fetch_add(&winners[t], 1);
        } else if (r >= 0 || -r - 1 < t + 1) {
            fail("advance_if lost but reported a value that cannot be current");
        }
        if (id == 0 && t + 1 < TRIALS) {
            while (ef_load(race_slot) != t + 1) {
                sched_yield();
            }
            atomic_store(&trial_go[t + 1], 1);
        }
    }
    for (int i = 0; i < 1000; i++) {
        ef_fetch_max(max_slot, (int64_t)id * 1000 + i);
    }
    return NULL;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(void) {
    hot_slot = ef_alloc_slot(0);
    race_slot = ef_alloc_slot(0);
    max_slot = ef_alloc_slot(0);
    if (hot_slot < 0 || race_slot < 0 || max_slot < 0) {
        fprintf(stderr, "stress: initial allocation failed\n");
        return 2;
    }
    atomic_store(&trial_go[0], 1);
    /* pthreads, not C11 <threads.h>: ThreadSanitizer does not intercept thrd_create. */
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        if (pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)i) != 0) {
            fprintf(stderr, "stress: pthread_create failed\n");
            return 2;
        }
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
    }
    static int64_t all[THREADS * RESERVES];
    for (int i = 0; i < THREADS; i++) {
        for (int j = 0; j < RESERVES; j++) {
            all[i * RESERVES + j] = seen[i][j];
        }
    }
    qsort(all, THREADS * RESERVES, sizeof(int64_t), cmp64);
    for (int64_t i = 0; i < THREADS * RESERVES; i++) {
        if (all[i] != i + 1) {
            fail("reserve values are not unique and gapless");
            break;
        }
    }
    for (int t = 0; t < TRIALS; t++) {
        if (atomic_load(&winners[t]) != 1) {
            fail("advance_if trial without exactly one winner");
            break;
        }
    }
    if (ef_load(max_slot) != (int64_t)(THREADS - 1) * 1000 + 999) {
        fail("fetch_max did not keep the maximum");
    }
    /* Edges: refused operations change nothing. */
    int64_t edge = ef_alloc_slot(ef_max_value());
    if (ef_reserve(edge) != EF_ERR_OVERFLOW || ef_load(edge) != ef_max_value() ||
        ef_advance_if(edge, ef_max_value()) != ef_fail_code() || ef_load(-1) != EF_ERR_SLOT ||
        ef_reserve(ef_capacity() - 1) != EF_ERR_SLOT || /* a bare index is never a handle */
        ef_reserve(edge + ef_capacity()) != EF_ERR_SLOT || /* a generation not handed out */
        ef_reserve(INT64_MAX) != EF_ERR_SLOT) {
        fail("edge cases");
    }
    /* A released handle is refused by every call and cannot be released or reclaimed twice. */
    int64_t old = ef_alloc_slot(5);
    if (ef_release(old) != 0 || ef_release(old) != EF_ERR_SLOT || ef_load(old) != EF_ERR_SLOT ||
        ef_reserve(old) != EF_ERR_SLOT || ef_advance_if(old, 5) != ef_fail_code() ||
        ef_compare_exchange(old, 5, 6) != ef_fail_code() || ef_fetch_max(old, 9) != EF_ERR_SLOT) {
        fail("a released handle still works");
    }
    int64_t renewed = ef_reclaim(old, 7);
    if (renewed < 0 || ef_load(renewed) != 7 || ef_load(old) != EF_ERR_SLOT ||
        ef_reclaim(old, 0) != EF_ERR_SLOT || ef_reclaim(renewed, 0) != EF_ERR_SLOT) {
        fail("reclaim");
    }
    int n = atomic_load(&failures);
    printf("stress: %s (%d threads, %lld slots allocated)\n", n ? "FAILED" : "ok", THREADS,
           (long long)(THREADS * ALLOCS + 5));
    return n ? 1 : 0;
}
