"""Speculative decoding at concurrency 1: output tokens/s with and without n-gram drafts on the same prompts, in one
process, alternating (off, on, off, on, ...) so that a busy machine hurts both alike; with the acceptance figures.

    python benchmarks/spec_decode_c1.py --dataset-name copy-heavy --num-prompts 8 --output-len 128 --rounds 2

`--dataset-name json-schema`: chat requests held to one JSON schema (structured outputs: an array of at least 40
{name, age, city} objects, `structured_outputs_throughput.py`'s), whose keys repeat in every output: the drafts
are checked against the grammar and the verify rows masked by it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from structured_outputs_throughput import SCHEMA

from pagedllm import LLM, SamplingParams
from pagedllm.bench.copy_heavy import sample_copy_heavy
from pagedllm.bench.throughput import random_token_prompts
from pagedllm.sampling_params import StructuredOutputsParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset-name", default="copy-heavy", choices=("copy-heavy", "random", "json-schema"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare-guard", action="store_true",
                        help='also run the config with "verify_cost_per_draft_token": 0 (no low-acceptance guard, '
                             'every request always drafts num_speculative_tokens), as "on-noguard"')
    args = parser.parse_args()
    engine = dict(max_num_seqs=1, max_model_len=2048, kv_cache_memory=128 << 20)
    llms = {"off": LLM(**engine), "on": LLM(speculative_config=args.speculative_config, **engine)}
    if args.compare_guard:
        noguard = dict(json.loads(args.speculative_config), verify_cost_per_draft_token=0)
        llms["on-noguard"] = LLM(speculative_config=noguard, **engine)
    tokenizer = llms["off"].get_tokenizer()
    if args.dataset_name == "copy-heavy":
        prompts = [tokenizer.encode(s.prompt, add_special_tokens=False)
                   for s in sample_copy_heavy(tokenizer, args.num_prompts, args.output_len)]
    elif args.dataset_name == "json-schema":
        chats = [[{"role": "user", "content": f"List {40 + i} people as JSON."}] for i in range(args.num_prompts)]
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False) for c in chats]
    else:
        prompts = random_token_prompts(random.Random(0), args.num_prompts, 256, len(tokenizer))
    structured = StructuredOutputsParams(json=SCHEMA) if args.dataset_name == "json-schema" else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=args.ignore_eos,
                            structured_outputs=structured)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=structured),
                     use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    cpu_rates: dict[str, list[float]] = {name: [] for name in llms}  # steadier than wall time on a busy machine
    outputs = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(num_tokens / elapsed)
            cpu_rates[name].append(num_tokens / cpu)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            print(f"{name}: {rates[name][-1]:.2f} output tok/s, {cpu_rates[name][-1]:.2f} per CPU second", flush=True)
    result = {
        "dataset": args.dataset_name, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "speculative_config": json.loads(args.speculative_config),
        "output_tok_s_off": rates["off"], "output_tok_s_on": rates["on"],
        "speedup_median": statistics.median(rates["on"]) / statistics.median(rates["off"]),
        "cpu_speedup_median": {name: statistics.median(r) / statistics.median(cpu_rates["off"])
                               for name, r in cpu_rates.items() if name != "off"},
        "identical_greedy_output": outputs["on"] == outputs["off"],
        **_acceptance(llms["on"]),
    }
    if args.compare_guard:
        off = statistics.median(rates["off"])
        result.update({"output_tok_s_on_noguard": rates["on-noguard"],
                       "speedup_median_noguard": statistics.median(rates["on-noguard"]) / off,
                       "identical_greedy_output_noguard": outputs["on-noguard"] == outputs["off"],
                       "noguard": _acceptance(llms["on-noguard"])})
    print(json.dumps(result, indent=2))


def _acceptance(llm: LLM) -> dict:
    totals = llm.llm_engine.engine_core.scheduler.spec_decoding_totals
    return {"num_drafts": totals.num_drafts, "num_draft_tokens": totals.num_draft_tokens,
            "acceptance_rate": totals.num_accepted_tokens / max(totals.num_draft_tokens, 1),
            "mean_acceptance_length": 1 + totals.num_accepted_tokens / max(totals.num_drafts, 1),
            "accepted_per_position": [n / max(totals.num_drafts, 1) for n in totals.num_accepted_tokens_per_pos]}


if __name__ == "__main__":
    main()
