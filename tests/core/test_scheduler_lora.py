"""LoRA in the scheduler: --max-loras bounds the distinct adapters of a step, and the prefix cache keys blocks by
adapter (block 0's extra keys hold the adapter's name, as vLLM's hold lora_name)."""

from __future__ import annotations

from tests.core.utils import step

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import LoRARequest
from pagedllm.sampling_params import SamplingParams

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")


def _scheduler(max_loras: int | None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                     CacheConfig(block_size=4, enable_prefix_caching=True), 200, 512, max_loras=max_loras)


def _request(req_id: str, lora: LoRARequest | None, prompt: list[int] | None = None) -> Request:
    return Request(req_id, prompt or [int(req_id) * 10 + j for j in range(9)], SamplingParams(max_tokens=2),
                   None, 0.0, 4, lora_request=lora)


def test_max_loras_holds_back_a_third_adapter_request_until_the_first_finishes():
    scheduler = _scheduler(max_loras=1)
    for req_id, lora in (("0", A), ("1", B), ("2", A), ("3", None)):
        scheduler.add_request(_request(req_id, lora))
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["0", "2", "3"]  # B would be a second adapter: it waits, keeping its place
    assert [r.lora_request for r in out.scheduled_new_reqs] == [A, A, None]
    out, _ = step(scheduler)  # the A requests still run (max_tokens 2): B still waits
    assert list(out.num_scheduled_tokens) == ["0", "2", "3"] and not scheduler.running
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["1"] and out.scheduled_new_reqs[0].lora_request == B


def test_no_max_loras_admits_every_adapter():
    scheduler = _scheduler(max_loras=2)
    for req_id, lora in (("0", A), ("1", B), ("2", None)):
        scheduler.add_request(_request(req_id, lora))
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["0", "1", "2"]


def test_prefix_cache_never_shares_blocks_across_adapters_and_shares_within_one():
    prompt = list(range(100, 109))  # two full blocks of 4
    scheduler = _scheduler(max_loras=2)
    cached = {}
    for req_id, lora in (("0", A), ("1", B), ("2", None), ("3", A), ("4", None)):
        scheduler.add_request(_request(req_id, lora, prompt))
        out, _ = step(scheduler)
        cached[req_id] = out.scheduled_new_reqs[0].num_computed_tokens
        while scheduler.running:
            step(scheduler)
    assert cached == {"0": 0, "1": 0, "2": 0, "3": 8, "4": 8}
    hashes = {r: _request(r, lora, prompt).block_hashes for r, lora in (("0", A), ("1", B), ("2", None))}
    assert len({h[0] for h in hashes.values()}) == 3 and len({h[1] for h in hashes.values()}) == 3
