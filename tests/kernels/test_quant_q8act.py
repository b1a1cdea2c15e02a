"""The 8-bit-activation kernel: packing is exact against gguf's dequantization, the integer path equals a float64
evaluation of the same quantized math (within fp32 summation error), and rows are independent of batch size
and thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from pagedllm.kernels import quant_q8act as qa8

pytestmark = pytest.mark.skipif(not qa8.available(), reason="needs the AVX2 native kernels")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K]
# byte offsets of each type's fp16 fields (scales, mins) inside a block
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2)}


def random_gguf(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of an [n, k] tensor, its fp16 fields set to finite scales of either sign."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packing_keeps_every_weight(qtype):
    n, k = 8, 512
    raw = random_gguf(qtype, n, k)
    packed = qa8.pack_gguf(raw, qtype, n, k)
    expected = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(n, k)
    np.testing.assert_array_equal(qa8.dequantize_packed(packed), expected)


def test_activation_quantization_is_llamacpp_q8():
    x = torch.randn(5, 96) * torch.tensor([1.0, 1e-3, 30.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    q, d, s = qa8.quantize_activations(x)
    blocks = x.reshape(5, 3, 32)
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(d, amax / 127, rtol=2.5e-7, atol=0)  # 1 ulp: fast-math multiplies by 1/127
    code = q.reshape(5, 3, 32).float()
    assert code.abs().max() <= 127 and (code.abs().amax(-1)[amax > 0] == 127).all()
    assert ((code - blocks / d.clamp_min(1e-30)[..., None]).abs() <= 0.5 + 1e-4).all()  # round to nearest
    assert (code[1, 1] == 0).all() and d[1, 1] == 0
    torch.testing.assert_close(s, d * code.sum(-1), rtol=1e-6, atol=0)


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """float64 of the kernel's int8 activations times their block scales."""
    q, d, _ = qa8.quantize_activations(x)
    return (q.double().reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(13, 256), (64, 1536)])
def test_integer_path_equals_float64_reference(qtype, n, k):
    packed = qa8.pack_gguf(random_gguf(qtype, n, k, seed=n), qtype, n, k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    out = qa8.linear(x, qa8.Q8ActWeight(packed))
    xq, w = dequantized_activations(x), torch.from_numpy(qa8.dequantize_packed(packed)).double()
    ref = xq @ w.T  # the same quantized math in float64
    # fp32 bound: each block's integer sum is exact; scaling it and accumulating k/32 blocks (and the min term)
    # cost a few ulps each of the magnitudes involved
    bound = 4 * (k // 32) * 2.0 ** -24 * (xq.abs() @ w.abs().T)
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() / bound).max())


def test_fused_parts_promote_4bit_to_5bit():
    n, k = 6, 256
    parts = [qa8.pack_gguf(random_gguf(t, n, k, seed=i), t, n, k) for i, t in enumerate([Q.Q4_K, Q.Q5_K, Q.Q4_0])]
    fused = qa8.fuse(parts)
    assert fused.kind == qa8.U5
    np.testing.assert_array_equal(qa8.dequantize_packed(fused),
                                  np.concatenate([qa8.dequantize_packed(p) for p in parts]))
    assert qa8.fuse([parts[0], qa8.pack_gguf(random_gguf(Q.Q8_0, n, k), Q.Q8_0, n, k)]) is None


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_rows_independent_of_batch_and_threads(qtype):
    n, k = 1541, 576  # n not a multiple of the 4-row tile; enough work to use both threads
    weight = qa8.Q8ActWeight(qa8.pack_gguf(random_gguf(qtype, n, k), qtype, n, k))
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = qa8.linear(x, weight)
        torch.set_num_threads(1)
        one_thread = qa8.linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for m in (1, 3, 17, 64):
        for start in (0, 5, 130 - m):
            assert torch.equal(qa8.linear(x[start:start + m], weight), full[start:start + m]), (m, start)
