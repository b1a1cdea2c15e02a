/* The elementwise parts of a Llama layer on the CPU, fp32, each in one pass over its rows: RMSNorm (with and
 * without the residual add before it), rotary embedding in place on the fused qkv projection, SiluAndMul.
 *
 * Layouts (row-major, contiguous):
 *   x, residual, out  [num_tokens, hidden]           RMSNorm; weight [hidden]
 *   qkv               [num_tokens, (H + 2 * Hkv) * D] q heads, then k heads, then v heads
 *   cos_sin           [num_tokens, 2, D / 2]          each token's row of RotaryEmbedding.cos_sin (cos, then sin)
 *   gate_up           [num_tokens, 2 * I]             gate, then up; out [num_tokens, I]
 *
 * Invariant (batch invariance, DESIGN invariant 2): a row's result depends only on that row. Every row runs
 * the same instructions in the same order whatever the batch size, thread count or the row's address: the
 * AVX2 path has no scalar loops that the compiler could vectorize differently by alignment (a row's last
 * n % 8 floats go through masked loads and stores), and OpenMP only splits the rows between threads, from
 * PARALLEL_MIN_FLOATS floats of work on (below that the fork and join cost more than the work).
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd_cpu.h"

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Lanes [0, n) of 8 set, 0 < n <= 8. */
static inline __m256i first_lanes(int64_t n) {
    return _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - n));
}
#endif

/* Rows are split between threads from this much work on: floats of a norm or rotary row, a SiluAndMul output
 * counting as SILU_COST of them (exp and a division). Measured on a 2-core EPYC, median us per call, 1 vs 2
 * threads (ctypes call included, ~2 us): rms_norm 8 x 576: 4.1 vs 5.4, 16 x 576: 5.5 vs 5.3, 32 x 576: 7.4 vs
 * 5.4; rotary 8 x 12 x 64: 4.5 vs 5.9, 16 x 12 x 64: 5.4 vs 5.0; silu_and_mul 2 x 1536: 5.1 vs 5.8,
 * 4 x 1536: 7.8 vs 7.0, 8 x 1536: 11.8 vs 8.2. */
#define PARALLEL_MIN_FLOATS (16 * 1024)
#define SILU_COST 4

/* sum(x[i]^2) for i in [0, n), in a fixed order: four 8-float accumulators over 32-float chunks, then the
 * remaining 8-float chunks (the last one masked) into the first, then a horizontal sum. */
static inline float sum_squares(const float *x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
        a2 = _mm256_fmadd_ps(x2, x2, a2);
        a3 = _mm256_fmadd_ps(x3, x3, a3);
    }
    for (; i < n; i += 8) {
        const __m256 x0 = i + 8 <= n ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, first_lanes(n - i));
        a0 = _mm256_fmadd_ps(x0, x0, a0);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return sum;
#endif
}

/* out[i] = (x[i] * r) * weight[i], rounded as transformers' LlamaRMSNorm rounds it. out may be x. */
static inline void scale_row(const float *x, float r, const float *weight, float *out, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(weight + i)));
    if (i < n) {
        const __m256i m = first_lanes(n - i);
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), rv),
                                                      _mm256_maskload_ps(weight + i, m)));
    }
#else
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * weight[i];
#endif
}

/* 1 / sqrt(mean + eps), mean and the sum with eps rounded to float as torch does. Taken in double: in float,
 * -ffast-math would turn 1.0f / sqrtf into an rsqrtss estimate plus a Newton step (an ulp or two off). */
static inline float inv_rms(float sum_sq, int64_t n, float eps) {
    const float var = sum_sq / (float)n + eps;
    return (float)(1.0 / sqrt((double)var));
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight for each of the num_tokens rows of `hidden` floats.
 * out may be x (in place). */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t num_tokens, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *xt = x + t * hidden;
        scale_row(xt, inv_rms(sum_squares(xt, hidden), hidden, eps), weight, out + t * hidden, hidden);
    }
}

/* vLLM's fused_add_rms_norm, in place: residual[t] = x[t] + residual[t]; x[t] = rms_norm(residual[t]) * weight.
 * The row is read twice (add, then scale) while it is in L1. */
void fused_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t num_tokens, int64_t hidden,
                            float eps) {
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *xt = x + t * hidden, *rt = residual + t * hidden;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t i = 0;
        for (; i + 8 <= hidden; i += 8)
            _mm256_storeu_ps(rt + i, _mm256_add_ps(_mm256_loadu_ps(xt + i), _mm256_loadu_ps(rt + i)));
        if (i < hidden) {
            const __m256i m = first_lanes(hidden - i);
            _mm256_maskstore_ps(rt + i, m, _mm256_add_ps(_mm256_maskload_ps(xt + i, m), _mm256_maskload_ps(rt + i, m)));
        }
#else
        for (int64_t i = 0; i < hidden; i++) rt[i] = xt[i] + rt[i];
#endif
        scale_row(rt, inv_rms(sum_squares(rt, hidden), hidden, eps), weight, xt, hidden);
    }
}

/* Rotary embedding, rotate-half (neox) layout, in place on `num_heads` consecutive heads of one token (row), whose
 * cos and sin are c and c + D / 2. For a head x = [x1 | x2] (D / 2 floats each):
 *   x1' = x1 * c - x2 * s,   x2' = x2 * c + x1 * s
 * Not inlined: the decode attention kernel calls this same code for its fused rotary, so both round alike. */
__attribute__((noinline)) void rotary_heads_f32(float *row, const float *c, int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    const float *s = c + half;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x1 = row + h * head_dim, *x2 = x1 + half;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
            const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
            _mm256_storeu_ps(x1 + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
            _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
        }
        if (i < half) { /* the same, masked */
            const __m256i m = first_lanes(half - i);
            const __m256 cv = _mm256_maskload_ps(c + i, m), sv = _mm256_maskload_ps(s + i, m);
            const __m256 a = _mm256_maskload_ps(x1 + i, m), b = _mm256_maskload_ps(x2 + i, m);
            _mm256_maskstore_ps(x1 + i, m, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
            _mm256_maskstore_ps(x2 + i, m, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
        }
#else
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
#endif
    }
}

/* Rotary embedding in place on the first num_heads + num_kv_heads heads (q and k) of each qkv row; v is left alone.
 * Example, H = 9, Hkv = 3, D = 64: a row is 15 * 64 floats; heads 0-8 (q) and 9-11 (k) are rotated. */
void rotary_qkv_f32(float *qkv, const float *cos_sin, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim) {
    const int64_t rotated = num_heads + num_kv_heads;
    const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) if (num_tokens * rotated * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < num_tokens; t++) rotary_heads_f32(qkv + t * row, cos_sin + t * head_dim, rotated, head_dim);
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x clamped to [-87, 88] (exp(88) = 1.65e38; 2^n stays a normal float), within 2e-7 relative:
 * x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, so r is exact), exp(r) by Cephes' degree-7 polynomial
 * 1 + r + r^2 (1/2 + r (1/6 + ...)), times 2^n built in the exponent bits. 1.5x faster than glibc's vector expf
 * (libmvec) in SiluAndMul (13 vs 21 cycles per 8 floats). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* x - n * ln2, high part exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r); /* ... and the low part */
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* silu(g) * u = g / (1 + exp(-g)) * u, 8 lanes. exp8's clamp keeps the divisor finite: under -ffast-math gcc
 * computes the vector division as rcpps plus a Newton step (within ~2 ulp), which gives NaN for an infinite
 * divisor. silu(g) is then -0 for g <= -88 (torch: -0 from g < -88.7, about -1e-36 before). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f))); /* exp(-g) */
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, size + i], silu(g) = g / (1 + exp(-g)) as torch computes it. */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_tokens, int64_t size) {
#pragma omp parallel for schedule(static) if (num_tokens * size * SILU_COST >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = gate_up + t * 2 * size, *u = g + size;
        float *o = out + t * size;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t i = 0;
        for (; i + 8 <= size; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        if (i < size) {
            const __m256i m = first_lanes(size - i);
            _mm256_maskstore_ps(o + i, m, silu_mul8(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
        }
#else
        for (int64_t i = 0; i < size; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
#endif
    }
}
