"""pagedllm's embeddings (LAST pooling) against generate(max_tokens=1) on the same prompts: what the pooling path
costs over a plain prefill. Both engines in one process, float32, no prefix caching, the two alternating run by run.

Usage: python benchmarks/embeddings_overhead.py MODEL_DIR   (N=16 prompts of IN=128 random token ids, RUNS=6)
"""

import json
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams

N, IN, RUNS = 16, 128, 6


def main() -> None:
    model = sys.argv[1]
    rng = random.Random(0)
    batches = [[[rng.randrange(100, 40000) for _ in range(IN)] for _ in range(N)] for _ in range(2 * RUNS)]
    kwargs = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory": 1 << 29, "enable_prefix_caching": False}
    emb = LLM(model, runner="pooling", **kwargs)
    gen = LLM(model, **kwargs)
    emb.embed(batches[0][:2], use_tqdm=False)  # warm-up
    gen.generate(batches[0][:2], SamplingParams(max_tokens=1), use_tqdm=False)
    rates: dict[str, list[float]] = {"embed": [], "generate1": []}
    for run in range(RUNS):
        for name in (("embed", "generate1") if run % 2 == 0 else ("generate1", "embed")):
            batch = batches[2 * run + (name == "embed")]
            start = time.perf_counter()
            if name == "embed":
                emb.embed(batch, use_tqdm=False)
            else:
                gen.generate(batch, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            rates[name].append(N * IN / (time.perf_counter() - start))
    print(json.dumps({"prompt_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                      "median_ratio_embed_over_generate1": round(statistics.median(rates["embed"])
                                                                 / statistics.median(rates["generate1"]), 3),
                      "loadavg": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
