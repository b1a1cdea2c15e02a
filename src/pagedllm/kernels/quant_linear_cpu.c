/* Linear layers on GGUF-quantized weights kept quantized in memory: y[M, N] = x[M, K] @ W[N, K]^T, fp32 x and y.
 *
 * Packed weight layout (built by layers/quantized_weight.py; see its docstring): output rows in panels of 8, each
 * panel a run of groups of `group` (16 or 32) k's; a group holds, in this order,
 *   scale[8] f32 | offset[8] f32 | codes      (one scale and offset per row of the panel)
 *   codes, bits = 4: group / 2 pairs of k, 8 bytes each: byte r = code(k, row r) | code(k + 1, row r) << 4
 *   codes, bits = 8: group k's, 8 bytes each: byte r = code(k, row r) as int8
 *   codes, bits = FP8: as bits = 8, each byte an fp8 e4m3 number (--quantization fp8), decoded exactly to
 *     code = its value / 256 (so the packer stores scale * 256)
 * so the 8 rows' codes of one k are adjacent and decode into one 8-lane vector. Weight value:
 *   w[n, k] = fma((float)code, scale, offset)
 * which is, bit for bit, the value gguf_dequant / gguf.quants compute (see the packer). Rows past N (the last
 * panel's padding) have zero codes, scales and offsets and are never stored.
 *
 * Invariant (DESIGN invariant 2, batch invariance): every output y[m, n] is
 *   acc = 0; for k = 0 .. K - 1 in order: acc = fma(w[n, k], x[m, k], acc)
 * one fp32 fma chain whatever M, the thread count or the path: small M streams the packed weights and decodes them
 * in registers (gemv_panels), large M decodes a strip of SW outputs (16, or 32 with AVX-512) x KC k's into an L1
 * buffer and runs a register-blocked micro-kernel over the rows (gemm_*: 6 rows x 16 outputs in ymm, or 12 x 32 in
 * zmm; a vector's lanes are outputs, so its width changes no chain), carrying each accumulator through y between K
 * tiles (an fp32 store and load are exact). Threads split the output panels, never the reduction.
 *
 * Threads take the outputs in chunks, dynamically (chunk_size): which thread computes an output never changes its
 * value, and a thread that the OS deschedules (the API server, the client and the engine's Python share these
 * cores) no longer holds the others at the region's end with a fixed half of the work.
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
#ifdef __AVX512F__
#define SP 4     /* panels per strip of the tiled path: 32 outputs, two zmm (see micro512) */
#else
#define SP 2     /* 16 outputs, two ymm */
#endif
#define SW (SP * PANEL)  /* outputs per strip: the row length of the decoded tile */
#define GEMM_MIN_ROWS 9  /* below: gemv, all the rows in one pass over W (see gemv_range) */
#define PARALLEL_MIN_WEIGHTS (64 * 1024)

#define FP8 9    /* the `bits` value naming fp8 e4m3 codes (8 bits each) */
#define CHUNKS_PER_THREAD 4

/* Units of work per chunk when the threads of the current parallel region share `units` dynamically: about
 * CHUNKS_PER_THREAD chunks per thread, each a multiple of `align` units. */
static inline int64_t chunk_size(int64_t units, int64_t align) {
    int64_t nt = 1;
#ifdef _OPENMP
    nt = omp_get_num_threads();
#endif
    const int64_t c = (units + nt * CHUNKS_PER_THREAD - 1) / (nt * CHUNKS_PER_THREAD);
    return c < 1 ? align : (c + align - 1) / align * align;
}

static inline int64_t group_bytes(int64_t bits, int64_t group) {
    return 2 * PANEL * 4 + group * (bits == FP8 ? 8 : bits);
}

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

/* 8 fp8 e4m3 bytes -> their values / 2^8, exactly: sign and the 7 other bits placed as an fp16 (s eeee mmm ->
 * s 0eeee mmm0000000); fp16's exponent bias is 8 more than e4m3's, and e4m3 subnormals land on fp16 subnormals,
 * which the conversion reads exactly. (No NaN: the packer saturates to +-448.) */
ALWAYS_INLINE __m256 fp8_to_ps(const uint8_t *p) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));  /* sign copied into bits 8..15 */
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBFFF)));
}

/* The weights of k = 2i and 2i + 1 for the 8 rows of a group whose codes start at `codes`. */
ALWAYS_INLINE void decode_pair(int bits, const uint8_t *codes, int64_t i, __m256 s, __m256 o, __m256 *w0, __m256 *w1) {
    if (bits == 4) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * i)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), s, o);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s, o);
    } else if (bits == FP8) {
        *w0 = _mm256_fmadd_ps(fp8_to_ps(codes + 16 * i), s, o);
        *w1 = _mm256_fmadd_ps(fp8_to_ps(codes + 16 * i + 8), s, o);
    } else {
        const __m256i b0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 16 * i)));
        const __m256i b1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 16 * i + 8)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b0), s, o);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b1), s, o);
    }
}

/* Software prefetch for the streaming path: at group g of a run of P panels, the bytes of group g + GEMV_AHEAD of
 * each panel, which past the panel's last group are the next run's (P panels on: the same stream, continued). A
 * panel is only a few kilobytes (SmolLM2's 4-bit K = 576: 18 groups, 3.4 KB), too short for the hardware
 * prefetcher to ramp up in, so without this the streams of several rows wait on DRAM (one thread, gate_up, M = 5:
 * 0.30 ms with the weights in DRAM, 0.21 with this or in cache). One row (8 panel streams, fewer fmas per byte)
 * runs slower with it (the batch-1 decode step: 6.3-6.9 ms against 7.4-8.0) and goes without. Past the weights'
 * end (the last run) the addresses are harmless: a prefetch never faults. */
#ifndef GEMV_AHEAD
#define GEMV_AHEAD 8
#endif
ALWAYS_INLINE void prefetch_groups(const uint8_t *gp, int P, int64_t panel_bytes, int64_t gbytes, int64_t g,
                                   int64_t num_groups) {
    const int64_t ahead = GEMV_AHEAD * gbytes + (g + GEMV_AHEAD >= num_groups ? (P - 1) * panel_bytes : 0);
    for (int p = 0; p < P; p++)
        for (int64_t b = 0; b < gbytes; b += 64) _mm_prefetch((const char *)(gp + p * panel_bytes + ahead + b), _MM_HINT_T0);
}

/* Small M: R rows (1 to 8) of x against P panels (1, 2, 4 or 8: 8P outputs from n0), streaming the packed weights
 * once. R x P independent fma chains hide the 4-cycle fma latency, and P panel streams read at once keep more
 * weight lines in flight from DRAM (one row, Q8_0 LM head, one thread: P = 8 takes 0.77x the time of P = 4; with
 * the weights in cache the two are even, the decode's use of the vector ports being the limit there).
 * Accumulators a<row><panel> are named variables, not an array: gcc kept an array's elements in registers but
 * also stored them to the stack on every k. */
ALWAYS_INLINE void gemv_panels(int bits, int R, int P, const uint8_t *w, int64_t panel_bytes, int64_t group,
                               const float *x, int64_t K, float *y, int64_t N, int64_t n0) {
    const int64_t gbytes = group_bytes(bits, group), num_groups = K / group;
    const __m256 z = _mm256_setzero_ps();
#define ACC_ROW(r) __m256 a##r##0 = z, a##r##1 = z, a##r##2 = z, a##r##3 = z, a##r##4 = z, a##r##5 = z, a##r##6 = z, \
                          a##r##7 = z;
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5) ACC_ROW(6) ACC_ROW(7)
#undef ACC_ROW
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *gp = w + g * gbytes;
        if (R > 1) prefetch_groups(gp, P, panel_bytes, gbytes, g, num_groups);
        for (int64_t i = 0; i < group / 2; i++) {
            const int64_t k = g * group + 2 * i;
            __m256 v0 = z, u0 = z, v1 = z, u1 = z, v2 = z, u2 = z, v3 = z, u3 = z; /* panel p's weights at k, k + 1 */
            __m256 v4 = z, u4 = z, v5 = z, u5 = z, v6 = z, u6 = z, v7 = z, u7 = z;
#define DECODE(p)                                                                                                  \
            if (P > p) {                                                                                           \
                const uint8_t *pp = gp + p * panel_bytes;                                                          \
                decode_pair(bits, pp + 64, i, _mm256_loadu_ps((const float *)pp),                                  \
                            _mm256_loadu_ps((const float *)pp + PANEL), &v##p, &u##p);                             \
            }
#define CHAIN(r, p)                                                                                                \
            if (R > r && P > p) {                                                                                  \
                a##r##p = _mm256_fmadd_ps(v##p, _mm256_broadcast_ss(x + r * K + k), a##r##p);                      \
                a##r##p = _mm256_fmadd_ps(u##p, _mm256_broadcast_ss(x + r * K + k + 1), a##r##p);                  \
            }
#define CHAINS(r) CHAIN(r, 0) CHAIN(r, 1) CHAIN(r, 2) CHAIN(r, 3) CHAIN(r, 4) CHAIN(r, 5) CHAIN(r, 6) CHAIN(r, 7)
            if (R == 1) {  /* each panel's two weights used at once: 8 panels need no more registers than 1 */
#define STEP(p) DECODE(p) CHAIN(0, p)
                STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
            } else {  /* the P panels' weights decoded once, then used by each row */
                DECODE(0) DECODE(1) DECODE(2) DECODE(3) DECODE(4) DECODE(5) DECODE(6) DECODE(7)
                CHAINS(0) CHAINS(1) CHAINS(2) CHAINS(3) CHAINS(4) CHAINS(5) CHAINS(6) CHAINS(7)
            }
#undef CHAINS
#undef CHAIN
#undef DECODE
        }
    }
#define STORE(r, p) if (R > r && P > p) store_out(y + r * N + n0 + p * PANEL, a##r##p, N - n0 - p * PANEL);
#define STORE_ROW(r) STORE(r, 0) STORE(r, 1) STORE(r, 2) STORE(r, 3) STORE(r, 4) STORE(r, 5) STORE(r, 6) STORE(r, 7)
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
#undef STORE_ROW
#undef STORE
}

#ifdef __AVX512F__
/* 8 bytes at a and 8 at b as one 16-byte vector (panel pair: a's rows in lanes 0-7, b's in 8-15). */
ALWAYS_INLINE __m128i load_pair8(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}

/* decode_pair for two panels at once (codes at ca and cb): 16 lanes, panel a's 8 rows then panel b's. */
ALWAYS_INLINE void decode_pair512(int bits, const uint8_t *ca, const uint8_t *cb, int64_t i, __m512 s, __m512 o,
                                  __m512 *w0, __m512 *w1) {
    if (bits == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(load_pair8(ca + 8 * i, cb + 8 * i));
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s, o);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, o);
    } else if (bits == FP8) {  /* as fp8_to_ps, 16 at once */
        const __m256i h0 = _mm256_cvtepi8_epi16(load_pair8(ca + 16 * i, cb + 16 * i));
        const __m256i h1 = _mm256_cvtepi8_epi16(load_pair8(ca + 16 * i + 8, cb + 16 * i + 8));
        const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
        *w0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h0, 7), keep)), s, o);
        *w1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h1, 7), keep)), s, o);
    } else {
        const __m512i b0 = _mm512_cvtepi8_epi32(load_pair8(ca + 16 * i, cb + 16 * i));
        const __m512i b1 = _mm512_cvtepi8_epi32(load_pair8(ca + 16 * i + 8, cb + 16 * i + 8));
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b0), s, o);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b1), s, o);
    }
}

/* 8 floats at a and 8 at b as one zmm. */
ALWAYS_INLINE __m512 load_pair_ps(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

ALWAYS_INLINE void store_pair(float *p, __m512 v, int64_t valid) {
    if (valid >= 16) _mm512_storeu_ps(p, v);
    else if (valid > 0) _mm512_mask_storeu_ps(p, (__mmask16)((1u << valid) - 1), v);
}

/* gemv_panels' AVX-512 form for 2 Q panels (Q = 1, 2 or 4 pairs): each zmm holds a pair of panels, lanes still
 * outputs, so every chain (and bit) is gemv_panels'; half the decode and fma instructions. */
ALWAYS_INLINE void gemv_pairs(int bits, int R, int Q, const uint8_t *w, int64_t panel_bytes, int64_t group,
                              const float *x, int64_t K, float *y, int64_t N, int64_t n0) {
    const int64_t gbytes = group_bytes(bits, group), num_groups = K / group;
    const __m512 z = _mm512_setzero_ps();
#define ACC_ROW(r) __m512 a##r##0 = z, a##r##1 = z, a##r##2 = z, a##r##3 = z;
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5) ACC_ROW(6) ACC_ROW(7)
#undef ACC_ROW
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *gp = w + g * gbytes;
        if (R > 1) prefetch_groups(gp, 2 * Q, panel_bytes, gbytes, g, num_groups);
        __m512 s0 = z, o0 = z, s1 = z, o1 = z, s2 = z, o2 = z, s3 = z, o3 = z;
#define SCALES(q)                                                                                                  \
        if (Q > q) {                                                                                               \
            const float *pa = (const float *)(gp + 2 * q * panel_bytes), *pb = (const float *)(gp + (2 * q + 1) * panel_bytes); \
            s##q = load_pair_ps(pa, pb);                                                                           \
            o##q = load_pair_ps(pa + PANEL, pb + PANEL);                                                           \
        }
        SCALES(0) SCALES(1) SCALES(2) SCALES(3)
#undef SCALES
        for (int64_t i = 0; i < group / 2; i++) {
            const int64_t k = g * group + 2 * i;
            __m512 v0 = z, u0 = z, v1 = z, u1 = z, v2 = z, u2 = z, v3 = z, u3 = z;
#define DECODE(q)                                                                                                  \
            if (Q > q) decode_pair512(bits, gp + 2 * q * panel_bytes + 64, gp + (2 * q + 1) * panel_bytes + 64, i, \
                                      s##q, o##q, &v##q, &u##q);
#define CHAIN(r, q)                                                                                                \
            if (R > r && Q > q) {                                                                                  \
                a##r##q = _mm512_fmadd_ps(v##q, _mm512_set1_ps(x[r * K + k]), a##r##q);                            \
                a##r##q = _mm512_fmadd_ps(u##q, _mm512_set1_ps(x[r * K + k + 1]), a##r##q);                        \
            }
#define CHAINS(r) CHAIN(r, 0) CHAIN(r, 1) CHAIN(r, 2) CHAIN(r, 3)
            DECODE(0) DECODE(1) DECODE(2) DECODE(3)
            CHAINS(0) CHAINS(1) CHAINS(2) CHAINS(3) CHAINS(4) CHAINS(5) CHAINS(6) CHAINS(7)
#undef CHAINS
#undef CHAIN
#undef DECODE
        }
    }
#define STORE(r, q) if (R > r && Q > q) store_pair(y + r * N + n0 + 2 * q * PANEL, a##r##q, N - n0 - 2 * q * PANEL);
#define STORE_ROW(r) STORE(r, 0) STORE(r, 1) STORE(r, 2) STORE(r, 3)
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
#undef STORE_ROW
#undef STORE
}
#endif

/* gemv_panels over panels [p_begin, p_end) of W: runs of max_p panels (8 for one row, 4 for two, 2 for more: the
 * registers; two rows with the weights in DRAM: P = 4 takes 0.89x the time of P = 2, in cache 1.1x), then runs of
 * 4, 2, 1 for the rest; the shape is constant in each instance. Every M below GEMM_MIN_ROWS is one pass, so the
 * weights are decoded once per call: R x 2 accumulators + 4 weights + 1 broadcast fit the 16 ymm registers up to
 * R = 5; at 6 to 8 rows gcc keeps some accumulators on the stack, and still the 4-bit linears run faster with
 * P = 2 than P = 1 (7-8 rows: 0.85-0.9x the time), the Q8_0 LM head slightly slower (1.01-1.1x), so 8-bit codes
 * take P = 1 there. One pass against passes of up to 4 rows, one thread's CPU time: 5 rows 0.7-0.85x the time
 * (4-bit linears), 0.68x (Q8_0 LM head); against the tiled path at 8 rows 0.7x (it decodes once too, but stores
 * and reloads the weights). */
#define GEMV_RANGE_ARGS const uint8_t *w, int64_t panel_bytes, int64_t group, const float *x, int64_t K, float *y, \
                        int64_t N, int64_t p_begin, int64_t p_end
typedef void (*gemv_range_fn)(GEMV_RANGE_ARGS);
ALWAYS_INLINE void gemv_range(int bits, int R, int max_p, GEMV_RANGE_ARGS) {
    int64_t p = p_begin;
#ifdef __AVX512F__
#define RUNS(P)                                                                                                    \
    if (max_p >= P)                                                                                                \
        for (; p + P <= p_end; p += P) gemv_pairs(bits, R, P / 2, w + p * panel_bytes, panel_bytes, group, x, K, y, N, p * PANEL);
    RUNS(8) RUNS(4) RUNS(2)
#undef RUNS
#endif
#define RUNS(P)                                                                                                    \
    if (max_p >= P)                                                                                                \
        for (; p + P <= p_end; p += P) gemv_panels(bits, R, P, w + p * panel_bytes, panel_bytes, group, x, K, y, N, p * PANEL);
    RUNS(8) RUNS(4) RUNS(2) RUNS(1)
#undef RUNS
}

#ifdef __AVX512F__
#define MAXP2 2 /* two rows, one panel pair per zmm: 0.93x the time of two pairs (one thread, gate_up; 3 to 5 rows: two
                 * pairs take 1.1-1.25x) */
#else
#define MAXP2 4
#endif
#define DEFINE_RANGE(NAME, BITS, R, MAXP)                                                                          \
    static void gemv_range_##NAME##_##R(GEMV_RANGE_ARGS) {                                                         \
        gemv_range(BITS, R, MAXP, w, panel_bytes, group, x, K, y, N, p_begin, p_end);                              \
    }
#define DEFINE_RANGES(NAME, BITS, MAXP78)                                                                          \
    DEFINE_RANGE(NAME, BITS, 1, 8) DEFINE_RANGE(NAME, BITS, 2, MAXP2) DEFINE_RANGE(NAME, BITS, 3, 2)               \
    DEFINE_RANGE(NAME, BITS, 4, 2) DEFINE_RANGE(NAME, BITS, 5, 2) DEFINE_RANGE(NAME, BITS, 6, 2)                   \
    DEFINE_RANGE(NAME, BITS, 7, MAXP78) DEFINE_RANGE(NAME, BITS, 8, MAXP78)
DEFINE_RANGES(4, 4, 2) DEFINE_RANGES(8, 8, 1) DEFINE_RANGES(fp8, FP8, 1)
#undef DEFINE_RANGES
#undef DEFINE_RANGE

/* [code type: 4, 8, FP8][rows - 1] */
#define KERNEL_ROW(NAME) {gemv_range_##NAME##_1, gemv_range_##NAME##_2, gemv_range_##NAME##_3, gemv_range_##NAME##_4, \
                          gemv_range_##NAME##_5, gemv_range_##NAME##_6, gemv_range_##NAME##_7, gemv_range_##NAME##_8}
static const gemv_range_fn GEMV_KERNELS[3][GEMM_MIN_ROWS - 1] = {KERNEL_ROW(4), KERNEL_ROW(8), KERNEL_ROW(fp8)};
#undef KERNEL_ROW

/* `run` over every panel of W for the rows x (R of them, fixed in the function); threads take chunks of whole
 * 8-panel runs as they come (chunk_size). */
static void gemv(gemv_range_fn run, int64_t bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t N,
                 int64_t K) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, panel_bytes = K / group * group_bytes(bits, group);
#pragma omp parallel if (N * K >= PARALLEL_MIN_WEIGHTS)
    {
        const int64_t chunk = chunk_size(num_panels, 8);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_panels; p += chunk)
            run(w, panel_bytes, group, x, K, y, N, p, p + chunk < num_panels ? p + chunk : num_panels);
    }
}

/* Decode k's [k0, k0 + kc) of np (1 to SP) panels into buf[kc][SW] (panel p in floats 8p .. 8p + 7). */
ALWAYS_INLINE void decode_strip(int bits, const uint8_t *w, int64_t panel_bytes, int np, int64_t group, int64_t k0,
                                int64_t kc, float *buf) {
    const int64_t gbytes = group_bytes(bits, group);
    for (int p = 0; p < np; p++)
        for (int64_t g = k0 / group; g < (k0 + kc) / group; g++) {
            const uint8_t *gp = w + p * panel_bytes + g * gbytes;
            const __m256 s = _mm256_loadu_ps((const float *)gp), o = _mm256_loadu_ps((const float *)gp + PANEL);
            float *out = buf + (g * group - k0) * SW + p * PANEL;
            for (int64_t i = 0; i < group / 2; i++) {
                __m256 w0, w1;
                decode_pair(bits, gp + 64, i, s, o, &w0, &w1);
                _mm256_storeu_ps(out + 2 * i * SW, w0);
                _mm256_storeu_ps(out + (2 * i + 1) * SW, w1);
            }
        }
}

#ifndef __AVX512F__
/* R rows x NP panels: y[r, 8p + j] continues its chain over kc k's of decoded weights. first: start from 0.
 * Named accumulators c<row><panel> (see gemv_panels). */
ALWAYS_INLINE void micro(int R, int NP, const float *buf, int64_t kc, const float *x, int64_t ldx, float *y,
                         int64_t ldy, int64_t valid, int first) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define LOAD_ROW(r)                                                                                                \
    if (R > r && !first) {                                                                                         \
        c##r##0 = load_out(y + r * ldy, valid);                                                                    \
        if (NP == 2) c##r##1 = load_out(y + r * ldy + PANEL, valid - PANEL);                                       \
    }
    LOAD_ROW(0) LOAD_ROW(1) LOAD_ROW(2) LOAD_ROW(3) LOAD_ROW(4) LOAD_ROW(5)
#undef LOAD_ROW
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(buf + SW * k);
        const __m256 w1 = NP == 2 ? _mm256_loadu_ps(buf + SW * k + 8) : w0;
#define FMA_ROW(r)                                                                                                 \
        if (R > r) {                                                                                               \
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                                \
            c##r##0 = _mm256_fmadd_ps(w0, xb, c##r##0);                                                            \
            if (NP == 2) c##r##1 = _mm256_fmadd_ps(w1, xb, c##r##1);                                               \
        }
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
#undef FMA_ROW
    }
#define STORE_ROW(r)                                                                                               \
    if (R > r) {                                                                                                   \
        store_out(y + r * ldy, c##r##0, valid);                                                                    \
        if (NP == 2) store_out(y + r * ldy + PANEL, c##r##1, valid - PANEL);                                       \
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
#undef STORE_ROW
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

#else
/* micro's AVX-512 form: a strip's 32 outputs in two zmm (NZ = 1: its first 16 only), R rows (up to MR512 = 12:
 * 24 accumulators + 2 weights; each k's broadcast of x folds into its fma, so the loads, 2 weights + R
 * broadcasts, stay below the fmas). Each lane still runs one output's fma chain over k in order: the same bits as
 * micro and the streaming path. Lanes past `valid` may hold another strip's weights and are never stored. */
#define MR512 12
ALWAYS_INLINE __mmask16 lanes(int64_t valid) {
    return valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
}

ALWAYS_INLINE void micro512(int R, int NZ, const float *buf, int64_t kc, const float *x, int64_t ldx, float *y,
                            int64_t ldy, int64_t valid, int first) {
    const __mmask16 m0 = lanes(valid), m1 = lanes(valid - 16);
    const __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z,
           c51 = z, c60 = z, c61 = z, c70 = z, c71 = z, c80 = z, c81 = z, c90 = z, c91 = z, c100 = z, c101 = z,
           c110 = z, c111 = z;
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define LOAD(r)                                                                                                    \
    if (R > r && !first) {                                                                                         \
        c##r##0 = _mm512_maskz_loadu_ps(m0, y + r * ldy);                                                          \
        if (NZ == 2) c##r##1 = _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);                                        \
    }
    ROWS(LOAD)
    for (int64_t k = 0; k < kc; k++) {
        const __m512 w0 = _mm512_loadu_ps(buf + SW * k), w1 = NZ == 2 ? _mm512_loadu_ps(buf + SW * k + 16) : w0;
#define FMA(r)                                                                                                     \
        if (R > r) {                                                                                               \
            const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);                                                      \
            c##r##0 = _mm512_fmadd_ps(w0, xb, c##r##0);                                                            \
            if (NZ == 2) c##r##1 = _mm512_fmadd_ps(w1, xb, c##r##1);                                               \
        }
        ROWS(FMA)
    }
#define STORE(r)                                                                                                   \
    if (R > r) {                                                                                                   \
        _mm512_mask_storeu_ps(y + r * ldy, m0, c##r##0);                                                           \
        if (NZ == 2) _mm512_mask_storeu_ps(y + r * ldy + 16, m1, c##r##1);                                         \
    }
    ROWS(STORE)
#undef STORE
#undef FMA
#undef LOAD
#undef ROWS
}

#define MICRO512_CASE(R)                                                                                           \
    case R: {                                                                                                      \
        if (nz == 2) micro512(R, 2, buf, kc, x, ldx, y, ldy, valid, first);                                        \
        else micro512(R, 1, buf, kc, x, ldx, y, ldy, valid, first);                                                \
        break;                                                                                                     \
    }
static void micro512_any(int rows, int nz, const float *buf, int64_t kc, const float *x, int64_t ldx, float *y,
                         int64_t ldy, int64_t valid, int first) {
    switch (rows) {
        MICRO512_CASE(1) MICRO512_CASE(2) MICRO512_CASE(3) MICRO512_CASE(4) MICRO512_CASE(5) MICRO512_CASE(6)
        MICRO512_CASE(7) MICRO512_CASE(8) MICRO512_CASE(9) MICRO512_CASE(10) MICRO512_CASE(11) MICRO512_CASE(12)
    }
}
#undef MICRO512_CASE
#endif

/* The packed bytes of k's [k0, k0 + kc) of strip s (its one or two panels) into the cache: issued before a tile's
 * micro-kernel calls for the next tile, they arrive while the fmas run (Q8_0 LM head, M=16: 0.93x the time; the 4-bit linears: even). */
ALWAYS_INLINE void prefetch_strip(int bits, const uint8_t *w, int64_t panel_bytes, int64_t num_panels, int64_t group,
                                  int64_t K, int64_t s, int64_t k0) {
    const int64_t gbytes = group_bytes(bits, group), kc = K - k0 < KC ? K - k0 : KC;
    for (int64_t p = SP * s; p < SP * s + SP && p < num_panels; p++) {
        const char *a = (const char *)w + p * panel_bytes + k0 / group * gbytes;
        for (int64_t off = 0; off < kc / group * gbytes; off += 64) _mm_prefetch(a + off, _MM_HINT_T0);
    }
}

/* Large M, one thread's share: strips [s_begin, s_end) of SW outputs. Per tile of MC rows and KC k's it decodes
 * each strip once into an L1 buffer and runs the micro-kernel over the tile's rows. The loops over strips and K
 * tiles nest whichever way keeps the larger operand in cache: K tiles outside when the thread's outputs are fewer
 * than K (the MC x KC tile of x is reused by every strip), inside otherwise (a strip's MC x SW outputs stay in
 * L1 across its K tiles instead of all the thread's outputs going through L3 between tiles: gate_up, 2 threads,
 * 1536 outputs each for K = 576). Either way each output's chain visits k in order. (s_next, k_next): the tile
 * that follows, prefetched; s_next < 0: none. */
ALWAYS_INLINE void gemm_tile(int bits, const uint8_t *w, int64_t panel_bytes, int64_t num_panels, int64_t group,
                             const float *x, float *y, int64_t N, int64_t K, int64_t m0, int64_t mc, int64_t s,
                             int64_t k0, float *buf, int64_t s_next, int64_t k_next) {
    const int np = SP * s + SP <= num_panels ? SP : (int)(num_panels - SP * s);
    const int64_t n0 = SP * s * PANEL, kc = K - k0 < KC ? K - k0 : KC;
    decode_strip(bits, w + SP * s * panel_bytes, panel_bytes, np, group, k0, kc, buf);
    if (s_next >= 0) prefetch_strip(bits, w, panel_bytes, num_panels, group, K, s_next, k_next);
#ifdef __AVX512F__
    const int64_t blocks = (mc + MR512 - 1) / MR512;
#else
    const int64_t blocks = (mc + MR - 1) / MR;  /* row blocks of even sizes: 16 rows as 6 + 5 + 5 (0.91x the time
                                                   of 6 + 6 + 4, whose 8 chains barely cover the fma latency) */
#endif
    for (int64_t i = 0, m = m0; i < blocks; i++) {
        const int rows = (int)(mc * (i + 1) / blocks - mc * i / blocks);
#ifdef __AVX512F__
        micro512_any(rows, np > 2 ? 2 : 1, buf, kc, x + m * K + k0, K, y + m * N + n0, N, N - n0, k0 == 0);
#else
        micro_any(rows, np, buf, kc, x + m * K + k0, K, y + m * N + n0, N, N - n0, k0 == 0);
#endif
        m += rows;
    }
}

ALWAYS_INLINE void gemm_strips(int bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t M,
                               int64_t N, int64_t K, int64_t s_begin, int64_t s_end) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, panel_bytes = K / group * group_bytes(bits, group);
    const int strips_outside = (s_end - s_begin) * SW > K;
    float buf[KC * SW] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
        if (strips_outside) {
            for (int64_t s = s_begin; s < s_end; s++)
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int last_k = k0 + KC >= K;
                    gemm_tile(bits, w, panel_bytes, num_panels, group, x, y, N, K, m0, mc, s, k0, buf,
                              !last_k ? s : s + 1 < s_end ? s + 1 : -1, !last_k ? k0 + KC : 0);
                }
        } else {
            for (int64_t k0 = 0; k0 < K; k0 += KC)
                for (int64_t s = s_begin; s < s_end; s++) {
                    const int last_s = s + 1 >= s_end;
                    gemm_tile(bits, w, panel_bytes, num_panels, group, x, y, N, K, m0, mc, s, k0, buf,
                              !last_s ? s + 1 : k0 + KC < K ? s_begin : -1, !last_s ? k0 : k0 + KC);
                }
        }
    }
}

static void gemm_strips_4(const uint8_t *w, int64_t group, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                          int64_t s_begin, int64_t s_end) {
    gemm_strips(4, w, group, x, y, M, N, K, s_begin, s_end);
}

static void gemm_strips_8(const uint8_t *w, int64_t group, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                          int64_t s_begin, int64_t s_end) {
    gemm_strips(8, w, group, x, y, M, N, K, s_begin, s_end);
}

static void gemm_strips_fp8(const uint8_t *w, int64_t group, const float *x, float *y, int64_t M, int64_t N,
                            int64_t K, int64_t s_begin, int64_t s_end) {
    gemm_strips(FP8, w, group, x, y, M, N, K, s_begin, s_end);
}

/* Threads take chunks of strips as they come (chunk_size). */
static void gemm(int bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t M, int64_t N,
                 int64_t K) {
    const int64_t num_strips = ((N + PANEL - 1) / PANEL + SP - 1) / SP;
#pragma omp parallel
    {
        const int64_t chunk = chunk_size(num_strips, 1);
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_strips; s += chunk) {
            const int64_t s_end = s + chunk < num_strips ? s + chunk : num_strips;
            if (bits == 4) gemm_strips_4(w, group, x, y, M, N, K, s, s_end);
            else if (bits == FP8) gemm_strips_fp8(w, group, x, y, M, N, K, s, s_end);
            else gemm_strips_8(w, group, x, y, M, N, K, s, s_end);
        }
    }
}

static void quant_linear_avx2(int bits, const uint8_t *w, int64_t group, const float *x, float *y, int64_t M,
                              int64_t N, int64_t K) {
    if (M >= GEMM_MIN_ROWS) {
        gemm(bits, w, group, x, y, M, N, K);
        return;
    }
    if (M > 0) gemv(GEMV_KERNELS[bits == 4 ? 0 : bits == 8 ? 1 : 2][M - 1], bits, w, group, x, y, N, K);
}
#endif

/* An fp8 e4m3 byte's value / 2^8 (see fp8_to_ps): (8 + m) 2^(e - 18), or m 2^-17 for e = 0. */
static inline float fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = e ? ldexpf((float)(8 + m), e - 18) : ldexpf((float)m, -17);
    return b & 0x80 ? -mag : mag;
}

/* One weight, as the kernels decode it. */
static inline float weight_at(const uint8_t *w, int64_t bits, int64_t group, int64_t K, int64_t n, int64_t k) {
    const int64_t panel_bytes = K / group * group_bytes(bits, group), lane = n % PANEL, kin = k % group;
    const uint8_t *gp = w + n / PANEL * panel_bytes + k / group * group_bytes(bits, group);
    const float s = ((const float *)gp)[lane], o = ((const float *)gp)[PANEL + lane];
    const uint8_t *codes = gp + 64;
    const float code = bits == 4     ? (float)((codes[kin / 2 * PANEL + lane] >> (kin % 2 * 4)) & 15)
                       : bits == FP8 ? fp8_value(codes[kin * PANEL + lane])
                                     : (float)(int8_t)codes[kin * PANEL + lane];
    return fmaf(code, s, o);
}

/* y[M, N] = x[M, K] @ W^T for a packed W (bits 4, 8 or FP8, group 16 or 32, K a multiple of group). */
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
    const int64_t gbytes = group_bytes(bits, group), panel_bytes = K / group * gbytes;
#pragma omp parallel for schedule(static) if (num_ids * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t i = 0; i < num_ids; i++) {
        const int64_t lane = ids[i] % PANEL;
        const uint8_t *panel = w + ids[i] / PANEL * panel_bytes;
        for (int64_t g = 0; g < K / group; g++) {
            const uint8_t *gp = panel + g * gbytes, *codes = gp + 64;
            const float s = ((const float *)gp)[lane], o = ((const float *)gp)[PANEL + lane];
            float *dst = out + i * K + g * group;
            if (bits == 4)
                for (int64_t j = 0; j < group; j += 2) {
                    const uint8_t b = codes[j / 2 * PANEL + lane];
                    dst[j] = fmaf((float)(b & 15), s, o);
                    dst[j + 1] = fmaf((float)(b >> 4), s, o);
                }
            else if (bits == FP8)
                for (int64_t j = 0; j < group; j++) dst[j] = fmaf(fp8_value(codes[j * PANEL + lane]), s, o);
            else
                for (int64_t j = 0; j < group; j++) dst[j] = fmaf((float)(int8_t)codes[j * PANEL + lane], s, o);
        }
    }
}
