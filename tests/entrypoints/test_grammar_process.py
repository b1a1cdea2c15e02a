"""GrammarProcess: the API server's grammar validation in child processes, killed at the timeout (the compile
stops using CPU), surviving a crash, and small grammars never queued behind a big one."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import llguidance
import pytest

from pagedllm.entrypoints.openai.grammar_process import GrammarProcess, GrammarProcessError, GrammarValidator

pytestmark = pytest.mark.slow  # starts child processes

SMALL = llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"')
BIG = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(f"option number {i}")
                                                                     for i in range(100_000)))
"""~2.4 MB: tens of seconds to validate (past the choice bound, sent here directly)."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def _gone(pid: int) -> bool:
    for _ in range(100):  # the loop reaps it
        if not _alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


def test_a_timed_out_compile_is_killed_and_a_crash_fails_one_request():
    async def scenario():
        process = GrammarProcess()
        try:
            assert await process.validate(SMALL, timeout_s=30.0) == ""
            assert "unknown name" in await process.validate('{"grammars": [{"lark_grammar": "start: x"}]}', 30.0)
            child = process.pid
            with pytest.raises(GrammarProcessError, match="longer than 0.3 s"):
                await process.validate(BIG, timeout_s=0.3)
            assert process.pid is None and await _gone(child)  # killed, not left compiling
            assert await process.validate(SMALL, timeout_s=30.0) == ""  # a fresh child

            crashing = asyncio.ensure_future(process.validate(BIG, timeout_s=30.0))
            while process.pid is None:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # compiling (or still reading the grammar: a dead child is a crash either way)
            os.kill(process.pid, signal.SIGSEGV)  # as a native stack overflow ends it
            with pytest.raises(GrammarProcessError, match="crashed"):
                await crashing
            assert await process.validate(SMALL, timeout_s=30.0) == ""

            child = process.pid
            cancelled = asyncio.ensure_future(process.validate(BIG, timeout_s=30.0))
            await asyncio.sleep(0.2)
            cancelled.cancel()  # the client left: the compile stops too
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert await _gone(child)
        finally:
            process.close()
            await asyncio.sleep(0.1)

    asyncio.run(scenario())


def test_a_small_grammar_does_not_wait_behind_big_ones():
    async def scenario():
        validator = GrammarValidator()
        try:
            big = [asyncio.ensure_future(validator.validate(BIG, timeout_s=60.0)) for _ in range(3)]
            small = await asyncio.gather(*(validator.validate(SMALL, timeout_s=60.0) for _ in range(5)))
            assert small == [""] * 5
            assert not any(task.done() for task in big)  # still compiling the first, the others queued
            child = validator.big.pid
            for task in big:
                task.cancel()
            await asyncio.gather(*big, return_exceptions=True)
            assert await _gone(child)
        finally:
            validator.close()
            await asyncio.sleep(0.1)

    asyncio.run(scenario())
