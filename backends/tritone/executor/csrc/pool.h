/* The kernels' threads (pool.c). */
#ifndef TRITONE_POOL_H
#define TRITONE_POOL_H

#include <stdint.h>

/* Runs fn(ctx, thread, num_threads) for thread = 0 .. num_threads - 1, thread 0 on the caller,
 * and returns when every call has returned: on the pool's threads inside a native forward pass
 * (pool_warm_begin), else on OpenMP's team. fn takes its work from a shared counter (pool_next),
 * never a share fixed by thread, so that it does all of it whatever num_threads it gets: a call
 * made while the pool is busy (from another thread, or from inside fn) runs fn once on the
 * caller, with num_threads 1. */
void pool_run(void (*fn)(void *ctx, int thread, int num_threads), void *ctx, int num_threads);

/* body(ctx, i) for i in [0, n), the indices taken in chunks from a shared counter; on the caller
 * alone where n < min_parallel. */
void pool_for(int64_t n, int64_t min_parallel, void (*body)(void *ctx, int64_t i), void *ctx, int num_threads);

/* Around a native forward pass, whose sections then run on the pool. */
void pool_warm_begin(void);
void pool_warm_end(void);

/* The next index of a shared counter, for fn's that take their work items from one. */
static inline int pool_next(int *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

#endif
