"""What /v1/completions and /v1/chat/completions share: model check, SamplingParams from a request,
engine errors to HTTP errors, logprobs and usage, merged output streams, and SSE framing."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from pydantic import BaseModel

from pagedllm.config import ServerConfig
from pagedllm.core.scheduler import QueueFullError
from pagedllm.engine.async_llm import AsyncLLM, RequestAbortedError, RequestFailedError
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import InvalidRequestError, is_valid_unicode
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.protocol import (
    Logprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from pagedllm.log_escape import escape_control
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256
PROMPT_CHARS_MARGIN = 2
"""A prompt longer than max_model_len x (the longest token's characters) x this is rejected before it is
tokenized: no tokenization of it can fit (the margin covers normalizers that merge characters)."""


def n_above_cap(n: int, caps: ServerConfig) -> errors.APIError:
    return errors.bad_request(f"n must be in [1, {caps.max_n}], got {n}.", param="n")


def too_many(param: str, count: int, caps: ServerConfig) -> errors.APIError:
    """The error for a list (or logit_bias map) over its cap."""
    if param == "prompt":
        return errors.bad_request(f"prompt is a list of {count} prompts; at most {caps.max_prompts} are allowed "
                                  "in one request.", param="prompt")
    if param == "logit_bias":
        return errors.bad_request(f"logit_bias has {count} entries; at most {caps.max_logit_bias} are allowed.",
                                  param="logit_bias")
    if param == "stop":
        return errors.bad_request(f"stop has {count} strings; at most {caps.max_stop} are allowed.", param="stop")
    return errors.bad_request(f"{param} has {count} ids; at most {caps.max_stop} are allowed.", param=param)


def too_deep() -> errors.APIError:
    """The error for a JSON body nested past what the parsers recurse into (~1,000 levels)."""
    return errors.bad_request("The request body is nested too deeply to parse.", code="json_too_deep")


def _cap_of(param: str, caps: ServerConfig) -> int:
    return {"prompt": caps.max_prompts, "logit_bias": caps.max_logit_bias}.get(param, caps.max_stop)


_CAPPED_LISTS = ("prompt", "stop", "stop_token_ids")
_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_RAW_SMALL_INT = msgspec.json.Decoder(int)


def precheck_caps(body: bytes, caps: ServerConfig) -> Any:
    """Reject a JSON request body whose n, prompt list, stop list, stop_token_ids or logit_bias is over its cap,
    before the body is parsed into Python objects and validated (100,000 prompts cost ~100 ms to parse and
    validate; here ~10 ms: the body is scanned, not built).

    Raises the APIError of the first cap broken. Returns the parsed body when this had to parse it (a body
    msgspec refuses but Python's json reads: NaN, a lone surrogate), else None; the request's own parse and
    validation decide everything else."""
    try:
        fields = _RAW_FIELDS.decode(body)
    except msgspec.DecodeError:
        return _precheck_parsed(body, caps)
    except RecursionError:  # msgspec, like Python's json, gives up near the interpreter's recursion limit
        raise too_deep() from None
    raw_n = fields.get("n")
    if raw_n is not None and len(raw_n) <= 24:
        try:
            n = _RAW_SMALL_INT.decode(raw_n)
        except msgspec.DecodeError:
            n = None
        if n is not None and not 1 <= n <= caps.max_n:
            raise n_above_cap(n, caps)
    for param in _CAPPED_LISTS:
        raw = fields.get(param)
        if raw is None:
            continue
        data = bytes(raw)
        cap = _cap_of(param, caps)
        if data[:1] != b"[" or data.count(b",") < cap:  # not a list, or too few commas for cap + 1 items
            continue
        first = data[1:].lstrip()[:1]
        if param == "prompt" and (first.isdigit() or first == b"-"):  # token ids: one prompt
            continue
        count = len(_RAW_ITEMS.decode(data))
        if count > cap:
            raise too_many(param, count, caps)
    raw = fields.get("logit_bias")
    if raw is not None:
        data = bytes(raw)
        if data[:1] == b"{" and data.count(b":") > caps.max_logit_bias:  # else too few colons to be over
            count = len(_RAW_FIELDS.decode(data))
            if count > caps.max_logit_bias:
                raise too_many("logit_bias", count, caps)
    return None


def _precheck_parsed(body: bytes, caps: ServerConfig) -> Any:
    try:
        data = json.loads(body)
    except ValueError:  # JSONDecodeError, bad UTF-8, an integer of too many digits
        return None  # the request's own parse answers it
    except RecursionError:
        raise too_deep() from None
    if isinstance(data, dict):
        n = data.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and not 1 <= n <= caps.max_n:
            raise n_above_cap(n, caps)
        for param in (*_CAPPED_LISTS, "logit_bias"):
            value = data.get(param)
            if param == "prompt" and isinstance(value, list) and value and isinstance(value[0], int):
                continue  # token ids: one prompt
            if isinstance(value, list | dict) and len(value) > _cap_of(param, caps):
                raise too_many(param, len(value), caps)
    return data


# Request fields that a model's generation_config.json may default when the request leaves them out.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], config: ServerConfig | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.config = config if config is not None else ServerConfig()
        self.max_prompt_chars = engine.max_model_len * longest_token_chars(self.tokenizer) * PROMPT_CHARS_MARGIN
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def encode(self, text: str, add_special_tokens: bool, check_length: bool = True) -> list[int]:
        """The token ids of `text`, tokenized in a worker thread: the event loop serves every other route
        meanwhile (HF tokenizers release the GIL; 15 MB took 15 s). check_length: first reject (400,
        context_length_exceeded) a text too long to fit in max_model_len tokens however it tokenizes."""
        if check_length and len(text) > self.max_prompt_chars:
            max_model_len = self.engine.max_model_len
            raise errors.bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
                f"{len(text)} characters long, more than {max_model_len} tokens of this tokenizer can hold.",
                param="prompt", code="context_length_exceeded")
        return await self.in_tokenizer_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def in_tokenizer_thread(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the tokenizer's worker thread (one at a time), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model and model not in self.served_model_names:
            raise errors.model_not_found(model)

    @staticmethod
    def request_id(prefix: str, request: SamplingFields) -> str:
        given = request.request_id
        if given is not None and not (0 < len(given) <= MAX_REQUEST_ID_LEN and is_valid_unicode(given)):
            raise errors.bad_request(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} "
                                     "characters of valid Unicode.", param="request_id")
        return f"{prefix}-{given or random_uuid()}"

    def check_request_caps(self, request: SamplingFields, num_prompts: int = 1) -> None:
        """The caps that bound one request's work, checked before any tokenization (each a serve flag)."""
        caps = self.config
        if not 1 <= request.n <= caps.max_n:
            raise n_above_cap(request.n, caps)
        if num_prompts * request.n > caps.max_choices:
            raise errors.bad_request(f"{num_prompts} prompts x n={request.n} are {num_prompts * request.n} choices; "
                                     f"at most {caps.max_choices} are allowed in one request (--max-choices).",
                                     param="n")
        if request.logit_bias is not None and len(request.logit_bias) > caps.max_logit_bias:
            raise too_many("logit_bias", len(request.logit_bias), caps)
        stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
        if len(stop) > caps.max_stop:
            raise too_many("stop", len(stop), caps)
        if request.stop_token_ids is not None and len(request.stop_token_ids) > caps.max_stop:
            raise too_many("stop_token_ids", len(request.stop_token_ids), caps)

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
            include_stop_str_in_output=request.include_stop_str_in_output, logit_bias=logit_bias, **kwargs)

    def add_requests(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                     params: SamplingParams, request: SamplingFields,
                     output_kind: str) -> list[AsyncIterator[RequestOutput]]:
        """Send every prompt as `{engine_id}-{i}` (one prompt: `engine_id`); all or none.

        The engine id is the response's id plus a random suffix, as vLLM does: a client-supplied request_id is
        echoed in the response but never shared with another request, so two requests (two tenants) with the
        same request_id both run and neither can tell that the other exists."""
        if not 1 <= params.n <= self.config.max_n:
            raise n_above_cap(params.n, self.config)
        engine_id = f"{request_id}-{random_uuid()[:8]}"
        if not self.config.disable_log_requests:
            logger.info("Received request %s: %d prompt(s), %d prompt tokens, params %s", escape_control(engine_id),
                        len(prompts), sum(len(ids) for _, ids in prompts), escape_control(_short(params)))
        self.engine.check_admission(params.n * len(prompts))  # again: the queue may have filled meanwhile
        streams = []
        ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
        try:
            for sub_id, (text, token_ids) in zip(ids, prompts, strict=True):
                streams.append(self.engine.add_request(sub_id, token_ids, params, text, output_kind,
                                                       request.priority, request.cache_salt))
        except BaseException:
            for sub_id in ids[:len(streams)]:
                self.engine.abort(sub_id)
            raise
        return streams


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (byte-level tokens: bytes, at least as many)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _short(params: SamplingParams, limit: int = 1000) -> str:
    """The parameters for a log line, cut to `limit` characters (a request may carry large lists)."""
    text = repr(params)
    return text if len(text) <= limit else text[:limit] + "...)"


def to_api_error(e: BaseException, value_error_is_bad_request: bool = True) -> errors.APIError:
    """The HTTP error for an exception raised while serving a request.

    An unexpected exception becomes a 500 that says nothing of the server's internals (no message,
    traceback, path or address); the details go to the log under an error id the response carries.
    value_error_is_bad_request=False: a plain ValueError is one of those (it escaped the request handling,
    e.g. while rendering the response, so it is the server's fault, not the request's)."""
    if isinstance(e, errors.APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return errors.bad_request(str(e), e.param, e.code)
    if isinstance(e, QueueFullError):
        return errors.unavailable(str(e), "queue_full", retry_after_s=1)
    if isinstance(e, EngineDeadError):
        return errors.unavailable(f"The engine is not available: {e}", "engine_dead")
    if isinstance(e, RequestAbortedError):
        return errors.unavailable(str(e), "aborted", retry_after_s=1)
    if isinstance(e, RequestFailedError):
        return errors.internal(str(e))
    if isinstance(e, UnicodeError):
        return errors.bad_request("The request contains text that is not valid Unicode (a lone surrogate?).")
    if isinstance(e, ValueError) and value_error_is_bad_request:
        return errors.bad_request(str(e))
    error_id = random_uuid()[:16]
    logger.error("internal error %s: %s: %s", error_id, type(e).__name__, escape_control(e), exc_info=e)
    return errors.internal(f"The server had an error while processing your request (error id {error_id}).")


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


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def top_entries(position: PositionLogprobs, num: int) -> list[tuple[int, float, str]]:
    """The `num` most likely (token id, logprob, text) at one position, best first."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return [(tid, lp.logprob, lp.decoded_token or "") for tid, lp in ranked[:num]]


def json_logprob(logprob: float) -> float:
    """A logprob as the response carries it: at least -9999.0 (OpenAI's floor for -inf), at most 0.0, and never
    NaN (a degenerate distribution, e.g. a repetition_penalty that is 0.0 in float32, gives NaN logprobs: JSON
    cannot carry them, and rendering the response failed)."""
    return min(logprob, 0.0) if logprob > -9999.0 else -9999.0


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None, num: int) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a response: one entry per prompt token (None for the first), each the prompt
    token's logprob and rank plus the top `num`, logprobs floored at -9999.0 (vLLM's clamp)."""
    if positions is None:
        return None
    result: PromptLogprobs = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        entries = {}
        for i, (token_id, lp) in enumerate(position.items()):  # the prompt token first, then the top-N by rank
            if i == 0 or (lp.rank is not None and lp.rank <= num):
                entries[token_id] = Logprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                                            decoded_token=lp.decoded_token)
        result.append(entries)
    return result


def chosen_entry(position: PositionLogprobs, token_id: int) -> tuple[float, str]:
    lp = position.get(token_id)
    if lp is None:  # should not happen: the chosen token is always first
        return float("-inf"), ""
    return lp.logprob, lp.decoded_token or ""


def sse(chunk: BaseModel | dict) -> str:
    body = chunk.model_dump_json(exclude_unset=False) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {body}\n\n"


def sse_error(e: BaseException) -> str:
    return sse({"error": to_api_error(e).to_info().model_dump()})


SSE_DONE = "data: [DONE]\n\n"
