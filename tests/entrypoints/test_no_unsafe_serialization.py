"""Nothing crossing a process boundary is pickled, and nothing evaluates or unpickles untrusted input.

Reads the syntax tree of every source file (docstrings and comments may say "never pickle").
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pagedllm"
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
PICKLING_METHODS = {"send_pyobj", "recv_pyobj", "loads_pickle"}


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(SRC.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append(f"{where}: imports from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in PICKLING_METHODS:
            found.append(f"{where}: uses .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                found.append(f"{where}: calls {func.id}()")
            if (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    found.append(f"{where}: torch.load without weights_only=True")
    return found


def test_no_pickle_eval_or_unsafe_torch_load():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    problems = [p for path in files for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_checker_catches_what_it_should(tmp_path):
    bad = tmp_path / "pagedllm" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import pickle\nfrom dill import loads\nimport torch\nsock.recv_pyobj()\neval('1')\n"
                   "torch.load('w.pt')\ntorch.load('w.pt', weights_only=True)\n'''never pickle'''\n")
    global SRC
    saved, SRC = SRC, tmp_path / "pagedllm"
    try:
        problems = _problems(bad)
    finally:
        SRC = saved
    assert len(problems) == 5, problems


def test_engine_core_is_started_without_fork():
    core_client = (SRC / "engine" / "core_client.py").read_text()
    assert "subprocess.Popen" in core_client and "os.fork" not in core_client
