"""Reasoning parsers (`--reasoning-parser`; `config.server.REASONING_PARSERS` registers them by name): they split
the model's `<think>...</think>` reasoning out of its output (reasoning.py does the splitting, whole or as a stream,
and tells the engine where the reasoning ends, so that a grammar constrains only the text after it).

A parser is a module with
- `START`, `END`: the tags that open and close the reasoning (single tokens of the model's vocabulary);
- `thinking(chat_template_kwargs) -> bool`: whether the output begins inside the reasoning (the chat template
  opened it, or the model may omit `START`); False: the whole output is content;
- `IMPLICIT_ENDS`: texts that end the reasoning without `END` and stay in the content (qwen3: `<tool_call>`);
- `DROP_END_IN_CONTENT`: a further `END` after the reasoning is dropped from the content (qwen3) or kept
  (deepseek_r1);
- `TURN_BOUNDARIES`: tokens past which the prompt is not searched for the tags (ChatML's; empty: the whole prompt).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pagedllm.config.server import REASONING_PARSERS


def get_reasoning_parser(name: str) -> ModuleType:
    """The module of the registered parser `name` (KeyError for an unknown name: ServerConfig refuses those)."""
    return importlib.import_module(f"{__name__}.{REASONING_PARSERS[name]}")
