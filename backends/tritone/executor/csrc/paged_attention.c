/* Paged attention for the CPU over a packed batch: every sequence's new query tokens (one for a
 * decode, many for a prompt chunk or the tail after a prefix-cache hit) attend causally to that
 * sequence's whole context, read in place from the paged KV cache through its block table.
 *
 * The torch path must first gather each sequence's keys and values out of the cache into a
 * padded batch: that copy is most of the attention time on a CPU, whose memory bandwidth is the
 * limit. Here each cached row is read where it lies (or converted once, for a bf16 cache).
 *
 * Plain C with no torch headers, so that it compiles in about a second wherever a C compiler is
 * present; the caller passes data pointers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Query tokens per work item: long prompts split into tiles that threads share. */
#define QUERY_TILE 16

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

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

/* A thread's scratch: each context row's key and value as a pointer (into the cache, or into
 * k_buf/v_buf where a bf16 cache is converted to float), and one row of scores. */
typedef struct {
    const float **k_rows, **v_rows;
    float *scores, *k_buf, *v_buf;
} Scratch;

static void gather_rows(const Args *a, const int32_t *table, int h, int n, Scratch *s) {
    const int D = a->head_dim;
    for (int t = 0; t < n; t++) {
        const size_t slot = (size_t)table[t / a->block_size] * a->block_size + t % a->block_size;
        const size_t offset = (slot * a->num_kv_heads + h) * D;
        if (a->is_bf16) {
            const uint16_t *k = (const uint16_t *)a->k_cache + offset;
            const uint16_t *v = (const uint16_t *)a->v_cache + offset;
            float *kf = s->k_buf + (size_t)t * D, *vf = s->v_buf + (size_t)t * D;
            for (int d = 0; d < D; d++) kf[d] = bf16_to_f32(k[d]);
            for (int d = 0; d < D; d++) vf[d] = bf16_to_f32(v[d]);
            s->k_rows[t] = kf;
            s->v_rows[t] = vf;
        } else {
            s->k_rows[t] = (const float *)a->k_cache + offset;
            s->v_rows[t] = (const float *)a->v_cache + offset;
        }
    }
}

/* Eight floats as one value (GCC and Clang vector extensions: the compiler maps them to the
 * machine's vector registers, AVX2 or AVX-512 halves, NEON pairs); aligned(4) allows any address. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline __attribute__((always_inline)) float dot(const float *x, const float *y, int D) {
    v8 acc = {0};
    for (int d = 0; d < D; d += 8) acc += *(const v8 *)(x + d) * *(const v8 *)(y + d);
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* One work item. Its rows are (query token, query head of this kv head's group) pairs; the
 * token at row r sits at position first_pos + r / group and sees keys [0, that]. Inlined with
 * D a constant for common head sizes, so that a row's accumulator stays in registers. */
static inline __attribute__((always_inline)) void attend_dim(const Args *a, WorkItem w, Scratch *s, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start[w.seq];
    const int q_len = a->query_start[w.seq + 1] - q_start;
    const int first_pos = a->seq_lens[w.seq] - q_len + w.first;
    gather_rows(a, a->block_tables + (size_t)w.seq * a->max_blocks, w.kv_head, first_pos + w.count, s);
    for (int r = 0; r < w.count * group; r++) {
        const size_t row = (size_t)(q_start + w.first + r / group) * a->num_heads + (size_t)w.kv_head * group + r % group;
        const float *qr = a->q + row * D;
        float *sr = s->scores;
        const int n = first_pos + r / group + 1;
        float max = -INFINITY;
        for (int t = 0; t < n; t++) {
            sr[t] = dot(qr, s->k_rows[t], D) * a->scale;
            max = sr[t] > max ? sr[t] : max;
        }
        float sum = 0.f;
        for (int t = 0; t < n; t++) {
            sr[t] = expf(sr[t] - max);
            sum += sr[t];
        }
        v8 acc[32]; /* head_dim / 8 of them; in registers when D is a small constant */
        for (int i = 0; i < D / 8; i++) acc[i] = (v8){0};
        for (int t = 0; t < n; t++) {
            const v8 p = (v8){0} + sr[t];
            const float *v = s->v_rows[t];
            for (int i = 0; i < D / 8; i++) acc[i] += p * *(const v8 *)(v + 8 * i);
        }
        float *o = a->out + row * D;
        const v8 inv = (v8){0} + 1.f / sum;
        for (int i = 0; i < D / 8; i++) *(v8 *)(o + 8 * i) = acc[i] * inv;
    }
}

static void attend_64(const Args *a, WorkItem w, Scratch *s) { attend_dim(a, w, s, 64); }
static void attend_128(const Args *a, WorkItem w, Scratch *s) { attend_dim(a, w, s, 128); }
static void attend_any(const Args *a, WorkItem w, Scratch *s) { attend_dim(a, w, s, a->head_dim); }

/* q, out: [num_tokens, num_heads, head_dim] float32, the tokens of sequence s at rows
 * [query_start[s], query_start[s + 1]). k_cache, v_cache: [num_slots, num_kv_heads, head_dim]
 * float32 (is_bf16 = 0) or bfloat16 (is_bf16 = 1), already holding the new tokens' keys and
 * values. block_tables: [num_seqs, max_blocks] int32. seq_lens: [num_seqs] int32, the context
 * length after this step's tokens, each >= its query length >= 1. Rows of out
 * that belong to no sequence (padding) are left as they are. Work is shared among num_threads
 * OpenMP threads (the caller passes torch's count). Returns 0, -1 when out of memory, -2 for
 * a head_dim that is over 256 or not a multiple of 8. */
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                    float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int is_bf16, int num_threads) {
    if (head_dim > 256 || head_dim % 8) return -2;
    const Args a = {q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_heads,
                    num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale};
    void (*attend)(const Args *, WorkItem, Scratch *) =
        head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    int num_items = 0, max_ctx = 1, failed = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        num_items += (q_len + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;
        if (seq_lens[s] > max_ctx) max_ctx = seq_lens[s];
    }
    WorkItem *items = malloc(sizeof(WorkItem) * (num_items ? num_items : 1));
    if (!items) return -1;
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        for (int first = 0; first < q_len; first += QUERY_TILE)
            for (int h = 0; h < num_kv_heads; h++) {
                WorkItem w = {s, h, first, q_len - first < QUERY_TILE ? q_len - first : QUERY_TILE};
                items[n++] = w;
            }
    }
    const size_t buf_floats = is_bf16 ? 2 * (size_t)max_ctx * head_dim : 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch s;
        s.k_rows = malloc(2 * sizeof(float *) * max_ctx);
        s.scores = malloc(sizeof(float) * (max_ctx + buf_floats));
        if (!s.k_rows || !s.scores) {
            failed = 1;
        } else {
            s.v_rows = s.k_rows + max_ctx;
            s.k_buf = s.scores + max_ctx;
            s.v_buf = s.k_buf + (size_t)max_ctx * head_dim;
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < num_items; i++) attend(&a, items[i], &s);
        }
        free(s.k_rows);
        free(s.scores);
    }
    free(items);
    return failed ? -1 : 0;
}
