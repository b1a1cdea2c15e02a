/* Suffix decoding over a request's own tokens (prompt + output): the per-request half of vLLM's `suffix` method.
 *
 * Equivalent to walking a suffix tree of depth max_depth built over the request's tokens, without building one:
 * the tree's node for the context's last m tokens has one count per earlier occurrence of those m tokens, and its
 * children are the tokens that followed them. So, for each request r (tokens t, n of them):
 *   1. L(e) for every e in [1, n - 1]: how many tokens before e match the context's last tokens (at most
 *      max_depth - 1, i.e. the occurrence t[e - L .. e - 1] equals t[n - L .. n - 1] and t[e] follows it).
 *   2. The match length m = min(max L, max_depth - k) (at least 1): the longest match that still leaves the tree
 *      room for k drafts below it. S = the e with L(e) >= m. No match (max L = 0): no drafts.
 *   3. Drafts, at most min(k, floor(max_spec_factor * m), max_depth - m): draft j is the most frequent t[e + j]
 *      over S (ties: the smallest token id); its probability p_j = p_{j-1} * (its count / |S|) (the tree's
 *      child count over node count; an occurrence that runs into the context's end counts in |S| only). Stop
 *      before a token with p_j < min_token_prob; S keeps the occurrences that agree with the drafts.
 * out[r * k ...] gets the drafts, num_drafts[r] their count, score[r] the sum of their p_j (how the runner
 * chooses between this and the global tree of past outputs), match_len[r] = m.
 * Example, max_depth 24, k 2, factor 1, min prob 0.1, over "a b c x a b c y a b c": L = 3 at e = 3 and 7,
 * m = 3, S = {3, 7}: "x" and "y" tie at 1/2 -> "x" (smaller id), p = 0.5; then S = {3}: t[4] = "a", p = 0.5.
 *
 * Cost: one pass over the context per request (as ngram_cpu.c) plus a sort of |S| tokens per draft.
 */
#include <stdint.h>
#include <stdlib.h>

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

void suffix_propose(const int64_t *token_ids, int64_t row_stride, const int64_t *rows, const int64_t *num_tokens,
                    int64_t num_reqs, int64_t max_depth, int64_t k, double max_spec_factor, double min_token_prob,
                    int64_t *out, int64_t *num_drafts, double *score, int64_t *match_len, int64_t *scratch)
{
    /* scratch: 3 * row_stride int64 (match lengths, the set S, the tokens being counted) */
    int64_t *len_at = scratch, *set = scratch + row_stride, *cand = scratch + 2 * row_stride;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t *t = token_ids + rows[r] * row_stride;
        const int64_t n = num_tokens[r];
        num_drafts[r] = 0;
        score[r] = 0.0;
        match_len[r] = 0;
        if (n < 2 || max_depth < 2) continue;
        const int64_t last = t[n - 1], cap = max_depth - 1;
        int64_t best = 0;
        for (int64_t e = 1; e <= n - 1; e++) {
            int64_t m = 0;
            if (t[e - 1] == last) {
                m = 1;
                while (m < cap && m < e && t[e - 1 - m] == t[n - 1 - m]) m++;
            }
            len_at[e] = m;
            if (m > best) best = m;
        }
        if (best == 0) continue;
        int64_t m = best < max_depth - k ? best : max_depth - k;
        if (m < 1) m = 1;
        int64_t limit = (int64_t)(max_spec_factor * (double)m);
        if (limit > k) limit = k;
        if (limit > max_depth - m) limit = max_depth - m;
        int64_t size = 0;
        for (int64_t e = 1; e <= n - 1; e++)
            if (len_at[e] >= m) set[size++] = e;
        double p = 1.0, total = 0.0;
        int64_t j = 0;
        for (; j < limit; j++) {
            int64_t nc = 0;
            for (int64_t i = 0; i < size; i++)
                if (set[i] + j < n) cand[nc++] = t[set[i] + j];
            if (nc == 0) break;
            qsort(cand, (size_t)nc, sizeof(int64_t), cmp_i64);
            int64_t tok = cand[0], count = 0;
            for (int64_t i = 0, run = 0; i < nc; i++) {
                run = (i > 0 && cand[i] == cand[i - 1]) ? run + 1 : 1;
                if (run > count) { count = run; tok = cand[i]; }
            }
            p *= (double)count / (double)size;
            if (p < min_token_prob) break;
            out[r * k + j] = tok;
            total += p;
            int64_t kept = 0;
            for (int64_t i = 0; i < size; i++)
                if (set[i] + j < n && t[set[i] + j] == tok) set[kept++] = set[i];
            size = kept;
        }
        num_drafts[r] = j;
        score[r] = total;
        match_len[r] = m;
    }
}
