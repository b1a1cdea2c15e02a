"""Multi-LoRA offline throughput: one engine with LoRA enabled, the same prompts run with no adapter and spread
round-robin over 4 adapters (PEFT, random weights, r 8 and 16 on q/k/v/o), interleaved in one sitting.

    python benchmarks/lora_throughput.py setup /tmp/lora-bench          # SmolLM2-shaped model + 4 adapters (peft)
    python benchmarks/lora_throughput.py run /tmp/lora-bench --engine pagedllm [--runs 3 --n 32 --in 128 --out 64]
    /tmp/pagedllm-peers/venv/bin/python benchmarks/lora_throughput.py run /tmp/lora-bench --engine vllm

`setup` needs transformers and peft (the project's venv); `run --engine vllm` runs in vLLM's venv
(../shared/bench/peers.sh setup) and imports nothing of pagedllm. Prints one JSON line per run and variant
(output tokens/s over N prompts of IN random token ids, OUT greedy tokens each, ignore_eos), then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ADAPTERS = {"a0": 8, "a1": 16, "a2": 8, "a3": 16}  # name -> rank


def setup(root: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = root / "model"
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "shaped_model.py"), "smollm2-135m",
                        str(model_dir)], check=True)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        peft_model.save_pretrained(root / name)
    print(f"model and adapters {', '.join(ADAPTERS)} in {root}")


def run(root: Path, engine: str, runs: int, n: int, n_in: int, n_out: int, max_num_seqs: int) -> None:
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    else:
        from pagedllm import LLM, SamplingParams
        from pagedllm.lora.request import LoRARequest
    llm = LLM(str(root / "model"), dtype=os.environ.get("DTYPE", "bfloat16"), max_model_len=1024, seed=0,
              enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=max_num_seqs,
              **({"kv_cache_memory": 1 << 30} if engine == "pagedllm" else {}))  # vLLM: VLLM_CPU_KVCACHE_SPACE
    loras = [LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)]
    rng = random.Random(0)

    def prompts(count: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n_in)]} for _ in range(count)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate(prompts(4), warm, use_tqdm=False, lora_request=loras)  # loads every adapter
    params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
    results: dict[str, list[float]] = {"base": [], "lora4": []}
    for r in range(runs):
        for variant in (("base", "lora4") if r % 2 == 0 else ("lora4", "base")):
            batch = prompts(n)
            lora_request = None if variant == "base" else [loras[i % len(loras)] for i in range(n)]
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)
            seconds = time.perf_counter() - start
            tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
            results[variant].append(tok_s)
            print(json.dumps({"engine": engine, "run": r, "variant": variant, "seconds": round(seconds, 2),
                              "output_tok_s": round(tok_s, 1), "loadavg": os.getloadavg()[0]}), flush=True)
    medians = {v: round(statistics.median(x), 1) for v, x in results.items()}
    print(json.dumps({"engine": engine, "median_output_tok_s": medians,
                      "lora4_over_base": round(medians["lora4"] / medians["base"], 3),
                      "n": n, "in": n_in, "out": n_out, "runs": runs}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["setup", "run"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--in", dest="n_in", type=int, default=128)
    parser.add_argument("--out", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    if args.step == "setup":
        setup(args.root)
    else:
        run(args.root, args.engine, args.runs, args.n, args.n_in, args.out, args.max_num_seqs)


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
