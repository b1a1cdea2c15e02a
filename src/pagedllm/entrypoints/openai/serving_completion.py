"""POST /v1/completions: prompts as text, lists of text, token ids or lists of token ids; echo; logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedllm.engine.detokenizer import decode_token
from pagedllm.engine.input_processor import is_valid_unicode
from pagedllm.entrypoints.openai import errors
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
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from pagedllm.entrypoints.openai.request_caps import too_many
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, merge_streams
from pagedllm.entrypoints.openai.sse_template import SSETemplate
from pagedllm.entrypoints.openai.structured_outputs import with_structured_outputs
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput

Prompt = tuple[str | None, list[int]]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Validate, send, and return the response (or, with stream, the first SSE chunk already awaited).

        Raises APIError for every rejection (before any byte of a stream is sent)."""
        self.check_model(request.model)
        if request.suffix is not None:
            raise errors.bad_request("suffix is not supported.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise errors.bad_request("best_of is not supported.", param="best_of")
        self.check_stream_fields(request, request.prompt_logprobs)
        items = self._prompt_items(request)
        self.check_request_caps(request, len(items))
        self.engine.check_admission(request.n * len(items))
        prompts = await self._tokenize(request, items)
        params = self.sampling_params(request, request.max_tokens, request.logprobs,
                                      _num_prompt_logprobs_computed(request))
        params = await with_structured_outputs(request, params, self.grammar_compile_timeout_s, self.json_options)
        reasoning = self.request_reasoning(None)
        if reasoning is not None and params.structured_outputs is not None:
            # as vLLM's engine does for every request: a grammar starts once the prompt's reasoning has ended
            params = [reasoning.constrain_after_reasoning(params, token_ids) for _, token_ids in prompts]
        request_id = self.request_id("cmpl", request)
        streams = self.add_requests(request_id, prompts, params, request,
                                    "delta" if request.stream else "final_only")
        merged = merge_streams(streams)
        if request.stream:
            return self._stream(request, request_id, prompts, merged)
        try:
            finals: dict[int, RequestOutput] = {}
            async for i, output in merged:
                finals[i] = output
        finally:
            await merged.aclose()
        return self._response(request, request_id, prompts, [finals[i] for i in range(len(prompts))])

    def _prompt_items(self, request: CompletionRequest) -> list[str | list[int]]:
        """The prompts as sent (text or token ids), checked but not tokenized."""
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise errors.bad_request("prompt must not be empty.", param="prompt")
        if len(items) > self.config.max_prompts:
            raise too_many("prompt", len(items), self.config)
        if not all(isinstance(item, str) or _is_token_ids(item) for item in items):
            raise errors.bad_request("prompt must be a string, a list of strings, a list of token ids, or a list "
                                     "of lists of token ids.", param="prompt")
        if any(isinstance(item, str) and not is_valid_unicode(item) for item in items):
            raise errors.bad_request("prompt must be valid Unicode (no lone surrogates).", param="prompt")
        return items

    async def _tokenize(self, request: CompletionRequest, items: list[str | list[int]]) -> list[Prompt]:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        result: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                result.append((item, await self.encode(item, add_special)))
            else:
                result.append((None, list(item)))
        return result

    def _prompt_text(self, prompt: Prompt) -> str:
        text, token_ids = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    # ---- one response -------------------------------------------------------------------------------

    def _response(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_prompt = num_completion = num_cached = 0
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            num_prompt += len(final.prompt_token_ids)
            num_cached += final.num_cached_tokens
            for output in sorted(final.outputs, key=lambda o: o.index):
                num_completion += len(output.token_ids)
                choices.append(self._choice(request, prompt_index * request.n + output.index, prompt, final,
                                            output, echo=bool(request.echo)))
        return CompletionResponse(id=request_id, model=self.response_model(request), choices=choices,
                                  usage=self.usage(num_prompt, num_completion, num_cached),
                                  kv_transfer_params=finals[0].kv_transfer_params)  # vLLM's: the first prompt's

    def _choice(self, request: CompletionRequest, index: int, prompt: Prompt, final: RequestOutput,
                output: CompletionOutput, echo: bool) -> CompletionResponseChoice:
        text = output.text
        token_ids = list(output.token_ids)
        positions = output.logprobs
        if echo:
            text = self._prompt_text(prompt) + text
            if positions is not None:
                token_ids = list(final.prompt_token_ids) + token_ids
                positions = _prompt_positions(final) + list(positions)
        logprobs = None
        if request.logprobs is not None and positions is not None:
            logprobs = self._logprobs(token_ids, positions, request.logprobs, as_ids=self.tokens_as_ids(request))
        num_prompt_logprobs = _num_prompt_logprobs_returned(request)
        return CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=(prompt_logprobs_json(final.prompt_logprobs, num_prompt_logprobs)
                             if num_prompt_logprobs is not None else None),
            prompt_token_ids=list(final.prompt_token_ids) if request.return_token_ids else None,
            token_ids=list(output.token_ids) if request.return_token_ids else None)

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], num: int,
                  text_offset: int = 0, as_ids: bool = False) -> CompletionLogProbs:
        """as_ids: tokens named `token_id:N` (--return-tokens-as-token-ids), their offsets counted so too."""
        result = CompletionLogProbs()
        logits = self.logprobs_are_logits
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:
                token_text = token_id_text(token_id) if as_ids else decode_token(self.tokenizer, token_id)
                result.tokens.append(token_text)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                logprob, token_text = chosen_entry(position, token_id)
                if as_ids:
                    token_text = token_id_text(token_id)
                result.tokens.append(token_text)
                result.token_logprobs.append(json_logprob(logprob, logits))
                top: dict[str, float] = {}
                for top_id, lp, text in top_entries(position, num):  # best first: keep the best of equal texts
                    top.setdefault(token_id_text(top_id) if as_ids else text, json_logprob(lp, logits))
                top.setdefault(token_text, json_logprob(logprob, logits))
                result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token_text)
        return result

    # ---- stream -----------------------------------------------------------------------------------------

    def _stream_piece(self, completion: CompletionOutput, prompt: Prompt, output: RequestOutput, echo: bool
                      ) -> tuple[str, list[int], list[PositionLogprobs | None] | None]:
        """A choice's new text, token ids and logprobs positions; with `echo` (its first piece), the prompt's
        before them."""
        text, token_ids, positions = completion.text, list(completion.token_ids), completion.logprobs
        if echo:
            text = self._prompt_text(prompt) + text
            if positions is not None:
                token_ids = list(output.prompt_token_ids) + token_ids
                positions = _prompt_positions(output) + list(positions)
        return text, token_ids, positions

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                      merged) -> AsyncIterator[str]:
        created, model = int(time.time()), self.response_model(request)
        n = request.n
        include_usage, continuous_usage = self.stream_usage_options(request)
        as_ids = self.tokens_as_ids(request)
        num_prompt = sum(len(ids) for _, ids in prompts)
        templated = not (request.return_token_ids or continuous_usage)
        """Chunks without logprobs are written from a template (no token ids, no usage in every chunk)."""
        num_completion = 0
        num_cached = [0] * len(prompts)
        echoed: set[int] = set()
        text_offsets: dict[int, int] = {}
        template: SSETemplate | None = None
        choices: list[CompletionResponseChoice | tuple]
        try:
            async for prompt_index, output in merged:
                num_cached[prompt_index] = max(num_cached[prompt_index], output.num_cached_tokens)
                choices = []
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    num_completion += len(completion.token_ids)
                    echo = request.echo and index not in echoed
                    echoed.add(index)
                    text, token_ids, positions = self._stream_piece(completion, prompts[prompt_index], output, echo)
                    logprobs = None
                    if request.logprobs is not None and positions is not None:
                        logprobs = self._logprobs(token_ids, positions, request.logprobs,
                                                  text_offsets.get(index, 0), as_ids)
                    first = index not in text_offsets
                    text_offsets[index] = text_offsets.get(index, 0) + len(text)
                    if not text and completion.finish_reason is None and not token_ids:
                        continue
                    if logprobs is None and templated:  # the template's fields only
                        choices.append((index, text, completion.finish_reason, completion.stop_reason))
                        continue
                    choices.append(CompletionResponseChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_token_ids=(list(output.prompt_token_ids)
                                          if request.return_token_ids and first else None),
                        token_ids=list(completion.token_ids) if request.return_token_ids else None))
                if len(choices) == 1 and isinstance(choices[0], tuple):
                    template = template or _chunk_template(request_id, created, model)
                    yield template.render(*choices[0])
                elif choices:
                    so_far = self.usage(num_prompt, num_completion, sum(num_cached)) if continuous_usage else None
                    yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                       choices=[_choice(c) for c in choices], usage=so_far))
            if include_usage:
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[], usage=self.usage(num_prompt, num_completion,
                                                                                sum(num_cached))))
        except Exception as e:
            yield sse_error(e)
        finally:
            await merged.aclose()
        yield SSE_DONE


_HOLES = ("index", "text", "finish_reason", "stop_reason")


def _chunk_template(request_id: str, created: int, model_name: str) -> SSETemplate:
    """A stream chunk with one choice that has no logprobs and no token ids (the common one)."""
    choice = CompletionResponseChoice.model_construct(**{name: SSETemplate.marker(name) for name in _HOLES})
    return SSETemplate(CompletionStreamResponse.model_construct(id=request_id, created=created, model=model_name,
                                                                choices=[choice]), _HOLES)


def _choice(choice: CompletionResponseChoice | tuple) -> CompletionResponseChoice:
    if isinstance(choice, tuple):
        return CompletionResponseChoice(**dict(zip(_HOLES, choice, strict=True)))
    return choice


def _num_prompt_logprobs_returned(request: CompletionRequest) -> int | None:
    """The top-N of the prompt_logprobs a response carries (vLLM's: prompt_logprobs, else with echo, logprobs);
    None: none."""
    if request.prompt_logprobs is not None:
        return request.prompt_logprobs
    return request.logprobs if request.echo else None


def _num_prompt_logprobs_computed(request: CompletionRequest) -> int | None:
    """What the engine computes: the returned prompt_logprobs, and with echo the top-`logprobs` of every prompt
    token for the echoed logprobs."""
    counts = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
    return max(counts) if counts else None


def _is_token_ids(item) -> bool:
    return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)


def _prompt_positions(output: RequestOutput) -> list[PositionLogprobs | None]:
    """One entry per prompt token, None where none was computed (the first token; prefix-cache hits)."""
    computed = list(output.prompt_logprobs or [])
    return [None] * (len(output.prompt_token_ids) - len(computed)) + computed
