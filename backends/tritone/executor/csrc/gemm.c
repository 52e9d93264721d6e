/* fp32 linear layers for the CPU: C[M, N] = A[M, K] @ W (+ bias), W packed in column panels.
 *
 * A decode step reads every weight once: hundreds of megabytes that never stay in cache, so
 * the GEMMs of serving wait on memory far more than on arithmetic. Measured on a 2-core AMD
 * EPYC (AVX2): oneDNN on prepacked weights reached 87 GFLOP/s per core on a weight already in
 * cache at 32 rows but 55 on one streamed from memory, and MKL's single-row GEMV about half the
 * memory bandwidth. Here each thread, while it works on one panel, prefetches the next it will
 * take, so streaming overlaps the arithmetic.
 *
 * Layout: panel p holds columns [16p, 16p + 16) as K rows of 16 floats (zero padded past N),
 * one 64-byte cache line per k. A 6 x 16 tile keeps twelve 8-float accumulators in registers
 * (the classic AVX2 register block: 12 accumulators, 2 weight vectors, 1 broadcast).
 *
 * Plain C with GCC/Clang vector extensions, no torch headers; OpenMP threads come from the
 * process's libgomp, which is torch's own once torch is loaded. */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

#define NR 16
#define MR 6
/* Panels per claim: runs long enough to stream from memory in order, short enough that the
 * threads finish together. */
#define CHUNK 4

/* Rows [0, mr) of A times one panel (K x 16) into c. `next`, when set, is the panel computed
 * after this one: this pass prefetches its lines pf_first, pf_first + pf_step, ..., one per k
 * row it reaches, so that the panel's passes over row tiles together fetch it all, evenly over
 * the time they take (fetched in the first pass alone, it came in a burst that the memory
 * could not deliver in time: batch-32 linears of a decode step took 70 ms, 60 ms spread). */
static inline __attribute__((always_inline)) void tile(const float *a, int K, const float *panel, float *c,
                                                       int ldc, int ncols, const float *bias, int mr,
                                                       const float *next, int pf_first, int pf_step) {
    v8 acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = (v8){0};
        acc[r][1] = (v8){0};
    }
    int pf = next ? pf_first : K;
    for (int k = 0; k < K; k++) {
        const v8 b0 = *(const v8 *)(panel + (size_t)k * NR);
        const v8 b1 = *(const v8 *)(panel + (size_t)k * NR + 8);
        if (k == pf) {
            __builtin_prefetch(next + (size_t)k * NR, 0, 3);
            pf += pf_step;
        }
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                const float s = a[(size_t)r * K + k];
                const v8 av = {s, s, s, s, s, s, s, s};
                acc[r][0] += av * b0;
                acc[r][1] += av * b1;
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float *out = c + (size_t)r * ldc;
        if (ncols == NR) { /* a whole panel's row: two vector stores, not sixteen scalar ones */
            *(v8 *)out = bias ? acc[r][0] + *(const v8 *)bias : acc[r][0];
            *(v8 *)(out + 8) = bias ? acc[r][1] + *(const v8 *)(bias + 8) : acc[r][1];
            continue;
        }
        float row[NR];
        *(v8 *)row = acc[r][0];
        *(v8 *)(row + 8) = acc[r][1];
        if (bias)
            for (int j = 0; j < ncols; j++) out[j] = row[j] + bias[j];
        else
            for (int j = 0; j < ncols; j++) out[j] = row[j];
    }
}

/* Each case is its own copy of `tile` with a constant row count, fully unrolled. */
#define TILE(n) tile(a + (size_t)m * K, K, panel, c + (size_t)m * N, N, ncols, bias, n, next, m / MR, tiles)

static void panel_rows(const float *a, int M, int K, int N, const float *panel, float *c, int ncols,
                       const float *bias, const float *next) {
    const int tiles = (M + MR - 1) / MR;
    int m = 0;
    for (; m + MR <= M; m += MR) TILE(MR);
    switch (M - m) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    }
}

/* a: [M, K], panels: ceil(N / 16) x K x 16 floats, bias: [N] or NULL, c: [M, N]; all contiguous.
 *
 * Threads take runs of CHUNK panels from a shared counter rather than fixed halves: on a machine
 * where the server's other processes share the engine's cores, a thread that the kernel preempts
 * would otherwise leave its partner waiting at the end of every GEMM for the rest of its half.
 * Each thread claims its next run before computing the current one, so that it knows what to
 * prefetch.
 *
 * Rows are taken in blocks of about A_BLOCK_BYTES of A, every panel for one block before the
 * next: a panel's passes then read their rows of A from the core's own L2 rather than all of A
 * from the shared L3, at the price of reading each weight once per block (from L3, or memory
 * for weights larger than it). Blocks of 192 KB measured best of 96 to 320 KB (a decode step's
 * 121 linears, cold weights, 2 threads: 128 rows 231 -> 209 ms, 512 rows 855 -> 800 ms;
 * 32 rows, one block, unchanged). */
#define A_BLOCK_BYTES (192 << 10)

/* Rows per block: about A_BLOCK_BYTES of A, whole tiles, at most M. */
static int rows_per_block(int M, int K) {
    int mc = A_BLOCK_BYTES / (K * (int)sizeof(float)) / MR * MR;
    if (mc < MR) mc = MR;
    return mc > M ? M : mc;
}

/* The panel a thread computes after panel p of its run [.., end): the next in the run, else the
 * first of its next item's run, else P (none). */
static inline int panel_after(int p, int end, int next_item, int items, int chunks, int P) {
    return p + 1 < end ? p + 1 : next_item < items ? next_item % chunks * CHUNK : P;
}

void gemm_f32(const float *a, const float *panels, const float *bias, float *c, int M, int K, int N,
              int num_threads) {
    if (M <= 0) return;
    const int P = (N + NR - 1) / NR;
    const int chunks = (P + CHUNK - 1) / CHUNK;
    const int mc = rows_per_block(M, K);
    const int items = (M + mc - 1) / mc * chunks; /* item i: run i % chunks of rows block i / chunks */
    int counter = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
        while (item < items) {
            const int next_item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
            const int chunk = item % chunks, m0 = item / chunks * mc, mb = M - m0 < mc ? M - m0 : mc;
            const int end = (chunk + 1) * CHUNK < P ? (chunk + 1) * CHUNK : P;
            for (int p = chunk * CHUNK; p < end; p++) {
                /* the panel this thread computes next: the following one, or its next run's first */
                const int q = panel_after(p, end, next_item, items, chunks, P);
                const float *panel = panels + (size_t)p * K * NR;
                const float *next = q < P ? panels + (size_t)q * K * NR : 0;
                const int ncols = N - p * NR < NR ? N - p * NR : NR;
                panel_rows(a + (size_t)m0 * K, mb, K, N, panel, c + (size_t)m0 * N + p * NR, ncols,
                           bias ? bias + p * NR : 0, next);
            }
            item = next_item;
        }
    }
}

/* Folds rows [0, mb) of a panel's product (buf, rows of NR, the first ncols valid; column col0
 * first) into each row's running maximum and its column. Strictly greater: the first of equal
 * values stays, and NaN is never taken. */
static void fold_max(const float *buf, int mb, int ncols, int col0, float *best, int32_t *best_col) {
    for (int r = 0; r < mb; r++) {
        const float *row = buf + (size_t)r * NR;
        float m = best[r];
        if (ncols == NR) { /* mostly nothing beats the row's maximum so far: one vector test */
            const v8 mv = {m, m, m, m, m, m, m, m};
            const v8i greater = (*(const v8 *)row > mv) | (*(const v8 *)(row + 8) > mv);
            int any = 0;
            for (int lane = 0; lane < 8; lane++) any |= greater[lane];
            if (!any) continue;
        }
        int32_t col = best_col[r];
        for (int j = 0; j < ncols; j++)
            if (row[j] > m) {
                m = row[j];
                col = col0 + j;
            }
        best[r] = m;
        best_col[r] = col;
    }
}

/* out[m] = argmax over n of (A @ W)[m, n], with `gemm_f32`'s arithmetic (so the values compared
 * are the ones gemm_f32 would write) but without writing the product: a greedy step's logits
 * are [rows, vocab], 50 MB at 256 rows of a 49,152-token vocabulary, written by the LM head
 * and read back by the argmax. Ties go to the lowest index and NaN is never chosen, as
 * argmax_rows; a row with nothing above -inf gets 0. Returns -1 where scratch cannot be
 * allocated. */
int gemm_f32_argmax(const float *a, const float *panels, int64_t *out, int M, int K, int N, int num_threads) {
    if (M <= 0) return 0;
    const int P = (N + NR - 1) / NR;
    const int chunks = (P + CHUNK - 1) / CHUNK;
    const int mc = rows_per_block(M, K);
    const int items = (M + mc - 1) / mc * chunks;
    /* Each item's rows' maximum over its run of panels: [chunks, M], merged in column order. */
    float *part = malloc(sizeof(float) * (size_t)M * chunks);
    int32_t *part_col = malloc(sizeof(int32_t) * (size_t)M * chunks);
    int failed = !part || !part_col, counter = 0;
    if (!failed) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            /* the product of one panel and a block of rows, then the block's running maxima */
            float *buf = malloc(sizeof(float) * (size_t)mc * (NR + 1) + sizeof(int32_t) * (size_t)mc);
            float *best = buf + (size_t)mc * NR;
            int32_t *best_col = (int32_t *)(best + mc);
            int item = buf ? __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED) : items;
            failed |= !buf;
            while (item < items) {
                const int next_item = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
                const int chunk = item % chunks, m0 = item / chunks * mc, mb = M - m0 < mc ? M - m0 : mc;
                const int end = (chunk + 1) * CHUNK < P ? (chunk + 1) * CHUNK : P;
                for (int r = 0; r < mb; r++) {
                    best[r] = -INFINITY;
                    best_col[r] = -1;
                }
                for (int p = chunk * CHUNK; p < end; p++) {
                    const int q = panel_after(p, end, next_item, items, chunks, P);
                    const float *panel = panels + (size_t)p * K * NR;
                    const float *next = q < P ? panels + (size_t)q * K * NR : 0;
                    const int ncols = N - p * NR < NR ? N - p * NR : NR;
                    panel_rows(a + (size_t)m0 * K, mb, K, NR, panel, buf, ncols, 0, next);
                    fold_max(buf, mb, ncols, p * NR, best, best_col);
                }
                memcpy(part + (size_t)chunk * M + m0, best, sizeof(float) * mb);
                memcpy(part_col + (size_t)chunk * M + m0, best_col, sizeof(int32_t) * mb);
                item = next_item;
            }
            free(buf);
        }
    }
    if (!failed)
        for (int r = 0; r < M; r++) {
            float m = -INFINITY;
            int32_t col = -1;
            for (int ch = 0; ch < chunks; ch++)
                if (part[(size_t)ch * M + r] > m) {
                    m = part[(size_t)ch * M + r];
                    col = part_col[(size_t)ch * M + r];
                }
            out[r] = col < 0 ? 0 : col;
        }
    free(part);
    free(part_col);
    return failed ? -1 : 0;
}
