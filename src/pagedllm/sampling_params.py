"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import math

import msgspec

# Caps that bound the work one request can ask for. The server exposes them as flags.
MAX_LOGPROBS = 20
MAX_SLO_MS = 86_400_000.0
"""The longest ttft_slo_ms / tpot_slo_ms: a day."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (argmax); the sampler applies the same threshold per row."""


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of `json`, `regex`,
    `choice`, `grammar` or `json_object`, plus options on how strictly JSON is generated."""

    json: str | dict | None = None
    """A JSON schema, as a dict or its JSON text."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """A Lark or EBNF grammar, as the backend takes it."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_end_token_ids: list[int] | None = None
    """Set by the server's reasoning parser: the output begins inside the model's reasoning, which is left
    unconstrained; the grammar applies from the token after the first of these tokens (`</think>`) on."""


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters for text generation, with vLLM's field names and defaults.

    `temperature == 0` (below GREEDY_TEMPERATURE) means greedy. `validate()` raises `ValueError` with a message a
    user can act on.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    ttft_slo_ms: float | None = None
    """pagedllm's (--scheduling-policy slo only): the time-to-first-token deadline, in milliseconds after arrival.
    The scheduler orders waiting requests by their slack to it and refuses one that can no longer meet it."""
    tpot_slo_ms: float | None = None
    """pagedllm's (--scheduling-policy slo only): the time per output token after the first, in milliseconds; with
    ttft_slo_ms it sets the deadline of a preempted request's next token (the n-th is due at TTFT + n x TPOT)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise ValueError naming the first parameter that is out of range. `max_logprobs`: the server's
        --max-logprobs (-1: no cap but the vocabulary)."""
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        _check(_finite(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature",
               f"temperature must be in [0, 2], got {self.temperature}.")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"top_p must be in (0, 1], got {self.top_p}.")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1, "top_k",
               f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}.")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be at least 0, got {self.min_tokens}.")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens}).")
        cap = max_logprobs if max_logprobs != -1 else vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= 0 and (cap is None or value <= cap), name,
                       f"{name} must be in [0, {cap}] (--max-logprobs), got {value}." if cap is not None else
                       f"{name} must be at least 0, got {value}.")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty.")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", f"seed {self.seed} does not fit in 64 bits.")
            # choice i of n samples with seed + i (vLLM's children): the last one must fit too
            _check(self.seed + self.n - 1 < 2**64, "seed",
                   f"seed {self.seed} is too large for n={self.n}: choice i samples with seed + i, and "
                   f"{self.seed + self.n - 1} does not fit in 64 bits (at most {2**64 - self.n} with this n).")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None:
                _check(_finite(value) and 0 < value <= MAX_SLO_MS, name,
                       f"{name} must be in (0, {MAX_SLO_MS}] milliseconds, got {value}.")
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                _check(0 <= tid < vocab_size, "stop_token_ids", f"stop token id {tid} is outside the vocabulary.")
        if self.logit_bias:
            for tid, bias in self.logit_bias.items():
                _check(vocab_size is None or 0 <= tid < vocab_size, "logit_bias",
                       f"logit_bias token id {tid} is outside the vocabulary.")
                _check(_finite(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                       f"logit_bias values must be in [-100, 100], got {bias}.")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
