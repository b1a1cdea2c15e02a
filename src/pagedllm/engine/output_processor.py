"""OutputProcessor: the one frontend loop per step that turns EngineCoreOutputs into RequestOutputs.

It detokenizes incrementally, checks stop strings (a hit finishes the request here and asks the engine
to abort it, the same step), converts logprobs, keeps per-request timings for metrics, and aggregates
the n sibling requests of a parent request.

An error while handling one request's output (its detokenizer raising, say) fails that request alone: it is
logged with its traceback, the request (with its n siblings) finishes with an error and is aborted in the
engine, and the other requests of the step go on as if nothing happened.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsEntry
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)

logger = logging.getLogger(__name__)

OutputKind = Literal["cumulative", "delta", "final_only"]


@dataclass
class ParentRequest:
    """A request with n > 1, run as n child requests `f"{i}_{request_id}"` sharing the prompt's blocks.

    Child 0 goes to the engine first; the others wait in `pending` until child 0 has computed the whole
    prompt (its first token arrives), so their prompts hit the prefix cache instead of being recomputed.
    """

    request_id: str
    n: int
    pending: list[EngineCoreRequest] = field(default_factory=list)
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Child 0's (the only child that computes them)."""
    kv_transfer_params: dict | None = None

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    max_logprobs: int | None
    parent: ParentRequest | None
    index: int
    output_kind: OutputKind
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None
    is_pooling: bool = False
    """A pooling request: its one output is an EmbeddingRequestOutput with `pooled`."""
    pooled: list[float] | None = None
    kv_transfer_params: dict | None = None
    """The KV connector's, sent with the request's finish."""


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests finished here by a stop string: the engine must abort them."""
    reqs_to_add: list[EngineCoreRequest] = field(default_factory=list)
    """Sibling requests released now that their first sibling has cached the prompt."""
    reqs_failed: list[str] = field(default_factory=list)
    """Requests (engine ids) failed here by an error in their output handling: the engine must abort those it
    still runs, and they count as finished with an error."""


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0, output_kind: OutputKind = "cumulative") -> None:
        params = request.sampling_params
        detokenizer = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
                       if params.detokenize and self.tokenizer is not None and request.pooling_params is None
                       else None)
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id, prompt=prompt, prompt_token_ids=request.prompt_token_ids,
            detokenizer=detokenizer, max_logprobs=params.logprobs, parent=parent, index=index,
            output_kind=output_kind, arrival_time=request.arrival_time,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            is_pooling=request.pooling_params is not None)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        """Forget requests (and a parent's children); returns the engine-side ids to abort."""
        aborted = []
        for req_id in req_ids:
            for rid, state in list(self.request_states.items()):
                if rid == req_id or (state.parent is not None and state.parent.request_id == req_id):
                    del self.request_states[rid]
                    aborted.append(rid)
        return aborted

    def finish_requests(self, req_id: str, finish_reason: str) -> tuple[list[RequestOutput], list[str]]:
        """End a request (all of a parent's children) here with finish_reason, as if the engine had:
        returns the last outputs (the text so far, flushed) and the engine-side ids to abort."""
        request_outputs: list[RequestOutput] = []
        finished = []
        for rid, state in list(self.request_states.items()):
            if rid not in self.request_states:  # failed below with a sibling
                continue
            if rid == req_id or (state.parent is not None and state.parent.request_id == req_id):
                if state.parent is not None:
                    state.parent.pending.clear()
                state.finish_reason = finish_reason
                try:
                    request_output = self._make_request_output(state)
                except Exception as e:  # the last flush of its text raised: it fails instead
                    request_output, failed = self._fail(state, e)
                    finished.extend(failed)
                    request_outputs.append(request_output)
                    continue
                del self.request_states[rid]
                finished.append(rid)
                if request_output is not None:
                    request_outputs.append(request_output)
        return request_outputs, finished

    def process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        reqs_to_add: list[EngineCoreRequest] = []
        reqs_failed: list[str] = []
        now = time.time()
        for out in outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:  # aborted in the frontend already
                continue
            try:
                stopped_here = self._update(state, out, now)
                request_output = self._make_request_output(state)
            except Exception as e:
                request_output, failed = self._fail(state, e)
                reqs_failed.extend(failed)
                request_outputs.append(request_output)
                continue
            if stopped_here:
                reqs_to_abort.append(out.request_id)
            if state.parent is not None and state.parent.pending and (out.new_token_ids or out.finished):
                reqs_to_add.extend(state.parent.pending)
                state.parent.pending.clear()
            if state.finish_reason is not None:
                del self.request_states[out.request_id]
            if request_output is not None:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort, reqs_to_add, reqs_failed)

    def _fail(self, state: RequestState, error: Exception) -> tuple[RequestOutput, list[str]]:
        """One request's output handling raised: log it with its traceback and end the request (all of a
        parent's children) with an error. Returns its last output and the engine ids it leaves."""
        error_id = uuid.uuid4().hex[:16]
        request_id = state.parent.request_id if state.parent is not None else state.request_id
        logger.error("internal error %s: the output of request %s could not be processed; the request fails, "
                     "the others go on", error_id, request_id, exc_info=error)
        failed = []
        for rid, other in list(self.request_states.items()):
            if rid == request_id or (other.parent is not None and other.parent.request_id == request_id):
                del self.request_states[rid]
                failed.append(rid)
        if state.parent is not None:
            state.parent.pending.clear()  # never sent: nothing to abort in the engine
        message = f"The server had an error while processing the output of this request (error id {error_id})."
        output = RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                               outputs=[CompletionOutput(index=state.index, text="", token_ids=[],
                                                         finish_reason="error")],
                               finished=True, error=message)
        return output, failed

    # ---- per request ----------------------------------------------------------------------------
    def _update(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Apply one engine output. Returns True when a stop string finished the request here."""
        if out.first_scheduled_time is not None:
            state.first_scheduled_time = out.first_scheduled_time
            state.num_cached_tokens = out.num_cached_tokens
        if out.new_prompt_logprobs and state.prompt_logprobs is not None:
            if out.new_prompt_logprobs[0] is None:  # position 0: a first pass, or a recompute after preemption
                state.prompt_logprobs = []
            state.prompt_logprobs.extend(self._convert(e) if e is not None else None
                                         for e in out.new_prompt_logprobs)
        if out.new_token_ids:
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
            state.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and state.logprobs is not None:
                for entry in out.new_logprobs:
                    state.logprobs.append(self._convert(entry))
                    state.cumulative_logprob += entry.logprobs[0]
        stopped_here = False
        if state.detokenizer is not None and out.new_token_ids:
            stop_str = state.detokenizer.update(out.new_token_ids)
            if state.detokenizer.num_dropped:  # a stop string inside a run of accepted drafts
                del state.token_ids[len(state.token_ids) - state.detokenizer.num_dropped:]
            if stop_str is not None and out.finish_reason is None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                stopped_here = True
            elif stop_str is not None:
                state.finish_reason, state.stop_reason = "stop", stop_str
        if out.pooled is not None:
            state.pooled = out.pooled
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if out.finish_reason is not None and state.finish_reason is None:
            state.finish_reason = str(out.finish_reason)
            state.stop_reason = out.stop_reason
            state.error = out.error
            state.error_code = out.error_code
        return stopped_here

    def _convert(self, entry: LogprobsEntry) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for i, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if token_id not in result:
                rank = entry.rank if i == 0 else i
                result[token_id] = Logprob(logprob, rank, decode_token(self.tokenizer, token_id))
        return result

    def _completion_output(self, state: RequestState) -> CompletionOutput:
        finished = state.finish_reason is not None
        delta = state.output_kind == "delta"
        text = state.detokenizer.get_next_output_text(finished, delta) if state.detokenizer else ""
        start = state.num_sent_tokens if delta else 0
        token_ids = state.token_ids[start:]
        logprobs = state.logprobs[start:] if state.logprobs is not None else None
        state.num_sent_tokens = len(state.token_ids)
        return CompletionOutput(index=state.index, text=text, token_ids=token_ids,
                                cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
                                finish_reason=state.finish_reason, stop_reason=state.stop_reason)

    def _make_request_output(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput | None:
        finished = state.finish_reason is not None
        if state.output_kind == "final_only" and not finished:
            return None
        if state.is_pooling:
            return EmbeddingRequestOutput(request_id=state.request_id, outputs=EmbeddingOutput(state.pooled or []),
                                          prompt_token_ids=state.prompt_token_ids, finished=True,
                                          num_cached_tokens=state.num_cached_tokens, prompt=state.prompt,
                                          error=state.error or (None if state.pooled is not None else
                                                                f"The request ended without a vector "
                                                                f"({state.finish_reason})."))
        completion = self._completion_output(state)
        parent = state.parent
        request_id = state.request_id
        outputs = [completion]
        prompt_logprobs = state.prompt_logprobs
        kv_transfer_params = state.kv_transfer_params
        if parent is not None:
            request_id = parent.request_id
            if state.index == 0:
                parent.prompt_logprobs = state.prompt_logprobs
            prompt_logprobs = parent.prompt_logprobs
            parent.outputs[state.index] = completion
            parent.num_finished += finished
            if kv_transfer_params is not None:  # n > 1: the first child's that has any (vLLM: one per request)
                parent.kv_transfer_params = parent.kv_transfer_params or kv_transfer_params
            kv_transfer_params = parent.kv_transfer_params
            finished = parent.num_finished == parent.n
            if state.output_kind == "final_only" and not finished:
                return None
            if state.output_kind != "delta":
                outputs = [parent.outputs[i] for i in sorted(parent.outputs)]
        metrics = {"arrival_time": state.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(state, name) is not None:
                metrics[name] = getattr(state, name)
        return RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             outputs=outputs, finished=finished, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=state.num_cached_tokens, metrics=metrics, error=state.error,
                             error_code=state.error_code,
                             kv_transfer_params=kv_transfer_params if finished else None)
