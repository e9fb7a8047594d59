/* y = x W^T (+ bias) with W held as Q4_1 groups, in float32, on AVX2 + FMA.
 *
 * W is [n, k]: each 32 consecutive inputs of an output row are d * q + m, q in 0..15
 * (llama.cpp's Q4_1, the default model's decoder). Every weight is rebuilt in float32 as
 * fma(q, d, m), which is d * q + m exactly as the float model holds it (d * q is exact in
 * float32), and every output element is one float32 dot product over the inputs in
 * their order: acc = fma(x[i], w[i], acc) for i = 0 .. k-1, then + bias. Nothing in that
 * depends on how many rows the call has, which rows they are, or how many threads run
 * it: a row's bits are the same alone and in any batch (batch invariance by
 * construction), and differ from the float model's only by the order of the sum.
 *
 * Layout (pack_q4_1 in quantization.py writes it): outputs go in tiles of 8. For tile t
 * and input i, levels[t * k + i] is one uint32 holding the 8 outputs' levels, output j
 * of the tile in bits 4j .. 4j+3. scales[t][g][8] and mins[t][g][8] hold d and m of
 * tile t's 8 outputs for group g (inputs 32g .. 32g+31).
 *
 * Two loops over the same arithmetic: few rows rebuild each weight in registers as they
 * go; more rows rebuild a strip of 16 outputs x k inputs once into a buffer and run
 * blocks of ROWS rows over it (the weights' rebuild is then shared by every row).
 */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define ROWS 6          /* rows per block: 12 accumulators + 2 weights + 1 broadcast */
#define STRIP_ROWS 4    /* from this many rows, rebuild the weights once into a strip */

static inline __m256 weights_of(uint32_t word, __m256 d, __m256 m, __m256i shifts) {
    __m256i q = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts);
    q = _mm256_and_si256(q, _mm256_set1_epi32(0xF));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

static inline void store_row(float *y, const float *bias, __m256 acc) {
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, acc);
}

#define INLINE static inline __attribute__((always_inline))

/* Rows r0 .. r0+NROWS-1 (NROWS < STRIP_ROWS) of tiles t .. t+NTILES-1, the weights rebuilt
 * as they are read. Several tiles at once: each output's sum is one chain of dependent
 * FMAs, and independent chains side by side hide the FMA's latency. */
INLINE void tiles_direct(const float *x, int64_t k, int64_t n, const uint32_t *levels,
                         const float *scales, const float *mins, const float *bias, float *y,
                         int64_t t, int64_t r0, const int NTILES, const int NROWS) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const int64_t num_groups = k / GROUP;
    __m256 acc[4][STRIP_ROWS];
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; g++) {
        __m256 d[4], m[4];
        for (int j = 0; j < NTILES; j++) {
            d[j] = _mm256_loadu_ps(scales + ((t + j) * num_groups + g) * 8);
            m[j] = _mm256_loadu_ps(mins + ((t + j) * num_groups + g) * 8);
        }
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++) {
            for (int j = 0; j < NTILES; j++) {
                const __m256 w = weights_of(levels[(t + j) * k + i], d[j], m[j], shifts);
                for (int r = 0; r < NROWS; r++)
                    acc[j][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (r0 + r) * k + i), w,
                                                acc[j][r]);
            }
        }
    }
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++)
            store_row(y + (r0 + r) * n + (t + j) * 8, bias ? bias + (t + j) * 8 : NULL,
                      acc[j][r]);
}

#define DIRECT_CASE(NT, NR)                                                                \
    tiles_direct(x, k, n, levels, scales, mins, bias, y, t, 0, NT, NR)

/* Tiles t .. t+ntiles-1 (ntiles <= 4) for all `rows` (< STRIP_ROWS) rows. */
static void direct(const float *x, int64_t k, int64_t n, const uint32_t *levels,
                   const float *scales, const float *mins, const float *bias, float *y,
                   int64_t t, int ntiles, int rows) {
    switch (ntiles * 4 + rows) {
    case 4 * 4 + 1: DIRECT_CASE(4, 1); break;
    case 4 * 4 + 2: DIRECT_CASE(4, 2); break;
    case 4 * 4 + 3: DIRECT_CASE(4, 3); break;
    case 3 * 4 + 1: DIRECT_CASE(3, 1); break;
    case 3 * 4 + 2: DIRECT_CASE(3, 2); break;
    case 3 * 4 + 3: DIRECT_CASE(3, 3); break;
    case 2 * 4 + 1: DIRECT_CASE(2, 1); break;
    case 2 * 4 + 2: DIRECT_CASE(2, 2); break;
    case 2 * 4 + 3: DIRECT_CASE(2, 3); break;
    case 1 * 4 + 1: DIRECT_CASE(1, 1); break;
    case 1 * 4 + 2: DIRECT_CASE(1, 2); break;
    case 1 * 4 + 3: DIRECT_CASE(1, 3); break;
    }
}

/* Tile t's weights, [k][8] float32, into `strip` (the same values tiles_direct rebuilds). */
static void rebuild(int64_t k, const uint32_t *levels, const float *scales, const float *mins,
                    int64_t t, float *strip) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const uint32_t *lv = levels + t * k;
    const int64_t num_groups = k / GROUP;
    for (int64_t g = 0; g < num_groups; g++) {
        const __m256 d = _mm256_loadu_ps(scales + (t * num_groups + g) * 8);
        const __m256 m = _mm256_loadu_ps(mins + (t * num_groups + g) * 8);
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++)
            _mm256_store_ps(strip + i * 8, weights_of(lv[i], d, m, shifts));
    }
}

/* Rows r0 .. r0+NROWS-1 against NTILES (1 or 2) rebuilt tiles, strip j at strip + j*k*8. */
INLINE void block(const float *x, int64_t k, int64_t n, const float *strip, const float *bias,
                  float *y, int64_t t, int64_t r0, const int NTILES, const int NROWS) {
    __m256 acc[2][ROWS];
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 w[2];
        for (int j = 0; j < NTILES; j++) w[j] = _mm256_load_ps(strip + (j * k + i) * 8);
        for (int r = 0; r < NROWS; r++) {
            const __m256 v = _mm256_broadcast_ss(x + (r0 + r) * k + i);
            for (int j = 0; j < NTILES; j++) acc[j][r] = _mm256_fmadd_ps(v, w[j], acc[j][r]);
        }
    }
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++)
            store_row(y + (r0 + r) * n + (t + j) * 8, bias ? bias + (t + j) * 8 : NULL,
                      acc[j][r]);
}

#define BLOCK_CASE(NT, NR) block(x, k, n, strip, bias, y, t, r0, NT, NR)

static void blocks(const float *x, int64_t k, int64_t n, const float *strip, const float *bias,
                   float *y, int64_t t, int ntiles, int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        const int nrows = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
        switch (ntiles * 8 + nrows) {
        case 2 * 8 + 6: BLOCK_CASE(2, 6); break;
        case 2 * 8 + 5: BLOCK_CASE(2, 5); break;
        case 2 * 8 + 4: BLOCK_CASE(2, 4); break;
        case 2 * 8 + 3: BLOCK_CASE(2, 3); break;
        case 2 * 8 + 2: BLOCK_CASE(2, 2); break;
        case 2 * 8 + 1: BLOCK_CASE(2, 1); break;
        case 1 * 8 + 6: BLOCK_CASE(1, 6); break;
        case 1 * 8 + 5: BLOCK_CASE(1, 5); break;
        case 1 * 8 + 4: BLOCK_CASE(1, 4); break;
        case 1 * 8 + 3: BLOCK_CASE(1, 3); break;
        case 1 * 8 + 2: BLOCK_CASE(1, 2); break;
        case 1 * 8 + 1: BLOCK_CASE(1, 1); break;
        }
    }
}

/* x [rows, k] and y [rows, n] row-major float32, contiguous; k % 32 == 0, n % 8 == 0.
 * Returns 0, or -1 when a buffer could not be allocated (y is then unwritten). */
int q4_1_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint32_t *levels,
              const float *scales, const float *mins, const float *bias, float *y,
              int num_threads) {
    const int64_t num_tiles = n / 8;
    if (rows < STRIP_ROWS) {
        const int64_t num_quads = (num_tiles + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t q = 0; q < num_quads; q++) {
            const int64_t t = 4 * q;
            const int ntiles = num_tiles - t < 4 ? (int)(num_tiles - t) : 4;
            direct(x, k, n, levels, scales, mins, bias, y, t, ntiles, (int)rows);
        }
        return 0;
    }
    const int64_t num_pairs = (num_tiles + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *strip = aligned_alloc(32, (size_t)(2 * k * 8) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_pairs; p++) {
            if (!strip) {  /* every thread must reach the loop; one without a buffer fails */
                failed = 1;
                continue;
            }
            const int64_t t = 2 * p;
            const int ntiles = t + 1 < num_tiles ? 2 : 1;
            for (int j = 0; j < ntiles; j++)
                rebuild(k, levels, scales, mins, t + j, strip + j * k * 8);
            blocks(x, k, n, strip, bias, y, t, ntiles, rows);
        }
        free(strip);
    }
    return failed ? -1 : 0;
}
