/* SiLU(gate) * up, shared by the forward pass's row work (llama.c) and the gate_up GEMM that
 * applies it as it goes (gemm_glu.c), so that both give the same activations bit for bit. */
#ifndef TRITONE_ACTIVATION_H
#define TRITONE_ACTIVATION_H
#include <math.h>
#include "vexp.h"

/* silu(g) * u for LANES entries at a time while they last. One body for both widths (P: the
 * intrinsics' prefix, EXP: vexp.h's exp of that width, which gives the other's value lane for
 * lane; the division and product are exact), so that the activations do not depend on which runs. */
#define SILU_MUL_LANES(V, P, LANES, EXP)                                                              \
    for (; j + LANES <= n; j += LANES) {                                                              \
        const V g = P##_loadu_ps(gate + j);                                                           \
        const V s = P##_div_ps(g, P##_add_ps(P##_set1_ps(1.0f), EXP(P##_sub_ps(P##_setzero_ps(), g)))); \
        P##_storeu_ps(out + j, P##_mul_ps(s, P##_loadu_ps(up + j)));                                  \
    }

/* out[j] = silu(gate[j]) * up[j] for j < n; out may be gate or up. */
static inline void silu_mul(const float *gate, const float *up, float *out, int n) {
    int j = 0;
#if defined(__AVX512F__)
    SILU_MUL_LANES(__m512, _mm512, 16, exp16)
#endif
#if defined(__AVX2__) && defined(__FMA__)
    SILU_MUL_LANES(__m256, _mm256, 8, exp8)
#endif
    for (; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}
#undef SILU_MUL_LANES
#endif
