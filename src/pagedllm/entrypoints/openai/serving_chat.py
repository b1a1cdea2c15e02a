"""POST /v1/chat/completions: messages through the model's chat template, then generation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_echo import echo_text
from pagedllm.entrypoints.openai.chat_prompt import ChatPrompts
from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    DeltaMessage,
    TopLogprob,
)
from pagedllm.entrypoints.openai.chat_stream_chunks import choice_delta, content_chunk_template, stream_choice
from pagedllm.entrypoints.openai.formatting import (
    SSE_DONE,
    chosen_entry,
    json_logprob,
    prompt_logprobs_json,
    sse,
    sse_error,
    token_id_text,
    top_entries,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, RequestReasoning
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, merge_streams
from pagedllm.entrypoints.openai.sse_template import SSETemplate
from pagedllm.entrypoints.openai.structured_outputs import with_structured_outputs
from pagedllm.entrypoints.openai.tool_calling import ChoiceStream, ToolCalling
from pagedllm.outputs import PositionLogprobs


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, chat_prompts: ChatPrompts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_prompts = chat_prompts if chat_prompts is not None else ChatPrompts(self.tokenizer, self.config)
        """The messages' rendering (chat_prompt.py), shared with /tokenize."""

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        self._check_top_logprobs(request)
        self.check_stream_fields(request, request.prompt_logprobs)
        self.check_request_caps(request)
        self.engine.check_admission(request.n)
        tools = ToolCalling(request, self.config)
        prompt = await self.chat_prompts.render(request, tools.template_tools)
        add_special = bool(request.add_special_tokens)
        token_ids = await self.encode(prompt, add_special)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = self.sampling_params(request, max_tokens, logprobs, request.prompt_logprobs)
        params = await with_structured_outputs(request, params, self.grammar_compile_timeout_s, self.json_options)
        params = await tools.constrain(params, self.grammar_compile_timeout_s, self.json_options)
        reasoning = self.request_reasoning(request.chat_template_kwargs)
        if reasoning is not None:
            params = reasoning.constrain_after_reasoning(params, token_ids)
        request_id = self.request_id("chatcmpl", request)
        streams = self.add_requests(request_id, [(prompt, token_ids)], params, request,
                                    "delta" if request.stream else "final_only")
        merged = merge_streams(streams)
        if request.stream:
            return self._stream(request, request_id, token_ids, merged, tools, reasoning)
        final = None
        try:
            async for _, output in merged:
                final = output
        finally:
            await merged.aclose()
        choices = []
        num_completion = 0
        role = self.response_role(request)
        echo = echo_text(request, role)
        for output in sorted(final.outputs, key=lambda o: o.index):
            num_completion += len(output.token_ids)
            thought, text = reasoning.split(output.text) if reasoning is not None else (None, output.text)
            message, finish_reason = tools.message(text or "", output.finish_reason)
            message.role = role
            if reasoning is not None:
                message.reasoning = message.reasoning_content = thought
                message.content = message.content or None
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=output.index, message=message,
                logprobs=self._logprobs(output.token_ids, output.logprobs, request),
                finish_reason=finish_reason, stop_reason=output.stop_reason,
                token_ids=list(output.token_ids) if request.return_token_ids else None))
        return ChatCompletionResponse(
            id=request_id, model=self.response_model(request), choices=choices,
            usage=self.usage(len(token_ids), num_completion, final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs, request.prompt_logprobs or 0),
            prompt_token_ids=list(token_ids) if request.return_token_ids else None,
            kv_transfer_params=final.kv_transfer_params)

    def _check_top_logprobs(self, request: ChatCompletionRequest) -> None:
        if request.top_logprobs is not None and not request.logprobs:
            raise errors.bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
        limits = self.engine.input_processor.limits
        cap = limits.max_logprobs if limits.max_logprobs != -1 else limits.vocab_size
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= cap:
            raise errors.bad_request(f"top_logprobs must be in [0, {cap}] (--max-logprobs), got "
                                     f"{request.top_logprobs}.", param="top_logprobs")

    def response_role(self, request: ChatCompletionRequest) -> str:
        """vLLM's: --response-role with add_generation_prompt, else the role of the request's last message."""
        if request.add_generation_prompt or not request.messages:
            return self.config.response_role
        return request.messages[-1].get("role") or self.config.response_role

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None,
                  request: ChatCompletionRequest) -> ChatLogprobs | None:
        """Tokens as text, or as `token_id:N` with return_tokens_as_token_ids (bytes: the token's text's)."""
        if not request.logprobs or positions is None:
            return None
        num = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request)
        content = []
        logits = self.logprobs_are_logits
        for token_id, position in zip(token_ids, positions, strict=False):
            logprob, text = chosen_entry(position, token_id)
            top = [TopLogprob(token=token_id_text(tid) if as_ids else t, logprob=json_logprob(lp, logits),
                              bytes=list(t.encode())) for tid, lp, t in top_entries(position, num)]
            content.append(ChatLogprobToken(token=token_id_text(token_id) if as_ids else text,
                                            logprob=json_logprob(logprob, logits), bytes=list(text.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, prompt_token_ids: list[int],
                      merged, tools: ToolCalling, reasoning: RequestReasoning | None) -> AsyncIterator[str]:
        created, model = int(time.time()), self.response_model(request)
        include_usage, continuous_usage = self.stream_usage_options(request)
        role = self.response_role(request)
        echo = echo_text(request, role)
        started: dict[int, tuple[ChoiceStream, ReasoningStream | None]] = {}
        num_completion = num_cached = 0
        template: SSETemplate | None = None
        # Chunks of content only (no tool parsing, logprobs, token ids or usage) are written from a template.
        plain = not (tools.parses_output or request.logprobs or request.return_token_ids or continuous_usage
                     or reasoning is not None)

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            so_far = self.usage(len(prompt_token_ids), num_completion, num_cached) if continuous_usage else None
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=choices, usage=so_far))

        try:
            async for _, output in merged:
                num_cached = max(num_cached, output.num_cached_tokens)
                choices: list[ChatCompletionStreamChoice | tuple] = []
                for completion in output.outputs:
                    if completion.index not in started:
                        started[completion.index] = (tools.stream(), reasoning and reasoning.stream())
                        for first in [DeltaMessage(role=role, content="")] + ([DeltaMessage(content=echo)]
                                                                              if echo else []):
                            yield chunk([ChatCompletionStreamChoice(index=completion.index, delta=first)])
                    num_completion += len(completion.token_ids)
                    if not completion.text and not completion.token_ids and completion.finish_reason is None:
                        continue
                    if plain:
                        choices.append((completion.index, completion.text, completion.finish_reason,
                                        completion.stop_reason))
                        continue
                    delta, finish_reason = choice_delta(completion.text, completion.finish_reason, tools,
                                                        *started[completion.index])
                    if delta is None and not (request.logprobs or request.return_token_ids):
                        continue  # held back (a tail that may begin a tool call or a tag)
                    choices.append(ChatCompletionStreamChoice(
                        index=completion.index, delta=delta or DeltaMessage(),
                        logprobs=self._logprobs(completion.token_ids, completion.logprobs, request),
                        finish_reason=finish_reason, stop_reason=completion.stop_reason,
                        token_ids=list(completion.token_ids) if request.return_token_ids else None))
                if len(choices) == 1 and isinstance(choices[0], tuple):
                    template = template or content_chunk_template(request_id, created, model)
                    yield template.render(*choices[0])
                elif choices:
                    yield chunk([stream_choice(c) for c in choices])
            if include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=self.usage(len(prompt_token_ids), num_completion, num_cached)))
        except Exception as e:
            yield sse_error(e)
        finally:
            await merged.aclose()
        yield SSE_DONE
