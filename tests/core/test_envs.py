"""One module reads the environment (pagedllm/envs.py, as vllm/envs.py): every variable is declared there once,
with its default and meaning, and read when asked for; no other module reads os.environ or os.getenv."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs

SRC = Path(pagedllm.__file__).parent


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that touch os.environ / os.getenv / environ other than `{**os.environ, ...}` (handing the environment on
    to a child process is not a read)."""
    passed_on = {id(v) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                 for k, v in zip(node.keys, node.values, strict=True) if k is None}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "environb", "getenvb") for a in node.names):
            lines.append(node.lineno)
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "getenvb")
                and isinstance(node.value, ast.Name) and node.value.id == "os" and id(node) not in passed_on):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_envs_reads_the_environment():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "envs.py":
            continue
        lines = _environment_reads(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(SRC))] = lines
    assert not offenders, f"read environment variables through pagedllm.envs: {offenders}"


def test_the_check_sees_reads():
    tree = ast.parse("import os\na = os.environ.get('X')\nb = os.getenv('Y')\nc = {**os.environ, 'Z': '1'}\n"
                     "from os import environ\n")
    assert _environment_reads(tree) == [2, 3, 5]


def test_variables_are_read_lazily_with_their_defaults(monkeypatch):
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.VLLM_API_KEY is None and envs.VLLM_LOGGING_LEVEL == "INFO" and envs.VLLM_CONFIGURE_LOGGING is True
    assert envs.VLLM_SERVER_DEV_MODE is False and envs.PAGEDLLM_NATIVE_KERNELS is True and envs.CC == "cc"
    assert envs.OMP_NUM_THREADS is None and envs.VLLM_ENGINE_READY_TIMEOUT_S is None
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    monkeypatch.setenv("PAGEDLLM_NATIVE_KERNELS", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert envs.VLLM_LOGGING_LEVEL == "DEBUG" and envs.VLLM_CONFIGURE_LOGGING is False
    assert envs.PAGEDLLM_NATIVE_KERNELS is False and envs.OMP_NUM_THREADS == 3 and envs.VLLM_SERVER_DEV_MODE is True
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "no")
    with pytest.raises(ValueError, match="VLLM_CONFIGURE_LOGGING"):
        _ = envs.VLLM_CONFIGURE_LOGGING
    with pytest.raises(AttributeError):
        _ = envs.NOT_DECLARED


def test_every_variable_is_documented():
    assert all(doc for _, doc in envs.ENVIRONMENT_VARIABLES.values())
