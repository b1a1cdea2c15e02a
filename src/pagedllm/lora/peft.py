"""PEFT LoRA adapters: a folder with adapter_config.json and adapter_model.safetensors (what PEFT's save_pretrained
writes), read, checked and turned into per-module weights.

Supported: plain LoRA (r, lora_alpha, use_rslora, rank_pattern / alpha_pattern) on the decoder layers' linear
modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or the fused qkv_proj / gate_up_proj of
checkpoints that store them fused). Refused with a message naming the feature, as vLLM's PEFTHelper refuses it:
DoRA, LoRA bias, modules_to_save, embedding or LM-head targets, non-LoRA inits that change the base weights,
aLoRA, layer replication, QALoRA, a rank above --max-lora-rank, and pickled weights (adapter_model.bin).

Each module's delta is y += (x @ A^T) @ (scaling * B)^T, A [r, in] and B [out, r] from lora_A / lora_B, scaling =
lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), as PEFT computes it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")  # only set the initial A/B, as vLLM's list
_WEIGHT_NAME = re.compile(r"^(?:base_model\.model\.)?(.*?)\.lora_(A|B)(?:\.default)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message says why (HTTP 400 on the load route)."""

    status_code = 400


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the path (vLLM's LoRAAdapterNotFoundError, HTTP 404)."""

    status_code = 404

    def __init__(self, lora_name: str, lora_path: str):
        super().__init__(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")


@dataclass(frozen=True)
class AdapterConfig:
    """The adapter_config.json keys that decide the math."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None

    def rank_and_scaling(self, module_name: str) -> tuple[int, float]:
        """PEFT's rank and scaling for `module_name` (e.g. model.layers.0.self_attn.q_proj): a pattern key matches
        as a suffix of the name at a "." boundary, the first match wins."""
        rank = _match(self.rank_pattern, module_name, self.r)
        alpha = _match(self.alpha_pattern, module_name, self.lora_alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _match(pattern: dict | None, name: str, default: Any) -> Any:
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_adapter_config(lora_name: str, lora_path: str, max_lora_rank: int) -> AdapterConfig:
    """The adapter's config, checked; raises LoRAAdapterNotFoundError (no folder or no adapter_config.json) or
    LoRAAdapterError (a feature not supported, a rank above max_lora_rank, no safetensors weights)."""
    config_path = os.path.join(lora_path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoRAAdapterNotFoundError(lora_name, lora_path)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"Loading lora {lora_name} failed: {CONFIG_FILE} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"Loading lora {lora_name} failed: {CONFIG_FILE} is not a JSON object.")
    errors = _unsupported(config)
    try:
        adapter = AdapterConfig(int(config["r"]), float(config.get("lora_alpha", 8)), bool(config.get("use_rslora")),
                                config.get("rank_pattern") or None, config.get("alpha_pattern") or None)
    except (KeyError, TypeError, ValueError):
        raise LoRAAdapterError(f"Loading lora {lora_name} failed: {CONFIG_FILE} needs an integer rank `r`.") from None
    ranks = [adapter.r, *(adapter.rank_pattern or {}).values()]
    if min(ranks) <= 0:
        errors.append(f"LoRA rank `r` must be a positive integer, got {min(ranks)}.")
    elif max(ranks) > max_lora_rank:
        errors.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}.")
    if not os.path.isfile(os.path.join(lora_path, WEIGHTS_FILE)):
        errors.append(f"No {WEIGHTS_FILE} in {lora_path} (pickled adapter_model.bin weights are not loaded; save the "
                      "adapter with safe_serialization=True).")
    if errors:
        raise LoRAAdapterError(" ".join(errors))
    return adapter


def _unsupported(config: dict) -> list[str]:
    """What the config asks that is not served, in vLLM's words where vLLM refuses it too."""
    errors = []
    if config.get("peft_type", "LORA") != "LORA":
        errors.append(f"Only LoRA adapters are supported, got peft_type {config.get('peft_type')!r}.")
    if config.get("modules_to_save"):
        errors.append(f"modules_to_save is not supported (it replaces whole modules): {config['modules_to_save']}.")
    if config.get("use_dora"):
        errors.append("DoRA (use_dora) is not supported.")
    if config.get("lora_bias"):
        errors.append("LoRA bias (lora_bias) is not supported.")
    if config.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in SUPPORTED_INITS:
        errors.append(f"init_lora_weights={init!r} is not supported: it modifies the base model's weights.")
    for key, what in (("alora_invocation_tokens", "Activated LoRA (aLoRA)"), ("layer_replication",
                      "layer_replication"), ("use_qalora", "QALoRA"), ("use_bdlora", "block-diagonal LoRA")):
        if config.get(key):
            errors.append(f"{what} is not supported.")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    embedding = [t for t in names if any(e in t for e in ("embed_tokens", "lm_head", "wte"))]
    if embedding:
        errors.append(f"LoRA on embeddings or the LM head is not supported (target_modules {embedding}); supported "
                      f"targets: {', '.join(SUPPORTED_MODULES)}.")
    return errors


def check_adapter_weights(lora_name: str, lora_path: str, adapter: AdapterConfig,
                          module_shapes: dict[str, list[int]], num_layers: int) -> None:
    """Check the safetensors' names and shapes (its header only) against the model: every lora_A/lora_B pair on a
    supported module of an existing layer, A [r, in] and B [out, r] with the module's in/out features
    (`module_shapes`: module -> [in, out]). Raises LoRAAdapterError naming the first tensor that does not fit."""
    from safetensors import safe_open

    with safe_open(os.path.join(lora_path, WEIGHTS_FILE), framework="np") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    _pairs(lora_name, shapes, adapter, module_shapes, num_layers)


def _pairs(lora_name: str, shapes: dict[str, list[int]], adapter: AdapterConfig, module_shapes: dict[str, list[int]],
           num_layers: int) -> dict[tuple[int, str], tuple[str, str, int, float]]:
    """(layer, module) -> (lora_A name, lora_B name, rank, scaling), every tensor checked."""
    found: dict[str, dict[str, str]] = {}
    for name in shapes:
        match = _WEIGHT_NAME.match(name)
        if match is None:
            raise LoRAAdapterError(f"Loading lora {lora_name} failed: tensor {name!r} is not a lora_A/lora_B weight "
                                   "of a supported module (embeddings, biases and saved modules are not supported).")
        found.setdefault(match.group(1), {})[match.group(2)] = name
    pairs = {}
    for module_name, ab in found.items():
        where = _LAYER_MODULE.match(module_name)
        if where is None or where.group(2) not in module_shapes or int(where.group(1)) >= num_layers:
            raise LoRAAdapterError(
                f"Loading lora {lora_name} failed: module {module_name!r} is not a LoRA target this model supports "
                f"({', '.join(m for m in SUPPORTED_MODULES if m in module_shapes)} of layers 0-{num_layers - 1}).")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"Loading lora {lora_name} failed: module {module_name!r} has no lora_"
                                   f"{'B' if 'A' in ab else 'A'} weight.")
        rank, scaling = adapter.rank_and_scaling(module_name)
        in_features, out_features = module_shapes[where.group(2)]
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        if a != [rank, in_features] or b != [out_features, rank]:
            raise LoRAAdapterError(
                f"Loading lora {lora_name} failed: {module_name} has lora_A {a} and lora_B {b}; this model needs "
                f"[{rank}, {in_features}] and [{out_features}, {rank}] (rank {rank}). Was it trained for another "
                "base model?")
        pairs[int(where.group(1)), where.group(2)] = (ab["A"], ab["B"], rank, scaling)
    return pairs


def load_adapter(lora_name: str, lora_path: str, max_lora_rank: int, module_shapes: dict[str, list[int]],
                 num_layers: int) -> dict[tuple[int, str], tuple[Any, Any, float]]:
    """The adapter's weights, checked: (layer, module) -> (A [r, in], B [out, r], scaling) as float32 tensors."""
    from safetensors.torch import load_file

    adapter = read_adapter_config(lora_name, lora_path, max_lora_rank)
    tensors = load_file(os.path.join(lora_path, WEIGHTS_FILE))
    pairs = _pairs(lora_name, {k: list(v.shape) for k, v in tensors.items()}, adapter, module_shapes, num_layers)
    return {key: (tensors[a].float(), tensors[b].float(), scaling) for key, (a, b, _, scaling) in pairs.items()}


def module_shapes(info: Any, dense_mlp: bool = True) -> dict[str, list[int]]:
    """Each supported target's [in_features, out_features] for a Llama-shaped model (`info`: models' ModelInfo);
    the MLP's only when every layer's MLP is dense (a mixture of experts has no gate/up/down Linear)."""
    h, q, kv, i = info.hidden_size, info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim, \
        info.intermediate_size
    shapes = {"q_proj": [h, q], "k_proj": [h, kv], "v_proj": [h, kv], "o_proj": [q, h], "qkv_proj": [h, q + 2 * kv]}
    if dense_mlp:
        shapes |= {"gate_proj": [h, i], "up_proj": [h, i], "down_proj": [i, h], "gate_up_proj": [h, 2 * i]}
    return shapes
