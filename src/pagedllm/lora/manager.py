"""LoRAManager: the runner's adapters. It attaches a LinearLoRA to every targetable Linear of the model, loads
adapters from their PEFT folders on first use (keeping --max-cpu-loras of them, least recently used evicted first),
and builds each step's LoRAMapping: the rows of the flattened batch grouped by adapter (lora/layers.py)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from pagedllm.config import LoRAConfig
from pagedllm.lora.layers import LinearLoRA, LoRAMapping
from pagedllm.lora.peft import load_adapter, module_shapes
from pagedllm.messages import LoRARequest

logger = logging.getLogger(__name__)


def attach_lora(model: torch.nn.Module) -> dict[tuple[int, str], LinearLoRA]:
    """A LinearLoRA on each decoder layer's q/k/v/o and dense gate/up/down Linear (Llama-shaped families:
    models/llama.py's qkv_proj, o_proj, gate_up_proj, down_proj). Returns (layer, module name) -> its LinearLoRA.
    Raises ValueError for a model without them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].self_attn, "qkv_proj"):
        raise ValueError(f"--enable-lora: {type(model).__name__} has no Llama-shaped decoder layers to apply LoRA to.")
    targets = {}
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q, kv = attn.q_size, attn.kv_size
        qkv = attn.qkv_proj.lora = LinearLoRA(attn.qkv_proj, {"q_proj": (0, q), "k_proj": (q, kv),
                                                              "v_proj": (q + kv, kv), "qkv_proj": (0, q + 2 * kv)})
        o = attn.o_proj.lora = LinearLoRA(attn.o_proj, {"o_proj": (0, attn.o_proj.out_features)})
        targets |= {(i, name): qkv for name in ("q_proj", "k_proj", "v_proj", "qkv_proj")} | {(i, "o_proj"): o}
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):  # a dense MLP (not a mixture of experts)
            inter = mlp.gate_up_proj.out_features // 2
            gate_up = mlp.gate_up_proj.lora = LinearLoRA(mlp.gate_up_proj, {
                "gate_proj": (0, inter), "up_proj": (inter, inter), "gate_up_proj": (0, 2 * inter)})
            down = mlp.down_proj.lora = LinearLoRA(mlp.down_proj, {"down_proj": (0, mlp.down_proj.out_features)})
            targets |= {(i, name): gate_up for name in ("gate_proj", "up_proj", "gate_up_proj")}
            targets[i, "down_proj"] = down
    return targets


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, model_info, dtype: torch.dtype):
        self.config = config
        self.dtype = dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.targets = attach_lora(model)
        self.num_layers = len(model.model.layers)
        self.shapes = module_shapes(model_info, dense_mlp=all((i, "down_proj") in self.targets
                                                              for i in range(self.num_layers)))
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        """lora_int_id -> its request, least recently used first."""

    @staticmethod
    def sort_key(state) -> int:
        """The runner orders a step's requests by this (a stable sort): the base model's first, then each adapter's
        together, so that each adapter's rows are one slice (outputs do not depend on a row's place in the batch)."""
        return 0 if state.lora_request is None else state.lora_request.lora_int_id

    def mapping(self, loras: list[LoRARequest | None], num_sched: np.ndarray) -> LoRAMapping | None:
        """This step's LoRAMapping (None when no row runs an adapter), loading the adapters it needs.
        `loras`: each scheduled request's adapter, in batch order; `num_sched`: its tokens this step."""
        if all(lora is None for lora in loras):
            return None
        ends = np.cumsum(num_sched)
        starts = ends - num_sched
        by_id: dict[int, list[int]] = {}
        for i, lora in enumerate(loras):
            if lora is not None:
                self._ensure_loaded(lora, by_id)
                by_id.setdefault(lora.lora_int_id, []).append(i)
        groups = []
        for lora_id, reqs in by_id.items():
            if all(reqs[j + 1] == reqs[j] + 1 for j in range(len(reqs) - 1)):  # adjacent requests: one slice
                groups.append((lora_id, slice(int(starts[reqs[0]]), int(ends[reqs[-1]]))))
            else:
                rows = np.concatenate([np.arange(starts[j], ends[j]) for j in reqs])
                groups.append((lora_id, torch.from_numpy(rows)))
        return LoRAMapping(groups)

    def _ensure_loaded(self, lora: LoRARequest, in_step: dict[int, list[int]]) -> None:
        if lora.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora.lora_int_id)
            return
        weights = load_adapter(lora.lora_name, lora.lora_path, self.config.max_lora_rank, self.shapes,
                               self.num_layers)
        while len(self.loaded) >= self.config.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in in_step), None)
            if victim is None:
                break
            self.remove(victim)
        per_linear: dict[int, tuple[LinearLoRA, dict]] = {}
        for (layer, name), (a, b, scaling) in weights.items():
            target = self.targets[layer, name]
            per_linear.setdefault(id(target), (target, {}))[1][name] = (a, b, scaling)
        for target, parts in per_linear.values():
            target.set_adapter(lora.lora_int_id, parts, self.dtype)
        self.loaded[lora.lora_int_id] = lora
        logger.info("Loaded LoRA adapter %r (id %d) from %s: %d modules", lora.lora_name, lora.lora_int_id,
                    lora.lora_path, len(weights))

    def remove(self, lora_id: int) -> None:
        """Drop an adapter's weights (it reloads from its path if a request needs it again)."""
        if self.loaded.pop(lora_id, None) is not None:
            for target in {id(t): t for t in self.targets.values()}.values():
                target.remove_adapter(lora_id)
