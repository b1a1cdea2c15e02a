"""How far an engine option set drifts from the default engine on the real model: for modes that are not lossless
(8-bit activations, fp8 weights, fp8 KV cache...).

    python benchmarks/drift.py --engine-args '{"activation_quantization": "int8"}'
        [--baseline-args '{}'] [--model PATH] [--text benchmarks/data/coriolanus_act1.txt] [--window 512]

Both engines run float32 with the same model, one after the other in this process. Three measures:
- greedy: the 32 greedy tokens (EOS masked, as the fixture was made) for each prompt of
  tests/fixtures/smollm2_greedy_fp32.json: the length of the prefix each engine shares with the fixture, and
  the candidate with the baseline;
- dlogprob: teacher-forced on each fixture prompt + its reference continuation (prompt logprobs), the mean
  |candidate - baseline| log-probability of the reference tokens, in nats per token (and the max);
- perplexity: exp(mean negative log-likelihood) of a fixed text, in non-overlapping windows of `window`
  tokens (each window's first token is context only), for each engine, and the relative difference.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_greedy_fp32.json"
TEXT = ROOT / "benchmarks" / "data" / "coriolanus_act1.txt"
COMMON = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory": 256 << 20, "seed": 0}


def _prompt_token_logprobs(output) -> list[float]:
    """Log-probability of each prompt token given the ones before it (the first position has none)."""
    ids = output.prompt_token_ids
    return [entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:], strict=True)]


def measure(model: str | None, engine_args: dict, text_ids_fn, window: int) -> dict:
    """Greedy tokens, teacher-forced reference logprobs and per-window NLLs of one engine."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **{**COMMON, **engine_args})
    try:
        cases = json.loads(FIXTURE.read_text())["cases"]
        prompts = [c["prompt_ids"] for c in cases]
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32), use_tqdm=False)
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        forced = llm.generate([c["prompt_ids"] + c["output_ids_ignore_eos"] for c in cases], scoring, use_tqdm=False)
        reference_logprobs = [_prompt_token_logprobs(o)[len(c["prompt_ids"]) - 1:]
                              for o, c in zip(forced, cases, strict=True)]
        ids = text_ids_fn(llm.get_tokenizer())
        windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
        text_logprobs = [lp for o in llm.generate(windows, scoring, use_tqdm=False) for lp in _prompt_token_logprobs(o)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"greedy": [list(o.outputs[0].token_ids) for o in greedy], "reference_logprobs": reference_logprobs,
            "text_logprobs": text_logprobs}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(base: dict, cand: dict) -> dict:
    cases = json.loads(FIXTURE.read_text())["cases"]
    fixture = [c["output_ids_ignore_eos"] for c in cases]
    deltas = [abs(x - y) for bs, cs in zip(base["reference_logprobs"], cand["reference_logprobs"], strict=True)
              for x, y in zip(bs, cs, strict=True)]
    ppl = {name: math.exp(-sum(r["text_logprobs"]) / len(r["text_logprobs"])) for name, r in
           (("baseline", base), ("candidate", cand))}
    return {
        "greedy_prefix": {
            "tokens_per_prompt": len(fixture[0]),
            "baseline_vs_fixture": [_common_prefix(b, f) for b, f in zip(base["greedy"], fixture, strict=True)],
            "candidate_vs_fixture": [_common_prefix(c, f) for c, f in zip(cand["greedy"], fixture, strict=True)],
            "candidate_vs_baseline": [_common_prefix(c, b) for c, b in zip(cand["greedy"], base["greedy"],
                                                                          strict=True)],
        },
        "dlogprob_nats": {"mean_abs": sum(deltas) / len(deltas), "max_abs": max(deltas), "tokens": len(deltas)},
        "perplexity": {**ppl, "relative_diff": ppl["candidate"] / ppl["baseline"] - 1,
                       "tokens": len(base["text_logprobs"])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-args", required=True, help="JSON object: the candidate's engine arguments")
    parser.add_argument("--baseline-args", default="{}", help="JSON object: the baseline's (default: none)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    text = Path(args.text).read_text()

    def text_ids(tokenizer) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    baseline_args, candidate_args = json.loads(args.baseline_args), json.loads(args.engine_args)
    base = measure(args.model, baseline_args, text_ids, args.window)
    cand = measure(args.model, candidate_args, text_ids, args.window)
    print(json.dumps({"baseline_args": baseline_args, "candidate_args": candidate_args, **compare(base, cand)},
                     indent=1))


if __name__ == "__main__":
    main()
