"""The KV pool's memory: zeroed on first use, and faulted in ahead of time by the background prefault."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from pagedllm.worker.cpu_allocator import PoolPrefault, zeroed_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory APIs")


def resident_fraction(array: np.ndarray) -> float:
    """Share of the array's pages that are in memory (mincore)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-array.nbytes // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(array.ctypes.data, array.nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def test_pool_is_zeroed_and_not_resident_until_used():
    pool = zeroed_pool(32 << 20)
    assert resident_fraction(pool) < 0.1
    assert not pool[:: mmap.PAGESIZE].any()


def test_prefault_makes_every_region_resident_without_changing_it():
    pools = [zeroed_pool((8 << 20) + 12288 * i) for i in range(3)]  # sizes not multiples of the chunk
    tensors = [torch.from_numpy(p).view(torch.float32) for p in pools]
    tensors[1][5] = 7.0  # already written: must keep its value
    halves = [half for t in tensors for half in t.view(2, -1)]  # the K/V halves, as the runner passes them
    prefault = PoolPrefault(halves, chunk_bytes=1 << 20)
    assert prefault.wait(timeout=60)
    for pool in pools:
        assert resident_fraction(pool) == 1.0
    assert tensors[1][5] == 7.0 and torch.count_nonzero(tensors[1]) == 1
    assert not tensors[0].any() and not tensors[2].any()


def test_prefault_stops_when_asked():
    pool = zeroed_pool(256 << 20)
    prefault = PoolPrefault([torch.from_numpy(pool)], chunk_bytes=1 << 20)
    prefault.stop()
    assert prefault.wait(timeout=30)
    assert resident_fraction(pool) < 1.0


def test_prefault_waits_while_the_engine_is_busy():
    pool = zeroed_pool(16 << 20)
    # It starts idle_s after construction at the earliest, so busy() below begins before any chunk.
    prefault = PoolPrefault([torch.from_numpy(pool)], chunk_bytes=1 << 20, idle_s=0.5)
    with prefault.busy():
        assert not prefault.wait(timeout=1.0)
        assert resident_fraction(pool) == 0.0
    assert prefault.wait(timeout=30)
    assert resident_fraction(pool) == 1.0
