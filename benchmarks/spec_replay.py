"""Replay n-gram speculation over fixed greedy outputs: steps and decode speed-up of a drafting policy, no model run.

Greedy verification is lossless, so which tokens a request produces never depends on the drafts: only how many
steps it takes. This script generates the greedy outputs once (copy-heavy prompts, speculation off), then
replays each policy step by step with the engine's own n-gram lookup (`ngram_proposer.propose_one`) and
low-acceptance guard (`DraftAcceptance`), and prices each step by its query rows with the given step costs
(relative to a one-row step: measure them with `spec_step_rows.py`, which prints the median step per row count).

    python benchmarks/spec_replay.py --num-prompts 8 --output-len 128 --row-costs 1,1.09,1.18,1.25,1.32 \\
        --k 2,3,4 --guard-costs 0.33,0.09,0

Prints, per policy: steps, steps without drafts, and the decode speed-up (output tokens after the first, over
the summed step costs). The first token of each request comes from its prefill and is not counted.
"""

from __future__ import annotations

import argparse

from pagedllm import LLM, SamplingParams
from pagedllm.bench.copy_heavy import sample_copy_heavy
from pagedllm.core.acceptance_guard import DraftAcceptance
from pagedllm.spec_decode.ngram_proposer import propose_one


def replay(items: list[tuple[list[int], list[int]]], k: int, lookup: tuple[int, int], guard_cost: float,
           row_costs: list[float]) -> tuple[int, int, float]:
    """(steps, steps without drafts, summed step cost) to produce every output after its first token."""
    steps = plain = 0
    cost = 0.0
    for prompt, output in items:
        acceptance = DraftAcceptance(k)
        pos = 1
        while pos < len(output):
            proposed = propose_one(prompt + output[:pos], lookup[0], lookup[1], k)
            drafts = proposed[:min(len(output) - pos - 1, acceptance.num_drafts(guard_cost))]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[pos + accepted]:
                accepted += 1
            produced = output[pos:pos + accepted + 1]
            acceptance.observe(proposed, produced)
            steps, plain, cost = steps + 1, plain + (not drafts), cost + row_costs[len(drafts)]
            pos += len(produced)
    return steps, plain, cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--row-costs", default="1,1.09,1.18,1.25,1.32",
                        help="cost of a step with 1, 2, ... query rows, relative to one row")
    parser.add_argument("--k", default="2,3,4", help="num_speculative_tokens to replay (at most rows - 1)")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--guard-costs", default="0.33,0.09,0", help="verify_cost_per_draft_token values")
    args = parser.parse_args()
    row_costs = [float(c) for c in args.row_costs.split(",")]
    lookup = tuple(int(n) for n in args.lookup.split(","))
    llm = LLM(max_num_seqs=args.num_prompts, max_model_len=2048, kv_cache_memory=256 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(s.prompt, add_special_tokens=False)
               for s in sample_copy_heavy(tokenizer, args.num_prompts, args.output_len)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                   ignore_eos=args.ignore_eos), use_tqdm=False)
    items = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs, strict=True)]
    tokens = sum(len(output) - 1 for _, output in items)
    print(f"{len(items)} copy-heavy requests, {tokens} tokens after the first; row costs {row_costs}")
    for k in (int(n) for n in args.k.split(",")):
        if k + 1 > len(row_costs):
            raise SystemExit(f"--row-costs has no cost for {k + 1} rows")
        for guard_cost in (float(c) for c in args.guard_costs.split(",")):
            steps, plain, cost = replay(items, k, lookup, guard_cost, row_costs)
            print(f"k={k} lookup {lookup[0]}-{lookup[1]} guard cost {guard_cost}: {steps} steps, {plain} without "
                  f"drafts, decode speed-up {tokens / cost:.2f}x")


if __name__ == "__main__":
    main()
