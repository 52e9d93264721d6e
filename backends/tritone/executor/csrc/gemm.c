/* fp32 linear layers for the CPU: C[M, N] = A[M, K] @ W (+ bias), W packed in column panels.
 *
 * A decode step reads every weight once: hundreds of megabytes that never stay in cache, so
 * the GEMMs of serving wait on memory far more than on arithmetic, and a library GEMM tuned for
 * weights in cache runs well below its peak on them. Here each thread, while it works on one
 * panel, prefetches the next it will take, so streaming overlaps the arithmetic.
 *
 * Layout: panel p holds columns [16p, 16p + 16) as K rows of 16 floats (zero padded past N),
 * one 64-byte cache line per k. A 6 x 16 tile keeps twelve 8-float accumulators in registers
 * (the classic AVX2 register block: 12 accumulators, 2 weight vectors, 1 broadcast).
 *
 * bf16 (where the CPU has AVX512-BF16): A rounded to bf16, W packed in panels of 32 columns as
 * pairs of k (the operand layout of vdpbf16ps, which multiplies two bf16 pairs per fp32 lane),
 * sums in fp32. It takes the same panel scheme as the fp32 one below (one driver serves both).
 *
 * AMX (where the CPU has it): the bf16 panels and rows again, multiplied on tiles (panel_rows_amx).
 *
 * Plain C with GCC/Clang vector extensions, no torch headers; threads from pool.c. */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "kernels.h"

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

#define NR 16
#define MR 6
/* Panels per claim: runs long enough to stream from memory in order, short enough that the
 * threads finish together. */
#define CHUNK 4

/* Rows [0, mr) of A times one panel (K x 16) into c. `next`, when set, is the panel computed
 * after this one: this pass prefetches its lines pf_first, pf_first + pf_step, ..., one per k
 * row it reaches, so that the panel's passes over row tiles together fetch it all, evenly over
 * the time they take (fetched in the first pass alone, it came in a burst that the memory
 * could not deliver in time: batch-32 linears of a decode step took 70 ms, 60 ms spread). */
static inline __attribute__((always_inline)) void tile(const float *a, int K, const float *panel, float *c,
                                                       int ldc, int ncols, const float *bias, int mr,
                                                       const float *next, int pf_first, int pf_step) {
    v8 acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = (v8){0};
        acc[r][1] = (v8){0};
    }
    int pf = next ? pf_first : K;
    for (int k = 0; k < K; k++) {
        const v8 b0 = *(const v8 *)(panel + (size_t)k * NR);
        const v8 b1 = *(const v8 *)(panel + (size_t)k * NR + 8);
        if (k == pf) {
            __builtin_prefetch(next + (size_t)k * NR, 0, 3);
            pf += pf_step;
        }
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                const float s = a[(size_t)r * K + k];
                const v8 av = {s, s, s, s, s, s, s, s};
                acc[r][0] += av * b0;
                acc[r][1] += av * b1;
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float *out = c + (size_t)r * ldc;
        if (ncols == NR) { /* a whole panel's row: two vector stores, not sixteen scalar ones */
            *(v8 *)out = bias ? acc[r][0] + *(const v8 *)bias : acc[r][0];
            *(v8 *)(out + 8) = bias ? acc[r][1] + *(const v8 *)(bias + 8) : acc[r][1];
            continue;
        }
        float row[NR];
        *(v8 *)row = acc[r][0];
        *(v8 *)(row + 8) = acc[r][1];
        if (bias)
            for (int j = 0; j < ncols; j++) out[j] = row[j] + bias[j];
        else
            for (int j = 0; j < ncols; j++) out[j] = row[j];
    }
}

/* Each case is its own copy of `tile` with a constant row count, fully unrolled. */
#define TILE(n) tile(a + (size_t)m * K, K, panel, c + (size_t)m * N, N, ncols, bias, n, next, m / MR, tiles)

static void panel_rows_f32(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                           const float *bias, const void *next_) {
    const float *a = a_, *panel = panel_, *next = next_;
    const int tiles = (M + MR - 1) / MR;
    int m = 0;
    for (; m + MR <= M; m += MR) TILE(MR);
    switch (M - m) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    }
}

#if defined(__AVX512BF16__)
#define NR_BF16 32
/* 12 x 32: 24 accumulators of the 32 vector registers, 2 for the weights' pairs, 1 broadcast. */
#define MR_BF16 12

/* Rows [0, mr) of A (bf16 pairs, K2 per row) times one bf16 panel (K2 rows of 32 pairs) into c;
 * prefetching as `tile`, two cache lines per row of pairs. */
static inline __attribute__((always_inline)) void tile_bf16(const uint32_t *a, int K2, const uint16_t *panel,
                                                            float *c, int ldc, int ncols, const float *bias, int mr,
                                                            const uint16_t *next, int pf_first, int pf_step) {
    __m512 acc[MR_BF16][2];
    for (int r = 0; r < MR_BF16; r++) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    int pf = next ? pf_first : K2;
    for (int k = 0; k < K2; k++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 2 * NR_BF16);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + (size_t)k * 2 * NR_BF16 + NR_BF16);
        if (k == pf) {
            __builtin_prefetch(next + (size_t)k * 2 * NR_BF16, 0, 3);
            __builtin_prefetch(next + (size_t)k * 2 * NR_BF16 + NR_BF16, 0, 3);
            pf += pf_step;
        }
        for (int r = 0; r < MR_BF16; r++) {
            if (r < mr) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[(size_t)r * K2 + k]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
            }
        }
    }
    const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
    const __mmask16 hi = ncols >= NR_BF16 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int r = 0; r < mr; r++) {
        float *out = c + (size_t)r * ldc;
        __m512 v0 = acc[r][0], v1 = acc[r][1];
        if (bias) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(lo, bias));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(hi, bias + 16));
        }
        _mm512_mask_storeu_ps(out, lo, v0);
        _mm512_mask_storeu_ps(out + 16, hi, v1);
    }
}

#define TILE_BF16(n) \
    tile_bf16(a + (size_t)m * K2, K2, panel, c + (size_t)m * N, N, ncols, bias, n, next, m / MR_BF16, tiles)

static void panel_rows_bf16(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                            const float *bias, const void *next_) {
    const uint32_t *a = a_;
    const uint16_t *panel = panel_, *next = next_;
    const int K2 = (K + 1) / 2, tiles = (M + MR_BF16 - 1) / MR_BF16;
    int m = 0;
    for (; m + MR_BF16 <= M; m += MR_BF16) TILE_BF16(MR_BF16);
    switch (M - m) {
    case 1: TILE_BF16(1); break;
    case 2: TILE_BF16(2); break;
    case 3: TILE_BF16(3); break;
    case 4: TILE_BF16(4); break;
    case 5: TILE_BF16(5); break;
    case 6: TILE_BF16(6); break;
    case 7: TILE_BF16(7); break;
    case 8: TILE_BF16(8); break;
    case 9: TILE_BF16(9); break;
    case 10: TILE_BF16(10); break;
    case 11: TILE_BF16(11); break;
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* AMX (Intel Xeon since Sapphire Rapids): the same bf16 panels and A rows as gemm_bf16, multiplied
 * on tiles. A block of up to 32 rows takes four accumulator tiles (two row halves by the panel's
 * two halves of 16 columns), two tiles of A and two of the panel; each step of the reduction takes
 * 32 values of k. Every row's sum runs over k in the same blocks and order whatever the row count
 * or the row's place in the block, so a row's result never depends on the rows beside it. K must
 * be a multiple of 32 (gemm_bf16_amx falls back to gemm_bf16's kernel where it is not). */
#define MR_AMX 32

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Loaded at every block, never cached per thread: other AMX code on the same threads (oneDNN's
 * bf16 GEMMs) loads its own configuration or releases the tiles, after which a tile instruction
 * without a new configuration faults (SIGILL). */
static inline void configure_tiles(int r0, int r1) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = r0;  /* C and A, rows [0, r0) of the block */
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = r1;  /* C and A, rows [16, 16 + r1) */
    cfg.rows[6] = cfg.rows[7] = 16;                /* the panel: 16 rows of pairs, 16 columns each */
    if (!r1) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
    _tile_loadconfig(&cfg);
}

/* Rows [0, mr) (mr <= 32) of A times one panel into c, prefetching `next` over the K loop. */
static void block_amx(const uint16_t *a, int K, const uint16_t *panel, float *c, int ldc, int ncols,
                      const float *bias, int mr, const uint16_t *next) {
    const int r0 = mr < 16 ? mr : 16, r1 = mr - r0;
    configure_tiles(r0, r1);
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const size_t a_stride = (size_t)K * 2, p_stride = NR_BF16 * 2 * 2;
    for (int k = 0; k < K; k += 32) {
        const uint16_t *b = panel + (size_t)k * NR_BF16; /* pair row k / 2 */
        if (next)
            for (int line = 0; line < 32; line++)
                __builtin_prefetch((const char *)(next + (size_t)k * NR_BF16) + line * 64, 0, 3);
        _tile_loadd(6, b, p_stride);
        _tile_loadd(7, b + NR_BF16, p_stride);
        _tile_loadd(4, a + k, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (r1) {
            _tile_loadd(5, a + (size_t)16 * K + k, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (ncols == NR_BF16 && !bias) {
        _tile_stored(0, c, (size_t)ldc * 4);
        _tile_stored(1, c + 16, (size_t)ldc * 4);
        if (r1) {
            _tile_stored(2, c + (size_t)16 * ldc, (size_t)ldc * 4);
            _tile_stored(3, c + (size_t)16 * ldc + 16, (size_t)ldc * 4);
        }
        return;
    }
    float buf[MR_AMX][NR_BF16];
    _tile_stored(0, buf[0], sizeof buf[0]);
    _tile_stored(1, buf[0] + 16, sizeof buf[0]);
    if (r1) {
        _tile_stored(2, buf[16], sizeof buf[0]);
        _tile_stored(3, buf[16] + 16, sizeof buf[0]);
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < ncols; j++) c[(size_t)r * ldc + j] = buf[r][j] + (bias ? bias[j] : 0.0f);
}

static void panel_rows_amx(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                           const float *bias, const void *next_) {
    const uint16_t *a = a_, *panel = panel_, *next = next_;
    for (int m = 0; m < M; m += MR_AMX)
        block_amx(a + (size_t)m * K, K, panel, c + (size_t)m * N, N, ncols, bias, M - m < MR_AMX ? M - m : MR_AMX,
                  m ? 0 : next); /* the first block's pass fetches the next panel for all */
}
#endif

/* 1 where gemm_bf16_amx runs on AMX here: built for such a CPU, and the kernel lets this
 * process use the tiles (Linux asks each process to request them once). */
int gemm_bf16_amx_supported(void) {
#if defined(HAVE_AMX)
    static int granted = -1;
    if (granted < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
#else
    return 0;
#endif
}

/* 1 where gemm_bf16 and gemm_bf16_argmax run here (built for a CPU with AVX512-BF16). */
int gemm_bf16_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const float *x;
    uint16_t *out;
    int K;
} ToBf16;

static void to_bf16_row(void *job_, int64_t m) {
    const ToBf16 *job = job_;
    const int K = job->K;
    f32_to_bf16_gemm_row(job->x + (size_t)m * K, job->out + (size_t)m * (K + (K & 1)), K);
}

/* x [M, K] float32 into out [M, K rounded up to even] bf16, rounded to nearest even, the pad
 * column zero: gemm_bf16's A. */
void to_bf16_rows(const float *x, uint16_t *out, int M, int K, int num_threads) {
    ToBf16 job = {x, out, K};
    pool_for(M, 8, to_bf16_row, &job, num_threads);
}

/* One kernel's geometry for the shared driver below. */
typedef struct {
    int nr, mr;            /* columns per panel, rows per tile */
    size_t elem;           /* bytes per element of A and of a panel */
    int k_pad;             /* K rounded up to a multiple of this in A's rows and in panels */
    void (*rows)(const void *a, int M, int K, int N, const void *panel, float *c, int ncols, const float *bias,
                 const void *next);
} Kernel;

static const Kernel F32 = {NR, MR, sizeof(float), 1, panel_rows_f32};
#if defined(__AVX512BF16__)
static const Kernel BF16 = {NR_BF16, MR_BF16, sizeof(uint16_t), 2, panel_rows_bf16};
#endif
#if defined(HAVE_AMX)
static const Kernel AMX = {NR_BF16, MR_AMX, sizeof(uint16_t), 2, panel_rows_amx};
#endif

/* The bf16 kernel for a reduction of K: AMX's where asked for, allowed and K is whole tiles of it. */
static const Kernel *bf16_kernel(int amx, int K) {
#if defined(HAVE_AMX)
    if (amx && K % 32 == 0 && gemm_bf16_amx_supported()) return &AMX;
#endif
    (void)amx, (void)K;
#if defined(__AVX512BF16__)
    return &BF16;
#else
    return 0;
#endif
}

/* Rows are taken in blocks of about A_BLOCK_BYTES of A, every panel for one block before the
 * next: a panel's passes then read their rows of A from the core's own L2 rather than all of A
 * from the shared L3, at the price of reading each weight once per block (from L3, or memory
 * for weights larger than it). Blocks of 192 KB measured best of 96 to 320 KB (fp32: a decode
 * step's 121 linears, cold weights, 2 threads: 128 rows 231 -> 209 ms, 512 rows 855 -> 800 ms;
 * 32 rows, one block, unchanged). */
#define A_BLOCK_BYTES (192 << 10)

/* Rows per block: about A_BLOCK_BYTES of A, whole tiles of mr, at most M. */
static int rows_per_block(int M, size_t row_bytes, int mr) {
    int mc = (int)(A_BLOCK_BYTES / row_bytes) / mr * mr;
    if (mc < mr) mc = mr;
    return mc > M ? M : mc;
}

/* The panel a thread computes after panel p of its run [.., end): the next in the run, else the
 * first of its next item's run, else P (none). */
static inline int panel_after(int p, int end, int next_item, int items, int chunks, int P) {
    return p + 1 < end ? p + 1 : next_item < items ? next_item % chunks * CHUNK : P;
}

/* Work shared by gemm_* and gemm_*_argmax: item i is run i % chunks of panels over row block
 * i / chunks. */
typedef struct {
    const Kernel *kn;
    int M, K, N, Kp, P, chunks, mc, items;
    size_t panel_bytes, a_row_bytes;
} Plan;

static Plan plan(const Kernel *kn, int M, int K, int N) {
    Plan p = {kn, M, K, N};
    p.Kp = (K + kn->k_pad - 1) / kn->k_pad * kn->k_pad;
    p.P = (N + kn->nr - 1) / kn->nr;
    p.chunks = (p.P + CHUNK - 1) / CHUNK;
    p.a_row_bytes = (size_t)p.Kp * kn->elem;
    p.panel_bytes = (size_t)p.Kp * kn->nr * kn->elem;
    p.mc = rows_per_block(M, p.a_row_bytes, kn->mr);
    p.items = (M + p.mc - 1) / p.mc * p.chunks;
    return p;
}

/* Runs item `item` of `pl`: its panels' products into c (rows of ldc), each at its columns, or,
 * where per_panel is set, each at c's column 0 and handed to per_panel(ctx, ...) before the next
 * panel overwrites it. next_item is the thread's following item, for prefetching. */
static void run_item(const Plan *pl, const void *a, const void *panels, const float *bias, float *c, int ldc,
                     int item, int next_item, void (*per_panel)(void *, int p, int m0, int mb, int ncols),
                     void *ctx) {
    const int chunk = item % pl->chunks, m0 = item / pl->chunks * pl->mc;
    const int mb = pl->M - m0 < pl->mc ? pl->M - m0 : pl->mc;
    const int end = (chunk + 1) * CHUNK < pl->P ? (chunk + 1) * CHUNK : pl->P;
    const int nr = pl->kn->nr;
    for (int p = chunk * CHUNK; p < end; p++) {
        const int q = panel_after(p, end, next_item, pl->items, pl->chunks, pl->P);
        const char *panel = (const char *)panels + (size_t)p * pl->panel_bytes;
        const char *next = q < pl->P ? (const char *)panels + (size_t)q * pl->panel_bytes : 0;
        const int ncols = pl->N - p * nr < nr ? pl->N - p * nr : nr;
        float *dst = per_panel ? c : c + (size_t)m0 * ldc + (size_t)p * nr;
        pl->kn->rows((const char *)a + (size_t)m0 * pl->a_row_bytes, mb, pl->K, ldc, panel, dst, ncols,
                     bias ? bias + (size_t)p * nr : 0, next);
        if (per_panel) per_panel(ctx, p, m0, mb, ncols);
    }
}

typedef struct {
    Plan pl;
    const void *a, *panels;
    const float *bias;
    float *c;
    int counter;
} GemmJob;

static void gemm_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    GemmJob *job = job_;
    int item = pool_next(&job->counter);
    while (item < job->pl.items) {
        const int next_item = pool_next(&job->counter);
        run_item(&job->pl, job->a, job->panels, job->bias, job->c, job->pl.N, item, next_item, 0, 0);
        item = next_item;
    }
}

/* Threads take runs of CHUNK panels from a shared counter rather than fixed halves: on a machine
 * where the server's other processes share the engine's cores, a thread that the kernel preempts
 * would otherwise leave its partner waiting at the end of every GEMM for the rest of its half.
 * Each thread claims its next run before computing the current one, so that it knows what to
 * prefetch. */
static void gemm_run(const Kernel *kn, const void *a, const void *panels, const float *bias, float *c, int M, int K,
                     int N, int num_threads) {
    if (M <= 0) return;
    GemmJob job = {plan(kn, M, K, N), a, panels, bias, c, 0};
    pool_run(gemm_part, &job, num_threads);
}

/* a: [M, K], panels: ceil(N / 16) x K x 16 floats, bias: [N] or NULL, c: [M, N]; all contiguous. */
void gemm_f32(const float *a, const float *panels, const float *bias, float *c, int M, int K, int N,
              int num_threads) {
    gemm_run(&F32, a, panels, bias, c, M, K, N, num_threads);
}

/* a: [M, K rounded up to even] bf16 (to_bf16_rows), panels: ceil(N / 32) x ceil(K / 2) x 32 x 2
 * bf16 (panel p, pair row k, column j: W[2k, 32p + j], W[2k + 1, 32p + j], zero padded), bias:
 * [N] float32 or NULL, c: [M, N] float32. Nothing where gemm_bf16_supported() is 0. */
void gemm_bf16(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
               int num_threads) {
    const Kernel *kn = bf16_kernel(0, K);
    if (kn) gemm_run(kn, a, panels, bias, c, M, K, N, num_threads);
}

/* gemm_bf16 on AMX tiles (same operands); gemm_bf16's kernel where K % 32 or AMX is missing. */
void gemm_bf16_amx(const uint16_t *a, const uint16_t *panels, const float *bias, float *c, int M, int K, int N,
                   int num_threads) {
    const Kernel *kn = bf16_kernel(1, K);
    if (kn) gemm_run(kn, a, panels, bias, c, M, K, N, num_threads);
}

/* Folds rows [0, mb) of a panel's product (buf, rows of nr floats, the first ncols valid; column
 * col0 first) into each row's running maximum and its column. Strictly greater: the first of
 * equal values stays, and NaN is never taken. */
static void fold_max(const float *buf, int nr, int mb, int ncols, int col0, float *best, int32_t *best_col) {
    for (int r = 0; r < mb; r++) {
        const float *row = buf + (size_t)r * nr;
        float m = best[r];
        if (ncols == nr) { /* mostly nothing beats the row's maximum so far: one vector test per 8 */
            const v8 mv = {m, m, m, m, m, m, m, m};
            v8i greater = (v8i){0};
            for (int j = 0; j < nr; j += 8) greater |= *(const v8 *)(row + j) > mv;
            int any = 0;
            for (int lane = 0; lane < 8; lane++) any |= greater[lane];
            if (!any) continue;
        }
        int32_t col = best_col[r];
        for (int j = 0; j < ncols; j++)
            if (row[j] > m) {
                m = row[j];
                col = col0 + j;
            }
        best[r] = m;
        best_col[r] = col;
    }
}

typedef struct {
    const float *buf;
    int nr;
    float *best;
    int32_t *best_col;
} ArgmaxCtx;

static void fold_panel(void *ctx_, int p, int m0, int mb, int ncols) {
    (void)m0;
    ArgmaxCtx *ctx = ctx_;
    fold_max(ctx->buf, ctx->nr, mb, ncols, p * ctx->nr, ctx->best, ctx->best_col);
}

typedef struct {
    Plan pl;
    const void *a, *panels;
    float *part;       /* each item's rows' maximum over its run of panels: [chunks, M] */
    int32_t *part_col; /* and its column */
    int counter, failed;
} ArgmaxJob;

static void argmax_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    ArgmaxJob *job = job_;
    const Plan *pl = &job->pl;
    const int mc = pl->mc, nr = pl->kn->nr, M = pl->M;
    /* the product of one panel and a block of rows, then the block's running maxima */
    float *buf = malloc(sizeof(float) * (size_t)mc * (nr + 1) + sizeof(int32_t) * (size_t)mc);
    if (!buf) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    ArgmaxCtx ctx = {buf, nr, buf + (size_t)mc * nr, 0};
    ctx.best_col = (int32_t *)(ctx.best + mc);
    int item = pool_next(&job->counter);
    while (item < pl->items) {
        const int next_item = pool_next(&job->counter);
        const int chunk = item % pl->chunks, m0 = item / pl->chunks * mc;
        const int mb = M - m0 < mc ? M - m0 : mc;
        for (int r = 0; r < mb; r++) {
            ctx.best[r] = -INFINITY;
            ctx.best_col[r] = -1;
        }
        run_item(pl, job->a, job->panels, 0, buf, nr, item, next_item, fold_panel, &ctx);
        memcpy(job->part + (size_t)chunk * M + m0, ctx.best, sizeof(float) * mb);
        memcpy(job->part_col + (size_t)chunk * M + m0, ctx.best_col, sizeof(int32_t) * mb);
        item = next_item;
    }
    free(buf);
}

/* out[m] = argmax over n of (A @ W)[m, n], with the GEMM's arithmetic (so the values compared
 * are the ones it would write) but without writing the product: a greedy step's logits are
 * [rows, vocab], 50 MB at 256 rows of a 49,152-token vocabulary, written by the LM head and
 * read back by the argmax. Ties go to the lowest index and NaN is never chosen, as
 * argmax_rows; a row with nothing above -inf gets 0. Returns -1 where scratch cannot be
 * allocated. */
static int argmax_run(const Kernel *kn, const void *a, const void *panels, int64_t *out, int M, int K, int N,
                      int num_threads) {
    if (M <= 0) return 0;
    ArgmaxJob job = {plan(kn, M, K, N), a, panels};
    const int chunks = job.pl.chunks;
    job.part = malloc(sizeof(float) * (size_t)M * chunks);
    job.part_col = malloc(sizeof(int32_t) * (size_t)M * chunks);
    int failed = !job.part || !job.part_col;
    if (!failed) {
        pool_run(argmax_part, &job, num_threads);
        failed = job.failed;
    }
    if (!failed)
        for (int r = 0; r < M; r++) {
            float m = -INFINITY;
            int32_t col = -1;
            for (int ch = 0; ch < chunks; ch++)
                if (job.part[(size_t)ch * M + r] > m) {
                    m = job.part[(size_t)ch * M + r];
                    col = job.part_col[(size_t)ch * M + r];
                }
            out[r] = col < 0 ? 0 : col;
        }
    free(job.part);
    free(job.part_col);
    return failed ? -1 : 0;
}

int gemm_f32_argmax(const float *a, const float *panels, int64_t *out, int M, int K, int N, int num_threads) {
    return argmax_run(&F32, a, panels, out, M, K, N, num_threads);
}

/* gemm_bf16's argmax, as gemm_f32_argmax; -2 where gemm_bf16_supported() is 0. */
int gemm_bf16_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                     int num_threads) {
    const Kernel *kn = bf16_kernel(0, K);
    return kn ? argmax_run(kn, a, panels, out, M, K, N, num_threads) : -2;
}

/* gemm_bf16_amx's argmax, as gemm_bf16_argmax. */
int gemm_bf16_amx_argmax(const uint16_t *a, const uint16_t *panels, int64_t *out, int M, int K, int N,
                         int num_threads) {
    const Kernel *kn = bf16_kernel(1, K);
    return kn ? argmax_run(kn, a, panels, out, M, K, N, num_threads) : -2;
}
