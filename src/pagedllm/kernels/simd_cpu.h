/* Helpers shared by the CPU kernels (AVX2 builds only). */
#pragma once
#include <immintrin.h>

/* The sum of a vector's 8 floats. */
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
