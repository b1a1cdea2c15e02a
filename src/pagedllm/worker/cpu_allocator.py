"""CPU memory: the zeroed KV pool in huge pages, and freed memory kept in the process heap (glibc), so
per-step temporaries do not page-fault.

`zeroed_pool`: the KV pool is an anonymous mmap, so its pages come zeroed from the OS and are touched only
when a block is first written: a 4 GiB pool costs no start-up time and no resident memory until used.
It asks for transparent huge pages (MADV_HUGEPAGE; THP is in `madvise` mode on these VMs): first touch
of 256 MiB took 0.97 s in 4 KiB pages and 0.58 s in 2 MiB pages here, and decode attention reads blocks
scattered over the whole pool, where 4 KiB pages cost a TLB miss per block.

`keep_freed_memory`:

A decode step allocates tens of MB of temporaries per layer (gathered K/V blocks, MLP activations) and
frees them a moment later. glibc serves every allocation above its mmap threshold (at most 32 MiB,
usually far less) with a fresh mmap and returns it with munmap, so each step faults in and zeroes the
same memory again: measured on the 2-core EPYC, gathering 15.7 MB of KV blocks took 13 ms that way and
2.6 ms from recycled heap memory; adding 1 to a 100 MB tensor took 85 ms vs 13 ms. vLLM's CPU build gets
the same effect by preloading tcmalloc.

Call after the long-lived tensors (weights, KV cache) exist: those stay in their own mmaps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys

import numpy as np

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below 1 GiB come from (and return to) the heap
TOP_PAD_BYTES = 256 << 20  # grow the heap in 256 MiB steps
TRIM_THRESHOLD_BYTES = 1 << 34  # never give freed heap memory back to the OS while serving


def keep_freed_memory() -> bool:
    """Tune glibc malloc for reuse (process-wide, idempotent). Returns False where it does not apply."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES)))
    logger.debug("glibc malloc tuned for reuse: %s", ok)
    return ok


def zeroed_pool(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of nbytes in its own anonymous mapping, backed by huge pages where the
    kernel allows (the array keeps the mapping alive)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off or unsupported: 4 KiB pages
            pass
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)
