"""UniProcExecutor: one Worker in the engine process (tensor-parallel size 1): a step is a direct method call, so
the in-process path costs what calling the runner cost.

With --async-scheduling the steps run on one thread of their own ("model-step"), so a step submitted with
non_block=True runs while the engine thread schedules the next one and applies the previous one's outputs (torch's
operators and the native kernels release the GIL while they compute). Every call to the worker then goes through
that thread, in submission order, as the worker processes of the mp executor take them."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
        self.step_thread: ThreadPoolExecutor | None = None
        """--async-scheduling: the one thread that runs steps (and every other worker call) in order."""
        if config.scheduler_config.async_scheduling:
            self.step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-step")

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None) -> list[Any]:
        call = getattr(self.driver_worker, method)
        if self.step_thread is not None:  # after the steps in flight, never beside one
            return [self.step_thread.submit(call, *args).result(timeout_s)]
        return [call(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput, grammar: GrammarOutput | None = None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self.step_thread is not None:
            future = self.step_thread.submit(self.driver_worker.execute_model, scheduler_output, grammar)
            return future if non_block else future.result()
        output = self.driver_worker.execute_model(scheduler_output, grammar)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()  # one process runs one step at a time: already done
        future.set_result(output)
        return future

    def check_health(self) -> None:
        self.driver_worker.check_health()

    def shutdown(self) -> None:
        if self.step_thread is not None:
            self.step_thread.shutdown(wait=True, cancel_futures=True)
        self.driver_worker.shutdown()
