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

static inline float dot(const float *a, const float *b, int64_t head_dim) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return lanes_sum(acc);
}

/* head_dim % 8 == 0; all tensors contiguous float32 (int32 for the metadata).
 * Returns 0, or -1 when scratch could not be allocated. */
int paged_attention(const float *query, const float *key_cache, const float *value_cache,
                    const int32_t *block_table, int64_t table_width,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_context_len, float scale, float softcap,
                    int64_t sliding_window, float *out, int num_threads) {
    int32_t *row_seq = malloc((size_t)(num_tokens > 0 ? num_tokens : 1) * sizeof(int32_t));
    if (!row_seq) return -1;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int32_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) row_seq[t] = (int32_t)s;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  /* floats per cache slot */
    const int64_t num_items = num_tokens * num_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(max_context_len > 0 ? max_context_len : 1) * sizeof(float));
#pragma omp for schedule(dynamic, 8)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            const int64_t t = item / num_heads, h = item % num_heads;
            const int64_t s = row_seq[t];
            const int64_t query_len = query_start_loc[s + 1] - query_start_loc[s];
            const int64_t position = context_lens[s] - query_len + (t - query_start_loc[s]);
            int64_t first = 0;
            if (sliding_window > 0 && position - sliding_window + 1 > 0)
                first = position - sliding_window + 1;
            const int32_t *blocks = block_table + s * table_width;
            const int64_t kv_offset = (h / group) * head_dim;
            const float *q = query + (t * num_heads + h) * head_dim;
            /* Keys first..position, walked block by block (no division per key). */
            float top = -INFINITY;
            for (int64_t j = first; j <= position;) {
                const int64_t block = j / block_size;
                const int64_t end = (block + 1) * block_size - 1 < position ? (block + 1) * block_size - 1 : position;
                const float *k = key_cache + ((int64_t)blocks[block] * block_size + (j - block * block_size)) * token_stride + kv_offset;
                for (; j <= end; j++, k += token_stride) {
                    float score = dot(q, k, head_dim) * scale;
                    if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                    scores[j - first] = score;
                    if (score > top) top = score;
                }
            }
            float denominator = 0.0f;
            for (int64_t j = first; j <= position; j++) {
                const float weight = expf(scores[j - first] - top);
                scores[j - first] = weight;
                denominator += weight;
            }
            float *o = out + (t * num_heads + h) * head_dim;
            /* P.V in chunks of up to 64 of head_dim (8 registers), each over the keys in order. */
            for (int64_t c = 0; c < head_dim; c += 64) {
                const int64_t lanes = (head_dim - c < 64 ? head_dim - c : 64) / 8;
                __m256 acc[8];
                for (int64_t i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t j = first; j <= position;) {
                    const int64_t block = j / block_size;
                    const int64_t end = (block + 1) * block_size - 1 < position ? (block + 1) * block_size - 1 : position;
                    const float *v = value_cache + ((int64_t)blocks[block] * block_size + (j - block * block_size)) * token_stride + kv_offset + c;
                    for (; j <= end; j++, v += token_stride) {
                        const __m256 weight = _mm256_set1_ps(scores[j - first]);
                        if (lanes == 8) {
                            for (int64_t i = 0; i < 8; i++)
                                acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                        } else {
                            for (int64_t i = 0; i < lanes; i++)
                                acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                        }
                    }
                }
                const __m256 denominators = _mm256_set1_ps(denominator);
                for (int64_t i = 0; i < lanes; i++)
                    _mm256_storeu_ps(o + c + 8 * i, _mm256_div_ps(acc[i], denominators));
            }
        }
        free(scores);
    }
    free(row_seq);
    return failed ? -1 : 0;
}
