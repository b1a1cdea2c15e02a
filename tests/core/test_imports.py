"""The package's layering, read from its import statements.

Every `pagedllm` module belongs to a layer; a module may import modules of its own layer or of a lower one,
never of a higher one, and no chain of imports leads back to where it started. Imports inside functions and
under `if TYPE_CHECKING:` count too: a deferred import still couples the two modules.

The layers, bottom first (a top-level module or sub-package is named by its first name under `pagedllm`):

    values       sampling_params, pooling_params, messages, outputs, config (the package: engine and server
                 settings), envs (the environment variables),
                 log_escape, math_utils, child_process, native_thread_name   (no torch; the last two: a process's own
                 exit and thread names)
    core         core (pure Python, no torch), kernels (native code)
    model        layers, models, tokenizer, spec_decode, distributed (the tensor-parallel group), lora (adapters),
                 kv_transfer (KV connectors)
    worker       worker
    executor     executor (drives the workers: in-process or one process per rank)
    metrics      metrics
    engine       engine
    bench        bench (the load generator; a client, no engine)
    entrypoints  entrypoints (LLM, the OpenAI server, the CLI)

So core < engine < entrypoints, and layers/models/worker never import engine or entrypoints. The package
root `pagedllm/__init__.py` is the public facade (it loads `LLM` lazily) and is not a layer: importing it
means importing `SamplingParams` and `__version__`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pagedllm

SRC = Path(pagedllm.__file__).parent

LAYERS = [
    {"sampling_params", "pooling_params", "messages", "outputs", "config", "envs", "log_escape", "math_utils",
     "child_process", "native_thread_name", "gc_heap"},
    {"core", "kernels"},
    {"layers", "models", "tokenizer", "spec_decode", "distributed", "structured_output", "lora", "kv_transfer"},
    {"worker"},
    {"executor"},
    {"metrics"},
    {"engine"},
    {"bench"},
    {"entrypoints"},
]
LAYER_OF = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}

TORCH_FREE_MODULES = [
    "pagedllm.messages",
    "pagedllm.config",
    "pagedllm.envs",
    "pagedllm.core",
    "pagedllm.core.request",
    "pagedllm.core.block_hash",
    "pagedllm.core.block_pool",
    "pagedllm.core.kv_events",
    "pagedllm.core.kv_cache_manager",
    "pagedllm.core.request_queue",
    "pagedllm.core.scheduler_output",
    "pagedllm.core.scheduler",
    "pagedllm.core.stop_check",
]
FORBIDDEN_IN_CORE = ["torch", "pagedllm.engine", "pagedllm.worker", "pagedllm.layers", "pagedllm.entrypoints",
                     "pagedllm.models", "pagedllm.metrics"]


def all_modules() -> dict[str, Path]:
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = ["pagedllm", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The pagedllm modules `path` imports, wherever the import statement sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if name in known and name != "pagedllm"}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(path, set(modules)) for name, path in modules.items()}


def layer(module: str) -> int:
    unit = module.split(".")[1]
    assert unit in LAYER_OF, f"{module}: add {unit!r} to a layer in LAYERS"
    return LAYER_OF[unit]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_every_package_is_in_a_layer():
    units = {name.split(".")[1] for name in all_modules() if name != "pagedllm"}
    assert units == set(LAYER_OF), "LAYERS must name every top-level module and sub-package exactly once"


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = sorted(f"{module} imports {target}" for module, targets in graph.items() if module != "pagedllm"
                    for target in targets if layer(target) > layer(module))
    assert upward == []


def test_no_import_cycle():
    graph = import_graph()
    graph["pagedllm"] = set()  # the facade's lazy import of LLM is the one allowed way back up
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_checks_catch_what_they_forbid():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert layer("pagedllm.core.scheduler") < layer("pagedllm.engine.core") < layer("pagedllm.entrypoints.llm")
    assert layer("pagedllm.worker.model_runner") < layer("pagedllm.engine.core")
    assert layer("pagedllm.messages") < layer("pagedllm.core.request")


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_imports_no_torch(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        f"bad = [m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"
