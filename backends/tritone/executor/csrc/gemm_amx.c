/* AMX (Intel Xeon since Sapphire Rapids): gemm_bf16's panels and rows multiplied on tiles. Built
 * only for a CPU with AMX; elsewhere only gemm_bf16_amx_supported (0) remains. */
#include <stddef.h>
#include <stdint.h>
#include "bf16.h"
#include "gemm.h"
#include "kernels.h"

#if defined(HAVE_AMX)
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

/* Loaded once per item and row count (`configured` below), never kept from one GEMM call to the
 * next: other AMX code on the same threads (oneDNN's bf16 GEMMs) loads its own configuration or
 * releases the tiles, after which a tile instruction without a new configuration faults (SIGILL).
 * Loading it at every block of rows cost 20% to 40% at 128 to 384 rows (K 576 and 1536). */
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

/* Rows [0, mr) (mr <= 32) of A times one panel into c, prefetching share `share` of `shares` of
 * `next` over the K loop: each k step's lines [32 share / shares, 32 (share + 1) / shares). */
static void block_amx(const uint16_t *a, int K, const uint16_t *panel, float *c, int ldc, int ncols,
                      const float *bias, int mr, const uint16_t *next, int share, int shares) {
    const int r0 = mr < 16 ? mr : 16, r1 = mr - r0;
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const size_t a_stride = (size_t)K * 2, p_stride = NR_BF16 * 2 * 2;
    for (int k = 0; k < K; k += 32) {
        const uint16_t *b = panel + (size_t)k * NR_BF16; /* pair row k / 2 */
        /* Into L2 (prefetcht1), not L1: the next panel is read there by tile loads anyway, and
         * lines pulled into L1 a panel early only evict this block's rows of A. A step's linears
         * and LM head, cold weights, alternated in one process: 1 row 7.02 -> 6.28 ms, 32 rows
         * 9.48 -> 8.27, 128 rows 24.0 -> 22.5 (the LM head 1.82 -> 1.61, 2.76 -> 2.31, 7.39 ->
         * 7.02). prefetchnta measured 2.4x slower. */
        if (next)
            for (int line = 32 * share / shares; line < 32 * (share + 1) / shares; line++)
                __builtin_prefetch((const char *)(next + (size_t)k * NR_BF16) + line * 64, 0, 2);
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

/* The row count the tiles are configured for on this thread; -1: unknown. An item's panels run
 * back to back with no other code between them, so the configuration holds from its first panel
 * to its last; an item starts unknown (other AMX code, oneDNN's, may have run on this thread). */
static __thread int configured = -1;

static void begin_amx(void) { configured = -1; }

static void panel_rows_amx(const void *a_, int M, int K, int N, const void *panel_, float *c, int ncols,
                           const float *bias, const void *next_) {
    const uint16_t *a = a_, *panel = panel_, *next = next_;
    /* Every block of rows fetches its share of the next panel: all of it from the first block's
     * pass alone, 32 prefetches a k step, stalled on the core's line fill buffers (a step's
     * linears at 128 rows, alternated in one process: 22.1 -> 20.7 ms, the LM head 6.8 -> 6.4). */
    const int blocks = (M + MR_AMX - 1) / MR_AMX;
    for (int m = 0; m < M; m += MR_AMX) {
        const int mr = M - m < MR_AMX ? M - m : MR_AMX;
        if (mr != configured) {
            configure_tiles(mr < 16 ? mr : 16, mr < 16 ? 0 : mr - 16);
            configured = mr;
        }
        block_amx(a + (size_t)m * K, K, panel, c + (size_t)m * N, N, ncols, bias, mr, next, m / MR_AMX, blocks);
    }
}

const Kernel gemm_kernel_amx = {NR_BF16, MR_AMX, sizeof(uint16_t), 2, panel_rows_amx, begin_amx};
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
