"""Pipeline parallelism on the tiny random Llama (3 layers): the layer split, what each stage loads, the start-up
errors, and greedy tokens and logprobs at pipeline-parallel size 2 and 3 (mp: one process per stage, gloo, 1
thread each) bitwise equal to the in-process engine: a stage runs the same ops on the same inputs, so the
summation order does not change. Combined with tensor parallelism (tp 2 x pp 2). A killed stage ends the engine
as a killed tensor-parallel rank does."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup, pipeline_layer_range
from pagedllm.distributed.shm_communicator import maps_segment
from server_process import pid_alive

PROMPTS = ["The quick brown fox jumps over", "Hello world! How are you", "Paged attention stores the KV cache",
           "Numbers like 12345 and 2024 appear", "user assistant system: write a short poem"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
# float32 whatever the CPU: the all-reduce changes the summation order, and in bfloat16 (dtype auto on a CPU with
# AVX512-BF16 or AMX) that flips near-tied greedy tokens of the random tiny model.
POOL = {"kv_cache_memory": 8 << 20, "dtype": "float32"}


@pytest.fixture(scope="module")
def one_thread():
    """1 thread in this process, so in the reference and in every stage (the executor gives each rank its share
    of this process's threads): the matmuls' blocking is the same everywhere."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _run(llm: LLM) -> dict:
    try:
        greedy = [o for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return {"tokens": [o.outputs[0].token_ids for o in greedy], "logprobs": [o.outputs[0].logprobs for o in greedy],
                "prompt_logprobs": [o.prompt_logprobs for o in greedy],
                "sampled": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]}
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, one_thread):
    return _run(LLM(str(tiny_llama_dir), **POOL))


def test_layer_split_is_vllms():
    """As even as possible; the extra layers on the stages before the last, from the second-to-last backwards."""
    def split(n, size):
        return [pipeline_layer_range(n, r, size) for r in range(size)]

    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert split(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert split(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert split(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]


def test_startup_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="--pipeline-parallel-size 4 is larger than the model's 3 layers"):
        LLM(str(tiny_llama_dir), pipeline_parallel_size=4, **POOL)
    with pytest.raises(ValueError, match="needs mp"):
        EngineConfig.from_kwargs(distributed_executor_backend="uni", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig.from_kwargs(pipeline_parallel_size=0)
    assert EngineConfig.from_kwargs(pipeline_parallel_size=2).parallel_config.executor_backend == "mp"
    assert EngineConfig.from_kwargs(pipeline_parallel_size=2, tensor_parallel_size=2).parallel_config.world_size == 4


def test_each_stage_loads_only_its_layers_quantized_rows_included(tiny_llama_gguf_quantized, monkeypatch):
    """The quantized GGUF (kept quantized): stage 0 of 2 holds the embedding and layers 0-1, stage 1 layer 2, the
    final norm and the LM head; together exactly the weights of the whole model. A stage never reads the other
    stages' tensors from the file."""
    from pagedllm.config import ModelConfig
    from pagedllm.models import gguf_loader
    from pagedllm.models.loader import load_model

    reads: list[str] = []
    for fn in ("unpack_tensor", "dequantize_tensor"):
        real = getattr(gguf_loader, fn)
        monkeypatch.setattr(gguf_loader, fn, lambda tensor, path, real=real: (reads.append(tensor.name),
                                                                               real(tensor, path))[1])

    def loaded(pp=None):
        reads.clear()
        model = load_model(mc, cpu, torch.float32, pp=pp)
        return model, list(reads)

    def weights(model):
        names = {n for n, p in model.named_parameters() if p is not None}
        names |= {n for n, m in model.named_modules() if getattr(m, "quant_weight", None) is not None}
        return names

    mc = ModelConfig(model=str(tiny_llama_gguf_quantized))
    cpu = torch.device("cpu")
    whole, whole_reads = loaded()
    first, first_reads = loaded(PipelineParallelGroup(0, 2))
    last, last_reads = loaded(PipelineParallelGroup(1, 2))
    assert sorted(first_reads + last_reads) == sorted(whole_reads)
    assert not any(n.startswith("blk.2.") for n in first_reads) and not any(n.startswith("blk.0.") for n in last_reads)
    assert first.num_layers == 2 and last.num_layers == 1
    assert {n.split(".")[2] for n in weights(first) if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in weights(last) if n.startswith("model.layers.")} == {"2"}
    assert any("embed_tokens" in n for n in weights(first)) and not any("embed_tokens" in n for n in weights(last))
    assert not any(n.startswith(("lm_head", "model.norm")) for n in weights(first))
    assert any(n.startswith("lm_head") for n in weights(last))
    assert any(n.startswith("model.norm") for n in weights(last))
    assert any(getattr(m, "quant_weight", None) is not None for m in first.model.layers[0].modules()), \
        "the stage's linears stay quantized"
    assert weights(first) | weights(last) == weights(whole)
    assert not weights(first) & weights(last)


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.engine_core.executor.procs]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_pipeline_parallel_is_bitwise_the_in_process_engine(tiny_llama_dir, reference, one_thread, size):
    """Greedy tokens, sample logprobs, prompt logprobs and seeded samples all equal the float bits of size 1; each
    stage's KV cache holds its layers only; no process is left after shutdown."""
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=size, **POOL)
    pids = _worker_pids(llm)
    specs = llm.llm_engine.engine_core.executor.collective_rpc("kv_cache_spec")
    blocks = llm.llm_engine.engine_core.executor.collective_rpc("determine_num_blocks")
    print(f"FIGURE PP={size}: KV bytes per block per stage {[s[0] for s in specs]}, blocks each stage's "
          f"{POOL['kv_cache_memory'] >> 20} MiB holds {blocks} (pool: the minimum)")
    result = _run(llm)
    assert len(pids) == size
    per_layer = specs[0][0] // (2 if size == 2 else 1)  # stage 0 of 2 holds 2 layers, of 3 one
    assert [s[0] for s in specs] == ([2 * per_layer, per_layer] if size == 2 else [per_layer] * 3)
    assert result["tokens"] == reference["tokens"]
    assert result["logprobs"] == reference["logprobs"]
    assert result["prompt_logprobs"] == reference["prompt_logprobs"]
    assert result["sampled"] == reference["sampled"]
    print(f"FIGURE PP={size} vs PP=1 tiny Llama: {len(PROMPTS)} prompts x {GREEDY.max_tokens} tokens, logprobs and "
          "prompt logprobs bitwise equal")
    assert not any(pid_alive(pid) for pid in pids)


@pytest.mark.slow
def test_pipeline_and_tensor_parallel_together(tiny_llama_dir, reference, one_thread):
    """tp 2 x pp 2 = 4 processes: each stage's two ranks split its layers and all-reduce in their own group, and
    each hands its hidden state to its peer in the next stage. Greedy tokens and seeded samples equal size 1's; the
    logprobs differ only by the all-reduce's summation order."""
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, tensor_parallel_size=2, **POOL)
    pids = _worker_pids(llm)
    assert all(maps_segment(pid) for pid in pids)  # each stage's group all-reduces over its own segment
    result = _run(llm)
    assert len(pids) == 4
    assert result["tokens"] == reference["tokens"]
    assert result["sampled"] == reference["sampled"]
    deltas = [abs(a.logprob - b.logprob) for x, y in zip(result["logprobs"], reference["logprobs"], strict=True)
              for step_a, step_b in zip(x, y, strict=True)
              for a, b in zip(step_a.values(), step_b.values(), strict=False)]
    print(f"FIGURE TP=2 x PP=2 vs size 1 tiny Llama: tokens identical, max |delta logprob| {max(deltas):.2e}")
    assert max(deltas) < 1e-4
    assert not any(pid_alive(pid) for pid in pids)


@pytest.mark.slow
def test_fp8_kv_cache_scales_calculated_stage_by_stage(tiny_llama_dir, one_thread):
    """An fp8 KV cache calculates its scales from the calibration text at load: each stage for its layers, the
    text's hidden state passed along as in a step. Scales, and so tokens and logprobs, bitwise size 1's."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    outputs = []
    for size in (1, 2):
        llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=size, kv_cache_dtype="fp8", **POOL)
        try:
            outputs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                            for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_pipeline_parallel_with_tied_embeddings(tiny_llama_dir, tmp_path, one_thread):
    """Tied LM head (the MQA model of test_executor.py, 2 layers): the last stage loads the embedding table as its
    LM head; greedy tokens equal size 1's."""
    from test_executor import _mqa_llama

    folder = _mqa_llama(tiny_llama_dir, tmp_path / "tied")
    prompts = [[5, 17, 42, 100, 7], [300, 301, 2, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = []
    for size in (1, 2):
        llm = LLM(str(folder), pipeline_parallel_size=size, **POOL)
        try:
            outputs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                            for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_killed_stage_ends_the_engine(tiny_llama_dir):
    """The middle stage of 3 killed while the engine idles: the failure callback fires, the next step raises
    ExecutorDeadError instead of waiting (the other stages would block in a receive), no process is left."""
    import threading

    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.executor.abstract import ExecutorDeadError
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(EngineConfig.from_kwargs(model=str(tiny_llama_dir), pipeline_parallel_size=3, **POOL))
    pids = [p.pid for p in executor.procs]
    try:
        reasons: list[str] = []
        called = threading.Event()
        executor.register_failure_callback(lambda reason: (reasons.append(reason), called.set()))
        executor.initialize_kv_cache(executor.determine_num_blocks())
        os.kill(pids[1], signal.SIGKILL)
        assert called.wait(5.0), "no failure callback within 5 s"
        assert "worker 1" in reasons[0] and "exit code -9" in reasons[0]
        with pytest.raises(ExecutorDeadError):
            executor.execute_model(SchedulerOutput.empty())
    finally:
        executor.shutdown()
    assert not any(pid_alive(pid) for pid in pids)


@pytest.mark.slow
def test_stage_killed_during_a_step_ends_the_engine(tiny_llama_dir):
    """The middle stage of 3 frozen (SIGSTOP) so that a step is surely in flight, then killed: the stages waiting
    on it see the closed connection, generate raises ExecutorDeadError within seconds instead of hanging, and
    shutdown leaves no process."""
    import threading
    import time

    from pagedllm.executor.abstract import ExecutorDeadError

    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=3, **POOL)
    pids = _worker_pids(llm)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError):
            llm.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
        elapsed = time.monotonic() - start
        print(f"FIGURE stage killed mid-step: generate raised after {elapsed:.2f} s (killed at 1.0 s)")
        assert elapsed < 120.0  # a hang guard: it raised, not waited forever
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(pid_alive(pid) for pid in pids)


# ---- the batch queue: up to pp steps in flight ----------------------------------------------------------------

QUEUE_PROMPTS = [[(7 * i + 3 * j) % 380 + 2 for j in range(n)] for i, n in enumerate((70, 9, 41, 23, 96, 5))]
"""Six prompts of different lengths; with 32 tokens a step, the long ones take several prefill chunks."""
QUEUE_ARGS = {"max_num_batched_tokens": 32, **POOL}


def _greedy_tokens(llm: LLM, prompts, max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def queue_reference(tiny_llama_dir, one_thread):
    llm = LLM(str(tiny_llama_dir), **QUEUE_ARGS)
    try:
        return _greedy_tokens(llm, QUEUE_PROMPTS)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _overlaps(spans: list[list[tuple[float, float]]]) -> list[float]:
    """For each step k: how long stage 0 had already been running step k+1 when stage 1 finished step k (negative:
    it started after). In lock-step (one step at a time) every value is negative."""
    first, last = spans[0], spans[-1]
    assert len(first) == len(last)  # every stage runs every step
    return [last[k][1] - first[k + 1][0] for k in range(len(first) - 1)]


@pytest.mark.slow
def test_batch_queue_keeps_two_steps_in_flight_with_the_same_tokens(tiny_llama_dir, queue_reference, one_thread):
    """PP=2, six concurrent requests of 5 to 96 tokens with 32-token steps (chunked prefill): greedy tokens equal
    PP=1's, the engine core had two steps in flight, and stage 0 started steps while stage 1 was still running the
    one before (the stages' own clocks)."""
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **QUEUE_ARGS)
    try:
        tokens = _greedy_tokens(llm, QUEUE_PROMPTS)
        core = llm.llm_engine.engine_core
        spans = core.executor.collective_rpc("get_step_spans")
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert tokens == queue_reference
    assert core.max_batch_queue_depth == 2
    overlaps = _overlaps(spans)
    overlapped = [o for o in overlaps if o > 0]
    print(f"FIGURE PP=2 batch queue: {len(overlapped)} of {len(overlaps)} steps overlapped the stage before, "
          f"median overlap {1e3 * sorted(overlapped)[len(overlapped) // 2] if overlapped else 0:.2f} ms")
    # In lock-step no step overlaps; how many do depends on how the OS shares busy cores between the two stage
    # processes (40 of 44 quiet, 4 of 44 with both cores loaded by other work), so: at least one
    assert overlapped, overlaps


@pytest.mark.slow
def test_abort_while_the_request_is_in_flight(tiny_llama_dir, queue_reference, one_thread):
    """A request aborted while a step holding it is in flight: its late output is dropped, the other requests'
    greedy tokens equal PP=1's, every KV block is free again and the engine keeps serving."""
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **QUEUE_ARGS)
    engine = llm.llm_engine
    core = engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        for i, prompt in enumerate(QUEUE_PROMPTS):
            engine.add_request(str(i), prompt, params)
        victim = "4"  # the longest prompt: several prefill chunks, so it is in flight for many steps
        outputs: dict[str, list[int]] = {}
        aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert not (aborted and out.request_id == victim), "an output after the abort"
                outputs[out.request_id] = out.outputs[0].token_ids
            if not aborted and any(victim in so.num_scheduled_tokens for _, so in core.batch_queue):
                engine.abort_request([victim])
                aborted = True
        assert aborted
        while core.has_unfinished_requests():  # the steps still in flight
            assert not core.step().outputs
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_blocks
        assert victim not in outputs or len(outputs[victim]) < 20
        assert [outputs[str(i)] for i in range(len(QUEUE_PROMPTS)) if str(i) != victim] == \
            [t for i, t in enumerate(queue_reference) if str(i) != victim]
        assert _greedy_tokens(llm, QUEUE_PROMPTS) == queue_reference  # no stale row left on a stage
    finally:
        core.shutdown()
