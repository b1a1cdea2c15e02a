"""The engine-core process through EngineCoreClient, without HTTP: READY, outputs, aborts, utility calls,
undecodable input, startup failure, and the private socket directory."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineCoreClient, EngineStartupError
from pagedllm.messages import EngineCoreRequest, Outputs
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def _config(model, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model), dtype="float32", kv_cache_memory=16 << 20, **kwargs)


def _request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(range(20, 40)),
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                             eos_token_id=None, arrival_time=time.time())


async def _scenario(model) -> None:
    client = await EngineCoreClient.start(_config(model), startup_timeout_s=120)
    try:
        socket_dir = client.socket_dir
        assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
        assert client.ready.limits.vocab_size == 384 and client.ready.max_model_len == 512
        total = client.ready.num_blocks
        messages: asyncio.Queue = asyncio.Queue()
        client.on_message = messages.put_nowait

        async def next_outputs() -> Outputs:
            while not isinstance(message := await asyncio.wait_for(messages.get(), 10), Outputs):
                pass
            return message

        # undecodable input is dropped; the engine keeps serving
        await client.input_socket.send(b"\xc1 not msgpack")
        await client.add_request(_request("a", max_tokens=5))
        tokens = []
        while True:
            message = await next_outputs()
            out = next((o for o in message.outputs.outputs if o.request_id == "a"), None)
            if out is not None:
                tokens += out.new_token_ids
                if out.finished:
                    break
        assert len(tokens) == 5 and str(out.finish_reason) == "length"

        # abort mid-request: the blocks return to the pool and the stats say so
        await client.add_request(_request("b", max_tokens=400))
        await next_outputs()
        await client.abort_requests(["b"])
        deadline = time.monotonic() + 10
        while True:
            stats = (await client.call_utility("stats", timeout_s=5)).stats
            if stats.num_running_reqs == 0 or time.monotonic() > deadline:
                break
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks == total
        assert (await client.call_utility("ping", timeout_s=5)).step_running_s == 0.0  # idle
        assert not client.is_dead
    finally:
        client.shutdown()
    assert client.proc.poll() is not None
    assert not os.path.exists(socket_dir)


def test_engine_core_process_round_trip(tiny_llama_dir):
    asyncio.run(_scenario(tiny_llama_dir))


def test_startup_failure_carries_the_engine_message(tiny_llama_dir):
    async def start():
        await EngineCoreClient.start(_config(tiny_llama_dir, num_gpu_blocks_override=2), startup_timeout_s=120)

    with pytest.raises(EngineStartupError, match="max_model_len=512"):
        asyncio.run(start())
