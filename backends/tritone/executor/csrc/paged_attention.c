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
#include "attention_vec.h"
#include "kernels.h"

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
    uint16_t *out_bf16;
} Args;

/* A thread's scratch: each context row's key and value as a pointer into the cache (float32 or
 * bf16 rows), and one row of scores. */
typedef struct {
    const void **k_rows, **v_rows;
    float *scores;
    float *acc, *row_max, *row_sum; /* a prompt item's running outputs, maxima and sums per row */
    int next_seq; /* the decode this thread takes next (-1: none or not a decode) */
    uint32_t *qpack; /* the AMX path's queries as tiles read them (amx_token) */
    float *corr;     /* the AMX path's softmax corrections, one per head */
} Scratch;

/* Block by block, the rows of a block a constant stride apart, rather than a division and a
 * remainder by the block size for every row (decode attention of 128 sequences of 128 tokens, 30
 * layers, the two alternated in one process: 2% to 8% faster). */
static void gather_rows(const Args *a, const int32_t *table, int h, int n, Scratch *s) {
    const size_t elem = a->is_bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t stride = (size_t)a->num_kv_heads * a->head_dim * elem;
    const char *k = (const char *)a->k_cache + (size_t)h * a->head_dim * elem;
    const char *v = (const char *)a->v_cache + (size_t)h * a->head_dim * elem;
    for (int t0 = 0, b = 0; t0 < n; t0 += a->block_size, b++) {
        const size_t first = (size_t)table[b] * a->block_size * stride;
        const int end = n - t0 < a->block_size ? n - t0 : a->block_size;
        for (int i = 0; i < end; i++) {
            s->k_rows[t0 + i] = k + first + (size_t)i * stride;
            s->v_rows[t0 + i] = v + first + (size_t)i * stride;
        }
    }
}

#ifdef HAVE_DECODE_KERNEL
/* Rows of keys and values to fetch while the current ones compute: `left` rows of one KV head of a
 * sequence, from block b's slot i of its table on. A decode's rows lie wherever the block manager
 * put its blocks, 16 slots at a time, so the hardware's prefetchers, which follow runs of
 * addresses, lose the thread at every block: decode attention over scattered blocks took twice as
 * long as over blocks in order, and one thread read its cache at 6 GB/s where it streams 29.
 * Each block of keys requests the rows read next (the next block, the next head's, the next
 * decode's) a few at a time as it computes, evenly over its keys. Decode attention, 30 layers of
 * the default model's shape over scattered blocks, two threads, AMD EPYC with AVX512-BF16,
 * alternated with the burst prefetch this replaced (a whole block's rows into L1 at its start):
 * bf16 cache, 32 x 128 tokens 8.4 / 7.7 -> 4.2 / 4.4 ms, 128 x 192 51.5 / 48.2 -> 24.7 / 25.4;
 * fp32 (no prefetch before), 32 x 128 11.5 -> 8.6, 128 x 192 71.0 -> 51.1. */
typedef struct {
    const int32_t *table;
    const char *k, *v; /* the head's first element in slot 0 of the caches */
    size_t stride;      /* bytes from slot to slot */
    int block_size, b, i, left, row_bytes;
} Ahead;

static inline Ahead ahead_at(const Args *a, const int32_t *table, int head, int t0, int n) {
    const size_t row_bytes = (size_t)a->head_dim * (a->is_bf16 ? sizeof(uint16_t) : sizeof(float));
    Ahead ah = {table, (const char *)a->k_cache + head * row_bytes, (const char *)a->v_cache + head * row_bytes,
                a->num_kv_heads * row_bytes, a->block_size, t0 / a->block_size, t0 % a->block_size,
                n - t0 < KEY_BLOCK ? n - t0 : KEY_BLOCK, (int)row_bytes};
    return ah;
}

/* Requests the next `count` rows of `ah` into L2 (hint 2: prefetcht1). Into L1 they came in
 * bursts that filled the core's queue of misses and stalled it: 128 decodes of 128 tokens, one
 * thread, 28 against 52 ms. */
static inline void ahead_rows(Ahead *ah, int count) {
    for (; count > 0 && ah->left > 0; count--, ah->left--) {
        const size_t off = ((size_t)ah->table[ah->b] * ah->block_size + ah->i) * ah->stride;
        for (int b = 0; b < ah->row_bytes; b += 64) {
            __builtin_prefetch(ah->k + off + b, 0, 2);
            __builtin_prefetch(ah->v + off + b, 0, 2);
        }
        if (++ah->i == ah->block_size) ah->i = 0, ah->b++;
    }
}

/* What a decode reads after head h's last block of keys: the next head's first block, else the
 * first of the decode the thread takes next (attention_part claims it before this one runs). */
static inline Ahead ahead_next(const Args *a, const Scratch *s, const int32_t *table, int h, int n) {
    if (h + 1 < a->num_kv_heads) return ahead_at(a, table, h + 1, 0, n);
    if (s->next_seq >= 0)
        return ahead_at(a, a->block_tables + (size_t)s->next_seq * a->max_blocks, 0, 0, a->seq_lens[s->next_seq]);
    return (Ahead){0};
}

/* The online softmax's step over one block's scores `sr` (exponentiated in place): the row's new
 * maximum and sum, and the factor its running output is scaled by (0 for the first block). */
static inline float softmax_block(float *sr, int cnt, float *row_max, float *row_sum) {
    const float block_max = max_of(sr, cnt);
    const float m = block_max > *row_max ? block_max : *row_max;
    const float corr = expf(*row_max - m);
    *row_sum = *row_sum * corr + exp_shifted(sr, cnt, m);
    *row_max = m;
    return corr;
}

/* One query row over keys [k0, k0 + cnt): scores, the running maximum and sum, and the running
 * output `acc_row` (online softmax). Prompt rows and decodes both go through it, block by block
 * from key 0, so a token's attention is the same bits either way. */
static inline __attribute__((always_inline)) void attend_block(const Args *a, const float *qr, Scratch *s, int k0,
                                                               int cnt, float *row_max, float *row_sum,
                                                               float *acc_row, const int D, const int bf16,
                                                               Ahead *ah) {
    float *sr = s->scores;
    const int per = ah ? (ah->left + (cnt + 7) / 8 - 1) / ((cnt + 7) / 8) : 0; /* evenly over the keys */
    int t = 0;
    for (; t + 8 <= cnt; t += 8) {
        scores8(qr, s->k_rows + k0 + t, D, a->scale, sr + t, bf16);
        if (per) ahead_rows(ah, per);
    }
    if (per) ahead_rows(ah, ah->left);
    for (; t < cnt; t++) sr[t] = dot(qr, s->k_rows[k0 + t], D, bf16) * a->scale;
    const float corr = softmax_block(sr, cnt, row_max, row_sum);
    accumulate_values(sr, s->v_rows + k0, cnt, corr, acc_row, D, bf16);
}
#endif

#if WIDE_BF16
/* attend_block for G query heads of one token (rows of q and acc D apart; G <= HEAD_CHUNK) over
 * the same keys, each key and value row widened once for them all (attention_vec.h). Keys go four
 * at a time, the last four padded with the block's last key, whose extra scores are dropped. Both
 * the prompt and the decode path go through it, so a token's attention is the same bits either way. */
static inline __attribute__((always_inline)) void heads_block(const Args *a, Scratch *s, int k0, int cnt,
                                                            const float *q0, float *acc0, float *row_max,
                                                            float *row_sum, const int D, const int G, Ahead *ah) {
    float scores[HEAD_CHUNK][KEY_BLOCK + 4], corr[HEAD_CHUNK];
    const float *q[HEAD_CHUNK], *p[HEAD_CHUNK];
    float *acc[HEAD_CHUNK], *out[HEAD_CHUNK];
    for (int g = 0; g < G; g++) q[g] = q0 + (size_t)g * D, acc[g] = acc0 + (size_t)g * D, p[g] = scores[g];
    const int per = ah ? (ah->left + (cnt + 3) / 4 - 1) / ((cnt + 3) / 4) : 0; /* evenly over the keys */
    for (int t = 0; t < cnt; t += 4) {
        const void *k[4];
        for (int j = 0; j < 4; j++) k[j] = s->k_rows[k0 + (t + j < cnt ? t + j : cnt - 1)];
        for (int g = 0; g < G; g++) out[g] = scores[g] + t;
        scores4_heads(q, k, D, a->scale, out, G);
        if (per) ahead_rows(ah, per);
    }
    for (int g = 0; g < G; g++) corr[g] = softmax_block(scores[g], cnt, &row_max[g], &row_sum[g]);
    accumulate_values_heads(p, s->v_rows + k0, cnt, corr, acc, D, G);
}

/* heads_block for `n` heads, HEAD_CHUNK at a time, each chunk's G a constant; `ah`, where set,
 * fetched beside them. */
static inline __attribute__((always_inline)) void heads_blocks(const Args *a, Scratch *s, int k0, int cnt,
                                                             const float *q0, float *acc0, float *row_max,
                                                             float *row_sum, const int D, int n, Ahead *ah) {
    for (int g0 = 0; g0 < n; g0 += HEAD_CHUNK) {
        const float *q = q0 + (size_t)g0 * D;
        float *acc = acc0 + (size_t)g0 * D;
        switch (n - g0 < HEAD_CHUNK ? n - g0 : HEAD_CHUNK) {
        case 1: heads_block(a, s, k0, cnt, q, acc, row_max + g0, row_sum + g0, D, 1, ah); break;
        case 2: heads_block(a, s, k0, cnt, q, acc, row_max + g0, row_sum + g0, D, 2, ah); break;
        case 3: heads_block(a, s, k0, cnt, q, acc, row_max + g0, row_sum + g0, D, 3, ah); break;
        default: heads_block(a, s, k0, cnt, q, acc, row_max + g0, row_sum + g0, D, 4, ah); break;
        }
    }
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
#if WIDE_BF16
        if (wide) { /* a token's heads together (heads_block) */
            for (int tok = 0; tok < w.count; tok++) {
                const int n = first_pos + tok + 1 - k0;
                if (n <= 0) continue;
                const int r = tok * group;
                heads_blocks(a, s, k0, n < KEY_BLOCK ? n : KEY_BLOCK, a->q + ROW(r) * D, acc + (size_t)r * D,
                             row_max + r, row_sum + r, D, group, 0);
            }
            continue;
        }
#endif
        for (int r = 0; r < rows; r++) {
            const int n = first_pos + r / group + 1 - k0; /* keys of this block that row r sees */
            if (n <= 0) continue;
            const int cnt = n < KEY_BLOCK ? n : KEY_BLOCK;
            attend_block(a, a->q + ROW(r) * D, s, k0, cnt, &row_max[r], &row_sum[r], acc + (size_t)r * D, D, bf16, 0);
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
#if WIDE_BF16
        if (wide) { /* as a prompt token's rows go (attend_dim), so the same bits */
            const size_t row0 = (size_t)a->query_start[seq] * a->num_heads + (size_t)h * group;
            for (int g = 0; g < group; g++) {
                s->row_max[g] = -INFINITY;
                s->row_sum[g] = 0.f;
            }
            memset(acc, 0, sizeof(float) * D * group);
            for (int k0 = 0; k0 < n; k0 += KEY_BLOCK) {
                /* The rows this thread reads next: this head's next block of keys, else the next
                 * head's first, else the first of the decode it takes next. */
                Ahead ah = k0 + KEY_BLOCK < n ? ahead_at(a, table, h, k0 + KEY_BLOCK, n) : ahead_next(a, s, table, h, n);
                heads_blocks(a, s, k0, n - k0 < KEY_BLOCK ? n - k0 : KEY_BLOCK, a->q + row0 * D, acc, s->row_max,
                             s->row_sum, D, group, &ah);
            }
            for (int g = 0; g < group; g++) {
                const v8 inv = (v8){0} + 1.f / s->row_sum[g];
                float *out = a->out + (row0 + g) * D;
                for (int i = 0; i < D / 8; i++) *(v8 *)(out + 8 * i) = *(const v8 *)(acc + (size_t)g * D + 8 * i) * inv;
            }
            continue;
        }
#endif
        for (int g = 0; g < group; g++) {
            const size_t row = (size_t)a->query_start[seq] * a->num_heads + (size_t)h * group + g;
            float row_max = -INFINITY, row_sum = 0.f;
            memset(acc, 0, sizeof(float) * D);
            for (int k0 = 0; k0 < n; k0 += KEY_BLOCK) {
                /* The group's first head reads the rows from memory, the others from cache: the
                 * first fetches this head's next block of keys, the last the rows read next. */
                Ahead ah = {0};
                if (g == 0 && k0 + KEY_BLOCK < n)
                    ah = ahead_at(a, table, h, k0 + KEY_BLOCK, n);
                else if (g == group - 1 && k0 + KEY_BLOCK >= n)
                    ah = ahead_next(a, s, table, h, n);
                attend_block(a, a->q + row * D, s, k0, n - k0 < KEY_BLOCK ? n - k0 : KEY_BLOCK, &row_max, &row_sum, acc,
                             D, bf16, &ah);
            }
            const v8 inv = (v8){0} + 1.f / row_sum;
            float *out = a->out + row * D;
            for (int i = 0; i < D / 8; i++) *(v8 *)(out + 8 * i) = *(const v8 *)(acc + 8 * i) * inv;
        }
    }
}

#if WIDE_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX (Intel Xeon since Sapphire Rapids): a token's scores for every head on tiles, read from the
 * cache where it lies. A tile of 16 keys' rows of one KV head (rows num_kv_heads * head_dim apart,
 * 32 elements of each) times the group's queries packed as pairs of elements by heads gives the 16
 * keys' scores for the group; no widening of keys to float32 and no sums across lanes, the two
 * costs of the vector path's scores. The softmax then runs with a vector lane per head and the
 * values as the vector path sums them (float32 multiply-adds of widened rows): the tiles would
 * need the values' rows interleaved in pairs of keys, a layout the cache does not have, and
 * interleaving them in registers for vdpbf16ps, with the probabilities rounded to bf16, measured
 * no faster. Each step reads the 64 keys' rows of every head together, so that the next step's
 * prefetches can run beside the whole of this one's work.
 *
 * The queries are rounded to bf16 for the tiles (scores summed in float32): a token's result is
 * the same bits whether it is a decode or a row of a prompt chunk (every token goes through
 * amx_token alone), not the vector path's. The native forward uses it where it measured faster
 * (attention.py); block sizes that are multiples of 16, head sizes of 32, groups up to 16 heads.
 * The default model's native forward, alternated with the vector kernel in one process, timed
 * around each layer's call: 32 decodes of 128 tokens 7.11 -> 5.81 ms of attention a step (the
 * forward 23.3 -> 21.4), 128 decodes 27.2 -> 23.0 (67.2 -> 63.1). */
#define HAVE_AMX_ATTENTION 1
/* Keys per step of the online softmax: four tiles of 16. */
#define AMX_STEP 64

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AttentionTiles;

/* Loaded by each thread before its first item (other AMX code on the thread, the GEMM's or
 * oneDNN's, loads its own). */
static void amx_configure(int group) {
    AttentionTiles cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = group * 4; /* scores: 16 keys by the group's heads */
    cfg.rows[1] = 16, cfg.colsb[1] = 64;        /* keys: 16 rows of 32 elements */
    cfg.rows[2] = 16, cfg.colsb[2] = group * 4; /* queries: 16 pairs of elements by the group's heads */
    _tile_loadconfig(&cfg);
}

/* Byte offsets in a cache of keys [t0, t0 + AMX_STEP) (of n), block by block; returns their count. */
static inline int amx_row_offsets(const int32_t *table, int t0, int n, int block_size, size_t row, size_t *off) {
    const int cnt = n - t0 < AMX_STEP ? n - t0 : AMX_STEP;
    for (int t = 0; t < cnt;) {
        const int key = t0 + t, in = key % block_size;
        const int m = block_size - in < cnt - t ? block_size - in : cnt - t;
        const size_t first = ((size_t)table[key / block_size] * block_size + in) * row;
        for (int i = 0; i < m; i++) off[t + i] = first + (size_t)i * row;
        t += m;
    }
    return cnt;
}

/* One token's every head over keys [0, n) of the sequence with block table `table`: qrow its
 * queries, outrow its outputs (num_heads rows of D). Scores go to s->scores as [AMX_STEP][HP], HP
 * the heads rounded up to 16, a vector lane per head. While a step computes, the next step's key
 * and value rows are prefetched into L2 (at the last step the first rows of s->next_seq), spread
 * over the value loop: a sequence's blocks lie wherever the block manager put them. */
static inline __attribute__((always_inline)) void amx_token(const Args *a, const int32_t *table, int n,
                                                           const float *qrow, float *outrow, Scratch *s,
                                                           const int D) {
    const int H = a->num_heads, KVH = a->num_kv_heads, G = H / KVH, HP = (H + 15) & ~15, bs = a->block_size;
    const size_t row = (size_t)KVH * D * sizeof(uint16_t);
    /* Each KV head's queries as tiles read them: pairs of elements (one uint32) by heads. */
    uint32_t *qp = s->qpack;
    for (int hd = 0; hd < H; hd++) {
        uint32_t pairs[128];
        f32_to_bf16_row(qrow + (size_t)hd * D, (uint16_t *)pairs, D);
        uint32_t *dst = qp + (size_t)(hd / G) * (D / 2) * G + hd % G;
        for (int p = 0; p < D / 2; p++) dst[(size_t)p * G] = pairs[p];
    }
    float *sc = s->scores, *acc = s->acc, *mx = s->row_max, *sm = s->row_sum, *corr = s->corr;
    for (int c = 0; c < HP; c += 16) {
        _mm512_storeu_ps(mx + c, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(sm + c, _mm512_setzero_ps());
    }
    memset(acc, 0, sizeof(float) * H * D);
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int k0 = 0; k0 < n; k0 += AMX_STEP) {
        size_t off[AMX_STEP], next[AMX_STEP];
        const int cnt = amx_row_offsets(table, k0, n, bs, row, off);
        int next_cnt = 0;
        if (k0 + AMX_STEP < n)
            next_cnt = amx_row_offsets(table, k0 + AMX_STEP, n, bs, row, next);
        else if (s->next_seq >= 0)
            next_cnt = amx_row_offsets(a->block_tables + (size_t)s->next_seq * a->max_blocks, 0,
                                       a->seq_lens[s->next_seq], bs, row, next);
        /* Scores, 16 keys a tile: past n the tile reads rows of the same block, whose scores are
         * never used (block_size is a multiple of 16). */
        for (int t = 0; t < cnt; t += 16) {
            const char *keys = (const char *)a->k_cache + off[t];
            for (int h = 0; h < KVH; h++) {
                _tile_zero(0);
                for (int kt = 0; kt < D / 32; kt++) {
                    _tile_loadd(1, keys + (size_t)h * D * sizeof(uint16_t) + kt * 64, row);
                    _tile_loadd(2, qp + ((size_t)h * (D / 2) + kt * 16) * G, G * 4);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, sc + (size_t)t * HP + h * G, HP * 4);
            }
        }
        /* The online softmax, sixteen heads a vector. */
        for (int c = 0; c < HP; c += 16) {
            const __m512 m = _mm512_loadu_ps(mx + c);
            __m512 block_max = _mm512_set1_ps(-INFINITY);
            for (int t = 0; t < cnt; t++) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc + (size_t)t * HP + c), scale);
                _mm512_storeu_ps(sc + (size_t)t * HP + c, x);
                block_max = _mm512_max_ps(block_max, x);
            }
            const __m512 new_max = _mm512_max_ps(m, block_max);
            const __m512 cr = exp16(_mm512_sub_ps(m, new_max));
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < cnt; t++) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + (size_t)t * HP + c), new_max));
                _mm512_storeu_ps(sc + (size_t)t * HP + c, e);
                sum = _mm512_add_ps(sum, e);
            }
            _mm512_storeu_ps(mx + c, new_max);
            _mm512_storeu_ps(sm + c, _mm512_fmadd_ps(_mm512_loadu_ps(sm + c), cr, sum));
            _mm512_storeu_ps(corr + c, cr);
        }
        /* Values: each KV head's rows for its group's heads, up to four heads by 64 elements in
         * registers. */
        for (int h = 0; h < KVH; h++) {
            const char *values = (const char *)a->v_cache + (size_t)h * D * sizeof(uint16_t);
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int gn = G - g0 < 4 ? G - g0 : 4;
                for (int d0 = 0; d0 < D; d0 += 64) {
                    const int nv = D - d0 < 64 ? (D - d0) / 16 : 4;
                    float *acc0 = acc + (size_t)(h * G + g0) * D + d0;
                    __m512 o[4][4];
                    for (int g = 0; g < gn; g++) {
                        const __m512 cg = _mm512_set1_ps(corr[h * G + g0 + g]);
                        for (int i = 0; i < nv; i++) o[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc0 + (size_t)g * D + 16 * i), cg);
                    }
                    for (int t = 0; t < cnt; t++) {
                        /* The next step's rows of this head, a key at a time: spread over the
                         * values' work, not in one burst at the step's start (the kernel alone,
                         * 128 decodes of 128 tokens, 30 layers: 42.5 -> 38.3 ms), into L2 (into
                         * L1: 10% slower, the fill buffers' limit). */
                        if (g0 == 0 && d0 == 0 && t < next_cnt)
                            for (size_t b = (size_t)h * D * 2; b < (size_t)(h + 1) * D * 2; b += 64) {
                                __builtin_prefetch((const char *)a->k_cache + next[t] + b, 0, 2);
                                __builtin_prefetch((const char *)a->v_cache + next[t] + b, 0, 2);
                            }
                        const char *v = values + off[t];
                        __m512 x[4];
                        for (int i = 0; i < nv; i++) x[i] = load16_bf16(v, d0 + 16 * i);
                        const float *p = sc + (size_t)t * HP + h * G + g0;
                        for (int g = 0; g < gn; g++) {
                            const __m512 pg = _mm512_set1_ps(p[g]);
                            for (int i = 0; i < nv; i++) o[g][i] = _mm512_fmadd_ps(pg, x[i], o[g][i]);
                        }
                    }
                    for (int g = 0; g < gn; g++)
                        for (int i = 0; i < nv; i++) _mm512_storeu_ps(acc0 + (size_t)g * D + 16 * i, o[g][i]);
                }
            }
        }
    }
    for (int hd = 0; hd < H; hd++) {
        const __m512 inv = _mm512_set1_ps(1.f / sm[hd]);
        for (int i = 0; i < D; i += 16)
            _mm512_storeu_ps(outrow + (size_t)hd * D + i, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)hd * D + i), inv));
    }
}

/* A work item's tokens one by one through amx_token: a decode, or a tile of a prompt's tokens. */
static inline __attribute__((always_inline)) void amx_item(const Args *a, WorkItem w, Scratch *s, const int D) {
    const int q_start = a->query_start[w.seq], q_len = a->query_start[w.seq + 1] - q_start;
    const int first_pos = a->seq_lens[w.seq] - q_len + w.first;
    const int32_t *table = a->block_tables + (size_t)w.seq * a->max_blocks;
    for (int tok = 0; tok < w.count; tok++) {
        const size_t r = (size_t)(q_start + w.first + tok) * a->num_heads * D;
        amx_token(a, table, first_pos + tok + 1, a->q + r, a->out + r, s, D);
    }
}

static void amx_item_64(const Args *a, WorkItem w, Scratch *s) { amx_item(a, w, s, 64); }
static void amx_item_128(const Args *a, WorkItem w, Scratch *s) { amx_item(a, w, s, 128); }
static void amx_item_any(const Args *a, WorkItem w, Scratch *s) { amx_item(a, w, s, a->head_dim); }
#endif

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

/* An item's rows of out, just written, into out_bf16 (its KV head's heads, or every head). */
static void round_item(const Args *a, WorkItem w) {
    const int width = a->num_heads * a->head_dim, group = a->num_heads / a->num_kv_heads * a->head_dim;
    const int col = w.kv_head < 0 ? 0 : w.kv_head * group, n = w.kv_head < 0 ? width : group;
    for (int r = 0; r < w.count; r++) {
        const size_t row = (size_t)a->query_start[w.seq] + w.first + r;
        f32_to_bf16_row(a->out + row * width + col, a->out_bf16 + row * width + col, n);
    }
}

typedef struct {
    const Args *a;
    void (*attend)(const Args *, WorkItem, Scratch *);
    const WorkItem *items;
    int num_items, max_ctx;
    size_t item_rows;
    void (*decode)(const Args *, int, Scratch *);
    int counter, failed, amx; /* amx: every item by `attend` (amx_item), all heads a token */
} AttentionJob;

static void attention_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    AttentionJob *job = job_;
    const Args *a = job->a;
    const int head_dim = a->head_dim, max_ctx = job->max_ctx, heads = (a->num_heads + 15) & ~15;
    /* Scores of a context or of an AMX step; outputs, maxima and sums of an item's rows or of a
     * token's heads. */
    const size_t scores = (size_t)max_ctx > (size_t)64 * heads ? (size_t)max_ctx : (size_t)64 * heads;
    const size_t rows = job->item_rows > (size_t)heads ? job->item_rows : (size_t)heads;
    Scratch s;
    s.k_rows = malloc(2 * sizeof(void *) * max_ctx);
    s.scores = calloc(scores + rows * (head_dim + 3), sizeof(float));
    s.qpack = malloc(sizeof(uint32_t) * ((size_t)a->num_heads * head_dim / 2 + 1));
    if (!s.k_rows || !s.scores || !s.qpack) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        s.v_rows = s.k_rows + max_ctx;
        s.acc = s.scores + scores;
        s.row_max = s.acc + rows * head_dim;
        s.row_sum = s.row_max + rows;
        s.corr = s.row_sum + rows;
#ifdef HAVE_AMX_ATTENTION
        if (job->amx) amx_configure(a->num_heads / a->num_kv_heads);
#endif
        for (int i = pool_next(&job->counter), next; i < job->num_items; i = next) {
            next = pool_next(&job->counter);
            s.next_seq = next < job->num_items && job->items[next].kv_head < 0 ? job->items[next].seq : -1;
            const WorkItem w = job->items[i];
#ifdef HAVE_DECODE_KERNEL
            if (w.kv_head < 0 && !job->amx)
                job->decode(a, w.seq, &s);
            else
#endif
                job->attend(a, w, &s);
            if (a->out_bf16) round_item(a, w);
        }
    }
    free(s.k_rows);
    free(s.scores);
    free(s.qpack);
}

int paged_attention_amx_supported(int num_heads, int num_kv_heads, int head_dim, int block_size) {
#ifdef HAVE_AMX_ATTENTION
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16 &&
           head_dim % 32 == 0 && block_size % 16 == 0 && gemm_bf16_amx_supported();
#else
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size;
    return 0;
#endif
}

/* q, out: [num_tokens, num_heads, head_dim] float32, the tokens of sequence s at rows
 * [query_start[s], query_start[s + 1]); out_bf16, where set, the same rows rounded to bf16 as
 * to_bf16_rows would (the next GEMM's input, rounded while each item's rows are in cache).
 * k_cache, v_cache: [num_slots, num_kv_heads, head_dim] float32 (is_bf16 = 0) or bfloat16
 * (is_bf16 = 1), already holding the new tokens' keys and values. block_tables: [num_seqs,
 * max_blocks] int32. seq_lens: [num_seqs] int32, the context length after this step's tokens,
 * each >= its query length >= 1. Rows of out (and out_bf16) that belong to no sequence (padding)
 * are left as they are. amx: on AMX tiles (amx_token), which
 * paged_attention_amx_supported must allow. Work is shared among num_threads threads (the caller
 * passes torch's count). Returns 0, -1 when out of memory, -2 for a head_dim that is over 256 or
 * not a multiple of 8, -3 for amx where it is not supported. */
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                    float *out, uint16_t *out_bf16, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int is_bf16, int amx, int num_threads) {
    if (head_dim > 256 || head_dim % 8) return -2;
    if (amx && !(is_bf16 && paged_attention_amx_supported(num_heads, num_kv_heads, head_dim, block_size)))
        return -3;
    const Args a = {q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_heads,
                    num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale, out_bf16};
    void (*attend)(const Args *, WorkItem, Scratch *) =
        is_bf16 ? (head_dim == 64 ? attend_64_bf16 : head_dim == 128 ? attend_128_bf16 : attend_any_bf16)
                : (head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any);
#ifdef HAVE_AMX_ATTENTION
    if (amx) attend = head_dim == 64 ? amx_item_64 : head_dim == 128 ? amx_item_128 : amx_item_any;
#endif
#ifdef HAVE_DECODE_KERNEL
    void (*decode)(const Args *, int, Scratch *) =
        is_bf16 ? (head_dim == 64 ? decode_64_bf16 : head_dim == 128 ? decode_128_bf16 : decode_any_bf16)
                : (head_dim == 64 ? decode_64 : head_dim == 128 ? decode_128 : decode_any);
#endif
    /* Per sequence, a decode (every head, by `decode`) or tiles of QUERY_TILE query tokens, one
     * item per KV head; on AMX a tile's every head. */
    const int heads_items = amx ? 1 : num_kv_heads;
    int num_items = 0, max_ctx = 1;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        num_items += IS_DECODE(q_len) ? 1 : (q_len + QUERY_TILE - 1) / QUERY_TILE * heads_items;
        if (seq_lens[s] > max_ctx) max_ctx = seq_lens[s];
    }
    WorkItem *items = malloc(sizeof(WorkItem) * (num_items ? num_items : 1));
    if (!items) return -1;
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start[s + 1] - query_start[s];
        if (IS_DECODE(q_len)) {
            WorkItem w = {s, -1, 0, 1};
            items[n++] = w;
            continue;
        }
        for (int first = 0; first < q_len; first += QUERY_TILE)
            for (int h = 0; h < heads_items; h++) {
                WorkItem w = {s, amx ? -1 : h, first, q_len - first < QUERY_TILE ? q_len - first : QUERY_TILE};
                items[n++] = w;
            }
    }
    AttentionJob job = {&a, attend, items, num_items, max_ctx, (size_t)QUERY_TILE * (num_heads / num_kv_heads)};
    job.amx = amx;
#ifdef HAVE_DECODE_KERNEL
    job.decode = decode;
#endif
    pool_run(attention_part, &job, num_threads);
    free(items);
    return job.failed ? -1 : 0;
}
