"""The proposers' drafts over a fixed token stream, pinned: a change made for speed (the native wrappers, the global
tree's lookups, the runner's bookkeeping) must leave every proposal the same token for token, since the low-
acceptance guard observes the unverified proposals and would otherwise change what is verified."""

import hashlib
import json

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer

# sha256 of the proposals below, recorded before the speed-ups of branch `propcost`.
EXPECTED = {
    "ngram": "90dff22d620f5c28e96f457761a90fdbe88c8c89aaf1be33a1ce24fb73051f57",
    "suffix": "e5be9a318d1402e18e8d387c7edb8c27f6041c5381175148ac529e928c4bdfa0",
}


def _stream_proposals(proposer, native: bool) -> list:
    """Six requests decode 160 steps each from 40-300-token prompts (vocabularies 5 to 49,152: repetitive to random,
    one copying a span of its prompt); every step proposes for all rows, a request that reaches 120 outputs
    finishes (joining the suffix proposer's global tree) and a new one takes its row."""
    rng = np.random.default_rng(15)
    proposer.native = native
    buf = np.zeros((8, 1024), dtype=np.int64)
    num_tokens = np.zeros(8, dtype=np.int64)
    num_prompt = np.zeros(8, dtype=np.int64)
    vocabs = [5, 40, 49152, 300, 49152, 12]

    def start(row: int) -> None:
        n = int(rng.integers(40, 300))
        buf[row, :n] = rng.integers(0, vocabs[row], size=n)
        if row == 4:
            buf[row, n - 30:n] = buf[row, 5:35]  # the prompt ends copying its start
        num_tokens[row] = num_prompt[row] = n

    for row in range(6):
        start(row)
    rows = np.array([4, 0, 2, 5, 1, 3], dtype=np.int64)
    out = []
    for step in range(160):
        drafts = proposer.propose(buf, rows, num_tokens[rows])
        out.append(drafts)
        for row, d in zip(rows.tolist(), drafts, strict=True):
            n = int(num_tokens[row])
            # the "model": the first draft half the time (copies go on), else a token of the row's vocabulary
            token = d[0] if d and rng.random() < 0.5 else int(rng.integers(0, vocabs[row]))
            buf[row, n] = token
            num_tokens[row] = n + 1
            if n + 1 - num_prompt[row] >= 120:
                if isinstance(proposer, SuffixProposer):
                    proposer.request_finished(buf[row, num_prompt[row]:n + 1].tolist())
                start(row)
        if step % 50 == 49:
            rows = rows[1:]  # the batch shrinks: fewer rows, other order
    return out


def _digest(proposals: list) -> str:
    return hashlib.sha256(json.dumps(proposals).encode()).hexdigest()


def _make(method: str):
    if method == "ngram":
        return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                               prompt_lookup_max=4))
    return SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                                            suffix_decoding_max_cached_requests=4))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_proposals_on_a_fixed_stream_are_unchanged(method):
    proposals = _stream_proposals(_make(method), native=False)
    assert sum(map(len, (d for step in proposals for d in step))) > 200  # the stream does draft
    assert _digest(proposals) == EXPECTED[method]
    if cpu_kernels.native_library_available():
        assert _stream_proposals(_make(method), native=True) == proposals
