"""The checks in front of every native call raise ValueError, also under `python -O`, which strips asserts: a bad
dtype, layout or shape never reaches the C code as a wrong pointer (issue 13, item 6)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.float32, torch.device("cpu")),
                                reason="needs the native CPU kernels")

# Each line calls a kernel wrapper with one argument wrong; each must raise ValueError.
BAD_CALLS = [
    "cpu_kernels.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)",
    "cpu_kernels.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)",
    "cpu_kernels.silu_and_mul(torch.ones(8, 2).t())",
    "cpu_kernels.quant_linear(torch.ones(64, dtype=torch.float32), 4, 32, torch.ones(1, 32), 8)",
    "cpu_kernels.write_kv_cache(torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.zeros(4, 16, 1, 8),"
    " torch.zeros(4, 16, 1, 8), torch.zeros(2, dtype=torch.int32))",
    "cpu_kernels.kv_encode(torch.ones(4, 2).t(), torch.bfloat16)",
]

@pytest.mark.parametrize("call", BAD_CALLS)
def test_a_bad_argument_raises_value_error(call):
    with pytest.raises(ValueError, match="native kernel argument check failed"):
        eval(call, {"cpu_kernels": cpu_kernels, "torch": torch})


def test_the_checks_survive_python_O():
    lines = ["import sys, torch", "from pagedllm.kernels import cpu_kernels",
             "if sys.flags.optimize != 1: raise SystemExit('not running under -O')"]
    for call in BAD_CALLS:
        lines += ["try:", f"    {call}", f"    raise SystemExit('no ValueError from {call[:50]}')",
                  "except ValueError:", "    pass"]
    result = subprocess.run([sys.executable, "-O", "-c", "\n".join(lines)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
