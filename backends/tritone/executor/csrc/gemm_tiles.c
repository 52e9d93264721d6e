/* The vector micro-kernels of gemm.c's panels: fp32 on any x86-64 with AVX2, bf16 pairs where the
 * CPU has AVX512-BF16. gemm.c's opening comment describes the layouts. */
#include <stddef.h>
#include <stdint.h>
#include "bf16.h"
#include "gemm.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));

#define NR 16
#define MR 6

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

static void panel_rows_f32(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                           const float *bias, const void *next_) {
    const float *a = a_, *panel = panel_, *next = next_;
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

#if defined(__AVX512BF16__)
/* 12 x 32: 24 accumulators of the 32 vector registers, 2 for the weights' pairs, 1 broadcast. */
#define MR_BF16 12

/* Rows [0, mr) of A (bf16 pairs, K2 per row) times one bf16 panel (K2 rows of 32 pairs) into c;
 * prefetching as `tile`, two cache lines per row of pairs. */
static inline __attribute__((always_inline)) void tile_bf16(const uint32_t *a, int K2, const uint16_t *panel,
                                                            float *c, int ldc, int ncols, const float *bias, int mr,
                                                            const uint16_t *next, int pf_first, int pf_step) {
    __m512 acc[MR_BF16][2];
    for (int r = 0; r < MR_BF16; r++) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    int pf = next ? pf_first : K2;
    for (int k = 0; k < K2; k++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 2 * NR_BF16);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 2 * NR_BF16 + NR_BF16);
        if (k == pf) {
            __builtin_prefetch(next + (size_t)k * 2 * NR_BF16, 0, 3);
            __builtin_prefetch(next + (size_t)k * 2 * NR_BF16 + NR_BF16, 0, 3);
            pf += pf_step;
        }
        for (int r = 0; r < MR_BF16; r++) {
            if (r < mr) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[(size_t)r * K2 + k]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
            }
        }
    }
    const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
    const __mmask16 hi = ncols >= NR_BF16 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int r = 0; r < mr; r++) {
        float *out = c + (size_t)r * ldc;
        __m512 v0 = acc[r][0], v1 = acc[r][1];
        if (bias) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(lo, bias));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(hi, bias + 16));
        }
        _mm512_mask_storeu_ps(out, lo, v0);
        _mm512_mask_storeu_ps(out + 16, hi, v1);
    }
}

#define TILE_BF16(n) \
    tile_bf16(a + (size_t)m * K2, K2, panel, c + (size_t)m * N, N, ncols, bias, n, next, m / MR_BF16, tiles)

static void panel_rows_bf16(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                            const float *bias, const void *next_) {
    const uint32_t *a = a_;
    const uint16_t *panel = panel_, *next = next_;
    const int K2 = (K + 1) / 2, tiles = (M + MR_BF16 - 1) / MR_BF16;
    int m = 0;
    for (; m + MR_BF16 <= M; m += MR_BF16) TILE_BF16(MR_BF16);
    switch (M - m) {
    case 1: TILE_BF16(1); break;
    case 2: TILE_BF16(2); break;
    case 3: TILE_BF16(3); break;
    case 4: TILE_BF16(4); break;
    case 5: TILE_BF16(5); break;
    case 6: TILE_BF16(6); break;
    case 7: TILE_BF16(7); break;
    case 8: TILE_BF16(8); break;
    case 9: TILE_BF16(9); break;
    case 10: TILE_BF16(10); break;
    case 11: TILE_BF16(11); break;
    }
}

const Kernel gemm_kernel_bf16 = {NR_BF16, MR_BF16, sizeof(uint16_t), 2, panel_rows_bf16};
#endif

const Kernel gemm_kernel_f32 = {NR, MR, sizeof(float), 1, panel_rows_f32};
