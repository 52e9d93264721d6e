/* The kernels' threads: the caller and persistent workers, and a wait that yields its core.
 *
 * A forward pass runs some 300 short parallel sections per step (each GEMM, each layer's
 * attention and elementwise work), on cores the engine shares with the server's other processes
 * (the detokenizers, the server, the client). OpenMP's threads, between sections, spin briefly and
 * then sleep in the kernel: when one of those processes preempts one thread, its partner sleeps,
 * and every later section pays a wake-up of the sleeper (tens of microseconds on a virtual
 * machine) while the core it left stays idle. Spinning longer keeps the threads awake but takes
 * the cores from the server's processes when they have the most to do.
 *
 * Here a waiting thread spins for a few microseconds, then yields its core (sched_yield) between
 * looks: another process that wants the core gets it at once, and when none does the thread
 * sees its next section without a wake-up. A worker sleeps (futex) only after a couple of
 * milliseconds with no work, so that an idle server uses no CPU.
 *
 * The pool runs the sections of a native forward pass, and the sampler's kernels right after one
 * (pool_warm_begin / pool_warm_end: kernels.pool_threads); other calls go to OpenMP's team.
 * Where the kernels run one GEMM at a time between torch's own ops (the torch forward path),
 * workers of the pool's own would either take the cores from torch's OpenMP threads (yielding)
 * or pay a wake-up per GEMM (sleeping). */
#define _GNU_SOURCE
#include "kernels.h"

#include <limits.h>
#include <omp.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
/* A waiter spins this long before yielding: sections follow each other within microseconds. */
#define SPIN_NS 20000
/* A worker yields this long before it sleeps: a step's Python between two forward passes. */
#define SLEEP_NS 2000000

typedef void (*pool_fn)(void *ctx, int thread, int num_threads);

/* One job at a time: taken with trylock, so that a busy pool runs a second caller's job serially. */
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int num_workers;
static unsigned start_gen[MAX_WORKERS + 1]; /* the generation a worker was started at */
/* The current job, bumped for each one (and the futex sleeping workers wait on). */
static unsigned generation;
static int sleepers;
/* Written before `generation` is bumped; read by workers after they see it change. */
static pool_fn job_fn;
static void *job_ctx;
static int job_threads;
/* Workers yet to finish the current job (every worker, part of it or not, counts down once). */
static int pending;
/* Native forward passes (or the sampling after one) under way (pool_warm_begin): the pool runs
 * only their sections. */
static int warm_depth;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spins, then yields, until *word != value (worker: also sleeps after SLEEP_NS). Returns *word. */
static unsigned wait_change(const unsigned *word, unsigned value, int may_sleep) {
    const int64_t start = now_ns();
    for (int i = 1;; i++) {
        const unsigned now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (now != value) return now;
        if (i % 64) {
            relax();
            continue;
        }
        const int64_t waited = now_ns() - start;
        if (waited < SPIN_NS) continue;
        if (!may_sleep || waited < SLEEP_NS) {
            sched_yield();
            continue;
        }
        /* Either the master sees this sleeper after its bump, or the futex sees the new value. */
        __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == value)
            syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
        __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned seen = start_gen[id];
    for (;;) {
        seen = wait_change(&generation, seen, 1);
        if (id < job_threads) job_fn(job_ctx, id, job_threads);
        __atomic_fetch_sub(&pending, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* A forked child has none of its parent's workers. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&busy, NULL);
    num_workers = sleepers = pending = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* Starts workers up to `wanted`; returns how many there are. Signals stay with the process's
 * other threads. */
static int start_workers(int wanted) {
    if (num_workers >= wanted) return num_workers;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (num_workers < wanted) {
        pthread_t t;
        start_gen[num_workers + 1] = generation;
        if (pthread_create(&t, &attr, worker, (void *)(intptr_t)(num_workers + 1))) break;
        num_workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return num_workers;
}

void pool_run(pool_fn fn, void *ctx, int num_threads) {
    if (num_threads > 1 && !__atomic_load_n(&warm_depth, __ATOMIC_RELAXED)) {
        /* Outside a native forward pass the kernels run one at a time between torch's own ops
         * (the torch forward path, its sampler): there torch's OpenMP team, which those ops keep
         * awake, runs them; a second set of threads only took its cores (above). */
#pragma omp parallel num_threads(num_threads)
        fn(ctx, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    if (num_threads > MAX_WORKERS + 1) num_threads = MAX_WORKERS + 1;
    if (num_threads > 1) pthread_once(&once, register_fork_handler);
    if (num_threads <= 1 || pthread_mutex_trylock(&busy)) {
        fn(ctx, 0, 1); /* every fn takes its work from a shared counter: one call does it all */
        return;
    }
    const int workers = start_workers(num_threads - 1);
    if (workers + 1 < num_threads) num_threads = workers + 1;
    job_fn = fn;
    job_ctx = ctx;
    job_threads = num_threads;
    __atomic_store_n(&pending, workers, __ATOMIC_RELAXED);
    __atomic_fetch_add(&generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    fn(ctx, 0, num_threads);
    int left;
    while ((left = __atomic_load_n(&pending, __ATOMIC_ACQUIRE)) != 0)
        wait_change((const unsigned *)&pending, (unsigned)left, 0);
    pthread_mutex_unlock(&busy);
}

void pool_warm_begin(void) { __atomic_fetch_add(&warm_depth, 1, __ATOMIC_RELAXED); }

void pool_warm_end(void) { __atomic_fetch_sub(&warm_depth, 1, __ATOMIC_RELAXED); }

typedef struct {
    void (*body)(void *ctx, int64_t i);
    void *ctx;
    int64_t n, chunk, next;
} ForJob;

static void for_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    ForJob *job = job_;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next, job->chunk, __ATOMIC_RELAXED);
        if (begin >= job->n) return;
        const int64_t end = begin + job->chunk < job->n ? begin + job->chunk : job->n;
        for (int64_t i = begin; i < end; i++) job->body(job->ctx, i);
    }
}

void pool_for(int64_t n, int64_t min_parallel, void (*body)(void *ctx, int64_t i), void *ctx, int num_threads) {
    if (n < min_parallel || num_threads <= 1 || n < 2) {
        for (int64_t i = 0; i < n; i++) body(ctx, i);
        return;
    }
    if (num_threads > n) num_threads = (int)n;
    /* Chunks small enough that a thread the kernel preempts holds little of the work. */
    int64_t chunk = n / ((int64_t)num_threads * 4);
    ForJob job = {body, ctx, n, chunk > 0 ? chunk : 1, 0};
    pool_run(for_part, &job, num_threads);
}
