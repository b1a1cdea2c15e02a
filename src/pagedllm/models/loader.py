"""Find a model (HF folder, GGUF file, or the embedded SmolLM2), read its facts, and load its weights.

Only safetensors and GGUF are read: never pickle, never `torch.load`, never model-supplied code.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TensorParallelGroup, check_tensor_parallel_size
from pagedllm.distributed.pipeline_parallel import PipelineParallelGroup, check_pipeline_parallel_size
from pagedllm.kernels import cpu_kernels, quant_q8act
from pagedllm.layers.expert_linear import QuantizedExperts
from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.layers.linear import pack_linear_weights
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.layers.rotary import use_long_factors
from pagedllm.models.checkpoint_tensors import prepare_checkpoint_tensors
from pagedllm.models.expert_weights import EXPERT_PARALLEL_PLAN, local_experts, stack_experts
from pagedllm.models.fp8_codes import quantize_fp8, quantizes_to_fp8
from pagedllm.models.gguf_loader import gguf_model_info, gguf_tensors, open_gguf
from pagedllm.models.model_info import (
    GENERATION_CONFIG_KEYS,
    ModelInfo,
    ModelLoadError,
    model_info_from_hf_config,
    token_ids,
)
from pagedllm.models.quantized_codes import QuantizedWeight
from pagedllm.models.registry import get_model_class
from pagedllm.models.resolve import DEFAULT_MODEL_NAME, EMBEDDED_PACKAGE, ResolvedModel  # noqa: F401 (re-exported)
from pagedllm.models.resolve import resolve_model as _resolve_model
from pagedllm.models.tensor_parallel_weights import shard_tensors

logger = logging.getLogger(__name__)
RunWeight = PackedWeight | Int8ActivationWeight  # a quantized weight as Linear / VocabEmbedding run it
CPU = torch.device("cpu")

_EMBEDDED_PACKAGE = EMBEDDED_PACKAGE
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_model(model: str | ModelConfig | None, revision: str | None = None,
                  download_dir: str | None = None) -> ResolvedModel:
    """Turn a --model argument (or a ModelConfig's --model, --revision and --download-dir) into a local HF folder or
    GGUF file; ModelLoadError if neither."""
    load_format = "auto"
    if isinstance(model, ModelConfig):
        model, revision, download_dir, load_format = (model.model, model.revision, model.download_dir,
                                                      model.load_format)
    resolved = _resolve_model(model, _EMBEDDED_PACKAGE, revision, download_dir)
    found = "safetensors" if resolved.kind == "hf" else "gguf"
    if load_format != "auto" and load_format != found:
        raise ModelLoadError(f"--load-format {load_format}: {resolved.path} is a {found} model, not {load_format}.")
    return resolved


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AMX or AVX512-BF16), read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device, model_config: ModelConfig | None = None) -> torch.dtype:
    """auto: bf16 on CUDA; on the CPU fp32 for weights the native quantized kernels run (a GGUF model, or
    --quantization fp8: their activations are fp32), else bf16 where the CPU has AMX / AVX512-BF16, else fp32;
    otherwise the named dtype."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if model_config is not None and _runs_quantized_kernels(model_config, device):
        return torch.float32
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def _runs_quantized_kernels(model_config: ModelConfig, device: torch.device) -> bool:
    """Whether runs_gguf_quantized or runs_fp8 would put the weights in the native quantized kernels at float32:
    so that dtype auto keeps a GGUF model quantized on a CPU with native bf16 too. Errors are left to load_model."""
    try:
        resolved = resolve_model(model_config)
        return (runs_gguf_quantized(model_config, resolved, device, torch.float32)
                or runs_fp8(model_config, resolved, device, torch.float32))
    except (ModelLoadError, ValueError):
        return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot parse JSON ({e})") from None


def _generation_config_file(model_config: ModelConfig, resolved: ResolvedModel) -> dict[str, Any]:
    """generation_config.json where vLLM's try_get_generation_config reads it: the model folder's under
    --generation-config auto and vllm, the named folder's otherwise; {} where there is none (a GGUF file)."""
    if model_config.generation_config in ("auto", "vllm"):
        return _read_json(resolved.folder / "generation_config.json") if resolved.kind == "hf" else {}
    return _read_json(Path(model_config.generation_config) / "generation_config.json")


def _apply_generation_config(info: ModelInfo, model_config: ModelConfig, resolved: ResolvedModel) -> ModelInfo:
    """The file's sampling defaults, except under --generation-config vllm, with --override-generation-config merged
    over them (vLLM's get_diff_sampling_param: the overrides apply under vllm too, a null drops a default), and the
    file's EOS ids under every mode: vLLM makes a generation config's eos_token_id list stop ids even under vllm
    (the overrides do not change them)."""
    gen = _generation_config_file(model_config, resolved)
    merged = {**({} if model_config.generation_config == "vllm" else gen),
              **(model_config.override_generation_config or {})}
    info.generation_config = {k: merged[k] for k in GENERATION_CONFIG_KEYS if merged.get(k) is not None}
    if token_ids(gen.get("eos_token_id")):
        info.eos_token_ids = token_ids(gen.get("eos_token_id"))
    return info


def load_model_info(model_config: ModelConfig) -> ModelInfo:
    """The architecture facts and generation defaults, without loading weights.

    After `load_model`, the same object is `model.info`; no need to call both.
    """
    resolved = resolve_model(model_config)
    if resolved.kind == "gguf":
        info = gguf_model_info(open_gguf(resolved.path), resolved.path)
    else:
        info = _hf_model_info(resolved.path)
    return _apply_generation_config(info, model_config, resolved)


def _hf_model_info(folder: Path) -> ModelInfo:
    """From config.json; the EOS ids are generation_config.json's where it has them (_apply_generation_config),
    else config.json's (vLLM's fallback, GenerationConfig.from_model_config)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    return model_info_from_hf_config(_read_json(config_path), {}, str(folder))


def _safetensors_tensors(folder: Path, keep: Callable[[str], bool] | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors (`keep`: only those whose name it accepts, the others never
    read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found {', '.join(pickled)}: pickle-based weights are never loaded)" if pickled else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from None


def _fused_state_dict(model: nn.Module, tensors: Iterator[tuple[str, Any]], source: str,
                      device: torch.device, dtype: torch.dtype,
                      pack: Callable[[str, QuantizedWeight], RunWeight]) -> dict[str, torch.Tensor | RunWeight]:
    """Checkpoint tensors -> the model's state dict: converted, moved, q/k/v and gate/up fused.

    QuantizedWeights (a GGUF model run quantized) become what `pack` makes of them (a PackedWeight, or an
    Int8ActivationWeight in the fast mode); a fused group whose parts are not all quantized (e.g. an F16 v_proj
    next to Q4_K q/k) is dequantized whole (logged).
    """
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    state: dict[str, torch.Tensor | PackedWeight] = {}
    shards: dict[str, dict[int, torch.Tensor | QuantizedWeight]] = {}
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        t = tensor if isinstance(tensor, QuantizedWeight) else _to_torch(tensor, device, dtype)
        for part, (fused, idx) in packed.items():
            if f".{part}." in name:
                shards.setdefault(name.replace(f".{part}.", f".{fused}."), {})[idx] = t
                break
        else:
            state[name] = pack(name, t) if isinstance(t, QuantizedWeight) else t
    for fused_name, parts in shards.items():
        fused_part = fused_name.split(".")[-2]  # "qkv_proj" in model.layers.0.self_attn.qkv_proj.weight
        expected = sum(1 for fused, _ in packed.values() if fused == fused_part)
        if sorted(parts) != list(range(expected)):
            raise ModelLoadError(f"{source}: {fused_name} is missing some of its q/k/v or gate/up parts")
        ordered = [parts[i] for i in range(expected)]
        shapes = [list(p.shape) for p in ordered]
        try:
            state[fused_name] = _fuse(ordered, fused_name, device, dtype, pack)
        except (RuntimeError, ValueError):
            raise ModelLoadError(f"{source}: the parts of {fused_name} have mismatched shapes {shapes}") from None
    return state


def _to_torch(tensor: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(tensor) if isinstance(tensor, np.ndarray) else tensor
    return t.to(device=device, dtype=dtype)


def _fuse(parts: list[torch.Tensor | QuantizedWeight], name: str, device: torch.device,
          dtype: torch.dtype, pack: Callable[[str, QuantizedWeight], RunWeight]) -> torch.Tensor | RunWeight:
    """Concatenate a fused projection's parts along the output rows."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return pack(name, QuantizedWeight.concat(parts))
    if any(isinstance(p, QuantizedWeight) for p in parts):
        logger.info("%s mixes quantized and float parts: dequantized at load", name)
        parts = [PackedWeight.from_codes(p).dequantize().to(device=device, dtype=dtype)
                 if isinstance(p, QuantizedWeight) else p for p in parts]
    return torch.cat(parts, dim=0)


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """Run torch's CPU ops single-threaded for a while (restored after).

    Loading is copies and casts, bound by memory: a second OpenMP thread gains nothing, and on a shared,
    oversubscribed machine it made torch.cat of the fused weights 30x slower (1.8 s vs 0.06 s).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def runs_gguf_quantized(model_config: ModelConfig, resolved: ResolvedModel, device: torch.device,
                        dtype: torch.dtype) -> bool:
    """Whether a model's GGUF weights stay quantized and run in the quantized kernels: a GGUF model (quantization
    None or "gguf") on the CPU with float32 activations and the native kernels on. Elsewhere (CUDA, bf16,
    PAGEDLLM_NATIVE_KERNELS=0) its weights are dequantized at load. ValueError for a quantization method that does
    not fit the model."""
    method = model_config.quantization
    if resolved.kind == "gguf":
        if method not in (None, "gguf"):
            raise ValueError(f"--quantization {method} does not apply to a GGUF model ({resolved.path}); "
                             "its weights are already quantized: use --quantization gguf or leave it unset")
        return device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available(dtype, device)
    if method == "gguf":
        raise ValueError(f"--quantization gguf needs a GGUF model file; {resolved.path} is a Hugging Face folder")
    return False


def runs_fp8(model_config: ModelConfig, resolved: ResolvedModel, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights are quantized to fp8 at load (--quantization fp8 on a Hugging Face checkpoint); a
    GGUF model is refused by runs_gguf_quantized. ValueError where the fp8 kernels cannot run."""
    if model_config.quantization != "fp8" or resolved.kind == "gguf":
        return False
    if device.type != "cpu" or dtype != torch.float32 or not cpu_kernels.available(dtype, device):
        raise ValueError(f"--quantization fp8 needs the CPU, float32 and the native kernels (they run its W8A32 "
                         f"matmuls); got device {device.type}, dtype {str(dtype).removeprefix('torch.')}, native "
                         f"kernels {'on' if cpu_kernels.available(torch.float32, CPU) else 'off'}")
    return True


def _fp8_linears(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with every linear weight quantized to fp8 (models/fp8_codes.py)."""
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and quantizes_to_fp8(name, t):
            try:
                yield name, quantize_fp8(t, name)
            except ValueError as e:
                raise ModelLoadError(str(e)) from None
        else:
            yield name, t


def _packer(model_config: ModelConfig, quantized: bool, source: str) -> Callable[[str, QuantizedWeight], RunWeight]:
    """How quantized weights are packed: PackedWeight (fp32 activations), or in the fast mode
    (--activation-quantization int8) Int8ActivationWeight where the type has an int8 kernel, else PackedWeight
    (logged). ValueError when the fast mode cannot run (not a GGUF model run quantized, or no kernel here)."""
    if model_config.activation_quantization == "none":
        return lambda name, w: PackedWeight.from_codes(w)
    if not quantized:
        raise ValueError(f"--activation-quantization {model_config.activation_quantization} needs a GGUF model run "
                         f"quantized on the CPU in float32 with the native kernels; {source} is not")
    if not quant_q8act.available():
        raise ValueError(f"--activation-quantization {model_config.activation_quantization} needs the AVX2 native "
                         "kernels, which did not build or load on this machine")

    def pack(name: str, w: QuantizedWeight) -> RunWeight:
        fast = Int8ActivationWeight.from_quantized(w)
        if fast is None:
            logger.info("%s (%s) has no int8-activation kernel: it runs with float32 activations", name,
                        "/".join(w.qtypes))
            return PackedWeight.from_codes(w)
        return fast

    return pack


def _stage_filter(pp: PipelineParallelGroup | None, info: ModelInfo) -> Callable[[str], bool] | None:
    """Which checkpoint tensors a pipeline stage reads (None: all)."""
    if pp is None or pp.size == 1:
        return None
    check_pipeline_parallel_size(pp.size, info.num_layers)
    return pp.weight_filter(info.num_layers, info.tie_word_embeddings)


def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
               tp: TensorParallelGroup | None = None, pp: PipelineParallelGroup | None = None) -> nn.Module:
    """Build the model on the meta device, load its weights onto `device` in `dtype`; eval mode. With a
    tensor-parallel group of size > 1, only this rank's share of each weight (models/tensor_parallel_weights.py);
    with a pipeline stage of several, only its layers' weights (distributed/pipeline_parallel.py).

    Returns the model (e.g. LlamaForCausalLM); `model.info` is its ModelInfo.
    """
    resolved = resolve_model(model_config)
    source = str(resolved.path)
    quantized = runs_gguf_quantized(model_config, resolved, device, dtype)
    pack = _packer(model_config, quantized, source)
    if resolved.kind == "gguf":
        reader = open_gguf(resolved.path)
        info = _apply_generation_config(gguf_model_info(reader, resolved.path), model_config, resolved)
        tensors: Iterator[tuple[str, Any]] = gguf_tensors(reader, info, resolved.path, quantized=quantized,
                                                          keep=_stage_filter(pp, info))
    else:
        info = _apply_generation_config(_hf_model_info(resolved.path), model_config, resolved)
        tensors = _safetensors_tensors(resolved.path, _stage_filter(pp, info))
    model_cls = get_model_class(info.architecture, source)
    info.rope_scaling = use_long_factors(info.rope_scaling, model_config.max_model_len or info.max_position_embeddings)
    tensors = prepare_checkpoint_tensors(model_cls.checkpoint_tensors(tensors, resolved.kind), model_cls, info)
    if resolved.kind == "hf" and runs_fp8(model_config, resolved, device, dtype):
        tensors = _fp8_linears(tensors)
    if tp is not None and tp.size > 1:
        check_tensor_parallel_size(tp.size, info.num_heads, info.num_kv_heads, info.intermediate_size)
        plan = model_cls.tensor_parallel_plan
        if tp.expert_parallel:  # a mixture of experts: this rank's experts, whole
            tensors, plan = local_experts(tensors, model_cls, info, tp), {**EXPERT_PARALLEL_PLAN, **plan}
        tensors = shard_tensors(tensors, plan, info, tp)
    with torch.device("meta"):
        model = model_cls(info, tp, pp)
    with _one_cpu_thread():
        state = _fused_state_dict(model, tensors, source, device, dtype, pack)
        stack_experts(model, state, source)  # a mixture of experts' per-expert weights into its stacked ones
    expected = model.state_dict()
    if info.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state and "lm_head.weight" in expected:  # a pipeline stage may lack it
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{source}: weights do not match {info.architecture}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{source}: weight {name} has shape {list(t.shape)}, "
                                 f"expected {list(expected[name].shape)}")
    quantized_weights = {name: state.pop(name) for name in list(state)
                         if isinstance(state[name], PackedWeight | Int8ActivationWeight | QuantizedExperts)}
    model.load_state_dict(state, assign=True, strict=not quantized_weights)
    for name, weight in quantized_weights.items():
        model.get_submodule(name.removesuffix(".weight")).set_quantized_weight(weight)
    model.tie_weights()
    model.materialize(device)
    model.eval().requires_grad_(False)
    pack_linear_weights(model)  # CPU fp32: oneDNN's layout, once (weights not kept quantized)
    if quantized_weights:
        nbytes = sum(w.nbytes for w in {id(w): w for w in quantized_weights.values()}.values())
        qtypes = sorted({t for w in quantized_weights.values() for t in w.qtypes})
        logger.info("%d weights kept quantized (%s, %.1f MB packed), run by the native CPU kernels",
                    len(quantized_weights), "/".join(qtypes), nbytes / 1e6)
    logger.info("loaded %s (%s, %d layers) on %s in %s", resolved.name, info.architecture,
                info.num_layers, device, dtype)
    return model
