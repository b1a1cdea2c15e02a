"""The cost of tensor parallelism's collectives on one host (issue 16, "Measure"):

  micro   microseconds per all-reduce of a [B, 576] float32 tensor (SmolLM2's hidden size), B = 1 and 16, over the
          shared-memory all-reduce and over gloo, at 2 and 3 ranks (real processes, 1 thread each; the two
          communicators alternate in blocks of calls so that both see the same load). Rank 0's wall time and thread
          CPU time per call, medians.
  steps   decode steps of the engine at batch 1 and 16 (128-token prompts, greedy, ignore_eos): the engine's step
          time, and inside each worker the time of its step and of the collectives in it (wall and thread CPU),
          medians over the timed steps. Configurations: a random Llama shaped like SmolLM2 but with 12 heads / 4 KV
          heads of 48 (so size 2 divides them) at TP=1 (uni, 2 threads) and TP=2 (mp, 1 thread per rank; shm and
          gloo), mp at TP=1 too; the real SmolLM2 (9 heads / 3 KV heads: size 3) at TP=1 (uni, 2 threads) and TP=3
          (mp, shm and gloo; 3 ranks of 1 thread on a 2-core machine are oversubscribed).
  cold    LLM() to ready (load_s) of every configuration above: for mp, the workers' fresh interpreters, the group
          set-up and the model loads included.

    PYTHONPATH=src .venv/bin/python benchmarks/tp_collectives.py [--steps 32] [--parts micro,steps] [--out FILE]

The workers' timings come from a sitecustomize.py that this script writes into a temporary folder and puts first
on the PYTHONPATH of the engine process it starts (the workers inherit it): it wraps TensorParallelGroup's
collectives and Worker.execute_model with timers, and makes the worker RPC `check_health` return them. Nothing of it is
in the package. Thread CPU time counts the calling thread only (gloo's own I/O threads are not in it; the shm
all-reduce spins on the calling thread, up to 50 us, before it sleeps). On a shared machine wall times move with
the load; the load average is printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HIDDEN = 576
RANDOM_LLAMA = Path(tempfile.gettempdir()) / "pagedllm-bench-tp2-llama"
SHM_SWITCH = "PAGEDLLM_CPU_SHM_ALLREDUCE"

HOOK = textwrap.dedent('''
    """Benchmark-only timers for benchmarks/tp_collectives.py (see its docstring)."""
    import os
    import time

    if os.environ.get("PAGEDLLM_BENCH_COLLECTIVES") == "1":
        from pagedllm.distributed import parallel_state
        from pagedllm.worker import worker as worker_module

        _collectives = [0, 0, 0]  # wall ns, thread ns, count
        _steps = []

        def _timed(fn):
            def timed(self, x):
                if self.size == 1:
                    return fn(self, x)
                wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
                try:
                    return fn(self, x)
                finally:
                    _collectives[0] += time.perf_counter_ns() - wall
                    _collectives[1] += time.thread_time_ns() - cpu
                    _collectives[2] += 1
            return timed

        _Group = parallel_state.TensorParallelGroup
        _Group.all_reduce = _timed(_Group.all_reduce)
        _Group.all_gather = _timed(_Group.all_gather)
        _execute = worker_module.Worker.execute_model

        def _execute_model(self, *args, **kwargs):
            before = list(_collectives)
            wall, cpu, proc = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            out = _execute(self, *args, **kwargs)
            _steps.append([time.perf_counter_ns() - wall, time.thread_time_ns() - cpu,
                           time.process_time_ns() - proc, *(a - b for a, b in zip(_collectives, before))])
            return out

        def _stats(self):
            """[[step wall, step thread CPU, step process CPU, collectives wall, collectives thread CPU,
            collectives], ...] in ns since the last call, and forget them. Answers the worker RPC check_health
            (a no-op the engine does not call): `python -m` runs worker_proc as __main__, so a new RPC name
            could not be added to its list from here."""
            out = list(_steps)
            _steps.clear()
            return out

        worker_module.Worker.execute_model = _execute_model
        worker_module.Worker.check_health = _stats
''')


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def median_us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1e3, 1)


def p90_us(ns: list[int]) -> float:
    return round(sorted(ns)[len(ns) * 9 // 10] / 1e3, 1)


# ---- micro: one rank of the all-reduce loop ------------------------------------------------------------------
def micro_rank(rank: int, size: int, init_method: str, rounds: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.shm_communicator import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    shm = ShmAllReduce.create(dist.group.WORLD, rank, size)
    assert shm is not None, "the shared-memory all-reduce is not available here"
    results = {}
    for batch in (1, 16):
        x = torch.randn(batch, HIDDEN)
        times = {"shm": ([], []), "gloo": ([], [])}
        for _ in range(20):  # warm-up
            shm.all_reduce(x.clone())
            dist.all_reduce(x.clone())
        for _ in range(rounds):
            for name in ("shm", "gloo"):
                walls, cpus = times[name]
                for _ in range(calls):
                    y = x.clone()
                    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
                    if name == "shm":
                        shm.all_reduce(y)
                    else:
                        dist.all_reduce(y)
                    walls.append(time.perf_counter_ns() - wall)
                    cpus.append(time.thread_time_ns() - cpu)
        results[f"B={batch}"] = {
            name: {"wall_us": median_us(w), "wall_us_p90": p90_us(w), "thread_cpu_us": median_us(c)}
            for name, (w, c) in times.items()}
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"part": "micro", "ranks": size, "calls": rounds * calls, **results, "load": load()}),
              flush=True)


def run_micro(size: int, rounds: int, calls: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--micro-rank", str(r), "--size", str(size),
                               "--init-method", f"tcp://127.0.0.1:{port}", "--rounds", str(rounds),
                               "--calls", str(calls)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(size)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outputs[0].strip().splitlines()[-1])


# ---- steps: one engine configuration ---------------------------------------------------------------------------
def run_config(config: dict, steps: int, prompt_len: int) -> None:
    import torch

    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(config["threads"])
    start = time.perf_counter()
    llm = LLM(config["model"], dtype="float32", seed=0, max_model_len=prompt_len + steps + 16, max_num_seqs=16,
              max_num_batched_tokens=4096, kv_cache_memory=64 << 20, tensor_parallel_size=config["tp"],
              distributed_executor_backend=config["backend"])
    load_s = time.perf_counter() - start
    engine = llm.llm_engine
    core = engine.engine_core
    pids = [p.pid for p in getattr(core.executor, "procs", [])]
    from pagedllm.distributed.shm_communicator import maps_segment

    communicator = "shm" if pids and all(maps_segment(p) for p in pids) else ("gloo" if config["tp"] > 1 else "-")
    rng = random.Random(0)
    top = min(49000, core.model_info.vocab_size)
    result = {"part": "steps", "name": config["name"], "tp": config["tp"], "backend": config["backend"],
              "threads_per_rank": max(1, config["threads"] // config["tp"]) if config["backend"] == "mp"
              else config["threads"], "communicator": communicator, "load_s": round(load_s, 2)}
    for batch in (1, 16):
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [rng.randrange(100, top) for _ in range(prompt_len)], params)
        while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
            engine.step()
        for _ in range(2):
            engine.step()
        core.executor.collective_rpc("check_health")  # forget the prefill steps
        walls, cpus = [], []
        for _ in range(steps):
            wall, cpu = time.perf_counter_ns(), time.process_time_ns()
            engine.step()
            walls.append(time.perf_counter_ns() - wall)
            cpus.append(time.process_time_ns() - cpu)
        ranks = core.executor.collective_rpc("check_health")
        while engine.has_unfinished_requests():
            engine.step()
        rank0 = ranks[0]
        result[f"B={batch}"] = {
            "engine_step_ms": round(statistics.median(walls) / 1e6, 2),
            "engine_process_cpu_ms": round(statistics.median(cpus) / 1e6, 2),
            "rank0_step_ms": round(statistics.median(s[0] for s in rank0) / 1e6, 2),
            "rank0_step_thread_cpu_ms": round(statistics.median(s[1] for s in rank0) / 1e6, 2),
            "rank0_step_process_cpu_ms": round(statistics.median(s[2] for s in rank0) / 1e6, 2),
            "collectives_per_step": rank0[0][5],
            "rank0_collectives_ms": round(statistics.median(s[3] for s in rank0) / 1e6, 3),
            "rank0_collectives_thread_cpu_ms": round(statistics.median(s[4] for s in rank0) / 1e6, 3),
            "ranks_collectives_ms": [round(statistics.median(s[3] for s in r) / 1e6, 3) for r in ranks],
            "load": load()}
    core.shutdown()
    print(json.dumps(result), flush=True)


def ensure_random_llama() -> Path:
    """A random-weight Llama with SmolLM2's sizes (hidden 576, MLP 1536, 30 layers, vocabulary 49152, tied) but
    12 heads and 4 KV heads of 48, so that size 2 divides them; SmolLM2's tokenizer. Made once, kept in /tmp."""
    if (RANDOM_LLAMA / "model.safetensors").exists():
        return RANDOM_LLAMA
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.tokenizer import get_tokenizer

    config = LlamaConfig(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=48, max_position_embeddings=2048,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    folder = RANDOM_LLAMA.with_name(RANDOM_LLAMA.name + f".tmp{os.getpid()}")
    LlamaForCausalLM(config).float().save_pretrained(folder, safe_serialization=True)
    get_tokenizer(None).save_pretrained(folder)
    folder.rename(RANDOM_LLAMA)
    return RANDOM_LLAMA


def run_steps(config: dict, steps: int, prompt_len: int, hook_dir: Path) -> dict:
    env = {**os.environ, "PAGEDLLM_BENCH_COLLECTIVES": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")]))}
    if config.get("gloo"):
        env[SHM_SWITCH] = "0"
    out = subprocess.run([sys.executable, __file__, "--config", json.dumps(config), "--steps", str(steps),
                          "--prompt-len", str(prompt_len)], env=env, stdout=subprocess.PIPE, text=True, check=True,
                         timeout=1200).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="micro,steps")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--micro-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--init-method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_rank is not None:
        micro_rank(args.micro_rank, args.size, args.init_method, args.rounds, args.calls)
        return
    if args.config is not None:
        run_config(json.loads(args.config), args.steps, args.prompt_len)
        return

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(line) + "\n")

    parts = args.parts.split(",")
    if "micro" in parts:
        for size in (2, 3):
            emit(run_micro(size, args.rounds, args.calls))
    if "steps" in parts:
        llama = str(ensure_random_llama())
        configs = [
            {"name": "random Llama (SmolLM2 sizes, 12/4 heads)", "model": llama, "tp": 1, "backend": "uni",
             "threads": 2},
            {"name": "random Llama (SmolLM2 sizes, 12/4 heads)", "model": llama, "tp": 1, "backend": "mp",
             "threads": 2},
            {"name": "random Llama (SmolLM2 sizes, 12/4 heads)", "model": llama, "tp": 2, "backend": "mp",
             "threads": 2},
            {"name": "random Llama (SmolLM2 sizes, 12/4 heads)", "model": llama, "tp": 2, "backend": "mp",
             "threads": 2, "gloo": True},
            {"name": "SmolLM2-135M GGUF", "model": None, "tp": 1, "backend": "uni", "threads": 2},
            {"name": "SmolLM2-135M GGUF", "model": None, "tp": 3, "backend": "mp", "threads": 2},
            {"name": "SmolLM2-135M GGUF", "model": None, "tp": 3, "backend": "mp", "threads": 2, "gloo": True},
        ]
        with tempfile.TemporaryDirectory(prefix="pagedllm-bench-hook-") as hook_dir:
            (Path(hook_dir) / "sitecustomize.py").write_text(HOOK)
            for config in configs:
                emit(run_steps(config, args.steps, args.prompt_len, Path(hook_dir)))


if __name__ == "__main__":
    main()
