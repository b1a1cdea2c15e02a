"""The all-reduce over shared memory for a tensor-parallel group whose ranks all run on this host (as vLLM's CPU
communicator does): one segment in /dev/shm that every rank maps, summed by kernels/shm_all_reduce_cpu.c.
torch.distributed (gloo) stays the fallback: for ranks on other hosts, other dtypes, or when this is turned off.

Setting up (every rank of the group at once, over the group's gloo collectives):
  1. every rank says whether it can take part (native kernels built, /dev/shm present, not turned off);
  2. rank 0 creates the segment under a random name and broadcasts the name; the others map it;
  3. every rank writes its pid into the segment and all-gathers it over gloo: a rank that sees every peer's pid
     in the segment shares its memory (the same host), and one that can signal them shares its process space
     (the kernel checks that a waited-for peer still exists);
  4. only if every rank agrees is the segment used; rank 0 unlinks its name right after step 3 either way.
The name is gone from /dev/shm while the group runs: the memory lives as long as some rank maps it, so nothing
is left behind whether the ranks shut down, crash or are killed.

Results are bitwise independent of the communicator at 2 ranks: every rank sums in rank order (0 + 1 + ...), and
gloo's sum of two is the same single addition. At 3 ranks or more gloo sums each part of the tensor in another
order, so the two differ in the last bits (tests/distributed/test_shm_all_reduce.py measures it).

`PAGEDLLM_CPU_SHM_ALLREDUCE=0` turns it off (every all-reduce then goes through gloo), as an A/B switch.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.kernels import shm_all_reduce

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGEDLLM_CPU_SHM_ALLREDUCE"
"""Set to 0 to keep every all-reduce on torch.distributed."""
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pagedllm-allreduce-"
"""Segment names: the prefix, the pid of rank 0's parent (the engine process, which sweeps what a rank killed
while setting up could leave), and a random part."""
SLOT_FLOATS = 1 << 18
"""Floats per slot (1 MiB): an all-reduce of more (a long prefill chunk) runs in several chunks."""
_NAME_BYTES = 128


class ShmAllReduce:
    """The mapped segment of one group, for all_reduce; made by `create` on every rank of the group."""

    def __init__(self, segment: mmap.mmap, rank: int, size: int):
        self.rank, self.size = rank, size
        self._segment = segment
        self._view = ctypes.c_char.from_buffer(segment)  # pins the mapping while the address is in use
        self.base = ctypes.addressof(self._view)

    @classmethod
    def create(cls, group: dist.ProcessGroup, rank: int, size: int) -> ShmAllReduce | None:
        """Set up the segment for `group` (every rank calls this at once); None when any rank cannot use it
        (then every rank gets None and stays on torch.distributed)."""
        reason = _unavailable()
        if not _all_ranks(group, reason is None):
            if rank == 0:
                logger.info("tensor-parallel all-reduce over gloo: %s", reason or "a peer cannot use shared memory")
            return None
        nbytes = shm_all_reduce.segment_bytes(size, SLOT_FLOATS)
        segment, path = None, None
        try:
            name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
            if rank == 0:
                path = SHM_DIR / f"{SEGMENT_PREFIX}{os.getppid()}-{secrets.token_hex(8)}"
                segment = _map(path, nbytes, create=True)
                if segment is not None:
                    name[: len(path.name)] = torch.tensor(list(path.name.encode()), dtype=torch.uint8)
            dist.broadcast(name, dist.get_global_rank(group, 0), group=group)
            if rank != 0 and name[0] != 0:
                segment = _map(SHM_DIR / bytes(name.tolist()).rstrip(b"\0").decode(), nbytes, create=False)
            shared = _same_memory(group, segment, rank, size)
        finally:
            if path is not None:  # every rank has mapped it (or given up): the name is no longer needed
                path.unlink(missing_ok=True)
        if not _all_ranks(group, shared):
            if segment is not None:
                segment.close()
            if rank == 0:
                logger.info("tensor-parallel all-reduce over gloo: the ranks do not share memory")
            return None
        if rank == 0:
            logger.info("tensor-parallel all-reduce over shared memory (%d ranks on this host, %.1f MiB segment)",
                        size, nbytes / 2**20)
        return cls(segment, rank, size)

    @staticmethod
    def accepts(x: torch.Tensor) -> bool:
        """Whether `x` goes through shared memory (float32, contiguous, on the CPU); others use gloo. Every rank
        decides the same way for the same collective: the model hands every rank the same kind of tensor."""
        return x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> None:
        """x = the sum over the ranks of x, in place, summed in rank order (the same bits on every rank)."""
        if self._segment is None:
            raise RuntimeError("the shared-memory all-reduce was used after close()")
        shm_all_reduce.all_reduce(self.base, self.rank, self.size, SLOT_FLOATS, x)

    def close(self) -> None:
        if self._segment is not None:
            del self._view
            self._segment.close()
            self._segment = None


def _unavailable() -> str | None:
    """Why this rank cannot use the shared-memory all-reduce, or None."""
    if not envs.PAGEDLLM_CPU_SHM_ALLREDUCE:
        return f"{ENV_SWITCH}=0"
    if not SHM_DIR.is_dir():
        return f"no {SHM_DIR}"
    if not shm_all_reduce.available():
        return "the native kernels are not available"
    return None


def _all_ranks(group: dist.ProcessGroup, ok: bool) -> bool:
    """Whether `ok` holds on every rank of the group (a collective: every rank calls it)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _map(path: Path, nbytes: int, create: bool) -> mmap.mmap | None:
    """The segment at `path` mapped read-write (created at nbytes, zero-filled, when `create`); None on failure."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except OSError as e:
        logger.warning("cannot %s %s: %s", "create" if create else "open", path, e)
        return None
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            logger.warning("%s has %d bytes, not %d", path, os.fstat(fd).st_size, nbytes)
            return None
        return mmap.mmap(fd, nbytes)
    except OSError as e:
        logger.warning("cannot map %s: %s", path, e)
        return None
    finally:
        os.close(fd)


def _same_memory(group: dist.ProcessGroup, segment: mmap.mmap | None, rank: int, size: int) -> bool:
    """Write this rank's pid into the segment (when it mapped one), all-gather the pids over gloo (also the
    barrier after which rank 0 unlinks the name: every rank has mapped the segment or given up), and check that
    the segment shows every peer's pid and that every peer's process is visible from here. A collective: every
    rank calls it, with or without a segment."""
    view = ctypes.c_char.from_buffer(segment) if segment is not None else None
    try:
        if view is not None:
            shm_all_reduce.join(ctypes.addressof(view), rank, os.getpid())
        pids = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64), group=group)
        expected = [int(p) for p in pids]
        if view is None:
            return False
        seen = [shm_all_reduce.pid_of(ctypes.addressof(view), r) for r in range(size)]
        return seen == expected and all(map(_visible, expected))
    finally:
        del view


def _visible(pid: int) -> bool:
    """Whether signals reach `pid` (the kernel's liveness check of a waited-for peer needs it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    return True


def remove_leftover_segments(parent_pid: int) -> None:
    """Unlink the segment names of the groups whose rank 0 is a child of `parent_pid`. A segment's name only
    exists while its group sets up; this removes the one a rank killed in that moment would leave."""
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}{parent_pid}-*"):
        path.unlink(missing_ok=True)


def maps_segment(pid: int) -> bool:
    """Whether process `pid` has an all-reduce segment of this module mapped (Linux; its name already unlinked):
    how tests and benchmarks tell which communicator a worker process runs."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return False
    return any(f"{SHM_DIR}/{SEGMENT_PREFIX}" in line and line.endswith("(deleted)") for line in lines)
