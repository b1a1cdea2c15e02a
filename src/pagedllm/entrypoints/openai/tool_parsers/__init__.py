"""Tool call parsers (`--tool-call-parser`; `server_config.TOOL_CALL_PARSERS` registers them by name) and the
chat template shipped for them (`tool_chat_template_hermes.jinja`).

A parser is a module with
- `extract_tool_calls(text, tools) -> (content, [(name, arguments JSON)]) | None`: the calls of a finished output
  (None: no call, the whole output is content);
- `stream_state(text, finished, tools) -> (content, [PartialCall])`: the content a stream may send so far and the
  calls begun, whose arguments text only grows by appending (partial_calls.py);
- optionally `SKIP_SPECIAL_TOKENS = False`: its markers are special tokens, which must stay in the output.
`tools` is the request's tools (for parsers that type arguments by their schema).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pagedllm.config.server import TOOL_CALL_PARSERS


def get_tool_parser(name: str) -> ModuleType:
    """The module of the registered parser `name` (KeyError for an unknown name: ServerConfig refuses those)."""
    return importlib.import_module(f"{__name__}.{TOOL_CALL_PARSERS[name]}")
