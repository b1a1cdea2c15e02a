"""Speculation's CPU-side parts inside a real in-process engine, per decode step: thread CPU time spent in the
runner's proposal (the proposer's lookup within it), the global suffix tree's lookups and insertions, the guard,
and the scheduler, next to the whole run's process CPU time; speculation off, n-gram and suffix, one process,
alternating. Random 256-token prompts, greedy, `ignore_eos`; one torch thread so process time is the step's.

    python benchmarks/spec_step_parts.py --concurrency 1 --num-prompts 2 --output-len 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import random_token_prompts
from pagedllm.core.acceptance_guard import DraftAcceptance
from pagedllm.core.scheduler import Scheduler
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.spec_decode.suffix_tree import SuffixTree
from pagedllm.worker.model_runner import ModelRunner

CONFIGS = {"off": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
           "suffix": {"method": "suffix", "num_speculative_tokens": 4}}
PARTS = [(ModelRunner, "_propose", "runner._propose"), (NgramProposer, "propose", "proposer.propose"),
         (SuffixProposer, "propose", "proposer.propose"), (SuffixTree, "speculate", "suffix_tree.speculate"),
         (SuffixTree, "add", "suffix_tree.add"), (DraftAcceptance, "observe", "guard.observe"),
         (DraftAcceptance, "num_drafts", "guard.num_drafts"), (Scheduler, "schedule", "scheduler.schedule"),
         (Scheduler, "update_from_output", "scheduler.update_from_output")]
spent: dict[str, float] = {}
calls: dict[str, int] = {}


def _timed(cls: type, name: str, key: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.thread_time() - start
            calls[key] = calls.get(key, 0) + 1

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", default="off,ngram,suffix")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for cls, name, key in PARTS:
        _timed(cls, name, key)
    engine = dict(max_num_seqs=args.concurrency, max_model_len=2048, kv_cache_memory=256 << 20)
    llms = {m: LLM(speculative_config=CONFIGS[m], **engine) for m in args.methods.split(",")}
    vocab = len(next(iter(llms.values())).get_tokenizer())
    prompts = random_token_prompts(random.Random(0), args.num_prompts, 256, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    outputs = {}
    for round_ in range(args.rounds):
        for method, llm in llms.items():
            spent.clear()
            calls.clear()
            start = time.process_time()
            results = llm.generate(prompts, params, use_tqdm=False)
            cpu = time.process_time() - start
            outputs[method] = [r.outputs[0].token_ids for r in results]
            steps = calls["scheduler.schedule"]  # engine steps, prefill chunks included
            totals = llm.llm_engine.engine_core.scheduler.spec_decoding_totals
            print(json.dumps({"round": round_, "method": method, "cpu_s": round(cpu, 2), "steps": steps,
                              "output_tokens": sum(map(len, outputs[method])),
                              "cpu_ms_per_step": round(cpu / steps * 1e3, 2),
                              "verified_drafts": totals.num_drafts if totals else None,
                              "us_per_step": {k: round(v / steps * 1e6, 1) for k, v in sorted(spent.items())}}),
                  flush=True)
    first = next(iter(outputs.values()))
    print(json.dumps({"identical_greedy_output": {m: o == first for m, o in outputs.items()}}))


if __name__ == "__main__":
    main()
