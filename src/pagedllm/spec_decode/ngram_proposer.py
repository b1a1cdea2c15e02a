"""The n-gram (prompt lookup) proposer: drafts are the tokens that followed the longest earlier occurrence of the
context's suffix, looked up over the request's prompt and output (vLLM's `ngram` method)."""

from __future__ import annotations

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import cpu_kernels, draft_lookup


class NgramProposer:
    """Proposes up to num_speculative_tokens drafts per request from its own tokens; needs no model.

    Args:
        config: prompt_lookup_min, prompt_lookup_max and num_speculative_tokens are read.
    """

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.native = cpu_kernels.native_library_available()

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts for the requests in `rows` of the persistent batch's token buffer.

        Args:
            token_ids: [max_reqs, max_len] int64 (InputBatch.token_ids).
            rows: [R] the rows to propose for; num_tokens: [R] tokens in each.
        Returns:
            R lists of draft token ids (possibly empty).
        """
        if not len(rows):
            return []
        if self.native:
            drafts, counts = draft_lookup.ngram_propose(token_ids, rows, num_tokens, self.min_n, self.max_n, self.k)
            return [d[:c] for d, c in zip(drafts.tolist(), counts.tolist(), strict=True)]
        return [propose_one(token_ids[r, :n].tolist(), self.min_n, self.max_n, self.k)
                for r, n in zip(rows.tolist(), num_tokens.tolist(), strict=True)]


def propose_one(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The reference (and no-compiler fallback) of ngram_cpu.c for one request; see its comment."""
    n = len(tokens)
    best_len = best_end = 0
    for e in range(min_n, n):
        m = 0
        while m < max_n and m < e and tokens[e - 1 - m] == tokens[n - 1 - m]:
            m += 1
        if m > best_len:
            best_len, best_end = m, e
            if m == max_n:
                break
    if best_len < min_n:
        return []
    return tokens[best_end:best_end + k]
