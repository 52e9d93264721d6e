/* What gemm.c's driver and its kernels share: the kernels' geometry and the plan of a GEMM's work.
 * Internal to csrc/; kernels.h declares what is exported. */
#ifndef TRITONE_GEMM_H
#define TRITONE_GEMM_H
#include <stddef.h>
#include <stdint.h>

#define NR_BF16 32 /* columns per bf16 panel (both the AVX512-BF16 and the AMX kernels) */
/* Panels per claim: runs long enough to stream from memory in order, short enough that the
 * threads finish together. GEMMs of few panels and enough rows claim them one at a time
 * (gemm_plan). */
#define CHUNK 4

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#endif

/* One kernel's geometry for the shared driver. `rows` computes rows [0, M) of A times one panel
 * into c (rows of N floats, ncols of them valid), adding bias where set, prefetching `next`. */
typedef struct {
    int nr, mr;            /* columns per panel, rows per tile */
    size_t elem;           /* bytes per element of A and of a panel */
    int k_pad;             /* K rounded up to a multiple of this in A's rows and in panels */
    void (*rows)(const void *a, int M, int K, int N, const void *panel, float *c, int ncols, const float *bias,
                 const void *next);
    void (*begin)(void);   /* where set, called before an item's first panel (AMX: tiles not yet configured) */
} Kernel;

extern const Kernel gemm_kernel_f32; /* gemm_tiles.c */
#if defined(__AVX512BF16__)
extern const Kernel gemm_kernel_bf16; /* gemm_tiles.c */
#endif
#if defined(HAVE_AMX)
extern const Kernel gemm_kernel_amx; /* gemm_amx.c */
#endif

/* The bf16 kernel for a reduction of K: AMX's where asked for, allowed and K is whole tiles of
 * it; NULL where the CPU has no bf16 kernel. */
const Kernel *gemm_bf16_kernel(int amx, int K);

/* Work shared by gemm_* and gemm_*_argmax: item i is run i % chunks of `chunk` panels over row
 * block i / chunks. */
typedef struct {
    const Kernel *kn;
    int M, K, N, Kp, P, chunk, chunks, mc, items;
    size_t panel_bytes, a_row_bytes;
} Plan;

Plan gemm_plan(const Kernel *kn, int M, int K, int N);

/* The panel a thread computes after panel p of its run [.., end): the next in the run, else the
 * first of its next item's run, else P (none). */
static inline int panel_after(const Plan *pl, int p, int end, int next_item) {
    return p + 1 < end ? p + 1 : next_item < pl->items ? next_item % pl->chunks * pl->chunk : pl->P;
}

/* Runs item `item` of `pl`: its panels' products into c (rows of ldc), each at its columns, or,
 * where per_panel is set, each at c's column 0 and handed to per_panel(ctx, ...) before the next
 * panel overwrites it. next_item is the thread's following item, for prefetching. */
void gemm_run_item(const Plan *pl, const void *a, const void *panels, const float *bias, float *c, int ldc,
                   int item, int next_item, void (*per_panel)(void *, int p, int m0, int mb, int ncols), void *ctx);

/* Where gemm_glu runs: the kernel exists and the intermediate size is whole panels of it, so that
 * up panel p is gate_up's panel P + p. */
int gemm_glu_supported(const Kernel *kn, int intermediate);

/* out [M, intermediate] = SiLU(A @ gate) * (A @ up), from a gate_up linear's panels (the gate's
 * columns, then the up's, each intermediate wide; bias [2 * intermediate] or NULL), the same
 * values bit for bit as the GEMM into gate_up rows and silu_mul over them; float32 rows, or where
 * bf16_out, bf16 rows as to_bf16_rows writes them. Returns -1 where scratch cannot be allocated,
 * -2 where !gemm_glu_supported, else 0. */
int gemm_glu(const Kernel *kn, const void *a, const void *panels, const float *bias, void *out, int bf16_out, int M,
             int K, int intermediate, int num_threads);

#endif
