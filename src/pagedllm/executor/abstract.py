"""Executor: what the engine core drives instead of a model runner (vLLM's executor layer).

    EngineCore ──▶ Executor ──▶ Worker(s) ──▶ ModelRunner
                   uni: one Worker in this process (executor/uniproc_executor.py)
                   mp:  one Worker process per rank (executor/multiproc_executor.py)
                   ray: one Ray actor per rank on a Ray cluster (executor/ray_executor.py)

Every rank loads its share of the model and of the KV cache; the pool has as many blocks as the smallest rank
holds; the scheduler output goes to every rank once per step and the sampled tokens come back from the driver rank:
rank 0, or with pipeline parallelism the last stage (which samples).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.messages import ModelRunnerOutput
from pagedllm.models.model_info import ModelInfo
from pagedllm.structured_output.manager import GrammarOutput


class ExecutorDeadError(RuntimeError):
    """A worker died or failed in a way the executor cannot recover from: the engine must stop."""


class StepFuture(Protocol):
    """A submitted step (concurrent.futures.Future has this shape)."""

    def done(self) -> bool:
        """Whether result() would return (or raise) without waiting."""

    def result(self) -> ModelRunnerOutput:
        """The driver rank's output; ExecutorDeadError when a worker is gone."""


class Executor(ABC):
    """Args: config: the engine's configuration; `config.parallel_config` picks the ranks."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_info: ModelInfo
        """The model's facts, from rank 0 (the whole model's: vocabulary, heads before any split)."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; returns the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, grammar: GrammarOutput | None = None,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on every rank (`grammar`: the token bitmask of the rows that sample under a grammar);
        the driver rank's output. Raises ExecutorDeadError when a worker is gone.

        non_block (vLLM's): return at once with a StepFuture; steps run and complete in submission order, so a
        pipeline's stages can work on different steps at the same time (engine/core.py's batch queue)."""

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over ranks."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs (on another thread) when a worker dies between steps (never in-process: there a
        failure raises in the step itself)."""
        self.failure_callback = callback

    @abstractmethod
    def check_health(self) -> None:
        """Raises ExecutorDeadError when a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
