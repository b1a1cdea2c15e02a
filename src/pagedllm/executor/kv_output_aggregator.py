"""KVOutputAggregator: the ranks' KV connector reports summed into one (vLLM's). Each tensor-parallel rank moves
its own KV heads, so a request has finished sending (or loading) only once every rank has said so, possibly in
different steps; a failed block on any rank is failed."""

from __future__ import annotations

from pagedllm.messages import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        """request id -> ranks that have not reported it yet."""

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's reports (one per rank) -> the requests every rank has now finished."""
        result = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            self._count(output.finished_sending, self._sending, result.finished_sending)
            self._count(output.finished_recving, self._recving, result.finished_recving)
            result.invalid_block_ids |= output.invalid_block_ids
            for name, value in output.kv_connector_stats.items():
                result.kv_connector_stats[name] = result.kv_connector_stats.get(name, 0) + value
        return result

    def _count(self, req_ids: set[str], remaining: dict[str, int], done: set[str]) -> None:
        for req_id in req_ids:
            left = remaining.get(req_id, self.world_size) - 1
            if left:
                remaining[req_id] = left
            else:
                remaining.pop(req_id, None)
                done.add(req_id)
