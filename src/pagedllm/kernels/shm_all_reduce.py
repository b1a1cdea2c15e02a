"""ctypes wrappers of shm_all_reduce_cpu.c: the sum all-reduce between the ranks of one host over a shared-memory
segment (its layout and protocol are in the C file; distributed/shm_communicator.py creates and maps the segment
and passes its address here)."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels import cpu_kernels


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = cpu_kernels._library()
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.shm_all_reduce_segment_bytes.restype = i64
    lib.shm_all_reduce_segment_bytes.argtypes = [i64, i64]
    lib.shm_all_reduce_join.restype = None
    lib.shm_all_reduce_join.argtypes = [ptr, i64, i64]
    lib.shm_all_reduce_pid.restype = i64
    lib.shm_all_reduce_pid.argtypes = [ptr, i64]
    lib.shm_all_reduce_f32.restype = ctypes.c_int
    lib.shm_all_reduce_f32.argtypes = [ptr, i64, i64, i64, ptr, i64]
    return lib


def available() -> bool:
    """Whether the native library (and so this kernel) is built and loaded."""
    return _kernel() is not None


def segment_bytes(ranks: int, slot_floats: int) -> int:
    """The size of the segment for `ranks` ranks with slots of `slot_floats` floats."""
    return _kernel().shm_all_reduce_segment_bytes(ranks, slot_floats)


def join(base: int, rank: int, pid: int) -> None:
    """Write this rank's pid into its control line of the segment at `base`."""
    _kernel().shm_all_reduce_join(base, rank, pid)


def pid_of(base: int, rank: int) -> int:
    """The pid rank `rank` wrote into the segment at `base` (0 until it joined)."""
    return _kernel().shm_all_reduce_pid(base, rank)


def all_reduce(base: int, rank: int, ranks: int, slot_floats: int, x: torch.Tensor) -> None:
    """x = the sum of every rank's x, in rank order (every rank calls this with a tensor of the same size).

    Args:
        base: the segment's address, as mapped in this process.
        x: float32, contiguous, on the CPU; overwritten.
    Raises:
        RuntimeError: a peer's process exited while this rank waited for it.
    """
    cpu_kernels.require(x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and 0 <= rank < ranks,
                        "x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and 0 <= rank < ranks")
    rc = _kernel().shm_all_reduce_f32(base, rank, ranks, slot_floats, x.data_ptr(), x.numel())
    if rc != 0:
        raise RuntimeError(f"tensor-parallel rank {rc - 1} exited during a shared-memory all-reduce")
