"""The n-gram proposer: the native kernel against the Python reference, and vLLM's lookup rules."""

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.spec_decode.ngram_proposer import NgramProposer, propose_one


def test_longest_suffix_match_and_earliest_occurrence():
    assert propose_one(list("abcdabc"), 2, 3, 2) == list("da")  # "abc" occurs at 0: the drafts follow it
    # "xbc" then "abc" earlier: the longest match (3, "abc") wins over a later shorter one ("bc")
    assert propose_one(list("abcQxbcRabc"), 2, 3, 1) == ["Q"]
    # two occurrences of the longest match: the earliest
    assert propose_one(list("abXabYab"), 2, 2, 1) == ["X"]
    assert propose_one(list("abXab"), 3, 4, 2) == []  # no match of at least prompt_lookup_min
    assert propose_one(list("aaaa"), 1, 2, 3) == ["a", "a"]  # drafts stop at the end of the context
    assert propose_one(list("a"), 1, 1, 3) == []


@pytest.mark.skipif(not cpu_kernels.native_library_available(), reason="no C compiler")
@pytest.mark.parametrize("vocab", [3, 50, 49152])
def test_native_kernel_matches_the_reference(vocab):
    rng = np.random.default_rng(vocab)
    buf = rng.integers(0, vocab, size=(12, 300)).astype(np.int64)
    buf[5, 100:150] = buf[5, 10:60]  # a copied span
    rows = np.array([3, 5, 0, 11, 7], dtype=np.int64)
    num_tokens = np.array([300, 130, 1, 2, 120], dtype=np.int64)
    for lo, hi, k in [(1, 1, 3), (2, 4, 5), (3, 8, 2)]:
        proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                                                   prompt_lookup_max=hi))
        got = proposer.propose(buf, rows, num_tokens)
        assert got == [propose_one(buf[r, :n].tolist(), lo, hi, k) for r, n in zip(rows, num_tokens, strict=True)]
    if vocab > 3:  # (over 3 symbols an earlier 8-token match exists by chance)
        assert got[1] == buf[5, 40:42].tolist()  # the suffix, tokens 122..129, copies 32..39
