"""The suffix decoding proposer (vLLM's `suffix` method, after arctic-inference's SuffixDecoding): drafts from the
longest match of the context's suffix in the request's own tokens (prompt + output; native, suffix_cpu.c) and in
a global tree of the outputs of past requests (suffix_tree.py); the draft with the higher summed probability
wins (the request's own on a tie)."""

from __future__ import annotations

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import cpu_kernels, draft_lookup
from pagedllm.spec_decode.suffix_tree import SuffixTree


class SuffixProposer:
    """Proposes up to num_speculative_tokens drafts per request; needs no model.

    Args:
        config: num_speculative_tokens and the suffix_decoding_* keys are read.
    """

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.global_tree = SuffixTree(self.max_depth, config.suffix_decoding_max_cached_requests)
        self.native = cpu_kernels.native_library_available()

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts for the requests in `rows` of the persistent batch's token buffer (see NgramProposer.propose)."""
        if not len(rows):
            return []
        if self.native:
            drafts, counts, scores, _ = draft_lookup.suffix_propose(token_ids, rows, num_tokens, self.max_depth, self.k,
                                                                   self.max_spec_factor, self.min_token_prob)
            local = [(d[:c], s) for d, c, s in zip(drafts.tolist(), counts.tolist(), scores.tolist(), strict=True)]
        else:
            local = [propose_one(token_ids[r, :n].tolist(), self.max_depth, self.k, self.max_spec_factor,
                                 self.min_token_prob) for r, n in zip(rows.tolist(), num_tokens.tolist(), strict=True)]
        if not self.global_tree.sequences:
            return [d for d, _ in local]
        result = []
        context_len, tree = self.max_depth, self.global_tree
        for (drafts, score), r, n in zip(local, rows.tolist(), num_tokens.tolist(), strict=True):
            # k drafts of probability 1: the global tree cannot do better; a last token the tree does not hold: it
            # matches nothing (checked before the context is copied)
            if score >= self.k or n == 0 or not tree.holds(int(token_ids[r, n - 1])):
                result.append(drafts)
                continue
            context = token_ids[r, max(n - context_len, 0):n].tolist()
            other, other_score = self.global_tree.speculate(context, self.k, self.max_spec_factor,
                                                            self.min_token_prob)
            result.append(other if other_score > score else drafts)
        return result

    def request_finished(self, output_token_ids: list[int]) -> None:
        """A request left the batch for good (finished or aborted): its output joins the global tree."""
        self.global_tree.add(output_token_ids)


def propose_one(tokens: list[int], max_depth: int, k: int, max_spec_factor: float, min_token_prob: float
                ) -> tuple[list[int], float]:
    """The reference (and no-compiler fallback) of suffix_cpu.c for one request; see its comment.
    Returns the drafts and their summed probabilities."""
    n = len(tokens)
    if n < 2 or max_depth < 2:
        return [], 0.0
    cap = max_depth - 1
    lengths = [0] * n
    for e in range(1, n):
        m = 0
        while m < cap and m < e and tokens[e - 1 - m] == tokens[n - 1 - m]:
            m += 1
        lengths[e] = m
    best = max(lengths)
    if best == 0:
        return [], 0.0
    m = max(min(best, max_depth - k), 1)
    limit = min(k, int(max_spec_factor * m), max_depth - m)
    occurrences = [e for e in range(1, n) if lengths[e] >= m]
    drafts: list[int] = []
    p, total = 1.0, 0.0
    for j in range(limit):
        counts: dict[int, int] = {}
        for e in occurrences:
            if e + j < n:
                counts[tokens[e + j]] = counts.get(tokens[e + j], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
        p *= count / len(occurrences)
        if p < min_token_prob:
            break
        drafts.append(token)
        total += p
        occurrences = [e for e in occurrences if e + j < n and tokens[e + j] == token]
    return drafts, total
