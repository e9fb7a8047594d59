/* y = x W^T (+ bias) in float32 on AVX2 + FMA, W held compactly and rebuilt as it is used.
 *
 * Two formats of W [n, k]:
 * - Q4_1 (q4_1_gemm): each 32 consecutive inputs of an output row are d * q + m, q in
 *   0..15 (llama.cpp's Q4_1, the default model's decoder). Each weight is rebuilt as
 *   fma(q, d, m), which is d * q + m exactly as the float model holds it (d * q is exact
 *   in float32).
 * - int8 (int8_gemm): q in -127..127 and one scale s per output row; each weight is
 *   rebuilt as the float q (exact) and the row's sum is multiplied by s at the end.
 * Either way every output element is one float32 dot product over the inputs in their
 * order, acc = fma(x[i], w[i], acc) for i = 0 .. k-1, then (* s) (+ bias). Nothing in
 * that depends on how many rows the call has, which rows they are, or how many threads
 * run it: a row's bits are the same alone and in any batch (batch invariance by
 * construction).
 *
 * Layout (cpu_kernels.py packs it): outputs go in tiles of 8. Q4_1: for tile t and input
 * i, levels[((t / 2) * k + i) * 2 + t % 2] is one uint32 holding the 8 outputs' levels,
 * output j of the tile in bits 4j .. 4j+3 (tiles in pairs, input by input: one 64-bit
 * load gives a pair's words); scales[t][g][8] and mins[t][g][8] hold d and m of tile t's 8
 * outputs for group g (inputs 32g .. 32g+31) in float16, as Q4_1 stores them (widened
 * exactly as they are read; in float32 they were a quarter of a step's reads). int8:
 * levels[(t * k + i) * 8 + j] is output 8t+j's int8 at input i; scales[n] the rows'
 * scales, float32.
 *
 * Two loops over the same arithmetic: few rows (below STRIP_ROWS) rebuild each weight in
 * registers as they go, four tiles side by side; more rows rebuild a strip of 16 outputs x
 * k inputs once into a buffer and run blocks of ROWS rows over it (the rebuild is then
 * shared by every row of the call). Where the CPU has AVX-512, both loops hold two tiles a
 * 512-bit register: the strips 32 outputs at a time in blocks of ROWS512 rows, the few-rows
 * loop eight or twelve tiles at a time in passes of up to four rows, and up to
 * WIDE_DIRECT_ROWS rows (rebuilding in registers pass after pass beats the strips' buffer
 * there). Each lane still computes its output's one chain of FMAs, so the bits are the
 * AVX2 loops', only twice as many chains run per instruction (tested bit for bit against
 * them).
 */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define GROUP 32
#define ROWS 6       /* rows per block: 12 accumulators + 2 weights + 1 broadcast */
#define ROWS512 8    /* AVX-512: 16 accumulators + 2 weights + 1 broadcast (of 32) */
#define QUAD 4       /* AVX-512: tiles per strip, 32 outputs, two registers an input */
#define STRIP_ROWS 4 /* from this many rows, rebuild the weights once into a strip */
#define Q4_1 0
#define INT8 1

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const void *levels;
    const void *scales; /* Q4_1: float16 per tile and group; int8: float32 per output row */
    const uint16_t *mins; /* Q4_1 only: float16 per tile and group */
    const float *bias;   /* or NULL */
    int64_t k, n;
} Weights;

/* Q4_1: where tile t's word at input i is: the tiles go in pairs, input by input
 * (see the layout above). */
INLINE int64_t level_at(const Weights *w, int64_t t, int64_t i) {
    return ((t >> 1) * w->k + i) * 2 + (t & 1);
}

/* Tile t's 8 weights at input i (g = i / 32's d and m already loaded for Q4_1). */
INLINE __m256 weights_at(const Weights *w, int64_t t, int64_t i, __m256 d, __m256 m,
                         const int FORMAT) {
    if (FORMAT == Q4_1) {
        const uint32_t word = ((const uint32_t *)w->levels)[level_at(w, t, i)];
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        __m256i q = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts);
        q = _mm256_and_si256(q, _mm256_set1_epi32(0xF));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    }
    const int8_t *q = (const int8_t *)w->levels + (t * w->k + i) * 8;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

INLINE void group_constants(const Weights *w, int64_t t, int64_t g, __m256 *d, __m256 *m,
                            const int FORMAT) {
    if (FORMAT == Q4_1) {
        const int64_t at = (t * (w->k / GROUP) + g) * 8;
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w->scales + at)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + at)));
    } else {
        *d = *m = _mm256_setzero_ps();
    }
}

/* Ask for tile t's weights of group g (its levels, and its scales and minimums for Q4_1)
 * before they are read: the AVX-512 few-rows loop reads eight tiles' levels, scales and
 * minimums at once, 24 streams a thread, more than the hardware prefetcher follows
 * (measured there: 5.4 -> 4.4 ms at two rows for the default model's decoder from memory;
 * the AVX2 loop gained nothing from it). A prefetch past the end is never issued. */
#define PREFETCH_GROUPS 2
INLINE void prefetch_group(const Weights *w, int64_t t, int64_t g, const int FORMAT) {
    if (g >= w->k / GROUP) return;
    if (FORMAT == Q4_1) {
        if ((t & 1) == 0) { /* the pair's 32 inputs x 2 words: four lines */
            const uint32_t *levels = (const uint32_t *)w->levels + level_at(w, t, g * GROUP);
            for (int line = 0; line < 4; line++)
                _mm_prefetch((const char *)(levels + 16 * line), _MM_HINT_T0);
        }
        const int64_t at = (t * (w->k / GROUP) + g) * 8;
        _mm_prefetch((const char *)((const uint16_t *)w->scales + at), _MM_HINT_T0);
        _mm_prefetch((const char *)(w->mins + at), _MM_HINT_T0);
    } else {
        const int8_t *levels = (const int8_t *)w->levels + (t * w->k + g * GROUP) * 8;
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(levels + 64 * line), _MM_HINT_T0);
    }
}

/* Output tile t of one row: acc (* the rows' scales for int8) (+ bias). */
INLINE void store_tile(const Weights *w, float *y_row, int64_t t, __m256 acc, const int FORMAT) {
    if (FORMAT == INT8) acc = _mm256_mul_ps(acc, _mm256_loadu_ps((const float *)w->scales + t * 8));
    if (w->bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(w->bias + t * 8));
    _mm256_storeu_ps(y_row + t * 8, acc);
}

/* All `NROWS` (< STRIP_ROWS) rows against tiles t .. t+NTILES-1, the weights rebuilt as
 * they are read. Several tiles at once: each output's sum is one chain of dependent FMAs,
 * and independent chains side by side hide the FMA's latency. */
INLINE void tiles_direct(const Weights *w, const float *x, float *y, int64_t t,
                         const int NTILES, const int NROWS, const int FORMAT) {
    /* A local copy: its fields cannot change under the stores, so they stay in registers
     * and each tile's offset is computed once, not at every input. */
    const Weights local = *w;
    w = &local;
    const int64_t k = w->k;
    __m256 acc[4][STRIP_ROWS];
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 d[4], m[4];
        for (int j = 0; j < NTILES; j++) group_constants(w, t + j, g, &d[j], &m[j], FORMAT);
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++) {
            for (int j = 0; j < NTILES; j++) {
                const __m256 wv = weights_at(w, t + j, i, d[j], m[j], FORMAT);
                for (int r = 0; r < NROWS; r++)
                    acc[j][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * k + i), wv, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) store_tile(w, y + r * w->n, t + j, acc[j][r], FORMAT);
}

#define DIRECT_CASE(NT, NR) tiles_direct(w, x, y, t, NT, NR, FORMAT)

INLINE void direct(const Weights *w, const float *x, float *y, int64_t t, int ntiles, int rows,
                   const int FORMAT) {
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

/* Tile t's weights into `strip`, input i's 8 floats at strip + i * stride (the values
 * tiles_direct rebuilds): [k][8] for the AVX2 blocks, every fourth 8 of [k][32] for the
 * AVX-512 ones. */
INLINE void rebuild(const Weights *w, int64_t t, float *strip, const int64_t stride,
                    const int FORMAT) {
    for (int64_t g = 0; g < w->k / GROUP; g++) {
        __m256 d, m;
        group_constants(w, t, g, &d, &m, FORMAT);
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++)
            _mm256_store_ps(strip + i * stride, weights_at(w, t, i, d, m, FORMAT));
    }
}

/* Rows r0 .. r0+NROWS-1 against NTILES (1 or 2) rebuilt tiles, strip j at strip + j*k*8. */
INLINE void block(const Weights *w, const float *x, float *y, const float *strip, int64_t t,
                  int64_t r0, const int NTILES, const int NROWS, const int FORMAT) {
    const int64_t k = w->k;
    __m256 acc[2][ROWS];
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 wv[2];
        for (int j = 0; j < NTILES; j++) wv[j] = _mm256_load_ps(strip + (j * k + i) * 8);
        for (int r = 0; r < NROWS; r++) {
            const __m256 v = _mm256_broadcast_ss(x + (r0 + r) * k + i);
            for (int j = 0; j < NTILES; j++) acc[j][r] = _mm256_fmadd_ps(v, wv[j], acc[j][r]);
        }
    }
    for (int j = 0; j < NTILES; j++)
        for (int r = 0; r < NROWS; r++) store_tile(w, y + (r0 + r) * w->n, t + j, acc[j][r], FORMAT);
}

#define BLOCK_CASE(NT, NR) block(w, x, y, strip, t, r0, NT, NR, FORMAT)

/* Not inlined into the parallel region: compiled on its own, the 6-row blocks keep their
 * 12 accumulators in registers (inlined, the strip loop ran at half the speed). */
static __attribute__((noinline)) void blocks(const Weights *w, const float *x, float *y,
                                             const float *strip, int64_t t, int ntiles,
                                             int64_t rows, int FORMAT) {
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

/* ---- AVX-512: the strip loop over four tiles at a time --------------------------------- */

/* Rows r0 .. r0+NROWS-1 against the quad at t: lane l of register h is output
 * 8t + 16h + l, whose chain is acc = fma(x[i], w[i], acc) in input order, as in `block`. */
AVX512 INLINE void block512(const Weights *w, const float *x, float *y, const float *strip,
                            int64_t t, int64_t r0, const int NROWS, const int FORMAT) {
    const int64_t k = w->k;
    __m512 acc[2][ROWS512];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < NROWS; r++) acc[h][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m512 w0 = _mm512_load_ps(strip + i * 32);
        const __m512 w1 = _mm512_load_ps(strip + i * 32 + 16);
        for (int r = 0; r < NROWS; r++) {
            const __m512 v = _mm512_set1_ps(x[(r0 + r) * k + i]);
            acc[0][r] = _mm512_fmadd_ps(v, w0, acc[0][r]);
            acc[1][r] = _mm512_fmadd_ps(v, w1, acc[1][r]);
        }
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < NROWS; r++) {
            float *y_row = y + (r0 + r) * w->n;
            store_tile(w, y_row, t + 2 * h, _mm512_castps512_ps256(acc[h][r]), FORMAT);
            store_tile(w, y_row, t + 2 * h + 1, _mm512_extractf32x8_ps(acc[h][r], 1), FORMAT);
        }
}

#define BLOCK512_CASE(NR) block512(w, x, y, strip, t, r0, NR, FORMAT)

AVX512 static __attribute__((noinline)) void blocks512(const Weights *w, const float *x,
                                                       float *y, const float *strip, int64_t t,
                                                       int64_t rows, int FORMAT) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS512) {
        switch (rows - r0 < ROWS512 ? (int)(rows - r0) : ROWS512) {
        case 8: BLOCK512_CASE(8); break;
        case 7: BLOCK512_CASE(7); break;
        case 6: BLOCK512_CASE(6); break;
        case 5: BLOCK512_CASE(5); break;
        case 4: BLOCK512_CASE(4); break;
        case 3: BLOCK512_CASE(3); break;
        case 2: BLOCK512_CASE(2); break;
        case 1: BLOCK512_CASE(1); break;
        }
    }
}

/* low's and high's lanes interleaved: low[0], high[0], low[1], high[1], ... */
AVX512 INLINE __m512 interleaved(__m256 low, __m256 high) {
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm512_permutexvar_ps(order, joined(low, high));
}

/* Tiles t and t+1's weights at input i in one register (t even), interleaved: lane 2j is
 * output j of tile t, lane 2j + 1 output j of tile t + 1 (the values weights_at gives
 * each; d2 and m2 hold the two tiles' group constants the same way: interleaved()). For
 * Q4_1 that is the pair's two adjacent words broadcast, each lane shifting out its own
 * level: one load and no shuffle, where two loads, an insert and a permute joined the
 * words of tiles k apart (the default model's decoder from memory on two Zen 5 cores,
 * alternated 4 times: one row 3.7-4.1 -> 2.8-3.1 ms, two rows 3.8-4.4 -> 3.0-3.3, three
 * 4.4-5.1 -> 3.5-4.0; the strips, which read words one at a time, unchanged). */
AVX512 INLINE __m512 pair_at(const Weights *w, int64_t t, int64_t i, __m512 d2, __m512 m2,
                             const int FORMAT) {
    if (FORMAT == Q4_1) {
        const uint32_t *levels = (const uint32_t *)w->levels + level_at(w, t, i);
        const __m512i shifts =
            _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        __m512i q = _mm512_set1_epi64(*(const int64_t *)levels);
        q = _mm512_and_si512(_mm512_srlv_epi32(q, shifts), _mm512_set1_epi32(0xF));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d2, m2);
    }
    /* int8: the two tiles' 8 levels at input i, byte by byte (first[0], second[0], ...) */
    const int8_t *q = (const int8_t *)w->levels;
    const __m128i first = _mm_loadl_epi64((const __m128i *)(q + (t * w->k + i) * 8));
    const __m128i second = _mm_loadl_epi64((const __m128i *)(q + ((t + 1) * w->k + i) * 8));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(first, second)));
}

/* The two tiles of an interleaved register, tile t's 8 outputs into *low. */
AVX512 INLINE void split_pair(__m512 v, __m256 *low, __m256 *high) {
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    v = _mm512_permutexvar_ps(order, v);
    *low = _mm512_castps512_ps256(v);
    *high = _mm512_extractf32x8_ps(v, 1);
}

/* tiles_direct in 512-bit registers: NPAIRS pairs of tiles from t (all of them there), all
 * NROWS rows, each lane's chain the same as there. */
#define MAX_PAIRS 6
#define PAIRS_FEW 6 /* pairs an item at one or two rows (pairs_for) */
#define PASS_ROWS 4 /* rows a pass of the AVX-512 few-rows loop over an item's weights */
/* AVX-512: below this many rows, the few-rows loop in passes rather than the strips. The
 * default model's decoder from memory on two Zen 5 cores, strips against passes, medians
 * of 5: 4 rows 9.22 / 3.97 ms, 8 rows 10.16 / 6.34, 16 rows 13.65 / 11.01, 24 rows 16.63 /
 * 15.46, 28 rows 20.06 / 19.78, 32 rows 20.74 / 20.93, 48 rows 27.87 / 31.26. */
#define WIDE_DIRECT_ROWS 28
AVX512 INLINE void pairs_direct(const Weights *w, const float *x, float *y, int64_t t,
                                const int NPAIRS, const int NROWS, const int FORMAT) {
    const Weights local = *w;
    w = &local;
    const int64_t k = w->k;
    __m512 acc[MAX_PAIRS][PASS_ROWS];
    for (int p = 0; p < NPAIRS; p++)
        for (int r = 0; r < NROWS; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m512 d2[MAX_PAIRS], m2[MAX_PAIRS];
        for (int p = 0; p < NPAIRS; p++) {
            prefetch_group(w, t + 2 * p, g + PREFETCH_GROUPS, FORMAT);
            prefetch_group(w, t + 2 * p + 1, g + PREFETCH_GROUPS, FORMAT);
            __m256 d0, m0, d1, m1;
            group_constants(w, t + 2 * p, g, &d0, &m0, FORMAT);
            group_constants(w, t + 2 * p + 1, g, &d1, &m1, FORMAT);
            d2[p] = interleaved(d0, d1);
            m2[p] = interleaved(m0, m1);
        }
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++) {
            for (int p = 0; p < NPAIRS; p++) {
                const __m512 wv = pair_at(w, t + 2 * p, i, d2[p], m2[p], FORMAT);
                for (int r = 0; r < NROWS; r++)
                    acc[p][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i]), wv, acc[p][r]);
            }
        }
    }
    for (int p = 0; p < NPAIRS; p++)
        for (int r = 0; r < NROWS; r++) {
            __m256 low, high;
            split_pair(acc[p][r], &low, &high);
            store_tile(w, y + r * w->n, t + 2 * p, low, FORMAT);
            store_tile(w, y + r * w->n, t + 2 * p + 1, high, FORMAT);
        }
}

/* Pairs of tiles an item of the AVX-512 few-rows loop, by the call's rows. Each output's
 * sum is one chain of dependent FMAs, so the fewer the rows, the more outputs side by side
 * it takes to hide the FMA's latency; from three rows, four pairs (four rows fill the
 * registers). The default model's decoder (weights read from memory) on two Zen 5 cores,
 * medians of 8, before pairs read their words in one load: one row 4.49 ms on the AVX2
 * loop (four tiles; its way before), 4.30 at four pairs, 3.82 at six, about 4.2 at eight;
 * two rows 4.42 at four pairs (before), 4.11 at six. After: six pairs still the best at
 * one and two rows, four and five alike at three. */
static int pairs_for(int64_t rows) { return rows < 3 ? PAIRS_FEW : 4; }

/* The 2 * npairs tiles from t (npairs pairs_for the call's rows), for a pass of 1 to
 * PASS_ROWS of its rows (x and y at the pass's first row). */
AVX512 static __attribute__((noinline)) void pairs_item(const Weights *w, const float *x,
                                                        float *y, int64_t t, int npairs,
                                                        int rows, int FORMAT) {
    switch (npairs == PAIRS_FEW ? rows : 8 + rows) {
    case 1: pairs_direct(w, x, y, t, PAIRS_FEW, 1, FORMAT); break;
    case 2: pairs_direct(w, x, y, t, PAIRS_FEW, 2, FORMAT); break;
    case 8 + 1: pairs_direct(w, x, y, t, 4, 1, FORMAT); break;
    case 8 + 2: pairs_direct(w, x, y, t, 4, 2, FORMAT); break;
    case 8 + 3: pairs_direct(w, x, y, t, 4, 3, FORMAT); break;
    case 8 + 4: pairs_direct(w, x, y, t, 4, 4, FORMAT); break;
    }
}

/* Whether the kernels take their AVX-512 paths: -1 until the first call asks the CPU. */
static int avx512_on = -1;

/* setting 0: the AVX2 loops only; 1: AVX-512 where the CPU has it; -1: as it is. Returns
 * whether the AVX-512 paths are on (tests compare the two paths' bits). Declared in
 * simd.h, for any kernel with an AVX-512 path. */
int wide_vectors(int setting) {
    if (setting >= 0 || avx512_on < 0)
        avx512_on = setting != 0 && __builtin_cpu_supports("avx512f") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512_on;
}

/* ---- entry points ----------------------------------------------------------------------- */

/* x [rows, k] and y [rows, n] row-major float32, contiguous; k % 32 == 0, n % 8 == 0.
 * Returns 0, or -1 when a buffer could not be allocated (y is then unwritten). */
INLINE int gemm(const Weights *w, const float *x, int64_t rows, float *y, int num_threads,
                const int FORMAT) {
    const int64_t num_tiles = w->n / 8;
    const int wide = wide_vectors(-1);
    if (rows < (wide ? WIDE_DIRECT_ROWS : STRIP_ROWS)) {
        /* Work items: pairs of tiles (AVX-512, pairs_for(rows) of them), then fours of the
         * tiles left (the AVX2 loop; from memory, the pairs took 4.4-4.5 against 5.1-5.2 ms
         * at two rows, 4.6-4.7 against 7.0 at three). Each item runs the rows in passes of
         * PASS_ROWS (the AVX2 loop STRIP_ROWS - 1), rebuilding its weights in each. */
        const int npairs = pairs_for(rows);
        const int64_t item_tiles = 2 * npairs;
        const int64_t num_wide = wide ? num_tiles / item_tiles : 0;
        const int64_t first_quad_tile = item_tiles * num_wide;
        const int64_t num_quads = (num_tiles - first_quad_tile + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t item = 0; item < num_wide + num_quads; item++) {
            if (item < num_wide) {
                for (int64_t r0 = 0; r0 < rows; r0 += PASS_ROWS) {
                    const int pass = rows - r0 < PASS_ROWS ? (int)(rows - r0) : PASS_ROWS;
                    pairs_item(w, x + r0 * w->k, y + r0 * w->n, item_tiles * item, npairs,
                               pass, FORMAT);
                }
                continue;
            }
            const int64_t t = first_quad_tile + 4 * (item - num_wide);
            const int ntiles = num_tiles - t < 4 ? (int)(num_tiles - t) : 4;
            for (int64_t r0 = 0; r0 < rows; r0 += STRIP_ROWS - 1) {
                const int pass = rows - r0 < STRIP_ROWS - 1 ? (int)(rows - r0) : STRIP_ROWS - 1;
                direct(w, x + r0 * w->k, y + r0 * w->n, t, ntiles, pass, FORMAT);
            }
        }
        return 0;
    }
    /* Work items: the quads (AVX-512), then pairs of the tiles left (1 or 2 the last). */
    const int64_t num_quads = wide_vectors(-1) ? num_tiles / QUAD : 0;
    const int64_t first_pair_tile = QUAD * num_quads;
    const int64_t num_pairs = (num_tiles - first_pair_tile + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *strip = aligned_alloc(64, (size_t)(QUAD * w->k * 8) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_quads + num_pairs; item++) {
            if (!strip) { /* every thread must reach the loop; one without a buffer fails */
                failed = 1;
                continue;
            }
            if (item < num_quads) {
                /* [k][32]: tile j's 8 at 8j of each input, so one input's 32 are two
                 * registers. */
                for (int j = 0; j < QUAD; j++)
                    rebuild(w, QUAD * item + j, strip + 8 * j, 8 * QUAD, FORMAT);
                blocks512(w, x, y, strip, QUAD * item, rows, FORMAT);
                continue;
            }
            const int64_t t = first_pair_tile + 2 * (item - num_quads);
            const int ntiles = t + 1 < num_tiles ? 2 : 1;
            for (int j = 0; j < ntiles; j++) rebuild(w, t + j, strip + j * w->k * 8, 8, FORMAT);
            blocks(w, x, y, strip, t, ntiles, rows, FORMAT);
        }
        free(strip);
    }
    return failed ? -1 : 0;
}

int q4_1_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint32_t *levels,
              const uint16_t *scales, const uint16_t *mins, const float *bias, float *y,
              int num_threads) {
    const Weights w = {levels, scales, mins, bias, k, n};
    return gemm(&w, x, rows, y, num_threads, Q4_1);
}

int int8_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const int8_t *levels,
              const float *scales, const float *bias, float *y, int num_threads) {
    const Weights w = {levels, scales, NULL, bias, k, n};
    return gemm(&w, x, rows, y, num_threads, INT8);
}
