"""Whole engine steps of the default GGUF model with its weights kept quantized (today's default) against the
dequantize-at-load path (float32 weights in oneDNN), both engines in this process, timed interleaved:

- a prefill step of 8 prompts x 256 random tokens (one 2048-token step),
- decode steps at batch 1 and at --batch (greedy, ignore_eos, 64-token prompts).

    .venv/bin/python benchmarks/quant_model_step.py [--reps 5] [--batch 16] [--decode-steps 8] [--threads N] [--int8]

--int8 adds a third engine in the 8-bit-activation fast mode (activation_quantization="int8"), also compared
with the dequantized one.

Prints medians per engine and the quantized / dequantized ratio, of wall time and of this thread's CPU time. With
--threads 1 every kernel runs on this thread, so its CPU time is the compute time even on a crowded machine (the
process's CPU time would also count the engines' background threads, such as the one faulting the KV pool in).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def build(quantized: bool, **engine_args):
    from pagedllm import LLM
    from pagedllm.models import loader

    original = loader.runs_gguf_quantized
    if not quantized:
        loader.runs_gguf_quantized = lambda *args: False
    try:
        return LLM(dtype="float32", max_model_len=1024, seed=0, max_num_seqs=64, max_num_batched_tokens=2048,
                   kv_cache_memory=256 << 20, **engine_args).llm_engine
    finally:
        loader.runs_gguf_quantized = original


def timed_step(engine) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def prefill(engine, rng: random.Random, tag: str) -> tuple[float, float]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(8):
        engine.add_request(f"{tag}-p{i}", [rng.randrange(100, 49000) for _ in range(256)], params)
    result = timed_step(engine)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def decode(engine, rng: random.Random, tag: str, batch: int, steps: int) -> tuple[float, float]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-d{i}", [rng.randrange(100, 49000) for _ in range(64)], params)
    for _ in range(3):  # the prompts, then warm-up decode steps
        engine.step()
    times = [timed_step(engine) for _ in range(steps)]
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--int8", action="store_true", help="also time the 8-bit-activation mode")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {"dequantized": build(False), "quantized": build(True)}
    if args.int8:
        engines["int8"] = build(True, activation_quantization="int8")
    rng = random.Random(0)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for name, engine in engines.items():
            tag = f"{name}{rep}"
            results.setdefault((name, "prefill 8x256"), []).append(prefill(engine, rng, tag))
            results.setdefault((name, "decode batch 1"), []).append(decode(engine, rng, tag, 1, args.decode_steps))
            results.setdefault((name, f"decode batch {args.batch}"), []).append(
                decode(engine, rng, tag, args.batch, args.decode_steps))
    print(f"threads {torch.get_num_threads()}, {args.reps} reps, load {open('/proc/loadavg').read().split()[:3]}")
    for phase, name in ((p, n) for p in dict.fromkeys(p for _, p in results) for n in list(engines)[1:]):
        old, new = results[("dequantized", phase)], results[(name, phase)]
        old_wall, new_wall = statistics.median(t[0] for t in old), statistics.median(t[0] for t in new)
        old_cpu, new_cpu = statistics.median(t[1] for t in old), statistics.median(t[1] for t in new)
        print(f"{phase:16s} dequantized {old_wall * 1e3:8.1f} ms (cpu {old_cpu * 1e3:8.1f})   {name} "
              f"{new_wall * 1e3:8.1f} ms (cpu {new_cpu * 1e3:8.1f})   new/old wall {new_wall / old_wall:5.2f} "
              f"cpu {new_cpu / old_cpu:5.2f}", flush=True)


if __name__ == "__main__":
    main()
