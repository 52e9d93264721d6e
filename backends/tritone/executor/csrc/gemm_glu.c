/* The MLP's gate_up GEMM with SiLU(gate) * up applied as it goes (gemm.c's plan and kernels): the
 * products of a block of rows with gate panel p and with up panel p stay in a thread's buffer
 * while they become that block's activations at columns [p * nr, p * nr + nr), rounded to bf16 as
 * the down GEMM reads them where the model is bf16. Computed apart, the gate_up rows (two floats
 * per activation, 1.5 MB at 128 rows of the default model) were written out, read back by the row
 * work and its activations written again; here only the activations leave the core. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "activation.h"
#include "bf16.h"
#include "gemm.h"
#include "kernels.h"

typedef struct {
    Plan pl; /* over the gate half: N is the intermediate size, P its panels */
    const void *a, *panels;
    const float *bias; /* [2 * N] or NULL */
    void *out;
    int bf16_out;
    int counter, failed;
} GluJob;

/* Rows [0, mb) of the block's activations at columns col .. col + nr from the gate and up
 * products (rows of nr floats; the gate buffer is overwritten). */
static void activate(const GluJob *job, float *gate, const float *up, int m0, int mb, int col) {
    const int nr = job->pl.kn->nr, N = job->pl.N;
    for (int r = 0; r < mb; r++) {
        float *g = gate + (size_t)r * nr;
        silu_mul(g, up + (size_t)r * nr, g, nr);
        if (job->bf16_out)
            f32_to_bf16_row(g, (uint16_t *)job->out + (size_t)(m0 + r) * N + col, nr);
        else
            memcpy((float *)job->out + (size_t)(m0 + r) * N + col, g, sizeof(float) * nr);
    }
}

static void glu_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    GluJob *job = job_;
    const Plan *pl = &job->pl;
    const Kernel *kn = pl->kn;
    const int nr = kn->nr, P = pl->P;
    float *gate = malloc(sizeof(float) * 2 * (size_t)pl->mc * nr);
    if (!gate) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *up = gate + (size_t)pl->mc * nr;
    const char *panels = job->panels;
    int item = pool_next(&job->counter);
    while (item < pl->items) {
        const int next_item = pool_next(&job->counter);
        const int chunk = item % pl->chunks, m0 = item / pl->chunks * pl->mc;
        const int mb = pl->M - m0 < pl->mc ? pl->M - m0 : pl->mc;
        const int end = (chunk + 1) * pl->chunk < P ? (chunk + 1) * pl->chunk : P;
        const char *a = (const char *)job->a + (size_t)m0 * pl->a_row_bytes;
        if (kn->begin) kn->begin();
        for (int p = chunk * pl->chunk; p < end; p++) {
            const int q = panel_after(pl, p, end, next_item); /* the gate panel after p's up panel */
            const char *gate_panel = panels + (size_t)p * pl->panel_bytes;
            const char *up_panel = panels + (size_t)(P + p) * pl->panel_bytes;
            kn->rows(a, mb, pl->K, nr, gate_panel, gate, nr, job->bias ? job->bias + (size_t)p * nr : 0, up_panel);
            kn->rows(a, mb, pl->K, nr, up_panel, up, nr, job->bias ? job->bias + (size_t)(pl->N + p * nr) : 0,
                     q < P ? panels + (size_t)q * pl->panel_bytes : 0);
            activate(job, gate, up, m0, mb, p * nr);
        }
        item = next_item;
    }
    free(gate);
}

int gemm_glu_supported(const Kernel *kn, int intermediate) { return kn && intermediate % kn->nr == 0; }

int gemm_glu(const Kernel *kn, const void *a, const void *panels, const float *bias, void *out, int bf16_out, int M,
             int K, int intermediate, int num_threads) {
    if (!gemm_glu_supported(kn, intermediate)) return -2;
    if (M <= 0) return 0;
    GluJob job = {gemm_plan(kn, M, K, intermediate), a, panels, bias, out, bf16_out};
    pool_run(glu_part, &job, num_threads);
    return job.failed ? -1 : 0;
}
