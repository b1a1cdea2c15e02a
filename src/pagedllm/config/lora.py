"""LoRAConfig: multi-LoRA serving (vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras,
--lora-dtype); one of the engine configuration's dataclasses (config/engine.py), with one docstring per field.
The adapters themselves come from --lora-modules (ServerConfig), /v1/load_lora_adapter, or a request's
LoRARequest (offline LLM.generate(..., lora_request=...)); lora/ loads and applies them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pagedllm.config.bounds import LORA_BOUNDS, check_bounds


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT's format: adapter_config.json + adapter_model.safetensors) on top of the base model:
    a request names an adapter in `model` (or passes a LoRARequest offline); one step batches requests of different
    adapters and of the base model together, the adapters' low-rank products added per group of rows."""
    max_loras: int = 1
    """Most distinct adapters in one step (vLLM's "max number of LoRAs in a single batch"): the scheduler holds
    back a waiting request whose adapter would be one more than this while the running requests use this many."""
    max_lora_rank: int = 16
    """Largest adapter rank `r` accepted (also every rank_pattern value); a bigger one is refused when loaded."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in memory (least recently used evicted first; reloaded from their path when needed
    again). Must be at least --max-loras; default: --max-loras."""
    lora_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    """The dtype adapter weights are computed in; auto: the model's activation dtype."""

    def __post_init__(self) -> None:
        check_bounds(self, LORA_BOUNDS)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras}).")


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's LoRAModulePath): the adapter's served name, its folder, and the served base
    model it belongs to (None: the first served model name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """--lora-modules' entries as vLLM's LoRAParserAction reads them: `name=path`, else a JSON object with `name`,
    `path` and optionally `base_model_name`. Raises ValueError naming the entry."""
    modules = []
    for item in values or []:
        if not item:
            continue
        if "=" in item and "," not in item and not item.lstrip().startswith("{"):
            name, path = item.split("=", 1)
            modules.append(LoRAModulePath(name, path))
            continue
        try:
            entry = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            if not isinstance(entry, dict):
                raise TypeError("expected a JSON object with name and path")
            module = LoRAModulePath(**entry)
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
        if not (isinstance(module.name, str) and module.name and isinstance(module.path, str) and module.path):
            raise ValueError(f"Invalid fields for --lora-modules: {item} - name and path must be non-empty strings")
        modules.append(module)
    return modules
