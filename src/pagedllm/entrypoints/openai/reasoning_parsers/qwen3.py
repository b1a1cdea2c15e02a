"""The `qwen3` reasoning parser (`--reasoning-parser qwen3`), as vLLM 0.32's: with thinking on (the default;
`chat_template_kwargs: {"enable_thinking": false}` turns it off) the output is reasoning until `</think>` (an opening
`<think>` is optional: Qwen3's thinking templates open it in the prompt), or until a `<tool_call>`, which ends the
reasoning and begins the content. With thinking off the whole output is content. A `</think>` after the reasoning
is dropped."""

from __future__ import annotations

from typing import Any

START = "<think>"
END = "</think>"
IMPLICIT_ENDS = ("<tool_call>",)
DROP_END_IN_CONTENT = True
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


def thinking(chat_template_kwargs: dict[str, Any] | None) -> bool:
    return bool((chat_template_kwargs or {}).get("enable_thinking", True))
