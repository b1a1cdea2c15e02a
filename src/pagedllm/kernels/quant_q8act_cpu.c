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
 * then madd into int32, with no saturation: see tile; or AVX-512 VNNI's vpdpbusd over up to four output groups at
 * once: see tile_wide); each block's sum is converted to fp32, scaled and accumulated, blocks in order.
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
#define CHUNKS_PER_THREAD 4

/* Keeps v in a register here: without it gcc reassociates a tile's integer sums (exact, so it may), computes
 * every product of a block first and spills them to the stack (half the speed). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* 4 activation bytes as one int32 (to broadcast to every lane). */
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Quantize one row of K = 32 * nb floats: qa [K] int8, da [nb], sa [nb], and where ia is not NULL the blocks'
 * integer sums of qa, ia [nb]. */
static void quantize_row(const float *x, int64_t nb, int8_t *qa, float *da, float *sa, int32_t *ia) {
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
        if (ia != NULL) ia[b] = _mm_cvtsi128_si32(s4);
    }
}

/* Accumulate a tile of R activation rows (1 to MR) x one group of 8 weight rows over all blocks.
 * Each 32-bit lane of a product vector is one output n of the group: maddubs multiplies the lane's 4 weight bytes
 * (k = 4q .. 4q + 3 of quad q) by the row's 4 activation bytes broadcast to every lane and adds them in int16
 * pairs. U4 adds the 8 quads of a block in int16 (at most 8 * 2 * 15 * 127 = 30480: no overflow), U5 flushes to
 * int32 every 4 quads (4 * 2 * 31 * 127), S8 every quad (|w| x a with w's sign: 2 * 128 * 127). Integer sums are
 * exact in any order, so a block's int32 sum does not depend on the tile. Then per block: int32 -> fp32, times
 * d * da, plus mn * sa: every lane runs the same fp32 op sequence whatever R, the group or the thread.
 * The per-row sums are named variables (s<row>, t<row>, c<row>): as arrays gcc kept them on the stack.
 * out: [R] rows of 8 floats (stride ld). */
static inline __attribute__((always_inline)) void tile(
        int wtype, int R, const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa, const float *da,
        const float *sa, int64_t nb, int64_t K, float *out, int64_t ld) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;  /* per group and block */
    const __m256i zi = _mm256_setzero_si256();
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
#define ROWS(X) X(0) X(1) X(2) X(3)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * bytes;
        const int8_t *ab = qa + b * QK;  /* row r's block: ab + r * K */
        __m256i s0 = zi, s1 = zi, s2 = zi, s3 = zi;  /* int32 sums */
        if (wtype == W_S8) {
            for (int q = 0; q < 8; q++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + q * 32)), wabs = _mm256_abs_epi8(w);
#define S8_ROW(r)                                                                                                  \
                if (R > r) {                                                                                       \
                    const __m256i a = _mm256_set1_epi32(load4(ab + r * K + q * 4));                                \
                    s##r = _mm256_add_epi32(s##r, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, w)), ones)); \
                    IN_REGISTER(s##r);                                                                             \
                }
                ROWS(S8_ROW)
#undef S8_ROW
            }
        } else {
            const __m256i h = wtype == W_U5 ? _mm256_loadu_si256((const __m256i *)(wb + 128)) : zi;
            __m256i t0 = zi, t1 = zi, t2 = zi, t3 = zi;  /* int16 sums since the last flush (U4: the block) */
            for (int j = 0; j < 4; j++) {
                /* load j holds quad j in its low nibbles and quad j + 4 in its high ones */
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(wb + j * 32));
                __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                if (wtype == W_U5) { /* bit q of each byte of h -> 0x10, for q = j and j + 4 */
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4 - j), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(j == 0 ? h : _mm256_srli_epi16(h, j), bit4));
                }
#define U_ROW(r)                                                                                                   \
                if (R > r) {                                                                                       \
                    const __m256i al = _mm256_set1_epi32(load4(ab + r * K + j * 4));                               \
                    const __m256i ah = _mm256_set1_epi32(load4(ab + r * K + (j + 4) * 4));                         \
                    t##r = _mm256_add_epi16(t##r, _mm256_add_epi16(_mm256_maddubs_epi16(lo, al),                   \
                                                                   _mm256_maddubs_epi16(hi, ah)));                 \
                    IN_REGISTER(t##r);                                                                             \
                }
                ROWS(U_ROW)
#undef U_ROW
                if (j == 3 || (wtype == W_U5 && j == 1)) {
#define FLUSH(r) if (R > r) { s##r = _mm256_add_epi32(s##r, _mm256_madd_epi16(t##r, ones)); t##r = zi; }
                    ROWS(FLUSH)
#undef FLUSH
                }
            }
        }
        const __m256 dw = _mm256_loadu_ps(dg + b * 8);
#define FP(r)                                                                                                      \
        if (R > r) {                                                                                               \
            c##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s##r), _mm256_mul_ps(dw, _mm256_broadcast_ss(da + r * nb + b)), c##r); \
            if (wtype != W_S8)                                                                                     \
                c##r = _mm256_fmadd_ps(_mm256_loadu_ps(mg + b * 8), _mm256_broadcast_ss(sa + r * nb + b), c##r);   \
        }
        ROWS(FP)
#undef FP
    }
#define STORE(r) if (R > r) _mm256_storeu_ps(out + r * ld, c##r);
    ROWS(STORE)
#undef STORE
#undef ROWS
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1
#define MRW 4  /* activation rows per wide tile */
/* tile() for P pairs of groups at once with AVX-512 VNNI (a zmm holds a pair's 8 + 8 outputs; P = 2: 32 outputs
 * in two zmm, or P = 1 at the edge of a chunk): vpdpbusd adds each lane's 4 unsigned weight x signed activation
 * byte products straight into its int32 sum, so one broadcast of 4 activation bytes serves P ops and a block's
 * decoded weights serve MRW rows (two zmm of outputs x 4 rows: 8 int32 sums, 8 fp32 sums and the decoded weights
 * fit the 32 registers; 6 rows spilled and measured no faster). S8 weights, signed, enter as the unsigned bytes
 * w + 128 (an xor per weight vector) and the block's sum drops 128 x the row's activation sum (ia): the same
 * integer, one op per product (negating the activations by the weights' signs, per row, cost the LM head 1.4x).
 * The int32 block sums are the same integers as tile()'s (exact in any order) and the fp32 part runs the same op
 * sequence per lane: the same bits whatever the tile. P = 1 keeps two int32 sums per row (lo and hi nibbles, or
 * even and odd quads) so that enough independent vpdpbusd chains cover its latency; P = 2 has two per row. */
static inline __attribute__((always_inline)) __m512i load_pair256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __attribute__((always_inline)) __m512 load_pair_f(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

static inline __attribute__((always_inline)) void tile_wide(
        int wtype, int R, int P, const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa,
        const float *da, const float *sa, const int32_t *ia, int64_t nb, int64_t K, float *out, int64_t ld) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10), zi = _mm512_setzero_si512();
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128, gs = nb * bytes, fs = nb * 8;
    const __m512 zf = _mm512_setzero_ps();
    __m512 c00 = zf, c01 = zf, c10 = zf, c11 = zf, c20 = zf, c21 = zf, c30 = zf, c31 = zf;
#define ROWS(X) X(0) X(1) X(2) X(3)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * bytes;  /* group i of the tile: wb + i * gs */
        const int8_t *ab = qa + b * QK;      /* row r's block: ab + r * K */
        /* P = 2: the sums of pair 0 and pair 1; P = 1: two halves of pair 0's */
        __m512i s00 = zi, s01 = zi, s10 = zi, s11 = zi, s20 = zi, s21 = zi, s30 = zi, s31 = zi;
        if (wtype == W_S8)
            for (int q = 0; q < 8; q++) {  /* w + 128 as unsigned bytes (see ia) */
                const __m512i w0 = _mm512_xor_si512(load_pair256(wb + q * 32, wb + gs + q * 32), bias);
                const __m512i w1 =
                    P == 2 ? _mm512_xor_si512(load_pair256(wb + 2 * gs + q * 32, wb + 3 * gs + q * 32), bias) : zi;
#define S8_ROW(r)                                                                                                  \
                if (R > r) {                                                                                       \
                    const __m512i a = _mm512_set1_epi32(load4(ab + r * K + q * 4));                                \
                    if (P == 2) {                                                                                  \
                        s##r##0 = _mm512_dpbusd_epi32(s##r##0, w0, a);                                             \
                        s##r##1 = _mm512_dpbusd_epi32(s##r##1, w1, a);                                             \
                    } else if (q % 2) {                                                                            \
                        s##r##1 = _mm512_dpbusd_epi32(s##r##1, w0, a);                                             \
                    } else {                                                                                       \
                        s##r##0 = _mm512_dpbusd_epi32(s##r##0, w0, a);                                             \
                    }                                                                                              \
                }
                ROWS(S8_ROW)
#undef S8_ROW
            }
        const __m512i h0 = wtype == W_U5 ? load_pair256(wb + 128, wb + gs + 128) : zi;
        const __m512i h1 = wtype == W_U5 && P == 2 ? load_pair256(wb + 2 * gs + 128, wb + 3 * gs + 128) : zi;
#pragma GCC unroll 4
        for (int j = 0; j < 4 && wtype != W_S8; j++) {
            /* load j holds quad j in its low nibbles and quad j + 4 in its high ones */
            const __m512i packed0 = load_pair256(wb + j * 32, wb + gs + j * 32);
            const __m512i packed1 = P == 2 ? load_pair256(wb + 2 * gs + j * 32, wb + 3 * gs + j * 32) : zi;
            __m512i lo0 = _mm512_and_si512(packed0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(packed0, 4), low4);
            __m512i lo1 = _mm512_and_si512(packed1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(packed1, 4), low4);
            if (wtype == W_U5) { /* bit q of each byte of h -> 0x10, for q = j and j + 4 */
                lo0 = _mm512_or_si512(lo0, _mm512_and_si512(_mm512_slli_epi16(h0, 4 - j), bit4));
                hi0 = _mm512_or_si512(hi0, _mm512_and_si512(j == 0 ? h0 : _mm512_srli_epi16(h0, j), bit4));
                lo1 = _mm512_or_si512(lo1, _mm512_and_si512(_mm512_slli_epi16(h1, 4 - j), bit4));
                hi1 = _mm512_or_si512(hi1, _mm512_and_si512(j == 0 ? h1 : _mm512_srli_epi16(h1, j), bit4));
            }
#define U_ROW(r)                                                                                                   \
            if (R > r) {                                                                                           \
                const __m512i al = _mm512_set1_epi32(load4(ab + r * K + j * 4));                                   \
                const __m512i ah = _mm512_set1_epi32(load4(ab + r * K + (j + 4) * 4));                             \
                s##r##0 = _mm512_dpbusd_epi32(s##r##0, lo0, al);                                                   \
                if (P == 2) {                                                                                      \
                    s##r##0 = _mm512_dpbusd_epi32(s##r##0, hi0, ah);                                               \
                    s##r##1 = _mm512_dpbusd_epi32(s##r##1, lo1, al);                                               \
                }                                                                                                  \
                s##r##1 = _mm512_dpbusd_epi32(s##r##1, P == 2 ? hi1 : hi0, ah);                                    \
            }
            ROWS(U_ROW)
#undef U_ROW
        }
        const __m512 dw0 = load_pair_f(dg + b * 8, dg + fs + b * 8);
        const __m512 dw1 = P == 2 ? load_pair_f(dg + 2 * fs + b * 8, dg + 3 * fs + b * 8) : zf;
        const __m512 mw0 = wtype == W_S8 ? zf : load_pair_f(mg + b * 8, mg + fs + b * 8);
        const __m512 mw1 = wtype == W_S8 || P == 1 ? zf : load_pair_f(mg + 2 * fs + b * 8, mg + 3 * fs + b * 8);
#define FP_ONE(r, p, sum)                                                                                          \
            c##r##p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw##p, _mm512_set1_ps(da[r * nb + b])), \
                                      c##r##p);                                                                    \
            if (wtype != W_S8) c##r##p = _mm512_fmadd_ps(mw##p, _mm512_set1_ps(sa[r * nb + b]), c##r##p);
#define FP(r)                                                                                                      \
        if (R > r) {                                                                                               \
            if (wtype == W_S8) {                                                                                   \
                const __m512i bias_sum = _mm512_set1_epi32(ia[r * nb + b] * 128);                                  \
                s##r##0 = _mm512_sub_epi32(s##r##0, bias_sum);                                                     \
                s##r##1 = P == 2 ? _mm512_sub_epi32(s##r##1, bias_sum) : s##r##1;                                  \
            }                                                                                                      \
            if (P == 2) {                                                                                          \
                FP_ONE(r, 0, s##r##0)                                                                              \
                FP_ONE(r, 1, s##r##1)                                                                              \
            } else {                                                                                               \
                FP_ONE(r, 0, _mm512_add_epi32(s##r##0, s##r##1))                                                   \
            }                                                                                                      \
        }
        ROWS(FP)
#undef FP
#undef FP_ONE
    }
#define STORE(r)                                                                                                   \
    if (R > r) {                                                                                                   \
        _mm512_storeu_ps(out + r * ld, c##r##0);                                                                   \
        if (P == 2) _mm512_storeu_ps(out + r * ld + 16, c##r##1);                                                  \
    }
    ROWS(STORE)
#undef STORE
#undef ROWS
}

/* tile_wide over a chunk's `rows` activation rows, MRW at a time: one call per chunk and group pair(s) (a call
 * per tile cost ~5% at these sizes). */
typedef void (*tile_wide_fn)(const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa, const float *da,
                             const float *sa, const int32_t *ia, int64_t nb, int64_t K, float *out, int64_t ld,
                             int64_t rows);
#define TILE_WIDE_REST(T, P, R) case R: tile_wide(T, R, P, wg, dg, mg, qa, da, sa, ia, nb, K, out, ld); break;
#define DEFINE_TILE_WIDE(T, P)                                                                                     \
    static void tile_wide_##T##_##P(const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa,         \
                                    const float *da, const float *sa, const int32_t *ia, int64_t nb, int64_t K,    \
                                    float *out, int64_t ld, int64_t rows) {                                        \
        for (; rows >= MRW; rows -= MRW, qa += MRW * K, da += MRW * nb, sa += MRW * nb, out += MRW * ld,          \
                            ia += T == W_S8 ? MRW * nb : 0)                                                        \
            tile_wide(T, MRW, P, wg, dg, mg, qa, da, sa, ia, nb, K, out, ld);                                      \
        switch (rows) { TILE_WIDE_REST(T, P, 1) TILE_WIDE_REST(T, P, 2) TILE_WIDE_REST(T, P, 3) }                  \
    }
DEFINE_TILE_WIDE(0, 1) DEFINE_TILE_WIDE(0, 2) DEFINE_TILE_WIDE(1, 1) DEFINE_TILE_WIDE(1, 2) DEFINE_TILE_WIDE(2, 1)
DEFINE_TILE_WIDE(2, 2)
#undef DEFINE_TILE_WIDE
#undef TILE_WIDE_REST
static const tile_wide_fn TILES_WIDE[3][2] = {{tile_wide_0_1, tile_wide_0_2}, {tile_wide_1_1, tile_wide_1_2},
                                              {tile_wide_2_1, tile_wide_2_2}};  /* [W_U4, W_U5, W_S8][P - 1] */
#else
#define WIDE 0
#endif

/* Quantize x [M, K] per row and block; ia: NULL, or [M, K / 32] the blocks' integer sums. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, float *sa, int32_t *ia) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, nb, qa + m * K, da + m * nb, sa + m * nb, ia == NULL ? NULL : ia + m * nb);
}

/* Quantize x [M, K] per row and block (exposed for tests). */
void q8act_quantize_f32(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, float *sa) {
    quantize_rows(x, M, K, qa, da, sa, NULL);
}

/* tile() with its shape as constants: [wtype][R - 1]. */
typedef void (*tile_fn)(const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa, const float *da,
                        const float *sa, int64_t nb, int64_t K, float *out, int64_t ld);
#define DEFINE_TILE(T, R)                                                                                          \
    static void tile_##T##_##R(const uint8_t *wg, const float *dg, const float *mg, const int8_t *qa,              \
                               const float *da, const float *sa, int64_t nb, int64_t K, float *out, int64_t ld) { \
        tile(T, R, wg, dg, mg, qa, da, sa, nb, K, out, ld);                                                        \
    }
#define DEFINE_TILES(T) DEFINE_TILE(T, 1) DEFINE_TILE(T, 2) DEFINE_TILE(T, 3) DEFINE_TILE(T, 4)
DEFINE_TILES(0) DEFINE_TILES(1) DEFINE_TILES(2)  /* W_U4, W_U5, W_S8 */
#undef DEFINE_TILES
#undef DEFINE_TILE
#define TILES_OF(T) {tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4}
static const tile_fn TILES[3][MR] = {TILES_OF(0), TILES_OF(1), TILES_OF(2)};
#undef TILES_OF

/* out [M, N] = x [M, K] @ w^T with x quantized per row to 8 bits. Returns 0, or -1 when scratch memory fails.
 * Threads take chunks of output groups as they come (about CHUNKS_PER_THREAD per thread: a descheduled thread
 * does not hold the others back with a fixed share); per chunk of M_CHUNK rows a chunk walks its groups, and per
 * group the rows in tiles of up to MR rows. Which thread computes an output never changes its value. */
int q8act_linear_f32(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                     const float *x, int64_t M, float *out) {
    const int64_t nb = K / QK, num_groups = (N + 7) / 8;
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;  /* per group and block */
    int8_t *qa = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *da = malloc(sizeof(float) * (size_t)(M * nb)), *sa = malloc(sizeof(float) * (size_t)(M * nb));
    const int need_ia = WIDE && wtype == W_S8;  /* S8 in the wide tiles: each row's block sums of qa */
    int32_t *ia = need_ia ? malloc(sizeof(int32_t) * (size_t)(M * nb)) : NULL;
    if (qa == NULL || da == NULL || sa == NULL || (need_ia && ia == NULL)) {
        free(qa);
        free(da);
        free(sa);
        free(ia);
        return -1;
    }
    quantize_rows(x, M, K, qa, da, sa, ia);
#pragma omp parallel num_threads(M * N * K >= (1 << 18) ? omp_get_max_threads() : 1)
    {
        const int64_t nth = omp_get_num_threads();
        int64_t chunk = (num_groups + nth * CHUNKS_PER_THREAD - 1) / (nth * CHUNKS_PER_THREAD);
        if (WIDE) chunk = (chunk + 3) / 4 * 4;  /* chunks of whole group quads, whatever the threads */
#pragma omp for schedule(dynamic, 1)
        for (int64_t first = 0; first < num_groups; first += chunk) {
            const int64_t last = first + chunk < num_groups ? first + chunk : num_groups;
            for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
                const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
                for (int64_t g = first; g < last; g++) {
                    const int64_t n0 = g * 8, valid = N - n0 < 8 ? N - n0 : 8;
#if WIDE
                    /* four full groups (32 outputs), or two (16), or one in tile() below */
                    const int pairs = g + 3 < last && n0 + 32 <= N ? 2
                                      : g + 1 < last && n0 + 16 <= N ? 1 : 0;
                    if (pairs) {
                        TILES_WIDE[wtype][pairs - 1](wq + g * nb * bytes, d + g * nb * 8, mn ? mn + g * nb * 8 : NULL,
                                                     qa + m0 * K, da + m0 * nb, sa + m0 * nb, ia ? ia + m0 * nb : NULL,
                                                     nb, K, out + m0 * N + n0, N, m1 - m0);
                        g += 2 * pairs - 1;
                        continue;
                    }
#endif
                    for (int64_t m = m0; m < m1; m += MR) {
                        const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                        float tmp[MR * 8];
                        float *dst = valid == 8 ? out + m * N + n0 : tmp;
                        TILES[wtype][rows - 1](wq + g * nb * bytes, d + g * nb * 8,
                                               mn == NULL ? NULL : mn + g * nb * 8, qa + m * K, da + m * nb,
                                               sa + m * nb, nb, K, dst, valid == 8 ? N : 8);
                        if (dst == tmp)
                            for (int i = 0; i < rows; i++)
                                memcpy(out + (m + i) * N + n0, tmp + i * 8, valid * sizeof(float));
                    }
                }
            }
        }
    }
    free(qa);
    free(da);
    free(sa);
    free(ia);
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
