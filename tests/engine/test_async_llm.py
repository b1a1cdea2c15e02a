"""AsyncLLM against the in-process mock engine core (real wire envelopes, no model, no process): streaming and
detokenizing, n > 1, abort when the consumer leaves, a full queue, engine death, a stalled consumer."""

from __future__ import annotations

import asyncio

import pytest
from mock_engine_core import MockEngineCore, collect, run_scenario

from pagedllm.core.scheduler import QueueFullError
from pagedllm.engine.async_llm import RequestAbortedError, RequestFailedError
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.messages import ModelLimits
from pagedllm.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=384, max_model_len=128, eos_token_id=2)
PROMPT = [40, 41, 42]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _run(scenario, tokenizer, watchdog_timeout_s: float | None = None, **engine_kwargs):
    run_scenario(scenario, MockEngineCore(LIMITS, **engine_kwargs), tokenizer, max_buffered_outputs=8,
                 watchdog_timeout_s=watchdog_timeout_s)


def test_streams_detokenized_deltas_until_length(tokenizer):
    async def scenario(engine, llm):
        stream = llm.add_request("r", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), "p", "delta")
        consumer = asyncio.ensure_future(collect(stream))
        await engine.run_until_idle()
        outputs = await consumer
        tokens = [t for o in outputs for t in o.outputs[0].token_ids]
        assert tokens == [43, 44, 45, 46, 47]
        assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(tokens)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outputs[:-1])
        assert llm.num_open_requests == 0 and engine.added == ["r"]

    _run(scenario, tokenizer)


def test_n_children_are_sent_after_the_first_and_merged(tokenizer):
    async def scenario(engine, llm):
        params = SamplingParams(n=3, seed=1, max_tokens=2, ignore_eos=True)
        consumer = asyncio.ensure_future(collect(llm.add_request("r", PROMPT, params, None, "cumulative")))
        await asyncio.sleep(0)
        assert engine.added == ["0_r"]  # the others wait for child 0's prompt (prefix cache)
        await engine.run_until_idle()
        assert sorted(engine.added) == ["0_r", "1_r", "2_r"]
        final = (await consumer)[-1]
        assert final.finished and sorted(c.index for c in final.outputs) == [0, 1, 2]
        assert all(len(c.token_ids) == 2 for c in final.outputs)

    _run(scenario, tokenizer)


def test_leaving_the_stream_aborts_in_the_engine(tokenizer):
    async def scenario(engine, llm):
        stream = llm.add_request("r", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), None, "delta")
        await engine.step()
        first = await stream.__anext__()
        assert first.outputs[0].token_ids == [43]
        await stream.aclose()  # the client disconnected
        await asyncio.sleep(0)
        assert engine.aborted == ["r"] and engine.running == {}
        assert llm.num_open_requests == 0

    _run(scenario, tokenizer)


def test_stop_string_aborts_the_engine_request(tokenizer):
    async def scenario(engine, llm):
        full = tokenizer.decode([43, 44, 45, 46])
        stop = full[len(tokenizer.decode([43])) - 1:][:2]  # spans the first two tokens' texts
        params = SamplingParams(max_tokens=50, ignore_eos=True, stop=[stop])
        consumer = asyncio.ensure_future(collect(llm.add_request("r", PROMPT, params, None, "cumulative")))
        await engine.run_until_idle()
        final = (await consumer)[-1]
        assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
        assert final.outputs[0].text == full[:full.index(stop)]
        assert engine.aborted == ["r"]  # the frontend found the stop string: the engine must stop too

    _run(scenario, tokenizer)


def test_a_request_ended_by_a_stop_string_is_not_counted_as_unfinished(tokenizer):
    """It stayed counted as an unfinished engine request: admission saw a phantom waiting request, and the hang
    watchdog declared the idle engine hung once the timeout passed with no step."""
    async def scenario(engine, llm):
        full = tokenizer.decode([43, 44, 45, 46])
        stop = full[len(tokenizer.decode([43])) - 1:][:2]
        params = SamplingParams(max_tokens=50, ignore_eos=True, stop=[stop])
        consumer = asyncio.ensure_future(collect(llm.add_request("r", PROMPT, params, None, "cumulative")))
        await engine.run_until_idle()
        assert (await consumer)[-1].outputs[0].finish_reason == "stop"
        await asyncio.sleep(0.6)  # idle past the watchdog's 0.2 s
        assert not llm.is_dead and llm.router.num_unfinished(0) == 0
        assert llm.estimated_num_waiting() == 0

    _run(scenario, tokenizer, watchdog_timeout_s=0.2)


def test_a_full_queue_fails_the_request(tokenizer):
    async def scenario(engine, llm):
        running = llm.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), None, "delta")
        rejected = llm.add_request("b", PROMPT, SamplingParams(max_tokens=5), None, "delta")
        with pytest.raises(QueueFullError):
            await collect(rejected)
        assert llm.num_open_requests == 1
        await running.aclose()

    _run(scenario, tokenizer, max_num_waiting=1)


def test_engine_death_fails_open_and_new_requests(tokenizer):
    async def scenario(engine, llm):
        stream = llm.add_request("r", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), None, "delta")
        await engine.step()
        assert (await stream.__anext__()).outputs[0].token_ids == [43]
        engine.die()
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await stream.__anext__()
        with pytest.raises(EngineDeadError):
            llm.add_request("s", PROMPT, SamplingParams(max_tokens=5), None, "delta")
        assert llm.is_dead

    _run(scenario, tokenizer)


def test_a_consumer_that_stops_reading_is_aborted(tokenizer):
    async def scenario(engine, llm):
        stream = llm.add_request("r", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), None, "delta")
        for _ in range(12):  # more outputs than max_buffered_outputs=8, none read
            await engine.step()
        assert "r" in engine.aborted and engine.running == {}
        outputs = []
        with pytest.raises(RequestAbortedError, match="did not read 8"):
            async for output in stream:
                outputs.append(output)
        assert len(outputs) == 8

    _run(scenario, tokenizer)


def test_finish_all_aborted_ends_streams_with_abort(tokenizer):
    async def scenario(engine, llm):
        stream = llm.add_request("r", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), None, "cumulative")
        await engine.step()
        llm.finish_all_aborted()  # the drain timeout
        outputs = await collect(stream)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await asyncio.sleep(0)
        assert engine.aborted == ["r"] and engine.running == {}

    _run(scenario, tokenizer)


def test_a_request_whose_output_handling_raises_fails_alone(tokenizer):
    """A padded-vocab model (512 rows, 384 tokens) sampled id 500 for one request: its detokenizer raises. That
    request fails (aborted in the engine, counted as an error); the other streams on to its end."""
    def next_token(request, i):
        return 500 if request.request_id == "bad" and i == 2 else 43 + i

    async def scenario(engine, llm):
        bad = asyncio.ensure_future(collect(llm.add_request("bad", PROMPT, SamplingParams(max_tokens=20,
                                                                                           ignore_eos=True))))
        good = asyncio.ensure_future(collect(llm.add_request("good", PROMPT, SamplingParams(max_tokens=6,
                                                                                             ignore_eos=True))))
        await engine.run_until_idle()
        with pytest.raises(RequestFailedError, match="error id"):
            await bad
        outputs = await good
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode([43 + i for i in range(6)])
        assert engine.aborted == ["bad"] and engine.running == {}
        assert llm.num_open_requests == 0 and llm.router.num_unfinished(0) == 0 and not llm.is_dead
        assert b'vllm:request_success_total{finished_reason="error",model_name="mock"} 1.0' in llm.prometheus.render()

    _run(scenario, tokenizer, next_token=next_token)
