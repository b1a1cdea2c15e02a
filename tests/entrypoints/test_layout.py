"""The serving layer stays small enough to read: no file in entrypoints/ over 300 lines and no function there over
60; elsewhere in src/ no file over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

SRC = Path(pagedllm.__file__).parent


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def test_entrypoints_files_and_functions_are_small():
    too_long = []
    for path in sorted((SRC / "entrypoints").rglob("*.py")):
        if _lines(path) > 300:
            too_long.append(f"{path.relative_to(SRC)}: {_lines(path)} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_source_files_stay_under_500_lines():
    assert [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py")) if _lines(p) >= 500] == []
