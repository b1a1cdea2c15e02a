"""Speculative decoding at concurrency 1, in-process: each engine step timed and split by its query rows (1: no
draft verified; k + 1: k drafts), with its phases (forward, LM head, sampler, rejection sampler, proposer,
scheduler). Copy-heavy prompts one at a time, greedy; where a verify step's time goes and how many steps draft.

    python benchmarks/spec_step_rows.py ngram ['{"num_speculative_tokens": 6}']   # or suffix, off

The second argument is merged into the method's speculative_config (k = 4, lookup 2-4 by default).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

from spec_step_parts import CONFIGS  # the same methods and settings as the per-part timing (this script's folder)

from pagedllm import LLM, SamplingParams
from pagedllm.bench.copy_heavy import sample_copy_heavy
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.core import EngineCore
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.worker import model_runner
from pagedllm.worker.model_runner import ModelRunner

PHASES = [(Scheduler, "schedule", "schedule"), (Scheduler, "update_from_output", "update"),
          (ModelRunner, "execute_model", "execute"), (ModelRunner, "_forward", "forward"),
          (LlamaForCausalLM, "compute_logits", "lm_head"), (ModelRunner, "_sample", "sample"),
          (ModelRunner, "_propose", "propose")]
LABELS = ["step", "schedule", "execute", "forward", "lm_head", "sample", "rejection", "propose", "update"]
current: list[dict[str, float] | None] = [None]


def _timed(function, label: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if current[0] is not None:
                current[0][label] += time.perf_counter() - start
    return wrapper


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "ngram"
    config = CONFIGS[method] and {**CONFIGS[method], **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})}
    for cls, name, label in PHASES:
        setattr(cls, name, _timed(getattr(cls, name), label))
    model_runner.rejection_sample = _timed(model_runner.rejection_sample, "rejection")
    steps: list[dict[str, float]] = []
    engine_step, schedule = EngineCore.step, Scheduler.schedule

    def step(self):
        current[0] = collections.defaultdict(float)
        start = time.perf_counter()
        out = engine_step(self)
        current[0]["step"] = time.perf_counter() - start
        steps.append(current[0])
        current[0] = None
        return out

    def counted_schedule(self):
        so = schedule(self)
        if current[0] is not None:
            current[0]["rows"] = sum(so.num_scheduled_tokens.values())
        return so

    EngineCore.step, Scheduler.schedule = step, counted_schedule
    llm = LLM(max_model_len=2048, kv_cache_memory=256 << 20, speculative_config=config)
    requests = sample_copy_heavy(llm.get_tokenizer(), 4, output_len=256, seed=0)
    params = SamplingParams(temperature=0, max_tokens=256)
    llm.generate([requests[0].prompt], params, use_tqdm=False)  # warm-up
    steps.clear()
    start = time.perf_counter()
    outputs = [llm.generate([r.prompt], params, use_tqdm=False)[0] for r in requests[1:]]
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{method} {config}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s, {len(steps)} steps")
    by_rows = collections.defaultdict(list)
    for s in steps:
        if s.get("rows", 0) <= 16:  # decode and verify steps (a prefill step has the prompt's rows)
            by_rows[int(s.get("rows", 0))].append(s)
    for rows in sorted(by_rows):
        group = by_rows[rows]
        print(f"rows={rows} steps={len(group)} median ms: "
              + " ".join(f"{label}={statistics.median(s[label] for s in group) * 1e3:.2f}" for label in LABELS))


if __name__ == "__main__":
    main()
