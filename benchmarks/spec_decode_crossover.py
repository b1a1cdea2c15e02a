"""Where speculative decoding stops paying with batch size: CPU time of a decode step of B requests with no
drafts against the same step with k drafts per request (k + 1 query rows each), alternating step by step at
each B. Speculation pays while the tokens a request gains per verify step (the mean acceptance length L, from
`spec_decode_c1.py` or the sitting) exceed the cost ratio r(B) = verify step / plain step; the crossover is the
first B with r(B) > L, and disable_by_batch_size should be about that B.

    python benchmarks/spec_decode_crossover.py [--batches 1 2 4 8 16 32] [--k 4] [--prompt-len 256] [--steps 6]

CPU time (time.process_time, one torch thread by default) moves far less with other jobs on a shared machine
than wall time; the drafts are forced (copies of the last token), so the costs do not depend on a proposer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode and batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--acceptance-lengths", type=float, nargs="*", default=[1.2, 2.0, 3.0, 3.9],
                        help="mean acceptance lengths to report the crossover for")
    args = parser.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(dtype="float32", max_model_len=2048, seed=0, max_num_seqs=max(args.batches),
              max_num_batched_tokens=8192, kv_cache_memory=256 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                  "verify_cost_per_draft_token": 0})  # no guard: every forced draft is verified
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    rng = random.Random(0)
    ratios = {}
    for b in args.batches:
        params = SamplingParams(max_tokens=4 * args.steps + 8, ignore_eos=True, temperature=0.0)
        ids = [f"b{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
        while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            engine.step()
        cpu = {"plain": [], "verify": []}
        for i in range(2 * args.steps + 2):
            mode = "verify" if i % 2 else "plain"
            for r in scheduler.running:
                r.spec_token_ids = [r.all_token_ids[-1]] * args.k if mode == "verify" else []
            start = time.process_time()
            engine.step()
            if i >= 2:  # the first pair warms up
                cpu[mode].append(time.process_time() - start)
        engine.abort_request(ids)
        engine.step()
        plain, verify = statistics.median(cpu["plain"]), statistics.median(cpu["verify"])
        ratios[b] = verify / plain
        print(json.dumps({"batch": b, "k": args.k, "plain_cpu_ms": round(plain * 1e3, 1),
                          "verify_cpu_ms": round(verify * 1e3, 1), "ratio": round(ratios[b], 2),
                          "load": " ".join(open("/proc/loadavg").read().split()[:3])}), flush=True)
    for length in args.acceptance_lengths:
        crossover = next((b for b in args.batches if ratios[b] > length), None)
        print(f"mean acceptance length {length}: speculation stops paying at batch "
              f"{crossover if crossover is not None else f'> {max(args.batches)}'}")


if __name__ == "__main__":
    main()
