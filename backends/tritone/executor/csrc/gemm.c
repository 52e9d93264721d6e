/* fp32 linear layers for the CPU: C[M, N] = A[M, K] @ W (+ bias), W packed in column panels.
 *
 * A decode step reads every weight once: hundreds of megabytes that never stay in cache, so
 * the GEMMs of serving wait on memory far more than on arithmetic, and a library GEMM tuned for
 * weights in cache runs well below its peak on them. Here each thread, while it works on one
 * panel, prefetches the next it will take, so streaming overlaps the arithmetic.
 *
 * Layout: panel p holds columns [16p, 16p + 16) as K rows of 16 floats (zero padded past N),
 * one 64-byte cache line per k. A 6 x 16 tile keeps twelve 8-float accumulators in registers
 * (the classic AVX2 register block: 12 accumulators, 2 weight vectors, 1 broadcast).
 *
 * bf16 (where the CPU has AVX512-BF16): A rounded to bf16, W packed in panels of 32 columns as
 * pairs of k (the operand layout of vdpbf16ps, which multiplies two bf16 pairs per fp32 lane),
 * sums in fp32. It takes the same panel scheme as the fp32 one below (one driver serves both).
 *
 * AMX (where the CPU has it): the bf16 panels and rows again, multiplied on tiles (gemm_amx.c).
 *
 * This file is the driver every kernel shares: the plan of row blocks and panel runs, threads
 * claiming runs, the entry points. The micro-kernels are in gemm_tiles.c and gemm_amx.c; the GEMM
 * reduced to each row's argmax as it goes is in gemm_argmax.c.
 *
 * Plain C with GCC/Clang vector extensions, no torch headers; threads from pool.c. */
#include <stddef.h>
#include <stdint.h>
#include "bf16.h"
#include "gemm.h"
#include "kernels.h"

/* 1 where gemm_bf16 and gemm_bf16_argmax run here (built for a CPU with AVX512-BF16). */
int gemm_bf16_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const float *x;
    uint16_t *out;
    int K;
} ToBf16;

static void to_bf16_row(void *job_, int64_t m) {
    const ToBf16 *job = job_;
    const int K = job->K;
    f32_to_bf16_gemm_row(job->x + (size_t)m * K, job->out + (size_t)m * (K + (K & 1)), K);
}

/* x [M, K] float32 into out [M, K rounded up to even] bf16, rounded to nearest even, the pad
 * column zero: gemm_bf16's A. */
void to_bf16_rows(const float *x, uint16_t *out, int M, int K, int num_threads) {
    ToBf16 job = {x, out, K};
    pool_for(M, 8, to_bf16_row, &job, num_threads);
}

const Kernel *gemm_bf16_kernel(int amx, int K) {
#if defined(HAVE_AMX)
    if (amx && K % 32 == 0 && gemm_bf16_amx_supported()) return &gemm_kernel_amx;
#endif
    (void)amx, (void)K;
#if defined(__AVX512BF16__)
    return &gemm_kernel_bf16;
#else
    return 0;
#endif
}

/* Rows are taken in blocks of about A_BLOCK_BYTES of A, every panel for one block before the
 * next: a panel's passes then read their rows of A from the core's own L2 rather than all of A
 * from the shared L3, at the price of reading each weight once per block (from L3, or memory
 * for weights larger than it). Blocks of 192 KB measured best of 96 to 320 KB (fp32: a decode
 * step's 121 linears, cold weights, 2 threads: 128 rows 231 -> 209 ms, 512 rows 855 -> 800 ms;
 * 32 rows, one block, unchanged). */
#define A_BLOCK_BYTES (192 << 10)

/* Rows per block: about A_BLOCK_BYTES of A, whole tiles of mr, at most M. */
static int rows_per_block(int M, size_t row_bytes, int mr) {
    int mc = (int)(A_BLOCK_BYTES / row_bytes) / mr * mr;
    if (mc < mr) mc = mr;
    return mc > M ? M : mc;
}

Plan gemm_plan(const Kernel *kn, int M, int K, int N) {
    Plan p = {kn, M, K, N};
    p.Kp = (K + kn->k_pad - 1) / kn->k_pad * kn->k_pad;
    p.P = (N + kn->nr - 1) / kn->nr;
    /* A linear of few panels (576 or 960 columns: 18 or 30) in runs of four left one thread a run
     * more than the other: claimed one at a time, two threads, 32 rows, 576 x 576 364 -> 400
     * GFLOP/s, 1536 x 576 373 -> 409, 576 x 960 381 -> 401 (128 rows: 379 -> 417, 395 -> 418).
     * A row or a few cost so little a panel that the claims would show (one row, 576 x 576: 71
     * -> 65). */
    p.chunk = p.P < 16 * CHUNK && M >= 8 ? 1 : CHUNK;
    p.chunks = (p.P + p.chunk - 1) / p.chunk;
    p.a_row_bytes = (size_t)p.Kp * kn->elem;
    p.panel_bytes = (size_t)p.Kp * kn->nr * kn->elem;
    p.mc = rows_per_block(M, p.a_row_bytes, kn->mr);
    p.items = (M + p.mc - 1) / p.mc * p.chunks;
    return p;
}

void gemm_run_item(const Plan *pl, const void *a, const void *panels, const float *bias, float *c, int ldc,
                   int item, int next_item, void (*per_panel)(void *, int p, int m0, int mb, int ncols), void *ctx) {
    const int chunk = item % pl->chunks, m0 = item / pl->chunks * pl->mc;
    const int mb = pl->M - m0 < pl->mc ? pl->M - m0 : pl->mc;
    const int end = (chunk + 1) * pl->chunk < pl->P ? (chunk + 1) * pl->chunk : pl->P;
    const int nr = pl->kn->nr;
    if (pl->kn->begin) pl->kn->begin();
    for (int p = chunk * pl->chunk; p < end; p++) {
        const int q = panel_after(pl, p, end, next_item);
        const char *panel = (const char *)panels + (size_t)p * pl->panel_bytes;
        const char *next = q < pl->P ? (const char *)panels + (size_t)q * pl->panel_bytes : 0;
        const int ncols = pl->N - p * nr < nr ? pl->N - p * nr : nr;
        float *dst = per_panel ? c : c + (size_t)m0 * ldc + (size_t)p * nr;
        pl->kn->rows((const char *)a + (size_t)m0 * pl->a_row_bytes, mb, pl->K, ldc, panel, dst, ncols,
                     bias ? bias + (size_t)p * nr : 0, next);
        if (per_panel) per_panel(ctx, p, m0, mb, ncols);
    }
}

typedef struct {
    Plan pl;
    const void *a, *panels;
    const float *bias;
    float *c;
    int counter;
} GemmJob;

static void gemm_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    GemmJob *job = job_;
    int item = pool_next(&job->counter);
    while (item < job->pl.items) {
        const int next_item = pool_next(&job->counter);
        gemm_run_item(&job->pl, job->a, job->panels, job->bias, job->c, job->pl.N, item, next_item, 0, 0);
        item = next_item;
    }
}

/* Threads take runs of panels (CHUNK, or one) from a shared counter rather than fixed halves: on
 * a machine where the server's other processes share the engine's cores, a thread that the
 * kernel preempts would otherwise leave its partner waiting at the end of every GEMM for the rest
 * of its half.
 * Each thread claims its next run before computing the current one, so that it knows what to
 * prefetch. */
static void gemm_run(const Kernel *kn, const void *a, const void *panels, const float *bias, float *c, int M, int K,
                     int N, int num_threads) {
    if (M <= 0) return;
    GemmJob job = {gemm_plan(kn, M, K, N), a, panels, bias, c, 0};
    pool_run(gemm_part, &job, num_threads);
}

/* a: [M, K], panels: ceil(N / 16) x K x 16 floats, bias: [N] or NULL, c: [M, N]; all contiguous. */
void gemm_f32(const float *a, const float *panels, const float *bias, float *c, int M, int K, int N,
              int num_threads) {
    gemm_run(&gemm_kernel_f32, a, panels, bias, c, M, K, N, num_threads);
}

/* a: [M, K rounded up to even] bf16 (to_bf16_rows), panels: ceil(N / 32) x ceil(K / 2) x 32 x 2
 * bf16 (panel p, pair row k, column j: W[2k, 32p + j], W[2k + 1, 32p + j], zero padded), bias:
 * [N] float32 or NULL, c: [M, N] float32. Nothing where gemm_bf16_supported() is 0. */
void gemm_bf16(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
               int num_threads) {
    const Kernel *kn = gemm_bf16_kernel(0, K);
    if (kn) gemm_run(kn, a, panels, bias, c, M, K, N, num_threads);
}

/* gemm_bf16 on AMX tiles (same operands); gemm_bf16's kernel where K % 32 or AMX is missing. */
void gemm_bf16_amx(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
                   int num_threads) {
    const Kernel *kn = gemm_bf16_kernel(1, K);
    if (kn) gemm_run(kn, a, panels, bias, c, M, K, N, num_threads);
}
