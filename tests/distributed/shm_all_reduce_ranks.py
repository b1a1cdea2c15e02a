"""One rank of tests/distributed/test_shm_all_reduce.py: a real process that joins a gloo group of SIZE ranks and sets
up the shared-memory all-reduce, compares it with the rank-order float32 sum, the float64 sum and gloo, and
(--peer-dies) then waits in an all-reduce for rank 1, which the test kills. Writes what it saw as JSON to
OUT/rank{R}.json (after the comparison, and again after the wait).

    python shm_all_reduce_ranks.py --rank R --size N --init-method tcp://127.0.0.1:PORT --out DIR [--peer-dies]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_communicator import SEGMENT_PREFIX, SLOT_FLOATS, ShmAllReduce

SHAPES = [(1, 576), (16, 576), (5, 7), (3, SLOT_FLOATS + 1000)]  # the last one: 4 chunks of the slot size
STRESS_ROUNDS = 200


def rank_input(case: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank `rank`'s partial tensor of case `case`: values over ~8 orders of magnitude, so the order of the sum
    shows in the last bits. Every rank can make every rank's."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(shape, generator=gen) * torch.exp(3 * torch.randn(shape, generator=gen))


def rank_order_sum(case: int, size: int, shape: tuple[int, ...]) -> torch.Tensor:
    total = rank_input(case, 0, shape)
    for r in range(1, size):
        total += rank_input(case, r, shape)  # one float32 addition per element, in rank order
    return total


def check(shm: ShmAllReduce, rank: int, size: int) -> dict:
    cases = []
    for case, shape in enumerate(SHAPES):
        x = rank_input(case, rank, shape)
        ours, theirs = x.clone(), x.clone()
        shm.all_reduce(ours)
        dist.all_reduce(theirs)
        exact = sum(rank_input(case, r, shape).double() for r in range(size))
        magnitude = sum(rank_input(case, r, shape).double().abs() for r in range(size))
        # each of the size - 1 float32 additions is off by at most 2^-24 of a partial sum <= sum |x_r|
        bound = (size - 1) * 2.0**-24 * magnitude
        cases.append({"shape": list(shape),
                      "rank_order_bitwise": torch.equal(ours, rank_order_sum(case, size, shape)),
                      "within_f64_bound": bool(((ours.double() - exact).abs() <= bound).all()),
                      "gloo_bitwise": torch.equal(ours, theirs),
                      "gloo_differing": int((ours != theirs).sum()),
                      "digest": hashlib.sha256(ours.numpy().tobytes()).hexdigest()})
    stress_ok = True  # many all-reduces in a row: the double buffer's slots are reused every other one
    for i in range(STRESS_ROUNDS):
        case, shape = len(SHAPES) + i % 7, (1 + i % 16, 576)
        x = rank_input(case, rank, shape)
        shm.all_reduce(x)
        stress_ok &= torch.equal(x, rank_order_sum(case, size, shape))
    return {"cases": cases, "stress_ok": stress_ok}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-dies", action="store_true")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.size)
    shm = ShmAllReduce.create(dist.group.WORLD, args.rank, args.size)
    maps = Path("/proc/self/maps").read_text().splitlines()
    result = {"pid": os.getpid(), "shm": shm is not None,
              "mapped": [line.split(None, 5)[-1] for line in maps if SEGMENT_PREFIX in line]}
    if shm is not None:
        result.update(check(shm, args.rank, args.size))
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(result))
    if shm is not None and args.peer_dies:
        x = torch.ones(16, 576)
        if args.rank != 0:
            (args.out / f"waiting{args.rank}").write_text(str(os.getpid()))
            time.sleep(600)  # the test kills this rank
        start = time.monotonic()
        try:
            shm.all_reduce(x)
            result["raised"] = None
        except RuntimeError as e:
            result["raised"] = str(e)
        result["wait_s"] = time.monotonic() - start
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(result))
        return 0
    if shm is not None:
        shm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
