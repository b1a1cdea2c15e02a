"""The scheduler's side of a KV connector (vLLM's KV connector seam, kv_transfer/base.py has the whole class).

A connector moves KV blocks between this engine's pool and somewhere else (an offload tier, another instance).
The scheduler asks it, for each waiting request after the local prefix-cache lookup, how many more tokens it can
load (`get_num_new_matched_tokens`), tells it which blocks were allocated for them (`update_state_after_alloc`),
hands the workers its plan once per step (`build_connector_meta`, in SchedulerOutput.kv_connector_metadata) and
asks it, when a request finishes, whether its blocks must outlive it (`request_finished`: a producer's blocks are
read by a consumer later). KVTransferScheduling below is the scheduler's bookkeeping around those calls:

- an asynchronous load keeps the request WAITING_FOR_REMOTE_KVS, holding its blocks, until the workers report it
  in KVConnectorOutput.finished_recving; the step never waits for it;
- blocks whose freeing the connector delays stay allocated until finished_sending names the request (an aborted
  request whose load is in flight also keeps its blocks until the load ends: the workers still write them);
- blocks whose load failed (invalid_block_ids): kv_load_failure_policy "recompute" computes them again (a running
  request is preempted, by recompute, so the tokens of the step that read them are dropped; a loading one
  resumes from its first failed block), "fail" ends the one request with an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.core.request import Request, RequestStatus
from pagedllm.messages import EngineCoreOutput, FinishReason, KVConnectorOutput

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import SchedulerOutput

Scheduler = Any
"""core/scheduler.py's Scheduler (not imported: it imports this module)."""


class SchedulerConnector(Protocol):
    """The scheduler-side calls of a KV connector (kv_transfer/base.py's KVConnectorBase implements them)."""

    kv_load_failure_policy: str

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` (the local prefix hit) the connector can load, and whether it loads
        them asynchronously. None: ask again at a later step (the request waits)."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's whole block table after allocation; the external tokens are the ones right after its
        local hit (their blocks follow the hit's)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        """This step's plan for the workers (a msgpack-able dict); resets the connector's per-step state."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks until finished_sending names the request, kv_transfer_params for the
        client)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' report for a step (after the scheduler's own bookkeeping)."""

    def get_stats(self) -> dict[str, float]:
        """The scheduler side's counters for /metrics (cumulative, kv_transfer/stats.py keys)."""


class KVTransferScheduling:
    """The scheduler's state around a connector. Owned by Scheduler (None without a connector)."""

    def __init__(self, connector: SchedulerConnector, block_size: int):
        self.connector = connector
        self.block_size = block_size
        self.loading: dict[str, Request] = {}
        """Requests whose asynchronous load is in flight (WAITING_FOR_REMOTE_KVS, or finished meanwhile)."""
        self.finished_recving: set[str] = set()
        self.failed_blocks: dict[str, int] = {}
        """A loading request whose load failed -> the index of its first failed block."""
        self.delayed_free: dict[str, Request] = {}
        """Finished requests whose blocks the connector (or a load in flight) still uses."""
        self.preempted_ids: set[str] = set()
        """Requests preempted after a failed load, outside schedule(): the next SchedulerOutput tells the runner."""
        self._resumed: set[str] = set()
        """Requests prepare_waiting admitted after their asynchronous load (after_alloc tells the connector
        nothing new)."""
        self.external_queries = 0
        self.external_hits = 0
        """Tokens asked of the connector (prompt tokens past the local hit) and tokens it supplied (vLLM's
        external prefix cache counters)."""
        self._last_counts: tuple[int, int] = (0, 0)

    def take_external_counts(self) -> tuple[int, int]:
        """(external prefix cache queries, hits) since the last call, for SchedulerStats."""
        counts = (self.external_queries, self.external_hits)
        queries, hits = (now - before for now, before in zip(counts, self._last_counts, strict=True))
        self._last_counts = counts
        return queries, hits

    @property
    def pending(self) -> bool:
        """Transfers still to be reported: the engine keeps stepping (the workers report on steps)."""
        return bool(self.loading or self.delayed_free)

    def prepare_waiting(self, request: Request, scheduler: Scheduler) -> tuple[list, int, int] | None:
        """For the waiting request at the head of the queue: (local prefix hits, tokens they hold, tokens the
        connector loads in the step), or None when it waits this step (its load in flight or just started, or
        the connector cannot tell yet). A request whose load ended holds its blocks: no lookup."""
        kv = scheduler.kv_cache_manager
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self.remote_kvs_ready(request, scheduler):
            return None
        if kv.get_block_ids(request.request_id):
            self._resumed.add(request.request_id)
            return [], request.num_computed_tokens, 0
        computed_blocks, num_local = kv.get_computed_blocks(request)
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external is None:
            return None
        if not load_async:  # the last token is never loaded: its step samples
            return computed_blocks, num_local, max(0, min(num_external, request.num_tokens - 1 - num_local))
        if kv.allocate_slots(request, num_external, num_local, computed_blocks) is None:
            return None
        self._count(request, num_local, num_external)
        self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        request.num_computed_tokens = num_local
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        return None

    def after_alloc(self, request: Request, kv, num_local: int, num_external: int) -> int:
        """A request admitted with `num_external` tokens to load in its step: tell the connector its blocks.
        Returns the tokens computed before the step (local hits + loaded)."""
        if request.request_id in self._resumed:
            self._resumed.discard(request.request_id)
            return num_local  # loaded asynchronously before: the connector was told then
        self._count(request, num_local, num_external)
        self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        return num_local + num_external

    def _count(self, request: Request, num_local: int, num_external: int) -> None:
        if request.num_preemptions == 0:
            self.external_queries += request.num_tokens - num_local
            self.external_hits += num_external

    def remote_kvs_ready(self, request: Request, scheduler: Scheduler) -> bool:
        """A WAITING_FOR_REMOTE_KVS request: False while its load is in flight; when it ended, count its loaded
        tokens computed (all but the last token, at most up to its first failed block), cache them, and make it
        WAITING. A failed load under policy fail was already finished by update()."""
        req_id = request.request_id
        if req_id not in self.finished_recving:
            return False
        self.finished_recving.discard(req_id)
        del self.loading[req_id]
        num_loaded = len(scheduler.kv_cache_manager.get_blocks(req_id)) * self.block_size
        first_failed = self.failed_blocks.pop(req_id, None)
        if first_failed is not None:
            num_loaded = min(num_loaded, first_failed * self.block_size)
        num_computed = min(num_loaded, request.num_tokens - 1)
        if num_computed > request.num_computed_tokens:
            request.num_computed_tokens = num_computed
            scheduler.kv_cache_manager.cache_blocks(request, num_computed)
        request.status = RequestStatus.WAITING
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether the request's blocks must outlive it, and the kv_transfer_params for its last output."""
        delay, params = self.connector.request_finished(request, block_ids)
        if request.request_id in self.loading:
            delay = True  # the workers still write its blocks: freed when the load is reported done
        if delay:
            self.delayed_free[request.request_id] = request
        return delay, params

    def update(self, kv_output: KVConnectorOutput, scheduler: Scheduler) -> list[EngineCoreOutput]:
        """A step's report: free the delayed blocks that are done, note the loads that ended, act on failed loads.
        Returns the outputs of requests failed by kv_load_failure_policy fail."""
        kv = scheduler.kv_cache_manager
        for req_id in kv_output.finished_recving:
            if req_id in self.loading:
                self.finished_recving.add(req_id)
        outputs = self._handle_invalid_blocks(kv_output.invalid_block_ids, scheduler) \
            if kv_output.invalid_block_ids else []
        for req_id in kv_output.finished_sending | kv_output.finished_recving:
            request = self.delayed_free.get(req_id)
            if request is not None and (req_id not in self.loading or req_id in self.finished_recving):
                self.loading.pop(req_id, None)
                self.finished_recving.discard(req_id)
                self.failed_blocks.pop(req_id, None)
                del self.delayed_free[req_id]
                kv.free(request)
        self.connector.update_connector_output(kv_output)
        return outputs

    def _handle_invalid_blocks(self, invalid: set[int], scheduler: Scheduler) -> list[EngineCoreOutput]:
        kv = scheduler.kv_cache_manager
        fail = self.connector.kv_load_failure_policy == "fail"
        outputs = []
        for request in list(scheduler.requests.values()):
            block_ids = kv.get_block_ids(request.request_id)
            bad = [i for i, block_id in enumerate(block_ids) if block_id in invalid]
            if not bad:
                continue
            if fail:
                outputs.append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                    error="the KV connector failed to load this request's KV cache (kv_load_failure_policy fail)."))
                scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            elif request.request_id in self.loading:
                self.failed_blocks[request.request_id] = bad[0]  # resumes from there (remote_kvs_ready)
            elif request.status == RequestStatus.RUNNING:
                scheduler.running.remove(request)
                scheduler._preempt(request)  # recompute: the tokens its step computed read the failed blocks
                self.preempted_ids.add(request.request_id)
        return outputs
