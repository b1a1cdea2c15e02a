"""Request grammars validated by llguidance in child processes, so that neither a crash nor a slow compile
reaches the API server.

A grammar's validation is a native call that cannot be interrupted: in a worker thread, one that timed out went
on using a core until it ended (six concurrent 100,000-entry `choice`s made every other client's trivial
`choice` time out), and a native crash (a stack overflow past the bounds of structured_output/bounds.py, which
are checked before this) killed the server. Here each grammar is validated by a long-lived child (`python -m`
this module) on a big-stack thread; the server awaits its answer without blocking, kills it at the timeout (so a
given-up compile stops using CPU) or when the client leaves, and starts a fresh one for the next grammar. A child
that dies answers that request alone with a 400.

Two lanes, each one child, by grammar size: a small grammar (up to bounds.SMALL_GRAMMAR_BYTES, which compiles
in milliseconds) never queues behind a big one. A request's timeout covers its wait for the lane and its compile.
Requests and answers are JSON lines on the child's stdin and stdout: no pickle.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import weakref

from pagedllm.structured_output.bounds import SMALL_GRAMMAR_BYTES

STARTUP_TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 16 << 20


class GrammarProcessError(Exception):
    """The grammar's validation gave no answer (timed out, or the child died); the message says which."""


class GrammarProcess:
    """One child that validates grammars, one at a time, started on first use (and again after a kill)."""

    def __init__(self):
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The running child's pid (None: none running)."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def validate(self, grammar: str, timeout_s: float) -> str:
        """llguidance's validation message of `grammar` ("": valid), within timeout_s of the call (waiting for
        the child included). Raises GrammarProcessError."""
        return (await self.ask({"grammar": grammar}, timeout_s))["error"]

    async def ask(self, request: dict, timeout_s: float) -> dict:
        """The child's answer to `request` (see main), within timeout_s of the call (waiting for the child
        included). Raises GrammarProcessError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        line = json.dumps(request).encode() + b"\n"  # ASCII JSON: lone surrogates travel escaped
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            raise GrammarProcessError(f"The grammar took longer than {timeout_s:g} s to compile (it waited for "
                                      "other large grammars).") from None
        try:
            proc = await self._started()
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
                answer = await asyncio.wait_for(proc.stdout.readline(), max(deadline - loop.time(), 0.001))
            except TimeoutError:
                self._kill()  # the compile stops using CPU now
                raise GrammarProcessError(f"The grammar took longer than {timeout_s:g} s to compile.") from None
            except (ConnectionError, ValueError):  # the child died mid-write; an answer over MAX_ANSWER_BYTES
                answer = b""
            except BaseException:  # cancelled (the client left): the answer must not go to the next request
                self._kill()
                raise
            if not answer.endswith(b"\n"):
                self._kill()
                raise GrammarProcessError("The grammar crashed the compiler.")
        finally:
            self._lock.release()
        return json.loads(answer)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=MAX_ANSWER_BYTES,
                start_new_session=True)  # Ctrl-C reaches the server alone; the child ends when its stdin closes
            try:  # its first line says it is ready: the compile timeout does not pay for its start-up
                ready = await asyncio.wait_for(self._proc.stdout.readline(), STARTUP_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            except BaseException:
                self._kill()
                raise
            if ready != b"{}\n":
                self._kill()
                raise GrammarProcessError("The grammar validation process did not start.")
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.returncode is None:
                self._proc.kill()
            self._proc.stdin.close()
        self._proc = None

    def close(self) -> None:
        self._kill()


class GrammarValidator:
    """The two lanes (small and big grammars) of one event loop."""

    def __init__(self):
        self.small = GrammarProcess()
        self.big = GrammarProcess()

    async def validate(self, grammar: str, timeout_s: float) -> str:
        """See GrammarProcess.validate; the lane is picked by the grammar's size."""
        lane = self.small if len(grammar) <= SMALL_GRAMMAR_BYTES else self.big
        return await lane.validate(grammar, timeout_s)

    async def prepare(self, params: bytes, json_options: tuple[bool, bool], timeout_s: float) -> dict:
        """The child's grammar text and validation of StructuredOutputsParams `params` (as msgspec JSON):
        {"grammar", "param", "error"} ("": valid), or {"param", "message"} for a StructuredOutputError (a limit of
        bounds.py, an invalid schema). The lane is picked by the params' size. Raises GrammarProcessError."""
        lane = self.small if len(params) <= SMALL_GRAMMAR_BYTES else self.big
        return await lane.ask({"params": params.decode(), "options": list(json_options)}, timeout_s)

    def close(self) -> None:
        self.small.close()
        self.big.close()


_validators: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GrammarValidator] = weakref.WeakKeyDictionary()


def validator() -> GrammarValidator:
    """The running event loop's GrammarValidator (its lanes' locks belong to one loop)."""
    loop = asyncio.get_running_loop()
    found = _validators.get(loop)
    if found is None:
        found = _validators[loop] = GrammarValidator()
    return found


def main() -> None:
    """The child: read a JSON request per line until stdin closes, and answer each on a line:
    {"grammar"} -> {"error"} (llguidance's validation message, "": valid);
    {"params", "options"} -> the grammar made from StructuredOutputsParams (bounds checked) and validated:
    {"grammar", "param", "error"}, or {"param", "message"} for a StructuredOutputError.
    The work runs on a thread with a bounds.STACK_BYTES stack."""
    import msgspec

    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.bounds import BigStackExecutor
    from pagedllm.structured_output.grammar import StructuredOutputError, prepared_grammar, validation_error

    def prepare(params: str, options: list[bool]) -> dict:
        try:
            grammar, param = prepared_grammar(msgspec.json.decode(params, type=StructuredOutputsParams), *options)
        except StructuredOutputError as e:
            return {"param": e.param, "message": str(e)}
        return {"grammar": grammar, "param": param, "error": validation_error(grammar)}

    try:  # killed with the server, even mid-compile (otherwise it ends when its stdin closes, between grammars)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (AttributeError, OSError):
        pass

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # nothing else may write into the answer stream
    worker = BigStackExecutor("grammar-validate")
    worker.submit(validation_error, "").result()  # llguidance loaded before the first request's clock runs
    answers.write("{}\n")
    answers.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            if "params" in request:
                reply = worker.submit(prepare, request["params"], request["options"]).result()
            else:
                reply = {"error": worker.submit(validation_error, request["grammar"]).result()}
        except Exception as e:  # noqa: BLE001 - any failure is that grammar's answer
            reply = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
