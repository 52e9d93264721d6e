/* Paged attention for the CPU over a packed batch: every sequence's new query tokens (one for a
 * decode, many for a prompt chunk or the tail after a prefix-cache hit) attend causally to that
 * sequence's whole context, read in place from the paged KV cache through its block table.
 *
 * The torch path must first gather each sequence's keys and values out of the cache into a
 * padded batch: that copy is most of the attention time on a CPU, whose memory bandwidth is the
 * limit. Here each cached row is read where it lies, a bf16 one converted to float32 as it is
 * loaded into registers (converted into a buffer first, gathering took three times the kernel's
 * own time: 18.7% of a batch-128 decode step of the default model against 6.5%).
 *
 * Plain C with no torch headers, so that it compiles in about a second wherever a C compiler is
 * present; the caller passes data pointers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vexp.h"
#include "bf16.h"
#include "kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Query tokens per work item: long prompts split into tiles that threads share. */
#define QUERY_TILE 16
/* Keys per block of a prompt item: 64 keys' and values' rows of 64 floats fill half of L1. */
#define KEY_BLOCK 64

typedef struct {
    int seq, kv_head, first, count; /* query tokens [first, first + count) of the sequence */
} WorkItem;

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int32_t *block_tables, *query_start, *seq_lens;
    float *out;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16;
    float scale;
} Args;

/* A thread's scratch: each context row's key and value as a pointer into the cache (float32 or
 * bf16 rows), and one row of scores. */
typedef struct {
    const void **k_rows, **v_rows;
    float *scores;
    float *acc, *row_max, *row_sum; /* a prompt item's running outputs, maxima and sums per row */
} Scratch;

static void gather_rows(const Args *a, const int32_t *table, int h, int n, Scratch *s) {
    const size_t elem = a->is_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int t = 0; t < n; t++) {
        const size_t slot = (size_t)table[t / a->block_size] * a->block_size + t % a->block_size;
        const size_t offset = (slot * a->num_kv_heads + h) * a->head_dim * elem;
        s->k_rows[t] = (const char *)a->k_cache + offset;
        s->v_rows[t] = (const char *)a->v_cache + offset;
    }
}

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

/* scores8 for bf16 rows, D a multiple of 16. */
static inline __attribute__((always_inline)) void scores8_wide(const float *q, const void *const *k, int D,
                                                             float scale, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qv, load16_bf16(k[0], d), a0);
        a1 = _mm512_fmadd_ps(qv, load16_bf16(k[1], d), a1);
        a2 = _mm512_fmadd_ps(qv, load16_bf16(k[2], d), a2);
        a3 = _mm512_fmadd_ps(qv, load16_bf16(k[3], d), a3);
        a4 = _mm512_fmadd_ps(qv, load16_bf16(k[4], d), a4);
        a5 = _mm512_fmadd_ps(qv, load16_bf16(k[5], d), a5);
        a6 = _mm512_fmadd_ps(qv, load16_bf16(k[6], d), a6);
        a7 = _mm512_fmadd_ps(qv, load16_bf16(k[7], d), a7);
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(halves(a0), halves(a1)), _mm256_hadd_ps(halves(a2), halves(a3)));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(halves(a4), halves(a5)), _mm256_hadd_ps(halves(a6), halves(a7)));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* accumulate_values for bf16 rows, D a multiple of 16. */
static inline __attribute__((always_inline)) void accumulate_values_wide(const float *p, const void *const *v_rows,
                                                                       int n, float corr, float *acc_row,
                                                                       const int D) {
    __m512 acc[16];
    const __m512 c = _mm512_set1_ps(corr);
    for (int i = 0; i < D / 16; i++) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(acc_row + 16 * i), c);
    for (int t = 0; t < n; t++) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int i = 0; i < D / 16; i++) acc[i] = _mm512_fmadd_ps(pt, load16_bf16(v_rows[t], 16 * i), acc[i]);
    }
    for (int i = 0; i < D / 16; i++) _mm512_storeu_ps(acc_row + 16 * i, acc[i]);
}
#else
#define WIDE_BF16 0
#define scores8_wide(q, k, D, scale, out) scores8(q, k, D, scale, out, 1)
#define accumulate_values_wide(p, v_rows, n, corr, acc_row, D) accumulate_values(p, v_rows, n, corr, acc_row, D, 1)
#endif
#define HAVE_DECODE_KERNEL 1
#define IS_DECODE(q_len) ((q_len) == 1)
#else
#define IS_DECODE(q_len) 0
#endif

#ifdef HAVE_DECODE_KERNEL
/* One query row over keys [k0, k0 + cnt): scores, the running maximum and sum, and the running
 * output `acc_row` (online softmax). Prompt rows and decodes both go through it, block by block
 * from key 0, so a token's attention is the same bits either way. */
static inline __attribute__((always_inline)) void attend_block(const Args *a, const float *qr, Scratch *s, int k0,
                                                               int cnt, float *row_max, float *row_sum,
                                                               float *acc_row, const int D, const int bf16,
                                                               const int wide) {
    float *sr = s->scores;
    int t = 0;
    for (; t + 8 <= cnt; t += 8) {
        if (wide)
            scores8_wide(qr, s->k_rows + k0 + t, D, a->scale, sr + t);
        else
            scores8(qr, s->k_rows + k0 + t, D, a->scale, sr + t, bf16);
    }
    for (; t < cnt; t++) sr[t] = dot(qr, s->k_rows[k0 + t], D, bf16) * a->scale;
    const float block_max = max_of(sr, cnt);
    const float m = block_max > *row_max ? block_max : *row_max;
    const float corr = expf(*row_max - m); /* 0 for the first block */
    *row_sum = *row_sum * corr + exp_shifted(sr, cnt, m);
    *row_max = m;
    if (wide)
        accumulate_values_wide(sr, s->v_rows + k0, cnt, corr, acc_row, D);
    else
        accumulate_values(sr, s->v_rows + k0, cnt, corr, acc_row, D, bf16);
}
#endif

/* One work item. Its rows are (query token, query head of this kv head's group) pairs; the
 * token at row r sits at position first_pos + r / group and sees keys [0, that]. Inlined with
 * D a constant for common head sizes, so that a row's accumulator stays in registers.
 *
 * With AVX2 the keys go in blocks of KEY_BLOCK, every row of the item over one block before the
 * next, with a running maximum and sum per row (online softmax, as flash attention): a block's
 * keys and values stay in L1 while the item's rows use them. Row by row over the whole context,
 * a 2,000-token prompt re-read each head's keys and values from L3 for every query row and spent
 * 3.4 s of the default model's forward pass in attention. Scores and exponentials go eight keys
 * at a time (the decode path's helpers). */
static inline __attribute__((always_inline)) void attend_dim(const Args *a, WorkItem w, Scratch *s, const int D,
                                                             const int bf16) {
    const int group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start[w.seq];
    const int q_len = a->query_start[w.seq + 1] - q_start;
    const int first_pos = a->seq_lens[w.seq] - q_len + w.first;
    const int rows = w.count * group;
    gather_rows(a, a->block_tables + (size_t)w.seq * a->max_blocks, w.kv_head, first_pos + w.count, s);
#define ROW(r) ((size_t)(q_start + w.first + (r) / group) * a->num_heads + (size_t)w.kv_head * group + (r) % group)
#ifdef HAVE_DECODE_KERNEL
    const int wide = WIDE_BF16 && bf16 && D % 16 == 0;
    float *acc = s->acc, *row_max = s->row_max, *row_sum = s->row_sum;
    for (int r = 0; r < rows; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
        memset(acc + (size_t)r * D, 0, sizeof(float) * D);
    }
    for (int k0 = 0; k0 < first_pos + w.count; k0 += KEY_BLOCK) {
        for (int r = 0; r < rows; r++) {
            const int n = first_pos + r / group + 1 - k0; /* keys of this block that row r sees */
            if (n <= 0) continue;
            const int cnt = n < KEY_BLOCK ? n : KEY_BLOCK;
            attend_block(a, a->q + ROW(r) * D, s, k0, cnt, &row_max[r], &row_sum[r], acc + (size_t)r * D, D, bf16,
                         wide);
        }
    }
    for (int r = 0; r < rows; r++) {
        const v8 inv = (v8){0} + 1.f / row_sum[r];
        float *out = a->out + ROW(r) * D;
        for (int i = 0; i < D / 8; i++) *(v8 *)(out + 8 * i) = *(const v8 *)(acc + (size_t)r * D + 8 * i) * inv;
    }
#else
    for (int r = 0; r < rows; r++) {
        const float *qr = a->q + ROW(r) * D;
        float *sr = s->scores;
        const int n = first_pos + r / group + 1;
        float max = -INFINITY;
        for (int t = 0; t < n; t++) {
            sr[t] = dot(qr, s->k_rows[t], D, bf16) * a->scale;
            max = sr[t] > max ? sr[t] : max;
        }
        float sum = 0.f;
        for (int t = 0; t < n; t++) {
            sr[t] = expf(sr[t] - max);
            sum += sr[t];
        }
        weighted_values(sr, s->v_rows, n, sum, a->out + ROW(r) * D, D, bf16);
    }
#endif
#undef ROW
}

#ifdef HAVE_DECODE_KERNEL
/* Each query head in turn over the keys in blocks of KEY_BLOCK with a running maximum and sum,
 * exactly as a prompt item's rows go (attend_dim): a token's attention output is then the same
 * bits whether it is a decode or a row of a prompt chunk (a prefix-cache hit's tail, a request
 * batched with prompts), which seeded sampling relies on (docs/contract.md). */
static inline __attribute__((always_inline)) void decode_dim(const Args *a, int seq, Scratch *s, const int D,
                                                             const int bf16) {
    const int group = a->num_heads / a->num_kv_heads;
    const int n = a->seq_lens[seq];
    const int32_t *table = a->block_tables + (size_t)seq * a->max_blocks;
    const int wide = WIDE_BF16 && bf16 && D % 16 == 0;
    float *acc = s->acc;
    for (int h = 0; h < a->num_kv_heads; h++) {
        gather_rows(a, table, h, n, s);
        for (int g = 0; g < group; g++) {
            const size_t row = (size_t)a->query_start[seq] * a->num_heads + (size_t)h * group + g;
            float row_max = -INFINITY, row_sum = 0.f;
            memset(acc, 0, sizeof(float) * D);
            for (int k0 = 0; k0 < n; k0 += KEY_BLOCK)
                attend_block(a, a->q + row * D, s, k0, n - k0 < KEY_BLOCK ? n - k0 : KEY_BLOCK, &row_max, &row_sum, acc,
                             D, bf16, wide);
            const v8 inv = (v8){0} + 1.f / row_sum;
            float *out = a->out + row * D;
            for (int i = 0; i < D / 8; i++) *(v8 *)(out + 8 * i) = *(const v8 *)(acc + 8 * i) * inv;
        }
    }
}

/* Each head size and cache dtype its own copy, with D and bf16 constants. */
#define DECODE(name, D, bf16) \
    static void name(const Args *a, int seq, Scratch *s) { decode_dim(a, seq, s, D, bf16); }
DECODE(decode_64, 64, 0)
DECODE(decode_128, 128, 0)
DECODE(decode_any, a->head_dim, 0)
DECODE(decode_64_bf16, 64, 1)
DECODE(decode_128_bf16, 128, 1)
DECODE(decode_any_bf16, a->head_dim, 1)
#endif

#define ATTEND(name, D, bf16) \
    static void name(const Args *a, WorkItem w, Scratch *s) { attend_dim(a, w, s, D, bf16); }
ATTEND(attend_64, 64, 0)
ATTEND(attend_128, 128, 0)
ATTEND(attend_any, a->head_dim, 0)
ATTEND(attend_64_bf16, 64, 1)
ATTEND(attend_128_bf16, 128, 1)
ATTEND(attend_any_bf16, a->head_dim, 1)

typedef struct {
    const Args *a;
    void (*attend)(const Args *, WorkItem, Scratch *);
    const WorkItem *items;
    int num_items, max_ctx;
    size_t item_rows;
    void (*decode)(const Args *, int, Scratch *);
    int counter, failed;
} AttentionJob;

static void attention_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    AttentionJob *job = job_;
    const int head_dim = job->a->head_dim, max_ctx = job->max_ctx;
    Scratch s;
    s.k_rows = malloc(2 * sizeof(void *) * max_ctx);
    s.scores = malloc(sizeof(float) * (max_ctx + job->item_rows * (head_dim + 2)));
    if (!s.k_rows || !s.scores) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        s.v_rows = s.k_rows + max_ctx;
        s.acc = s.scores + max_ctx;
        s.row_max = s.acc + job->item_rows * head_dim;
        s.row_sum = s.row_max + job->item_rows;
        for (int i; (i = pool_next(&job->counter)) < job->num_items;) {
            const WorkItem w = job->items[i];
#ifdef HAVE_DECODE_KERNEL
            if (w.kv_head < 0) {
                job->decode(job->a, w.seq, &s);
                continue;
            }
#endif
            job->attend(job->a, w, &s);
        }
    }
    free(s.k_rows);
    free(s.scores);
}

/* q, out: [num_tokens, num_heads, head_dim] float32, the tokens of sequence s at rows
 * [query_start[s], query_start[s + 1]). k_cache, v_cache: [num_slots, num_kv_heads, head_dim]
 * float32 (is_bf16 = 0) or bfloat16 (is_bf16 = 1), already holding the new tokens' keys and
 * values. block_tables: [num_seqs, max_blocks] int32. seq_lens: [num_seqs] int32, the context
 * length after this step's tokens, each >= its query length >= 1. Rows of out
 * that belong to no sequence (padding) are left as they are. Work is shared among num_threads
 * threads (the caller passes torch's count). Returns 0, -1 when out of memory, -2 for
 * a head_dim that is over 256 or not a multiple of 8. */
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                    float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int is_bf16, int num_threads) {
    if (head_dim > 256 || head_dim % 8) return -2;
    const Args a = {q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_heads,
                    num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale};
    void (*attend)(const Args *, WorkItem, Scratch *) =
        is_bf16 ? (head_dim == 64 ? attend_64_bf16 : head_dim == 128 ? attend_128_bf16 : attend_any_bf16)
                : (head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any);
#ifdef HAVE_DECODE_KERNEL
    void (*decode)(const Args *, int, Scratch *) =
        is_bf16 ? (head_dim == 64 ? decode_64_bf16 : head_dim == 128 ? decode_128_bf16 : decode_any_bf16)
                : (head_dim == 64 ? decode_64 : head_dim == 128 ? decode_128 : decode_any);
#endif
    int num_items = 0, max_ctx = 1;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        num_items += IS_DECODE(q_len) ? 1 : (q_len + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;
        if (seq_lens[s] > max_ctx) max_ctx = seq_lens[s];
    }
    WorkItem *items = malloc(sizeof(WorkItem) * (num_items ? num_items : 1));
    if (!items) return -1;
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        if (IS_DECODE(q_len)) {
            WorkItem w = {s, -1, 0, 1}; /* every head, by `decode` */
            items[n++] = w;
            continue;
        }
        for (int first = 0; first < q_len; first += QUERY_TILE)
            for (int h = 0; h < num_kv_heads; h++) {
                WorkItem w = {s, h, first, q_len - first < QUERY_TILE ? q_len - first : QUERY_TILE};
                items[n++] = w;
            }
    }
    AttentionJob job = {&a, attend, items, num_items, max_ctx, (size_t)QUERY_TILE * (num_heads / num_kv_heads)};
#ifdef HAVE_DECODE_KERNEL
    job.decode = decode;
#endif
    pool_run(attention_part, &job, num_threads);
    free(items);
    return job.failed ? -1 : 0;
}
