/* Quantized linear with 8-bit activations: the opt-in fast mode (`activation_quantization="int8"`).
 *
 * out[m, n] = sum_k x[m, k] * w[n, k], with both sides quantized per block of 32 values along k:
 *   weights (packed at load by layers/int8_activation_weight.py from GGUF codes; the values stay exact):
 *     U4  w = q * d + mn, q in [0, 15]      Q4_0 (mn = -8 d), Q4_1, Q4_K (d, mn per 32-value sub-block)
 *     U5  w = q * d + mn, q in [0, 31]      Q5_0 (mn = -16 d), Q5_1, Q5_K
 *     S8  w = q * d,      q in [-127, 127]  Q8_0
 *   activations, per row and block (llama.cpp's Q8_0/Q8_1 scheme, scales kept in fp32):
 *     da = amax / 127, qa = round(x / da) in [-127, 127], sa = da * sum(qa)
 * so that per block   sum_k x w  ~  d * da * sum_k(q * qa)  +  mn * sa.
 * The integer sums are exact (AVX2 maddubs, unsigned weight bytes x signed activation bytes into int16 pairs,
 * then madd into int32, with no saturation: see group_tile); each block's sum is converted to fp32, scaled and
 * accumulated, blocks in order.
 *
 * Packed weight layout: rows in groups of 8 (N padded to a multiple of 8), per group and block of 32 k:
 *   U4  128 bytes: 4 loads of 32; load j, lane n (4 bytes): k = 4j..4j+3 in the low nibbles, 4(j+4).. in the high
 *   U5  those 128 + 32 bytes of fifth bits: byte (n, t) bit q = fifth bit of w[n, 4q + t]
 *   S8  256 bytes: 8 quads of 32, quad q lane n = w[n, 4q .. 4q + 3]
 *   d, mn  [groups, K / 32, 8] f32 (mn unused for S8).
 * x [M, K] f32 and out [M, N] f32, row-major.
 *
 * Invariant (batch invariance, DESIGN invariant 2): out[m, n] depends only on row m of x and row n of w. The
 * activation quantization is per row; each output is one fp32 lane that runs the same op sequence (blocks in
 * order) whatever the row tile, the group or the thread; threads split the output groups, never the reduction.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd_cpu.h"

enum { W_U4 = 0, W_U5 = 1, W_S8 = 2 };
#define QK 32
#define MR 4        /* activation rows per tile (a tile is MR rows x 8 outputs) */
#define M_CHUNK 64  /* activation rows kept hot in L2 while a thread walks its weight rows */

/* 4 activation bytes as one int32 (to broadcast to every lane). */
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
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

/* Accumulate one row tile (mr activation rows) against one group of 8 weight rows over all blocks.
 * Each 32-bit lane of a product vector is one output n of the group: maddubs multiplies the lane's 4 weight
 * bytes (k = 4q .. 4q + 3 of quad q) by the row's 4 activation bytes broadcast to every lane and adds them in
 * int16 pairs. U4 adds the 8 quads of a block in int16 (at most 8 * 2 * 15 * 127 = 30480: no overflow), U5
 * flushes to int32 every 4 quads (4 * 2 * 31 * 127), S8 every quad (|w| x a with w's sign: 2 * 128 * 127).
 * Then per block: int32 -> fp32, times d * da, plus mn * sa. Every lane runs the same op sequence whatever
 * mr, the group, or the thread. out: [mr] rows of 8 floats (stride ld). */
static inline __attribute__((always_inline)) void group_tile(
        int wtype, const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa, const float *da,
        const float *sa, int mr, int64_t nb, int64_t K, float *out, int64_t ld) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;  /* per group and block */
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * bytes;
        __m256i isum[MR];
        for (int i = 0; i < mr; i++) isum[i] = _mm256_setzero_si256();
        if (wtype == W_S8) {
            for (int q = 0; q < 8; q++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + q * 32)), wabs = _mm256_abs_epi8(w);
                for (int i = 0; i < mr; i++) {
                    const __m256i a = _mm256_set1_epi32(load4(qa + i * K + b * QK + q * 4));
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, w)), ones));
                }
            }
        } else {
            __m256i hb = _mm256_setzero_si256(), s16[MR];
            if (wtype == W_U5) hb = _mm256_loadu_si256((const __m256i *)(wb + 128));
            for (int half = 0; half < 2; half++) {
                if (half == 0 || wtype == W_U5)
                    for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
                for (int j = 0; j < 2; j++) {
                    /* load 2 * half + j holds quad (2 * half + j) in its low nibbles and quad (+ 4) in its high */
                    const int lo_q = 2 * half + j;
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(wb + lo_q * 32));
                    for (int part = 0; part < 2; part++) {
                        const int q = lo_q + 4 * part;
                        __m256i w = _mm256_and_si256(part ? _mm256_srli_epi16(packed, 4) : packed, low4);
                        if (wtype == W_U5) /* bit q of each byte of hb -> 0x10 */
                            w = _mm256_or_si256(w, _mm256_and_si256(
                                q <= 4 ? _mm256_slli_epi16(hb, 4 - q) : _mm256_srli_epi16(hb, q - 4), bit4));
                        for (int i = 0; i < mr; i++) {
                            const __m256i a = _mm256_set1_epi32(load4(qa + i * K + b * QK + q * 4));
                            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(w, a));
                        }
                    }
                }
                if (half == 1 || wtype == W_U5)  /* U4 adds the whole block in int16, U5 each half */
                    for (int i = 0; i < mr; i++) isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(s16[i], ones));
            }
        }
        const __m256 dw = _mm256_loadu_ps(dg + b * 8);
        for (int i = 0; i < mr; i++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(da + i * nb + b));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, acc[i]);
            if (wtype != W_S8)
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(mg + b * 8), _mm256_broadcast_ss(sa + i * nb + b), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * ld, acc[i]);
}

/* Quantize x [M, K] per row and block (exposed for tests). */
void q8act_quantize_f32(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, float *sa) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, nb, qa + m * K, da + m * nb, sa + m * nb);
}

static void group_tile_dispatch(int wtype, const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa,
                                const float *da, const float *sa, int mr, int64_t nb, int64_t K, float *out,
                                int64_t ld) {
#define GROUP_TILE(T) do { \
        if (mr == MR) group_tile(T, wg, dg, mg, qa, da, sa, MR, nb, K, out, ld); \
        else group_tile(T, wg, dg, mg, qa, da, sa, 1, nb, K, out, ld); \
    } while (0)
    if (wtype == W_U4) GROUP_TILE(W_U4);
    else if (wtype == W_U5) GROUP_TILE(W_U5);
    else GROUP_TILE(W_S8);
#undef GROUP_TILE
}

/* out [M, N] = x [M, K] @ w^T with x quantized per row to 8 bits. Returns 0, or -1 when scratch memory fails. */
int q8act_linear_f32(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                     const float *x, int64_t M, float *out) {
    const int64_t nb = K / QK, num_groups = (N + 7) / 8;
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;  /* per group and block */
    int8_t *qa = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *da = malloc(sizeof(float) * (size_t)(M * nb)), *sa = malloc(sizeof(float) * (size_t)(M * nb));
    if (qa == NULL || da == NULL || sa == NULL) {
        free(qa);
        free(da);
        free(sa);
        return -1;
    }
    q8act_quantize_f32(x, M, K, qa, da, sa);
#pragma omp parallel num_threads(M * N * K >= (1 << 18) ? omp_get_max_threads() : 1)
    {
        const int64_t nth = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = num_groups * t / nth, last = num_groups * (t + 1) / nth;
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
            for (int64_t g = first; g < last; g++) {
                const int64_t n0 = g * 8, valid = N - n0 < 8 ? N - n0 : 8;
                int64_t m = m0;
                while (m < m1) {
                    const int mr = m + MR <= m1 ? MR : 1;
                    float tmp[MR * 8];
                    float *dst = valid == 8 ? out + m * N + n0 : tmp;
                    group_tile_dispatch(wtype, wq + g * nb * bytes, d + g * nb * 8, mn + g * nb * 8, qa + m * K,
                                        da + m * nb, sa + m * nb, mr, nb, K, dst, valid == 8 ? N : 8);
                    if (valid < 8)
                        for (int i = 0; i < mr; i++) memcpy(out + (m + i) * N + n0, tmp + i * 8, valid * sizeof(float));
                    m += mr;
                }
            }
        }
    }
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
int q8act_linear_f32(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                     const float *x, int64_t M, float *out) {
    (void)wtype; (void)wq; (void)d; (void)mn; (void)N; (void)K; (void)x; (void)M; (void)out;
    return -1;
}
#endif
