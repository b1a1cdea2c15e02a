"""OpenAIServing, what /v1/completions and /v1/chat/completions share: a request's checks, its text to token ids
(off the event loop), its fields to SamplingParams, its prompts into the engine, and the merged output streams
of several prompts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.config import ServerConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.input_processor import is_valid_unicode, json_options
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.formatting import usage
from pagedllm.entrypoints.openai.protocol import MAX_REQUEST_ID_LEN, SamplingFields, UsageInfo, random_uuid
from pagedllm.entrypoints.openai.reasoning import ReasoningParser, RequestReasoning
from pagedllm.entrypoints.openai.request_caps import check_request_caps, n_above_cap
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.tokenizer_threads import TokenizerThreads
from pagedllm.messages import LoRARequest
from pagedllm.metrics.tracing import current_request_trace
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_CHARS_MARGIN = 2
"""A prompt longer than max_model_len x (the longest token's characters) x this is rejected before it is
tokenized: no tokenization of it can fit (the margin covers normalizers that merge characters)."""


# Request fields that a model's generation_config.json may default when the request leaves them out.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], config: ServerConfig | None = None,
                 tokenizer_threads: TokenizerThreads | None = None, models: ServingModels | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.models = models if models is not None else ServingModels(served_model_names, served_model_names[0])
        """The base model's names and the LoRA adapters a request may name in `model`."""
        self.config = config if config is not None else ServerConfig()
        self.max_prompt_chars = max_prompt_chars(engine.max_model_len, self.tokenizer)
        self.tokenizer_threads = tokenizer_threads if tokenizer_threads is not None else TokenizerThreads()
        """Shared by every route of one app (app.py), so that a big text delays no small one anywhere."""
        self.request_logger = RequestLogger(self.config.max_log_len) if self.config.log_requests else None
        """--enable-log-requests (and --enable-log-outputs): None when requests are not logged."""
        self.reasoning_parser = (ReasoningParser(self.config.reasoning_parser, self.tokenizer)
                                 if self.config.reasoning_parser else None)
        """--reasoning-parser over the tokenizer (reasoning.py); None without the flag."""

    def request_reasoning(self, chat_template_kwargs: dict[str, Any] | None) -> RequestReasoning | None:
        """A chat request's reasoning split (None without --reasoning-parser)."""
        if self.reasoning_parser is None:
            return None
        return self.reasoning_parser.for_request(chat_template_kwargs)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of `text`, tokenized in a worker thread (tokenizer_threads.py): the event loop serves
        every other route meanwhile. A text too long to fit in max_model_len tokens however it tokenizes is
        refused first (400, context_length_exceeded)."""
        self.check_text_length(len(text))
        return await self.tokenizer_threads.run(len(text), self.tokenizer.encode, text,
                                                add_special_tokens=add_special_tokens)

    def check_text_length(self, num_chars: int) -> None:
        """Raises APIError(400) for a text of num_chars characters that no tokenization fits in max_model_len."""
        if num_chars > self.max_prompt_chars:
            raise prompt_too_long(num_chars, self.engine.max_model_len)

    @property
    def grammar_compile_timeout_s(self) -> float:
        return self.engine.input_processor.limits.grammar_compile_timeout_s

    @property
    def json_options(self) -> tuple[bool, bool]:
        """The server's JSON options (disable_any_whitespace, disable_additional_properties), as the engine
        compiles grammars with them."""
        return json_options(self.engine.input_processor.limits)

    @property
    def logprobs_are_logits(self) -> bool:
        """--logprobs-mode raw_logits or processed_logits: responses carry logits in their `logprob` fields."""
        return self.engine.input_processor.limits.logprobs_are_logits

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); raises APIError 404 for a model not served."""
        return self.models.resolve(model)

    def response_model(self, request) -> str:
        """The `model` of a response: the adapter's name for a request that runs one (as vLLM), else the base
        model's first served name."""
        return request.model if request.model in self.models.lora_requests else self.model_name

    @staticmethod
    def request_id(prefix: str, request: SamplingFields) -> str:
        given = request.request_id
        if given is not None and not (0 < len(given) <= MAX_REQUEST_ID_LEN and is_valid_unicode(given)):
            raise errors.bad_request(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} "
                                     "characters of valid Unicode.", param="request_id")
        return f"{prefix}-{given or random_uuid()}"

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
        """A response's usage; prompt_tokens_details (the prefix-cache hits) with --enable-prompt-tokens-details."""
        return usage(num_prompt_tokens, num_completion_tokens,
                     num_cached_tokens if self.config.enable_prompt_tokens_details else None)

    def stream_usage_options(self, request: SamplingFields) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk) of a stream: stream_options', or both with
        --enable-force-include-usage (vLLM's should_include_usage)."""
        if self.config.enable_force_include_usage:
            return True, True
        options = request.stream_options
        return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)

    def tokens_as_ids(self, request: SamplingFields) -> bool:
        """Whether logprobs name tokens `token_id:N`: the request's return_tokens_as_token_ids, else the server's
        --return-tokens-as-token-ids."""
        given = request.return_tokens_as_token_ids
        return self.config.return_tokens_as_token_ids if given is None else given

    def check_request_caps(self, request: SamplingFields, num_prompts: int = 1) -> None:
        check_request_caps(request, self.config, num_prompts)

    @staticmethod
    def check_stream_fields(request: SamplingFields, prompt_logprobs: int | None) -> None:
        """vLLM's checks of the fields that need (or exclude) stream=True."""
        if request.stream_options is not None and not request.stream:
            raise errors.bad_request("Stream options can only be defined when `stream=True`.",
                                     param="stream_options")
        if request.stream and prompt_logprobs:
            raise errors.bad_request("`prompt_logprobs` are not available when `stream=True`.",
                                     param="prompt_logprobs")

    def sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        defaults = self.engine.input_processor.sampling_defaults()
        values = {name: getattr(request, name) if getattr(request, name) is not None else defaults.get(name)
                  for name in _DEFAULTABLE}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        cap = self.engine.input_processor.limits.max_tokens_cap
        if cap is not None and (max_tokens is None or max_tokens > cap):
            max_tokens = cap  # vLLM's get_max_tokens: a --generation-config folder's max_new_tokens caps every request
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        logit_bias = None
        if request.logit_bias:
            if not all(isinstance(k, str) and 0 < len(k) <= 12 for k in request.logit_bias):
                raise errors.bad_request("logit_bias keys must be token ids.", param="logit_bias")
            try:
                logit_bias = {int(k): float(v) for k, v in request.logit_bias.items()}
            except ValueError:
                raise errors.bad_request("logit_bias keys must be token ids.", param="logit_bias") from None
        kwargs: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
        vocab_size = self.engine.input_processor.limits.vocab_size
        if isinstance(kwargs.get("top_k"), int) and kwargs["top_k"] > vocab_size:
            # every k from the vocabulary size up keeps every token; a larger one (2**90) cannot cross the
            # engine's wire (msgpack integers are 64-bit): it made the send fail, a 500
            kwargs["top_k"] = vocab_size
        return SamplingParams(
            n=request.n, presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0, seed=request.seed, stop=stop,
            stop_token_ids=list(request.stop_token_ids or []), ignore_eos=request.ignore_eos,
            max_tokens=max_tokens, min_tokens=request.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output, logit_bias=logit_bias,
            ttft_slo_ms=request.ttft_slo_ms, tpot_slo_ms=request.tpot_slo_ms, **kwargs)

    def add_requests(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                     params: SamplingParams | list[SamplingParams], request: SamplingFields,
                     output_kind: str) -> list[AsyncIterator[RequestOutput]]:
        """Send every prompt as `{engine_id}-{i}` (one prompt: `engine_id`); all or none. `params`: for every
        prompt, or one each (they differ only in where a grammar starts, reasoning.py).

        The engine id is the response's id plus a random suffix, as vLLM does: a client-supplied request_id is
        echoed in the response but never shared with another request, so two requests (two tenants) with the
        same request_id both run and neither can tell that the other exists."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        params = per_prompt[0]
        transfer = request.kv_transfer_params or {}
        if len(prompts) > 1 and (transfer.get("do_remote_decode") or transfer.get("do_remote_prefill")):
            # one kv_transfer_params names one prompt's blocks: a batch would share them (a consumer's second
            # prompt decoding from the first one's KV) or leave all but one prompt's blocks held on a producer
            raise errors.bad_request(f"kv_transfer_params takes one prompt, not a batch of {len(prompts)}.",
                                     param="kv_transfer_params")
        if not 1 <= params.n <= self.config.max_n:
            raise n_above_cap(params.n, self.config)
        engine_id = f"{request_id}-{random_uuid()[:8]}"
        if (trace := current_request_trace.get()) is not None:  # --otlp-traces-endpoint: the span's request id
            trace.request_id = request_id
        self.engine.check_admission(params.n * len(prompts))  # again: the queue may have filled meanwhile
        lora = self.check_model(request.model)  # again: the adapter may have been unloaded meanwhile
        streams = []
        ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
        request_logger = self.request_logger
        try:
            for sub_id, (text, token_ids), prompt_params in zip(ids, prompts, per_prompt, strict=True):
                if request_logger is not None:
                    request_logger.log_inputs(sub_id, text, token_ids, prompt_params)
                stream = self.engine.add_request(sub_id, token_ids, prompt_params, text, output_kind,
                                                 request.priority, request.cache_salt, lora_request=lora,
                                                 kv_transfer_params=request.kv_transfer_params)
                if request_logger is not None and self.config.enable_log_outputs:
                    stream = request_logger.logging_outputs(stream, sub_id, params.n, output_kind == "delta")
                streams.append(stream)
        except BaseException:
            for sub_id in ids[:len(streams)]:
                self.engine.abort(sub_id)
            raise
        return streams


def max_prompt_chars(max_model_len: int, tokenizer) -> int:
    """The longest text (in characters) that some tokenization may fit in max_model_len tokens: longer ones are
    refused before they are tokenized, by every route that tokenizes text (completions, chat, /tokenize)."""
    return max_model_len * longest_token_chars(tokenizer) * PROMPT_CHARS_MARGIN


def prompt_too_long(num_chars: int, max_model_len: int) -> errors.APIError:
    return errors.bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
        f"{num_chars} characters long, more than {max_model_len} tokens of this tokenizer can hold.",
        param="prompt", code="context_length_exceeded")


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (byte-level tokens: bytes, at least as many)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output); closing this closes them all."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    # Bounded: when the consumer stops taking outputs, the pumps stop too and the outputs wait in each
    # stream's own buffer, whose cap aborts a stalled request (AsyncLLM.max_buffered_outputs).
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
