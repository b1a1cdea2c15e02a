"""Time of one n-gram proposal step: 64 requests with 2k-token contexts (issue 15 asks for at most 0.2 ms).

    python benchmarks/ngram_proposer.py
"""

from __future__ import annotations

import time

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer


def main() -> None:
    rows = np.arange(64)
    num_tokens = np.full(64, 2048)
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                               prompt_lookup_max=5))
    rng = np.random.default_rng(0)
    for vocab, what in ((49152, "random ids over the vocabulary"), (20, "ids over 20 symbols (many partial matches)")):
        token_ids = rng.integers(0, vocab, size=(64, 2100)).astype(np.int64)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            proposer.propose(token_ids, rows, num_tokens)
            times.append(time.perf_counter() - start)
        print(f"{what}: median {np.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms per step "
              f"(native: {proposer.native})")


if __name__ == "__main__":
    main()
