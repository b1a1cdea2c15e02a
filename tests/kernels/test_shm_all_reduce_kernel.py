"""kernels/shm_all_reduce_cpu.c's protocol without processes: 2 and 3 "ranks" as threads of this process over one
buffer (ctypes releases the GIL, so they really run at once), thousands of all-reduces in a row of changing sizes,
some larger than a slot (several chunks). Every rank must get the rank-order float32 sum bit for bit every time:
a slot reused too early or a missed wake-up shows as a wrong sum or a hang. tests/distributed/ runs real
processes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from pagedllm.kernels import shm_all_reduce

SLOT_FLOATS = 1024  # small slots: many tensors take several chunks


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not shm_all_reduce.available():
        pytest.skip("the native kernels are not built here")


def _inputs(round_: int, rank: int) -> torch.Tensor:
    n = 1 + (round_ * 7919) % (3 * SLOT_FLOATS)  # the same size on every rank, 1 to 3 slots
    gen = torch.Generator().manual_seed(round_ * 8 + rank)
    return torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))


@pytest.mark.parametrize("ranks", [2, 3])
def test_threads_as_ranks_get_the_rank_order_sum_every_time(ranks):
    segment = np.zeros(shm_all_reduce.segment_bytes(ranks, SLOT_FLOATS), dtype=np.uint8)
    base = segment.ctypes.data
    for r in range(ranks):
        shm_all_reduce.join(base, r, os.getpid())
    assert [shm_all_reduce.pid_of(base, r) for r in range(ranks)] == [os.getpid()] * ranks
    rounds = 1500
    wrong: list[tuple[int, int]] = []

    def rank_loop(rank: int) -> None:
        for i in range(rounds):
            x = _inputs(i, rank)
            shm_all_reduce.all_reduce(base, rank, ranks, SLOT_FLOATS, x)
            expected = _inputs(i, 0)
            for r in range(1, ranks):
                expected += _inputs(i, r)
            if not torch.equal(x, expected):
                wrong.append((rank, i))

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "an all-reduce hung"
    assert wrong == []


def test_argument_checks():
    segment = np.zeros(shm_all_reduce.segment_bytes(2, SLOT_FLOATS), dtype=np.uint8)
    with pytest.raises(ValueError):
        shm_all_reduce.all_reduce(segment.ctypes.data, 0, 2, SLOT_FLOATS, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        shm_all_reduce.all_reduce(segment.ctypes.data, 0, 2, SLOT_FLOATS, torch.zeros(4, 2).t())
    with pytest.raises(ValueError):
        shm_all_reduce.all_reduce(segment.ctypes.data, 2, 2, SLOT_FLOATS, torch.zeros(4))
