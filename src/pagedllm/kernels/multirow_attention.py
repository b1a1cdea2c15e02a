"""The native multi-row paged attention (paged_attention_cpu.c's paged_multirow_attention): the rows of a request
that attend to one block table (verify rows of speculative decoding, a prefill chunk's rows) run together, each
row bitwise the decode kernel's for its own context length. Its ctypes signature is declared with the others in
cpu_kernels.py."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels


def check_multirow_args(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                        row_start: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """The layouts paged_multirow_attention assumes of the cache and the step's metadata (step_plan checks them
    once per step; row_start[-1] is a tensor read)."""
    cpu_kernels.check_cache(key_cache, value_cache)
    cpu_kernels.require(
        block_table.dtype == torch.int32 and block_table.stride(1) == 1 and row_start.dtype == torch.int64
        and row_start.is_contiguous() and len(row_start) == len(block_table) + 1
        and int(row_start[-1]) == len(seq_lens) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
        "block_table [G, nb] int32, row_start [G + 1] int64 ending at S, seq_lens [S] int32")


def paged_multirow_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_table: torch.Tensor, row_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0, args_checked: bool = False,
                             window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of groups of rows that share a block table (verify rows, prefill chunks), each row exactly
    paged_decode_attention's for its own context length, bit for bit, K/V read once per tile of rows
    (paged_attention_cpu.c). The rows' K/V must already be in the cache.

    Args:
        q: [S, H, D] float32, each row contiguous (the row stride may exceed H * D).
        key_cache, value_cache: as paged_decode_attention's.
        block_table: [G, max_blocks] int32, contiguous rows: group g's table.
        row_start: [G + 1] int64, contiguous: group g's rows are row_start[g] .. row_start[g + 1] - 1; row_start[G] = S.
        seq_lens: [S] int32, contiguous: each row's context length (>= 1), its own token included.
        args_checked: the caller ran check_multirow_args on these (once per step, not once per layer).
        window, softcap: as paged_decode_attention's (a windowed layer's rows run one by one: each is then the
            decode kernel's row itself, not a tile's).
    Returns:
        out: [S, H, D] float32.
    """
    s, h, d = q.shape
    cpu_kernels.require(q.dtype == torch.float32 and q.stride()[1:] == (d, 1) and len(seq_lens) == s,
                        "q [S, H, D] float32 with contiguous rows, one per seq_lens entry")
    if not args_checked:
        check_multirow_args(key_cache, value_cache, block_table, row_start, seq_lens)
    block_size, hkv, _ = key_cache.shape[1:]
    out = q.new_empty(s, h, d)
    rc = cpu_kernels._library().paged_multirow_attention(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
        block_table.stride(0), row_start.data_ptr(), len(block_table), seq_lens.data_ptr(), out.data_ptr(), h, hkv, d,
        block_size, scale, cpu_kernels.KV_FORMATS[key_cache.dtype], k_scale, v_scale, window, softcap)
    if rc != 0:
        raise MemoryError("paged multi-row attention could not allocate its scratch buffer")
    return out
