"""CI size of benchmarks/structured_outputs_validity.py: its 10 JSON schemas, a regex and a choice, 2 requests
each, greedy and at temperature 1, on the tiny random model: every output is valid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedllm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from structured_outputs_validity import run_validity  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_output_is_valid(tiny_llama_dir):
    pytest.importorskip("jsonschema", reason="the test extras (scripts/setup.sh) install jsonschema")
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, num_gpu_blocks_override=512)
    results = run_validity(llm, num_requests=2, max_tokens=300)
    assert len(results) == 12
    invalid = {(name, t): bad for name, per in results.items() for t, (ok, total, bad) in per.items() if ok != total}
    assert not invalid
