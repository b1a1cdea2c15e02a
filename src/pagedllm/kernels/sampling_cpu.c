/* Categorical draws by inverse CDF: one uniform per row instead of one random number per vocabulary entry (the
 * exponential race drew V exponentials per row: 18 ms for 16 rows of SmolLM2's 49,152 tokens, a quarter of a
 * batch-16 decode step). Each row is one thread's work from start to end: its token depends only on its own
 * weights and uniform, not on the batch or the thread count. */
#include <stdint.h>

#define BLOCK 256

/* Not inlined: both passes of draw_row add a block in the same order (-ffast-math may vectorize each inlined copy
 * differently), so the blocks' sums add up to the very total. */
__attribute__((noinline)) static double block_sum(const float *w, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += w[i];
    return s;
}

/* The first index whose running sum of w exceeds u * sum(w) (u in [0, 1)), so index i is drawn with probability
 * w[i] / sum(w) and a zero weight never. The blocks' sums locate the block (the same sums as the total, so some
 * block is found unless u * total rounds up to the total); the elements are then summed one by one. If rounding
 * leaves the sum short of the target: the last index of positive weight. */
static int64_t draw_row(const float *w, int64_t V, double u) {
    double total = 0.0;
    for (int64_t b = 0; b < V; b += BLOCK) total += block_sum(w + b, V - b < BLOCK ? V - b : BLOCK);
    const double target = u * total;
    double acc = 0.0;
    int64_t i = 0;
    for (; i < V; i += BLOCK) {
        const double s = block_sum(w + i, V - i < BLOCK ? V - i : BLOCK);
        if (acc + s > target) break;
        acc += s;
    }
    for (; i < V; i++) {
        acc += w[i];
        if (acc > target) return i;
    }
    for (i = V - 1; i > 0 && !(w[i] > 0.0f); i--) {}
    return i;
}

/* out[r] = draw_row(w + r * ld, V, u[r]) for r < n. w: [n, V] float32, rows ld floats apart, weights >= 0 and
 * finite; u: [n] float64 in [0, 1). */
void categorical_draw_f32(const float *w, int64_t ld, int64_t n, int64_t V, const double *u, int64_t *out) {
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) out[r] = draw_row(w + r * ld, V, u[r]);
}
