/* Rows converted between float32 and bf16, shared by the GEMM, the forward pass and attention. */
#ifndef TRITONE_BF16_H
#define TRITONE_BF16_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Rounded to nearest even, as torch's conversion (NaN stays a quiet NaN). */
static inline void f32_to_bf16_row(const float *src, uint16_t *dst, int n) {
    int k = 0;
#if defined(__AVX512BF16__)
    for (; k + 16 <= n; k += 16)
        _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
#endif
    for (; k < n; k++) {
        uint32_t u;
        memcpy(&u, src + k, sizeof u);
        dst[k] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* A row of K floats as a bf16 GEMM reads its input: rounded, padded to an even length with a
 * zero (pairs of k are the operand of vdpbf16ps). */
static inline void f32_to_bf16_gemm_row(const float *src, uint16_t *dst, int K) {
    f32_to_bf16_row(src, dst, K);
    if (K & 1) dst[K] = 0;
}

/* Exact: a bf16 is the top half of a float32. */
static inline void bf16_to_f32_row(const uint16_t *src, float *dst, int n) {
    int k = 0;
#if defined(__AVX2__)
    for (; k + 8 <= n; k += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + k)));
        _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; k < n; k++) {
        const uint32_t u = (uint32_t)src[k] << 16;
        memcpy(dst + k, &u, sizeof u);
    }
}
#endif
