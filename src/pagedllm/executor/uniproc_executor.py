"""UniProcExecutor: one Worker in the engine process (tensor-parallel size 1): a step is a direct method call, so
the in-process path costs what calling the runner cost."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.messages import ModelRunnerOutput
from pagedllm.structured_output.manager import GrammarOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.driver_worker = Worker(config)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.model_info = self.driver_worker.model_info

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput, grammar: GrammarOutput | None = None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.driver_worker.execute_model(scheduler_output, grammar)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()  # one process runs one step at a time: already done
        future.set_result(output)
        return future

    def check_health(self) -> None:
        self.driver_worker.check_health()

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
