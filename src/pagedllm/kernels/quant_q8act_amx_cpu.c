/* The fast mode's 8-bit-activation linear on AMX tiles (Intel Sapphire Rapids and later): quant_q8act_cpu.c's
 * many-row path where the CPU has AMX-INT8.
 *
 * The same numbers as quant_q8act_cpu.c's tiles, bit for bit: per output, per 32-k block, the integer sum of
 * weight codes x activation codes is exact whichever instruction adds it (here one TDPBSUD, or TDPBSSD for S8
 * weights, per block and 16 x 16 outputs), and its fp32 part is the same op sequence, blocks in order:
 *   c = fma(float(sum), d * da, c); c = fma(mn, sa, c)   (the second only for U4 / U5)
 * so a row's outputs do not depend on which path, how many rows or which thread computed them.
 *
 * Tiles (one configuration per thread): C (tmm0) 16 rows x 16 int32 outputs, A (tmm1) 16 activation rows x 32
 * int8 codes (one block), B (tmm2) 8 quads x 16 outputs x 4 codes: the weight codes of two 8-row groups of the
 * packed layout as bytes, decoded once per group pair into a scratch buffer (nb x 512 bytes) and reused by every
 * 16-row slice of the activations. The activation rows are padded with zero rows to a multiple of 16 by the
 * caller; padded rows' outputs are not stored.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { W_U4 = 0, W_U5 = 1, W_S8 = 2 };
#define QK 32
#define AMX_M_SLICE 512
#define AMX_BLOCK_CHUNK 16  /* 32-k blocks whose int32 sums (1 KB each) are computed before they are scaled */  /* activation rows per pass over a chunk's group pairs */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted = -1; /* -1: not asked yet */
static int amx_enabled = 1;

/* Whether this process may use the tiles (Linux grants the tile state on request) and they are not turned off. */
int q8act_amx_ready(void) {
    if (amx_permitted < 0) amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted && amx_enabled;
}

/* Turn the AMX path on or off (benchmarks' before / after and the tests' bitwise comparison). */
void q8act_amx_enable(int on) { amx_enabled = on != 0; }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The tile shapes (C, A, B as above). A file-scope constant: built on the stack, gcc 12 at -O3 dropped the
 * stores of its rows / colsb fields before ldtilecfg (it does not see the instruction read them). */
static const tile_config CONFIG = {.palette_id = 1, .colsb = {64, QK, 64, 64, QK, 64},
                                   .rows = {16, 16, QK / 4, 16, 16, QK / 4}};

/* Load this thread's tile configuration. */
void q8act_amx_configure(void) { _tile_loadconfig(&CONFIG); }

void q8act_amx_release(void) { _tile_release(); }

static inline __m512i load_pair256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 load_pair_f(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

/* The codes of groups g (at wg) and g + 1 (at wg + gs) as B tiles: per block 8 rows of 64 bytes, row q = quad q
 * (k = 4q .. 4q + 3) of the 16 outputs. U4 / U5: load j holds quad j in its low nibbles and quad j + 4 in its
 * high ones (plus the fifth bits for U5); S8: quad q is 32 bytes per group as they are. */
static void decode_pair(int wtype, const uint8_t *wg, int64_t gs, int64_t nb, uint8_t *bt) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    const int64_t bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * bytes;
        uint8_t *dst = bt + b * 512;
        if (wtype == W_S8) {
            for (int q = 0; q < 8; q++) _mm512_storeu_si512(dst + q * 64, load_pair256(wb + q * 32, wb + gs + q * 32));
            continue;
        }
        const __m512i h = wtype == W_U5 ? load_pair256(wb + 128, wb + gs + 128) : _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i packed = load_pair256(wb + j * 32, wb + gs + j * 32);
            __m512i lo = _mm512_and_si512(packed, low4), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            if (wtype == W_U5) {
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4 - j), bit4));
                hi = _mm512_or_si512(hi, _mm512_and_si512(j == 0 ? h : _mm512_srli_epi16(h, j), bit4));
            }
            _mm512_storeu_si512(dst + j * 64, lo);
            _mm512_storeu_si512(dst + (j + 4) * 64, hi);
        }
    }
}

/* The int32 block sums of 16 activation rows (qa, K apart) x one group pair, every block: sums [nb][16 x 16].
 * Two blocks at a time in separate tiles (C: tmm0 / tmm3, A: tmm1 / tmm4, B: tmm2 / tmm5) so that their dot
 * products overlap; stored to memory and read back only after all of them (a vector load right after a tile
 * store of the same line waits for it). */
static inline void block_sums(int wtype, const int8_t *qa, int64_t K, const uint8_t *bt, int64_t nb, int32_t *sums) {
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, qa + b * QK, K);
        _tile_loadd(2, bt + b * 512, 64);
        _tile_loadd(4, qa + (b + 1) * QK, K);
        _tile_loadd(5, bt + (b + 1) * 512, 64);
        if (wtype == W_S8) {
            _tile_dpbssd(0, 1, 2);
            _tile_dpbssd(3, 4, 5);
        } else {
            _tile_dpbsud(0, 1, 2);
            _tile_dpbsud(3, 4, 5);
        }
        _tile_stored(0, sums + b * 256, 64);
        _tile_stored(3, sums + (b + 1) * 256, 64);
    }
    if (b < nb) {
        _tile_zero(0);
        _tile_loadd(1, qa + b * QK, K);
        _tile_loadd(2, bt + b * 512, 64);
        if (wtype == W_S8)
            _tile_dpbssd(0, 1, 2);
        else
            _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums + b * 256, 64);
    }
}

/* 16 outputs (groups g, g + 1) of `rows` activation rows: qa [rows padded to 16, K] int8 codes, da / sa
 * [rows, nb]; dg / mg point at group g's scales and offsets, fs floats apart per group. out: rows x 16 (stride
 * ld). bt: nb x 512 bytes of scratch, sums: AMX_BLOCK_CHUNK x 256 int32. */
static void pair_rows(int wtype, const uint8_t *wg, int64_t gs, const float *dg, const float *mg, int64_t fs,
                      const int8_t *qa, const float *dt, const float *st, int64_t nb, int64_t K, float *out,
                      int64_t ld, int64_t rows, uint8_t *bt, int32_t *sums) {
    decode_pair(wtype, wg, gs, nb, bt);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int64_t valid = rows - m0 < 16 ? rows - m0 : 16;
        float acc[16 * 16] __attribute__((aligned(64))); /* the fp32 sums between chunks of blocks */
        for (int64_t b0 = 0; b0 < nb; b0 += AMX_BLOCK_CHUNK) {  /* a chunk's int32 sums stay in L1 */
            const int64_t b1 = b0 + AMX_BLOCK_CHUNK < nb ? b0 + AMX_BLOCK_CHUNK : nb;
            block_sums(wtype, qa + m0 * K + b0 * QK, K, bt + b0 * 512, b1 - b0, sums);
            for (int64_t h = 0; h < valid; h += 8) { /* 8 rows at a time: their sums stay in registers */
                const __m512 zf = _mm512_setzero_ps();
#define LOAD(r) __m512 c##r = b0 == 0 ? zf : _mm512_load_ps(acc + (h + r) * 16);
                LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) LOAD(6) LOAD(7)
#undef LOAD
                for (int64_t b = b0; b < b1; b++) {
                    const int32_t *sb = sums + (b - b0) * 256 + h * 16;
                    const float *dab = dt + (m0 * nb + b * 16 + h), *sab = st + (m0 * nb + b * 16 + h);
                    const __m512 dw = load_pair_f(dg + b * 8, dg + fs + b * 8);
                    const __m512 mw = wtype == W_S8 ? zf : load_pair_f(mg + b * 8, mg + fs + b * 8);
#define FP(r)                                                                                                      \
                    c##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sb + r * 16)),                     \
                                           _mm512_mul_ps(dw, _mm512_set1_ps(dab[r])), c##r);                       \
                    if (wtype != W_S8) c##r = _mm512_fmadd_ps(mw, _mm512_set1_ps(sab[r]), c##r);
                    FP(0) FP(1) FP(2) FP(3) FP(4) FP(5) FP(6) FP(7)
#undef FP
                }
                float *o = out + (m0 + h) * ld;
#define STORE(r)                                                                                                   \
                if (b1 < nb)                                                                                       \
                    _mm512_store_ps(acc + (h + r) * 16, c##r);                                                     \
                else if (valid - h > r)                                                                            \
                    _mm512_storeu_ps(o + r * ld, c##r);
                STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
            }
        }
    }
}

/* da / sa [rows, nb] -> scales [2][16-row slices][nb][16] (da, then sa): a block's 16 rows' scales side by side;
 * rows past `rows` up to a multiple of 16 get 0. scales: 2 x padded rows x nb floats. */
void q8act_amx_scales(const float *da, const float *sa, int64_t rows, int64_t nb, float *scales) {
    const int64_t padded = (rows + 15) / 16 * 16;
    float *dt = scales, *st = scales + padded * nb;
    memset(dt + rows / 16 * 16 * nb, 0, sizeof(float) * (size_t)((padded - rows / 16 * 16) * nb));
    memset(st + rows / 16 * 16 * nb, 0, sizeof(float) * (size_t)((padded - rows / 16 * 16) * nb));
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < nb; b++) {
            dt[(m & ~15) * nb + b * 16 + (m & 15)] = da[m * nb + b];
            st[(m & ~15) * nb + b * 16 + (m & 15)] = sa[m * nb + b];
        }
}

/* Groups [first, last) of the packed weight (last - first even), all `rows` rows: the caller's thread, tiles
 * configured. Group g's codes at wq + g * gs, its scales / offsets at d / mn + g * fs; the activations' scales
 * as q8act_amx_scales laid them out. */
void q8act_amx_groups(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                      const int8_t *qa, const float *scales, int64_t rows, float *out, int64_t first, int64_t last,
                      uint8_t *bt) {
    const int64_t nb = K / QK, bytes = wtype == W_S8 ? 256 : wtype == W_U5 ? 160 : 128;
    const int64_t gs = nb * bytes, fs = nb * 8;
    const float *dt = scales, *st = scales + (rows + 15) / 16 * 16 * nb;
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_M_SLICE) {  /* a slice's activation codes stay in L2 */
        const int64_t m1 = m0 + AMX_M_SLICE < rows ? m0 + AMX_M_SLICE : rows;
        for (int64_t g = first; g + 1 < last; g += 2)
            pair_rows(wtype, wq + g * gs, gs, d + g * fs, mn == NULL ? NULL : mn + g * fs, fs, qa + m0 * K,
                      dt + m0 * nb, st + m0 * nb, nb, K, out + m0 * N + g * 8, N, m1 - m0, bt,
                      (int32_t *)(bt + nb * 512));
    }
}

#else
int q8act_amx_ready(void) { return 0; }
void q8act_amx_enable(int on) { (void)on; }
void q8act_amx_configure(void) {}
void q8act_amx_release(void) {}
void q8act_amx_scales(const float *da, const float *sa, int64_t rows, int64_t nb, float *scales) {
    (void)da; (void)sa; (void)rows; (void)nb; (void)scales;
}
void q8act_amx_groups(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K,
                      const int8_t *qa, const float *scales, int64_t rows, float *out, int64_t first, int64_t last,
                      uint8_t *bt) {
    (void)wtype; (void)wq; (void)d; (void)mn; (void)N; (void)K; (void)qa; (void)scales; (void)rows; (void)out;
    (void)first; (void)last; (void)bt;
}
#endif
