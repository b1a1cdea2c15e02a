"""MultiConnector: several connectors chained (vLLM's), e.g. the offload tier and a P/D connector.

kv_connector_extra_config {"connectors": [{"kv_connector": ..., "kv_role": ..., "kv_connector_extra_config":
{...}}, ...]}. A request loads from the first connector that has tokens for it; every connector sees every save
and every finish. At most one of them may delay freeing a request's blocks (a P/D producer; the offload tier's
saves end within the step), since a request is reported sent once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pagedllm.config.kv_transfer import KVTransferConfig
from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.messages import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput


class MultiConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_rank: tuple[int, int, int] = (0, 0, 1)):
        super().__init__(config, role, kv_rank)
        from pagedllm.kv_transfer.factory import KVConnectorFactory

        specs = self.kv_transfer_config.kv_connector_extra_config.get("connectors")
        if not isinstance(specs, list) or not specs:
            raise ValueError("MultiConnector needs kv_connector_extra_config {\"connectors\": [...]}.")
        base = self.kv_transfer_config
        self.connectors: list[KVConnectorBase] = []
        for spec in specs:
            sub = KVTransferConfig(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                      "kv_connector_extra_config": {}, **spec})
            # without --kv-offloading-size: it made this MultiConnector already, it must not wrap a sub-connector
            cache_config = dataclasses.replace(config.cache_config, kv_offloading_size=None)
            self.connectors.append(KVConnectorFactory.create_connector(
                dataclasses.replace(config, cache_config=cache_config, kv_transfer_config=sub), role, kv_rank))
        self._loader: dict[str, int] = {}
        """request id -> the connector that loads its external tokens."""

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        for index, connector in enumerate(self.connectors):
            num_tokens, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                return None, False
            if num_tokens > 0:
                self._loader[request.request_id] = index
                return num_tokens, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        chosen = self._loader.pop(request.request_id, None)
        for index, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(request, block_ids, num_external_tokens if index == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        return {"metadata": [c.build_connector_meta(scheduler_output) for c in self.connectors]}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delays, params = 0, None
        for connector in self.connectors:
            delay, p = connector.request_finished(request, block_ids)
            delays += delay
            params = params if params is not None else p
        if delays > 1:
            raise RuntimeError("MultiConnector: two connectors delay freeing the same request's blocks.")
        return bool(delays), params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(connector_output)

    def get_stats(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        for connector in self.connectors:
            for name, value in connector.get_stats().items():
                stats[name] = stats.get(name, 0) + value
        return stats

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: dict[str, Any] | None) -> None:
        parts = (metadata or {}).get("metadata") or [None] * len(self.connectors)
        for connector, part in zip(self.connectors, parts, strict=True):
            connector.bind_connector_metadata(part)

    def clear_connector_metadata(self) -> None:
        for connector in self.connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        for connector in self.connectors:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for connector in self.connectors:
            connector.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for connector in self.connectors:
            done_sending, done_recving = connector.get_finished(finished_req_ids)
            sending |= done_sending or set()
            recving |= done_recving or set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for connector in self.connectors:
            errors |= connector.get_block_ids_with_load_errors()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        for connector in self.connectors:
            for name, value in connector.get_kv_connector_stats().items():
                stats[name] = stats.get(name, 0) + value
        return stats

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()
