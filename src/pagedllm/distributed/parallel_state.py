"""The tensor-parallel group a rank belongs to, and the two collectives the model needs, over torch.distributed
(gloo on the CPU, NCCL on CUDA; the code is the same). On the CPU, when every rank of the group runs on this host,
the float32 all-reduces go through shared memory instead (distributed/shm_communicator.py; gloo stays for the rest
and as the fallback; `PAGEDLLM_CPU_SHM_ALLREDUCE=0` keeps everything on gloo).

`TensorParallelGroup.single()` is the group of one rank: its collectives return their input untouched, so a model
built for size 1 runs exactly the operations it ran before tensor parallelism existed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_communicator import ShmAllReduce
from pagedllm.math_utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None at size 1
    shm: ShmAllReduce | None = None
    """The shared-memory all-reduce of this group (CPU, every rank on this host), else None."""
    expert_parallel: bool = False
    """A mixture of experts' experts split across this group's ranks (--enable-expert-parallel), not each expert's
    intermediate size (layers/fused_moe.py)."""

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, in place."""
        if self.size > 1:
            if self.shm is not None and self.shm.accepts(x):
                self.shm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n] side by side along the last dim -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension of n split evenly (n divisible by size)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def padded_split(self, n: int) -> tuple[int, int]:
        """This rank's [start, start + cdiv(n, size)) of a dimension padded to a multiple of size (the vocabulary)."""
        part = cdiv(n, self.size)
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's [first, end) KV heads: split when size <= num_kv_heads, else one head replicated on
        size / num_kv_heads consecutive ranks (size 4, 2 KV heads: ranks 0, 1 hold head 0; ranks 2, 3 head 1)."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads)
        first = self.rank * num_kv_heads // self.size
        return first, first + 1


def check_tensor_parallel_size(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError unless `size` ranks can split the model's heads (vLLM's rule) and MLP."""
    if num_heads % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention heads; "
                         f"use a divisor of {num_heads}.")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} neither divides the model's {num_kv_heads} KV heads nor "
                         f"is a multiple of them.")
    if intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's intermediate size "
                         f"{intermediate_size}.")


def init_tensor_parallel_group(rank: int, size: int, init_method: str, device: torch.device,
                               timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the process group of `size` ranks (all ranks call this); gloo on the CPU, NCCL on CUDA."""
    if size == 1:
        return TensorParallelGroup.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    logger.info("rank %d of %d joined the %s group", rank, size, backend)
    group = dist.group.WORLD
    shm = ShmAllReduce.create(group, rank, size) if device.type == "cpu" else None
    return TensorParallelGroup(rank, size, group, shm)


def destroy_tensor_parallel_group(tp: TensorParallelGroup) -> None:
    if tp.shm is not None:
        tp.shm.close()
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
