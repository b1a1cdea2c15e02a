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
The child's protocol (JSON lines, a ready line, kills) is json_lines_child.py's.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import weakref

from pagedllm.entrypoints.openai.json_lines_child import JsonLinesChild, serve_json_lines
from pagedllm.structured_output.bounds import SMALL_GRAMMAR_BYTES

MAX_ANSWER_BYTES = 16 << 20


class GrammarProcessError(Exception):
    """The grammar's validation gave no answer (timed out, or the child died); the message says which."""


class GrammarProcess(JsonLinesChild):
    """One child that validates grammars, one at a time, started on first use (and again after a kill)."""

    error = GrammarProcessError
    not_started_message = "The grammar validation process did not start."
    crash_message = "The grammar crashed the compiler."

    def __init__(self):
        super().__init__(__name__, max_answer_bytes=MAX_ANSWER_BYTES)

    def timeout_message(self, timeout_s: float, waited: bool) -> str:
        return (f"The grammar took longer than {timeout_s:g} s to compile"
                + (" (it waited for other large grammars)." if waited else "."))

    async def validate(self, grammar: str, timeout_s: float) -> str:
        """llguidance's validation message of `grammar` ("": valid), within timeout_s of the call (waiting for
        the child included). Raises GrammarProcessError."""
        return (await self.ask({"grammar": grammar}, timeout_s))["error"]


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

    worker = BigStackExecutor("grammar-validate")

    def answer(request: dict) -> dict:
        if "params" in request:
            return worker.submit(prepare, request["params"], request["options"]).result()
        return {"error": worker.submit(validation_error, request["grammar"]).result()}

    # llguidance loaded before the first request's clock runs
    serve_json_lines(answer, warm_up=lambda: worker.submit(validation_error, "").result())


if __name__ == "__main__":
    main()
