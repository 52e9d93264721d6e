/* exp of eight floats at once (sixteen on AVX-512), shared by the attention kernel (softmax) and
 * the forward pass (SiLU). */
#ifndef TRITONE_VEXP_H
#define TRITONE_VEXP_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) to about one ulp: Cephes' expf polynomial. Inputs are clamped to [-87, 88], where exp
 * neither underflows to denormals nor overflows. One body for both widths (P: the intrinsics'
 * prefix, W: the width in bits, ROUND: round to nearest), so that the two give the same value lane
 * for lane. */
#define TRITONE_EXP(name, V, VI, P, W, ROUND)                                                           \
    static inline V name(V x) {                                                                        \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                          \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                              \
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                               \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                            \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                           \
        V p = P##_set1_ps(1.9875691500e-4f);                                                             \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                           \
        p = P##_fmadd_ps(P##_mul_ps(p, r), r, P##_add_ps(r, P##_set1_ps(1.0f)));                         \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);         \
        return P##_mul_ps(p, P##_castsi##W##_ps(e));                                                     \
    }

TRITONE_EXP(exp8, __m256, __m256i, _mm256, 256, _mm256_round_ps)
#if defined(__AVX512F__)
TRITONE_EXP(exp16, __m512, __m512i, _mm512, 512, _mm512_roundscale_ps)
#endif
#undef TRITONE_EXP
#endif
#endif
