"""Keep freed memory in the process heap on CPU (glibc), so per-step temporaries do not page-fault.

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
import sys

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
