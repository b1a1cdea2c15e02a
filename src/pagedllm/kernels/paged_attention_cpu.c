/* Paged decode attention on the CPU: every query is one fp32 token that attends to its request's whole context,
 * read in place through the block table (no gathered copy of K/V). The cache holds fp32, bf16 or fp8 (e4m3, e5m2)
 * values (kv_dtype_cpu.h), converted to fp32 in registers as they are read.
 *
 * Layouts (row-major):
 *   q            [num_seqs, q_stride] fp32: row s starts with the query's num_heads * head_dim floats
 *   key_cache    [num_blocks, block_size, num_kv_heads, head_dim] in `fmt` (value_cache the same)
 *   block_table  [num_seqs, block_table_stride] int32
 *   seq_lens     [num_seqs] int32: tokens of context, the query's own token included
 *   out          [num_seqs, num_heads, head_dim] fp32, or NULL: rotate and write only (no attention)
 *   slot_mapping [num_seqs] int64: the cache slot of each query's own token, or NULL
 *   cos_sin      [num_seqs, 2, head_dim / 2] fp32: each query's rotary cos and sin, or NULL
 *
 * Scales: a cached K code c stands for c * k_scale, a V code for c * v_scale (kv_dtype_cpu.h; powers of two, 1 for
 * fp32 and bf16 caches). k_scale is folded into the softmax scale, v_scale multiplies the output as it is stored, and
 * the fused write encodes x / scale: the same result, bit for bit, as scaling every cached value. k_comp: NULL, or
 * (fp8) the error-feedback weights [num_kv_heads, head_dim, head_dim] the fused write rounds K rows with
 * (kv_dtype_cpu.h's kv_store_row_compensated, as kv_cache_write).
 *
 * Per-layer options (0: off): window, a sliding window (the query at position p attends the keys at positions
 * > p - window, as transformers and vLLM define it: the last `window` tokens of its context, its own included); softcap,
 * attention logit soft-capping (Gemma 2: scores = softcap * tanh(scores / softcap), on the scaled scores, before the
 * softmax). A custom softmax scale is `scale` itself.
 *
 * Fused use, one call per layer for a batch of decodes: q is the fused qkv projection (q_stride =
 * (num_heads + 2 * num_kv_heads) * head_dim: q heads, then k heads, then v heads). Each sequence rotates its q and
 * k heads in place (cos_sin given; elementwise_cpu.c's rotary_heads_f32, so exactly as rotary_qkv_f32 would),
 * writes its K and V (encoded in `fmt`) at its slot (slot_mapping given), then attends to its context, that token
 * included.
 *
 * One OpenMP task per sequence (per sequence and KV head when there are fewer sequences than threads: batch 1 would
 * otherwise leave all but one thread idle): it reads each context token's K row once for all query heads, keeps the
 * scores in a scratch buffer, takes the softmax per head, then reads each V row once. Sums run in a fixed
 * order, so the result does not depend on the thread count or on the other sequences in the batch. At head_dim 64,
 * the context is taken KV_CHUNK tokens at a time (each of the task's KV heads in turn, the whole rows prefetched into
 * L2 a few KB ahead), a KV head's rows for all the query heads that share it:
 * bf16 and fp8 rows converted to fp32 once into an L1 buffer, fp32 rows read where they are (the prefetch brings
 * them close), and the fp32 loops run on them: the same sums as over an fp32 cache holding the dequantized values,
 * bit for bit, at a third of the conversions and cache misses (SmolLM2: 3 query heads per KV head).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_dtype_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

void rotary_heads_f32(float *row, const float *c, int64_t num_heads, int64_t head_dim); /* elementwise_cpu.c */

#if defined(KV_SIMD)
#include "simd_cpu.h"

/* scores[t] = scale * q . k_t for t in [0, len), head_dim 64: q stays in 8 registers, 4 tokens' dot products
 * are reduced together (one store of 4 scores instead of 4 horizontal sums). k_rows[t] + k_offset: the head's
 * first element (bytes). */
ALWAYS_INLINE void qk_head64(const float *q, const uint8_t *const *k_rows, int64_t k_offset, int64_t len,
                             float scale, float *scores, int fmt) {
    const int64_t es8 = 8 * kv_elem_size(fmt); /* bytes of 8 elements */
    __m256 qv[8];
    for (int j = 0; j < 8; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
    const __m128 sc = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        const uint8_t *k0 = k_rows[t] + k_offset, *k1 = k_rows[t + 1] + k_offset, *k2 = k_rows[t + 2] + k_offset,
                      *k3 = k_rows[t + 3] + k_offset;
        __m256 a0 = _mm256_mul_ps(qv[0], kv_load8(k0, fmt)), a1 = _mm256_mul_ps(qv[0], kv_load8(k1, fmt)),
               a2 = _mm256_mul_ps(qv[0], kv_load8(k2, fmt)), a3 = _mm256_mul_ps(qv[0], kv_load8(k3, fmt));
        for (int j = 1; j < 8; j++) {
            a0 = _mm256_fmadd_ps(qv[j], kv_load8(k0 + es8 * j, fmt), a0);
            a1 = _mm256_fmadd_ps(qv[j], kv_load8(k1 + es8 * j, fmt), a1);
            a2 = _mm256_fmadd_ps(qv[j], kv_load8(k2 + es8 * j, fmt), a2);
            a3 = _mm256_fmadd_ps(qv[j], kv_load8(k3 + es8 * j, fmt), a3);
        }
        /* [a0 a1 a2 a3] -> their four horizontal sums */
        const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
        const __m256 h = _mm256_hadd_ps(h01, h23); /* lanes: s0 s1 s2 s3 (low half), s0 s1 s2 s3 (high half) */
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(scores + t, _mm_mul_ps(sum, sc));
    }
    for (; t < len; t++) {
        const uint8_t *k = k_rows[t] + k_offset;
        __m256 a = _mm256_mul_ps(qv[0], kv_load8(k, fmt));
        for (int j = 1; j < 8; j++) a = _mm256_fmadd_ps(qv[j], kv_load8(k + es8 * j, fmt), a);
        scores[t] = scale * hsum8(a);
    }
}

/* Context tokens whose K (or V) rows of one KV head are converted to fp32 at a time in the bf16 / fp8 formats: 16 KB,
 * in L1 while the group's query heads read it. */
#define KV_CHUNK 64
/* Software prefetch of the rows KV_PREFETCH_BYTES ahead (whole rows: every KV head the task attends with) into L2.
 * The blocks lie anywhere in the pool, so the hardware prefetchers lose the stream at every block (12 KB in fp32),
 * and prefetches into L1 wait on its few outstanding misses. fp32, batch 128, context ~320, 2 threads, Zen 5: 30
 * layers 135-168 ms with 16 rows ahead into L1, 117-130 ms so (benchmarks/micro_decode_attention_dram.py). */
#define KV_PREFETCH_BYTES 4608

/* buf[t] = rows [t0, t0 + n) of one KV head (head_dim 64, at rows[t] + offset bytes) as fp32 (exact), ptrs[t] = &buf[t]:
 * the fp32 kernels then read each converted row once per query head of the group instead of converting it again.
 * Prefetches pf_bytes at pf_offset of the row KV_PREFETCH_BYTES ahead (pf_bytes 0: none), of avail rows. */
ALWAYS_INLINE void convert_rows64(const uint8_t *const *rows, int64_t offset, int64_t n, int64_t avail, float *buf,
                                  const uint8_t **ptrs, int64_t pf_offset, int64_t pf_bytes, int fmt) {
    const int64_t es8 = 8 * kv_elem_size(fmt);
    const int64_t ahead = pf_bytes > 0 ? (KV_PREFETCH_BYTES + pf_bytes - 1) / pf_bytes : 0; /* rows */
    for (int64_t t = 0; t < n; t++) {
        if (t + ahead < avail)
            for (int64_t b = 0; b < pf_bytes; b += 64)
                _mm_prefetch((const char *)(rows[t + ahead] + pf_offset + b), _MM_HINT_T2);
        const uint8_t *src = rows[t] + offset;
        if (fmt == KV_F32) { /* already fp32: the group's heads read the row where it is, now in L1 */
            ptrs[t] = src;
            continue;
        }
        float *dst = buf + t * 64;
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + 8 * j, kv_load8(src + es8 * j, fmt));
        ptrs[t] = (const uint8_t *)dst;
    }
}

/* acc[0, 64) += sum_t p[t] * v_t over fp32 rows v_rows[t], t in [0, n): pv_head's 8 FMA chains, carried in acc from one
 * chunk to the next (a stored and reloaded float is the same float, so the sums are pv_head's, bit for bit). */
ALWAYS_INLINE void pv_acc64(const float *p, int64_t n, const uint8_t *const *v_rows, float *acc) {
#ifdef __AVX512F__ /* the same 64 chains, 16 lanes to a register: half the instructions, the same bits */
    __m512 b[4];
    for (int j = 0; j < 4; j++) b[j] = _mm512_loadu_ps(acc + 16 * j);
    for (int64_t t = 0; t < n; t++) {
        const float *v = (const float *)v_rows[t];
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int j = 0; j < 4; j++) b[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * j), b[j]);
    }
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + 16 * j, b[j]);
    return;
#endif
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int64_t t = 0; t < n; t++) {
        const float *v = (const float *)v_rows[t];
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + 8 * j, a[j]);
}
#endif

/* scores[g * stride] = scale * q_g . k for the `group` query heads that share one K head (k: bytes). */
ALWAYS_INLINE void dot_group(const float *q, const uint8_t *k, int64_t group, int64_t d, float scale, float *scores,
                             int64_t stride, int fmt) {
#if defined(KV_SIMD)
    if (d % 16 == 0) {
        const int64_t es = kv_elem_size(fmt);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), kv_load8(k + i * es, fmt), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), kv_load8(k + (i + 8) * es, fmt), a1);
            }
            scores[g * stride] = scale * hsum8(_mm256_add_ps(a0, a1));
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        float s = 0.0f;
        for (int64_t i = 0; i < d; i++) s += q[g * d + i] * kv_load1(k, i, fmt);
        scores[g * stride] = scale * s;
    }
}

/* o = v_scale * sum_t p[t] * v_t over the context, v_t = value row of token t for this head (D elements at v_rows[t] +
 * v_offset bytes). Accumulates in registers, 64 or 32 floats at a time: each row is read from cache once, nothing is
 * stored until the end. */
ALWAYS_INLINE void pv_head(const float *p, int64_t len, const uint8_t *const *v_rows, int64_t v_offset, int64_t d,
                           float v_scale, float *o, int fmt) {
    const int64_t es = kv_elem_size(fmt);
    int64_t i = 0;
#if defined(KV_SIMD)
    for (; i + 64 <= d; i += 64) { /* 8 independent FMA chains: enough to hide the FMA latency */
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const uint8_t *v = v_rows[t] + v_offset + i * es;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(pt, kv_load8(v + 8 * j * es, fmt), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + i + 8 * j, _mm256_mul_ps(a[j], _mm256_set1_ps(v_scale)));
    }
    for (; i + 32 <= d; i += 32) {
        __m256 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const uint8_t *v = v_rows[t] + v_offset + i * es;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(pt, kv_load8(v + 8 * j * es, fmt), a[j]);
        }
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + i + 8 * j, _mm256_mul_ps(a[j], _mm256_set1_ps(v_scale)));
    }
#endif
    for (; i < d; i++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < len; t++) acc += p[t] * kv_load1(v_rows[t] + v_offset, i, fmt);
        o[i] = acc * v_scale;
    }
}

/* k_rows[t], v_rows[t] = where context token t's K and V rows are (bytes), t in [0, len): block by block, without a
 * division per token. */
ALWAYS_INLINE void row_pointers(const int32_t *blocks, int64_t len, int64_t block_size, int64_t row,
                                const uint8_t *key_cache, const uint8_t *value_cache, const uint8_t **k_rows,
                                const uint8_t **v_rows) {
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int64_t first = (int64_t)blocks[b] * block_size * row;
        for (int64_t i = 0; i < block_size && t < len; i++, t++) {
            k_rows[t] = key_cache + first + i * row;
            v_rows[t] = value_cache + first + i * row;
        }
    }
}

/* sh[0, len) = softmax(sh[0, len)), len >= 1. Not inlined: the decode and the multi-row kernels run the same
 * machine code (the vector expf and sum gcc makes of it), so their probabilities are the same bits. */
__attribute__((noinline)) static void softmax_row(float *sh, int64_t len) {
    float m = sh[0]; /* no infinities here (built with -ffast-math) */
    for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
    float sum = 0.0f;
    for (int64_t t = 0; t < len; t++) {
        sh[t] = expf(sh[t] - m);
        sum += sh[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < len; t++) sh[t] *= inv;
}

/* sh[0, len) = softcap * tanh(sh[0, len) / softcap): attention logit soft-capping (Gemma 2), on the scaled scores
 * before the softmax. Not inlined, as softmax_row: the decode and multi-row kernels cap with the same code. */
__attribute__((noinline)) static void softcap_row(float *sh, int64_t len, float softcap) {
    for (int64_t t = 0; t < len; t++) sh[t] = softcap * tanhf(sh[t] / softcap);
}

/* One sequence, KV heads [kh0, kh1) and their query heads: rotate and write its new token's heads (fused use), then
 * attend. Every head is computed on its own, so the heads of one sequence may be split among tasks (a batch smaller
 * than the thread count) without changing a bit. k_comp (which rounds a whole K row) needs every KV head in one
 * call. Returns -1 when the scratch cannot be allocated. */
ALWAYS_INLINE int attend_seq(float *qs, const float *cos_sin, const int64_t *slot, const uint8_t *key_cache,
                             const uint8_t *value_cache, const int32_t *blocks, int64_t len, float *os,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float k_scale, float v_scale, const float *k_comp, int64_t kh0,
                             int64_t kh1, int fmt, int64_t window, float softcap) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t es = kv_elem_size(fmt);
    const int64_t row = num_kv_heads * head_dim * es; /* bytes per cached token */
    if (cos_sin != NULL) {
        rotary_heads_f32(qs + kh0 * group * head_dim, cos_sin, (kh1 - kh0) * group, head_dim);
        rotary_heads_f32(qs + (num_heads + kh0) * head_dim, cos_sin, kh1 - kh0, head_dim);
    }
    if (slot != NULL) {
        const float *k = qs + num_heads * head_dim, *v = k + num_kv_heads * head_dim;
        const int64_t first = kh0 * head_dim, count = (kh1 - kh0) * head_dim; /* the heads' elements in a row */
        if (k_comp != NULL)
            kv_store_row_compensated(k, num_kv_heads, head_dim, fmt, k_scale, k_comp, (uint8_t *)key_cache + *slot * row);
        else
            kv_store_row(k + first, count, fmt, 1.0f / k_scale, (uint8_t *)key_cache + *slot * row + first * es);
        kv_store_row(v + first, count, fmt, 1.0f / v_scale, (uint8_t *)value_cache + *slot * row + first * es);
    }
    if (os == NULL) return 0; /* rotate and write only */
    scale *= k_scale; /* q . (c * k_scale) * scale == q . c * (scale * k_scale): both factors powers of two or 1 */
    const int64_t n = len > 0 ? len : 1;
#if defined(KV_SIMD)
    const int convert = head_dim == 64; /* convert (fp32: prefetch) each row once for the group (convert_rows64) */
#else
    const int convert = 0;
#endif
    /* scratch: where each context token's K and V rows are (n pointers each), then [num_heads, n] scores; with
     * `convert`, then KV_CHUNK pointers, KV_CHUNK converted rows and the task's heads' [heads, 64] output sums */
    const size_t conv_bytes = convert ? sizeof(uint8_t *) * KV_CHUNK + sizeof(float) * (KV_CHUNK + num_heads) * 64
                                      : 0;
    const uint8_t **k_rows = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)(2 * n) +
                                                      sizeof(float) * (size_t)(num_heads * n) + conv_bytes);
    if (k_rows == NULL) return -1;
    const uint8_t **rows_base = k_rows, **v_rows = k_rows + n;
    float *scores = (float *)(k_rows + 2 * n);
    row_pointers(blocks, len, block_size, row, key_cache, value_cache, k_rows, v_rows);
    if (window > 0 && len > window) { /* a sliding window: the last `window` tokens, this one included */
        k_rows += len - window;
        v_rows += len - window;
        len = window;
    }
#if defined(KV_SIMD)
    const uint8_t **conv_rows = (const uint8_t **)(scores + num_heads * n);
    float *conv_buf = (float *)(conv_rows + KV_CHUNK), *conv_acc = conv_buf + KV_CHUNK * 64;
    const int64_t heads_bytes = (kh1 - kh0) * 64 * es; /* the task's heads in a cached row, prefetched together */
    if (convert) { /* the same sums as below, on rows converted once per chunk (KV_CHUNK is a multiple of 4) */
        for (int64_t t0 = 0; t0 < len; t0 += KV_CHUNK) {
            const int64_t m = len - t0 < KV_CHUNK ? len - t0 : KV_CHUNK;
            for (int64_t kh = kh0; kh < kh1; kh++) {
                convert_rows64(k_rows + t0, kh * 64 * es, m, len - t0, conv_buf, conv_rows, kh0 * 64 * es,
                               kh == kh0 ? heads_bytes : 0, fmt);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    qk_head64(qs + h * 64, conv_rows, 0, m, scale, scores + h * len + t0, KV_F32);
            }
        }
    } else
#endif
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = kh0; kh < kh1; kh++)
                dot_group(qs + kh * group * head_dim, k_rows[t] + kh * head_dim * es, group, head_dim, scale,
                          scores + kh * group * len + t, len, fmt);
    if (softcap > 0.0f)
        for (int64_t h = kh0 * group; h < kh1 * group; h++) softcap_row(scores + h * len, len, softcap);
    for (int64_t h = kh0 * group; h < kh1 * group; h++) softmax_row(scores + h * len, len);
#if defined(KV_SIMD)
    if (convert) {
        for (int64_t i = 0; i < (kh1 - kh0) * group * 64; i++) conv_acc[i] = 0.0f;
        for (int64_t t0 = 0; t0 < len; t0 += KV_CHUNK) {
            const int64_t m = len - t0 < KV_CHUNK ? len - t0 : KV_CHUNK;
            for (int64_t kh = kh0; kh < kh1; kh++) {
                convert_rows64(v_rows + t0, kh * 64 * es, m, len - t0, conv_buf, conv_rows, kh0 * 64 * es,
                               kh == kh0 ? heads_bytes : 0, fmt);
                for (int64_t g = 0; g < group; g++)
                    pv_acc64(scores + (kh * group + g) * len + t0, m, conv_rows,
                             conv_acc + ((kh - kh0) * group + g) * 64);
            }
        }
        for (int64_t h = kh0 * group; h < kh1 * group; h++)
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(os + h * 64 + 8 * j,
                                 _mm256_mul_ps(_mm256_loadu_ps(conv_acc + (h - kh0 * group) * 64 + 8 * j),
                                               _mm256_set1_ps(v_scale)));
        free(rows_base);
        return 0;
    }
#endif
    for (int64_t h = kh0 * group; h < kh1 * group; h++) /* out_h = sum_t p[h][t] * v_t */
        pv_head(scores + h * len, len, v_rows, (h / group) * head_dim * es, head_dim, v_scale, os + h * head_dim,
                fmt);
    free(rows_base);
    return 0;
}

int paged_decode_attention(float *q, int64_t q_stride, const float *cos_sin, const int64_t *slot_mapping,
                           void *key_cache, void *value_cache, const int32_t *block_table,
                           int64_t block_table_stride, const int32_t *seq_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int fmt, float k_scale, float v_scale, const float *k_comp, int64_t window,
                           float softcap) {
    const uint8_t *kc = (const uint8_t *)key_cache, *vc = (const uint8_t *)value_cache;
    int failed = 0;
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* fewer sequences than threads (batch 1 on 2 threads): one task per (sequence, KV head), else per sequence */
    const int64_t parts = num_seqs < threads && k_comp == NULL ? num_kv_heads : 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        const int64_t s = task / parts, kh0 = parts == 1 ? 0 : task % parts, kh1 = parts == 1 ? num_kv_heads : kh0 + 1;
        float *qs = q + s * q_stride, *os = out != NULL ? out + s * num_heads * head_dim : NULL;
        const float *cs = cos_sin != NULL ? cos_sin + s * head_dim : NULL;
        const int64_t *slot = slot_mapping != NULL ? slot_mapping + s : NULL;
        const int32_t *blocks = block_table + s * block_table_stride;
        const int64_t len = seq_lens[s];
        int rc; /* one specialized copy of the loop nest per storage format */
        switch (fmt) {
        case KV_BF16:
            rc = attend_seq(qs, cs, slot, kc, vc, blocks, len, os, num_heads, num_kv_heads, head_dim, block_size,
                            scale, k_scale, v_scale, k_comp, kh0, kh1, KV_BF16, window, softcap);
            break;
        case KV_FP8_E4M3:
            rc = attend_seq(qs, cs, slot, kc, vc, blocks, len, os, num_heads, num_kv_heads, head_dim, block_size,
                            scale, k_scale, v_scale, k_comp, kh0, kh1, KV_FP8_E4M3, window, softcap);
            break;
        case KV_FP8_E5M2:
            rc = attend_seq(qs, cs, slot, kc, vc, blocks, len, os, num_heads, num_kv_heads, head_dim, block_size,
                            scale, k_scale, v_scale, k_comp, kh0, kh1, KV_FP8_E5M2, window, softcap);
            break;
        default:
            rc = attend_seq(qs, cs, slot, kc, vc, blocks, len, os, num_heads, num_kv_heads, head_dim, block_size,
                            scale, k_scale, v_scale, k_comp, kh0, kh1, KV_F32, window, softcap);
        }
        if (rc != 0) failed = 1;
    }
    return failed ? -1 : 0;
}

/* Multi-row attention: rows of queries that attend to one block table (a speculative step's verify rows, a
 * prefill chunk's rows), each row r a decode row of its own context length seq_lens[r] (causal: the row at
 * position p has length p + 1), its K/V already in the cache.
 *
 *   q            [num_rows, q_stride] fp32: row r starts with its num_heads * head_dim floats (rotated)
 *   block_table  [num_groups, block_table_stride] int32: group g's table
 *   row_start    [num_groups + 1] int64: group g's rows are [row_start[g], row_start[g + 1])
 *   seq_lens     [num_rows] int32, >= 1
 *   out          [num_rows, num_heads, head_dim] fp32
 *
 * One OpenMP task per (group, KV head, tile of up to MR_TILE rows, fewer when the tasks would not keep every thread
 * busy, e.g. one request's verify rows): the tile's K and V rows of that head are
 * converted (fp32: prefetched) once per KV_CHUNK tokens and used by every row of the tile, so a context token is
 * read once per tile instead of once per row. Each row computes what attend_seq computes for it, in the same order
 * (qk_head64 over the same chunks, softmax_row, pv_acc64 chunk by chunk, the same v_scale product): its output is
 * bitwise paged_decode_attention's for that row, whatever the tile, the group or the thread count. Without the
 * head_dim 64 SIMD path, or with a sliding window (whose rows start at different tokens), each row runs attend_seq
 * itself (one task per row).
 */
#define MR_TILE 16

#if defined(KV_SIMD)
/* Rows [0, nrows) of a tile (q rows q_stride apart, out rows num_heads * 64 apart), KV head kh, head_dim 64. */
ALWAYS_INLINE int attend_rows64(const float *q, int64_t q_stride, const uint8_t *key_cache,
                                const uint8_t *value_cache, const int32_t *blocks, const int32_t *lens,
                                int64_t nrows, int64_t kh, float *out, int64_t num_heads, int64_t num_kv_heads,
                                int64_t block_size, float scale, float v_scale, int fmt, float softcap) {
    const int64_t group = num_heads / num_kv_heads, es = kv_elem_size(fmt);
    const int64_t row = num_kv_heads * 64 * es, offset = kh * 64 * es;
    int64_t maxlen = 0, nscores = 0;
    for (int64_t r = 0; r < nrows; r++) {
        maxlen = lens[r] > maxlen ? lens[r] : maxlen;
        nscores += group * (int64_t)lens[r];
    }
    const size_t floats = (size_t)(nscores + (KV_CHUNK + nrows * group) * 64);
    const uint8_t **k_rows =
        (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)(2 * maxlen + KV_CHUNK) + sizeof(float) * floats);
    if (k_rows == NULL) return -1;
    const uint8_t **v_rows = k_rows + maxlen, **conv_rows = v_rows + maxlen;
    float *scores = (float *)(conv_rows + KV_CHUNK), *conv_buf = scores + nscores, *acc = conv_buf + KV_CHUNK * 64;
    row_pointers(blocks, maxlen, block_size, row, key_cache, value_cache, k_rows, v_rows);
    for (int64_t t0 = 0; t0 < maxlen; t0 += KV_CHUNK) { /* scores: row r's [group, lens[r]] after row r - 1's */
        const int64_t m = maxlen - t0 < KV_CHUNK ? maxlen - t0 : KV_CHUNK;
        convert_rows64(k_rows + t0, offset, m, maxlen - t0, conv_buf, conv_rows, offset, 8 * 8 * es, fmt);
        float *sr = scores;
        for (int64_t r = 0; r < nrows; sr += group * lens[r], r++) {
            const int64_t len = lens[r], mr = len - t0 < KV_CHUNK ? len - t0 : KV_CHUNK;
            if (mr <= 0) continue;
            for (int64_t g = 0; g < group; g++)
                qk_head64(q + r * q_stride + (kh * group + g) * 64, conv_rows, 0, mr, scale, sr + g * len + t0,
                          KV_F32);
        }
    }
    float *sr = scores;
    for (int64_t r = 0; r < nrows; sr += group * lens[r], r++)
        for (int64_t g = 0; g < group; g++) {
            if (softcap > 0.0f) softcap_row(sr + g * lens[r], lens[r], softcap);
            softmax_row(sr + g * lens[r], lens[r]);
        }
    for (int64_t i = 0; i < nrows * group * 64; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < maxlen; t0 += KV_CHUNK) {
        const int64_t m = maxlen - t0 < KV_CHUNK ? maxlen - t0 : KV_CHUNK;
        convert_rows64(v_rows + t0, offset, m, maxlen - t0, conv_buf, conv_rows, offset, 8 * 8 * es, fmt);
        sr = scores;
        for (int64_t r = 0; r < nrows; sr += group * lens[r], r++) {
            const int64_t len = lens[r], mr = len - t0 < KV_CHUNK ? len - t0 : KV_CHUNK;
            if (mr <= 0) continue;
            for (int64_t g = 0; g < group; g++) pv_acc64(sr + g * len + t0, mr, conv_rows, acc + (r * group + g) * 64);
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t g = 0; g < group; g++)
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(out + r * num_heads * 64 + (kh * group + g) * 64 + 8 * j,
                                 _mm256_mul_ps(_mm256_loadu_ps(acc + (r * group + g) * 64 + 8 * j),
                                               _mm256_set1_ps(v_scale)));
    free(k_rows);
    return 0;
}
#endif

int paged_multirow_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                             const int32_t *block_table, int64_t block_table_stride, const int64_t *row_start,
                             int64_t num_groups, const int32_t *seq_lens, float *out, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int fmt,
                             float k_scale, float v_scale, int64_t window, float softcap) {
    const uint8_t *kc = (const uint8_t *)key_cache, *vc = (const uint8_t *)value_cache;
#if defined(KV_SIMD)
    const int tiled = head_dim == 64 && window <= 0; /* a windowed layer's rows: each attend_seq's own (below) */
#else
    const int tiled = 0;
#endif
    /* tasks: (group, first row, rows); tiled: each for every KV head, the task index's low part */
    const int64_t heads = tiled ? num_kv_heads : 1;
    int64_t tile = tiled ? MR_TILE : 1, num_tiles = 0, threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    for (;;) { /* too few tasks for the threads (one request's verify rows: 3 KV heads on 2 threads, 2:1): halve the
                * tiles, down to one row; a row's bits do not depend on its tile */
        num_tiles = 0;
        for (int64_t g = 0; g < num_groups; g++) num_tiles += (row_start[g + 1] - row_start[g] + tile - 1) / tile;
        if (tile == 1 || num_tiles * heads >= 2 * threads) break;
        tile = (tile + 1) / 2;
    }
    int64_t *tasks = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * num_tiles + 1));
    if (tasks == NULL) return -1;
    for (int64_t g = 0, i = 0; g < num_groups; g++) { /* a group's rows in n tiles of even sizes (5 rows: 3 + 2) */
        const int64_t rows = row_start[g + 1] - row_start[g], n = (rows + tile - 1) / tile;
        for (int64_t j = 0; j < n; j++, i++) {
            tasks[3 * i] = g;
            tasks[3 * i + 1] = row_start[g] + rows * j / n;
            tasks[3 * i + 2] = rows * (j + 1) / n - rows * j / n;
        }
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tiles * heads; task++) {
        const int64_t *t = tasks + 3 * (num_tiles - 1 - task / heads); /* the last (longest) rows first */
        const int64_t kh = task % heads, r0 = t[1], nrows = t[2];
        const int32_t *blocks = block_table + t[0] * block_table_stride;
        int rc = 0;
#if defined(KV_SIMD)
        if (tiled) {
            const float *qs = q + r0 * q_stride;
            float *os = out + r0 * num_heads * 64;
            const float sc = scale * k_scale; /* as attend_seq folds it */
            switch (fmt) { /* one specialized copy per storage format */
            case KV_BF16:
                rc = attend_rows64(qs, q_stride, kc, vc, blocks, seq_lens + r0, nrows, kh, os, num_heads,
                                   num_kv_heads, block_size, sc, v_scale, KV_BF16, softcap);
                break;
            case KV_FP8_E4M3:
                rc = attend_rows64(qs, q_stride, kc, vc, blocks, seq_lens + r0, nrows, kh, os, num_heads,
                                   num_kv_heads, block_size, sc, v_scale, KV_FP8_E4M3, softcap);
                break;
            case KV_FP8_E5M2:
                rc = attend_rows64(qs, q_stride, kc, vc, blocks, seq_lens + r0, nrows, kh, os, num_heads,
                                   num_kv_heads, block_size, sc, v_scale, KV_FP8_E5M2, softcap);
                break;
            default:
                rc = attend_rows64(qs, q_stride, kc, vc, blocks, seq_lens + r0, nrows, kh, os, num_heads,
                                   num_kv_heads, block_size, sc, v_scale, KV_F32, softcap);
            }
        } else
#endif
            rc = paged_decode_attention((float *)q + r0 * q_stride, q_stride, NULL, NULL, (void *)kc, (void *)vc,
                                        blocks, 0, seq_lens + r0, out + r0 * num_heads * head_dim, 1, num_heads,
                                        num_kv_heads, head_dim, block_size, scale, fmt, k_scale, v_scale, NULL,
                                        window, softcap);
        if (rc != 0) failed = 1;
    }
    free(tasks);
    return failed ? -1 : 0;
}
