/* The KV cache's storage formats and their conversions to and from fp32 (shared by the cache write and the decode
 * attention kernels).
 *
 *   KV_F32      float32, as is
 *   KV_BF16     bfloat16: the top 16 bits of a float32
 *   KV_FP8_E4M3 OCP E4M3FN (torch.float8_e4m3fn): bias 7, no infinities, 0x7F / 0xFF NaN, max finite 448
 *   KV_FP8_E5M2 OCP E5M2 (torch.float8_e5m2): bias 15, the top byte of an IEEE fp16, max finite 57344
 *
 * Scales (vLLM's k_scale / v_scale, one per layer for K and one for V): a stored code c stands for c * scale, so
 * the write encodes x / scale. Scales are powers of two (layers/kv_cache_dtype.py), so x / scale == x * (1 / scale)
 * and c * scale are exact and the readers fold them into the softmax scale (K) and the output (V) with the same
 * result as scaling every value. fp32 and bf16 caches always have scale 1.
 *
 * Encode (float -> code): round to nearest, ties to even; a value beyond the format's largest finite value,
 * infinities included, saturates to it with its sign; NaN becomes the format's NaN (sign kept: 0x7F / 0xFF for
 * both fp8 formats, a quiet NaN for bf16). Decode (code -> float) is exact: every code is a float32 value.
 * Integer arithmetic only, so -ffast-math cannot change a rounding.
 */
#pragma once
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

static inline int kv_elem_size(int fmt) { return fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1; }

static inline uint32_t kv_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float kv_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* |x| (bits, finite, not NaN) rounded to nearest-even into a float format with `man` mantissa bits and exponent
 * bias `bias`, as sign-less code bits (exponent field, then mantissa). Values past the largest normal exponent come
 * out past the format's code range: callers saturate first. Example, e4m3 (man 3, bias 7), |x| = 1.0625 = 0x3F880000:
 * halfway between 1.0 (0x38) and 1.125 (0x39); ties to even gives 0x38. */
static inline uint32_t kv_round_bits(uint32_t a, int man, int bias) {
    const int exp = (int)(a >> 23);
    if (exp < 127 + 1 - bias) { /* below the smallest normal: a subnormal code, in units of 2^(1 - bias - man) */
        if (exp == 0) return 0; /* float32 subnormals are far below every format's smallest subnormal */
        const uint32_t m = (a & 0x7FFFFF) | 0x800000; /* value = m * 2^(exp - 150) */
        const int shift = 150 + 1 - bias - man - exp; /* >= 24 - man */
        if (shift > 25) return 0; /* below half the smallest subnormal */
        const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        return q + (rem > half || (rem == half && (q & 1))); /* q = 2^man carries into the smallest normal */
    }
    const int drop = 23 - man;
    const uint32_t rounded = a + ((1u << (drop - 1)) - 1) + ((a >> drop) & 1); /* carries into the exponent */
    return (rounded >> drop) - ((uint32_t)(127 - bias) << man);
}

static inline uint8_t kv_encode_e4m3(float x) {
    const uint32_t u = kv_f32_bits(x), sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint8_t)(sign | 0x7F);        /* NaN */
    if (a >= 0x43E00000) return (uint8_t)(sign | 0x7E);       /* >= 448 (and inf): saturate */
    return (uint8_t)(sign | kv_round_bits(a, 3, 7));          /* at most 0x7E: 448 itself */
}

static inline uint8_t kv_encode_e5m2(float x) {
    const uint32_t u = kv_f32_bits(x), sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint8_t)(sign | 0x7F);        /* NaN */
    if (a >= 0x47600000) return (uint8_t)(sign | 0x7B);       /* >= 57344 (and inf): saturate */
    return (uint8_t)(sign | kv_round_bits(a, 2, 15));
}

static inline uint16_t kv_encode_bf16(float x) {
    const uint32_t u = kv_f32_bits(x), a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint16_t)((u >> 16) | 0x40); /* NaN: quiet, sign kept */
    if (a >= 0x7F7F8000) return (uint16_t)(((u >> 16) & 0x8000) | 0x7F7F); /* rounds past 3.39e38: saturate */
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float kv_decode_e4m3(uint8_t c) {
    const uint32_t sign = (uint32_t)(c & 0x80) << 24, exp = (c >> 3) & 0xF, man = c & 7;
    if ((c & 0x7F) == 0x7F) return kv_bits_f32(sign | 0x7FC00000);
    if (exp == 0) return kv_bits_f32(sign | kv_f32_bits((float)man * 0.001953125f)); /* man * 2^-9 */
    return kv_bits_f32(sign | ((exp + 120) << 23) | (man << 20));
}

static inline float kv_decode_e5m2(uint8_t c) {
    const uint32_t sign = (uint32_t)(c & 0x80) << 24, exp = (c >> 2) & 0x1F, man = c & 3;
    if (exp == 0x1F) return kv_bits_f32(sign | 0x7F800000 | (man << 21)); /* inf, NaN */
    if (exp == 0) return kv_bits_f32(sign | kv_f32_bits((float)man * 1.52587890625e-5f)); /* man * 2^-16 */
    return kv_bits_f32(sign | ((exp + 112) << 23) | (man << 21));
}

static inline float kv_decode_bf16(uint16_t c) { return kv_bits_f32((uint32_t)c << 16); }

/* Element i of a row stored in `fmt`, as float. */
static inline float kv_load1(const uint8_t *row, int64_t i, int fmt) {
    switch (fmt) {
    case KV_BF16: { uint16_t c; memcpy(&c, row + 2 * i, 2); return kv_decode_bf16(c); }
    case KV_FP8_E4M3: return kv_decode_e4m3(row[i]);
    case KV_FP8_E5M2: return kv_decode_e5m2(row[i]);
    default: { float x; memcpy(&x, row + 4 * i, 4); return x; }
    }
}

/* out[i] = x[i] * inv_scale encoded in `fmt`, i in [0, n); inv_scale = 1 / scale, a power of two (exact). */
static inline void kv_store_row(const float *x, int64_t n, int fmt, float inv_scale, uint8_t *out) {
    switch (fmt) {
    case KV_BF16:
        for (int64_t i = 0; i < n; i++) { const uint16_t c = kv_encode_bf16(x[i]); memcpy(out + 2 * i, &c, 2); }
        break;
    case KV_FP8_E4M3: for (int64_t i = 0; i < n; i++) out[i] = kv_encode_e4m3(x[i] * inv_scale); break;
    case KV_FP8_E5M2: for (int64_t i = 0; i < n; i++) out[i] = kv_encode_e5m2(x[i] * inv_scale); break;
    default: memcpy(out, x, sizeof(float) * (size_t)n);
    }
}

/* The K row of one token, num_heads heads of d values, stored with error feedback (fp8 only): each head's values are
 * rounded in order, and the error of value i, e_i = r_i - decode(code_i) * scale, is carried into the values after it,
 * r_j -= e_i * w[i][j] for j > i (r starts as x; w [num_heads, d, d] row-major, only j > i read). w comes from the
 * queries' second moment H (worker/kv_scales.py, GPTQ's rule: w = U / diag(U) row-wise, U the upper Cholesky factor of
 * H^-1), so the rounding errors cancel along the directions queries look in and the scores move less. The carry is
 * computed in double from float operands (the product exact), so FMA contraction cannot change it and the torch path
 * (layers/kv_cache_dtype.py, to_cache_dtype_compensated) stores the same codes. */
static inline void kv_store_row_compensated(const float *x, int64_t num_heads, int64_t d, int fmt, float scale,
                                            const float *w, uint8_t *out) {
    const float inv_scale = 1.0f / scale;
    float r[d];
    for (int64_t h = 0; h < num_heads; h++) {
        const float *wh = w + h * d * d;
        for (int64_t i = 0; i < d; i++) r[i] = x[h * d + i];
        for (int64_t i = 0; i < d; i++) {
            const uint8_t c = fmt == KV_FP8_E4M3 ? kv_encode_e4m3(r[i] * inv_scale) : kv_encode_e5m2(r[i] * inv_scale);
            out[h * d + i] = c;
            const float e = r[i] - (fmt == KV_FP8_E4M3 ? kv_decode_e4m3(c) : kv_decode_e5m2(c)) * scale;
            const double ed = (double)e;
            for (int64_t j = i + 1; j < d; j++) r[j] = (float)((double)r[j] - ed * (double)wh[i * d + j]);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_SIMD 1

/* Elements [0, 8) of a row stored in `fmt` (p points at element 0), as 8 floats. e5m2 is the top byte of an fp16
 * (vcvtph2ps converts exactly, subnormals, infinities and NaN included); e4m3 becomes the fp16 with the same
 * exponent and mantissa bits placed 3 bits lower (value / 2^8, exact), NaN fixed up, times 2^8. The 2^8 is kept here
 * rather than folded into the attention's scales: value / 2^8 times a tiny softmax weight can fall into fp32
 * subnormals, which are slow on x86. */
static inline __m256 kv_load8(const uint8_t *p, int fmt) {
    switch (fmt) {
    case KV_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case KV_FP8_E5M2:
        return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p)));
    case KV_FP8_E4M3: { /* c as int16 is 0xFF80 | magnitude when negative: c << 7 has the sign in bits 15 and 14 */
        const __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
        const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F)),
                                          _mm_set1_epi16(0x7C00));
        const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16((short)0xBF80)), nan);
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)); /* value / 2^8 -> value (exact) */
    }
    default: return _mm256_loadu_ps((const float *)p);
    }
}
#endif
