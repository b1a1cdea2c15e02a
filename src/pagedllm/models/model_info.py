"""ModelInfo: the architecture facts the model and the runner need, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The generation_config.json keys that become default sampling parameters (vLLM's choice of keys).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


class ModelLoadError(ValueError):
    """A model folder or file is missing, corrupt, truncated or unsupported; the message names it."""


@dataclass
class ModelInfo:
    architecture: str  # e.g. "LlamaForCausalLM"; picks the model class in models/registry.py
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_scaling dict ("rope_type", ...)
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: per-frequency divisors
    rotary_dim: int | None = None  # dimensions of each head rotary applies to (partial_rotary_factor); None: all
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation_config: dict[str, Any] = field(default_factory=dict)  # sampling defaults (GENERATION_CONFIG_KEYS)
    # config.json as read (a GGUF file: its family's keys under config.json's names, models/gguf_loader.py), for
    # the keys only some families read (sliding_window, layer_types, soft-capping...: models/mistral.py, gemma2.py)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def validate(self, source: str) -> None:
        """Raise ModelLoadError naming `source` when the numbers cannot describe a Llama."""
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{source}: {self.num_heads} attention heads are not a multiple of "
                                 f"{self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim {self.head_dim} must be even for rotary embedding")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ModelLoadError(f"{source}: rotary dimension {self.rotary_dim} must be even and within head_dim "
                                 f"{self.head_dim}")
        from pagedllm.layers.rotary import SUPPORTED_ROPE_TYPES  # here: importing this module needs no torch

        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"{source}: rope scaling {rope_type!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if rope_type == "longrope":
            half = (self.rotary_dim or self.head_dim) // 2
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling.get(key) or ()) != half:
                    raise ModelLoadError(f"{source}: longrope {key} must have {half} values (one per rotated "
                                         f"frequency), got {len(self.rope_scaling.get(key) or ())}")


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`).

    longrope (and its legacy name "su", Phi-3) gets the context sizes its attention factor is computed from:
    config.json's original_max_position_embeddings where set (transformers gives it priority) and its
    max_position_embeddings (before any cap to a sliding window). rope_parameters by layer type (Gemma 3's
    "full_attention" and "sliding_attention"): the full-attention layers' (the family reads the others)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5's per layer type (Gemma 3): the global layers' are the model's
        params = params["full_attention"] or {}
    scaling = config.get("rope_scaling") or dict(params) or None
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        for key in ("rope_theta", "partial_rotary_factor", "type"):
            scaling.pop(key, None)
        if scaling["rope_type"] == "su":
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "longrope":
            max_positions = int(config.get("max_position_embeddings", 2048))
            scaling["original_max_position_embeddings"] = int(
                config.get("original_max_position_embeddings")
                or scaling.get("original_max_position_embeddings") or max_positions)
            scaling["max_position_embeddings"] = max_positions
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def _rotary_dim(config: dict[str, Any], head_dim: int) -> int | None:
    """The rotated dimensions of a head where `partial_rotary_factor` (top level or in rope_parameters) is below
    1, as transformers rounds it: int(head_dim * factor); None for all of them."""
    factor = config.get("partial_rotary_factor", (config.get("rope_parameters") or {}).get("partial_rotary_factor"))
    if factor is None or float(factor) >= 1.0:
        return None
    return int(head_dim * float(factor))


def model_info_from_hf_config(config: dict[str, Any], generation_config: dict[str, Any],
                              source: str) -> ModelInfo:
    """Build ModelInfo from a parsed config.json (+ generation_config.json, may be {})."""
    architectures = config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{source}: config.json has no 'architectures' entry")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        theta, scaling = _rope(config)
        eos = token_ids(generation_config.get("eos_token_id")) or token_ids(config.get("eos_token_id"))
        info = ModelInfo(
            architecture=architectures[0],
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=_rotary_dim(config, head_dim),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos,
            generation_config={k: generation_config[k] for k in GENERATION_CONFIG_KEYS
                               if generation_config.get(k) is not None},
            hf_config=config,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: config.json has a malformed value ({e})") from None
    info.validate(source)
    return info
