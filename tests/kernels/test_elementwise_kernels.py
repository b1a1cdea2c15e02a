"""The native elementwise kernels (RMSNorm, fused add + RMSNorm, rotary on qkv, SiluAndMul) against float64
torch references, at odd sizes, in place, and row by row: a row's result must not depend on the batch around it
or on the thread count (DESIGN invariant 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_kernels

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def native_kernels():
    if not cpu_kernels.available(torch.float32, torch.device("cpu")):
        pytest.skip("native CPU kernels unavailable")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


def rotary_ref(qkv: torch.Tensor, cos_sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    out = qkv.double().view(qkv.shape[0], heads + 2 * kv_heads, head_dim).clone()
    cos, sin = cos_sin.double()[:, 0:1], cos_sin.double()[:, 1:2]  # [T, 1, D / 2]
    x1, x2 = out[:, : heads + kv_heads].chunk(2, dim=-1)
    out[:, : heads + kv_heads] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.view(qkv.shape).float()


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return (F.silu(gate) * up).float()


def cos_sin_rows(tokens: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    angles = torch.rand(tokens, head_dim // 2, generator=gen, dtype=torch.float64) * 1000  # [T, D / 2]
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()  # [T, 2, D / 2]


@pytest.mark.parametrize("hidden", [576, 64, 8, 37, 1003])  # SmolLM2, tiny, one vector, odd sizes (masked tails)
@pytest.mark.parametrize("tokens", [1, 3, 200])
def test_rms_norm(hidden, tokens):
    gen = torch.Generator().manual_seed(hidden * 7 + tokens)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    x_before = x.clone()
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5), rtol=RTOL, atol=ATOL)
    assert torch.equal(x, x_before)  # not in place


@pytest.mark.parametrize("hidden", [576, 64, 37, 1003])
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_fused_add_rms_norm_in_place(hidden, tokens):
    gen = torch.Generator().manual_seed(hidden * 11 + tokens)
    x, residual = torch.randn(2, tokens, hidden, generator=gen).unbind(0)
    x, residual = x.contiguous(), residual.contiguous()
    weight = torch.randn(hidden, generator=gen)
    total = x.double() + residual.double()
    expected_x = rms_norm_ref(total, weight, 1e-6)
    expected_residual = (x + residual).clone()  # fp32 add, exactly as the kernel rounds it
    cpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x, expected_x, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2
    (4, 2, 16),  # the tiny test model
    (8, 2, 48),  # half 24: three vectors
    (6, 3, 20),  # half 10: one vector and a masked tail
    (2, 1, 6),  # half 3: only a masked tail
])
@pytest.mark.parametrize("tokens", [1, 4, 130])
def test_rotary_qkv_in_place(heads, kv_heads, head_dim, tokens):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos_sin = cos_sin_rows(tokens, head_dim, gen)
    expected = rotary_ref(qkv, cos_sin, heads, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cpu_kernels.rotary_qkv(qkv, cos_sin, heads, kv_heads, head_dim)
    torch.testing.assert_close(qkv, expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_rotary_qkv_matches_the_torch_layer_path():
    from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(64, 4096, 100000.0)
    rope.materialize(torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 4095, 17, 300])
    cos_sin = rope(positions, torch.float32)
    qkv = torch.randn(6, 15 * 64, generator=torch.Generator().manual_seed(3))
    q = apply_rotary(qkv[:, : 9 * 64].view(6, 9, 64), cos_sin[:, 0:1], cos_sin[:, 1:2])
    k = apply_rotary(qkv[:, 9 * 64 : 12 * 64].view(6, 3, 64), cos_sin[:, 0:1], cos_sin[:, 1:2])
    cpu_kernels.rotary_qkv(qkv, cos_sin, 9, 3, 64)
    torch.testing.assert_close(qkv[:, : 9 * 64].view(6, 9, 64), q, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(qkv[:, 9 * 64 : 12 * 64].view(6, 3, 64), k, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("size", [1536, 128, 8, 13, 1001])
@pytest.mark.parametrize("tokens", [1, 3, 100])
def test_silu_and_mul(size, tokens):
    gen = torch.Generator().manual_seed(size + tokens)
    x = torch.randn(tokens, 2 * size, generator=gen) * 4
    out = cpu_kernels.silu_and_mul(x)
    assert out.shape == (tokens, size)
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=RTOL, atol=ATOL)


def test_silu_and_mul_extremes():
    gate = torch.tensor([-200.0, -100.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 88.0, 100.0, 1e30, -1e30])
    x = torch.cat([gate, torch.full_like(gate, 2.0)])[None]  # [1, 2 * 12]
    out = cpu_kernels.silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=RTOL, atol=ATOL)


def _all_kernels(x, residual, weight, qkv, cos_sin, gate_up):
    """Every kernel on copies of the inputs; rows [T, ...] of each output."""
    x, residual, qkv = x.clone(), residual.clone(), qkv.clone()
    normed = cpu_kernels.rms_norm(x, weight, 1e-5)
    cpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    cpu_kernels.rotary_qkv(qkv, cos_sin, 6, 3, 20)
    return normed, x, residual, qkv, cpu_kernels.silu_and_mul(gate_up)


@pytest.mark.parametrize("hidden,size", [(576, 1536), (37, 13)])
def test_rows_do_not_depend_on_batch_or_threads(two_threads, hidden, size):
    gen = torch.Generator().manual_seed(hidden)
    tokens = 600  # big enough for two threads in every kernel (PARALLEL_MIN_FLOATS)
    x, residual = torch.randn(2, tokens, hidden, generator=gen).unbind(0)
    weight = torch.randn(hidden, generator=gen)
    qkv = torch.randn(tokens, 12 * 20, generator=gen)
    cos_sin = cos_sin_rows(tokens, 20, gen)
    gate_up = torch.randn(tokens, 2 * size, generator=gen)
    inputs = (x.contiguous(), residual.contiguous(), weight, qkv, cos_sin, gate_up)
    batched = _all_kernels(*inputs)
    torch.set_num_threads(1)
    single_thread = _all_kernels(*inputs)
    for row in (0, 1, 157, tokens - 1):  # alone, in a fresh (differently aligned) tensor
        alone = _all_kernels(*(t if t is weight else t[row : row + 1].clone() for t in inputs))
        for got, want in zip(alone, batched, strict=True):
            assert torch.equal(got[0], want[row])
    for got, want in zip(single_thread, batched, strict=True):
        assert torch.equal(got, want)
