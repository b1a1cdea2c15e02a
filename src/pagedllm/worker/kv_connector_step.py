"""A step with a KV connector's worker side around it (kv_transfer/base.py gives the order of the calls)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.messages import KVConnectorOutput, ModelRunnerOutput

if TYPE_CHECKING:
    import torch

    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.kv_transfer.base import KVConnectorBase


def layer_kv_caches(kv_caches: list[torch.Tensor], first_layer: int) -> dict[str, torch.Tensor]:
    """This rank's KV tensors by connector layer name ("layers.{i}", i: the model's layer index)."""
    return {f"layers.{first_layer + i}": kv for i, kv in enumerate(kv_caches)}


def run_with_connector(connector: KVConnectorBase, kv_caches: dict[str, torch.Tensor], so: SchedulerOutput,
                       run: Callable[[], ModelRunnerOutput | None]) -> tuple[ModelRunnerOutput | None,
                                                                             KVConnectorOutput]:
    """Loads before `run` (the forward), saves after it; the rank's report of what finished."""
    connector.bind_connector_metadata(so.kv_connector_metadata)
    try:
        connector.start_load_kv()
        for name in kv_caches:
            connector.wait_for_layer_load(name)
        output = run()
        for name, kv in kv_caches.items():
            connector.save_kv_layer(name, kv, None)
        connector.wait_for_save()
        sending, recving = connector.get_finished(so.finished_req_ids)
        report = KVConnectorOutput(finished_sending=sending or set(), finished_recving=recving or set(),
                                   invalid_block_ids=connector.get_block_ids_with_load_errors(),
                                   kv_connector_stats=connector.get_kv_connector_stats())
    finally:
        connector.clear_connector_metadata()
    return output, report
