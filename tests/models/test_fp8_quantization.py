"""--quantization fp8 on a Hugging Face checkpoint: linear weights quantized at load to fp8 e4m3 with a per-row
scale, kept as 8-bit codes and multiplied by the quantized-weight kernels (W8A32); refused where it cannot run."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models import loader
from pagedllm.models.fp8_codes import FP8_BITS, fp8_reference, quantize_fp8

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")


def random_weight(n: int, k: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    w[0, :] = 0.0  # an all-zero row
    w[1, 1:] *= 1e-4  # one large value: the rest become e4m3 subnormals
    w[2] = -w[2].abs()
    return w


def test_codes_decode_to_the_fp8_values_exactly():
    w = random_weight(21, 96)
    packed = PackedWeight.from_codes(quantize_fp8(w, "w"))
    expected = fp8_reference(w)
    assert (expected[1, 1:] != 0).any() and (expected[1, 1:].abs() < expected[1, 0].abs() * 2.0 ** -6).any()
    assert torch.equal(packed.dequantize(), expected)  # the scalar decode
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ expected.double().T
    bound = 96 * 2.0 ** -23 * (x.double().abs() @ expected.double().abs().T) + 1e-30
    for rows in (1, 2, 3, 5, 6, 7, 8, 20):  # streaming (M <= 8) and blocked (large M) paths
        got = packed.matmul(x[:rows])
        assert ((got.double() - ref[:rows]).abs() <= bound[:rows]).all(), rows
        assert torch.equal(got, packed.matmul(x)[:rows]), rows  # rows independent of the batch


def test_fp8_weights_vs_fp32_on_a_tiny_model(tiny_llama_dir):
    fp32 = loader.load_model(ModelConfig(model=str(tiny_llama_dir)), CPU, torch.float32)
    fp8 = loader.load_model(ModelConfig(model=str(tiny_llama_dir), quantization="fp8"), CPU, torch.float32)
    linears = {n: m for n, m in fp8.named_modules() if isinstance(m, Linear) and n != "lm_head"}
    assert linears and all(m.quant_weight is not None and m.quant_weight.bits == FP8_BITS and m.weight is None
                           for m in linears.values())
    assert fp8.lm_head.quant_weight is None and fp8.model.embed_tokens.weight is not None  # as vLLM: not quantized
    fp32_bytes = sum(m.in_features * m.out_features * 4 for m in linears.values())
    fp8_bytes = sum(m.quant_weight.nbytes for m in linears.values())
    assert fp8_bytes <= 0.32 * fp32_bytes  # 1 code byte + 8 scale bytes per 32 weights (and padding) vs 4 bytes
    prompt = list(range(3, 60))
    ref = torch.log_softmax(PagedRunner(fp32).step([("a", prompt)]).double(), -1)
    got = torch.log_softmax(PagedRunner(fp8).step([("a", prompt)]).double(), -1)
    nxt = torch.tensor(prompt[1:])[:, None]
    delta = (ref[:-1].gather(1, nxt) - got[:-1].gather(1, nxt)).abs().mean()
    assert 0 < float(delta) < 0.08, float(delta)  # measured 0.045 on random prompts


def test_fp8_on_a_gguf_model_is_refused(tiny_llama_gguf):
    with pytest.raises(ValueError, match="--quantization fp8 does not apply to a GGUF model"):
        loader.load_model(ModelConfig(model=str(tiny_llama_gguf), quantization="fp8"), CPU, torch.float32)


def test_fp8_needs_float32(tiny_llama_dir):
    with pytest.raises(ValueError, match="--quantization fp8 needs the CPU, float32"):
        loader.load_model(ModelConfig(model=str(tiny_llama_dir), quantization="fp8"), CPU, torch.bfloat16)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="--quantization must be one of gguf, fp8"):
        ModelConfig(quantization="awq")
