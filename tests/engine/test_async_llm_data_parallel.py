"""AsyncLLM over two mock engine cores (data parallelism, no process): requests follow their cached prefix or
go to the less loaded replica, n > 1 children and aborts reach their request's replica, a replica's death fails
the whole server, and the metrics carry an `engine` label per replica."""

from __future__ import annotations

import asyncio

import pytest
from mock_engine_core import MockEngineCore, collect, run_scenario

from pagedllm.engine.core_client import EngineDeadError
from pagedllm.messages import ModelLimits
from pagedllm.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=384, max_model_len=128, eos_token_id=2)
PREFIX = list(range(100, 148))  # 3 blocks of 16
OTHER = list(range(200, 248))
LONG = SamplingParams(max_tokens=60, ignore_eos=True)


def _run(scenario, tokenizer):
    run_scenario(scenario, [MockEngineCore(LIMITS), MockEngineCore(LIMITS)], tokenizer)


def test_prefix_then_load_decide_and_children_and_aborts_follow_the_replica(tiny_tokenizer):
    async def scenario(engines, llm):
        llm.add_request("a", PREFIX + [1], LONG, None, "delta")  # idle replicas: rank 0
        llm.add_request("b", OTHER + [1], LONG, None, "delta")  # no cached prefix: the less loaded, 1
        llm.add_request("c", PREFIX + [2], LONG, None, "delta")  # its prefix is on 0
        await asyncio.sleep(0)
        assert engines[0].added == ["a", "c"] and engines[1].added == ["b"]
        llm.abort("c")  # as a client's disconnect does
        await asyncio.sleep(0)
        assert engines[0].aborted == ["c"] and engines[1].aborted == []
        params = SamplingParams(n=3, seed=1, max_tokens=2, ignore_eos=True)
        d = asyncio.ensure_future(collect(llm.add_request("d", OTHER + [2], params, None, "cumulative")))
        await asyncio.sleep(0)
        assert engines[1].added == ["b", "0_d"]  # its prefix is on 1
        await asyncio.gather(*(engine.step() for engine in engines))  # child 0 computed the prompt: 1 and 2 go
        await asyncio.sleep(0)
        assert engines[1].added == ["b", "0_d", "1_d", "2_d"] and engines[0].added == ["a", "c"]
        for _ in range(2):
            await engines[1].step()
        assert (await d)[-1].finished
        for request_id in ("a", "b"):
            llm.abort(request_id)
        await asyncio.sleep(0)
        assert llm.router.loads() == [0, 0] and engines[0].running == {} and engines[1].running == {}
        text = llm.prometheus.render().decode()
        assert 'vllm:generation_tokens_total{engine="1",model_name="mock"} 9.0' in text  # b's 3, d's 3 x 2
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="mock"} 2.0' in text
        assert 'vllm:num_requests_running{engine="0",model_name="mock"}' in text

    _run(scenario, tiny_tokenizer)


def test_a_dead_replica_fails_the_whole_server_fast(tiny_tokenizer):
    """Issue 32 item 7 (before: the other replica kept serving, /health 503 for ever, the dead replica's gauges
    frozen): every open stream fails, on the live replica too, which aborts its request; new requests are refused;
    on_death stops the server once; the dead replica's gauges leave /metrics, its counters stay."""
    async def scenario(engines, llm):
        deaths: list[str] = []
        llm.on_death = deaths.append
        a = llm.add_request("a", PREFIX + [1], LONG, None, "delta")
        b = llm.add_request("b", OTHER + [1], LONG, None, "delta")
        await asyncio.gather(*(engine.step() for engine in engines))
        assert len((await a.__anext__()).outputs[0].token_ids) == 1
        assert len((await b.__anext__()).outputs[0].token_ids) == 1
        text = llm.prometheus.render().decode()
        assert 'vllm:num_requests_running{engine="1",model_name="mock"} 1.0' in text
        engines[1].die()
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await b.__anext__()
        with pytest.raises(EngineDeadError, match="engine 1: .*exit code -9"):
            await asyncio.wait_for(a.__anext__(), 30.0)  # on the live replica: failed too, and aborted there
        await asyncio.sleep(0)
        assert engines[0].aborted == ["a"] and engines[0].running == {}
        assert llm.is_dead and len(deaths) == 1 and llm.dead_reason.startswith("engine 1: ")
        assert llm.num_open_requests == 0 and llm.router.loads() == [0, 0]
        with pytest.raises(EngineDeadError, match="engine 1"):
            await llm.check_health(1.0)  # /health answers 503
        with pytest.raises(EngineDeadError, match="engine 1"):
            llm.add_request("c", OTHER + [2], LONG, None, "delta")  # new requests: 503
        await asyncio.sleep(0.05)
        text = llm.prometheus.render().decode()
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                      "pagedllm:kv_cache_free_blocks", "pagedllm:kv_cache_total_blocks"):
            assert f'{gauge}{{engine="1"' not in text, gauge
            assert f'{gauge}{{engine="0"' in text, gauge
        assert 'vllm:prompt_tokens_total{engine="1",model_name="mock"}' in text  # counters keep their totals
        engines[0].die()  # while stopping: nothing more happens
        assert len(deaths) == 1

    _run(scenario, tiny_tokenizer)
