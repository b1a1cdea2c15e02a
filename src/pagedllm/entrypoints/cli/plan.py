"""`pagedllm plan`: replicas, KV memory and --max-num-seqs from a workload, SLOs and measured bench results.

The model is src/pagedllm/bench/plan.py (its docstring is the method); the check is bench/plan_sim.py.
"""

from __future__ import annotations

import argparse
import json
import sys

_DESCRIPTION = ("Capacity plan: how many replicas, how much KV cache and which --max-num-seqs serve USERS x "
                "REQUESTS-PER-USER-PER-MINUTE within p99 TTFT and ITL SLOs, from `pagedllm bench serve --save-result "
                "--max-concurrency C` files measured on this hardware (a sweep over C).")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedllm.config.arguments import parse_bytes

    parser = subparsers.add_parser("plan", help="Capacity plan from measured bench results.",
                                   description=_DESCRIPTION)
    group = parser.add_argument_group("workload")
    group.add_argument("--users", type=float, required=True, help="Concurrent users.")
    group.add_argument("--requests-per-user-per-minute", type=float, required=True,
                       help="Requests each user sends per minute (lambda = users x this / 60 req/s).")
    group.add_argument("--prompt-len", type=int, required=True, help="Mean prompt tokens.")
    group.add_argument("--output-len", type=int, required=True, help="Mean output tokens.")
    group.add_argument("--len-range-ratio", type=float, default=0.0,
                       help="Lengths uniform within mean x (1 +- this), as bench's --random-range-ratio; KV memory "
                            "is sized for the longest.")
    group = parser.add_argument_group("SLOs (p99)")
    group.add_argument("--ttft-slo-ms", type=float, required=True, help="p99 time to first token, ms.")
    group.add_argument("--itl-slo-ms", type=float, required=True, help="p99 inter-token latency, ms.")
    group = parser.add_argument_group("measurements and memory")
    group.add_argument("--bench-result", nargs="+", required=True, metavar="FILE",
                       help="`pagedllm bench serve --save-result --max-concurrency C` JSON files (one or a sweep).")
    group.add_argument("--kv-bytes-per-token", type=int, default=None,
                       help="KV cache bytes one token takes in a replica; default: from --model's config.")
    group.add_argument("--model", default=None,
                       help="The served model (default: pagedllm's default model), read for its KV bytes per token.")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help="As `pagedllm serve --kv-cache-dtype` (a server with --activation-quantization int8 stores "
                            "bfloat16 for auto: give bfloat16 here for one).")
    group.add_argument("--dtype", default="auto", help="As `pagedllm serve --dtype`.")
    group.add_argument("--kv-memory-per-replica", type=parse_bytes, default=4 << 30,
                       help="Memory one replica can give its KV cache (`4GiB`, bytes), after weights and "
                            "activations; default 4 GiB, `pagedllm serve`'s CPU default.")
    group.add_argument("--block-size", type=int, default=16, help="KV block size in tokens, as --block-size.")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="The servers' --max-model-len: the KV cache is made to hold one such sequence, as the "
                            "engine requires (default: not considered; pass the model's context length).")
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", default=None, help="Also write the plan as JSON to this file.")
    group.add_argument("--simulate", action="store_true",
                       help="Check the plan in a discrete-event simulation (bench/plan_sim.py) driven by the "
                            "measured curve, at the recommendation and with one replica fewer.")
    return parser


def cmd(args: argparse.Namespace) -> int:
    from pagedllm.bench.plan import Memory, Workload, format_plan, plan
    from pagedllm.bench.plan_curve import Curve, PlanError, load_points, model_kv_bytes_per_token

    try:
        workload = Workload(args.users, args.requests_per_user_per_minute, args.prompt_len, args.output_len,
                            args.ttft_slo_ms, args.itl_slo_ms, args.len_range_ratio)
        curve = Curve(load_points(args.bench_result))
        kv_note = "given"
        if args.kv_bytes_per_token is None:
            args.kv_bytes_per_token, kv_note = model_kv_bytes_per_token(args.model, args.kv_cache_dtype, args.dtype)
        result = plan(workload, curve, Memory(args.kv_bytes_per_token, args.kv_memory_per_replica, args.block_size,
                                                        args.max_model_len))
    except (PlanError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result.reasoning.insert(0, f"KV bytes per token: {kv_note}")
    print(format_plan(result, workload, curve))
    out = {"workload": {**vars(workload), "arrival_rate": workload.arrival_rate, "slo_percentile": 99},
           "bench_results": [p.to_dict() for p in curve.points], **result.to_dict()}
    if args.simulate:
        out["simulation"] = _simulate(result, workload, curve)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _simulate(result, workload, curve) -> list[dict]:
    from pagedllm.bench.plan_sim import CurveStepModel, meets, simulate

    runs = []
    print("\nSimulation (measured step times, Poisson arrivals, round-robin, 3000 requests, seed 0):")
    for replicas in sorted({result.replicas, max(result.replicas - 1, 1)}, reverse=True):
        sim = simulate(CurveStepModel(curve), replicas=replicas, max_num_seqs=result.max_num_seqs,
                       prompt_len=workload.prompt_len, output_len=workload.output_len,
                       arrival_rate=workload.arrival_rate, num_requests=3000, len_range_ratio=workload.len_range_ratio)
        ok = meets(sim, workload.ttft_slo_ms, workload.itl_slo_ms)
        print(f"  {replicas} replica(s): p99 TTFT {sim['p99_ttft_ms']:.1f} ms, p99 ITL {sim['p99_itl_ms']:.1f} ms, "
              f"slots {sim['slot_utilisation']:.0%} busy: SLOs {'met' if ok else 'MISSED'}")
        runs.append({**sim, "meets_slos": ok})
    return runs
