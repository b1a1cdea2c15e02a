"""KVConnectorBase: vLLM's KV connector seam (KVConnectorBase_V1), with its names and its split.

One class, built twice: once in the engine core with role SCHEDULER (it decides what to load and save, and
answers core/kv_connector.py's SchedulerConnector calls) and once per worker rank with role WORKER (it moves the
bytes). The scheduler side's plan reaches the workers as a msgpack-able dict (build_connector_meta ->
SchedulerOutput.kv_connector_metadata -> bind_connector_metadata), since the workers may be other processes.

The worker side, per step (worker/kv_connector_step.py calls them, in this order):
    bind_connector_metadata(meta); start_load_kv(); wait_for_layer_load(layer) for each layer;
    <the forward>; save_kv_layer(layer, kv, attn_metadata) for each layer; wait_for_save();
    get_finished(finished_req_ids); get_block_ids_with_load_errors(); get_kv_connector_stats();
    clear_connector_metadata()
pagedllm's native decode step runs every layer in one call, so the per-layer hooks run before (loads) and after
(saves) the whole forward rather than between layers: a connector must not rely on overlapping them with compute.
Each rank's KV tensors are registered once (register_kv_caches): layer name "layers.{i}" (i: the model's layer
index) -> [2 (K, V), num_blocks, block_size, num_kv_heads_of_this_rank, head_dim].
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from pagedllm.messages import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase:
    """The seam. Subclasses override the calls they need; the defaults load nothing and save nothing.

    Args:
        config: the engine's configuration (config.kv_transfer_config is this connector's).
        role: SCHEDULER or WORKER.
        kv_rank: the worker's place: (data-parallel rank, tensor-parallel rank, tensor-parallel size). The
            scheduler side gets its replica's data-parallel rank and ranks 0 and 1.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_rank: tuple[int, int, int] = (0, 0, 1)):
        self.config = config
        self.kv_transfer_config = config.kv_transfer_config
        self.role = role
        self.dp_rank, self.tp_rank, self.tp_size = kv_rank
        self.kv_load_failure_policy = self.kv_transfer_config.kv_load_failure_policy
        self._connector_metadata: dict[str, Any] | None = None

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after the first `num_computed_tokens` (the local prefix hit) this connector can load, and
        whether the load is asynchronous (the request then waits in WAITING_FOR_REMOTE_KVS). None: not known
        yet, ask at a later step."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's block table once its blocks are allocated; its external tokens start right after the
        local hit."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        """The workers' plan for this step (a msgpack-able dict); resets the per-step state."""
        return {}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (or was aborted): (keep its blocks until get_finished reports it sent,
        kv_transfer_params returned to the client)."""
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' report of a step, summed over the ranks."""

    def get_stats(self) -> dict[str, float]:
        """Counters for /metrics (cumulative, by name); {} when none."""
        return {}

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This rank's KV tensors by layer name, after they are allocated; again with {} when sleep mode drops
        them (let go of them) and with the new ones when it allocates them again."""

    def bind_connector_metadata(self, metadata: dict[str, Any] | None) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> dict[str, Any]:
        return self._connector_metadata or {}

    def start_load_kv(self) -> None:
        """Start this step's loads (into the blocks the metadata names) before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's loads for this step are in its KV tensor."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """The layer's KV of this step is in `kv_layer`: start saving what the metadata asks."""

    def wait_for_save(self) -> None:
        """Block until the saves this step started no longer need the pool's blocks as they are now (the next
        step may overwrite them)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose sending ended, requests whose asynchronous load ended) since the last call, on this
        rank. `finished_req_ids`: requests that finished since the last step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (kv_load_failure_policy decides what happens)."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, float]:
        """This rank's counters since the last call (metric name, or "name|label value" for a family of
        kv_transfer/stats.py, -> value; summed over the ranks, handed to the scheduler side's
        update_connector_output)."""
        return {}

    def shutdown(self) -> None:
        """Stop threads, close sockets, detach shared memory."""
