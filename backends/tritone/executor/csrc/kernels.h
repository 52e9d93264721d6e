/* What the kernels' C files share: every function the library exports and the native forward
 * pass's structures, declared once. Each C file includes it, so that the compiler checks every
 * definition against its declaration and every call against it. Python cannot read a header:
 * kernels.py gives ctypes the functions' signatures and native.py mirrors the structures, both by
 * hand from this file (test_executor checks the structures' sizes against the library's). */
#ifndef TRITONE_KERNELS_H
#define TRITONE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The kernels' threads (pool.c). */

/* Runs fn(ctx, thread, num_threads) for thread = 0 .. num_threads - 1, thread 0 on the caller,
 * and returns when every call has returned: on the pool's threads inside a native forward pass
 * (pool_warm_begin), else on OpenMP's team. fn takes its work from a shared counter (pool_next),
 * never a share fixed by thread, so that it does all of it whatever num_threads it gets: a call
 * made while the pool is busy (from another thread, or from inside fn) runs fn once on the
 * caller, with num_threads 1. */
void pool_run(void (*fn)(void *ctx, int thread, int num_threads), void *ctx, int num_threads);

/* body(ctx, i) for i in [0, n), the indices taken in chunks from a shared counter; on the caller
 * alone where n < min_parallel. */
void pool_for(int64_t n, int64_t min_parallel, void (*body)(void *ctx, int64_t i), void *ctx, int num_threads);

/* Around a native forward pass (or the sampling after one), whose sections then run on the pool. */
void pool_warm_begin(void);
void pool_warm_end(void);

/* The next index of a shared counter, for fn's that take their work items from one. */
static inline int pool_next(int *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

/* Linear layers on weights packed in column panels, fp32 and bf16 (gemm.c). */
int gemm_bf16_supported(void);
int gemm_bf16_amx_supported(void);
void to_bf16_rows(const float *x, uint16_t *out, int M, int K, int num_threads);
void gemm_f32(const float *a, const float *panels, const float *bias, float *c, int M, int K, int N,
              int num_threads);
void gemm_bf16(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
               int num_threads);
int gemm_f32_argmax(const float *a, const float *panels, int64_t *out, int M, int K, int N, int num_threads);
int gemm_bf16_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                     int num_threads);
void gemm_bf16_amx(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
                   int num_threads);
int gemm_bf16_amx_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                         int num_threads);

/* Attention over the paged KV cache (paged_attention.c). */
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                    float *out, uint16_t *out_bf16, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int is_bf16, int amx, int num_threads);
/* 1 where paged_attention's amx path runs here: AMX built and granted, head_dim a multiple of 32,
 * groups of up to 16 query heads, block_size a multiple of 16. */
int paged_attention_amx_supported(int num_heads, int num_kv_heads, int head_dim, int block_size);

/* The sampler's row work (argmax.c, sample.c). */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);
int sample_rows(const float *x, int64_t rows, int64_t n, const float *inv_temp, const double *u, int64_t *out,
                int num_threads);
int top_p_rows(float *x, int64_t rows, int64_t n, const float *top_p, int num_threads);

/* The Llama family's forward pass (llama.c). */

/* One decoder layer's weights: norms and biases as float32 vectors, linears as gemm.c's panels of
 * the model's dtype; biases, q_norm and k_norm may be NULL. k_cache, v_cache: [num_slots,
 * num_kv_heads, head_dim] of the model's dtype. */
/* A linear's LoRA adapters stacked side by side (lora.py): a, panels of [in, slots * width]; b,
 * panels of [slots * width, out] (each adapter's scale folded in); a NULL: no adapter adapts it. */
typedef struct {
    const void *a, *b;
    int width;
} LoraLinear;

typedef struct {
    const float *input_norm;
    const void *qkv;
    const float *qkv_bias, *q_norm, *k_norm;
    const void *o;
    const float *o_bias, *post_norm;
    const void *gate_up;
    const float *gate_up_bias;
    const void *down;
    const float *down_bias;
    void *k_cache, *v_cache;
    LoraLinear lora_qkv, lora_o, lora_gate_up, lora_down;
} LlamaLayer;

/* Under tensor parallelism: adds x [n] over the ranks, in place (the runner's collective). */
typedef void (*AllReduceFn)(void *ctx, float *x, int64_t n);

/* All-reduce through shared memory between the ranks of one host (shm_comm.c). */
typedef struct {
    int rank, size;
    int64_t chunk;   /* floats per slot: a longer call goes in pieces */
    uint64_t calls;  /* this rank's calls so far */
    void *seq;       /* each rank's published call count, a cache line each */
    float *data;     /* [size][2][chunk] slots */
} ShmComm;

size_t shm_comm_bytes(int size, int64_t chunk);
void shm_comm_init(ShmComm *c, void *base, int rank, int size, int64_t chunk);
/* An AllReduceFn, ctx a ShmComm; with n == 0, a barrier. */
void shm_all_reduce(void *ctx, float *x, int64_t n);

/* One rank's part of the model under tensor parallelism (tensor_parallel.py): num_heads,
 * num_kv_heads, intermediate and vocab are the rank's, embed holds the vocabulary rows
 * [vocab_start, vocab_start + vocab_rows), and all_reduce adds the partial sums after o_proj,
 * down_proj and the embedding, called with all_reduce_ctx; all_reduce NULL: the whole model,
 * vocab_start 0. */
#define BF16_AMX 2
typedef struct {
    int num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, vocab;
    int bf16;                /* weights' panels, embeddings and KV cache in bf16 (BF16_AMX: its GEMMs on AMX
                              * tiles), else float32 */
    int vocab_start, vocab_rows;
    AllReduceFn all_reduce;
    void *all_reduce_ctx;
    float eps, scale;
    const void *embed;       /* [vocab, hidden] */
    const float *rope;       /* [max_positions, head_dim]: cos in the first half, sin in the second */
    const float *final_norm; /* [hidden] */
    const void *lm_head;     /* panels of [hidden, vocab] */
    const LlamaLayer *layers;
    int lora_slots;          /* LoRA adapter slots (0: none loaded) */
    int lora_cols;           /* the widest linear's slots * width */
    int attention_amx;       /* paged_attention on AMX tiles (its amx argument) */
    int fused_row_work;      /* row work between two kernels done by the first as it writes, rather than by a
                              * pass of its own: SiLU(gate) * up by the gate_up GEMM (gemm_glu.c) where it
                              * can, the attention's output rounded to bf16 by the attention; the same bits */
} LlamaModel;

/* One step's packed batch, as the runner lays it out for paged_attention. */
typedef struct {
    const int64_t *ids, *positions, *slots, *logits_rows;
    const int32_t *block_tables, *query_start, *seq_lens;
    int num_tokens, num_seqs, max_blocks, block_size, num_logits;
    const float *lora_mask; /* [num_tokens, lora_slots]: each token's adapter slot, one-hot (NULL: none) */
} LlamaBatch;

size_t llama_scratch_floats(const LlamaModel *m, int num_tokens);
int llama_forward(const LlamaModel *m, const LlamaBatch *b, float *scratch, float *logits, int64_t *greedy_ids,
                  int num_threads);
void llama_struct_sizes(size_t sizes[3]);

#endif
