"""The `deepseek_r1` reasoning parser (`--reasoning-parser deepseek_r1`), as vLLM's: DeepSeek-R1's template opens
`<think>` in the prompt, so the output is reasoning until `</think>` whether or not it writes `<think>` itself; an
output that never closes it is all reasoning. `enable_thinking` changes nothing."""

from __future__ import annotations

from typing import Any

START = "<think>"
END = "</think>"
IMPLICIT_ENDS: tuple[str, ...] = ()
DROP_END_IN_CONTENT = False
TURN_BOUNDARIES: tuple[str, ...] = ()


def thinking(chat_template_kwargs: dict[str, Any] | None) -> bool:
    return True
