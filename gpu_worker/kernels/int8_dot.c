/* y = x W^T (+ bias) with W as int8 (one scale per output row) and each row of x rounded to
 * 8 bits, summed in int32 by AVX-512 VNNI (vpdpbusd: 64 products an instruction, where an
 * FMA does 16; on two Zen 5 cores the default model's head at 64 rows takes 5.9 ms against
 * 10.6 on gemm.c's float32 rows): the rescored head's first pass (quantization.py), which
 * only ranks each row's candidates; their logits are then recomputed in float32.
 *
 * A row x is rounded as a whole: s = max |x| / 127, q = round(x / s) in -127..127. vpdpbusd
 * takes unsigned bytes, so q + 128 goes in, and 128 times the output's sum of levels comes
 * off again:
 *
 *     y[j] = w_scale[j] * (s * float(Q[j] - 128 c[j])) (+ bias[j])
 *
 * with Q[j] the int32 sum of (q + 128) w[j] over the inputs and c[j] the sum of w[j]'s
 * levels. The integer sums are exact in any order (k < 65,536; their float too for k <=
 * 1,040), and each step after them rounds one row at a time: no bit of a row depends on the other rows of the call, on their number or on
 * the threads (batch invariance by construction).
 *
 * Layout (cpu_kernels.pack_int8_dot): outputs in tiles of 16; levels[(t * k / 4 + i4) * 64
 * + 4 l + b] is output 16t + l's level at input 4 i4 + b, so one 64-byte load holds a
 * tile's levels at four inputs, vpdpbusd's operand. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define DOT_TILE 16     /* outputs per tile: one register of int32 */
#define DOT_TILES 4     /* tiles a work item: 64 outputs */
#define DOT_ROWS 6      /* rows a block: 4 x 6 accumulators + 4 levels + 1 broadcast */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

/* Whether this CPU runs the kernel: AVX-512 F, BW, VL and VNNI. */
int int8_dot_available(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* One row's levels (as q + 128) and its scale; k % 8 == 0. */
static void round_row(const float *x, int64_t k, uint8_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8)
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, largest);
    float step = 0.0f;
    for (int l = 0; l < 8; l++) step = lanes[l] > step ? lanes[l] : step;
    step /= 127.0f;
    const __m256 steps = _mm256_set1_ps(step);
    for (int64_t i = 0; i < k; i += 8) {
        /* to nearest, ties to even (the default mode), then + 128; a zero row stays zero */
        __m256i level = _mm256_set1_epi32(128);
        if (step > 0.0f) {
            const __m256 ratio = _mm256_div_ps(_mm256_loadu_ps(x + i), steps);
            level = _mm256_add_epi32(level, _mm256_cvtps_epi32(ratio));
        }
        const __m128i words =
            _mm_packus_epi32(_mm256_castsi256_si128(level), _mm256_extracti128_si256(level, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(words, words));
    }
    *scale = step;
}

typedef struct {
    const int8_t *levels;
    const int32_t *offsets; /* 128 * the sum of each output's levels */
    const float *scales;    /* per output */
    const float *bias;      /* or NULL */
    const uint8_t *q;       /* [rows][k]: the rows' levels + 128 */
    const float *steps;     /* [rows]: their scales */
    int64_t k, n;
} Dot;

/* Rows r0 .. r0+NROWS-1 against the DOT_TILES tiles from t. */
VNNI INLINE void dot_block(const Dot *d, float *y, int64_t t, int64_t r0, const int NROWS) {
    const int64_t k = d->k, quads = k / 4;
    __m512i acc[DOT_TILES][DOT_ROWS];
    for (int j = 0; j < DOT_TILES; j++)
        for (int r = 0; r < NROWS; r++) acc[j][r] = _mm512_setzero_si512();
    const int8_t *levels = d->levels + t * quads * 64;
    for (int64_t i4 = 0; i4 < quads; i4++) {
        __m512i w[DOT_TILES];
        for (int j = 0; j < DOT_TILES; j++)
            w[j] = _mm512_loadu_si512(levels + (j * quads + i4) * 64);
        for (int r = 0; r < NROWS; r++) {
            const int32_t four = *(const int32_t *)(d->q + (r0 + r) * k + 4 * i4);
            const __m512i x = _mm512_set1_epi32(four);
            for (int j = 0; j < DOT_TILES; j++)
                acc[j][r] = _mm512_dpbusd_epi32(acc[j][r], x, w[j]);
        }
    }
    for (int j = 0; j < DOT_TILES; j++) {
        const int64_t at = (t + j) * DOT_TILE;
        const __m512i offsets = _mm512_loadu_si512(d->offsets + at);
        const __m512 scales = _mm512_loadu_ps(d->scales + at);
        for (int r = 0; r < NROWS; r++) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j][r], offsets));
            const __m512 step = _mm512_set1_ps(d->steps[r0 + r]);
            __m512 out = _mm512_mul_ps(_mm512_mul_ps(sum, step), scales);
            if (d->bias) out = _mm512_add_ps(out, _mm512_loadu_ps(d->bias + at));
            _mm512_storeu_ps(y + (r0 + r) * d->n + at, out);
        }
    }
}

#define DOT_CASE(NR)                                                                       \
    case NR: dot_block(d, y, t, r0, NR); break

VNNI static __attribute__((noinline)) void dot_item(const Dot *d, float *y, int64_t t,
                                                    int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += DOT_ROWS) {
        switch (rows - r0 < DOT_ROWS ? (int)(rows - r0) : DOT_ROWS) {
            DOT_CASE(6);
            DOT_CASE(5);
            DOT_CASE(4);
            DOT_CASE(3);
            DOT_CASE(2);
            DOT_CASE(1);
        }
    }
}

/* x [rows, k] float32, y [rows, n]; k % 8 == 0, n % 64 == 0; only where
 * int8_dot_available(). Returns 0, or -1 when the rows' levels could not be allocated (y is
 * then unwritten). */
int int8_dot_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const int8_t *levels,
                  const int32_t *offsets, const float *scales, const float *bias, float *y,
                  int num_threads) {
    uint8_t *q = malloc((size_t)(rows * k));
    float *steps = malloc((size_t)rows * sizeof(float));
    if (!q || !steps) {
        free(q);
        free(steps);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) round_row(x + r * k, k, q + r * k, steps + r);
    const Dot d = {levels, offsets, scales, bias, q, steps, k, n};
    const int64_t items = n / (DOT_TILE * DOT_TILES);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < items; item++) dot_item(&d, y, item * DOT_TILES, rows);
    free(q);
    free(steps);
    return 0;
}
