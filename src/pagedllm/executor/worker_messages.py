"""The messages between the mp executor and its worker processes: msgspec msgpack, never pickle.

    executor ──XPUB ipc://…/broadcast──▶ every worker (SUB): ExecuteModel | RpcCall | Shutdown, encoded once
    executor ◀──PULL ipc://…/results─── every worker (PUSH): WorkerReady | WorkerFailed | StepResult | RpcResult
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.messages import ModelRunnerOutput
from pagedllm.models.model_info import ModelInfo
from pagedllm.structured_output.manager import GrammarOutput


class ExecuteModel(msgspec.Struct, tag="execute", array_like=True):
    scheduler_output: SchedulerOutput
    grammar_rows: dict[str, int] | None = None
    """Structured outputs: request id -> row of the bitmask ([rows, words] int32, sent as its bytes)."""
    grammar_bitmask: bytes | None = None
    grammar_words: int = 0

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput, grammar: GrammarOutput | None) -> ExecuteModel:
        if grammar is None:
            return cls(scheduler_output)
        return cls(scheduler_output, grammar.req_id_to_row, grammar.bitmask.tobytes(), grammar.bitmask.shape[1])

    def grammar(self) -> GrammarOutput | None:
        if self.grammar_rows is None:
            return None
        bitmask = np.frombuffer(self.grammar_bitmask, dtype=np.int32).reshape(-1, self.grammar_words)
        return GrammarOutput(self.grammar_rows, bitmask)


class RpcCall(msgspec.Struct, tag="rpc", array_like=True):
    call_id: int
    method: str  # a public method of worker/worker.py's Worker
    args: list[int | float | str | bool | None] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToWorker = ExecuteModel | RpcCall | Shutdown


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    pid: int
    model_info: ModelInfo | None = None  # rank 0's


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    message: str


class StepResult(msgspec.Struct, tag="step", array_like=True):
    rank: int
    output: ModelRunnerOutput | None = None
    error: str | None = None


class RpcResult(msgspec.Struct, tag="rpc_result", array_like=True):
    rank: int
    call_id: int
    result: Any = None
    error: str | None = None


FromWorker = WorkerReady | WorkerFailed | StepResult | RpcResult
