"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

Each kernel has a pure-torch path beside it; where no compiler is found (or the device is not the CPU),
that path runs instead. See `cpu_kernels.py`.
"""
