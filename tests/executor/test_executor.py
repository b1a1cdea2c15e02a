"""The executor layer and tensor parallelism on a tiny random Llama: the backend flag, the start-up errors, and
greedy tokens at tensor-parallel size 2 (mp: one process per rank; all-reduces over shared memory, or gloo) identical to
the in-process engine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.shm_communicator import ENV_SWITCH, SEGMENT_PREFIX, SHM_DIR, maps_segment
from server_process import pid_alive

PROMPTS = ["The quick brown fox jumps over", "Hello world! How are you", "Paged attention stores the KV cache",
           "Numbers like 12345 and 2024 appear", "user assistant system: write a short poem"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
# Every rank samples from the same gathered logits with the same generator; only rank 0's tokens are returned, and
# the other ranks' persistent batches must hold the same tokens (vLLM relies on this too).
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
# float32 whatever the CPU: the all-reduce changes the summation order, and in bfloat16 (dtype auto on a CPU with
# AVX512-BF16 or AMX) that flips near-tied greedy tokens of the random tiny model.
POOL = {"kv_cache_memory": 8 << 20, "dtype": "float32"}


def _generate(llm: LLM, prompts: list | None = None) -> list:
    return [o.outputs[0] for o in llm.generate(prompts or PROMPTS, GREEDY, use_tqdm=False)]


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.engine_core.executor.procs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy outputs (tokens, logprobs) and seeded samples of the default in-process (uni) engine."""
    llm = LLM(str(tiny_llama_dir), **POOL)
    try:
        return {"greedy": _generate(llm),
                "sampled": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]}
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_backend_flag_choices():
    assert EngineConfig.from_kwargs().parallel_config.executor_backend == "uni"
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel_config.executor_backend == "mp"
    with pytest.raises(ValueError, match="needs mp"):
        EngineConfig.from_kwargs(distributed_executor_backend="uni", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)


def test_ray_backend_without_ray_is_a_startup_error_naming_the_extra(monkeypatch):
    """Ray is an optional extra: without it, `serve --distributed-executor-backend ray` stops before anything
    starts and says how to install it (before: "ray is not yet supported", whether Ray was there or not)."""
    import argparse
    import importlib.util

    from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    parser = add_parser(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    args = parser.parse_args(["--distributed-executor-backend", "ray", "--pipeline-parallel-size", "2",
                              "--ray-address", "127.0.0.2:6379"])
    with pytest.raises(ValueError, match=r'ray needs Ray, which is not installed: pip install "pagedllm\[ray\]"'):
        configs_from_args(args)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if find_spec("ray") is not None:
        engine, _ = configs_from_args(args)
        assert engine.parallel_config.executor_backend == "ray"
        assert engine.parallel_config.ray_address == "127.0.0.2:6379"


def test_size_that_does_not_divide_the_heads_is_a_startup_error(tiny_llama_dir):
    """4 query heads: size 3 is refused from the model's metadata, before any worker process starts."""
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **POOL)


@pytest.mark.slow
def test_mp_at_size_1_is_bitwise_the_in_process_engine(tiny_llama_dir, reference):
    """The same worker code behind ZMQ: the same tokens and the same logprob floats; the worker is gone after
    shutdown."""
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="mp", **POOL)
    pids = _worker_pids(llm)
    try:
        outputs = _generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference["greedy"]]
    assert [o.logprobs for o in outputs] == [o.logprobs for o in reference["greedy"]]
    assert not any(pid_alive(pid) for pid in pids)


@pytest.mark.slow
def test_tensor_parallel_2_greedy_matches_size_1(tiny_llama_dir, reference, monkeypatch):
    """4 heads / 2 KV heads split over 2 ranks (1 thread each), vocabulary-parallel embedding and LM head. The
    all-reduce changes the float summation order, so logprobs may differ in the last bits; tokens must not. The
    all-reduces go through shared memory (both workers map the segment, its name already unlinked); forced onto
    gloo (PAGEDLLM_CPU_SHM_ALLREDUCE=0) the tokens and logprobs are bitwise the same (both sum two partials, a + b),
    and no segment is left in /dev/shm."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **POOL)
    pids = _worker_pids(llm)
    try:
        assert len(pids) == 2
        assert all(maps_segment(pid) for pid in pids)
        outputs = _generate(llm)
        sampled = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference["greedy"]]
    assert sampled == reference["sampled"]
    deltas = [abs(a.logprob - b.logprob) for x, y in zip(outputs, reference["greedy"], strict=True)
              for step_a, step_b in zip(x.logprobs, y.logprobs, strict=True)
              for a, b in zip(step_a.values(), step_b.values(), strict=False)]
    print(f"FIGURE TP=2 vs TP=1 tiny Llama: {len(PROMPTS)} prompts x {GREEDY.max_tokens} tokens identical, "
          f"max |delta logprob| {max(deltas):.2e}")
    assert max(deltas) < 1e-4
    assert not any(pid_alive(pid) for pid in pids)

    monkeypatch.setenv(ENV_SWITCH, "0")
    gloo = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **POOL)
    try:
        assert not any(maps_segment(pid) for pid in _worker_pids(gloo))
        gloo_outputs = _generate(gloo)
    finally:
        gloo.llm_engine.engine_core.shutdown()
    assert [(o.token_ids, o.logprobs) for o in gloo_outputs] == [(o.token_ids, o.logprobs) for o in outputs]
    assert list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}-*")) == []


@pytest.mark.slow
def test_tensor_parallel_replicates_kv_heads_beyond_their_number(tiny_llama_dir, tmp_path):
    """One KV head (MQA), 2 query heads, size 2: both ranks hold the one KV head. A vocabulary of 383 (odd) with
    tied embeddings: rank 1's slice of the embedding and LM head is padded with a zero row. Token-id prompts (the
    tokenizer has 384 tokens)."""
    folder = _mqa_llama(tiny_llama_dir, tmp_path / "mqa")
    prompts = [[5, 17, 42, 100, 7], [300, 301, 2, 9], [191, 192, 193, 382, 381, 380, 11, 12, 13]]
    size1 = LLM(str(folder), **POOL)
    try:
        expected = [o.token_ids for o in _generate(size1, prompts)]
    finally:
        size1.llm_engine.engine_core.shutdown()
    size2 = LLM(str(folder), tensor_parallel_size=2, **POOL)
    try:
        assert [o.token_ids for o in _generate(size2, prompts)] == expected
    finally:
        size2.llm_engine.engine_core.shutdown()


def _mqa_llama(tokenizer_dir: Path, folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=383, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.08, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(1)
    LlamaForCausalLM(config).float().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.slow
def test_worker_death_between_steps_is_reported_and_steps_raise(tiny_llama_dir):
    """A worker killed while the engine idles: the failure callback fires at once (engine/core_proc.py then stops
    the engine), the next step raises ExecutorDeadError instead of waiting, and shutdown leaves no process."""
    import os
    import signal
    import threading
    import time

    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.executor.abstract import ExecutorDeadError
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(EngineConfig.from_kwargs(model=str(tiny_llama_dir), distributed_executor_backend="mp",
                                                          **POOL))
    try:
        reasons: list[str] = []
        called = threading.Event()
        executor.register_failure_callback(lambda reason: (reasons.append(reason), called.set()))
        executor.initialize_kv_cache(executor.determine_num_blocks())
        pid = executor.procs[0].pid
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert called.wait(2.0), "no failure callback within 2 s"
        print(f"FIGURE idle worker kill: failure callback after {time.monotonic() - killed_at:.2f} s")
        assert "worker 0" in reasons[0] and "exit code -9" in reasons[0]
        with pytest.raises(ExecutorDeadError):
            executor.execute_model(SchedulerOutput.empty())
    finally:
        executor.shutdown()
    assert not pid_alive(pid)
