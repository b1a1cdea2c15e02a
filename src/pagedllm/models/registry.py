"""Model classes by the name in config.json's `architectures` (GGUF files map their arch to one)."""

from __future__ import annotations

from torch import nn

from pagedllm.core.kv_cache_spec import KVCacheLayout, make_kv_cache_layout, single_group_layout
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.model_info import ModelInfo, ModelLoadError
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(architecture: str, source: str) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ModelLoadError(f"{source}: architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(MODEL_CLASSES)})") from None


def kv_cache_layout(info: ModelInfo, disable_hybrid: bool = False) -> KVCacheLayout:
    """The model's KV cache groups (core/kv_cache_spec.py) from each layer's sliding window (0: full attention), as
    its family's attention_options give them; one full-attention group with `disable_hybrid`
    (--disable-hybrid-kv-cache-manager). The engine core (the scheduler's managers) and every worker (the pool's
    tensors) compute the same one."""
    if disable_hybrid:
        return single_group_layout(info.num_layers)
    family = get_model_class(info.architecture, info.architecture)
    options = getattr(family, "attention_options", None)
    windows = [0 if options is None else int(options(info, i).sliding_window or 0) for i in range(info.num_layers)]
    return make_kv_cache_layout(windows)
