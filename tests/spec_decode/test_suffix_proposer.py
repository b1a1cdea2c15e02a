"""Suffix decoding: the native kernel against the Python reference, hand-made cases of the match and probability
rules, the global tree of past outputs and its memory bound, and the per-step cost."""


import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import cpu_kernels, draft_lookup
from pagedllm.spec_decode.suffix_proposer import SuffixProposer, propose_one
from pagedllm.spec_decode.suffix_tree import SuffixTree


def _tokens(text: str) -> list[int]:
    return [ord(c) for c in text.replace(" ", "")]


def _text(tokens: list[int]) -> str:
    return "".join(chr(t) for t in tokens)


def test_longest_match_most_frequent_continuation_and_probability():
    # "abc" occurred twice, followed by x and y: a tie at 1/2 goes to the smaller id; then only "abcx" is left
    drafts, score = propose_one(_tokens("abcxabcyabc"), 24, 2, 1.0, 0.1)
    assert _text(drafts) == "xa" and score == pytest.approx(0.5 + 0.5)
    # "bc" is followed by z twice and by q once, but the longest match "abc" only by q: the longest match wins
    assert _text(propose_one(_tokens("bczbczabcqabc"), 24, 1, 1.0, 0.1)[0]) == "q"
    # frequency decides among the occurrences of the longest match: 2 of 3 continue with "z"
    drafts, score = propose_one(_tokens("cz cz cq c"), 24, 1, 1.0, 0.1)
    assert _text(drafts) == "z" and score == pytest.approx(2 / 3)
    # min_token_prob: the path probability 1/3 * 1 < 0.5 stops before the first draft
    assert propose_one(_tokens("cx cy cz c"), 24, 3, 1.0, 0.5) == ([], 0.0)
    assert _text(propose_one(_tokens("cx cy cz c"), 24, 3, 1.0, 0.3)[0]) == "x"
    # max_spec_factor: a match of 2 tokens drafts at most 2 x 0.5 = 1 token
    assert _text(propose_one(_tokens("abcdefgab"), 24, 5, 0.5, 0.1)[0]) == "c"
    assert _text(propose_one(_tokens("abcdefgab"), 24, 5, 2.0, 0.1)[0]) == "cdef"
    # tree depth: a depth-4 tree with k = 3 matches at most 1 token and so drafts at most 3
    assert _text(propose_one(_tokens("abcdefgabcdefg"), 4, 3, 8.0, 0.1)[0]) == "abc"
    assert propose_one(_tokens("abcd"), 24, 3, 1.0, 0.1) == ([], 0.0)  # no earlier occurrence of "d"
    assert propose_one(_tokens("a"), 24, 3, 1.0, 0.1) == ([], 0.0)


@pytest.mark.skipif(not cpu_kernels.native_library_available(), reason="no C compiler")
@pytest.mark.parametrize("vocab", [2, 5, 50, 49152])
def test_native_kernel_matches_the_reference(vocab):
    rng = np.random.default_rng(vocab)
    buf = rng.integers(0, vocab, size=(12, 300)).astype(np.int64)
    buf[5, 100:150] = buf[5, 10:60]  # a copied span
    buf[7, 60:120] = buf[7, 0:60]
    rows = np.array([3, 5, 0, 11, 7], dtype=np.int64)
    num_tokens = np.array([300, 130, 1, 2, 130], dtype=np.int64)
    for depth, k, factor, min_prob in [(24, 4, 1.0, 0.1), (6, 3, 0.5, 0.0), (64, 8, 4.0, 0.3), (2, 5, 1.0, 0.1)]:
        drafts, counts, scores, _ = draft_lookup.suffix_propose(buf, rows, num_tokens, depth, k, factor, min_prob)
        for i, (r, n) in enumerate(zip(rows, num_tokens, strict=True)):
            want, want_score = propose_one(buf[r, :n].tolist(), depth, k, factor, min_prob)
            assert drafts[i, :counts[i]].tolist() == want
            assert scores[i] == pytest.approx(want_score)
    if vocab > 5:
        proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
        assert proposer.propose(buf, rows, num_tokens)[1] == buf[5, 40:44].tolist()  # the copy continues


def test_global_tree_drafts_from_past_outputs_and_stays_bounded():
    tree = SuffixTree(max_depth=8, max_sequences=2)
    tree.add(_tokens("{name:ann}"))
    drafts, score = tree.speculate(_tokens("xx{name:"), 4, 1.0, 0.1)
    assert _text(drafts) == "ann}" and score == pytest.approx(4.0)
    tree.add(_tokens("{name:bob}"))
    drafts, score = tree.speculate(_tokens("{na"), 4, 4.0, 0.1)
    assert _text(drafts) == "me:a" and score == pytest.approx(3 + 0.5)  # "a" and "b" tie at 1/2: the smaller id
    outputs = [_tokens("{name:" + name + "}") for name in ["cat", "dan", "eve", "fay", "gus"]]
    for i, output in enumerate(outputs):
        tree.add(output)
        fresh = SuffixTree(max_depth=8, max_sequences=2)  # bounded: the same tree as one of the last two only
        for kept in outputs[max(i - 1, 0):i + 1]:
            fresh.add(kept)
        assert len(tree.sequences) == 2 and (i == 0 or _paths(tree) == _paths(fresh))
        assert tree.num_nodes == _count(tree.root) - 1
    assert tree._walk(_tokens(":a")) is None and tree._walk(_tokens(":g")) is not None  # ann was evicted
    for _ in range(2):
        tree.evict_oldest()
    assert tree.num_nodes == 0 and tree.root[:2] == [0, {}]
    off = SuffixTree(max_depth=8, max_sequences=0)
    off.add(_tokens("abc"))
    assert off.num_nodes == 0


def test_proposer_prefers_the_global_tree_when_it_knows_more():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    proposer = SuffixProposer(config)
    buf = np.zeros((2, 64), dtype=np.int64)
    prompt = _tokens("Q:{name:")
    buf[0, :len(prompt)] = prompt
    rows, n = np.array([0]), np.array([len(prompt)])
    assert _text(proposer.propose(buf, rows, n)[0]) == "{"  # ":" once followed by "{" (a 1-token match: 1 draft)
    proposer.request_finished(_tokens("{name:ann}"))
    assert _text(proposer.propose(buf, rows, n)[0]) == "ann}"


def _count(node) -> int:
    return 1 + sum(_count(c) for c in (node[1] or {}).values())


def _paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every string in the tree with its count, lazy chains spelled out (the same for any insertion history)."""
    out = {}

    def visit(node, path):
        out[path] = node[0]
        if node[1] is None:
            seq, pos = node[2], node[3]
            while len(path) < tree.max_depth and pos < len(seq):
                path = path + (seq[pos],)
                out[path] = 1
                pos += 1
            return
        for token, child in node[1].items():
            visit(child, path + (token,))

    visit(tree.root, ())
    return out


@pytest.mark.skipif(not cpu_kernels.native_library_available(), reason="no C compiler")
def test_proposals_for_64_requests_of_2k_tokens_are_repeatable():
    """64 requests of 1,800 tokens with a global tree: every request gets its drafts, and asking again gives the
    same drafts (proposing does not change the trees). Its cost is benchmarks/spec_proposer_cost.py's to measure."""
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 49152, size=(64, 2048 + 8)).astype(np.int64)
    buf[:, 1500:1900] = buf[:, 100:500]  # copying: a long match, so drafts are made
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    for _ in range(50):
        proposer.request_finished(rng.integers(0, 49152, size=200).tolist())
    rows, num_tokens = np.arange(64), np.full(64, 1800)
    drafts = proposer.propose(buf, rows, num_tokens)
    assert all(len(d) == 4 for d in drafts)
    assert all(list(d) == buf[i, 1800:1804].tolist() for i, d in enumerate(drafts))  # the copied continuation
    assert [list(d) for d in proposer.propose(buf, rows, num_tokens)] == [list(d) for d in drafts]


def test_global_tree_counts_equal_brute_force_under_eviction():
    rng = np.random.default_rng(1)
    tree = SuffixTree(max_depth=5, max_sequences=3)
    outputs = [rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist() for _ in range(12)]
    for i, output in enumerate(outputs):
        tree.add(output)
        want: dict[tuple[int, ...], int] = {(): 0}
        for seq in outputs[max(i - 2, 0):i + 1]:
            for start in range(len(seq)):
                want[()] += 1
                for end in range(start + 1, min(start + 5, len(seq)) + 1):
                    want[tuple(seq[start:end])] = want.get(tuple(seq[start:end]), 0) + 1
        assert _paths(tree) == want
        assert tree.num_nodes == _count(tree.root) - 1
