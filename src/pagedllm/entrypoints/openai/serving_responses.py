"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path. A request's input
(and the stored conversation of its previous_response_id) becomes chat messages (responses_input.py), rendered by
the model's chat template with its tools; it runs as a chat completion would (tool calling, structured outputs via
`text.format`, the reasoning parser), and its output becomes output items: a reasoning item, a message, function
calls. `stream: true` sends OpenAI's event sequence (responses_stream.py). Responses are stored in memory unless
`store: false` (responses_store.py, bounded by --max-stored-responses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_prompt import ChatPrompts
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol import random_uuid
from pagedllm.entrypoints.openai.reasoning import RequestReasoning
from pagedllm.entrypoints.openai.responses_input import input_messages, output_messages
from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_stream import EventWriter, StreamedItems
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, merge_streams
from pagedllm.entrypoints.openai.structured_outputs import with_structured_outputs
from pagedllm.entrypoints.openai.tool_calling import ToolCalling
from pagedllm.sampling_params import SamplingParams

_PASSED_TO_CHAT = ("temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt",
                   "request_id", "user")
"""Fields that mean the same in a chat completion, passed as they are."""
_CHAT_PARAM = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *args, chat_prompts: ChatPrompts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_prompts = chat_prompts if chat_prompts is not None else ChatPrompts(self.tokenizer, self.config)
        self.store = ResponseStore(self.config.max_stored_responses)

    def retrieve(self, response_id: str) -> ResponsesResponse:
        """GET /v1/responses/{id}: a stored response (404 when unknown or dropped)."""
        return self.store.get(response_id).response

    async def create_response(self, request: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        self.check_model(request.model)
        _check_unsupported(request)
        previous = self.store.get(request.previous_response_id) if request.previous_response_id else None
        conversation = (list(previous.messages) if previous else []) + input_messages(request.input)
        if not conversation:
            raise errors.bad_request("input must not be empty.", param="input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        chat = _chat_request(request, system + conversation)
        self.check_request_caps(chat)
        self.engine.check_admission(1)
        tools = ToolCalling(chat, self.config)
        prompt = await self.chat_prompts.render(chat, tools.template_tools)
        token_ids = await self.encode(prompt, False)
        params = self.sampling_params(chat, request.max_output_tokens, None)
        params = await with_structured_outputs(chat, params, self.grammar_compile_timeout_s, self.json_options)
        params = await tools.constrain(params, self.grammar_compile_timeout_s, self.json_options)
        reasoning = self.request_reasoning(chat.chat_template_kwargs)
        if reasoning is not None:
            params = reasoning.constrain_after_reasoning(params, token_ids)
        self.request_id("resp", chat)  # the client's request_id checked as on the other routes
        # a random part even with a client's request_id: ids name stored responses, which no one may guess
        response_id = f"resp_{chat.request_id}-{random_uuid()[:16]}" if chat.request_id else f"resp_{random_uuid()}"
        stream, = self.add_requests(response_id, [(prompt, token_ids)], params, chat,
                                    "delta" if request.stream else "final_only")
        response = _response(request, response_id, self.model_name, params)
        turn = _Turn(self, request, response, conversation, len(token_ids), reasoning, tools)
        if request.stream:
            return turn.stream(stream)
        final = None
        merged = merge_streams([stream])
        try:
            async for _, output in merged:
                final = output
        finally:
            await merged.aclose()
        completion = final.outputs[0]
        thought, text = reasoning.split(completion.text) if reasoning is not None else (None, completion.text)
        message, _ = tools.message(text or "", completion.finish_reason)
        items: list[OutputItem] = []
        if thought and request.include_reasoning:
            items.append(ReasoningItem(content=[ReasoningText(text=thought)]))
        if message.content or not message.tool_calls:
            items.append(OutputMessage(content=[OutputText(text=message.content or "")]))
        items += [FunctionCallItem(call_id=call.id, name=call.function.name, arguments=call.function.arguments)
                  for call in message.tool_calls]
        return turn.finish(items, completion.finish_reason, completion.token_ids, final.num_cached_tokens)


class _Turn:
    """One response being made: its output becomes the response object, stored unless store is false."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, response: ResponsesResponse,
                 conversation: list[dict[str, Any]], num_prompt_tokens: int, reasoning: RequestReasoning | None,
                 tools: ToolCalling):
        self.serving, self.request, self.response = serving, request, response
        self.conversation, self.num_prompt_tokens = conversation, num_prompt_tokens
        self.reasoning, self.tools = reasoning, tools

    def finish(self, items: list[OutputItem], finish_reason: str | None, token_ids, num_cached: int
               ) -> ResponsesResponse:
        response = self.response
        response.output = items
        response.status = "incomplete" if finish_reason == "length" else "completed"
        if finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        num_reasoning = self.reasoning.count_tokens(token_ids) if self.reasoning is not None else 0
        response.usage = ResponseUsage(
            input_tokens=self.num_prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
            output_tokens=len(token_ids), output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning),
            total_tokens=self.num_prompt_tokens + len(token_ids))
        if self.request.store is not False:
            self.serving.store.put(StoredResponse(response.model_copy(deep=True),
                                                  self.conversation + output_messages(items)))
        return response

    async def stream(self, stream) -> AsyncIterator[str]:
        event = EventWriter()
        items = StreamedItems(event)
        snapshot = self.response.model_dump(mode="json")
        yield event("response.created", response=snapshot)
        yield event("response.in_progress", response=snapshot)
        thinking = self.reasoning.stream() if self.reasoning is not None else None
        calls = self.tools.stream() if self.tools.parses_output else None
        token_ids: list[int] = []
        finish_reason = None
        num_cached = 0
        try:
            async for output in stream:
                completion = output.outputs[0]
                token_ids += completion.token_ids
                num_cached = max(num_cached, output.num_cached_tokens)
                finish_reason = completion.finish_reason
                text, finished = completion.text, completion.finish_reason is not None
                if thinking is not None:
                    thought, text = thinking.feed(text, finished)
                    if thought and self.request.include_reasoning:
                        for frame in items.reasoning(thought):
                            yield frame
                if calls is not None:
                    delta, _ = calls.delta(text, completion.finish_reason)
                    text = delta.content if delta is not None else ""
                    for frame in items.tool_calls(delta.tool_calls if delta is not None else []):
                        yield frame
                if text:
                    for frame in items.content(text):
                        yield frame
            for frame in items.finish():
                yield frame
            response = self.finish(items.output, finish_reason, token_ids, num_cached)
            yield event("response.completed", response=response.model_dump(mode="json"))
        except Exception as e:
            error = errors.to_api_error(e)
            yield event("error", code=error.code or error.type, message=error.message, param=error.param)
        finally:
            await stream.aclose()


def _response(request: ResponsesRequest, response_id: str, model_name: str,
              params: SamplingParams) -> ResponsesResponse:
    """The response object before its output: the request's settings echoed, as OpenAI's."""
    choice = request.tool_choice
    text = request.text.model_dump(mode="json", by_alias=True, exclude_none=True) if request.text else None
    return ResponsesResponse(
        id=response_id, model=model_name, status="in_progress", instructions=request.instructions,
        max_output_tokens=request.max_output_tokens, metadata=request.metadata,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
        service_tier=request.service_tier or "auto", store=request.store is not False,
        temperature=params.temperature, top_p=params.top_p, text=text or {"format": {"type": "text"}},
        tool_choice=(choice.model_dump() if choice is not None and not isinstance(choice, str)
                     else choice or ("auto" if request.tools else "none")),
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []], user=request.user)


def _check_unsupported(request: ResponsesRequest) -> None:
    """A 400 naming each known field whose value this server cannot honour."""
    refused = [("background", bool(request.background), "background responses are not supported"),
               ("include", bool(request.include), "no `include` values are supported"),
               ("max_tool_calls", request.max_tool_calls is not None, "max_tool_calls is not supported"),
               ("top_logprobs", bool(request.top_logprobs), "logprobs are not supported on /v1/responses"),
               ("prompt", request.prompt is not None, "prompt templates are not supported"),
               ("conversation", request.conversation is not None, "conversations are not supported (use "
                                                                   "previous_response_id)"),
               ("stream_options", request.stream_options is not None, "stream_options is not supported"),
               ("truncation", request.truncation == "auto", "truncation `auto` is not supported (a prompt too long "
                                                            "is a 400)"),
               ("text.verbosity", request.text is not None and request.text.verbosity not in (None, "medium"),
                "only `medium` verbosity (the model's own) is supported"),
               ("reasoning.summary", request.reasoning is not None and (
                   request.reasoning.summary is not None or request.reasoning.generate_summary is not None),
                "reasoning summaries are not generated")]
    for param, broken, why in refused:
        if broken:
            raise errors.bad_request(f"{param}: {why}.", param=param)
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function":
            raise errors.bad_request(f"tools[{i}]: tools of type {tool.type!r} are not supported (only function "
                                     "tools are).", param=f"tools[{i}].type")
        if tool.name is None:
            raise errors.bad_request(f"tools[{i}].name is required.", param=f"tools[{i}].name")


def _chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion the response runs as (one choice, not streamed at the chat level)."""
    fields: dict[str, Any] = {name: getattr(request, name) for name in _PASSED_TO_CHAT
                              if getattr(request, name) is not None}
    fields["messages"] = messages
    fields["max_completion_tokens"] = request.max_output_tokens
    if request.tools is not None:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning.effort)  # vLLM's
    fields["chat_template_kwargs"] = kwargs or None
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise errors.bad_request("text.format of type json_schema needs a schema.", param="text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        param = _CHAT_PARAM.get(loc[0], loc[0]) if loc else None
        raise errors.bad_request(f"{param}: {first.get('msg', 'invalid')}", param=param) from None
