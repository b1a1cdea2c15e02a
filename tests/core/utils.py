"""Helpers for scheduler tests: build schedulers, requests and runner outputs without a model."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.messages import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

EOS_TOKEN_ID = 50000


def create_scheduler(
    num_blocks: int = 10000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    max_num_queued_reqs: int | None = None,
    max_prefill_attention_pairs: int | None = None,
    speculative_config: SpeculativeConfig | None = None,
    slo_max_wait_s: float = 30.0,
) -> Scheduler:
    if max_model_len is None:
        max_model_len = min(max_num_batched_tokens, num_blocks * block_size)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
        max_num_queued_reqs=max_num_queued_reqs,
        slo_max_wait_s=slo_max_wait_s,
        **({} if max_prefill_attention_pairs is None else {"max_prefill_attention_pairs": max_prefill_attention_pairs}),
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, num_blocks, max_model_len, speculative_config)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    block_size: int = 16,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    same_prompt: bool = False,
    prompt_token_ids: list[int] | None = None,
    priorities: list[int] | None = None,
    arrival_times: list[float] | None = None,
    cache_salt: str | None = None,
    id_prefix: str = "",
) -> list[Request]:
    """Requests with distinct prompts (token ids i*num_tokens + j) unless same_prompt or given."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos)
    requests = []
    for i in range(num_requests):
        if prompt_token_ids is not None:
            prompt = list(prompt_token_ids)
        elif same_prompt:
            prompt = list(range(num_tokens))
        else:
            prompt = [i * num_tokens + j for j in range(num_tokens)]
        requests.append(Request(
            request_id=f"{id_prefix}{i}",
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_id=EOS_TOKEN_ID,
            arrival_time=arrival_times[i] if arrival_times else float(i),
            block_size=block_size,
            priority=priorities[i] if priorities else 0,
            cache_salt=cache_salt,
        ))
    return requests


def make_output(scheduler: Scheduler, output: SchedulerOutput, token_id: int = 0,
                tokens: dict[str, int] | None = None) -> ModelRunnerOutput:
    """A runner output sampling one token for every request whose scheduled tokens reach its end."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        if request is not None and request.num_computed_tokens >= request.num_tokens:
            sampled.append([tokens.get(req_id, token_id) if tokens else token_id])
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler, token_id: int = 0, tokens: dict[str, int] | None = None):
    """One schedule + update; returns (SchedulerOutput, EngineCoreOutputs)."""
    output = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(output, make_output(scheduler, output, token_id, tokens))
    return output, engine_outputs


def check_pool_invariants(scheduler: Scheduler) -> None:
    """Ref counts match the block tables; free queue, hash map and counts are consistent."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    expected_refs = [0] * pool.num_blocks
    for blocks in kv.req_to_blocks.values():
        for block in blocks:
            expected_refs[block.block_id] += 1
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free) == pool.get_num_free_blocks()
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == expected_refs[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert len(free) + in_use == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached_block_hash_to_block)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def assert_all_free(scheduler: Scheduler) -> None:
    """DESIGN invariant 1."""
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not scheduler.kv_cache_manager.req_to_blocks
