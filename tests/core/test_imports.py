import subprocess
import sys

import pytest

CORE_MODULES = [
    "pagedllm.core",
    "pagedllm.core.request",
    "pagedllm.core.block_hash",
    "pagedllm.core.block_pool",
    "pagedllm.core.kv_cache_manager",
    "pagedllm.core.request_queue",
    "pagedllm.core.scheduler_output",
    "pagedllm.core.scheduler",
]
FORBIDDEN = ["torch", "pagedllm.worker", "pagedllm.layers", "pagedllm.entrypoints", "pagedllm.models"]


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_torch(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"
