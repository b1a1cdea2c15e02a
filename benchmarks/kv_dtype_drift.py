"""How far a bf16 / fp8 KV cache moves SmolLM2-135M from the fp32-KV model (fp32 weights and activations).

    .venv/bin/python benchmarks/kv_dtype_drift.py [--long-tokens 256]

For each --kv-cache-dtype (float32 = auto, bfloat16, fp8_e4m3, fp8_e5m2; the fp8 ones with their default
--calculate-kv-scales, "+calibrated": per-layer scales and error-feedback rounding of K; "scale 1":
--no-calculate-kv-scales; "+scales only": the scales without the K rounding), on the prompts of
tests/fixtures/smollm2_greedy_fp32.json:
- greedy prefix match: how many of the 32 greedy tokens (EOS masked, as the fixture's `output_ids_ignore_eos`)
  agree with the fixture before the first difference (decode path: the native kernel over the quantized pool);
- teacher-forced drift: prompt + the fixture's continuation are fed as one prompt (`prompt_logprobs`), and the
  logprob of each continuation token is compared with the fp32-KV run: mean and max |delta logprob| in nats
  per token (prefill path: every chunk reads its context back from the quantized pool);
- the same drift over a longer context: the fp32 model's own greedy continuation of the first prompt,
  --long-tokens tokens, fed back teacher-forced.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.worker import kv_scales

FIXTURE = Path(__file__).parent.parent / "tests" / "fixtures" / "smollm2_greedy_fp32.json"
SCALE_ONE = {"calculate_kv_scales": False}
KV_DTYPES = {"auto": {}, "bfloat16": {}, "fp8_e4m3 scale 1": SCALE_ONE, "fp8_e4m3+scales only": {},
             "fp8_e4m3+calibrated": {}, "fp8_e5m2 scale 1": SCALE_ONE, "fp8_e5m2+calibrated": {}}


def _prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _teacher_forced(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[np.ndarray]:
    """Logprob of each continuation token given everything before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([p + c for p, c in zip(prompts, continuations, strict=True)], params, use_tqdm=False)
    result = []
    for out, prompt, cont in zip(outs, prompts, continuations, strict=True):
        entries = out.prompt_logprobs[len(prompt):]
        result.append(np.array([entry[tok].logprob for entry, tok in zip(entries, cont, strict=True)]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-tokens", type=int, default=256)
    args = parser.parse_args()
    cases = json.loads(FIXTURE.read_text())["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    references = [c["output_ids_ignore_eos"] for c in cases]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    long_greedy = SamplingParams(temperature=0.0, max_tokens=args.long_tokens, ignore_eos=True)
    base_short = base_long = long_cont = None
    print(f"{'kv dtype':20s} {'blocks':>7s} {'greedy prefix match':>22s} {'mean |dlogp|':>13s} {'max |dlogp|':>12s} "
          f"{'mean |dlogp| long':>18s} {'max long':>9s}")
    plain_rounding = kv_scales.error_feedback_weights
    for name, options in KV_DTYPES.items():
        # "scales only": the calibration's K rounding weights replaced by None (plain round to nearest)
        kv_scales.error_feedback_weights = (lambda h: None) if name.endswith("scales only") else plain_rounding
        kv_cache_dtype = name.split("+")[0].split()[0]
        llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20, kv_cache_dtype=kv_cache_dtype,
                  **options)
        blocks = llm.llm_engine.engine_core.num_blocks
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        matches = [_prefix_match(o.outputs[0].token_ids, ref) for o, ref in zip(outs, references, strict=True)]
        if long_cont is None:  # the fp32-KV model's own continuation
            long_cont = list(llm.generate([prompts[0]], long_greedy, use_tqdm=False)[0].outputs[0].token_ids)
        short = np.concatenate(_teacher_forced(llm, prompts, references))
        long = _teacher_forced(llm, [prompts[0]], [long_cont])[0]
        if base_short is None:
            base_short, base_long = short, long
        d_short, d_long = np.abs(short - base_short), np.abs(long - base_long)
        print(f"{name:20s} {blocks:7d} {str(matches) + ' / 32':>22s} {d_short.mean():13.4f} {d_short.max():12.4f} "
              f"{d_long.mean():18.4f} {d_long.max():9.4f}", flush=True)
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
