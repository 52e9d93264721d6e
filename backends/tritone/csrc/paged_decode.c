/* Decode attention straight from the paged KV cache, for the CPU.
 *
 * The torch path must first gather every request's keys and values out of the cache into a
 * padded batch: that copy is most of the attention time on a CPU, whose memory bandwidth is the
 * limit. This kernel reads each cached row once, in place, through the block table.
 *
 * Plain C with no torch headers, so that it compiles in about a second wherever a C compiler
 * is present; the caller passes data pointers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define DEFINE_LOAD(NAME, T, CONVERT)                                   \
    static inline void NAME(const T *src, float *dst, int n) {        \
        for (int i = 0; i < n; i++) dst[i] = CONVERT(src[i]);           \
    }
#define IDENTITY(x) (x)
DEFINE_LOAD(load_f32, float, IDENTITY)
DEFINE_LOAD(load_bf16, uint16_t, bf16_to_f32)

/* One (sequence, kv head) pair: the `group` query heads that share the kv head. scores holds
 * group * len floats, kv holds head_dim floats (both scratch). */
static void attend(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                   int len, float *out, int h, int group, int num_kv_heads, int head_dim,
                   int block_size, float scale, int is_bf16, float *scores, float *kv) {
    const size_t row = (size_t)num_kv_heads * head_dim;
    for (int t = 0; t < len; t++) {
        const size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        const size_t offset = slot * row + (size_t)h * head_dim;
        const float *k;
        if (is_bf16) {
            load_bf16((const uint16_t *)k_cache + offset, kv, head_dim);
            k = kv;
        } else {
            k = (const float *)k_cache + offset;
        }
        for (int g = 0; g < group; g++) {
            const float *qg = q + (size_t)g * head_dim;
            float dot = 0.f;
            for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
            scores[(size_t)g * len + t] = dot * scale;
        }
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + (size_t)g * len;
        float max = sg[0], sum = 0.f;
        for (int t = 1; t < len; t++) max = sg[t] > max ? sg[t] : max;
        for (int t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - max);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int t = 0; t < len; t++) sg[t] *= inv;
        memset(out + (size_t)g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int t = 0; t < len; t++) {
        const size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        const size_t offset = slot * row + (size_t)h * head_dim;
        const float *v;
        if (is_bf16) {
            load_bf16((const uint16_t *)v_cache + offset, kv, head_dim);
            v = kv;
        } else {
            v = (const float *)v_cache + offset;
        }
        for (int g = 0; g < group; g++) {
            const float p = scores[(size_t)g * len + t];
            float *og = out + (size_t)g * head_dim;
            for (int d = 0; d < head_dim; d++) og[d] += p * v[d];
        }
    }
}

/* q, out: [num_seqs, num_heads, head_dim] float32. k_cache, v_cache: [num_slots, num_kv_heads,
 * head_dim] of float32 (is_bf16 = 0) or bfloat16 (is_bf16 = 1). block_tables: [num_seqs,
 * max_blocks] int32. context_lens: [num_seqs] int32, each >= 1. The (sequence, kv head) pairs
 * are shared among num_threads threads (the caller passes torch's count, whose OpenMP runtime
 * this library shares). Returns 0, or -1 when out of memory. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, float *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16,
                           int num_threads) {
    const int group = num_heads / num_kv_heads;
    int max_len = 0, failed = 0;
    for (int s = 0; s < num_seqs; s++)
        if (context_lens[s] > max_len) max_len = context_lens[s];
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * ((size_t)group * max_len + head_dim));
        if (!scores) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int i = 0; i < num_seqs * num_kv_heads; i++) {
                const int s = i / num_kv_heads, h = i % num_kv_heads;
                const size_t first = (size_t)s * num_heads + (size_t)h * group;
                attend(q + first * head_dim, k_cache, v_cache, block_tables + (size_t)s * max_blocks,
                       context_lens[s], out + first * head_dim, h, group, num_kv_heads, head_dim,
                       block_size, scale, is_bf16, scores, scores + (size_t)group * max_len);
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
