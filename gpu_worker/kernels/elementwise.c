/* The dense parts of a Llama-style decoder layer between its GEMMs, float32 on AVX2, each
 * one call over the whole step (cpu_kernels.py; fused_model.py patches them in):
 *
 * - rms_norm: weight * (x * 1 / sqrt(mean(x * x) + eps)) per row, as HF's RMSNorm rounds
 *   it (each square rounded, then summed; the normalised value rounded before the
 *   weight); with a residual, x + residual is formed first, stored as the next residual
 *   stream, and normalised.
 * - silu_and_mul: gate / (1 + e^-gate) * up over [rows, 2n] (gate the first n columns).
 * - rotary: Llama/NeoX RoPE in place, each half pair (x1, x2) of a head becoming
 *   (x1 c - x2 s, x2 c + x1 s), c and s from a table row chosen by the token's position,
 *   two products rounded and then added, as HF's q * cos + rotate_half(q) * sin.
 *
 * Every row is computed alone, in the same order whatever else is in the call and however
 * many threads run it (the squares are summed in 8 lanes added in one fixed order), so a
 * row's bits never depend on its batch. The library is built with -ffp-contract=off, so
 * each product and sum written here is rounded where it is written.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Below this many floats a call runs on one thread: the work is shorter than waking the
 * others. */
#define PARALLEL_FLOATS 65536

/* x, residual, out and residual_out [rows, cols] contiguous, cols % 8 == 0; residual_out
 * (with a residual) gets x + residual. */
void rms_norm(const float *x, const float *residual, const float *weight, float *out,
              float *residual_out, int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        if (residual) {
            const float *add = residual + r * cols;
            float *sum = residual_out + r * cols;
            for (int64_t c = 0; c < cols; c += 8)
                _mm256_storeu_ps(sum + c, _mm256_add_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(add + c)));
            row = sum;
        }
        __m256 squares = _mm256_setzero_ps();
        for (int64_t c = 0; c < cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(row + c);
            squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
        }
        const float inverse = 1.0f / sqrtf(lanes_sum(squares) / (float)cols + eps);
        const __m256 scale = _mm256_set1_ps(inverse);
        float *dst = out + r * cols;
        for (int64_t c = 0; c < cols; c += 8) {
            const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(row + c), scale);
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), normed));
        }
    }
}

/* gate_up [rows, 2 * cols] contiguous, each row [gate (cols) | up (cols)]; cols % 8 == 0. */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t cols, int num_threads) {
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * cols, *up = gate + cols;
        float *dst = out + r * cols;
        for (int64_t c = 0; c < cols; c += 8) {
            const __m256 g = _mm256_loadu_ps(gate + c);
            const __m256 denominator = _mm256_add_ps(one, exp_lanes(_mm256_sub_ps(_mm256_setzero_ps(), g)));
            const __m256 silu = _mm256_div_ps(g, denominator);
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(silu, _mm256_loadu_ps(up + c)));
        }
    }
}

/* One head of head_dim floats at x, rotated by the table row cos_sin (cos of the half,
 * then sin of the half); half % 8 == 0. */
static inline void rotate_head(float *x, const float *cos_sin, int64_t half) {
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 c = _mm256_loadu_ps(cos_sin + i), s = _mm256_loadu_ps(cos_sin + half + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
}

/* query [T] with heads `q_head_stride` apart and tokens `q_token_stride` apart (the same
 * for key); positions[t] < the table's rows, each row head_dim floats. */
void rotary(float *query, int64_t q_token_stride, int64_t q_head_stride, int64_t num_heads,
            float *key, int64_t k_token_stride, int64_t k_head_stride, int64_t num_kv_heads,
            const int64_t *positions, const float *cos_sin, int64_t num_tokens, int64_t head_dim,
            int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_tokens * (num_heads + num_kv_heads) * head_dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = cos_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; h++)
            rotate_head(query + t * q_token_stride + h * q_head_stride, row, half);
        for (int64_t h = 0; h < num_kv_heads; h++)
            rotate_head(key + t * k_token_stride + h * k_head_stride, row, half);
    }
}
