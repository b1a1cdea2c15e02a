/* One decode step of a Llama model's decoder layers in one native call (models/llama_native_step.py drives it):
 * the CPU analogue of replaying a captured CUDA graph. It calls, in the order models/llama.py's modules call them,
 * the same exported kernels of the other files of this library, on the same values:
 *
 *   per layer l:  l == 0 ? h = rms_norm(res)                       (res holds the embeddings)
 *                        : h, res = fused_add_rms_norm(h, res)     (h: the previous layer's MLP output)
 *                 qkv = linear(h) [+ bias]
 *                 attn = paged_decode_attention(qkv, ...)          (rotary, KV write at the slots, attention)
 *                 verify: attn = paged_multirow_attention(qkv, ...)   (see below)
 *                 h = linear(attn) [+ bias];  h, res = fused_add_rms_norm(h, res)
 *                 gu = linear(h) [+ bias];  act = silu_and_mul(gu);  h = linear(act) [+ bias]
 *   then:         h, res = fused_add_rms_norm(h, res, final norm)
 *
 * so the hidden states (and the KV cache) are bitwise those of the module path: every kernel computes each row
 * the same way whatever the buffer it writes (see their files' batch-invariance notes). A linear is either a
 * packed quantized weight (quant_linear_cpu.c: GGUF codes, fp8) or an 8-bit-activation weight (quant_q8act_cpu.c);
 * a bias is added afterwards as Linear.forward's `y.add_(bias)` does (one fp32 add per element).
 *
 * Layouts (row-major, fp32 unless named): res, h [num_seqs, hidden]; qkv [num_seqs, (H + 2 Hkv) D];
 * attn [num_seqs, H D]; gu [num_seqs, 2 I]; act [num_seqs, I]: one scratch buffer holds qkv, attn, gu and act.
 * The KV cache of layer l: key_caches[l] [num_blocks, block_size, Hkv, D] in `kv_fmt` (kv_dtype_cpu.h), its
 * value cache value_bytes further on; block_table [num_seqs, block_table_stride] int32, seq_lens [num_seqs] int32,
 * slot_mapping [num_seqs] int64, cos_sin [num_seqs, 2, D / 2]: as paged_attention_cpu.c documents them.
 *
 * verify (speculative decoding): some requests have several consecutive rows (each a decode row of its own
 * length over the request's block table), and a row attends to the K/V its request's earlier rows write in the
 * same step. The first call's rows run in parallel, so a row may read such a slot before it is written: that
 * call only rotates Q and K in place and writes every row's K/V (out NULL: no attention); then
 * paged_multirow_attention over the rotated Q computes the attention once every slot holds its value, a
 * request's rows (group g: rows row_start[g] .. row_start[g + 1] - 1, block table group_table + g *
 * group_table_stride) together, each row bitwise a decode row of its length: the module path's order (write all,
 * then attend) and so its bits. group_table and row_start are read only with verify.
 */
#include <stdint.h>
#include <stdlib.h>

/* The kernels called here, defined in the other files of this library: these declarations must match them. */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t num_tokens, int64_t hidden, float eps);
void fused_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t num_tokens, int64_t hidden,
                            float eps);
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_tokens, int64_t size);
void quant_linear_f32(const uint8_t *w, int64_t bits, int64_t group, const float *x, float *y, int64_t M, int64_t N,
                      int64_t K);
int q8act_linear_f32(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                     const float *x, int64_t M, float *out);
int paged_decode_attention(float *q, int64_t q_stride, const float *cos_sin, const int64_t *slot_mapping,
                           void *key_cache, void *value_cache, const int32_t *block_table,
                           int64_t block_table_stride, const int32_t *seq_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int fmt, float k_scale, float v_scale, const float *k_comp, int64_t window,
                           float softcap);
int paged_multirow_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                             const int32_t *block_table, int64_t block_table_stride, const int64_t *row_start,
                             int64_t num_groups, const int32_t *seq_lens, float *out, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int fmt,
                             float k_scale, float v_scale, int64_t window, float softcap);

enum { LINEAR_PACKED = 0, LINEAR_Q8ACT = 1 };

/* One linear layer's weight (mirrored by ctypes Structures in models/llama_native_step.py: keep them in sync). */
typedef struct {
    int64_t kind;                         /* LINEAR_PACKED or LINEAR_Q8ACT */
    int64_t bits, group;                  /* packed: code type (4, 8, 9 = fp8) and k's per scale */
    int64_t wtype;                        /* q8act: U4, U5 or S8 */
    const uint8_t *w;                     /* packed panels, or q8act codes */
    const float *d, *mn;                  /* q8act: scales, offsets (NULL for S8) */
    const float *bias;                    /* [out_features], or NULL */
    int64_t out_features, in_features;
} decode_linear;

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] */
    decode_linear qkv, o, gate_up, down;
    float k_scale, v_scale;                        /* the attention's KV cache scales (1.0 unless calibrated) */
    const float *k_comp;                           /* K rounding weights [Hkv, D, D], or NULL (kv_dtype_cpu.h) */
    int64_t window;                                /* the attention's sliding window (0: none, paged_attention_cpu.c) */
    float softcap;                                 /* its logit soft-cap (0: none) */
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;        /* every norm's epsilon; the attention's softmax scale */
    const float *final_norm; /* [hidden] */
} decode_model;

/* y [m, out_features] = x [m, in_features] @ W^T (+ bias). Returns 0, or -1 when a kernel's scratch fails. */
static int linear(const decode_linear *l, const float *x, float *y, int64_t m) {
    const int64_t n = l->out_features;
    if (l->kind == LINEAR_Q8ACT) {
        if (q8act_linear_f32((int)l->wtype, l->w, l->d, l->mn, n, l->in_features, x, m, y) != 0) return -1;
    } else {
        quant_linear_f32(l->w, l->bits, l->group, x, y, m, n, l->in_features);
    }
    if (l->bias != NULL)
        for (int64_t t = 0; t < m; t++)
            for (int64_t i = 0; i < n; i++) y[t * n + i] += l->bias[i];
    return 0;
}

/* The decoder layers and the final norm for num_seqs decodes (one token each). res: in, the embeddings; out, the
 * residual stream before the final norm. h: out, the final hidden states. Returns 0, or -1 when a kernel could not
 * allocate its scratch (then h, res and the cache hold partial results). */
int llama_decode_step(const decode_model *model, const decode_layer *layers, void *const *key_caches,
                      int64_t value_bytes, int kv_fmt, int64_t block_size, const int32_t *block_table,
                      int64_t block_table_stride, const int32_t *seq_lens, const int64_t *slot_mapping,
                      const float *cos_sin, int64_t num_seqs, float *res, float *h, float *scratch, int verify,
                      const int32_t *group_table, int64_t group_table_stride, const int64_t *row_start,
                      int64_t num_groups) {
    const int64_t s = num_seqs, hidden = model->hidden, d = model->head_dim;
    const int64_t q_size = model->num_heads * d, qkv_size = q_size + 2 * model->num_kv_heads * d;
    float *qkv = scratch, *attn = qkv + s * qkv_size, *gu = attn + s * q_size, *act = gu + s * 2 * model->intermediate;
    for (int64_t i = 0; i < model->num_layers; i++) {
        const decode_layer *layer = layers + i;
        if (i == 0) rms_norm_f32(res, layer->input_norm, h, s, hidden, model->eps);
        else fused_add_rms_norm_f32(h, res, layer->input_norm, s, hidden, model->eps);
        if (linear(&layer->qkv, h, qkv, s) != 0) return -1;
        uint8_t *key_cache = (uint8_t *)key_caches[i];
        if (paged_decode_attention(qkv, qkv_size, cos_sin, slot_mapping, key_cache, key_cache + value_bytes,
                                   block_table, block_table_stride, seq_lens, verify ? NULL : attn, s,
                                   model->num_heads, model->num_kv_heads, d, block_size, model->scale, kv_fmt,
                                   layer->k_scale, layer->v_scale, layer->k_comp, layer->window, layer->softcap) != 0)
            return -1;
        if (verify && paged_multirow_attention(qkv, qkv_size, key_cache, key_cache + value_bytes, group_table,
                                               group_table_stride, row_start, num_groups, seq_lens, attn,
                                               model->num_heads, model->num_kv_heads, d, block_size, model->scale,
                                               kv_fmt, layer->k_scale, layer->v_scale, layer->window, layer->softcap) != 0)
            return -1;
        if (linear(&layer->o, attn, h, s) != 0) return -1;
        fused_add_rms_norm_f32(h, res, layer->post_attention_norm, s, hidden, model->eps);
        if (linear(&layer->gate_up, h, gu, s) != 0) return -1;
        silu_and_mul_f32(gu, act, s, model->intermediate);
        if (linear(&layer->down, act, h, s) != 0) return -1;
    }
    fused_add_rms_norm_f32(h, res, model->final_norm, s, hidden, model->eps);
    return 0;
}
