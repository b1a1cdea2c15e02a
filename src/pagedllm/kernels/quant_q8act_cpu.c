/* Quantized linear with 8-bit activations: the opt-in fast mode (`activation_quantization="int8"`).
 *
 * out[m, n] = sum_k x[m, k] * w[n, k], with both sides quantized per block of 32 values along k:
 *   weights (packed at load from GGUF blocks, see layers/q8act_weight.py):
 *     U4  w = q * d + mn, q in [0, 15]    Q4_0 (mn = -8 d), Q4_1, Q4_K (d, mn per 32-value sub-block)
 *     U5  w = q * d + mn, q in [0, 31]    Q5_0 (mn = -16 d), Q5_1, Q5_K
 *     S8  w = q * d,      q in [-127, 127]  Q8_0
 *   activations, per row and block (llama.cpp's Q8_0/Q8_1 scheme, scales kept in fp32):
 *     da = amax / 127, qa = round(x / da) in [-127, 127], sa = da * sum(qa)
 * so that per block   sum_k x w  ~  d * da * sum_k(q * qa)  +  mn * sa.
 * The integer sums are exact (AVX2 maddubs: unsigned weight bytes x signed activation bytes into int16 pairs,
 * at most 2 * 31 * 127 or 2 * 128 * 127 in magnitude, so never saturating; then madd into int32); each block's
 * sum is converted to fp32, scaled by d * da and accumulated in 8 fp32 lanes, in block order.
 *
 * Layouts (row-major, contiguous): x [M, K] f32; out [M, N] f32; weights padded to Np = N rounded up to NR:
 *   qs [Np, K / 32, 16] (U4, U5: ggml's nibble order, byte j = value j | value j + 16 << 4)
 *      [Np, K / 32, 32] int8 (S8);  qh [Np, K / 32] u32 (U5: bit j = fifth bit of value j);
 *   d, mn [Np, K / 32] f32 (mn unused for S8).
 *
 * Invariant (batch invariance, DESIGN invariant 2): out[m, n] depends only on row m of x and row n of w. The
 * activation quantization is per row; every (m, n) output runs the same instructions in the same order (one
 * accumulator, blocks in order, the same horizontal sum and min-term dot) whatever tile it falls in; threads
 * split the output features, never the reduction.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd_cpu.h"

enum { W_U4 = 0, W_U5 = 1, W_S8 = 2 };
#define QK 32
#define NR 4        /* weight rows per tile (the packed weight is padded to a multiple of this) */
#define MR 2        /* activation rows per tile */
#define M_CHUNK 64  /* activation rows kept hot in L2 while a thread walks its weight rows */

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* sum(a[i] * b[i]) for i in [0, n): one 8-lane accumulator, the tail masked, then a horizontal sum. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (i < n) {
        const __m256i mask = _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - (n - i)));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
    }
    return hsum8(acc);
}

/* Quantize one row of K = 32 * nb floats: qa [K] int8, da [nb], sa [nb]. */
static void quantize_row(const float *x, int64_t nb, int8_t *qa, float *da, float *sa) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float d = max_abs / 127.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        /* cvtps rounds to nearest even (the default MXCSR mode) */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* int32 -> int8 by two in-lane packs, then the 4-byte groups back into order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(qa + b * QK), _mm256_permutevar8x32_epi32(p, order));
        da[b] = d;
        sa[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

/* 32 bytes, byte i = 0xFF where bit i of x is set, else 0. */
static inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                              0x0303030303030303LL);
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);  /* every bit but bit (i % 8) of byte i */
    const __m256i v = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread), others);
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* Weight rows [n0, n0 + NR) as bytes q (unsigned for U4/U5) into buf [NR, K]. */
static void decode_tile(int wtype, const uint8_t *qs, const uint32_t *qh, int64_t n0, int64_t nb, uint8_t *buf) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t i = 0; i < NR * nb; i++) {
        const int64_t blk = n0 * nb + i;
        const __m128i x = _mm_loadu_si128((const __m128i *)(qs + blk * 16));
        __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), low4);
        if (wtype == W_U5) v = _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(qh[blk]), bit4));
        _mm256_storeu_si256((__m256i *)(buf + i * QK), v);
    }
}

/* acc[r][i] over all blocks for weight rows w [NR, K] (bytes) and activation rows qa [mr, K]; out[m][n] gets
 * hsum(acc) for each of the tile's valid weight rows. Every accumulator sees the same op sequence whatever mr. */
static inline __attribute__((always_inline)) void tile(
        const uint8_t *w, const float *dw, const int8_t *qa, const float *da, int mr, int s8, int64_t nb,
        float *sums /* [NR][MR] */) {
    const int64_t K = nb * QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < mr; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv[NR], wabs[NR];
        __m256 dwv[NR];
        for (int r = 0; r < NR; r++) {
            wv[r] = _mm256_loadu_si256((const __m256i *)(w + r * K + b * QK));
            if (s8) wabs[r] = _mm256_abs_epi8(wv[r]);
            dwv[r] = _mm256_broadcast_ss(dw + r * nb + b);
        }
        for (int i = 0; i < mr; i++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + i * K + b * QK));
            const __m256 dav = _mm256_broadcast_ss(da + i * nb + b);
            for (int r = 0; r < NR; r++) {
                /* signed weights: |w| x (a with w's sign), the maddubs operands must be unsigned x signed */
                const __m256i p = s8 ? _mm256_maddubs_epi16(wabs[r], _mm256_sign_epi8(a, wv[r]))
                                     : _mm256_maddubs_epi16(wv[r], a);
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                acc[r][i] = _mm256_fmadd_ps(f, _mm256_mul_ps(dwv[r], dav), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < mr; i++) sums[r * MR + i] = hsum8(acc[r][i]);
}

static void tile_dispatch(const uint8_t *w, const float *dw, const int8_t *qa, const float *da, int mr, int s8,
                          int64_t nb, float *sums) {
    if (s8) {
        if (mr == MR) tile(w, dw, qa, da, MR, 1, nb, sums);
        else tile(w, dw, qa, da, 1, 1, nb, sums);
    } else {
        if (mr == MR) tile(w, dw, qa, da, MR, 0, nb, sums);
        else tile(w, dw, qa, da, 1, 0, nb, sums);
    }
}

/* Quantize x [M, K] per row and block (exposed for tests). */
void q8act_quantize_f32(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, float *sa) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, nb, qa + m * K, da + m * nb, sa + m * nb);
}

/* out [M, N] = x [M, K] @ w^T with x quantized per row to 8 bits. Returns 0, or -1 when scratch memory fails. */
int q8act_linear_f32(int wtype, const uint8_t *qs, const uint32_t *qh, const float *d, const float *mn,
                     int64_t N, int64_t K, const float *x, int64_t M, float *out) {
    const int64_t nb = K / QK, num_tiles = (N + NR - 1) / NR;
    const int s8 = wtype == W_S8;
    const int max_threads = omp_get_max_threads();
    int8_t *qa = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *da = malloc(sizeof(float) * (size_t)(M * nb)), *sa = malloc(sizeof(float) * (size_t)(M * nb));
    uint8_t *bufs = s8 ? NULL : aligned_alloc(64, (size_t)(max_threads * NR * K));  /* one tile per thread */
    if (qa == NULL || da == NULL || sa == NULL || (!s8 && bufs == NULL)) {
        free(qa);
        free(da);
        free(sa);
        free(bufs);
        return -1;
    }
    q8act_quantize_f32(x, M, K, qa, da, sa);
#pragma omp parallel num_threads(M * N * K >= (1 << 18) ? max_threads : 1)
    {
        const int64_t nth = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = num_tiles * t / nth, last = num_tiles * (t + 1) / nth;
        uint8_t *buf = s8 ? NULL : bufs + t * NR * K;
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
            for (int64_t tl = first; tl < last; tl++) {
                const int64_t n0 = tl * NR;
                const uint8_t *w = qs + n0 * K;  /* S8: the packed rows are already bytes [NR, K] */
                if (!s8) {
                    decode_tile(wtype, qs, qh, n0, nb, buf);
                    w = buf;
                }
                int64_t m = m0;
                while (m < m1) {
                    const int mr = m + MR <= m1 ? MR : 1;
                    float sums[NR * MR];
                    tile_dispatch(w, d + n0 * nb, qa + m * K, da + m * nb, mr, s8, nb, sums);
                    for (int i = 0; i < mr; i++)
                        for (int r = 0; r < NR && n0 + r < N; r++) {
                            float v = sums[r * MR + i];
                            if (!s8) v += dot_f32(mn + (n0 + r) * nb, sa + (m + i) * nb, nb);
                            out[(m + i) * N + n0 + r] = v;
                        }
                    m += mr;
                }
            }
        }
    }
    free(bufs);
    free(qa);
    free(da);
    free(sa);
    return 0;
}

int q8act_supported(void) { return 1; }

#else
int q8act_supported(void) { return 0; }
void q8act_quantize_f32(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, float *sa) {
    (void)x; (void)M; (void)K; (void)qa; (void)da; (void)sa;
}
int q8act_linear_f32(int wtype, const uint8_t *qs, const uint32_t *qh, const float *d, const float *mn,
                     int64_t N, int64_t K, const float *x, int64_t M, float *out) {
    (void)wtype; (void)qs; (void)qh; (void)d; (void)mn; (void)N; (void)K; (void)x; (void)M; (void)out;
    return -1;
}
#endif
