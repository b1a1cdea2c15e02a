"""The fast GGUF paths match the slow references they replace: our reader vs gguf.GGUFReader, our
dequantization vs gguf.quants, our GGUF tokenizer vs AutoTokenizer(gguf_file=...)."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest

from pagedllm.models.gguf_dequant import dequantize
from pagedllm.models.gguf_reader import GGUFFile
from pagedllm.tokenizer import get_tokenizer


def _assert_same_file(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert len(ours.metadata) == sum(1 for k in ref.fields if not k.startswith("GGUF."))
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name


def test_reader_matches_gguf_reader(tiny_llama_gguf):
    _assert_same_file(tiny_llama_gguf)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0",
                                                                          "Q4_1")], ids=lambda q: q.name)
def test_dequantize_bit_identical(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 256)) * rng.uniform(1e-3, 10, (64, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(-1)
    ours = dequantize(raw.reshape(-1).view(np.uint8), qtype)
    assert ours.dtype == np.float32 and ours.flags.writeable
    assert ours.view(np.uint32).tolist() == ref.astype(np.float32).view(np.uint32).tolist()


def _assert_same_tokenizer(ours, ref, texts):
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.special_tokens_map == ref.special_tokens_map and ours.all_special_ids == ref.all_special_ids
    assert ours.chat_template == ref.chat_template and ours.get_vocab() == ref.get_vocab()
    for text in texts:
        for add_special in (True, False):
            ids = ours(text, add_special_tokens=add_special).input_ids
            assert ids == ref(text, add_special_tokens=add_special).input_ids, text
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    for conversation in (messages, messages[1:2]):
        for add in (True, False):
            for tokenize in (True, False):
                assert ours.apply_chat_template(conversation, tokenize=tokenize, add_generation_prompt=add) == \
                    ref.apply_chat_template(conversation, tokenize=tokenize, add_generation_prompt=add)


def _random_texts(n: int) -> list[str]:
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,!?'\"\n\t  ünïcödé✓日本語😀<>|_-"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60))) for _ in range(n)]
    return texts + ["<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x", " leading", "I'm can't we'll"]


def test_gguf_tokenizer_matches_auto_tokenizer(tiny_llama_gguf):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_llama_gguf.parent, gguf_file=tiny_llama_gguf.name)
    _assert_same_tokenizer(get_tokenizer(tiny_llama_gguf), ref, _random_texts(200))


@pytest.mark.slow
def test_smollm2_fast_paths_match_references(smollm2_hf_tokenizer):
    from pagedllm.models.loader import resolve_model

    resolved = resolve_model(None)
    _assert_same_file(resolved.path)
    _assert_same_tokenizer(get_tokenizer(resolved), smollm2_hf_tokenizer, _random_texts(1000))
