"""The executor --distributed-executor-backend names."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor


def create_executor(config: EngineConfig) -> Executor:
    """uni (the default at world size 1: the worker in this process), mp (the default above: a process per rank)
    or ray (an actor per rank on a Ray cluster; ParallelConfig refuses it when Ray is not installed)."""
    backend = config.parallel_config.executor_backend
    if backend == "uni":
        from pagedllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"--distributed-executor-backend {backend} is not yet supported.")
