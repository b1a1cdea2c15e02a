"""Request-supplied chat templates (`--trust-request-chat-template`), rendered in a child process.

The sandbox of chat_template.py bounds what a template's own loops and operators build while it renders,
but not what Jinja computes while it compiles: it folds constant expressions (`{{ '%999999999s' % 'a' }}`,
`{{ 'a'|center(999999999) }}`) at compile time, in one C call. In the API server that call blocked the event
loop for 20.9 s and left 1.2 GB behind (cached with the template). Here a template is compiled and rendered
by one long-lived child process (`python -m` this module, a JsonLinesChild) under an address-space limit; the
server awaits its answer without blocking, kills it past the render timeout (plus slack for one long C call)
and starts a fresh one for the next template.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from pagedllm.entrypoints.openai import chat_template
from pagedllm.entrypoints.openai.json_lines_child import JsonLinesChild, serve_json_lines

MEMORY_LIMIT_BYTES = 512 << 20
"""The child's address-space limit: a template that allocates past it fails with MemoryError (the child
itself needs ~30 MB; a 16 MB request's messages a few hundred)."""
KILL_SLACK_S = 2.0
"""Seconds past the render timeout (which the child enforces itself between Python lines) before the
server kills a child stuck in one long C call."""
MAX_ANSWER_BYTES = 64 << 20


class ChatTemplateProcessError(Exception):
    """The template could not be rendered; the message says why (as the in-process sandbox words it)."""


class ChatTemplateProcess(JsonLinesChild):
    """One child process that renders request-supplied templates, one at a time, started on first use."""

    error = ChatTemplateProcessError
    not_started_message = "RuntimeError: the chat template process did not start."
    crash_message = "ChatTemplateLimitError: the chat template used too much memory."

    def __init__(self, memory_limit_bytes: int = MEMORY_LIMIT_BYTES):
        super().__init__(__name__, [str(memory_limit_bytes)], MAX_ANSWER_BYTES)

    def timeout_message(self, timeout_s: float, waited: bool) -> str:
        return f"ChatTemplateLimitError: the chat template took longer than {timeout_s:g} s to render."

    async def render(self, source: str, messages: list[dict[str, Any]], *, timeout_s: float,
                     **options: Any) -> str:
        """chat_template.render(source, messages, timeout_s=timeout_s, **options) in the child.

        Raises ChatTemplateProcessError (a TemplateError, a limit, MemoryError, a kill after the timeout)."""
        reply = await self.ask({"source": source, "messages": messages, "options": {**options, "timeout_s": timeout_s}},
                               timeout_s, wait_counts=False, slack_s=KILL_SLACK_S)
        if "error" in reply:
            raise ChatTemplateProcessError(reply["error"])
        return reply["text"]


def main() -> None:
    """The child: read a JSON request per line, answer {"text"} or {"error"} per line, until stdin closes."""
    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    serve_json_lines(_render)


def _render(request: dict) -> dict:
    try:
        return {"text": chat_template.render(request["source"], request["messages"], **request["options"])}
    except MemoryError:
        return {"error": "ChatTemplateLimitError: the chat template used too much memory."}
    finally:
        chat_template.compile_template.cache_clear()  # a template's folded constants must not outlive it


if __name__ == "__main__":
    main()
