"""The KV cache's storage formats: the native conversions against torch's float8 / bfloat16 dtypes, the cache
write, and decode attention over a bf16 / fp8 pool against a float64 reference on the dequantized cache."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import reference

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.kv_cache_dtype import resolve_kv_cache_dtype, to_cache_dtype

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_DTYPES = [torch.bfloat16, *FP8]


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_every_code_decodes_as_torch_does(dtype, vector):
    codes = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32)  # all 256 (fp8) or 65536 (bf16) codes
    codes = codes.to(torch.uint8) if dtype.itemsize == 1 else codes.to(torch.int16)
    assert _same_floats(cpu_kernels.kv_decode(codes.view(dtype), vector), codes.view(dtype).float())


def _encode_cases(dtype: torch.dtype) -> torch.Tensor:
    """Random values over the whole float32 range, every representable value, and every midpoint between two
    neighbours (the ties that round to even), with both signs."""
    gen = torch.Generator().manual_seed(0)
    scales = 2.0 ** torch.randint(-140, 128, (50_000,), generator=gen).double()
    randoms = (torch.randn(50_000, generator=gen, dtype=torch.float64) * scales).float()
    if dtype.itemsize == 1:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    else:
        values = torch.arange(0, 1 << 15, 7, dtype=torch.int32).to(torch.int16).view(dtype).float()
    values = values[values.isfinite()].unique()  # sorted
    midpoints = ((values[1:].double() + values[:-1].double()) / 2).float()
    x = torch.cat([randoms, values, midpoints, -midpoints])
    return x[x.isfinite()]


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_encode_rounds_to_nearest_even_and_saturates(dtype):
    x = _encode_cases(dtype)
    limit = torch.finfo(dtype).max
    # torch's conversion rounds to nearest even; clamped first, the overflows are the saturated largest value
    expected = x.clamp(-limit, limit).to(dtype)
    got = cpu_kernels.kv_encode(x, dtype)
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    assert torch.equal(got.view(bits), expected.view(bits))
    assert torch.equal(to_cache_dtype(x, dtype).view(bits), expected.view(bits))  # the torch path agrees


@pytest.mark.parametrize("dtype,ties,largest", [
    (torch.float8_e4m3fn, {1.0625: 1.0, 1.1875: 1.25, 0.0009765625: 0.0, 0.0029296875: 0.00390625}, 448.0),
    (torch.float8_e5m2, {1.125: 1.0, 1.375: 1.5, 2.0**-17: 0.0, 3 * 2.0**-17: 2.0**-15}, 57344.0),
    (torch.bfloat16, {1 + 2.0**-8: 1.0, 1 + 3 * 2.0**-8: 1 + 2.0**-6}, torch.finfo(torch.bfloat16).max),
])
def test_encode_edge_cases(dtype, ties, largest):
    x = torch.tensor([*ties, 3.4e38, float("inf"), -float("inf"), float("nan"), -float("nan")])
    out = cpu_kernels.kv_encode(x, dtype).float()
    assert out[: len(ties)].tolist() == list(ties.values())  # ties go to the even neighbour, subnormals included
    assert out[len(ties):-2].tolist() == [largest, largest, -largest]  # saturating, infinities too
    assert out[-2:].isnan().all()
    if dtype.itemsize == 1:  # NaN is the format's NaN code, its sign kept
        assert cpu_kernels.kv_encode(x[-2:], dtype).view(torch.uint8).tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("dtype", [torch.float32, *KV_DTYPES])
def test_write_encodes_strided_rows_into_their_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 15, 64, generator=gen) * 3  # [T, H + 2 Hkv, D] as the fused projection lays it out
    k, v = qkv[:, 9:12], qkv[:, 12:15]  # [T, Hkv, D] strided views
    cache = torch.zeros(2, 4, 16, 3, 64, dtype=dtype)
    slots = torch.tensor([3, 17, 18, 63, 0])
    cpu_kernels.write_kv_cache(k, v, cache[0], cache[1], slots)
    flat = cache.view(2, 64, 3, 64)
    assert torch.equal(flat[0, slots].float(), k.to(dtype).float()) or dtype != torch.float32
    assert torch.equal(flat[0, slots].float(), to_cache_dtype(k, dtype).float())
    assert torch.equal(flat[1, slots].float(), to_cache_dtype(v, dtype).float())
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].float().any()


def _pool(dtype, num_blocks, block_size, kv_heads, head_dim, gen):
    # values spread over the fp8 range, so rounding and subnormals are exercised
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2.0
    return to_cache_dtype(kv, dtype)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2
    (8, 2, 48, 16),  # head_dim a multiple of 16, not 64
    (6, 3, 20, 4),  # head_dim not a multiple of 8: the scalar loops
])
def test_decode_attention_over_a_quantized_pool(dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, seqs = 100, 5
    cache = _pool(dtype, num_blocks, block_size, kv_heads, head_dim, gen)
    seq_lens = torch.tensor([1, block_size + 1, 70, 37, 5 * block_size], dtype=torch.int32)
    width = int(-(-seq_lens.max() // block_size)) + 1
    block_table = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width).to(torch.int32)
    q = torch.randn(seqs, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, cache[0], cache[1], block_table, seq_lens, scale)
    expected = reference(q, cache[0].float(), cache[1].float(), block_table, seq_lens, scale)  # float64 inside
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_decode_attention_over_a_quantized_pool_is_that_over_its_fp32_values(dtype):
    """Converting each row once per KV head, KV_CHUNK (64) tokens at a time, changes no sum: the bits of the fp32
    kernel over the dequantized pool (contexts shorter than, equal to and spanning several chunks; scales folded)."""
    gen = torch.Generator().manual_seed(6)
    cache = _pool(dtype, 140, 16, 3, 64, gen)
    seq_lens = torch.tensor([1, 3, 64, 70, 130, 257, 300], dtype=torch.int32)
    block_table = torch.randperm(140, generator=gen)[:7 * 19].view(7, 19).to(torch.int32)
    q = torch.randn(7, 9, 64, generator=gen)
    for k_scale, v_scale in ((1.0, 1.0), (2.0**-5, 2.0**3)):
        out = cpu_kernels.paged_decode_attention(q, cache[0], cache[1], block_table, seq_lens, 0.125, k_scale, v_scale)
        fp32 = [(half.float() * s).contiguous() for half, s in ((cache[0], k_scale), (cache[1], v_scale))]
        assert torch.equal(out, cpu_kernels.paged_decode_attention(q, *fp32, block_table, seq_lens, 0.125))


def _fused_case(dtype, seq_lens: list[int], seed: int):
    """A pool of 40 blocks of 16 (3 KV heads, D 64) and, per sequence, its block table row, the slot of its own
    token (the last position of its context), its fused qkv row (9 query heads) and its rotary cos / sin."""
    gen = torch.Generator().manual_seed(seed)
    cache = _pool(dtype, 40, 16, 3, 64, gen)
    s = len(seq_lens)
    width = 40 // s
    block_table = torch.randperm(40, generator=gen)[:s * width].view(s, width).to(torch.int32)
    slots = torch.stack([block_table[i, (n - 1) // 16].long() * 16 + (n - 1) % 16 for i, n in enumerate(seq_lens)])
    qkv = torch.randn(s, 15 * 64, generator=gen)  # [S, (H + 2 Hkv) * D]
    angles = torch.rand(s, 32, generator=gen) * 6
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1)  # [S, 2, D / 2]
    return cache, torch.tensor(seq_lens, dtype=torch.int32), block_table, slots, qkv, cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, *KV_DTYPES])
def test_fused_rotary_write_attend_matches_the_separate_kernels(dtype):
    """One call per layer (rotary on the fused qkv, K/V write, attention) gives the bits of the three calls."""
    cache, seq_lens, block_table, slots, qkv, cos_sin = _fused_case(dtype, [1, 17, 50, 64], seed=2)
    separate, qkv_separate = cache.clone(), qkv.clone()
    cpu_kernels.rotary_qkv(qkv_separate, cos_sin, 9, 3, 64)
    rows = qkv_separate.view(4, 15, 64)
    cpu_kernels.write_kv_cache(rows[:, 9:12], rows[:, 12:], separate[0], separate[1], slots)
    expected = cpu_kernels.paged_decode_attention(rows[:, :9], separate[0], separate[1], block_table, seq_lens, 0.125)
    fused, qkv_fused = cache.clone(), qkv.clone()
    out = cpu_kernels.fused_decode_attention(qkv_fused, cos_sin, slots, fused, block_table, seq_lens, 0.125, 9)
    assert torch.equal(qkv_fused, qkv_separate)  # rotated in place, as rotary_qkv does
    assert torch.equal(fused.float(), separate.float())
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, *KV_DTYPES])
def test_a_sequence_alone_gets_its_bits_in_a_batch(dtype):
    """Fewer sequences than threads (batch 1 on 2 threads) split each sequence's KV heads among tasks: every head's
    rotation, K/V write and attention keep the bits the whole-sequence task gives them in a batch."""
    cache, seq_lens, block_table, slots, qkv, cos_sin = _fused_case(dtype, [70, 1, 17, 129], seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch, qkv_batch = cache.clone(), qkv.clone()
        out = cpu_kernels.fused_decode_attention(qkv_batch, cos_sin, slots, batch, block_table, seq_lens, 0.125, 9)
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for s in range(4):
                alone, qkv_alone = cache.clone(), qkv[s:s + 1].clone()
                got = cpu_kernels.fused_decode_attention(qkv_alone, cos_sin[s:s + 1], slots[s:s + 1], alone,
                                                         block_table[s:s + 1], seq_lens[s:s + 1], 0.125, 9)
                assert torch.equal(got[0], out[s]), f"sequence {s}, {n} threads"
                assert torch.equal(qkv_alone[0], qkv_batch[s])
                slot = int(slots[s])
                assert torch.equal(alone.flatten(1, 2)[:, slot].float(), batch.flatten(1, 2)[:, slot].float())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", FP8)
def test_quantized_result_does_not_depend_on_threads_or_batch(dtype):
    gen = torch.Generator().manual_seed(3)
    cache = _pool(dtype, 64, 16, 3, 64, gen)
    block_table = torch.randperm(64, generator=gen)[:48].view(8, 6).to(torch.int32)
    seq_lens = torch.randint(1, 96, (8,), generator=gen, dtype=torch.int32)
    q = torch.randn(8, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(cpu_kernels.paged_decode_attention(q, cache[0], cache[1], block_table, seq_lens, 0.125))
    torch.set_num_threads(threads)
    alone = cpu_kernels.paged_decode_attention(q[3:4], cache[0], cache[1], block_table[3:4], seq_lens[3:4], 0.125)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][3:4], alone)


def test_resolve_names_and_refuse_unknown_ones():
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.float32, cpu) == torch.float8_e4m3fn  # vLLM: fp8 = fp8_e4m3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32, cpu) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8_inc"):
        resolve_kv_cache_dtype("fp8_inc", torch.float32, cpu)


def test_a_device_that_cannot_convert_fails_with_the_reason(monkeypatch):
    """As CUDA builds without float8 kernels would: start-up stops with torch's reason, no fallback dtype."""
    from pagedllm.layers import kv_cache_dtype

    def no_fp8(x, dtype):
        raise RuntimeError(f'"copy_" not implemented for {dtype}')

    monkeypatch.setattr(kv_cache_dtype, "to_cache_dtype", no_fp8)
    with pytest.raises(ValueError, match="cannot store or read a torch.float8_e5m2 KV cache.*not implemented"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("dtype", FP8)
def test_scaled_write_stores_x_over_scale_as_the_torch_path_does(dtype):
    """vLLM's k_scale / v_scale: the write stores x / scale (powers of two: exact), native and torch alike, and
    values far below 1 that scale 1 would flush into subnormals keep their 3 (e5m2: 2) mantissa bits."""
    gen = torch.Generator().manual_seed(4)
    tiny = 2.0**-10 if dtype == torch.float8_e4m3fn else 2.0**-20  # subnormals start at 2^-6 (e4m3), 2^-14 (e5m2)
    kv = torch.randn(2, 6, 2, 32, generator=gen) * tiny  # [K/V, T, Hkv, D]
    cache = torch.zeros(2, 2, 4, 2, 32, dtype=dtype)
    slots = torch.tensor([0, 2, 3, 4, 6, 7])
    k_scale, v_scale = tiny / 2, tiny * 2
    cpu_kernels.write_kv_cache(kv[0], kv[1], cache[0], cache[1], slots, k_scale, v_scale)
    flat = cache.view(2, 8, 2, 32)
    bits = torch.uint8
    assert torch.equal(flat[0, slots].view(bits), to_cache_dtype(kv[0], dtype, k_scale).view(bits))
    assert torch.equal(flat[1, slots].view(bits), to_cache_dtype(kv[1], dtype, v_scale).view(bits))
    k_back = flat[0, slots].float() * k_scale
    relative = ((k_back - kv[0]).norm() / kv[0].norm()).item()
    unscaled = ((to_cache_dtype(kv[0], dtype).float() - kv[0]).norm() / kv[0].norm()).item()
    assert relative < (0.04 if dtype == torch.float8_e4m3fn else 0.08) < unscaled


@pytest.mark.parametrize("dtype", FP8)
def test_decode_attention_folds_the_scales(dtype):
    """k_scale folded into the softmax scale and v_scale into the output: the result of attending over the
    dequantized values (codes * scale), against the float64 reference; fused and separate kernels agree."""
    gen = torch.Generator().manual_seed(5)
    cache = _pool(dtype, 40, 16, 3, 64, gen)
    k_scale, v_scale = 2.0**-5, 2.0**3
    seq_lens = torch.tensor([1, 17, 50, 64], dtype=torch.int32)
    block_table = torch.randperm(40, generator=gen)[:16].view(4, 4).to(torch.int32)
    q = torch.randn(4, 9, 64, generator=gen) * 8
    out = cpu_kernels.paged_decode_attention(q, cache[0], cache[1], block_table, seq_lens, 0.125, k_scale, v_scale)
    expected = reference(q, cache[0].float() * k_scale, cache[1].float() * v_scale, block_table, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    slots = torch.stack([block_table[s, (n - 1) // 16].long() * 16 + (n - 1) % 16
                         for s, n in enumerate(seq_lens.tolist())])
    qkv = torch.randn(4, 15 * 64, generator=gen)
    angles = torch.rand(4, 32, generator=gen) * 6
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=1)
    separate, qkv_separate = cache.clone(), qkv.clone()
    cpu_kernels.rotary_qkv(qkv_separate, cos_sin, 9, 3, 64)
    rows = qkv_separate.view(4, 15, 64)
    cpu_kernels.write_kv_cache(rows[:, 9:12], rows[:, 12:], separate[0], separate[1], slots, k_scale, v_scale)
    expected = cpu_kernels.paged_decode_attention(rows[:, :9], separate[0], separate[1], block_table, seq_lens, 0.125,
                                                  k_scale, v_scale)
    fused = cache.clone()
    out = cpu_kernels.fused_decode_attention(qkv.clone(), cos_sin, slots, fused, block_table, seq_lens, 0.125, 9,
                                             k_scale, v_scale)
    assert torch.equal(fused.float(), separate.float())
    assert torch.equal(out, expected)


def test_power_of_two_scale():
    from pagedllm.layers.kv_cache_dtype import power_of_two_scale

    assert power_of_two_scale(20.0, 200.0) == 0.125  # 20 / 0.125 = 160 <= 200 < 320
    assert power_of_two_scale(200.0, 200.0) == 1.0
    assert power_of_two_scale(201.0, 200.0) == 2.0
    assert power_of_two_scale(0.0, 200.0) == power_of_two_scale(float("nan"), 200.0) == 1.0


@pytest.mark.parametrize("dtype", FP8)
def test_error_feedback_write_matches_the_torch_path_and_cancels_errors_where_queries_look(dtype):
    """K rows rounded with error feedback (GPTQ's carry weights from the queries' second moment H): the native write
    (separate and fused) stores the torch path's codes bit for bit, and e^T H e, the mean squared score error, is
    well below plain rounding's."""
    from pagedllm.layers.kv_cache_dtype import to_cache_dtype_compensated
    from pagedllm.worker.kv_scales import error_feedback_weights

    gen = torch.Generator().manual_seed(6)
    hkv, d = 3, 64
    direction = torch.randn(hkv, 1, d, generator=gen, dtype=torch.float64)
    queries = torch.randn(hkv, 500, d, generator=gen, dtype=torch.float64) + 4 * direction  # one dominant direction
    h = queries.transpose(1, 2) @ queries / 500  # [Hkv, D, D]
    w = error_feedback_weights(h)
    k = torch.randn(40, hkv, d, generator=gen) * 3 + 2
    k_scale = 2.0**-4
    expected = to_cache_dtype_compensated(k, dtype, k_scale, w)
    cache = torch.zeros(2, 4, 16, hkv, d, dtype=dtype)
    slots = torch.arange(40) + 5
    cpu_kernels.write_kv_cache(k, k, cache[0], cache[1], slots, k_scale, 1.0, w)
    flat = cache.view(2, 64, hkv, d)
    assert torch.equal(flat[0, slots].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), to_cache_dtype(k, dtype).view(torch.uint8))  # V: plain

    def score_error(codes):  # mean over rows of e^T H e, per head
        e = (codes.double() * k_scale - k.double()).transpose(0, 1)  # [Hkv, T, D]
        return torch.einsum("htd,hde,hte->", e, h, e).item() / 40

    plain = to_cache_dtype(k, dtype, k_scale).float()
    assert score_error(expected.float()) < 0.5 * score_error(plain)
    # the fused write of one token per sequence stores the same codes
    qkv = torch.randn(4, (6 + 2 * hkv) * d, generator=gen)
    rows = qkv.view(4, 6 + 2 * hkv, d)
    cos_sin = torch.stack([torch.ones(4, d // 2), torch.zeros(4, d // 2)], dim=1)  # rotary by angle 0
    fused = torch.zeros(2, 4, 16, hkv, d, dtype=dtype)
    block_table = torch.arange(4, dtype=torch.int32).view(4, 1)
    seq_lens = torch.ones(4, dtype=torch.int32)
    slots = torch.arange(4) * 16
    cpu_kernels.fused_decode_attention(qkv.clone(), cos_sin, slots, fused, block_table, seq_lens, 0.125, 6, k_scale,
                                       1.0, w)
    assert torch.equal(fused[0, :, 0].view(torch.uint8),
                       to_cache_dtype_compensated(rows[:, 6:6 + hkv], dtype, k_scale, w).view(torch.uint8))
