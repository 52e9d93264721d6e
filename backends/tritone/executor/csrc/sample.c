/* One categorical draw per row from softmax(x * inv_temperature): the sampler's random tokens.
 *
 * The torch path drew one exponential per vocabulary entry per row from the request's own
 * generator and raced them (Gumbel-max): at 128 rows of a 49,152-token vocabulary that was
 * 141 ms of noise a step, more than the sorting that top-p needs. Here each row takes one
 * uniform u from its request's generator (drawn by the caller) and walks the inverse of its
 * distribution's cumulative sum: the first token whose running sum of exp(x - max) exceeds
 * u times the total. Two passes over the row, sums in double. Tokens at -inf (removed by
 * top-k, top-p, min-p or a ban) have probability 0 and are never drawn; NaN neither. */
#include <math.h>
#include <stdint.h>
#include "vexp.h"

#define BLOCK 8

/* exp((x[j] - max) * inv_temp) for the eight entries of a block, summed in float, and each
 * entry's own value in e. Both passes call it, so that their block sums agree exactly. */
static inline float block_weights(const float *x, float max, float inv_temp, float *e) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(max)), _mm256_set1_ps(inv_temp));
    /* -inf and NaN weigh nothing: exp8 clamps its input, so they are zeroed here. */
    const __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    _mm256_storeu_ps(e, _mm256_and_ps(exp8(v), keep));
#else
    for (int i = 0; i < BLOCK; i++) {
        const float v = (x[i] - max) * inv_temp;
        e[i] = v >= -87.0f ? expf(v) : 0.0f;
    }
#endif
    return ((e[0] + e[4]) + (e[1] + e[5])) + ((e[2] + e[6]) + (e[3] + e[7]));
}

static int64_t sample_row(const float *x, int64_t n, float inv_temp, double u) {
    float max = -INFINITY;
    for (int64_t j = 0; j < n; j++) max = x[j] > max ? x[j] : max;
    if (max == -INFINITY) return 0; /* nothing drawable: the caller's bans left no token */
    if (max == INFINITY) /* an infinite logit takes all the mass */
        for (int64_t j = 0; j < n; j++)
            if (x[j] == INFINITY) return j;
    const int64_t whole = n / BLOCK * BLOCK;
    float e[BLOCK];
    double total = 0.0;
    for (int64_t j = 0; j < whole; j += BLOCK) total += block_weights(x + j, max, inv_temp, e);
    double tail[BLOCK];
    for (int64_t j = whole; j < n; j++) {
        const float v = (x[j] - max) * inv_temp;
        tail[j - whole] = v >= -87.0f ? expf(v) : 0.0;
        total += tail[j - whole];
    }
    const double target = u * total;
    double running = 0.0;
    int64_t last = -1; /* the last token of nonzero weight passed, should rounding overshoot */
    for (int64_t j = 0; j < whole; j += BLOCK) {
        const float sum = block_weights(x + j, max, inv_temp, e);
        if (sum > 0.0f) {
            if (running + sum > target)
                for (int i = 0; i < BLOCK; i++) {
                    if (e[i] <= 0.0f) continue;
                    running += e[i];
                    last = j + i;
                    if (running > target) return last;
                }
            else
                running += sum;
            for (int i = BLOCK - 1; i >= 0 && last < j; i--)
                if (e[i] > 0.0f) last = j + i;
        }
    }
    for (int64_t j = whole; j < n; j++)
        if (tail[j - whole] > 0.0) {
            running += tail[j - whole];
            last = j;
            if (running > target) return last;
        }
    return last < 0 ? 0 : last;
}

/* x: [rows, n] float32 logits, contiguous; inv_temp, u: [rows] (u uniform in [0, 1));
 * out: [rows] int64. */
void sample_rows(const float *x, int64_t rows, int64_t n, const float *inv_temp, const double *u, int64_t *out,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = sample_row(x + r * n, n, inv_temp[r], u[r]);
}
