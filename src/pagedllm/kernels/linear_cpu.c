/* y[M, N] = x[M, K] @ W[N, K]^T for a few rows of x (decode at low concurrency), fp32.
 *
 * BLAS gemm is tuned for many rows; with 1-8 rows it spends more time packing W than multiplying, and the
 * step's weights (540 MB in fp32 for SmolLM2) stream from memory at a fraction of the bandwidth. Here each
 * thread takes a range of W's rows and reads each row once, for all M rows of x (x stays in L1).
 * Each y[m, n] is summed in a fixed order, independent of the thread count.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd_cpu.h"

#define MAX_ROWS 4
#endif

int linear_small_m_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m > MAX_ROWS || k % 8 != 0) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const float *wj = w + j * k;
        /* two accumulators per row (even and odd 8-float chunks) halve the FMA dependency chain */
        __m256 acc0[MAX_ROWS], acc1[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            const __m256 w0 = _mm256_loadu_ps(wj + i), w1 = _mm256_loadu_ps(wj + i + 8);
            for (int64_t r = 0; r < m; r++) {
                acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc0[r]);
                acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc1[r]);
            }
        }
        if (i < k) /* k % 16 == 8 */
            for (int64_t r = 0; r < m; r++)
                acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wj + i), _mm256_loadu_ps(x + r * k + i), acc0[r]);
        for (int64_t r = 0; r < m; r++) y[r * n + j] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)m; (void)n; (void)k;
    return -1; /* callers use BLAS */
#endif
}
