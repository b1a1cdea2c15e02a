"""A tiny random model whose tokenizer has `<think>` and `</think>` as (non-special) added tokens, as Qwen3's and
DeepSeek-R1's have, and a ChatML template that opens `<think>` after the assistant prompt, or writes an empty
`<think>\n\n</think>\n\n` when `enable_thinking` is false (Qwen3's). A random model never closes its reasoning by
itself: tests drive it with logit_bias on `</think>` (greedy, so the output is deterministic)."""

from __future__ import annotations

import shutil
from pathlib import Path

THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}"
)


def build_thinking_model(padded_dir: Path, folder: Path) -> tuple[Path, int, int]:
    """(model folder, id of `<think>`, id of `</think>`): the padded tiny Llama (512 rows for 384 tokens) with the
    two tags added to its tokenizer (ids 384 and 385, rows the model has)."""
    from transformers import AutoTokenizer

    shutil.copytree(padded_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder, tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
