"""The identity table of issue 16: greedy output of each parallel configuration against the single-process engine
(`uni`, TP=1 PP=1 DP=1) of the same model, on 32 random token prompts (lengths 8-96, fixed seed) x 64 tokens
(ignore_eos). Also compares the logprobs of the sampled tokens bit for bit (the issue asks PP's to be bitwise
PP=1's; TP's all-reduce changes the summation order, so there only the tokens must agree).

Run: OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/parallel_identity.py \
         [--out benchmarks/results/scale_out/identity.json] [--configs tp3,tp2,pp2,pp3,dp2,ray_pp2]

Rows: TP=3, PP=2, PP=3 on the embedded SmolLM2 GGUF (offline LLM, mp executor); TP=2 on the tests' tiny random
Llama (4 heads / 2 KV heads); DP=2 on SmolLM2 served (`pagedllm serve --data-parallel-size 2`, token-id prompts over
HTTP; offline DP is refused); Ray PP=2 on SmolLM2 served over a two-node Ray cluster on 127.0.0.2 / 127.0.0.3 (the
cluster of tests/reliability/test_ray_cluster.py; the row is skipped with its reason when Ray is absent). Every
process runs one thread, as the reference does, so a stage or rank runs the reference's matmul blocking. Every
configuration gets the same pool (--num-gpu-blocks-override) and --max-num-seqs, so none preempts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
from reliability_utils import MODEL_NAME, Server  # noqa: E402

from server_process import build_tiny_model  # noqa: E402

NUM_PROMPTS, MAX_TOKENS, SEED = 32, 64, 0
MIN_LEN, MAX_LEN = 8, 96
BLOCK_SIZE, MAX_NUM_SEQS = 16, 8
NUM_BLOCKS = MAX_NUM_SEQS * ((MAX_LEN + MAX_TOKENS) // BLOCK_SIZE + 1) + 8  # every running sequence fits: no preemption
ENGINE = {"dtype": "float32", "max_model_len": 256, "block_size": BLOCK_SIZE, "max_num_seqs": MAX_NUM_SEQS,
          "num_gpu_blocks_override": NUM_BLOCKS}
SERVE_FLAGS = ("--max-model-len", "256", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--num-gpu-blocks-override", str(NUM_BLOCKS))
SMOLLM2_VOCAB, TINY_VOCAB = 49152, 384


def random_prompts(vocab: int, first_id: int) -> list[list[int]]:
    """32 prompts of random ids in [first_id, vocab) (past the special tokens), lengths MIN_LEN..MAX_LEN."""
    import random

    rng = random.Random(SEED)
    return [[rng.randrange(first_id, vocab) for _ in range(rng.randint(MIN_LEN, MAX_LEN))] for _ in range(NUM_PROMPTS)]


Output = list[tuple[list[int], list[float]]]  # per prompt: (token ids, logprob of each sampled token)


def offline(model: str, prompts: list[list[int]], **parallel) -> Output:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **ENGINE, **parallel)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [step[t].logprob for t, step in zip(o.outputs[0].token_ids,
                                                                                   o.outputs[0].logprobs, strict=True)])
                for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def served(server: Server, prompts: list[list[int]]) -> Output:
    def complete(prompt: list[int]) -> tuple[list[int], list[float]]:
        response = server.http.post("/v1/completions", timeout=600.0, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True})
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:  # concurrent, so DP spreads them over both replicas
        return list(pool.map(complete, prompts))


def compare(config: str, model: str, output: Output, reference: Output, seconds: float, **extra) -> dict:
    identical = [tokens == ref_tokens for (tokens, _), (ref_tokens, _) in zip(output, reference, strict=True)]
    first = None
    for i, ((tokens, _), (ref_tokens, _)) in enumerate(zip(output, reference, strict=True)):
        if tokens != ref_tokens:
            position = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b),
                            min(len(tokens), len(ref_tokens)))
            first = {"prompt": i, "position": position}
            break
    # logprobs of the sampled tokens, over the positions where both sampled the same token so far
    deltas = []
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(output, reference, strict=True):
        for a, b, lp, ref_lp in zip(tokens, ref_tokens, logprobs, ref_logprobs, strict=False):
            if a != b:
                break
            deltas.append(abs(lp - ref_lp))
    return {"config": config, "model": model, "identical": sum(identical), "prompts": len(identical),
            "first_difference": first, "logprobs_bitwise": bool(deltas) and max(deltas) == 0.0,
            "max_abs_logprob_delta": max(deltas) if deltas else None, "seconds": round(seconds, 1), **extra}


def ray_row(prompts: list[list[int]], reference: Output, folder: Path) -> dict:
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"config": "Ray PP=2 (2 nodes)", "skipped": "ray is not installed (pip install -e \".[ray]\")"}
    from test_ray_cluster import HEAD_IP, NODE_IP, start_ray_cluster

    start = time.monotonic()
    (folder / "ray-cluster").mkdir()
    with start_ray_cluster(folder / "ray-cluster") as cluster:
        server = Server(None, folder / "ray-server.log", *SERVE_FLAGS, "--distributed-executor-backend", "ray",
                        "--pipeline-parallel-size", "2", "--ray-address", cluster.address, wait_ready=False)
        try:
            server.wait_ready(timeout_s=600.0)
            placed = next(line for line in server.log().splitlines() if "Ray workers on" in line)
            if not (HEAD_IP in placed and NODE_IP in placed):
                raise RuntimeError(f"the stages did not land on both nodes: {placed}")
            output = served(server, prompts)
        finally:
            server.close()
    return compare("Ray PP=2 (2 nodes)", "SmolLM2", output, reference, time.monotonic() - start,
                   placement=placed.split("]", 1)[-1].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale_out" / "identity.json")
    parser.add_argument("--configs", default="tp3,tp2,pp2,pp3,dp2,ray_pp2")
    args = parser.parse_args()
    configs = args.configs.split(",")
    import torch

    torch.set_num_threads(1)
    from pagedllm.models.resolve import resolve_model

    smollm2 = str(resolve_model(None).path)
    rows = []
    previous = json.loads(args.out.read_text())["rows"] if args.out.exists() else []

    def save() -> None:
        """Rewrite the JSON after each row: the rows of this run, then the file's rows of the other configs."""
        mine = {r["config"] for r in rows}
        result = {"prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS, "prompt_lengths": [MIN_LEN, MAX_LEN],
                  "seed": SEED, "threads_per_process": 1, "engine": ENGINE,
                  "rows": rows + [r for r in previous if r["config"] not in mine]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="identity-") as tmp:
        folder = Path(tmp)
        prompts = random_prompts(SMOLLM2_VOCAB, 100)
        start = time.monotonic()
        reference = offline(smollm2, prompts)
        print(f"uni SmolLM2: {time.monotonic() - start:.0f} s", flush=True)

        def timed(config: str, model: str, run, ref: Output) -> None:
            start = time.monotonic()
            rows.append(compare(config, model, run(), ref, time.monotonic() - start))
            print(json.dumps(rows[-1]), flush=True)
            save()

        if "tp3" in configs:
            timed("TP=3", "SmolLM2", lambda: offline(smollm2, prompts, tensor_parallel_size=3), reference)
        if "pp2" in configs:
            timed("PP=2", "SmolLM2", lambda: offline(smollm2, prompts, pipeline_parallel_size=2), reference)
        if "pp3" in configs:
            timed("PP=3", "SmolLM2", lambda: offline(smollm2, prompts, pipeline_parallel_size=3), reference)
        if "dp2" in configs:
            def dp2() -> Output:
                server = Server(None, folder / "dp2.log", *SERVE_FLAGS, "--data-parallel-size", "2",
                                wait_ready=False)
                try:
                    server.wait_ready(timeout_s=600.0)  # two SmolLM2 engines on a loaded machine
                    output = served(server, prompts)
                    rows_per_engine = [server.metric(f'vllm:request_success_total{{engine="{r}"') for r in (0, 1)]
                    print(f"DP=2 requests per replica: {rows_per_engine}", flush=True)
                    return output
                finally:
                    server.close()
            timed("DP=2 (served)", "SmolLM2", dp2, reference)
        if "ray_pp2" in configs:
            rows.append(ray_row(prompts, reference, folder))
            print(json.dumps(rows[-1]), flush=True)
            save()
        if "tp2" in configs:
            tiny = str(build_tiny_model(folder))
            tiny_prompts = random_prompts(TINY_VOCAB, 3)
            tiny_reference = offline(tiny, tiny_prompts)
            timed("TP=2", "tiny random Llama", lambda: offline(tiny, tiny_prompts, tensor_parallel_size=2),
                  tiny_reference)

    print(f"\n{'config':<20} {'model':<18} {'identical':>9}  first difference (prompt, position)  logprobs")
    for row in json.loads(args.out.read_text())["rows"]:
        if "skipped" in row:
            print(f"{row['config']:<20} skipped: {row['skipped']}")
            continue
        first = row["first_difference"]
        where = f"prompt {first['prompt']}, token {first['position']}" if first else "none"
        logprobs = "bitwise" if row["logprobs_bitwise"] else f"max |delta| {row['max_abs_logprob_delta']:.1e}"
        print(f"{row['config']:<20} {row['model']:<18} {row['identical']:>4} / {row['prompts']:<3} {where:<36} "
              f"{logprobs}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
