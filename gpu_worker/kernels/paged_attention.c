/* Paged attention for the CPU, float32, over the whole step in one call.
 *
 * The semantics are gpu_worker/attention/backend.py's: the step's T rows are sequences'
 * chunks, sequence s owning rows query_start_loc[s] .. query_start_loc[s+1]-1 at the last
 * positions before context_lens[s]; a row at position p sees its own sequence's keys at
 * positions j <= p (and j > p - window with a sliding window), read through the block
 * table from the caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads
 * KV head h / (heads / kv_heads); scores are q.k * scale, then softcap * tanh(s / softcap)
 * with a softcap.
 *
 * Each (row, head) is computed alone, the same way whatever else is in the step, how it
 * was chunked, or how many threads run: q.k is summed over head_dim in 8 lanes added in a
 * fixed order, the softmax's maximum and denominator and P.V run over the keys in
 * position order. So a row's bits are the same alone, in any batch, in a prefill chunk or
 * a decode step (batch invariance by construction), and every sum is float32.
 *
 * For speed, a work item is a tile of up to MAX_TILE (row, head) pairs of one sequence
 * and one KV head (a few consecutive rows times the heads that share the KV head): each
 * key is read once for the whole tile, its dot products run four at a time, and the
 * tile's keys and values stay in cache while each pair's P.V runs in registers. Tiling
 * changes which pairs share a read, never a pair's arithmetic.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float lanes_sum(__m256 v) {
    /* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), always this order */
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

/* e^x for 8 lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial
 * for e^r, times 2^n), within 2 ulp of the exact value; below -87 it is 0, as e^x rounds
 * there anyway. The same lanes always give the same bits. */
static inline __m256 exp_lanes(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3f);
    const __m256 small = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(small, result);
}

/* Queries sharing one work item: up to MAX_TILE (row, head) pairs of one sequence and one
 * KV head, so each key and value read from the cache serves all of them. */
#define MAX_TILE 16

typedef struct {
    const float *q;   /* the query, head_dim floats */
    float *o;         /* its output row */
    float *scores;    /* its keys' scores, then weights: scores[j - first] */
    int64_t first, position;
    float top, denominator;
} Query;

/* The cache slot of position j of a sequence (block table `blocks`), walked without a
 * division per key by the loops below. */
#define SLOT(blocks, j) ((int64_t)(blocks)[(j) / block_size] * block_size + (j) % block_size)

/* qr->o = sum over its keys j, in order, of weight_j * v_j, divided by the denominator:
 * head_dim in chunks of up to 64 floats, 8 registers each. */
static void weighted_values(const Query *qr, const float *value_cache, const int32_t *blocks,
                            int64_t block_size, int64_t token_stride, int64_t kv_offset,
                            int64_t head_dim) {
    for (int64_t c = 0; c < head_dim; c += 64) {
        const int64_t lanes = (head_dim - c < 64 ? head_dim - c : 64) / 8;
        __m256 acc[8];
        for (int64_t i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = qr->first; j <= qr->position;) {
            const int64_t block = j / block_size;
            const int64_t end = (block + 1) * block_size - 1 < qr->position ? (block + 1) * block_size - 1 : qr->position;
            const float *v = value_cache + SLOT(blocks, j) * token_stride + kv_offset + c;
            for (; j <= end; j++, v += token_stride) {
                const __m256 weight = _mm256_set1_ps(qr->scores[j - qr->first]);
                if (lanes == 8) {
                    for (int64_t i = 0; i < 8; i++)
                        acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                } else {
                    for (int64_t i = 0; i < lanes; i++)
                        acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
            }
        }
        const __m256 denominators = _mm256_set1_ps(qr->denominator);
        for (int64_t i = 0; i < lanes; i++)
            _mm256_storeu_ps(qr->o + c + 8 * i, _mm256_div_ps(acc[i], denominators));
    }
}

/* head_dim % 8 == 0; all tensors contiguous float32 (int32 for the metadata).
 * Returns 0, or -1 when scratch could not be allocated. */
int paged_attention(const float *query, const float *key_cache, const float *value_cache,
                    const int32_t *block_table, int64_t table_width,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_context_len, float scale, float softcap,
                    int64_t sliding_window, float *out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim; /* floats per cache slot */
    /* Rows per item: as many as fit MAX_TILE queries with the group's heads. */
    const int64_t tile_rows = group >= MAX_TILE ? 1 : MAX_TILE / group;
    const int64_t heads_per_item = group >= MAX_TILE ? MAX_TILE : group;
    const int64_t head_parts = (group + heads_per_item - 1) / heads_per_item;
    /* Items: (sequence, KV head, part of its heads, block of rows), listed per sequence. */
    int64_t *item_start = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!item_start) return -1;
    item_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t rows = query_start_loc[s + 1] - query_start_loc[s];
        item_start[s + 1] = item_start[s] + num_kv_heads * head_parts * ((rows + tile_rows - 1) / tile_rows);
    }
    const int64_t num_items = item_start[num_seqs];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t span = max_context_len > 0 ? max_context_len : 1;
        float *scratch = malloc((size_t)(MAX_TILE * span) * sizeof(float));
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scratch) {
                failed = 1;
                continue;
            }
            while (item_start[s + 1] <= item) s++;
            while (item_start[s] > item) s--;
            const int64_t row_start = query_start_loc[s];
            const int64_t rows = query_start_loc[s + 1] - row_start;
            const int64_t row_blocks = (rows + tile_rows - 1) / tile_rows;
            int64_t local = item - item_start[s];
            const int64_t row_block = local % row_blocks;
            local /= row_blocks;
            const int64_t part = local % head_parts;
            const int64_t kv_head = local / head_parts;
            const int32_t *blocks = block_table + s * table_width;
            const int64_t kv_offset = kv_head * head_dim;
            Query tile[MAX_TILE];
            int n = 0;
            int64_t lo = INT64_MAX, hi = -1;
            for (int64_t r = row_block * tile_rows; r < rows && r < (row_block + 1) * tile_rows; r++) {
                const int64_t t = row_start + r;
                const int64_t position = context_lens[s] - rows + r;
                int64_t first = 0;
                if (sliding_window > 0 && position - sliding_window + 1 > 0)
                    first = position - sliding_window + 1;
                for (int64_t i = part * heads_per_item; i < group && i < (part + 1) * heads_per_item; i++) {
                    const int64_t h = kv_head * group + i;
                    Query *qr = &tile[n];
                    qr->q = query + (t * num_heads + h) * head_dim;
                    qr->o = out + (t * num_heads + h) * head_dim;
                    qr->scores = scratch + n * span;
                    qr->first = first;
                    qr->position = position;
                    qr->top = -INFINITY;
                    qr->denominator = 0.0f;
                    n++;
                }
                if (first < lo) lo = first;
                if (position > hi) hi = position;
            }
            /* q.k: each key read once for every query of the tile that sees it. */
            for (int64_t j = lo; j <= hi;) {
                const int64_t block = j / block_size;
                const int64_t end = (block + 1) * block_size - 1 < hi ? (block + 1) * block_size - 1 : hi;
                const float *k = key_cache + SLOT(blocks, j) * token_stride + kv_offset;
                for (; j <= end; j++, k += token_stride) {
                    /* Four queries' dot products side by side (four independent FMA chains,
                     * each one query's sum over head_dim in 8 lanes); a missing fourth repeats the first. */
                    for (int i0 = 0; i0 < n; i0 += 4) {
                        const int m = n - i0 < 4 ? n - i0 : 4;
                        const float *q0 = tile[i0].q;
                        const float *q1 = m > 1 ? tile[i0 + 1].q : q0;
                        const float *q2 = m > 2 ? tile[i0 + 2].q : q0;
                        const float *q3 = m > 3 ? tile[i0 + 3].q : q0;
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                        for (int64_t c = 0; c < head_dim; c += 8) {
                            const __m256 kc = _mm256_loadu_ps(k + c);
                            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + c), kc, a0);
                            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + c), kc, a1);
                            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + c), kc, a2);
                            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + c), kc, a3);
                        }
                        const float sums[4] = {lanes_sum(a0), lanes_sum(a1), lanes_sum(a2), lanes_sum(a3)};
                        for (int i = 0; i < m; i++) {
                            Query *qr = &tile[i0 + i];
                            if (j < qr->first || j > qr->position) continue;
                            float score = sums[i] * scale;
                            if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                            qr->scores[j - qr->first] = score;
                            if (score > qr->top) qr->top = score;
                        }
                    }
                }
            }
            /* The softmax's weights and denominator, then P.V in registers, each query over
             * its own keys in order (its values stay in cache from one query to the next). */
            for (int i = 0; i < n; i++) {
                Query *qr = &tile[i];
                /* e^(score - top), 8 keys at a time; the denominator adds them in order. */
                const int64_t count = qr->position - qr->first + 1;
                const __m256 top = _mm256_set1_ps(qr->top);
                int64_t j = 0;
                for (; j + 8 <= count; j += 8)
                    _mm256_storeu_ps(qr->scores + j,
                                     exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(qr->scores + j), top)));
                if (j < count) {
                    float rest[8] = {0};
                    for (int64_t i = j; i < count; i++) rest[i - j] = qr->scores[i] - qr->top;
                    _mm256_storeu_ps(rest, exp_lanes(_mm256_loadu_ps(rest)));
                    for (int64_t i = j; i < count; i++) qr->scores[i] = rest[i - j];
                }
                for (j = 0; j < count; j++) qr->denominator += qr->scores[j];
                weighted_values(qr, value_cache, blocks, block_size, token_stride, kv_offset, head_dim);
            }
        }
        free(scratch);
    }
    free(item_start);
    return failed ? -1 : 0;
}
