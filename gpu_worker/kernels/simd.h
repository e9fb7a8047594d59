/* Vector helpers shared by the kernels (AVX2 + FMA, float32). */

#ifndef PAGODA_SIMD_H
#define PAGODA_SIMD_H

#include <immintrin.h>

/* The sum of v's 8 lanes, always added in this order:
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static inline float lanes_sum(__m256 v) {
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

/* Whether the kernels run their AVX-512 paths (gemm.c, paged_attention.c): same bits as the
 * AVX2 ones, each lane computing the same chain. setting 0: off, 1: on where the CPU has
 * it, -1: ask. */
int wide_vectors(int setting);

#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq")))

/* One 512-bit register of two 8-lane halves. */
AVX512 static inline __m512 joined(__m256 low, __m256 high) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

#endif
