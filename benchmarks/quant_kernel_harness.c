/* Times the quantized kernels without Python: quant_linear_f32 (lossless) or q8act_linear_f32 (int8 activations)
 * on random packed weights of one shape, and writes the output for bitwise comparisons between two builds.
 * (benchmarks/RESULTS.md, "Quantized kernels: faster, same bits", came from it.)
 *
 *   F="-O3 -march=native -ffast-math -fopenmp -fPIC"; K=src/pagedllm/kernels
 *   gcc $F -c $K/quant_linear_cpu.c -o lin.o && gcc $F -c $K/quant_q8act_cpu.c -o q8.o
 *   gcc $F benchmarks/quant_kernel_harness.c lin.o q8.o -o harness -lm
 *   ./harness lin|q8 BITS|KIND GROUP N K M THREADS REPS [OUT]
 *     lin: BITS 4, 8 or 9 (fp8), GROUP 16 or 32; q8: KIND 0 (U4), 1 (U5), 2 (S8), GROUP 32
 *   COLD=48 ./harness ...   cycle the weights through 48 copies (each call reads them from DRAM, as a decode step)
 *
 * Prints the min and median ms per call over REPS timed calls (each repeats the kernel for >= 10 ms): one
 * thread's CPU time when THREADS is 1 (robust on a crowded machine; WALL=1 for wall time), wall time otherwise
 * (CPU=1: the process's CPU time, all threads; with OMP_WAIT_POLICY=passive so that idle threads don't spin).
 * Build two trees' kernels into two harnesses, run them interleaved, and `cmp` their OUT files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <omp.h>
#include <immintrin.h>
void quant_linear_f32(const uint8_t *w, int64_t bits, int64_t group, const float *x, float *y, int64_t M, int64_t N, int64_t K);
int q8act_linear_f32(int wtype, const uint8_t *wq, const float *d, const float *mn, int64_t N, int64_t K, const float *x, int64_t M, float *out);

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static float frnd(void) { return (float)((rnd() >> 11) * (1.0 / 9007199254740992.0)); }
static int use_cpu = 0;
static double now(void) { struct timespec t; clock_gettime(use_cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

int main(int argc, char **argv) {
    if (argc < 9) { fprintf(stderr, "bench lin|q8 bits|wtype group N K M threads reps [out]\n"); return 1; }
    int q8 = !strcmp(argv[1], "q8");
    int64_t bits = atoi(argv[2]), group = atoi(argv[3]), N = atoll(argv[4]), K = atoll(argv[5]), M = atoll(argv[6]);
    int threads = atoi(argv[7]), reps = atoi(argv[8]);
    omp_set_num_threads(threads);
    use_cpu = getenv("WALL") == NULL && (threads == 1 || getenv("CPU") != NULL);
    float *x = aligned_alloc(64, (M * K * 4 + 63) / 64 * 64), *y = aligned_alloc(64, (M * N * 4 + 63) / 64 * 64);
    for (int64_t i = 0; i < M * K; i++) x[i] = frnd() * 2 - 1;
    uint8_t *w; float *d = NULL, *mn = NULL;
    int64_t np = (N + 7) / 8;
    if (!q8) {
        int64_t gb = 64 + group * (bits == 9 ? 8 : bits);
        int64_t bytes = np * (K / group) * gb;
        w = aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (int64_t i = 0; i < bytes; i++) w[i] = rnd();
        for (int64_t g = 0; g < np * (K / group); g++) {
            float *s = (float *)(w + g * gb);
            for (int j = 0; j < 16; j++) s[j] = (float)(_Float16)((frnd() * 2 - 1) * 0.02f);
        }
    } else {
        int64_t nb = K / 32, bytes = np * nb * (bits == 2 ? 256 : bits == 1 ? 160 : 128);
        w = aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (int64_t i = 0; i < bytes; i++) w[i] = rnd();
        if (bits == 2) for (int64_t i = 0; i < bytes; i++) if (w[i] == 0x80) w[i] = 0x81;
        d = malloc(np * nb * 8 * 4); mn = malloc(np * nb * 8 * 4);
        for (int64_t i = 0; i < np * nb * 8; i++) { d[i] = frnd() * 0.02f; mn[i] = -frnd() * 0.1f; }
    }
    int copies = getenv("COLD") ? atoi(getenv("COLD")) : 1;
    uint8_t **ws = malloc(sizeof(uint8_t *) * copies);
    size_t wbytes = !q8 ? (size_t)np * (K / group) * (64 + group * (bits == 9 ? 8 : bits)) : (size_t)np * (K / 32) * (bits == 2 ? 256 : bits == 1 ? 160 : 128);
    ws[0] = w;
    for (int c = 1; c < copies; c++) { ws[c] = aligned_alloc(64, (wbytes + 63) / 64 * 64); memcpy(ws[c], w, wbytes); }
    int cur = 0;
    double *t = malloc(sizeof(double) * reps);
    int inner = 1;
    for (int r = -1; r < reps; r++) {
        double t0 = now();
        for (int i = 0; i < inner; i++) {
            const uint8_t *wc = ws[cur]; cur = (cur + 1) % copies;
            if (q8) q8act_linear_f32((int)bits, wc, d, mn, N, K, x, M, y);
            else quant_linear_f32(wc, bits, group, x, y, M, N, K);
        }
        double dt = (now() - t0) / inner;
        if (r < 0) { inner = (int)(0.01 / dt) + 1; continue; }
        t[r] = dt;
    }
    qsort(t, reps, sizeof(double), cmpd);
    printf("%s b%lld N%lld K%lld M%lld t%d: min %.4f med %.4f ms  (%.1f GFLOP/s at min)\n", argv[1], (long long)bits,
           (long long)N, (long long)K, (long long)M, threads, t[0] * 1e3, t[reps / 2] * 1e3, 2.0 * M * N * K / t[0] * 1e-9);
    if (argc > 9) { FILE *f = fopen(argv[9], "wb"); fwrite(y, 4, M * N, f); fclose(f); }
    return 0;
}
