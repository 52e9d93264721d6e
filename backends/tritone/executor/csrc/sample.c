/* The sampler's row work: one categorical draw per row from softmax(x * inv_temperature)
 * (sample_rows), and top-p without sorting the vocabulary (top_p_rows, below).
 *
 * The torch path drew one exponential per vocabulary entry per row from the request's own
 * generator and raced them (Gumbel-max): at 128 rows of a 49,152-token vocabulary that was
 * 141 ms of noise a step. Here each row takes one
 * uniform u from its request's generator (drawn by the caller) and walks the inverse of its
 * distribution's cumulative sum: the first token whose running sum of exp(x - max) exceeds
 * u times the total. The weights are computed once, summed per span of 64 tokens (kept) and in
 * double over the row; the walk then reads the span sums and recomputes the weights of the span
 * it lands in only. Tokens at -inf (removed by
 * top-k, top-p, min-p or a ban) have probability 0 and are never drawn; NaN neither. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vexp.h"
#include "kernels.h"

#define BLOCK 8

/* exp(v), or 0 below -87 (where exp would go denormal) and for -inf and NaN: a token's weight. */
static inline float weight(float v) { return v >= -87.0f ? expf(v) : 0.0f; }

/* The largest value of x[0, n), NaN ignored (max_ps returns its second operand for a NaN). */
static float row_max(const float *x, int64_t n) {
    int64_t j = 0;
    float max = -INFINITY;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + j), m);
    max = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + j), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) max = lanes[i] > max ? lanes[i] : max;
#endif
    for (; j < n; j++) max = x[j] > max ? x[j] : max;
    return max;
}

/* exp((x[j] - max) * inv_temp) for the eight entries of a block, summed in float, and each
 * entry's own value in e. Both passes call it, so that their block sums agree exactly. */
static inline float block_weights(const float *x, float max, float inv_temp, float *e) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(max)), _mm256_set1_ps(inv_temp));
    /* -inf and NaN weigh nothing: exp8 clamps its input, so they are zeroed here. */
    const __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    _mm256_storeu_ps(e, _mm256_and_ps(exp8(v), keep));
#else
    for (int i = 0; i < BLOCK; i++) e[i] = weight((x[i] - max) * inv_temp);
#endif
    return ((e[0] + e[4]) + (e[1] + e[5])) + ((e[2] + e[6]) + (e[3] + e[7]));
}

/* sample_row's unit: one weight sum is kept per span, so that the walk to the drawn token reads
 * the sums and recomputes the weights of one span only (the sums pass is the one exp pass). */
#define SPAN 64

#if defined(__AVX2__) && defined(__FMA__)
/* ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) */
static inline float sum8(__m256 s) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 u = _mm_add_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehl_ps(u, u)));
}
#endif

/* The weights exp((x[i] - max) * inv_temp) of one span (into e, unless NULL) and their sum, in
 * one order on every width: lane l of sixteen sums entries l, 16 + l, 32 + l, 48 + l in turn,
 * lanes l and 8 + l are added, then sum8. -inf and NaN weigh nothing (exp clamps its input, so
 * they are zeroed here). */
static inline float span_weights(const float *x, float max, float inv_temp, float *e) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < SPAN; k += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(max)),
                                       _mm512_set1_ps(inv_temp));
        const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), exp16(v));
        if (e) _mm512_storeu_ps(e + k, w);
        acc = _mm512_add_ps(acc, w);
    }
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int k = 0; k < SPAN; k += 16) {
        __m256 w[2];
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + k + 8 * h), _mm256_set1_ps(max)),
                                           _mm256_set1_ps(inv_temp));
            w[h] = _mm256_and_ps(exp8(v), _mm256_cmp_ps(v, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
            if (e) _mm256_storeu_ps(e + k + 8 * h, w[h]);
        }
        lo = _mm256_add_ps(lo, w[0]);
        hi = _mm256_add_ps(hi, w[1]);
    }
    return sum8(_mm256_add_ps(lo, hi));
#else
    float lanes[16] = {0}, own[SPAN];
    if (!e) e = own;
    for (int i = 0; i < SPAN; i++) {
        e[i] = weight((x[i] - max) * inv_temp);
        lanes[i % 16] += e[i];
    }
    float s[8];
    for (int l = 0; l < 8; l++) s[l] = lanes[l] + lanes[8 + l];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
#endif
}

/* sums: room for n / SPAN floats. */
static int64_t sample_row(const float *x, int64_t n, float inv_temp, double u, float *sums) {
    const float max = row_max(x, n);
    if (max == -INFINITY) return 0; /* nothing drawable: the caller's bans left no token */
    if (max == INFINITY) /* an infinite logit takes all the mass */
        for (int64_t j = 0; j < n; j++)
            if (x[j] == INFINITY) return j;
    const int64_t spans = n / SPAN, whole = spans * SPAN;
    double total = 0.0;
    for (int64_t b = 0; b < spans; b++) total += sums[b] = span_weights(x + b * SPAN, max, inv_temp, NULL);
    double tail[SPAN];
    for (int64_t j = whole; j < n; j++) {
        tail[j - whole] = weight((x[j] - max) * inv_temp);
        total += tail[j - whole];
    }
    const double target = u * total;
    double running = 0.0;
    /* The last token of nonzero weight passed, should rounding overshoot: `last`, or where a span
     * was passed whole by its sum, the last such token of span `pending`. */
    int64_t last = -1, pending = -1;
    float e[SPAN];
    for (int64_t b = 0; b < spans; b++) {
        const float sum = sums[b];
        if (!(sum > 0.0f)) continue;
        if (running + sum > target) {
            span_weights(x + b * SPAN, max, inv_temp, e);
            for (int i = 0; i < SPAN; i++) {
                if (e[i] <= 0.0f) continue;
                running += e[i];
                last = b * SPAN + i;
                if (running > target) return last;
            }
            pending = -1;
        } else {
            running += sum;
            pending = b;
        }
    }
    for (int64_t j = whole; j < n; j++)
        if (tail[j - whole] > 0.0) {
            running += tail[j - whole];
            last = j, pending = -1;
            if (running > target) return last;
        }
    if (pending >= 0) {
        span_weights(x + pending * SPAN, max, inv_temp, e);
        for (int i = SPAN - 1; i >= 0; i--)
            if (e[i] > 0.0f) return pending * SPAN + i;
    }
    return last < 0 ? 0 : last;
}

/* Span sums a row keeps on its thread's stack: vocabularies up to 256K tokens; larger ones use
 * sample_rows' heap_sums. */
#define STACK_SPANS 4096

typedef struct {
    const float *x;
    int64_t n;
    const float *inv_temp;
    const double *u;
    int64_t *out;
    float *heap_sums;
} SampleRows;

static void sample_one(void *job_, int64_t r) {
    const SampleRows *job = job_;
    float stack_sums[STACK_SPANS];
    float *sums = job->n / SPAN < STACK_SPANS ? stack_sums : job->heap_sums + (size_t)r * (job->n / SPAN + 1);
    job->out[r] = sample_row(job->x + r * job->n, job->n, job->inv_temp[r], job->u[r], sums);
}

/* x: [rows, n] float32 logits, contiguous; inv_temp, u: [rows] (u uniform in [0, 1));
 * out: [rows] int64. */
int sample_rows(const float *x, int64_t rows, int64_t n, const float *inv_temp, const double *u, int64_t *out,
                int num_threads) {
    SampleRows job = {x, n, inv_temp, u, out, NULL};
    if (n / SPAN >= STACK_SPANS && !(job.heap_sums = malloc(sizeof(float) * (size_t)rows * (size_t)(n / SPAN + 1))))
        return -1;
    pool_for(rows, 2, sample_one, &job, num_threads);
    free(job.heap_sums);
    return 0;
}

/* Floats in an order-preserving unsigned key: ascending keys, ascending values. */
static inline uint32_t order_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

#define TOP_P_BUCKETS 4096 /* by a key's top 12 bits */

typedef struct {
    float value;
    int32_t index;
} Entry;

static int by_value_descending(const void *a, const void *b) {
    const float x = ((const Entry *)a)->value, y = ((const Entry *)b)->value;
    if (x != y) return x < y ? 1 : -1;
    const int32_t i = ((const Entry *)a)->index, j = ((const Entry *)b)->index;
    return i < j ? -1 : i > j;
}

/* Top-p of one row in place: a token stays while the tokens more likely than it hold less than
 * top_p of the row's mass (the most likely always stays); the others become -inf. The tokens'
 * weights go into buckets by their value's top bits, the bucket where the mass from the top
 * passes top_p is sorted, and only its tokens are decided one by one. Returns -1 when out of
 * memory. */
static int top_p_row(float *x, int64_t n, float top_p, double *mass, Entry **boundary, int64_t *capacity) {
    const float max = row_max(x, n);
    if (max == -INFINITY || !(max < INFINITY)) return 0;
    memset(mass, 0, sizeof(double) * TOP_P_BUCKETS);
    double total = 0.0;
    const int64_t whole = n / BLOCK * BLOCK;
    float e[BLOCK];
    for (int64_t j = 0; j < whole; j += BLOCK) {
        total += block_weights(x + j, max, 1.0f, e); /* -inf and NaN weigh nothing */
        for (int i = 0; i < BLOCK; i++)
            if (e[i] > 0.0f) mass[order_key(x[j + i]) >> 20] += e[i];
    }
    for (int64_t j = whole; j < n; j++) {
        const float w = weight(x[j] - max);
        if (w > 0.0f) mass[order_key(x[j]) >> 20] += w;
        total += w;
    }
    const double target = (double)top_p * total;
    double above = 0.0;
    int b = TOP_P_BUCKETS - 1;
    for (; b > 0 && above + mass[b] < target; b--) above += mass[b];
    /* Buckets above b stay whole, those below go; bucket b's tokens are ranked. */
    int64_t count = 0;
    for (int64_t j = 0; j < n; j++) {
        if (!(x[j] > -INFINITY)) {
            x[j] = -INFINITY;
            continue;
        }
        const int bucket = (int)(order_key(x[j]) >> 20);
        if (bucket < b) {
            x[j] = -INFINITY;
        } else if (bucket == b) {
            if (count == *capacity) {
                const int64_t grown = *capacity ? 2 * *capacity : 1024;
                Entry *more = realloc(*boundary, sizeof(Entry) * grown);
                if (!more) return -1;
                *boundary = more;
                *capacity = grown;
            }
            (*boundary)[count].value = x[j];
            (*boundary)[count++].index = (int32_t)j;
        }
    }
    qsort(*boundary, count, sizeof(Entry), by_value_descending);
    for (int64_t i = 0; i < count; i++) {
        const Entry e = (*boundary)[i];
        if (above >= target && e.value < max) x[e.index] = -INFINITY;
        above += weight(e.value - max);
    }
    return 0;
}

typedef struct {
    float *x;
    int64_t rows, n;
    const float *top_p;
    int64_t next;
    int failed;
} TopPJob;

static void top_p_part(void *job_, int thread, int num_threads) {
    (void)thread, (void)num_threads;
    TopPJob *job = job_;
    double *mass = malloc(sizeof(double) * TOP_P_BUCKETS);
    Entry *boundary = NULL;
    int64_t capacity = 0;
    int failed = !mass;
    for (int64_t r; mass && (r = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->rows;)
        if (job->top_p[r] < 1.0f)
            failed |= top_p_row(job->x + r * job->n, job->n, job->top_p[r], mass, &boundary, &capacity) != 0;
    free(mass);
    free(boundary);
    if (failed) __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
}

/* x: [rows, n] float32 logits, contiguous, masked in place; top_p: [rows] in (0, 1], a row with 1
 * left as it is. Returns 0, or -1 when out of memory. */
int top_p_rows(float *x, int64_t rows, int64_t n, const float *top_p, int num_threads) {
    TopPJob job = {x, rows, n, top_p, 0, 0};
    pool_run(top_p_part, &job, rows > 1 ? num_threads : 1);
    return job.failed ? -1 : 0;
}
