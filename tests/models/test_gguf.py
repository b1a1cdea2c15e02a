"""GGUF loading: dequantization of every supported type, metadata, and clean errors on bad files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.config import ModelConfig
from pagedllm.models.gguf_loader import dequantize_tensor, gguf_model_info, open_gguf
from pagedllm.models.loader import load_model, load_model_info
from pagedllm.models.model_info import ModelLoadError

# type -> max abs error of quantize + dequantize on N(0, 1) data (None: gguf cannot quantize it)
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.03, Q.Q4_0: 0.5, Q.Q4_1: 0.4,
                   Q.Q4_K: None, Q.Q5_K: None, Q.Q6_K: None}
# byte offsets of the fp16 scales inside one K-quant block (ggml-common.h block_q*_K layouts)
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama") -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_k_blocks(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (random bytes there could be inf / nan)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, 2, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.001, 0.1, (rows, 2)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, 2, 2)
    return blocks.reshape(rows, 2 * type_size)  # 2 blocks = 2 * 256 values per row


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_dequantize_round_trip(tmp_path, qtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    tol = QUANT_TOLERANCE[qtype]
    raw = gguf.quants.quantize(x, qtype) if tol is not None else random_k_blocks(qtype, 8, rng)
    write_tensors(tmp_path / "q.gguf", {"t.weight": (raw, qtype)})
    (tensor,) = open_gguf(tmp_path / "q.gguf").tensors
    ours = dequantize_tensor(tensor, tmp_path / "q.gguf")
    assert ours.shape == (8, 512) and ours.dtype == np.float32 and np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))
    if tol is not None:
        assert np.abs(ours - x).max() <= tol


def test_tiny_gguf_metadata_matches_hf_config(tiny_llama_dir, tiny_llama_gguf):
    hf = load_model_info(ModelConfig(model=str(tiny_llama_dir)))
    gg = load_model_info(ModelConfig(model=str(tiny_llama_gguf)))
    for name in ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                 "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
                 "eos_token_ids", "bos_token_id"):
        assert getattr(hf, name) == getattr(gg, name), name
    assert hf.rms_norm_eps == pytest.approx(gg.rms_norm_eps)
    assert hf.generation_config == {"temperature": 0.7, "top_p": 0.9}
    assert gg.generation_config == {}


def test_garbage_file_is_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*not a GGUF file"):
        load_model_info(ModelConfig(model=str(bad)))


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.98])
def test_truncated_file(tmp_path, tiny_llama_gguf, keep):
    data = tiny_llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|corrupt)"):
        load_model(ModelConfig(model=str(cut)), torch.device("cpu"), torch.float32)


def test_corrupt_header(tmp_path, tiny_llama_gguf):
    data = bytearray(tiny_llama_gguf.read_bytes())
    data[8:16] = (2**40).to_bytes(8, "little")  # absurd tensor count
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"corrupt\.gguf"):
        load_model_info(ModelConfig(model=str(bad)))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tensors(path, {"t.weight": (np.zeros((2, 32), np.float32), Q.F32)}, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf.*architecture 'gpt2' is not supported"):
        load_model_info(ModelConfig(model=str(path)))


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "nokeys.gguf"
    write_tensors(path, {"t.weight": (np.zeros((2, 32), np.float32), Q.F32)})
    with pytest.raises(ModelLoadError, match=r"nokeys\.gguf.*lacks required key 'llama\.attention\.head_count'"):
        gguf_model_info(open_gguf(path), path)


def test_unsupported_quant_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    raw = np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)
    write_tensors(path, {"t.weight": (raw, Q.Q2_K)})
    (tensor,) = open_gguf(path).tensors
    with pytest.raises(ModelLoadError, match=r"q2k\.gguf.*'t\.weight'.*unsupported type Q2_K"):
        dequantize_tensor(tensor, path)
