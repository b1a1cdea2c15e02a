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
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
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

/* o_g += p[g * stride] * v for the `group` query heads that share one V head. */
static inline void axpy_group(const float *p, int64_t stride, const float *v, int64_t group, int64_t d, float *o) {
    if (d % 8 != 0) {
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++) o[g * d + i] += p[g * stride] * v[i];
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        const __m256 pg = _mm256_set1_ps(p[g * stride]);
        float *og = o + g * d;
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(og + i, _mm256_fmadd_ps(pg, _mm256_loadu_ps(v + i), _mm256_loadu_ps(og + i)));
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

static inline void axpy_group(const float *p, int64_t stride, const float *v, int64_t group, int64_t d, float *o) {
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < d; i++) o[g * d + i] += p[g * stride] * v[i];
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
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * (len > 0 ? len : 1)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        for (int64_t t = 0; t < len; t++) { /* scores[h][t] = scale * q_h . k_t */
            const float *k = key_cache + ((int64_t)blocks[t / block_size] * block_size + t % block_size) * row;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                dot_group(qs + kh * group * head_dim, k + kh * head_dim, group, head_dim, scale,
                          scores + kh * group * len + t, len);
        }
        for (int64_t h = 0; h < num_heads; h++) { /* softmax over t, per head */
            float *sh = scores + h * len;
            float m = -INFINITY;
            for (int64_t t = 0; t < len; t++) m = sh[t] > m ? sh[t] : m;
            float sum = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = expf(sh[t] - m);
                sum += sh[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < len; t++) sh[t] *= inv;
        }
        for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) { /* out_h = sum_t p[h][t] * v_t */
            const float *v = value_cache + ((int64_t)blocks[t / block_size] * block_size + t % block_size) * row;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                axpy_group(scores + kh * group * len + t, len, v + kh * head_dim, group, head_dim,
                           os + kh * group * head_dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
