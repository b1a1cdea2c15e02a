"""InputProcessor: turns a user's prompt and SamplingParams into a validated EngineCoreRequest.

Runs in the frontend (the LLM class, or the API server process). Every check that can reject a request
happens here, before the engine sees it, and raises InvalidRequestError with the OpenAI error's
`param` and `code`.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec

from pagedllm.config.pooler import wrong_runner_message
from pagedllm.lora.peft import check_adapter_weights, read_adapter_config
from pagedllm.messages import EngineCoreRequest, LoRARequest, ModelLimits
from pagedllm.pooling_params import PoolerDefaults, PoolingParams
from pagedllm.sampling_params import SamplingParams, SamplingParamsError
from pagedllm.structured_output.grammar import StructuredOutputError, check_grammar

# SamplingParams fields that a model's generation_config.json may default (vLLM's list).
GENERATION_CONFIG_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}

MAX_CACHE_SALT_LEN = 256


class InvalidRequestError(ValueError):
    """A request the engine will not run. `param` and `code` fill the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class InputProcessor:
    def __init__(self, limits: ModelLimits, tokenizer_eos_token_id: int | None = None, model_name: str = ""):
        self.limits = limits if tokenizer_eos_token_id is None else with_tokenizer_eos(limits, tokenizer_eos_token_id)
        self.model_name = model_name
        """The served model name, for the messages that name the model (vLLM's dimensions checks)."""
        self.checked_loras: dict[LoRARequest, None] = {}
        """Adapters already checked (check_lora), by value: name, id and path."""

    def default_sampling_params(self) -> SamplingParams:
        """The model's generation-config defaults, or vLLM's when it has none."""
        return SamplingParams(**self.sampling_defaults())

    def sampling_defaults(self) -> dict:
        return {GENERATION_CONFIG_FIELDS[k]: v for k, v in self.limits.generation_defaults.items()
                if k in GENERATION_CONFIG_FIELDS and v is not None}

    def child_params(self, params: SamplingParams) -> list[SamplingParams]:
        """The parameters of the n child requests of a request with n > 1: n = 1 each, child i seeded with
        seed + i. The parent is validated first, so an error names what the user sent (not a child's seed).
        Only child 0 computes prompt logprobs (the parent returns its): the others take the prompt from the
        prefix cache instead of computing it again.

        Raises:
            InvalidRequestError: a parameter is out of range (HTTP 400).
        """
        try:
            params.validate(self.limits.vocab_size, self.limits.max_logprobs)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), param=e.param) from None
        return [_replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                         prompt_logprobs=params.prompt_logprobs if index == 0 else None)
                for index in range(params.n)]

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                kv_transfer_params: dict | None = None) -> EngineCoreRequest:
        """Validate and build the engine request. kv_transfer_params: vLLM's, for the KV connector (copied; without
        one the engine ignores it, as vLLM does).

        Raises:
            InvalidRequestError: the prompt or a parameter is out of range (HTTP 400).
        """
        limits = self.limits
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < limits.vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {limits.vocab_size}).",
                                      param="prompt")
        if not (isinstance(priority, int) and -(2**63) <= priority < 2**63):
            raise InvalidRequestError(f"priority must fit in 64 bits, got {priority}.", param="priority")
        if priority != 0 and not limits.priority_scheduling:
            raise InvalidRequestError(f"Got priority {priority} but priority scheduling is not enabled (start the "
                                      "server with --scheduling-policy priority).", param="priority")
        if not limits.slo_scheduling:
            for name in ("ttft_slo_ms", "tpot_slo_ms"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(f"Got {name} but SLO scheduling is not enabled (start the server with "
                                              "--scheduling-policy slo).", param=name)
        num_prompt = len(prompt_token_ids)
        if num_prompt >= limits.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
                f"prompt has {num_prompt} tokens, leaving no room for output.",
                param="prompt", code="context_length_exceeded")
        try:
            params.validate(limits.vocab_size, limits.max_logprobs)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), param=e.param) from None
        if params.structured_outputs is not None:
            try:
                check_grammar(params.structured_outputs, limits.grammar_compile_timeout_s, *json_options(limits))
            except StructuredOutputError as e:
                raise InvalidRequestError(str(e), param=e.param) from None
        room = limits.max_model_len - num_prompt
        if params.max_tokens is None:
            params = _replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise InvalidRequestError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{limits.max_model_len} tokens and your request has {num_prompt} input tokens "
                f"({params.max_tokens} > {limits.max_model_len} - {num_prompt}).",
                param="max_tokens", code="context_length_exceeded")
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be at most max_tokens "
                                      f"({params.max_tokens}).", param="min_tokens")
        check_cache_salt(cache_salt)
        if lora_request is not None:
            self.check_lora(lora_request)
        if not all(is_valid_unicode(s) for s in params.stop):
            raise InvalidRequestError("stop strings must be valid Unicode (no lone surrogates).", param="stop")
        if limits.extra_stop_token_ids and not params.ignore_eos:
            extra = [t for t in limits.extra_stop_token_ids if t not in params.stop_token_ids]
            if extra:
                params = _replace(params, stop_token_ids=params.stop_token_ids + extra)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=limits.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params is not None else None,
        )

    def check_lora(self, lora: LoRARequest) -> None:
        """Check an adapter once (its config and its tensors' names and shapes against the model), so that the
        engine never fails a step on it. Raises LoRAAdapterError (its status_code: 404 for no adapter at the path,
        else 400), or InvalidRequestError when LoRA is off."""
        limits = self.limits
        if limits.max_lora_rank is None:
            raise InvalidRequestError(f"Got lora_request {lora.lora_name!r} but LoRA is not enabled (start with "
                                      "--enable-lora).", param="model")
        if lora in self.checked_loras:
            return
        adapter = read_adapter_config(lora.lora_name, lora.lora_path, limits.max_lora_rank)
        check_adapter_weights(lora.lora_name, lora.lora_path, adapter, limits.lora_module_shapes, limits.num_layers)
        if len(self.checked_loras) >= 4096:
            self.checked_loras.pop(next(iter(self.checked_loras)))
        self.checked_loras[lora] = None


    def process_pooling(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                        arrival_time: float | None = None, priority: int = 0,
                        cache_salt: str | None = None) -> EngineCoreRequest:
        """Validate a pooling request (runner pooling) and fill its parameters from the model's pooling
        (vLLM's PoolingParams.verify): a prompt may take the whole context, `dimensions` needs a matryoshka model.

        Raises:
            InvalidRequestError: not a pooling server, or a prompt or parameter out of range (HTTP 400).
        """
        limits = self.limits
        pooler = limits.pooler
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt must not be empty.", param="input")
        if pooler is None:
            raise InvalidRequestError(wrong_runner_message(limits.runner_type))
        num_prompt = len(prompt_token_ids)
        if num_prompt > limits.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
                f"{num_prompt} tokens in the input for embedding generation. Please reduce the length of the "
                "input.", param="input", code="context_length_exceeded")
        dimensions = params.dimensions if params.dimensions is not None else pooler.dimensions
        if params.task != "embed":
            raise InvalidRequestError(f"Pooling task {params.task!r} is not supported; only embed.", param="task")
        if dimensions is not None:
            check_dimensions(dimensions, pooler, self.model_name)
        params = msgspec.structs.replace(
            params, dimensions=dimensions, pooling_type=pooler.pooling_type,
            use_activation=pooler.use_activation if params.use_activation is None else params.use_activation,
            skip_reading_prefix_cache=pooler.pooling_type != "LAST")
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < limits.vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {limits.vocab_size}).",
                                      param="input")
        # the priority's and the salt's checks (one token: a pooling prompt may fill the context, no output follows)
        request = self.process(request_id, prompt_token_ids[:1], SamplingParams(max_tokens=1, detokenize=False),
                               arrival_time, priority, cache_salt)
        request.prompt_token_ids = list(prompt_token_ids)
        request.pooling_params = params
        request.eos_token_id = None
        return request


def check_dimensions(dimensions: int, pooler: PoolerDefaults, model_name: str) -> None:
    """vLLM's checks of `dimensions` (PoolingParams._set_default_parameters), its messages."""
    size = pooler.embedding_size
    if not pooler.is_matryoshka:
        raise InvalidRequestError(f"Model {model_name!r} does not support Matryoshka embeddings; dimensions must be "
                                  f"unset (received dimensions={dimensions}).", param="dimensions")
    if not 1 <= dimensions <= size:
        raise InvalidRequestError(f"Model {model_name!r} only supports dimensions in range [1, {size}], got "
                                  f"{dimensions}.", param="dimensions")
    if pooler.matryoshka_dimensions is not None and dimensions not in pooler.matryoshka_dimensions:
        raise InvalidRequestError(f"Model {model_name!r} only supports Matryoshka dimensions "
                                  f"{pooler.matryoshka_dimensions}, got {dimensions}.", param="dimensions")


def with_tokenizer_eos(limits: ModelLimits, eos_token_id: int) -> ModelLimits:
    """vLLM's EOS: a request's EOS is the tokenizer's eos_token_id, and the model's EOS ids (generation_config.json's
    eos_token_id list) other than it are stop token ids (SamplingParams.update_from_generation_config). They differ
    e.g. for Llama 3.1 Instruct (tokenizer <|eot_id|>, generation config [<|end_of_text|>, <|eom_id|>, <|eot_id|>]):
    ending on <|eot_id|> is an EOS (stop_reason None), on <|eom_id|> a stop token (stop_reason its id)."""
    if eos_token_id == limits.eos_token_id:
        return limits
    model_ids = [t for t in (limits.eos_token_id, *limits.extra_stop_token_ids) if t is not None]
    return dataclasses.replace(limits, eos_token_id=eos_token_id,
                               extra_stop_token_ids=[t for t in dict.fromkeys(model_ids) if t != eos_token_id])


def json_options(limits: ModelLimits) -> tuple[bool, bool]:
    """The server's JSON options, as check_grammar and grammar_of take them (disable_any_whitespace,
    disable_additional_properties)."""
    return limits.json_disable_any_whitespace, limits.json_disable_additional_properties


def check_cache_salt(cache_salt: str | None) -> None:
    """Raises InvalidRequestError unless cache_salt is None or 1 to MAX_CACHE_SALT_LEN characters of valid
    Unicode (the one check of a client's salt, with or without --cache-salt-from-api-key)."""
    if cache_salt is not None and not (isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT_LEN
                                       and is_valid_unicode(cache_salt)):
        raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} "
                                  "characters of valid Unicode.", param="cache_salt")


def is_valid_unicode(text: str) -> bool:
    """False for text that cannot be encoded as UTF-8 (a lone surrogate such as "\\ud83d", which JSON allows)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
