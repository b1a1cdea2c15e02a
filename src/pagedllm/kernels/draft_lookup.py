"""The native draft lookups of speculative decoding (ngram_cpu.c, suffix_cpu.c): batched over the requests' rows
of the persistent batch's token buffer."""

from __future__ import annotations

import numpy as np

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.cpu_kernels import require


def _checked_rows(token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows and num_tokens as C-contiguous int64, checked to lie within token_ids. The bounds are checked on Python
    lists: for a batch's few rows that is ~2 us, where numpy's elementwise compares cost ~18 us per call, most of
    the proposal's cost on a short context."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    num_tokens = np.ascontiguousarray(num_tokens, dtype=np.int64)
    require(token_ids.dtype == np.int64 and token_ids.flags.c_contiguous and token_ids.ndim == 2,
            "token_ids int64, C-contiguous, 2-D")
    row_list, count_list = rows.tolist(), num_tokens.tolist()
    require(rows.shape == num_tokens.shape and rows.ndim == 1
            and (not row_list or (min(row_list) >= 0 and max(row_list) < token_ids.shape[0]
                                  and min(count_list) >= 0 and max(count_list) <= token_ids.shape[1])),
            "rows and num_tokens within token_ids")
    return rows, num_tokens


def ngram_propose(token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, min_n: int, max_n: int,
                  k: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-lookup drafts (ngram_cpu.c) for several requests in one call.

    Args:
        token_ids: [max_reqs, max_len] int64, C-contiguous: each row a request's tokens.
        rows: [R] int64: the rows to propose for.
        num_tokens: [R] int64: tokens in each of those rows.
        min_n, max_n: the n-gram lengths looked up; k: most drafts per request.
    Returns:
        drafts [R, k] int64 and counts [R] int64 (drafts[r, :counts[r]] are request r's).
    """
    rows, num_tokens = _checked_rows(token_ids, rows, num_tokens)
    out = np.zeros(len(rows) * (k + 1), dtype=np.int64)  # drafts, then counts: one buffer, one pointer
    drafts, counts = out[:len(rows) * k].reshape(len(rows), k), out[len(rows) * k:]
    base = out.ctypes.data
    cpu_kernels._library().ngram_propose(token_ids.ctypes.data, token_ids.shape[1], rows.ctypes.data,
                                         num_tokens.ctypes.data, len(rows), min_n, max_n, k, base,
                                         base + drafts.nbytes)
    return drafts, counts

def suffix_propose(token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, max_depth: int, k: int,
                   max_spec_factor: float, min_token_prob: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Suffix-decoding drafts from each request's own tokens (suffix_cpu.c) for several requests in one call.

    Args:
        token_ids, rows, num_tokens: as ngram_propose.
        max_depth, k, max_spec_factor, min_token_prob: the tree depth, most drafts, draft cap per matched token,
            least path probability of a draft.
    Returns:
        drafts [R, k] int64, counts [R] int64, scores [R] float64 (sum of the drafts' probabilities) and match
        lengths [R] int64.
    """
    rows, num_tokens = _checked_rows(token_ids, rows, num_tokens)
    require(k >= 1 and max_depth >= 1, "k and max_depth at least 1")
    r = len(rows)
    # drafts, counts, scores (float64, zero bits are 0.0), match lengths, scratch: one buffer, one pointer
    out = np.zeros(r * (k + 3) + 3 * token_ids.shape[1], dtype=np.int64)
    drafts, counts = out[:r * k].reshape(r, k), out[r * k:r * (k + 1)]
    scores, match_len = out[r * (k + 1):r * (k + 2)].view(np.float64), out[r * (k + 2):r * (k + 3)]
    base, step = out.ctypes.data, out.itemsize
    cpu_kernels._library().suffix_propose(token_ids.ctypes.data, token_ids.shape[1], rows.ctypes.data,
                                          num_tokens.ctypes.data, r, max_depth, k, float(max_spec_factor),
                                          float(min_token_prob), base, base + step * r * k,
                                          base + step * r * (k + 1), base + step * r * (k + 2),
                                          base + step * r * (k + 3))
    return drafts, counts, scores, match_len
