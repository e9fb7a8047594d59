/* A decoder stack's step in one call: for each layer, the kernels that direct_forward.py
 * ran one ctypes call at a time (about ten a layer, 3-4 us of Python each), in the same
 * order on the same values, so the same bits:
 *
 *   x = rms_norm(hidden); qkv = x Wqkv^T; (Qwen3: q, k = rms_norm per head);
 *   RoPE on q and k; k, v into the cache; attended = paged_attention(q);
 *   out = attended Wo^T; x, residual = rms_norm(out + hidden), out + hidden;
 *   hidden = residual + down(silu(gate) * up).
 *
 * Each kernel keeps its own threads (one OpenMP region each, as before). */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels this calls (gemm.c, elementwise.c, paged_attention.c). */
int q4_1_gemm(const float *x, int64_t rows, int64_t k, int64_t n, const uint32_t *levels,
              const uint16_t *scales, const uint16_t *mins, const float *bias, float *y,
              int num_threads);
void rms_norm(const float *x, const float *residual, const float *weight, float *out,
              float *residual_out, int64_t rows, int64_t cols, float eps, int num_threads);
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t cols, int num_threads);
void rotary(float *query, int64_t q_token_stride, int64_t q_head_stride, int64_t num_heads,
            float *key, int64_t k_token_stride, int64_t k_head_stride, int64_t num_kv_heads,
            const int64_t *positions, const float *cos_sin, int64_t num_tokens, int64_t head_dim,
            int num_threads);
void write_kv(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
              const int64_t *slots, int64_t rows, int64_t row_floats, float *key_cache,
              float *value_cache);
int paged_attention(const float *query, const float *key_cache, const float *value_cache,
                    const int32_t *block_table, int64_t table_width,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, int64_t max_context_len, float scale, float softcap,
                    int64_t sliding_window, float *out, int num_threads);

typedef struct { /* a Q4_1 GEMM's packed weight (cpu_kernels.PackedQ4) */
    const uint32_t *levels;
    const uint16_t *scales, *mins;
    const float *bias; /* or NULL */
    int64_t k, n;
} Q4Weight;

typedef struct { /* one layer (direct_forward._Layer); the field order is ctypes' too */
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* Qwen3's per-head norms, or NULL */
    float input_eps, post_eps, q_eps, k_eps;
    Q4Weight qkv, o_proj, gate_up, down;
    const float *cos_sin;
    float scale;
    int64_t sliding_window; /* 0: none */
    float *key_cache, *value_cache;
} Layer;

typedef struct { /* the model's widths */
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
} Shape;

typedef struct { /* the step (its AttentionMetadata and positions) */
    int64_t num_tokens, num_seqs, max_context_len, table_width;
    const int64_t *positions, *slots;
    const int32_t *block_table, *query_start_loc, *context_lens;
} Step;

/* hidden [T, shape.hidden] in place through the layers. Returns 0, or -1 when a buffer
 * could not be allocated (hidden is then partly through). */
int decoder_layers(const Layer *layers, int64_t num_layers, const Shape *shape,
                   const Step *step, float *hidden, int num_threads) {
    const int64_t T = step->num_tokens, H = shape->hidden, d = shape->head_dim;
    if (T == 0) return 0;
    const int64_t q_width = shape->num_heads * d, kv_width = shape->num_kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width, I = shape->intermediate;
    const int64_t widest = qkv_width > 2 * I ? qkv_width : 2 * I;
    float *x = malloc((size_t)(T * H) * sizeof(float));
    float *wide = malloc((size_t)(T * widest) * sizeof(float));
    float *query = malloc((size_t)(T * q_width) * sizeof(float));
    float *key = malloc((size_t)(T * kv_width) * sizeof(float));
    float *attended = malloc((size_t)(T * q_width) * sizeof(float));
    float *residual = malloc((size_t)(T * H) * sizeof(float));
    float *act = malloc((size_t)(T * I) * sizeof(float));
    int failed = !x || !wide || !query || !key || !attended || !residual || !act;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const Layer *layer = layers + l;
        rms_norm(hidden, NULL, layer->input_norm, x, NULL, T, H, layer->input_eps, num_threads);
        const Q4Weight *w = &layer->qkv;
        failed |= q4_1_gemm(x, T, w->k, w->n, w->levels, w->scales, w->mins, w->bias, wide,
                            num_threads) != 0;
        /* q and k where RoPE rotates them: in qkv's rows, or normed into their own rows */
        float *q_at = wide, *k_at = wide + q_width;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (layer->q_norm) {
            for (int64_t t = 0; t < T; t++) {
                rms_norm(wide + t * qkv_width, NULL, layer->q_norm, query + t * q_width, NULL,
                         shape->num_heads, d, layer->q_eps, 1);
                rms_norm(wide + t * qkv_width + q_width, NULL, layer->k_norm, key + t * kv_width,
                         NULL, shape->num_kv_heads, d, layer->k_eps, 1);
            }
            q_at = query, k_at = key, q_stride = q_width, k_stride = kv_width;
        }
        rotary(q_at, q_stride, d, shape->num_heads, k_at, k_stride, d, shape->num_kv_heads,
               step->positions, layer->cos_sin, T, d, num_threads);
        write_kv(k_at, wide + q_width + kv_width, k_stride, qkv_width, step->slots, T, kv_width,
                 layer->key_cache, layer->value_cache);
        if (!layer->q_norm) /* the attention reads contiguous rows */
            for (int64_t t = 0; t < T; t++)
                memcpy(query + t * q_width, wide + t * qkv_width, (size_t)q_width * sizeof(float));
        failed |= paged_attention(query, layer->key_cache, layer->value_cache, step->block_table,
                                  step->table_width, step->query_start_loc, step->context_lens,
                                  step->num_seqs, shape->num_heads, shape->num_kv_heads, d,
                                  shape->block_size, step->max_context_len, layer->scale, 0.0f,
                                  layer->sliding_window, attended, num_threads) != 0;
        w = &layer->o_proj;
        failed |= q4_1_gemm(attended, T, w->k, w->n, w->levels, w->scales, w->mins, w->bias, x,
                            num_threads) != 0;
        /* x = norm(out + hidden), residual = out + hidden (out is in x: the kernel reads a
         * row before it writes it) */
        rms_norm(x, hidden, layer->post_norm, x, residual, T, H, layer->post_eps, num_threads);
        w = &layer->gate_up;
        failed |= q4_1_gemm(x, T, w->k, w->n, w->levels, w->scales, w->mins, w->bias, wide,
                            num_threads) != 0;
        silu_and_mul(wide, act, T, I, num_threads);
        w = &layer->down;
        failed |= q4_1_gemm(act, T, w->k, w->n, w->levels, w->scales, w->mins, w->bias, x,
                            num_threads) != 0;
        for (int64_t i = 0; i < T * H; i += 8)
            _mm256_storeu_ps(hidden + i, _mm256_add_ps(_mm256_loadu_ps(residual + i),
                                                       _mm256_loadu_ps(x + i)));
    }
    free(x);
    free(wide);
    free(query);
    free(key);
    free(attended);
    free(residual);
    free(act);
    return failed ? -1 : 0;
}
