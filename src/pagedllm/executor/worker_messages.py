"""The messages between the mp executor and its worker processes: msgspec msgpack, never pickle.

    executor ──XPUB ipc://…/broadcast──▶ every worker (SUB): ExecuteModel | RpcCall | Shutdown, encoded once
    executor ◀──PULL ipc://…/results─── every worker (PUSH): WorkerReady | WorkerFailed | StepResult | RpcResult
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.messages import ModelRunnerOutput
from pagedllm.models.model_info import ModelInfo


class ExecuteModel(msgspec.Struct, tag="execute", array_like=True):
    scheduler_output: SchedulerOutput


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
