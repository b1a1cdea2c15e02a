"""Per-step CPU cost of speculation's CPU-side parts when nothing matches (random tokens), no model: the n-gram and
suffix proposals (native lookup + wrapper; suffix also with a global tree of past outputs), the global tree's
insertion of a finished output, and the low-acceptance guard's per-request bookkeeping. One thread, thread_time,
best of 5 repeats (the machine is shared).

    python benchmarks/spec_proposer_cost.py [--past-outputs 64]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.core.acceptance_guard import DraftAcceptance
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer

VOCAB = 49152  # SmolLM2's


def per_call_us(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        fn()
        start = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - start) / reps * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--past-outputs", type=int, default=64, help="128-token outputs in the suffix global tree")
    args = parser.parse_args()
    rng = random.Random(0)
    ngram = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                            prompt_lookup_max=4))
    suffix = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    suffix_global = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    outputs = [[rng.randrange(VOCAB) for _ in range(128)] for _ in range(args.past_outputs)]
    start = time.thread_time()
    for output in outputs:
        suffix_global.request_finished(output)
    add_us = (time.thread_time() - start) / max(len(outputs), 1) * 1e6
    print(f"global tree: {add_us:.0f} us to add a 128-token output ({add_us / 128:.1f} us per output token), "
          f"{suffix_global.global_tree.num_nodes} nodes")
    for batch in (1, 16):
        for context in (256, 512, 1000):
            buf = np.zeros((16, 2048), dtype=np.int64)  # the persistent batch's token buffer
            buf[:, :context] = np.array([[rng.randrange(VOCAB) for _ in range(context)] for _ in range(16)])
            rows, num_tokens = np.arange(batch, dtype=np.int64), np.full(batch, context, dtype=np.int64)
            cost = {name: per_call_us(lambda p=p, b=buf, r=rows, n=num_tokens: p.propose(b, r, n), 2000 // batch)
                    for name, p in (("ngram", ngram), ("suffix", suffix), ("suffix+global", suffix_global))}
            print(f"batch {batch:2d} context {context:4d}: " + ", ".join(f"{k} {v:.1f} us" for k, v in cost.items()),
                  flush=True)
    guard = DraftAcceptance(4)

    def guard_step() -> None:
        guard.observe([1, 2, 3, 4], [5])
        guard.num_drafts(0.33)

    print(f"guard (observe + num_drafts): {per_call_us(guard_step, 20000):.2f} us per request per step")


if __name__ == "__main__":
    main()
