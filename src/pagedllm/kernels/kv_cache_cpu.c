/* Writing K and V into the paged KV cache in its storage format (kv_dtype_cpu.h), and the format conversions on
 * their own (tests, tools).
 *
 * Layouts: k, v [num_tokens, stride] fp32, row t holding num_kv_heads * head_dim floats (row_size); key_cache and
 * value_cache [num_slots, row_size] in `fmt`; slot_mapping [num_tokens] int64.
 */
#include <stdint.h>

#include "kv_dtype_cpu.h"

/* Rows are split between threads from this many of them on (a row is 192 values for SmolLM2). */
#define PARALLEL_MIN_ROWS 64

/* key_cache[slot_mapping[t]] = encode(k[t] / k_scale), value_cache the same with v_scale, for t in [0, num_tokens).
 * k_scale, v_scale: powers of two (1 for fp32 and bf16 caches). k_comp: NULL, or (fp8 only) the error-feedback
 * weights [row_size / head_dim, head_dim, head_dim] K rows are rounded with (kv_store_row_compensated). */
void kv_cache_write(const float *k, const float *v, int64_t stride, void *key_cache, void *value_cache,
                    const int64_t *slot_mapping, int64_t num_tokens, int64_t row_size, int fmt, float k_scale,
                    float v_scale, const float *k_comp, int64_t head_dim) {
    const int64_t row_bytes = row_size * kv_elem_size(fmt);
    const float k_inv = 1.0f / k_scale, v_inv = 1.0f / v_scale;
#pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (k_comp != NULL)
            kv_store_row_compensated(k + t * stride, row_size / head_dim, head_dim, fmt, k_scale, k_comp,
                                     (uint8_t *)key_cache + slot * row_bytes);
        else
            kv_store_row(k + t * stride, row_size, fmt, k_inv, (uint8_t *)key_cache + slot * row_bytes);
        kv_store_row(v + t * stride, row_size, fmt, v_inv, (uint8_t *)value_cache + slot * row_bytes);
    }
}

/* out = encode(x) (n codes of kv_elem_size(fmt) bytes), scale 1. */
void kv_encode(const float *x, int64_t n, int fmt, void *out) { kv_store_row(x, n, fmt, 1.0f, (uint8_t *)out); }

/* out = decode(codes); with the vector loads where the build has them (n a multiple of 8), else one by one. */
void kv_decode(const void *codes, int64_t n, int fmt, int vector, float *out) {
    const uint8_t *c = (const uint8_t *)codes;
    const int64_t es = kv_elem_size(fmt);
#if defined(KV_SIMD)
    if (vector) {
        for (int64_t i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, kv_load8(c + i * es, fmt));
        for (int64_t i = n / 8 * 8; i < n; i++) out[i] = kv_load1(c, i, fmt);
        return;
    }
#endif
    (void)vector;
    for (int64_t i = 0; i < n; i++) out[i] = kv_load1(c, i, fmt);
}
