"""Give the calling thread its name in the OS, so `top -H`, /proc/<pid>/task/<tid>/comm and
benchmarks/serving_cpu.py can tell an IO thread from an OpenMP worker (Python 3.11 names threads only
inside Python). Linux only; elsewhere, or if libc refuses, it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def set_native_thread_name(name: str) -> None:
    """Name the calling OS thread (at most 15 bytes are kept)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
