"""A tiny random model whose tokenizer has `<think>` and `</think>` as (non-special) added tokens, as Qwen3's and
DeepSeek-R1's have, and a ChatML template that opens `<think>` after the assistant prompt, or writes an empty
`<think>\n\n</think>\n\n` when `enable_thinking` is false (Qwen3's). A random model never closes its reasoning by
itself: tests drive it with logit_bias on `</think>` (greedy, so the output is deterministic), or, where logit_bias
cannot be used (it turns speculative decoding off for the request), build it with `close_like`: `</think>`'s output
row becomes 1.05 x that token's, so the model writes `</think>` wherever it would have written that token."""

from __future__ import annotations

import shutil
from pathlib import Path

THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}"
)


def build_thinking_model(padded_dir: Path, folder: Path, close_like: int | None = None) -> tuple[Path, int, int]:
    """(model folder, id of `<think>`, id of `</think>`): the padded tiny Llama (512 rows for 384 tokens) with the
    two tags added to its tokenizer (ids 384 and 385, rows the model has)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    shutil.copytree(padded_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(folder)
    end = tokenizer.convert_tokens_to_ids("</think>")
    if close_like is not None:
        weights = load_file(folder / "model.safetensors")
        weights["lm_head.weight"][end] = weights["lm_head.weight"][close_like] * 1.05
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
