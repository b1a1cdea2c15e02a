/* Linear layers on GGUF-quantized weights kept quantized in memory: y[M, N] = x[M, K] @ W[N, K]^T, fp32 x and y.
 *
 * Packed weight layout (built by layers/quantized_weight.py; see its docstring): output rows in panels of 8, each
 * panel a run of groups of `group` (16 or 32) k's; a group holds, in this order,
 *   scale[8] f32 | offset[8] f32 | codes      (one scale and offset per row of the panel)
 *   codes, bits = 4: group / 2 pairs of k, 8 bytes each: byte r = code(k, row r) | code(k + 1, row r) << 4
 *   codes, bits = 8: group k's, 8 bytes each: byte r = code(k, row r) as int8
 * so the 8 rows' codes of one k are adjacent and decode into one 8-lane vector. Weight value:
 *   w[n, k] = fma((float)code, scale, offset)
 * which is, bit for bit, the value gguf_dequant / gguf.quants compute (see the packer). Rows past N (the last
 * panel's padding) have zero codes, scales and offsets and are never stored.
 *
 * Invariant (DESIGN invariant 2, batch invariance): every output y[m, n] is
 *   acc = 0; for k = 0 .. K - 1 in order: acc = fma(w[n, k], x[m, k], acc)
 * one fp32 fma chain whatever M, the thread count or the path: small M streams the packed weights and decodes them
 * in registers (gemv_panels), large M decodes a strip of 16 outputs x KC k's into an L1 buffer and runs a 6 x 16
 * register-blocked micro-kernel over the rows (gemm_*), carrying each accumulator through y between K tiles (an
 * fp32 store and load are exact). Threads split the output panels, never the reduction.
 */
#include <stdint.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 8
#define KC 256   /* k's per decoded tile (a multiple of every group size) */
#define MC 192   /* rows of x per tile: 192 x 256 x 4 B = 192 KiB, in L2 across the strips */
#define MR 6     /* rows per micro-kernel call: 6 x 2 accumulators + 2 weights + 1 broadcast = 15 ymm */
#define GEMM_MIN_ROWS 5
#define PARALLEL_MIN_WEIGHTS (64 * 1024)

static inline int64_t group_bytes(int64_t bits, int64_t group) { return 2 * PANEL * 4 + group * bits; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

ALWAYS_INLINE __m256 load_out(const float *p, int64_t valid) {
    return valid >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - valid)));
}

ALWAYS_INLINE void store_out(float *p, __m256 v, int64_t valid) {
    if (valid >= 8) _mm256_storeu_ps(p, v);
    else if (valid > 0) _mm256_maskstore_ps(p, _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - valid)), v);
}

/* The weights of k = 2i and 2i + 1 for the 8 rows of a group whose codes start at `codes`. */
ALWAYS_INLINE void decode_pair(int bits, const uint8_t *codes, int64_t i, __m256 s, __m256 o, __m256 *w0, __m256 *w1) {
    if (bits == 4) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * i)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), s, o);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s, o);
    } else {
        const __m256i b0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 16 * i)));
        const __m256i b1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 16 * i + 8)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b0), s, o);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b1), s, o);
    }
}

/* Small M: R rows of x against P panels (8P outputs from n0), streaming the packed weights once. P independent
 * chains per row hide the fma latency at R = 1. */
ALWAYS_INLINE void gemv_panels(int bits, int R, int P, const uint8_t *w, int64_t panel_bytes, int64_t group,
                               const float *x, int64_t K, float *y, int64_t N, int64_t n0) {
    const int64_t gbytes = group_bytes(bits, group), num_groups = K / group;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *gp[4];
        __m256 s[4], o[4];
        for (int p = 0; p < P; p++) {
            gp[p] = w + p * panel_bytes + g * gbytes;
            s[p] = _mm256_loadu_ps((const float *)gp[p]);
            o[p] = _mm256_loadu_ps((const float *)gp[p] + PANEL);
        }
        for (int64_t i = 0; i < group / 2; i++) {
            const int64_t k = g * group + 2 * i;
            __m256 w0[4], w1[4];
            for (int p = 0; p < P; p++) decode_pair(bits, gp[p] + 64, i, s[p], o[p], &w0[p], &w1[p]);
            for (int r = 0; r < R; r++) {
                const __m256 x0 = _mm256_broadcast_ss(x + r * K + k), x1 = _mm256_broadcast_ss(x + r * K + k + 1);
                for (int p = 0; p < P; p++) acc[r][p] = _mm256_fmadd_ps(w0[p], x0, acc[r][p]);
                for (int p = 0; p < P; p++) acc[r][p] = _mm256_fmadd_ps(w1[p], x1, acc[r][p]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) store_out(y + r * N + n0 + p * PANEL, acc[r][p], N - n0 - p * PANEL);
}

/* R rows (R <= 4) of x against every panel, P panels per call; threads split the panel runs. */
ALWAYS_INLINE void gemv(int bits, int R, int P, const uint8_t *w, int64_t group, const float *x, float *y, int64_t N,
                        int64_t K) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, panel_bytes = K / group * group_bytes(bits, group);
    const int64_t runs = (num_panels + P - 1) / P;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t run = 0; run < runs; run++) {
        const int64_t p0 = run * P;
        const uint8_t *wp = w + p0 * panel_bytes;
        if (p0 + P <= num_panels) gemv_panels(bits, R, P, wp, panel_bytes, group, x, K, y, N, p0 * PANEL);
        else for (int64_t p = p0; p < num_panels; p++)  /* the last, short run: one panel at a time */
            gemv_panels(bits, R, 1, w + p * panel_bytes, panel_bytes, group, x, K, y, N, p * PANEL);
    }
}

/* Decode k's [k0, k0 + kc) of NP (1 or 2) panels into buf[kc][16] (panel p in floats 8p .. 8p + 7). */
ALWAYS_INLINE void decode_strip(int bits, const uint8_t *w, int64_t panel_bytes, int np, int64_t group, int64_t k0,
                                int64_t kc, float *buf) {
    const int64_t gbytes = group_bytes(bits, group);
    for (int p = 0; p < np; p++)
        for (int64_t g = k0 / group; g < (k0 + kc) / group; g++) {
            const uint8_t *gp = w + p * panel_bytes + g * gbytes;
            const __m256 s = _mm256_loadu_ps((const float *)gp), o = _mm256_loadu_ps((const float *)gp + PANEL);
            float *out = buf + (g * group - k0) * 16 + p * PANEL;
            for (int64_t i = 0; i < group / 2; i++) {
                __m256 w0, w1;
                decode_pair(bits, gp + 64, i, s, o, &w0, &w1);
                _mm256_storeu_ps(out + 32 * i, w0);
                _mm256_storeu_ps(out + 32 * i + 16, w1);
            }
        }
}

/* R rows x NP panels: y[r, 8p + j] continues its chain over kc k's of decoded weights. first: start from 0. */
ALWAYS_INLINE void micro(int R, int NP, const float *buf, int64_t kc, const float *x, int64_t ldx, float *y,
                         int64_t ldy, int64_t valid, int first) {
    __m256 acc[MR][2];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++)
            acc[r][p] = first ? _mm256_setzero_ps() : load_out(y + r * ldy + p * PANEL, valid - p * PANEL);
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(buf + 16 * k);
        const __m256 w1 = NP == 2 ? _mm256_loadu_ps(buf + 16 * k + 8) : w0;
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
            if (NP == 2) acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) store_out(y + r * ldy + p * PANEL, acc[r][p], valid - p * PANEL);
}

#define MICRO_CASE(R, NP) \
    case R: micro(R, NP, buf, kc, x, ldx, y, ldy, valid, first); break;

static void micro_any(int rows, int np, const float *buf, int64_t kc, const float *x, int64_t ldx, float *y,
                      int64_t ldy, int64_t valid, int first) {
    if (np == 2) {
        switch (rows) { MICRO_CASE(1, 2) MICRO_CASE(2, 2) MICRO_CASE(3, 2) MICRO_CASE(4, 2) MICRO_CASE(5, 2) MICRO_CASE(6, 2) }
    } else {
        switch (rows) { MICRO_CASE(1, 1) MICRO_CASE(2, 1) MICRO_CASE(3, 1) MICRO_CASE(4, 1) MICRO_CASE(5, 1) MICRO_CASE(6, 1) }
    }
}

/* Large M: each thread owns a contiguous range of 16-output strips; per tile of MC rows and KC k's it decodes each
 * of its strips once into an L1 buffer and runs the micro-kernel over the tile's rows. */
ALWAYS_INLINE void gemm(int bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t M, int64_t N,
                        int64_t K) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, panel_bytes = K / group * group_bytes(bits, group);
    const int64_t num_strips = (num_panels + 1) / 2;
#pragma omp parallel
    {
        float buf[KC * 16] __attribute__((aligned(64)));
        int nt = 1, t = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        const int64_t s_begin = num_strips * t / nt, s_end = num_strips * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t mc = M - m0 < MC ? M - m0 : MC;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t s = s_begin; s < s_end; s++) {
                    const int np = 2 * s + 2 <= num_panels ? 2 : 1;
                    const int64_t n0 = 2 * s * PANEL;
                    decode_strip(bits, w + 2 * s * panel_bytes, panel_bytes, np, group, k0, kc, buf);
                    for (int64_t m = m0; m < m0 + mc; m += MR) {
                        const int rows = m0 + mc - m < MR ? (int)(m0 + mc - m) : MR;
                        micro_any(rows, np, buf, kc, x + m * K + k0, K, y + m * N + n0, N, N - n0, k0 == 0);
                    }
                }
            }
        }
    }
}

static void quant_linear_avx2(int bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t M,
                              int64_t N, int64_t K) {
    if (M >= GEMM_MIN_ROWS) {
        if (bits == 4) gemm(4, w, group, x, y, M, N, K);
        else gemm(8, w, group, x, y, M, N, K);
        return;
    }
    for (int64_t m = 0; m < M;) {
        const int64_t rows = M - m >= 2 ? 2 : 1;
        const float *xm = x + m * K;
        float *ym = y + m * N;
        if (bits == 4) {
            if (rows == 2) gemv(4, 2, 4, w, group, xm, ym, N, K); else gemv(4, 1, 4, w, group, xm, ym, N, K);
        } else {
            if (rows == 2) gemv(8, 2, 4, w, group, xm, ym, N, K); else gemv(8, 1, 4, w, group, xm, ym, N, K);
        }
        m += rows;
    }
}
#endif

/* One weight, as the kernels decode it. */
static inline float weight_at(const uint8_t *w, int64_t bits, int64_t group, int64_t K, int64_t n, int64_t k) {
    const int64_t panel_bytes = K / group * group_bytes(bits, group), lane = n % PANEL, kin = k % group;
    const uint8_t *gp = w + n / PANEL * panel_bytes + k / group * group_bytes(bits, group);
    const float s = ((const float *)gp)[lane], o = ((const float *)gp)[PANEL + lane];
    const uint8_t *codes = gp + 64;
    const float code = bits == 4 ? (float)((codes[kin / 2 * PANEL + lane] >> (kin % 2 * 4)) & 15)
                                 : (float)(int8_t)codes[kin * PANEL + lane];
    return fmaf(code, s, o);
}

/* y[M, N] = x[M, K] @ W^T for a packed W (bits 4 or 8, group 16 or 32, K a multiple of group). */
void quant_linear_f32(const uint8_t *w, int64_t bits, int64_t group, const float *x, float *y, int64_t M, int64_t N,
                      int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
    quant_linear_avx2((int)bits, w, group, x, y, M, N, K);
#else
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(weight_at(w, bits, group, K, n, k), x[m * K + k], acc);
            y[m * N + n] = acc;
        }
#endif
}

/* out[i, :] = W[ids[i], :] decoded (the embedding lookup; also the whole matrix, for tests). ids must be < N. */
void quant_gather_rows_f32(const uint8_t *w, int64_t bits, int64_t group, const int64_t *ids, float *out,
                           int64_t num_ids, int64_t K) {
#pragma omp parallel for schedule(static) if (num_ids * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t i = 0; i < num_ids; i++)
        for (int64_t k = 0; k < K; k++) out[i * K + k] = weight_at(w, bits, group, K, ids[i], k);
}
