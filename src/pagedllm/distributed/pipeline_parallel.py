"""The pipeline-parallel stage a rank is: its contiguous range of layers, the weights it loads, and the
point-to-point hand-over of the hidden state to the next stage, over torch.distributed (gloo on the CPU, NCCL on
CUDA; the code is the same).

    stage 0: embed + layers [0, a)  ──send (hidden, residual)──▶  stage 1: layers [a, b)  ──▶ … ──▶
    last stage: layers [z, L) + final norm + LM head: samples and returns the tokens to the engine; the stages
    before it learn them from the next step's scheduler output (CachedRequestData.new_token_ids), so no stage ever
    waits for another's sampling and the engine core can keep up to pp steps in flight (its batch queue)

With tensor parallelism too (world = tp x pp), rank = stage * tp + tp_rank: a stage's tensor-parallel ranks form
their own group, and each hands its (replicated) hidden state to the rank of the same tensor-parallel rank in the
next stage (vLLM's layout).

`PipelineParallelGroup.single()` is the one stage of size 1: it holds every layer and never communicates.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.shm_communicator import ShmAllReduce

logger = logging.getLogger(__name__)

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def pipeline_layer_range(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """Stage `rank`'s [start, end) of `num_layers` split over `size` stages as vLLM's get_pp_indices does: as even
    as possible, the extra layers on the stages before the last (which also holds the LM head), from the
    second-to-last backwards (10 layers, 4 stages: 2, 3, 3, 2)."""
    parts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):
        parts[-i] += 1
    start = sum(parts[:rank])
    return start, start + parts[rank]


def check_pipeline_parallel_size(size: int, num_layers: int) -> None:
    """ValueError unless every stage gets at least one layer."""
    if size > num_layers:
        raise ValueError(f"--pipeline-parallel-size {size} is larger than the model's {num_layers} layers; use at "
                         f"most {num_layers}.")


@dataclass(frozen=True)
class PipelineParallelGroup:
    rank: int
    """This stage's index."""
    size: int
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def global_rank(self) -> int:
        return self.rank * self.tp_size + self.tp_rank

    @classmethod
    def single(cls) -> PipelineParallelGroup:
        return cls(0, 1)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        """This stage's [start, end) of the model's `num_layers` layers."""
        return pipeline_layer_range(num_layers, self.rank, self.size)

    def keeps_weight(self, name: str, num_layers: int, tie_word_embeddings: bool) -> bool:
        """Whether this stage loads the checkpoint tensor `name` (Hugging Face names): its layers, the embedding on
        the first stage (and on the last when the LM head is tied to it), the final norm and LM head on the last."""
        if self.size == 1:
            return True
        m = _LAYER_NAME.match(name)
        if m is not None:
            start, end = self.layers(num_layers)
            return start <= int(m.group(1)) < end
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    def weight_filter(self, num_layers: int, tie_word_embeddings: bool) -> Callable[[str], bool]:
        """keeps_weight for this model: the checkpoint readers skip the other tensors before reading them."""
        return lambda name: self.keeps_weight(name, num_layers, tie_word_embeddings)

    # ---- communication -------------------------------------------------------------------------------
    def send_to_next(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand this stage's output, (MLP output, residual stream before it) each [T, hidden], to the next stage."""
        dist.send(torch.stack([hidden_states, residual]), self.global_rank + self.tp_size)

    def recv_from_previous(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden_states, residual), each [num_tokens, hidden_size]."""
        both = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(both, self.global_rank - self.tp_size)
        return both[0], both[1]


def run_stage(model: torch.nn.Module, pp: PipelineParallelGroup, input_ids: torch.Tensor, positions: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor | None:
    """One forward pass of this stage (inside the forward context): the previous stage's output in, this stage's
    out to the next. Returns the hidden states [T, hidden] on the last stage, None on the others."""
    intermediate = None if pp.is_first else pp.recv_from_previous(len(input_ids), model.info.hidden_size, dtype,
                                                                  input_ids.device)
    out = model(input_ids, positions, intermediate)
    if pp.is_last:
        return out
    pp.send_to_next(*out)
    return None


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_pipeline(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                  timeout_s: float = 600.0) -> tuple[TensorParallelGroup, PipelineParallelGroup]:
    """Join the process group of all tp_size x pp_size ranks (every rank calls this; gloo on the CPU, NCCL on
    CUDA) and, above tensor-parallel size 1, every stage's tensor-parallel group (each rank creates them all, in
    the same order, as torch.distributed requires). Returns this rank's tensor-parallel group and stage."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    world_size = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    tp = TensorParallelGroup.single()
    if tp_size > 1:
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        shm = ShmAllReduce.create(groups[stage], tp_rank, tp_size) if device.type == "cpu" else None
        tp = TensorParallelGroup(tp_rank, tp_size, groups[stage], shm)
    logger.info("rank %d of %d joined the %s group: stage %d of %d, tensor-parallel rank %d of %d", rank,
                world_size, backend, stage, pp_size, tp_rank, tp_size)
    return tp, PipelineParallelGroup(stage, pp_size, tp_size, tp_rank)
