"""A GGUF model whose weights stay quantized (CPU, float32): the loader keeps codes and scales (rotary rows
permuted, fused projections of mixed types concatenated), the weights are the dequantize-at-load values exactly,
and bad input fails the load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from paged_runner import PagedRunner

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import Linear
from pagedllm.models import loader
from pagedllm.models.gguf_loader import open_gguf, unpack_tensor
from pagedllm.models.model_info import ModelLoadError

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.float32, torch.device("cpu")),
                                reason="native CPU kernels unavailable")

CPU = torch.device("cpu")


def load(path, **kwargs):
    return loader.load_model(ModelConfig(model=str(path), **kwargs), CPU, torch.float32)


def test_weights_stay_quantized_and_equal_the_dequantized_ones(tiny_llama_gguf_quantized, monkeypatch):
    model = load(tiny_llama_gguf_quantized)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 3 * 4 + 1 and all(m.quant_weight is not None and m.weight is None for m in linears)
    assert model.model.embed_tokens.weight is None
    qkv = model.model.layers[1].self_attn.qkv_proj.quant_weight
    assert (qkv.bits, qkv.group, qkv.qtypes) == (8, 32, ("Q4_0", "Q4_1", "Q5_0"))
    with monkeypatch.context() as m:  # the dequantize-at-load path, float weights kept unpacked to compare
        m.setattr(loader, "runs_gguf_quantized", lambda *args: False)
        m.setattr(loader, "pack_linear_weights", lambda model: None)
        ref = load(tiny_llama_gguf_quantized)
    assert ref.model.layers[0].self_attn.qkv_proj.quant_weight is None
    ref_weights = dict(ref.named_parameters())
    for name, module in model.named_modules():
        if getattr(module, "quant_weight", None) is not None:
            assert torch.equal(module.quant_weight.dequantize(), ref_weights[f"{name}.weight"]), name
    ids = [1, 5, 9, 44, 100, 383, 7, 7, 12, 300, 2, 64, 65]
    ours, theirs = PagedRunner(model), PagedRunner(ref)
    with torch.inference_mode():
        for chunk in (ids[:9], ids[9:], [17], [18]):
            torch.testing.assert_close(ours.step([("a", chunk)]), theirs.step([("a", chunk)]), atol=2e-5, rtol=1e-5)


def test_bf16_activations_dequantize_at_load(tiny_llama_gguf_quantized):
    model = loader.load_model(ModelConfig(model=str(tiny_llama_gguf_quantized)), CPU, torch.bfloat16)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_weight is None and qkv.weight.dtype == torch.bfloat16


def test_a_nan_scale_fails_the_load(tiny_llama_gguf_quantized, tmp_path):
    data = bytearray(tiny_llama_gguf_quantized.read_bytes())
    tensor = next(t for t in open_gguf(tiny_llama_gguf_quantized).tensors if t.name == "blk.2.ffn_up.weight")  # Q4_1
    start = bytes(data).find(tensor.data.tobytes())
    block = 3
    data[start + 20 * block + 2: start + 20 * block + 4] = np.array([np.nan], np.float16).tobytes()  # its min m
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"nan\.gguf.*'blk\.2\.ffn_up\.weight' \(Q4_1\) is corrupt.*block 3 "
                                             r"has a non-finite fp16 scale"):
        load(bad)


def test_a_truncated_quantized_tensor_fails_the_load(tiny_llama_gguf_quantized, tmp_path):
    data = tiny_llama_gguf_quantized.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        load(cut)


def test_unsupported_type_names_the_tensor_and_the_supported_types(tmp_path):
    import gguf
    from test_gguf import write_tensors

    path = tmp_path / "iq.gguf"
    write_tensors(path, {"blk.0.attn_q.weight": (np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8), Q.Q2_K)})
    (tensor,) = open_gguf(path).tensors
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' has unsupported type Q2_K \(supported: "
                                             r"F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K\)"):
        unpack_tensor(tensor, path)


def test_quantization_flag(tiny_llama_gguf_quantized, tiny_llama_dir):
    assert load(tiny_llama_gguf_quantized, quantization="gguf").lm_head.quant_weight is not None
    with pytest.raises(ValueError, match="--quantization must be one of gguf, fp8; got .awq."):
        ModelConfig(quantization="awq")
    with pytest.raises(ValueError, match="--quantization gguf needs a GGUF model file"):
        load(tiny_llama_dir, quantization="gguf")


def test_reading_gguf_files_imports_no_torch():
    """The API server reads GGUF metadata and tokenizers through these modules; torch would add ~200 MB to it."""
    import subprocess
    import sys

    code = ("import sys, pagedllm.models.gguf_loader, pagedllm.models.gguf_unpack\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
