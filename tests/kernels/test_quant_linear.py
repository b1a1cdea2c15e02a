"""Quantized linear kernels: the weights they decode are exactly gguf's dequantized values, the products are within
fp32's summation bound of a float64 reference, and every row is bitwise independent of the batch and threads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.quantized_weight import PackedWeight
from pagedllm.models.gguf_unpack import UNPACKED_TYPES, unpack
from pagedllm.models.quantized_codes import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.float32, torch.device("cpu")),
                                reason="native CPU kernels unavailable")

# gguf.quants can quantize these; the K-quants get random blocks with sane fp16 scales
QUANTIZABLE = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
FP16_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def raw_tensor(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k] weights as GGUF blocks of `qtype` (rows of different magnitudes, so scales vary)."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((n, k)) * rng.uniform(1e-3, 2.0, (n, 1))
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[qtype]:
        scales = (rng.uniform(1e-4, 0.05, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("qtype", UNPACKED_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [96, 37])  # 37: a last panel of 5 rows
def test_decoded_weights_equal_gguf_dequantize(qtype, n):
    k = 512
    raw = raw_tensor(qtype, n, k)
    packed = PackedWeight.from_codes(unpack(raw, qtype, (n, k)))
    assert torch.equal(packed.dequantize(), reference(raw, qtype, n, k))  # same values (+0 == -0)
    ids = torch.tensor([[n - 1, 0], [5, 5]])
    assert torch.equal(packed.rows(ids), reference(raw, qtype, n, k)[ids])
    with pytest.raises(IndexError):
        packed.rows(torch.tensor([n]))


@pytest.mark.parametrize("qtype", UNPACKED_TYPES, ids=lambda q: q.name)
def test_products_within_the_fp32_summation_bound(qtype):
    n, k = 45, 768
    raw = raw_tensor(qtype, n, k, seed=1)
    packed = PackedWeight.from_codes(unpack(raw, qtype, (n, k)))
    w = reference(raw, qtype, n, k).double()
    for m in (1, 2, 3, 5, 6, 7, 8, 40):  # the streaming (M <= 8, one pass) and the tiled (M >= 9) paths
        x = torch.randn(m, k)
        y = packed.matmul(x).double()
        exact = x.double() @ w.T
        # sequential fp32 fma chain of K terms: |error| <= gamma_K * sum |w| |x|, gamma_K = K u / (1 - K u)
        u = 2.0 ** -24
        bound = k * u / (1 - k * u) * (x.double().abs() @ w.abs().T)
        assert ((y - exact).abs() <= bound).all(), (m, float(((y - exact).abs() / bound).max()))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_each_row_is_bitwise_independent_of_the_batch_and_threads(qtype):
    n, k = 200, 512
    packed = PackedWeight.from_codes(unpack(raw_tensor(qtype, n, k, seed=2), qtype, (n, k)))
    x = torch.randn(300, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = packed.matmul(x)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64):
            assert torch.equal(packed.matmul(x[:m]), full[:m]), m
        assert torch.equal(packed.matmul(x[7:8]), full[7:8])
        assert torch.equal(packed.matmul(x[250:]), full[250:])
        torch.set_num_threads(1)
        assert torch.equal(packed.matmul(x), full)
        assert torch.equal(packed.matmul(x[:1]), full[:1])
    finally:
        torch.set_num_threads(threads)


def test_fused_parts_of_different_types_keep_their_values():
    """A Q4_K q/k with a Q6_K v (as llama.cpp's Q4_K_M files mix them) is promoted to 8-bit codes, 16-k groups."""
    k = 512
    parts = [(Q.Q4_K, 64), (Q.Q4_1, 32), (Q.Q6_K, 32)]
    raws = [raw_tensor(qtype, n, k, seed=i) for i, (qtype, n) in enumerate(parts)]
    fused = QuantizedWeight.concat([unpack(raw, qtype, (n, k)) for raw, (qtype, n) in zip(raws, parts, strict=True)])
    assert (fused.group, fused.bits, fused.qtypes) == (16, 8, ("Q4_K", "Q4_1", "Q6_K"))
    expected = torch.cat([reference(raw, qtype, n, k) for raw, (qtype, n) in zip(raws, parts, strict=True)])
    packed = PackedWeight.from_codes(fused)
    assert torch.equal(packed.dequantize(), expected)
    x = torch.randn(3, k)
    torch.testing.assert_close(packed.matmul(x), x @ expected.T, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_run_width_and_row_split_keeps_the_chain(threads):
    """15 panels run as 8 + 4 + 2 + 1 (one thread) or 4 + 2 + 1 and 8 (two); rows 1-8 stream the weights in one
    pass (runs of up to 2 panels from 3 rows on); 9-23 rows run the tiled path in row blocks of 6 or fewer. Every
    row equals the one a 300-row call computes."""
    n, k = 8 * 15, 256
    packed = PackedWeight.from_codes(unpack(raw_tensor(Q.Q4_1, n, k, seed=3), Q.Q4_1, (n, k)))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = packed.matmul(x)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 23):
            assert torch.equal(packed.matmul(x[m:2 * m]), full[m:2 * m]), m
    finally:
        torch.set_num_threads(saved)
