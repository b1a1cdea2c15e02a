"""Request-supplied chat templates (`--trust-request-chat-template`), rendered in a child process.

The sandbox of chat_template.py bounds what a template's own loops and operators build while it renders,
but not what Jinja computes while it compiles: it folds constant expressions (`{{ '%999999999s' % 'a' }}`,
`{{ 'a'|center(999999999) }}`) at compile time, in one C call. In the API server that call blocked the event
loop for 20.9 s and left 1.2 GB behind (cached with the template). Here a template is compiled and rendered
by one long-lived child process (`python -m` this module) under an address-space limit; the server awaits
its answer without blocking, kills it past the render timeout (plus slack for one long C call) and starts a
fresh one for the next template. Requests and answers are JSON lines on its stdin and stdout: no pickle.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
from typing import Any

from pagedllm.entrypoints.openai import chat_template

MEMORY_LIMIT_BYTES = 512 << 20
"""The child's address-space limit: a template that allocates past it fails with MemoryError (the child
itself needs ~30 MB; a 16 MB request's messages a few hundred)."""
KILL_SLACK_S = 2.0
"""Seconds past the render timeout (which the child enforces itself between Python lines) before the
server kills a child stuck in one long C call."""
STARTUP_TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 64 << 20


class ChatTemplateProcessError(Exception):
    """The template could not be rendered; the message says why (as the in-process sandbox words it)."""


class ChatTemplateProcess:
    """One child process that renders request-supplied templates, one at a time, started on first use."""

    def __init__(self, memory_limit_bytes: int = MEMORY_LIMIT_BYTES):
        self.memory_limit_bytes = memory_limit_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def render(self, source: str, messages: list[dict[str, Any]], *, timeout_s: float,
                     **options: Any) -> str:
        """chat_template.render(source, messages, timeout_s=timeout_s, **options) in the child.

        Raises ChatTemplateProcessError (a TemplateError, a limit, MemoryError, a kill after the timeout)."""
        # ASCII JSON: a lone surrogate in a message travels as its \\u escape
        line = json.dumps({"source": source, "messages": messages,
                           "options": {**options, "timeout_s": timeout_s}}).encode() + b"\n"
        async with self._lock:
            proc = await self._started()
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
                answer = await asyncio.wait_for(proc.stdout.readline(), timeout_s + KILL_SLACK_S)
            except TimeoutError:
                self._kill()
                raise ChatTemplateProcessError(f"ChatTemplateLimitError: the chat template took longer than "
                                               f"{timeout_s:g} s to render.") from None
            except (ConnectionError, ValueError):  # the child died mid-write; an answer over MAX_ANSWER_BYTES
                answer = b""
            except BaseException:  # cancelled (the client left): the answer must not go to the next request
                self._kill()
                raise
            if not answer.endswith(b"\n"):
                self._kill()
                raise ChatTemplateProcessError("ChatTemplateLimitError: the chat template used too much memory.")
        reply = json.loads(answer)
        if "error" in reply:
            raise ChatTemplateProcessError(reply["error"])
        return reply["text"]

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, str(self.memory_limit_bytes), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=MAX_ANSWER_BYTES,
                start_new_session=True)  # Ctrl-C reaches the server alone, which kills it at exit
            try:  # its first line says it is ready: the render timeout does not pay for its start-up
                ready = await asyncio.wait_for(self._proc.stdout.readline(), STARTUP_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            except BaseException:
                self._kill()
                raise
            if ready != b"{}\n":
                self._kill()
                raise ChatTemplateProcessError("RuntimeError: the chat template process did not start.")
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.returncode is None:
                self._proc.kill()
            self._proc.stdin.close()
        self._proc = None

    def close(self) -> None:
        self._kill()


def main() -> None:
    """The child: read a JSON request per line, answer {"text"} or {"error"} per line, until stdin closes."""
    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # nothing else may write into the answer stream
    answers.write("{}\n")
    answers.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply = {"text": chat_template.render(request["source"], request["messages"], **request["options"])}
        except MemoryError:
            reply = {"error": "ChatTemplateLimitError: the chat template used too much memory."}
        except Exception as e:  # TemplateError (SecurityError, limits), ValueError, TypeError, ...
            reply = {"error": f"{type(e).__name__}: {e}"}
        chat_template.compile_template.cache_clear()  # a template's folded constants must not outlive it
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
