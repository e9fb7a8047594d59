/* Selections over each row of a float32 [rows, cols] block (logits), for the sampler and
 * the rescored head on the CPU (cpu_kernels.py):
 *
 * - argmax_rows: the index of each row's largest value, the first one on ties, or of its
 *   first NaN where it has one (torch.argmax's answer, in a tenth of its time on two
 *   cores at 64 x 49,152);
 * - top_k_rows: the indices of each row's k largest values, ties going to the lower index,
 *   in no particular order (the rescored head's candidates).
 *
 * A row's answer depends on its own values alone, never on the other rows or the threads. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Below this many floats a call runs on one thread. */
#define PARALLEL_FLOATS 65536

static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t c = 0; c < cols; c++)
        if (isnan(row[c])) return c;
    return -1;
}

static int64_t row_argmax(const float *row, int64_t cols) {
    int64_t c = 0, best_at = 0;
    float best = row[0];
    if (cols >= 8) {
        /* Each lane keeps the first of its largest values; then the lowest index among the
         * lanes holding the largest of all. */
        __m256 lane_best = _mm256_loadu_ps(row);
        __m256i lane_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i at = lane_at;
        __m256 nans = _mm256_cmp_ps(lane_best, lane_best, _CMP_UNORD_Q);
        const __m256i eight = _mm256_set1_epi32(8);
        for (c = 8; c + 8 <= cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(row + c);
            at = _mm256_add_epi32(at, eight);
            nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 greater = _mm256_cmp_ps(v, lane_best, _CMP_GT_OQ);
            lane_best = _mm256_blendv_ps(lane_best, v, greater);
            lane_at = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(lane_at), _mm256_castsi256_ps(at), greater));
        }
        if (_mm256_movemask_ps(nans)) return first_nan(row, cols);
        float values[8];
        int32_t indices[8];
        _mm256_storeu_ps(values, lane_best);
        _mm256_storeu_si256((__m256i *)indices, lane_at);
        best = values[0];
        best_at = indices[0];
        for (int l = 1; l < 8; l++)
            if (values[l] > best || (values[l] == best && indices[l] < best_at)) {
                best = values[l];
                best_at = indices[l];
            }
    } else {
        if (isnan(best)) return 0;
        c = 1;
    }
    for (; c < cols; c++) {
        if (isnan(row[c])) return c;
        if (row[c] > best) {
            best = row[c];
            best_at = c;
        }
    }
    return best_at;
}

/* x [rows, cols] contiguous, cols >= 1; out [rows]. */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * cols, cols);
}

/* The candidate that leaves first: the smallest value, the highest index among equals. */
static int weakest(const float *values, const int64_t *indices, int64_t k) {
    int weakest_at = 0;
    for (int64_t i = 1; i < k; i++)
        if (values[i] < values[weakest_at] ||
            (values[i] == values[weakest_at] && indices[i] > indices[weakest_at]))
            weakest_at = (int)i;
    return weakest_at;
}

/* Value `value` at index `at` offered to the k kept: it replaces the weakest (*low) when
 * larger, and *low becomes the new weakest. */
static inline void offer(float *values, int64_t *indices, int64_t k, int *low, float value,
                         int64_t at) {
    if (!(value > values[*low])) return;
    values[*low] = value;
    indices[*low] = at;
    *low = weakest(values, indices, k);
}

/* x [rows, cols] contiguous, 1 <= k <= cols; out [rows, k]. A value enters the k kept so
 * far when it is larger than their smallest (a later equal one does not), so the kept are
 * the k largest with ties to the lower index; eight values at a time are passed over at
 * once while none is larger, which is nearly always once the row is under way. NaNs are
 * never taken after the first k. */
void top_k_rows(const float *x, int64_t rows, int64_t cols, int64_t k, int64_t *out,
                int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int64_t *indices = out + r * k;
        float values[k];
        for (int64_t i = 0; i < k; i++) {
            values[i] = row[i];
            indices[i] = i;
        }
        int low = weakest(values, indices, k);
        int64_t c = k;
        for (; c + 8 <= cols; c += 8) {
            const __m256 greater = _mm256_cmp_ps(_mm256_loadu_ps(row + c), _mm256_set1_ps(values[low]), _CMP_GT_OQ);
            if (!_mm256_movemask_ps(greater)) continue;
            for (int64_t j = c; j < c + 8; j++) offer(values, indices, k, &low, row[j], j);
        }
        for (; c < cols; c++) offer(values, indices, k, &low, row[c], c);
    }
}
