"""JsonLinesChild: one long-lived child process (`python -m MODULE ARGS...`) that the API server asks questions
of without blocking its event loop, and kills when an answer is late, when the asker leaves, or when it dies.

Requests and answers are one JSON object per line on the child's stdin and stdout (no pickle); the child's
first line, `{}`, says it is ready, so a request's timeout does not pay for the start-up. One request at a time:
the answer of a killed request can never reach the next one. A killed child is started again on the next
request. Used for what must not run in the server itself: request grammars (grammar_process.py) and
request-supplied chat templates (chat_template_process.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence

STARTUP_TIMEOUT_S = 30.0


class JsonLinesChild:
    """The server's side. Subclasses name the error they raise and word its messages."""

    error: type[Exception] = RuntimeError
    not_started_message = "the child process did not start."
    crash_message = "the child process died."

    def __init__(self, module: str, args: Sequence[str] = (), max_answer_bytes: int = 16 << 20):
        self.module = module
        self.args = list(args)
        self.max_answer_bytes = max_answer_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The running child's pid (None: none running)."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    def timeout_message(self, timeout_s: float, waited: bool) -> str:
        """The message of a request that got no answer within its timeout (`waited`: it never got the child)."""
        return f"no answer within {timeout_s:g} s."

    async def ask(self, request: dict, timeout_s: float, *, wait_counts: bool = True, slack_s: float = 0.0) -> dict:
        """The child's answer to `request`, within timeout_s of the call (wait_counts: the wait for the child,
        behind other requests, counts; otherwise timeout_s starts once the child is this request's), plus slack_s
        for a child that enforces timeout_s itself where it can. Raises `error` when the answer is late (the
        child is killed: its work stops using CPU) or the child dies."""
        loop = asyncio.get_running_loop()
        line = json.dumps(request).encode() + b"\n"  # ASCII JSON: lone surrogates travel escaped
        deadline = loop.time() + timeout_s + slack_s
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s if wait_counts else None)
        except TimeoutError:
            raise self.error(self.timeout_message(timeout_s, waited=True)) from None
        try:
            if not wait_counts:
                deadline = loop.time() + timeout_s + slack_s
            proc = await self._started()
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
                answer = await asyncio.wait_for(proc.stdout.readline(), max(deadline - loop.time(), 0.001))
            except TimeoutError:
                self._kill()
                raise self.error(self.timeout_message(timeout_s, waited=False)) from None
            except (ConnectionError, ValueError):  # the child died mid-write; an answer over max_answer_bytes
                answer = b""
            except BaseException:  # cancelled (the client left): the answer must not go to the next request
                self._kill()
                raise
            if not answer.endswith(b"\n"):
                self._kill()
                raise self.error(self.crash_message)
        finally:
            self._lock.release()
        return json.loads(answer)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, *self.args, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=self.max_answer_bytes,
                start_new_session=True)  # Ctrl-C reaches the server alone, which kills it at exit
            try:
                ready = await asyncio.wait_for(self._proc.stdout.readline(), STARTUP_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            except BaseException:
                self._kill()
                raise
            if ready != b"{}\n":
                self._kill()
                raise self.error(self.not_started_message)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.returncode is None:
                self._proc.kill()
            self._proc.stdin.close()
        self._proc = None

    def close(self) -> None:
        self._kill()


def serve_json_lines(answer: Callable[[dict], dict], warm_up: Callable[[], object] | None = None) -> None:
    """The child's side: warm_up(), then say it is ready, then answer each request line with answer(request)
    until stdin closes. An exception is that request's answer: {"error": "Type: message"}."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # nothing else may write into the answer stream
    if warm_up is not None:
        warm_up()
    answers.write("{}\n")
    answers.flush()
    for line in sys.stdin.buffer:
        try:
            reply = answer(json.loads(line))
        except Exception as e:  # noqa: BLE001 - any failure is that request's answer
            reply = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()
