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
from pagedllm.layers.int8_activation_weight import Int8ActivationWeight
from pagedllm.models.gguf_unpack import unpack
from pagedllm.models.quantized_codes import QuantizedWeight

pytestmark = pytest.mark.skipif(not qa8.available(), reason="needs the AVX2 native kernels")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K]
# byte offsets of each type's fp16 fields (scales, mins) inside a block
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_gguf(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of an [n, k] tensor, its fp16 fields set to finite scales of either sign."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def packed(qtype: Q, n: int, k: int, seed: int = 0) -> Int8ActivationWeight:
    return Int8ActivationWeight.from_quantized(unpack(random_gguf(qtype, n, k, seed), qtype, (n, k)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packing_keeps_every_weight(qtype):
    n, k = 13, 512
    raw = random_gguf(qtype, n, k)
    expected = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(n, k)
    weight = packed(qtype, n, k)
    assert weight.kind == {Q.Q8_0: qa8.S8, Q.Q5_0: qa8.U5, Q.Q5_1: qa8.U5, Q.Q5_K: qa8.U5}.get(qtype, qa8.U4)
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
    ids = torch.tensor([[12, 0], [7, 8]])
    assert torch.equal(weight.rows(ids), torch.from_numpy(expected)[ids])


def test_types_without_a_kernel_are_left_to_the_lossless_path():
    n, k = 8, 256
    assert Int8ActivationWeight.from_quantized(unpack(random_gguf(Q.Q6_K, n, k), Q.Q6_K, (n, k))) is None
    fused = QuantizedWeight.concat([unpack(random_gguf(t, n, k), t, (n, k)) for t in (Q.Q4_K, Q.Q6_K)])
    assert Int8ActivationWeight.from_quantized(fused) is None  # 16-k groups


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
    weight = packed(qtype, n, k, seed=n)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    out = weight.matmul(x)
    xq, w = dequantized_activations(x), weight.dequantize().double()
    ref = xq @ w.T  # the same quantized math in float64
    # fp32 bound: each block's integer sum is exact; scaling it and accumulating k/32 blocks (and the min term)
    # cost a few ulps each of the magnitudes involved
    bound = 4 * (k // 32) * 2.0 ** -24 * (xq.abs() @ w.abs().T)
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() / bound).max())


def test_fused_4bit_and_5bit_parts_run_as_5bit():
    n, k = 6, 256
    parts = [unpack(random_gguf(t, n, k, seed=i), t, (n, k)) for i, t in enumerate([Q.Q4_K, Q.Q5_K, Q.Q4_0])]
    weight = Int8ActivationWeight.from_quantized(QuantizedWeight.concat(parts))
    assert weight.kind == qa8.U5
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    xq, w = dequantized_activations(x), weight.dequantize().double()
    bound = 4 * (k // 32) * 2.0 ** -24 * (xq.abs() @ w.abs().T)  # as in test_integer_path_equals_float64_reference
    assert ((weight.matmul(x).double() - xq @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_rows_independent_of_batch_and_threads(qtype):
    n, k = 1541, 576  # n not a multiple of the 4-row tile; enough work to use both threads
    weight = packed(qtype, n, k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = weight.matmul(x)
        torch.set_num_threads(1)
        one_thread = weight.matmul(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for m in (1, 3, 17, 64):
        for start in (0, 5, 130 - m):
            assert torch.equal(weight.matmul(x[start:start + m]), full[start:start + m]), (m, start)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_an_output_group_has_the_same_bits_in_the_wide_tile(qtype):
    """With AVX-512 VNNI, four groups of 8 outputs run at once, or two where fewer than four are left, a last odd
    group alone: 7 groups are a quad, a pair and a single one, and the rows rolled by 8 move every group's weights
    into the next tile kind."""
    n, k = 56, 512
    raw = random_gguf(qtype, n, k, seed=4)
    rolled = np.roll(raw.reshape(n, -1), 8, axis=0).reshape(-1)
    a = Int8ActivationWeight.from_quantized(unpack(raw, qtype, (n, k)))
    b = Int8ActivationWeight.from_quantized(unpack(rolled, qtype, (n, k)))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(a.matmul(x), torch.roll(b.matmul(x), -8, dims=1)), t
    finally:
        torch.set_num_threads(threads)
