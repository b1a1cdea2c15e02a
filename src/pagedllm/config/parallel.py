"""ParallelConfig: how the engine's model is split across processes (tensor, pipeline, expert and data
parallelism); one of the engine configuration's dataclasses (config/engine.py), with one docstring per field."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from pagedllm.config.bounds import PARALLEL_BOUNDS, check_bounds

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
"""Values of --distributed-executor-backend (vLLM's names)."""
RAY_EXTRA_HINT = 'pip install "pagedllm[ray]"'
"""How to get Ray: it is an optional extra (pyproject.toml)."""


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that split every layer's weights (attention heads, MLP columns, vocabulary) and all-reduce after the
    row-parallel layers, over torch.distributed (gloo on the CPU, NCCL on CUDA). Each rank gets its share of the
    CPU threads. Must divide the attention heads, and the KV heads or be a multiple of them."""
    pipeline_parallel_size: int = 1
    """Stages that each hold a contiguous range of the layers (vLLM's split: as even as possible; the embedding on
    the first stage, the final norm and LM head on the last) and their KV cache; the hidden state and residual go
    from stage to stage point to point, the last stage samples. One batch at a time (no batch queue yet).
    Combined with --tensor-parallel-size the world is tp x pp processes (rank = stage * tp + tp rank)."""
    data_parallel_size: int = 1
    """Replicas of the whole engine behind one API server (`pagedllm serve` only): each its own engine-core
    process with its own executor, KV cache (--kv-cache-memory each) and share of the CPU threads. The API server
    sends each request to the replica that holds the longest cached prefix of it, else to the least loaded
    (engine/dp_router.py); metrics carry an `engine` label per replica. The replicas fail together, as one engine
    does and as vLLM's data-parallel engines do: when any replica dies, every open request on every replica fails,
    /health and new requests answer 503, the dead replica's gauges leave /metrics, and after
    --engine-death-exit-delay the server stops the other replicas and exits non-zero, so that its orchestrator
    restarts it whole."""
    enable_expert_parallel: bool = False
    """A mixture-of-experts model's experts split across the tensor-parallel ranks (rank r of n holds experts
    [r * E / n, (r + 1) * E / n) of every layer, whole) instead of each expert's intermediate size; attention stays
    tensor-parallel. Every rank routes the same tokens, runs its own experts on those routed to them, and the
    ranks' partial outputs are summed by the layer's all-reduce. Needs --tensor-parallel-size > 1 dividing the
    number of experts (across --data-parallel-size replicas it is not supported: each replica is an engine of its
    own). A dense model ignores it."""
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    """How the model's workers run: uni (in the engine process; needs tensor-parallel-size 1), mp (one fresh
    process per rank on this machine), ray (one Ray actor per rank, placed on a Ray cluster by a placement group;
    needs the ray extra). Default: uni at size 1, else mp."""
    ray_address: str | None = None
    """The Ray cluster the ray backend joins (ray.init's address: HOST:PORT of the head node's GCS, or auto).
    Default: the RAY_ADDRESS environment variable, else the cluster `ray start` started on this machine, else a
    new local one (vLLM's behaviour; vLLM has no flag and reads RAY_ADDRESS only)."""

    def __post_init__(self) -> None:
        check_bounds(self, PARALLEL_BOUNDS)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got "
                             f"{backend!r}.")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(f"--distributed-executor-backend ray needs Ray, which is not installed: "
                             f"{RAY_EXTRA_HINT} (or use mp: one process per rank on this machine).")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel splits the experts across the tensor-parallel ranks and needs "
                             "--tensor-parallel-size > 1 (expert parallelism across --data-parallel-size replicas "
                             "is not supported).")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one rank in the engine process; "
                             f"--tensor-parallel-size {self.tensor_parallel_size} --pipeline-parallel-size "
                             f"{self.pipeline_parallel_size} needs mp.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs: the one asked for, else uni at world size 1 and mp above."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")
