"""Thread settings on this CPU: F.linear(x[M,576], W[3072,576]) at M = 64, 512, 2048 with 2 and 1 torch threads.

Run it plainly and with OMP_WAIT_POLICY=PASSIVE to see GNU OpenMP's spinning on a busy machine.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def median_seconds(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def main() -> None:
    w = torch.randn(3072, 576)
    for m in (64, 512, 2048):
        x = torch.randn(m, 576)
        for threads in (2, 1):
            torch.set_num_threads(threads)
            t = median_seconds(lambda x=x: F.linear(x, w))
            print(f"M={m} threads={threads} {t * 1e3:.2f} ms {2 * m * 576 * 3072 / t / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
