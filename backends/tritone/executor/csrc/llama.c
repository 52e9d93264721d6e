/* The Llama family's whole forward pass on the CPU in one call: fp32, or bf16 weights and KV cache
 * where the CPU has AVX512-BF16 (activations stay fp32 between the GEMMs, whose inputs are
 * rounded to bf16 and whose sums are fp32).
 *
 * Run op by op from Python, even compiled, a decode step of a small model paid about half a
 * millisecond per layer outside the GEMMs and attention (dynamo's wrappers, the custom ops'
 * dispatch, size checks, tensors allocated and freed): 16 ms of a 45 ms step at batch 2 on the
 * default model, 30 ms of 122 at batch 32. Here the layers run back to back on the same kernels
 * (gemm.c, paged_attention.c), with the small work between them done in place on one scratch
 * buffer: RMSNorm fused with the residual add, q/k norm and RoPE fused with the write of the new
 * keys and values into the paged cache, SiLU(gate) * up. Where they can, the kernels do some of it
 * as they write their results (`fused_row_work`): the gate_up GEMM applies SiLU(gate) * up to each
 * pair of its panels (gemm_glu.c) and the attention rounds its output for the o GEMM, which saves
 * a pass over rows that have left the cache, and a wait of the threads at its end (a bf16 decode
 * step of the default model at 128 rows, one process alternating the two: 3.4% faster).
 *
 * The arithmetic follows Hugging Face's modules, so that greedy answers match theirs in fp32:
 * RMSNorm scales by 1 / sqrt(mean(x^2) + eps) and then by its weight; RoPE is
 * x * cos + rotate_half(x) * sin; SiLU is x / (1 + exp(-x)). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "activation.h"
#include "bf16.h"
#include "gemm.h"
#include "kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Rows of elementwise work below which threads cost more than they save. */
#define PARALLEL_ROWS 8

static float sum_squares(const float *x, int n) {
    int i = 0;
    float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out = weight * (x / sqrt(mean(x^2) + eps)); out may be x. */
static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* x * cos + rotate_half(x) * sin over one head, from the position's row of the RoPE table. */
static void rope(const float *x, const float *table_row, float *out, int D) {
    const int half = D / 2;
    const float *cos = table_row, *sin = table_row + half;
    for (int i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
        out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
    }
}

/* n heads of D floats from x, each normed (where norm is set: Qwen3's q/k norm) and rotated for
 * the position's row of the RoPE table, into out. */
static void norm_rope_heads(const float *x, int n, const float *norm, const float *table_row, float *out, int D,
                            float eps) {
    float tmp[512];
    for (int h = 0; h < n; h++) {
        const float *head = x + (size_t)h * D;
        if (norm) {
            rms_norm(head, norm, tmp, D, eps);
            head = tmp;
        }
        rope(head, table_row, out + (size_t)h * D, D);
    }
}

/* Token t's queries into q_out, and its keys and values into the cache at its slot (rounded to
 * bf16 for a bf16 cache, as torch's conversion rounds). */
static void qkv_to_cache(const LlamaModel *m, const LlamaLayer *l, const float *qkv_row, int64_t position,
                         int64_t slot, float *q_out) {
    const int D = m->head_dim, H = m->num_heads, KV = m->num_kv_heads;
    const float *table_row = m->rope + (size_t)position * D;
    const float *k = qkv_row + (size_t)H * D, *v = k + (size_t)KV * D;
    norm_rope_heads(qkv_row, H, l->q_norm, table_row, q_out, D, m->eps);
    const size_t at = (size_t)slot * KV * D;
    if (!m->bf16) {
        norm_rope_heads(k, KV, l->k_norm, table_row, (float *)l->k_cache + at, D, m->eps);
        memcpy((float *)l->v_cache + at, v, sizeof(float) * KV * D);
        return;
    }
    float keys[KV * D];
    norm_rope_heads(k, KV, l->k_norm, table_row, keys, D, m->eps);
    f32_to_bf16_row(keys, (uint16_t *)l->k_cache + at, KV * D);
    f32_to_bf16_row(v, (uint16_t *)l->v_cache + at, KV * D);
}

/* A GEMM's input x [T, K] as the model's kernel reads it: x itself (fp32), or x rounded to bf16
 * into the scratch x_bf16. */
static const void *gemm_input(const LlamaModel *m, const float *x, uint16_t *x_bf16, int T, int K, int num_threads) {
    if (!m->bf16) return x;
    to_bf16_rows(x, x_bf16, T, K, num_threads);
    return x_bf16;
}

/* out [T, N] = a [T, K] @ the linear's panels (+ bias), a as gemm_input gives it. */
static void linear_of(const LlamaModel *m, const void *a, const void *panels, const float *bias, float *out, int T,
                      int K, int N, int num_threads) {
    if (m->bf16 == BF16_AMX)
        gemm_bf16_amx(a, panels, bias, out, T, K, N, num_threads);
    else if (m->bf16)
        gemm_bf16(a, panels, bias, out, T, K, N, num_threads);
    else
        gemm_f32(a, panels, bias, out, T, K, N, num_threads);
}

/* out [T, N] = x [T, K] @ the linear's panels (+ bias), in the model's dtype. */
static void linear(const LlamaModel *m, const float *x, uint16_t *x_bf16, const void *panels, const float *bias,
                   float *out, int T, int K, int N, int num_threads) {
    linear_of(m, gemm_input(m, x, x_bf16, T, K, num_threads), panels, bias, out, T, K, N, num_threads);
}

/* out [T, N] += each token's adapter's low-rank product of a [T, K] (as linear_of takes it): all
 * slots' A at once, the columns of other slots than the token's zeroed, then B (lora.py). A token
 * of the base model gets +0. x_bf16 is overwritten (B's input); lora_scratch holds T * (lora_cols
 * + N) floats. */
static void lora_add(const LlamaModel *m, const LlamaBatch *b, const LoraLinear *lo, const void *a, uint16_t *x_bf16,
                     float *lora_scratch, float *out, int T, int K, int N, int num_threads) {
    if (!b->lora_mask || !lo->a) return;
    const int S = m->lora_slots, w = lo->width, cols = S * w;
    float *xa = lora_scratch, *delta = lora_scratch + (size_t)T * m->lora_cols;
    linear_of(m, a, lo->a, 0, xa, T, K, cols, num_threads);
    for (int t = 0; t < T; t++)
        for (int s = 0; s < S; s++)
            if (b->lora_mask[(size_t)t * S + s] == 0.0f) memset(xa + (size_t)t * cols + (size_t)s * w, 0, sizeof(float) * w);
    linear(m, xa, x_bf16, lo->b, 0, delta, T, cols, N, num_threads);
    for (size_t i = 0; i < (size_t)T * N; i++) out[i] += delta[i];
}

/* One step's buffers and the layer at hand, for the row-parallel work between the GEMMs. */
typedef struct {
    const LlamaModel *m;
    const LlamaBatch *b;
    const LlamaLayer *l;
    const float *norm; /* the RMSNorm weight of add_norm_row */
    float *residual, *normed, *out, *queries, *wide, *act;
    uint16_t *x_bf16;
    int qkv_size, q_size;
} Rows;

/* Row t of x [T, K], just written, rounded into the next GEMM's bf16 input (as gemm_input would,
 * but while the row is in cache and without a pass of its own); nothing for an fp32 model. */
static void to_gemm_input_row(const Rows *r, const float *x, int64_t t, int K) {
    if (r->m->bf16) f32_to_bf16_gemm_row(x + (size_t)t * K, r->x_bf16 + (size_t)t * (K + (K & 1)), K);
}

/* Token t's embedding into the residual (zeros where another rank holds its row). */
static void embed_only_row(void *r_, int64_t t) {
    const Rows *r = r_;
    const LlamaModel *m = r->m;
    const int Hd = m->hidden;
    float *res = r->residual + (size_t)t * Hd;
    const int64_t row = r->b->ids[t] - m->vocab_start;
    if (row < 0 || row >= m->vocab_rows)
        memset(res, 0, sizeof(float) * Hd);
    else if (m->bf16)
        bf16_to_f32_row((const uint16_t *)m->embed + (size_t)row * Hd, res, Hd);
    else
        memcpy(res, (const float *)m->embed + (size_t)row * Hd, sizeof(float) * Hd);
}

/* The first layer's norm of token t's embedding. */
static void first_norm_row(void *r_, int64_t t) {
    const Rows *r = r_;
    const LlamaModel *m = r->m;
    const int Hd = m->hidden;
    rms_norm(r->residual + (size_t)t * Hd, m->layers[0].input_norm, r->normed + (size_t)t * Hd, Hd, m->eps);
    to_gemm_input_row(r, r->normed, t, Hd);
}

/* Token t's embedding into the residual, and its first norm. */
static void embed_row(void *r_, int64_t t) {
    embed_only_row(r_, t);
    first_norm_row(r_, t);
}

/* residual += out and normed = norm(residual) with r->norm, at row t. */
static void add_norm_row(void *r_, int64_t t) {
    const Rows *r = r_;
    const int n = r->m->hidden;
    float *res = r->residual + (size_t)t * n;
    const float *o = r->out + (size_t)t * n;
    for (int j = 0; j < n; j++) res[j] += o[j];
    rms_norm(res, r->norm, r->normed + (size_t)t * n, n, r->m->eps);
    to_gemm_input_row(r, r->normed, t, n);
}

static void qkv_row(void *r_, int64_t t) {
    const Rows *r = r_;
    qkv_to_cache(r->m, r->l, r->wide + (size_t)t * r->qkv_size, r->b->positions[t], r->b->slots[t],
                 r->queries + (size_t)t * r->q_size);
}

static void silu_mul_row(void *r_, int64_t t) {
    const Rows *r = r_;
    const int I = r->m->intermediate;
    const float *gate = r->wide + (size_t)t * 2 * I;
    silu_mul(gate, gate + I, r->act + (size_t)t * I, I);
    to_gemm_input_row(r, r->act, t, I);
}

/* The kernel of the model's fused gate_up GEMM and activation (gemm_glu), NULL where it does not
 * apply: not asked for, or an intermediate size that is not whole panels. */
static const Kernel *glu_kernel_of(const LlamaModel *m) {
    if (!m->fused_row_work) return 0;
    const Kernel *kn = m->bf16 ? gemm_bf16_kernel(m->bf16 == BF16_AMX, m->hidden) : &gemm_kernel_f32;
    return gemm_glu_supported(kn, m->intermediate) ? kn : 0;
}

/* Floats per token of the scratch that holds a layer's QKV rows, or its gate_up rows and the
 * activation after them. */
static size_t wide_floats(const LlamaModel *m) {
    const size_t qkv = (size_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim, mlp = 3 * (size_t)m->intermediate;
    return qkv > mlp ? qkv : mlp;
}

/* Floats of scratch space `llama_forward` needs for num_tokens tokens. */
size_t llama_scratch_floats(const LlamaModel *m, int num_tokens) {
    const size_t T = num_tokens > 0 ? num_tokens : 1;
    const size_t q = (size_t)m->num_heads * m->head_dim;
    size_t widest_in = (size_t)m->hidden > q ? (size_t)m->hidden : q;
    widest_in = widest_in > (size_t)m->intermediate ? widest_in : (size_t)m->intermediate;
    /* residual, normed, out, queries, attention output, gate_up with the activation after it,
     * a GEMM's input in bf16 (two to a float, rows padded to even), and LoRA's products */
    const size_t lora = m->lora_slots ? (size_t)m->lora_cols + wide_floats(m) + (size_t)m->hidden : 0;
    return T * (3 * (size_t)m->hidden + 2 * q + wide_floats(m) + (widest_in + 2) / 2 + lora);
}

/* Runs the model over b's tokens, writing their keys and values into each layer's cache, and
 * the logits of rows b->logits_rows into logits [num_logits, vocab], or, where greedy_ids is
 * set, only each such row's greedy token into greedy_ids [num_logits] (logits unused). scratch
 * holds llama_scratch_floats(m, b->num_tokens) floats. Returns paged_attention's or
 * gemm_f32_argmax's error, else 0. */
static int forward(const LlamaModel *m, const LlamaBatch *b, float *scratch, float *logits, int64_t *greedy_ids,
                   int num_threads) {
    const int T = b->num_tokens, Hd = m->hidden, I = m->intermediate;
    const int q_size = m->num_heads * m->head_dim, qkv_size = q_size + 2 * m->num_kv_heads * m->head_dim;
    float *residual = scratch, *normed = residual + (size_t)T * Hd, *out = normed + (size_t)T * Hd;
    float *queries = out + (size_t)T * Hd, *attn = queries + (size_t)T * q_size;
    float *wide = attn + (size_t)T * q_size; /* qkv rows, or gate_up rows and the activation */
    float *act = wide + (size_t)T * 2 * I;
    uint16_t *x_bf16 = (uint16_t *)(wide + (size_t)T * wide_floats(m));
    size_t widest_in = (size_t)Hd > (size_t)q_size ? (size_t)Hd : (size_t)q_size;
    widest_in = widest_in > (size_t)I ? widest_in : (size_t)I;
    float *lora_scratch = (float *)x_bf16 + (size_t)T * ((widest_in + 2) / 2);

    Rows rows = {m, b, 0, 0, residual, normed, out, queries, wide, act, x_bf16, qkv_size, q_size};
    /* The GEMM input that the row work before a linear has already rounded (see to_gemm_input_row). */
    const void *normed_in = m->bf16 ? (const void *)x_bf16 : normed, *act_in = m->bf16 ? (const void *)x_bf16 : act;
    if (m->all_reduce) {
        pool_for(T, PARALLEL_ROWS, embed_only_row, &rows, num_threads);
        m->all_reduce(m->all_reduce_ctx, residual, (int64_t)T * Hd);
        pool_for(T, PARALLEL_ROWS, first_norm_row, &rows, num_threads);
    } else {
        pool_for(T, PARALLEL_ROWS, embed_row, &rows, num_threads);
    }
    const Kernel *glu_kernel = glu_kernel_of(m);
    /* the attention's output rounded by the attention itself, for the o GEMM */
    uint16_t *attn_bf16 = m->fused_row_work && m->bf16 ? x_bf16 : 0;
    for (int i = 0; i < m->num_layers; i++) {
        const LlamaLayer *l = &m->layers[i];
        rows.l = l;
        linear_of(m, normed_in, l->qkv, l->qkv_bias, wide, T, Hd, qkv_size, num_threads);
        lora_add(m, b, &l->lora_qkv, normed_in, x_bf16, lora_scratch, wide, T, Hd, qkv_size, num_threads);
        pool_for(T, PARALLEL_ROWS, qkv_row, &rows, num_threads);
        const int rc = paged_attention(queries, l->k_cache, l->v_cache, b->block_tables, b->query_start, b->seq_lens,
                                       attn, attn_bf16, b->num_seqs, m->num_heads, m->num_kv_heads, m->head_dim,
                                       b->block_size, b->max_blocks, m->scale, m->bf16 != 0, m->attention_amx,
                                       num_threads);
        if (rc) return rc;
        if (attn_bf16)
            linear_of(m, attn_bf16, l->o, l->o_bias, out, T, q_size, Hd, num_threads);
        else
            linear(m, attn, x_bf16, l->o, l->o_bias, out, T, q_size, Hd, num_threads);
        lora_add(m, b, &l->lora_o, m->bf16 ? (const void *)x_bf16 : attn, x_bf16, lora_scratch, out, T, q_size, Hd,
                 num_threads);
        if (m->all_reduce) m->all_reduce(m->all_reduce_ctx, out, (int64_t)T * Hd);
        rows.norm = l->post_norm;
        pool_for(T, PARALLEL_ROWS, add_norm_row, &rows, num_threads);
        /* the down GEMM's input: the activations, in bf16 where the model is */
        const void *down_in = act_in;
        if (glu_kernel && !(b->lora_mask && l->lora_gate_up.a)) {
            /* bf16 activations into the gate_up rows' space, free here: x_bf16 is the GEMM's input */
            if (m->bf16) down_in = wide;
            if (gemm_glu(glu_kernel, normed_in, l->gate_up, l->gate_up_bias, (void *)down_in, m->bf16 != 0, T, Hd, I,
                         num_threads))
                return -1;
        } else {
            linear_of(m, normed_in, l->gate_up, l->gate_up_bias, wide, T, Hd, 2 * I, num_threads);
            lora_add(m, b, &l->lora_gate_up, normed_in, x_bf16, lora_scratch, wide, T, Hd, 2 * I, num_threads);
            pool_for(T, PARALLEL_ROWS, silu_mul_row, &rows, num_threads);
        }
        linear_of(m, down_in, l->down, l->down_bias, out, T, I, Hd, num_threads);
        lora_add(m, b, &l->lora_down, down_in, x_bf16, lora_scratch, out, T, I, Hd, num_threads);
        if (m->all_reduce) m->all_reduce(m->all_reduce_ctx, out, (int64_t)T * Hd);
        if (i + 1 < m->num_layers) {
            rows.norm = m->layers[i + 1].input_norm;
            pool_for(T, PARALLEL_ROWS, add_norm_row, &rows, num_threads);
        }
    }
    /* The last layer's residual add and the final norm only at the rows that are sampled. */
    for (int s = 0; s < b->num_logits; s++) {
        const int64_t t = b->logits_rows[s];
        float *r = residual + (size_t)t * Hd, *dst = normed + (size_t)s * Hd;
        const float *o = out + (size_t)t * Hd;
        for (int j = 0; j < Hd; j++) dst[j] = r[j] + o[j];
        rms_norm(dst, m->final_norm, dst, Hd, m->eps);
    }
    if (!greedy_ids) {
        linear(m, normed, x_bf16, m->lm_head, 0, logits, b->num_logits, Hd, m->vocab, num_threads);
        return 0;
    }
    const void *a = gemm_input(m, normed, x_bf16, b->num_logits, Hd, num_threads);
    if (m->bf16 == BF16_AMX)
        return gemm_bf16_amx_argmax(a, m->lm_head, greedy_ids, b->num_logits, Hd, m->vocab, num_threads);
    return m->bf16 ? gemm_bf16_argmax(a, m->lm_head, greedy_ids, b->num_logits, Hd, m->vocab, num_threads)
                   : gemm_f32_argmax(a, m->lm_head, greedy_ids, b->num_logits, Hd, m->vocab, num_threads);
}

/* forward() (above), its workers waiting for each next section without sleeping (pool.c). */
int llama_forward(const LlamaModel *m, const LlamaBatch *b, float *scratch, float *logits, int64_t *greedy_ids,
                  int num_threads) {
    pool_warm_begin();
    const int rc = forward(m, b, scratch, logits, greedy_ids, num_threads);
    pool_warm_end();
    return rc;
}

/* sizeof LlamaLayer, LlamaModel and LlamaBatch, which native.py's ctypes mirrors must match. */
void llama_struct_sizes(size_t sizes[3]) {
    sizes[0] = sizeof(LlamaLayer);
    sizes[1] = sizeof(LlamaModel);
    sizes[2] = sizeof(LlamaBatch);
}
