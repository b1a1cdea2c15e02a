"""CPU memory: the zeroed KV pool, faulted in ahead of use, and freed memory kept in the process heap (glibc), so
per-step temporaries do not page-fault.

`zeroed_pool`: the KV pool is an anonymous mmap, so its pages come zeroed from the OS and cost nothing until
they are touched: no start-up time to allocate a 4 GiB pool.

`PoolPrefault`: writing a block for the first time costs a page fault, ~15 us per 4 KiB page on these VMs (the
host backs guest memory lazily): in the offline benchmark that was 7% of a prefill step and up to ~50 ms of a
decode step at batch 128 (`index_copy_` of new K/V into fresh pages). One madvise(MADV_POPULATE_WRITE) per
2 MiB faults the pool in far cheaper: 4 GiB in 2.0 s. A background thread does it while the engine is idle
(no step for `PREFAULT_IDLE_S`), lowest block ids first (the order the block pool hands them out), every layer.
It must not run during steps: a page fault holds its core in the hypervisor, so even at the lowest priority it
stalled the other core's matmul threads (offline benchmark: 134 s with it running alongside, 120 s after it).
The offline `LLM` waits for it at construction, as vLLM's CPU build writes its whole pool (torch.zeros) before
it serves; the server lets it run between requests.
Plain 4 KiB pages, not transparent huge pages: populating 4 GiB took 15.3 s in 2 MiB pages here (2.0 s in
4 KiB ones), and decode attention over the pool measured no faster in huge pages (4.5-6.4 vs 4.5-4.6 ms per
call at batch 128).

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

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below 1 GiB come from (and return to) the heap
TOP_PAD_BYTES = 256 << 20  # grow the heap in 256 MiB steps
TRIM_THRESHOLD_BYTES = 1 << 34  # never give freed heap memory back to the OS while serving
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, as a first write would
PREFAULT_CHUNK_BYTES = 2 << 20  # per madvise call (~1 ms): the thread yields to a step within one chunk
PREFAULT_IDLE_S = 0.05  # the engine counts as idle after this long without a step
_PAGE = mmap.PAGESIZE


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


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS now (glibc malloc_trim; keep_freed_memory keeps them otherwise):
    after the weights are dropped (sleep mode). Returns False where it does not apply."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def zeroed_pool(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of nbytes in its own anonymous mapping (the array keeps the mapping alive)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)


class PoolPrefault:
    """Faults in the pages of `regions` (host tensors: the K and V halves of every layer) from a daemon thread at
    the lowest CPU priority, only while the owner is idle (`busy()` marks a step): chunk i of every region
    before chunk i + 1 of any, so the blocks the pool hands out first are resident first. Where
    MADV_POPULATE_WRITE is missing (Linux < 5.14, not Linux), it does nothing and blocks are faulted in on first
    write.
    """

    def __init__(self, regions: list, chunk_bytes: int = PREFAULT_CHUNK_BYTES, idle_s: float = PREFAULT_IDLE_S):
        self._stop = threading.Event()
        self.done = threading.Event()
        self._idle_s = idle_s
        self._busy = False
        self._last_busy = time.monotonic()  # when the last step ended; the first chunk waits idle_s from now
        # The thread gets addresses only: the tensors (and so the mappings) are owned by this object's owner on
        # its thread. A daemon thread that dropped the last reference to a tensor could be killed inside torch's
        # deallocator at interpreter exit, which aborts the process.
        self.regions = regions
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in regions if t.numel()]
        self._thread = threading.Thread(target=self._run, args=(spans, chunk_bytes), name="kv-prefault",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a step: no chunk starts until the engine has been idle for `idle_s` after it."""
        self._busy = True
        try:
            yield
        finally:
            self._last_busy = time.monotonic()
            self._busy = False

    def _wait_until_idle(self) -> bool:
        """False when stopped."""
        while self._busy or time.monotonic() - self._last_busy < self._idle_s:
            if self._stop.wait(self._idle_s):
                return False
        return not self._stop.is_set()

    def _run(self, spans: list[tuple[int, int]], chunk: int) -> None:
        try:
            madvise = _madvise()
            if madvise is None:
                return
            try:  # this thread only: the engine keeps its priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
            for offset in range(0, max((n for _, n in spans), default=0), chunk):
                for addr, nbytes in spans:
                    if offset >= nbytes:
                        continue
                    if not self._wait_until_idle():  # stopped: the owner is freeing the pool
                        return
                    start = (addr + offset) // _PAGE * _PAGE  # madvise wants a page-aligned start
                    end = addr + min(offset + chunk, nbytes)
                    if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                        logger.debug("KV pool prefault stopped: madvise errno %d", ctypes.get_errno())
                        return
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pool is resident (or prefault gave up); False on timeout."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Stop within one chunk; call before freeing the regions."""
        self._stop.set()
        self._thread.join()
        self.regions = []


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
