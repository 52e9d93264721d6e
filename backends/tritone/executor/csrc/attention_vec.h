/* The vector arithmetic of paged_attention.c: a cached row's elements as floats (float32 or bf16
 * rows), dot products, eight keys' scores at once, shifted exponentials, and the running sums of
 * values. Static inline, for paged_attention.c alone: its loops inline them with the head size
 * and cache dtype constant. */
#ifndef TRITONE_ATTENTION_VEC_H
#define TRITONE_ATTENTION_VEC_H
#include <math.h>
#include <stdint.h>
#include "vexp.h"
#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Eight floats as one value (GCC and Clang vector extensions: the compiler maps them to the
 * machine's vector registers, AVX2 or AVX-512 halves, NEON pairs); aligned(4) allows any address. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* Elements [d, d + 8) of a cached row as floats; bf16 is a constant where this is inlined. */
static inline __attribute__((always_inline)) v8 load8(const void *row, int d, const int bf16) {
    if (!bf16) return *(const v8 *)((const float *)row + d);
    v8 out;
    bf16_to_f32_row((const uint16_t *)row + d, (float *)&out, 8);
    return out;
}

static inline __attribute__((always_inline)) float dot(const float *x, const void *y, int D, const int bf16) {
    v8 acc = {0};
    for (int d = 0; d < D; d += 8) acc += *(const v8 *)(x + d) * load8(y, d, bf16);
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* out = sum over t of p[t] * v_rows[t], divided by `sum`: one query row's output from its
 * unnormalized softmax weights. */
static inline __attribute__((always_inline)) void weighted_values(const float *p, const void *const *v_rows, int n,
                                                                float sum, float *out, const int D,
                                                                const int bf16) {
    v8 acc[32]; /* head_dim / 8 of them; in registers when D is a small constant */
    for (int i = 0; i < D / 8; i++) acc[i] = (v8){0};
    for (int t = 0; t < n; t++) {
        const v8 pt = (v8){0} + p[t];
        const void *v = v_rows[t];
        for (int i = 0; i < D / 8; i++) acc[i] += pt * load8(v, 8 * i, bf16);
    }
    const v8 inv = (v8){0} + 1.f / sum;
    for (int i = 0; i < D / 8; i++) *(v8 *)(out + 8 * i) = acc[i] * inv;
}

/* A decode: one sequence's single new token, every head. The query heads of a KV head's group
 * all read that head's keys and values, so each group is done together while its rows are in
 * cache. Work per key is small (a 64-wide dot product and a multiply-add), so what limits a
 * decode is memory and the latency of dependent arithmetic: scores are computed eight keys at a
 * time with eight independent accumulators, and exponentials eight at a time. */
#if defined(__AVX2__) && defined(__FMA__)
/* scale * (q . k[j]) for eight keys into out[0..8). */
static inline __attribute__((always_inline)) void scores8(const float *q, const void *const *k, int D, float scale,
                                                        float *out, const int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, (__m256)load8(k[0], d, bf16), a0);
        a1 = _mm256_fmadd_ps(qv, (__m256)load8(k[1], d, bf16), a1);
        a2 = _mm256_fmadd_ps(qv, (__m256)load8(k[2], d, bf16), a2);
        a3 = _mm256_fmadd_ps(qv, (__m256)load8(k[3], d, bf16), a3);
        a4 = _mm256_fmadd_ps(qv, (__m256)load8(k[4], d, bf16), a4);
        a5 = _mm256_fmadd_ps(qv, (__m256)load8(k[5], d, bf16), a5);
        a6 = _mm256_fmadd_ps(qv, (__m256)load8(k[6], d, bf16), a6);
        a7 = _mm256_fmadd_ps(qv, (__m256)load8(k[7], d, bf16), a7);
    }
    /* Eight sums at once: pairwise adds leave [k0..k3 low halves | k0..k3 high halves] and the
     * same for k4..k7; the two 128-bit halves then add up. */
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* exp(sr[t] - m) in place for t < n; returns their sum. */
static inline float exp_shifted(float *sr, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), vm));
        _mm256_storeu_ps(sr + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sums[8];
    _mm256_storeu_ps(sums, vsum);
    float sum = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
    for (; t < n; t++) {
        sr[t] = expf(sr[t] - m);
        sum += sr[t];
    }
    return sum;
}

static inline float max_of(const float *sr, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + t));
    float m[8];
    _mm256_storeu_ps(m, vmax);
    float max = m[0];
    for (int i = 1; i < 8; i++) max = m[i] > max ? m[i] : max;
    for (; t < n; t++) max = sr[t] > max ? sr[t] : max;
    return max;
}

/* acc = acc * corr + sum over t of p[t] * v_rows[t]: one query row's running output over a
 * block of keys (online softmax). */
static inline __attribute__((always_inline)) void accumulate_values(const float *p, const void *const *v_rows, int n,
                                                                  float corr, float *acc_row, const int D,
                                                                  const int bf16) {
    v8 acc[32];
    const v8 c = (v8){0} + corr;
    for (int i = 0; i < D / 8; i++) acc[i] = *(const v8 *)(acc_row + 8 * i) * c;
    for (int t = 0; t < n; t++) {
        const v8 pt = (v8){0} + p[t];
        const void *v = v_rows[t];
        for (int i = 0; i < D / 8; i++) acc[i] += pt * load8(v, 8 * i, bf16);
    }
    for (int i = 0; i < D / 8; i++) *(v8 *)(acc_row + 8 * i) = acc[i];
}
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* A bf16 cache on AVX-512: sixteen elements a vector, converted as they are loaded (a bf16 is the
 * top half of a float: a widening move and a shift). Half the instructions of the eight-wide
 * path: decode attention of 128 sequences of 160 tokens, 30 layers, 18.5 -> 12.0 ms. */
#define WIDE_BF16 1
static inline __attribute__((always_inline)) __m512 load16_bf16(const void *row, int d) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m256 halves(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

/* The query heads of one KV group, up to HEAD_CHUNK of them at once, over the same keys: each key
 * and value row is loaded and widened once for all of them (the widening, two instructions per
 * sixteen elements, competes with the multiply-adds for the same ports). Decode attention of 128
 * sequences of 128 tokens, 30 layers, the default model's three heads a group, alternated with the
 * head-by-head kernel it replaced in one process: 44.1 -> 36.9 ms, the same bits. Each head's
 * arithmetic is the same whichever heads share its pass, so its result does not depend on them. */
#define HEAD_CHUNK 4

/* scale * (q[g] . k[j]) for four keys into out[g][0..4), g < G. */
static inline __attribute__((always_inline)) void scores4_heads(const float *const *q, const void *const *k,
                                                              const int D, float scale, float *const *out,
                                                              const int G) {
    __m512 acc[HEAD_CHUNK][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 k0 = load16_bf16(k[0], d), k1 = load16_bf16(k[1], d), k2 = load16_bf16(k[2], d),
                     k3 = load16_bf16(k[3], d);
        for (int g = 0; g < G; g++) {
            const __m512 qv = _mm512_loadu_ps(q[g] + d);
            acc[g][0] = _mm512_fmadd_ps(qv, k0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(qv, k1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(qv, k2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(qv, k3, acc[g][3]);
        }
    }
    for (int g = 0; g < G; g++) { /* scores8's sums of the lanes, four keys at a time */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(acc[g][0]), halves(acc[g][1])),
                                        _mm256_hadd_ps(halves(acc[g][2]), halves(acc[g][3])));
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(out[g], _mm_mul_ps(sum, _mm_set1_ps(scale)));
    }
}

/* acc_row[g] = acc_row[g] * corr[g] + sum over t of p[g][t] * v_rows[t], g < G, D a multiple of 16:
 * sixty-four elements of every head at a time. */
static inline __attribute__((always_inline)) void accumulate_values_heads(const float *const *p,
                                                                        const void *const *v_rows, int n,
                                                                        const float *corr, float *const *acc_row,
                                                                        const int D, const int G) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nv = D - d0 < 64 ? (D - d0) / 16 : 4;
        __m512 acc[HEAD_CHUNK][4];
        for (int g = 0; g < G; g++) {
            const __m512 c = _mm512_set1_ps(corr[g]);
            for (int i = 0; i < nv; i++) acc[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc_row[g] + d0 + 16 * i), c);
        }
        for (int t = 0; t < n; t++) {
            __m512 v[4];
            for (int i = 0; i < nv; i++) v[i] = load16_bf16(v_rows[t], d0 + 16 * i);
            for (int g = 0; g < G; g++) {
                const __m512 pt = _mm512_set1_ps(p[g][t]);
                for (int i = 0; i < nv; i++) acc[g][i] = _mm512_fmadd_ps(pt, v[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < nv; i++) _mm512_storeu_ps(acc_row[g] + d0 + 16 * i, acc[g][i]);
    }
}
#else
#define WIDE_BF16 0
#endif
#define HAVE_DECODE_KERNEL 1
#define IS_DECODE(q_len) ((q_len) == 1)
#else
#define IS_DECODE(q_len) 0
#endif

#endif
