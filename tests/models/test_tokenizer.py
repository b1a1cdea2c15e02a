"""Tokenizers from HF folders and GGUF metadata, chat templates, and the Jinja sandbox."""

from __future__ import annotations

import pytest

from pagedllm.tokenizer import get_tokenizer

TEXTS = ["Hello world!", "The quick brown fox jumps over the lazy dog.", "  spaces\tand\nnewlines ",
         "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓ 日本"]
MESSAGES = [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "The sea."},
            {"role": "user", "content": "Again"}]


def test_hf_folder_and_gguf_tokenizers_agree(tiny_llama_dir, tiny_llama_gguf):
    hf, gg = get_tokenizer(tiny_llama_dir), get_tokenizer(tiny_llama_gguf)
    for text in TEXTS:
        assert hf(text).input_ids == gg(text).input_ids, text
        assert hf.decode(hf(text).input_ids) == text
    assert (hf.eos_token_id, hf.bos_token_id) == (gg.eos_token_id, gg.bos_token_id) == (2, 1)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == gg.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


def test_chat_templates_render_in_a_sandbox(tiny_llama_dir):
    from jinja2.exceptions import SecurityError

    tok = get_tokenizer(tiny_llama_dir)
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        tok.apply_chat_template(MESSAGES, chat_template=evil, tokenize=False)


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_hf_tokenizer):
    from pagedllm.models.loader import resolve_model

    resolved = resolve_model(None)
    ours = get_tokenizer(resolved)
    ref = smollm2_hf_tokenizer
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.decode(ours("Hello world!").input_ids) == "Hello world!"
