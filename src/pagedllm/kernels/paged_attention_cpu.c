/* Paged decode attention on the CPU, fp32: every query is one token that attends to its request's whole
 * context, read in place through the block table (no gathered copy of K/V).
 *
 * Layouts (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]
 *   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]  (value_cache the same)
 *   block_table  [num_seqs, block_table_stride] int32
 *   seq_lens     [num_seqs] int32: tokens of context, the query's own token included
 *   out          [num_seqs, num_heads, head_dim]
 *
 * One OpenMP task per sequence: it reads each context token's K row once for all query heads, keeps the
 * scores in a scratch buffer, takes the softmax per head, then reads each V row once. Sums run in a fixed
 * order, so the result does not depend on the thread count or on the other sequences in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "simd_cpu.h"


/* scores[t] = scale * q . k_t for t in [0, len), head_dim 64: q stays in 8 registers, 4 tokens' dot products
 * are reduced together (one store of 4 scores instead of 4 horizontal sums). */
static inline void qk_head64(const float *q, const float *const *k_rows, int64_t k_offset, int64_t len, float scale,
                             float *scores) {
    __m256 qv[8];
    for (int j = 0; j < 8; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
    const __m128 sc = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        const float *k0 = k_rows[t] + k_offset, *k1 = k_rows[t + 1] + k_offset, *k2 = k_rows[t + 2] + k_offset,
                    *k3 = k_rows[t + 3] + k_offset;
        __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1)),
               a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
        for (int j = 1; j < 8; j++) {
            a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 8 * j), a0);
            a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k1 + 8 * j), a1);
            a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k2 + 8 * j), a2);
            a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k3 + 8 * j), a3);
        }
        /* [a0 a1 a2 a3] -> their four horizontal sums */
        const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
        const __m256 h = _mm256_hadd_ps(h01, h23); /* lanes: s0 s1 s2 s3 (low half), s0 s1 s2 s3 (high half) */
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(scores + t, _mm_mul_ps(sum, sc));
    }
    for (; t < len; t++) {
        const float *k = k_rows[t] + k_offset;
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
        for (int j = 1; j < 8; j++) a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a);
        scores[t] = scale * hsum8(a);
    }
}

/* scores[g * stride] = scale * q_g . k for the `group` query heads that share one K head. */
static inline void dot_group(const float *q, const float *k, int64_t group, int64_t d, float scale, float *scores,
                             int64_t stride) {
    if (d % 16 != 0) {
        for (int64_t g = 0; g < group; g++) {
            float s = 0.0f;
            for (int64_t i = 0; i < d; i++) s += q[g * d + i] * k[i];
            scores[g * stride] = scale * s;
        }
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), _mm256_loadu_ps(k + i + 8), a1);
        }
        scores[g * stride] = scale * hsum8(_mm256_add_ps(a0, a1));
    }
}

/* o = sum_t p[t] * v_t over the context, v_t = value row of token t for this head (D floats). Accumulates in
 * registers, 32 floats at a time: each row is read from cache, nothing is stored until the end. */
static inline void pv_head(const float *p, int64_t len, const float *const *v_rows, int64_t v_offset, int64_t d,
                           float *o) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) { /* 8 independent FMA chains: enough to hide the FMA latency */
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_rows[t] + v_offset + i;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + i + 8 * j, a[j]);
    }
    for (; i + 32 <= d; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_rows[t] + v_offset + i;
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(o + i, a0);
        _mm256_storeu_ps(o + i + 8, a1);
        _mm256_storeu_ps(o + i + 16, a2);
        _mm256_storeu_ps(o + i + 24, a3);
    }
    for (; i < d; i++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < len; t++) acc += p[t] * v_rows[t][v_offset + i];
        o[i] = acc;
    }
}
#else
static inline void dot_group(const float *q, const float *k, int64_t group, int64_t d, float scale, float *scores,
                             int64_t stride) {
    for (int64_t g = 0; g < group; g++) {
        float s = 0.0f;
        for (int64_t i = 0; i < d; i++) s += q[g * d + i] * k[i];
        scores[g * stride] = scale * s;
    }
}

static inline void pv_head(const float *p, int64_t len, const float *const *v_rows, int64_t v_offset, int64_t d,
                           float *o) {
    for (int64_t i = 0; i < d; i++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < len; t++) acc += p[t] * v_rows[t][v_offset + i];
        o[i] = acc;
    }
}
#endif

int paged_decode_attention_f32(const float *q, const float *key_cache, const float *value_cache,
                               const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,
                               float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cached token */
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        const int32_t *blocks = block_table + s * block_table_stride;
        const float *qs = q + s * num_heads * head_dim;
        float *os = out + s * num_heads * head_dim;
        const int64_t n = len > 0 ? len : 1;
        /* scratch: where each context token's K and V rows are (n pointers each), then [num_heads, n] scores */
        const float **k_rows = (const float **)malloc(sizeof(float *) * (size_t)(2 * n) +
                                                      sizeof(float) * (size_t)(num_heads * n));
        if (k_rows == NULL) {
            failed = 1;
            continue;
        }
        const float **v_rows = k_rows + n;
        float *scores = (float *)(k_rows + 2 * n);
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = (int64_t)blocks[t / block_size] * block_size + t % block_size;
            k_rows[t] = key_cache + slot * row;
            v_rows[t] = value_cache + slot * row;
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (head_dim == 64) {
            for (int64_t h = 0; h < num_heads; h++) /* scores[h][t] = scale * q_h . k_t */
                qk_head64(qs + h * head_dim, k_rows, (h / group) * head_dim, len, scale, scores + h * len);
        } else
#endif
            for (int64_t t = 0; t < len; t++)
                for (int64_t kh = 0; kh < num_kv_heads; kh++)
                    dot_group(qs + kh * group * head_dim, k_rows[t] + kh * head_dim, group, head_dim, scale,
                              scores + kh * group * len + t, len);
        for (int64_t h = 0; h < num_heads; h++) { /* softmax over t, per head */
            float *sh = scores + h * len;
            float m = sh[0]; /* len >= 1; no infinities here (built with -ffast-math) */
            for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
            float sum = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = expf(sh[t] - m);
                sum += sh[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < len; t++) sh[t] *= inv;
        }
        for (int64_t h = 0; h < num_heads; h++) /* out_h = sum_t p[h][t] * v_t */
            pv_head(scores + h * len, len, v_rows, (h / group) * head_dim, head_dim, os + h * head_dim);
        free(k_rows);
    }
    return failed ? -1 : 0;
}
