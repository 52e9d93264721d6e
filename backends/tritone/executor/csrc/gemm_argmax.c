/* The LM head's GEMM reduced to each row's argmax as it goes (gemm.c's plan and kernels): a greedy
 * step never writes its logits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gemm.h"
#include "kernels.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* Folds rows [0, mb) of a panel's product (buf, rows of nr floats, the first ncols valid; column
 * col0 first) into each row's running maximum and its column. Strictly greater: the first of
 * equal values stays, and NaN is never taken. */
static void fold_max(const float *buf, int nr, int mb, int ncols, int col0, float *best, int32_t *best_col) {
    for (int r = 0; r < mb; r++) {
        const float *row = buf + (size_t)r * nr;
        float m = best[r];
        if (ncols == nr) { /* mostly nothing beats the row's maximum so far: one vector test per 8 */
            const v8 mv = {m, m, m, m, m, m, m, m};
            v8i greater = (v8i){0};
            for (int j = 0; j < nr; j += 8) greater |= *(const v8 *)(row + j) > mv;
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

typedef struct {
    const float *buf;
    int nr;
    float *best;
    int32_t *best_col;
} ArgmaxCtx;

static void fold_panel(void *ctx_, int p, int m0, int mb, int ncols) {
    (void)m0;
    ArgmaxCtx *ctx = ctx_;
    fold_max(ctx->buf, ctx->nr, mb, ncols, p * ctx->nr, ctx->best, ctx->best_col);
}

typedef struct {
    Plan pl;
    const void *a, *panels;
    float *part;       /* each item's rows' maximum over its run of panels: [chunks, M] */
    int32_t *part_col; /* and its column */
    int counter, failed;
} ArgmaxJob;

static void argmax_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    ArgmaxJob *job = job_;
    const Plan *pl = &job->pl;
    const int mc = pl->mc, nr = pl->kn->nr, M = pl->M;
    /* the product of one panel and a block of rows, then the block's running maxima */
    float *buf = malloc(sizeof(float) * (size_t)mc * (nr + 1) + sizeof(int32_t) * (size_t)mc);
    if (!buf) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    ArgmaxCtx ctx = {buf, nr, buf + (size_t)mc * nr, 0};
    ctx.best_col = (int32_t *)(ctx.best + mc);
    int item = pool_next(&job->counter);
    while (item < pl->items) {
        const int next_item = pool_next(&job->counter);
        const int chunk = item % pl->chunks, m0 = item / pl->chunks * mc;
        const int mb = M - m0 < mc ? M - m0 : mc;
        for (int r = 0; r < mb; r++) {
            ctx.best[r] = -INFINITY;
            ctx.best_col[r] = -1;
        }
        gemm_run_item(pl, job->a, job->panels, 0, buf, nr, item, next_item, fold_panel, &ctx);
        memcpy(job->part + (size_t)chunk * M + m0, ctx.best, sizeof(float) * mb);
        memcpy(job->part_col + (size_t)chunk * M + m0, ctx.best_col, sizeof(int32_t) * mb);
        item = next_item;
    }
    free(buf);
}

/* out[m] = argmax over n of (A @ W)[m, n], with the GEMM's arithmetic (so the values compared
 * are the ones it would write) but without writing the product: a greedy step's logits are
 * [rows, vocab], 50 MB at 256 rows of a 49,152-token vocabulary, written by the LM head and
 * read back by the argmax. Ties go to the lowest index and NaN is never chosen, as
 * argmax_rows; a row with nothing above -inf gets 0. Returns -1 where scratch cannot be
 * allocated. */
static int argmax_run(const Kernel *kn, const void *a, const void *panels, int64_t *out, int M, int K, int N,
                      int num_threads) {
    if (M <= 0) return 0;
    ArgmaxJob job = {gemm_plan(kn, M, K, N), a, panels};
    const int chunks = job.pl.chunks;
    job.part = malloc(sizeof(float) * (size_t)M * chunks);
    job.part_col = malloc(sizeof(int32_t) * (size_t)M * chunks);
    int failed = !job.part || !job.part_col;
    if (!failed) {
        pool_run(argmax_part, &job, num_threads);
        failed = job.failed;
    }
    if (!failed)
        for (int r = 0; r < M; r++) {
            float m = -INFINITY;
            int32_t col = -1;
            for (int ch = 0; ch < chunks; ch++)
                if (job.part[(size_t)ch * M + r] > m) {
                    m = job.part[(size_t)ch * M + r];
                    col = job.part_col[(size_t)ch * M + r];
                }
            out[r] = col < 0 ? 0 : col;
        }
    free(job.part);
    free(job.part_col);
    return failed ? -1 : 0;
}

int gemm_f32_argmax(const float *a, const float *panels, int64_t *out, int M, int K, int N, int num_threads) {
    return argmax_run(&gemm_kernel_f32, a, panels, out, M, K, N, num_threads);
}

/* gemm_bf16's argmax, as gemm_f32_argmax; -2 where gemm_bf16_supported() is 0. */
int gemm_bf16_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                     int num_threads) {
    const Kernel *kn = gemm_bf16_kernel(0, K);
    return kn ? argmax_run(kn, a, panels, out, M, K, N, num_threads) : -2;
}

/* gemm_bf16_amx's argmax, as gemm_bf16_argmax. */
int gemm_bf16_amx_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                         int num_threads) {
    const Kernel *kn = gemm_bf16_kernel(1, K);
    return kn ? argmax_run(kn, a, panels, out, M, K, N, num_threads) : -2;
}
