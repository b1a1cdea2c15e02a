"""An in-process fake engine core for frontend tests: the interface of EngineCoreClient, the real wire envelopes.

Every message crosses a msgpack encode/decode, as on the sockets, so a field that does not survive the wire fails
here too. The fake "model" is a script: request `r` emits `next_token(r, i)` as its i-th output token (default:
the last prompt token + 1 + i, modulo the vocabulary), one per `step()`, and finishes on max_tokens, EOS or a
stop token id. Tests drive it step by step (`await engine.step()`), so nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    FromEngine,
    ModelLimits,
    Outputs,
    Ready,
    Rejected,
    SchedulerStats,
    ToEngine,
    UtilityCall,
    UtilityResult,
)

NUM_BLOCKS = 64


class MockEngineCore:
    def __init__(self, limits: ModelLimits, max_num_waiting: int | None = None,
                 next_token: Callable[[EngineCoreRequest, int], int] | None = None):
        self.ready = Ready(num_blocks=NUM_BLOCKS, block_size=16, max_model_len=limits.max_model_len, limits=limits,
                           model_name="mock", pid=0)
        self.max_num_waiting = max_num_waiting
        self.next_token = next_token or (lambda r, i: (r.prompt_token_ids[-1] + 1 + i) % limits.vocab_size)
        self.dead_reason: str | None = None
        self.on_message: Callable[[FromEngine], None] = lambda message: None
        self.on_death: Callable[[str], None] = lambda reason: None
        self.running: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.received: list[ToEngine] = []
        """Every message the frontend sent, decoded as the engine core decodes it."""
        self.num_added = 0
        self._to_engine = msgspec.msgpack.Decoder(ToEngine)
        self._from_engine = msgspec.msgpack.Decoder(FromEngine)
        self._encoder = msgspec.msgpack.Encoder()

    # ---- EngineCoreClient's interface -------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._receive(AddRequest(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            await self._receive(AbortRequests(request_ids))

    async def call_utility(self, method: str, timeout_s: float | None, *args: int | str) -> UtilityResult:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        await self._receive(UtilityCall(0, method, list(args)))  # type: ignore[arg-type]
        return self._wire(UtilityResult(0, self._stats() if method == "stats" else None))

    def mark_dead(self, reason: str) -> None:
        if not self.is_dead:
            self.dead_reason = reason
            self.on_death(reason)

    def request_stop(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # ---- the fake engine --------------------------------------------------------------------------------

    @property
    def aborted(self) -> list[str]:
        return [rid for m in self.received if isinstance(m, AbortRequests) for rid in m.request_ids]

    @property
    def added(self) -> list[str]:
        return [m.request.request_id for m in self.received if isinstance(m, AddRequest)]

    async def step(self) -> None:
        """One engine step: every running request emits its next token; the outputs go to the frontend."""
        await asyncio.sleep(0)  # let the frontend's pending sends arrive first
        outputs = []
        for request_id, (request, tokens) in list(self.running.items()):
            token = self.next_token(request, len(tokens))
            tokens.append(token)
            finish, stop_reason = self._finish(request, tokens)
            outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[token], finish_reason=finish,
                                            stop_reason=stop_reason))
            if finish is not None:
                del self.running[request_id]
        self._send(Outputs(EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats(), timestamp=time.time()),
                           self.num_added))
        await asyncio.sleep(0)

    async def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            await self.step()
            if not self.running:
                await asyncio.sleep(0)
                if not self.running:
                    return
        raise AssertionError("the mock engine still has running requests")

    def die(self, reason: str = "engine core process exited unexpectedly (exit code -9)") -> None:
        self.mark_dead(reason)

    # ---- wire -------------------------------------------------------------------------------------------

    def _wire(self, message):
        return self._from_engine.decode(self._encoder.encode(message))

    def _send(self, message: FromEngine) -> None:
        self.on_message(self._wire(message))

    async def _receive(self, message: ToEngine) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        message = self._to_engine.decode(self._encoder.encode(message))
        self.received.append(message)
        if isinstance(message, AddRequest):
            self.num_added += 1
            request = message.request
            if self.max_num_waiting is not None and len(self.running) >= self.max_num_waiting:
                self._send(Rejected(request.request_id, "queue_full", "The waiting queue is full."))
            else:
                self.running[request.request_id] = (request, [])
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.running.pop(request_id, None)

    def _finish(self, request: EngineCoreRequest, tokens: list[int]) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        token = tokens[-1]
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        if not params.ignore_eos and token == request.eos_token_id:
            return FinishReason.STOP, None
        if len(tokens) >= params.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running), num_total_blocks=NUM_BLOCKS,
                              num_free_blocks=NUM_BLOCKS)


async def collect(stream) -> list:
    """Every output of an AsyncLLM stream, until it ends."""
    return [output async for output in stream]


def run_scenario(scenario, engines, tokenizer, **llm_kwargs) -> None:
    """asyncio.run(scenario(engines, llm)) with an AsyncLLM over `engines` (one mock engine core, or a list of them
    for data parallelism), shut down afterwards whatever the scenario raised."""
    async def main():
        llm = AsyncLLM(engines, tokenizer, "mock", log_stats=False, **llm_kwargs)
        try:
            await scenario(engines, llm)
        finally:
            llm.shutdown()

    asyncio.run(main())
