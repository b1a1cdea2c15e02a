"""--async-scheduling on and off, in process (the offline LLM), interleaved: output tokens/s of a batch of
requests, and the worker's idle time between two model steps (the engine core's scheduling and output processing
that the model waits for), from the worker's step spans.

    PYTHONPATH=src .venv/bin/python benchmarks/async_scheduling.py --runs 3 --batch 16 64 --backends uni mp

Prints one JSON line per measurement and a table of medians; every line carries the load average."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedllm import LLM, SamplingParams


def measure(llm: LLM, batch: int, output_len: int, input_len: int, seed: int) -> dict:
    prompts = [{"prompt_token_ids": [(seed * 7919 + i * 104729 + j * 31) % 40000 + 100 for j in range(input_len)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = llm.llm_engine.engine_core
    start_mono = time.monotonic()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    while core.has_unfinished_requests():
        core.step()
    spans = [s for s in core.executor.collective_rpc("get_step_spans")[0] if s[0] >= start_mono]
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    steps = [e - s for s, e in spans]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tok_s": tokens / elapsed, "gap_ms": 1e3 * statistics.median(gaps),
            "gap_mean_ms": 1e3 * statistics.fmean(gaps), "step_ms": 1e3 * statistics.median(steps),
            "idle_share": sum(gaps) / (spans[-1][1] - spans[0][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: pagedllm's default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--backends", nargs="+", default=["uni"], choices=["uni", "mp"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=768 << 20, help="bytes of KV pool per engine")
    args = parser.parse_args()
    engines = {}
    for backend in args.backends:
        for flag in (False, True):
            kwargs = {"async_scheduling": flag, "distributed_executor_backend": backend,
                      "kv_cache_memory": args.kv_cache_memory}
            engines[(backend, flag)] = LLM(args.model, **kwargs) if args.model else LLM(**kwargs)
    for llm in engines.values():  # warm-up
        measure(llm, 4, 8, args.input_len, 0)
    rows: dict[tuple, list[dict]] = {}
    for run in range(args.runs):
        for batch in args.batch:
            order = list(engines.items())
            if run % 2:
                order.reverse()
            for (backend, flag), llm in order:
                result = measure(llm, batch, args.output_len, args.input_len, run * 100 + batch)
                result.update(backend=backend, async_scheduling=flag, batch=batch, run=run,
                              loadavg=os.getloadavg()[0])
                print(json.dumps(result), flush=True)
                rows.setdefault((backend, flag, batch), []).append(result)
    print("| executor | async | batch | output tok/s | gap between steps (ms) | step (ms) | idle share | load |")
    print("|---|---|---|---|---|---|---|---|")
    for (backend, flag, batch), results in rows.items():
        med = {k: statistics.median(r[k] for r in results)
               for k in ("output_tok_s", "gap_ms", "step_ms", "idle_share", "loadavg")}
        print(f"| {backend} | {'on' if flag else 'off'} | {batch} | {med['output_tok_s']:.1f} | {med['gap_ms']:.2f} | "
              f"{med['step_ms']:.1f} | {med['idle_share']:.1%} | {med['loadavg']:.1f} |")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
