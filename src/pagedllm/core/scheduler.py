"""Scheduler: vLLM V1 semantics. No prefill or decode phase, a token budget per step.

Each request has num_computed_tokens and num_tokens (prompt + outputs so far); a step decides how many tokens each
request advances. One step (see DESIGN section 4):
  1. running requests, in order, get min(needed, budget left); a failed allocation preempts the lowest-priority,
     latest-arrived running request (recompute; --scheduling-policy slo: core/slo_queue.py) and retries;
  2. only if nothing was preempted, waiting requests in policy order, after a prefix-cache lookup;
  3. update_from_output appends sampled tokens, checks stops, frees finished requests and registers newly full
     blocks in the prefix cache.
Besides the token budget, prefill chunks share an attention budget (max_prefill_attention_pairs): a chunk of T tokens
ending at context L attends T x L (query, key) pairs, so deep into a long prompt its chunks get shorter and no step
runs for long (decodes keep flowing).
num_computed_tokens advances when a step is scheduled (as in vLLM), so the next schedule() may run before the
previous step's update and still see the right positions: with pipeline parallelism up to pp steps are in flight
(engine/core.py). A request in flight is scheduled again only for its next prefill chunk; a decode waits for its
token (not with --async-scheduling: core/async_scheduler.py). Outputs of a request aborted or preempted after its
step was scheduled are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.acceptance_guard import VerifyCost, drafts_to_verify
from pagedllm.core.kv_cache_coordinator import AnyKVCacheManager, make_kv_cache_manager
from pagedllm.core.kv_cache_spec import KVCacheLayout
from pagedllm.core.kv_connector import KVTransferScheduling, SchedulerConnector
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.scheduler_introspection import SchedulerIntrospection
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.slo_queue import shed_unattainable
from pagedllm.core.step_builder import StepBuilder
from pagedllm.core.stop_check import append_and_check_stop, check_stop
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, RoutedTokenCounts

if TYPE_CHECKING:
    from pagedllm.messages import ModelRunnerOutput


class QueueFullError(Exception):
    """The waiting queue holds max_num_queued_reqs requests; the new one is rejected (HTTP 503)."""


class Scheduler(SchedulerIntrospection):
    """Decides, every step, which requests advance by how many tokens, and owns their KV blocks.

    Args:
        scheduler_config: budgets and policy (max_num_seqs, max_num_batched_tokens, ...).
        cache_config: block_size and enable_prefix_caching.
        num_blocks: KV-cache blocks in the pool.
        max_model_len: longest prompt + output (EngineCore.max_model_len, resolved once from the model).
        speculative_config: speculative decoding (None: off). The runner proposes drafts; the scheduler verifies
            those that fit and pay (core/acceptance_guard.py) and rolls back over the rejected ones.
        enable_kv_cache_events: record prefix-cache events (core/kv_events.py) for kv_cache_manager.take_events().
        pipeline_parallel: send the running requests' sampled tokens in the step (CachedRequestData.new_token_ids)
            for the stages before the last, which do not sample.
        kv_cache_layout: the model's KV cache groups (core/kv_cache_spec.py); with a sliding window, the hybrid
            manager (core/kv_cache_coordinator.py) keeps a block table per group. None: one full-attention group.

    Raises ValueError when one request of max_model_len tokens cannot fit the pool (KVCacheManager) or,
    without chunked prefill, a step.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, speculative_config: SpeculativeConfig | None = None,
                 enable_kv_cache_events: bool = False, pipeline_parallel: bool = False,
                 kv_cache_layout: KVCacheLayout | None = None, max_loras: int | None = None,
                 kv_connector: SchedulerConnector | None = None):
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_loras = max_loras  # distinct LoRA adapters in one step (None: LoRA off)
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        pairs = scheduler_config.max_prefill_attention_pairs
        self.max_prefill_attention_pairs = pairs if pairs > 0 and scheduler_config.enable_chunked_prefill else None
        if (not scheduler_config.enable_chunked_prefill
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill, --max-num-batched-tokens ({self.max_num_batched_tokens}) "
                f"must be at least --max-model-len ({self.max_model_len}) so every prompt fits a step.")
        self.kv_cache_manager: AnyKVCacheManager = make_kv_cache_manager(
            kv_cache_layout, num_blocks, self.block_size, cache_config.enable_prefix_caching, self.max_model_len,
            enable_kv_cache_events, self.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy, scheduler_config.slo_max_wait_s)
        self.slo = scheduler_config.scheduling_policy == "slo"
        self.shed_outputs: list[EngineCoreOutput] = []
        """--scheduling-policy slo: the errors of requests shed since EngineCore.step last took them."""
        self.num_slo_shed = 0
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Finished or aborted since the last schedule(); sent in the next SchedulerOutput."""
        self.num_preemptions = 0
        self.num_waiting_for_mask = 0
        """Requests the last schedule() left out because their grammar's mask was not ready (structured outputs:
        such a request keeps its place and its blocks and joins a later step; see structured_output/request.py)."""
        self.pipeline_parallel = pipeline_parallel
        self.num_steps = 0
        """schedule() calls so far: the next SchedulerOutput's step_id."""
        self._last_stats = (0, 0, 0, 0)  # (queries, hits, preemptions, slo sheds) at the last make_stats()
        self._last_connector_stats: dict[str, float] = {}  # the KV connector's get_stats() then
        self.speculative_config = speculative_config
        self.verify_cost = VerifyCost(speculative_config) if speculative_config else None
        self._spec_stats = self._new_spec_stats()
        self.spec_decoding_totals = self._new_spec_stats()
        """Every draft verified since start (the per-snapshot deltas go out in make_stats)."""
        self.routed_tokens = RoutedTokenCounts()
        """A mixture of experts: tokens routed to each expert since the last make_stats (the runner's counts)."""
        self.kv_transfer = KVTransferScheduling(kv_connector, self.block_size) if kv_connector else None
        """A KV connector's bookkeeping (core/kv_connector.py); None without one."""

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            QueueFullError: max_num_queued_reqs requests are already waiting.
            ValueError: duplicate id, prompt longer than max_model_len, or a different block size.
        """
        cap = self.scheduler_config.max_num_queued_reqs
        if cap is not None and len(self.waiting) >= cap:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (--max-num-queued-reqs={cap}).")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} prompt tokens, "
                             f"more than max_model_len={self.max_model_len}.")
        if request.block_size != self.block_size:
            raise ValueError(f"request hashed with block_size={request.block_size}, the cache uses {self.block_size}.")
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string, error), whatever state they are in.

        Their blocks are freed now; unknown or already finished ids are ignored.

        Args:
            req_ids: one id or several.
            finished_status: a finished status, e.g. RequestStatus.FINISHED_ABORTED.
        """
        if not finished_status.is_finished:
            raise ValueError(f"{finished_status} is not a finished status.")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        removed_running = False
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                removed_running = True
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]

    def _free_request(self, request: Request) -> dict | None:
        """Free a finished request's blocks (unless its KV connector still reads them); its kv_transfer_params."""
        delay, params = False, None
        if self.kv_transfer is not None:
            delay, params = self.kv_transfer.request_finished(request, self.kv_cache_manager.get_block_ids(
                request.request_id))
        if not delay:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return params

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """This step's SchedulerOutput (order: the module docstring); num_computed_tokens already counts it."""
        step = StepBuilder(token_budget=self.max_num_batched_tokens, attention_pairs=self.max_prefill_attention_pairs)
        spec = self.speculative_config
        step.use_spec = spec is not None and (spec.disable_by_batch_size is None
                                              or len(self.running) < spec.disable_by_batch_size)
        self.num_waiting_for_mask = 0
        if self.slo and self.waiting:
            shed_unattainable(self)
        self._schedule_running(step)
        if not step.preempted_reqs:
            self._schedule_waiting(step)
        output = self._make_output(step)
        if self.kv_transfer is not None:
            output.preempted_req_ids |= self.kv_transfer.preempted_ids
            self.kv_transfer.preempted_ids = set()
            output.kv_connector_metadata = self.kv_transfer.connector.build_connector_meta(output)
        output.step_id = self.num_steps
        self.num_steps += 1
        for request in step.running_reqs:
            request.num_computed_tokens += step.num_scheduled_tokens[request.request_id]
        for request in step.new_reqs:
            request.num_computed_tokens += step.num_scheduled_tokens[request.request_id]
        return output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the request still needs, capped by long_prefill_token_threshold (not by budget)."""
        num_new_tokens = len(request.all_token_ids) - num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            return threshold
        return num_new_tokens

    def _schedule_running(self, step: StepBuilder) -> None:
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.scheduler_config.long_prefill_token_threshold
        running = self.running
        scheduled_running = step.running_reqs
        num_scheduled_tokens = step.num_scheduled_tokens
        new_blocks_by_req = step.new_blocks
        token_budget = step.token_budget
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            num_new_tokens = len(request.all_token_ids) + request.num_output_placeholders - request.num_computed_tokens
            if request.num_output_placeholders and self._reaches_limit_in_flight(request):
                num_new_tokens = 0  # --async-scheduling: the steps in flight already take it to its last token
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            prefill = num_new_tokens > 1  # else a decode (its drafts come below)
            if prefill:
                num_new_tokens = step.cap_prefill(request.num_computed_tokens, num_new_tokens)
            if num_new_tokens <= 0:
                i += 1
                continue
            so_request = request.structured_output_request
            if (so_request is not None and request.num_computed_tokens + num_new_tokens >= len(request.all_token_ids)
                    and not so_request.is_mask_ready()):
                self.num_waiting_for_mask += 1  # it would sample without its mask: it sits this step out
                i += 1
                continue
            drafts = None
            if step.use_spec and request.spec_token_ids and num_new_tokens == 1:
                drafts = drafts_to_verify(request, token_budget - 1, self.max_model_len, self.verify_cost)
                num_new_tokens += len(drafts)
            new_blocks = allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim_index = self._select_victim()
                victim = running.pop(victim_index)
                if victim.request_id in num_scheduled_tokens:
                    token_budget += step.unschedule(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                step.preempted_reqs.append(victim)
                if victim is request:
                    break  # it preempted itself; running[i] is now the next request
                new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                scheduled_running.append(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                new_blocks_by_req[request.request_id] = new_blocks
                token_budget -= num_new_tokens
                if drafts:
                    step.spec_tokens[request.request_id] = drafts
                elif prefill:
                    step.count_prefill(request, request.num_computed_tokens, num_new_tokens)
                i += 1
        step.token_budget = token_budget

    def _reaches_limit_in_flight(self, request: Request) -> bool:  # placeholders exist only in AsyncScheduler
        return False

    def _select_victim(self) -> int:
        """Index in self.running of the lowest-priority, latest-arrived request (ties: the later position)."""
        if self.slo:
            return self.waiting.select_victim(self.running)
        priority = self.scheduler_config.scheduling_policy == "priority"
        key = (lambda r: (r.priority, r.arrival_time)) if priority else (lambda r: r.arrival_time)
        best, best_key = 0, key(self.running[0])
        for index in range(1, len(self.running)):
            k = key(self.running[index])
            if k >= best_key:
                best, best_key = index, k
        return best

    def _preempt(self, request: Request) -> None:
        """Recompute mode: drop all KV, start over from the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.preempted_at_step = self.num_steps
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        kv = self.kv_cache_manager
        chunked = self.scheduler_config.enable_chunked_prefill
        waiting_for_fsm = []  # and requests whose LoRA adapter would exceed max_loras this step
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_ready():
                    waiting_for_fsm.append(self.waiting.pop())  # the requests behind it go first
                    continue
                request.status = RequestStatus.WAITING
            if request.structured_output_request is not None and not request.structured_output_request.is_mask_ready():
                self.num_waiting_for_mask += 1
                waiting_for_fsm.append(self.waiting.pop())  # its first mask (computed as it compiled) is not ready
                continue
            if not step.admits_lora(request, self.running, self.max_loras):
                waiting_for_fsm.append(self.waiting.pop())
                continue
            if self.kv_transfer is None:
                computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
                num_external = 0
            else:  # the local hit, then what the KV connector loads (an asynchronous load: the request waits)
                prepared = self.kv_transfer.prepare_waiting(request, self)
                if prepared is None:
                    waiting_for_fsm.append(self.waiting.pop())
                    continue
                computed_blocks, num_computed_tokens, num_external = prepared
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens + num_external)
            if not chunked and num_new_tokens > step.token_budget:
                break  # the prompt waits until it fits a step whole
            num_new_tokens = step.cap_prefill(num_computed_tokens + num_external,
                                              min(num_new_tokens, step.token_budget))
            if num_new_tokens <= 0:
                break  # the step's attention budget is spent
            new_blocks = kv.allocate_slots(request, num_external + num_new_tokens, num_computed_tokens, computed_blocks)
            if new_blocks is None:
                break  # not enough free blocks: wait for running requests to finish
            if self.kv_transfer is not None:
                num_computed_tokens = self.kv_transfer.after_alloc(request, kv, num_computed_tokens, num_external)
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_tokens = num_computed_tokens
            step.new_reqs.append(request)
            step.add(request, num_new_tokens, new_blocks)
            step.count_prefill(request, num_computed_tokens, num_new_tokens)
        for request in reversed(waiting_for_fsm):
            self.waiting.prepend(request)

    def _make_output(self, step: StepBuilder) -> SchedulerOutput:
        get_block_ids = self.kv_cache_manager.get_block_ids
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                eos_token_id=r.eos_token_id,
                block_ids=get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
            )
            for r in step.new_reqs
        ]
        new_blocks = step.new_blocks
        cached = CachedRequestData()
        to_ids = self.kv_cache_manager.new_block_ids
        for r in step.running_reqs:
            blocks = new_blocks[r.request_id]
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(to_ids(blocks) if blocks else [])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if self.pipeline_parallel:
                cached.new_token_ids.append(r.all_token_ids[max(r.num_computed_tokens, r.num_prompt_tokens):])
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            scheduled_spec_decode_tokens=step.spec_tokens,
        )

    # ---- after the step ran ----

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a step's sampled tokens: append, check stops, free finished requests, cache blocks.

        Args:
            scheduler_output: what schedule() returned for this step.
            model_runner_output: the runner's result for it.

        Returns:
            One EngineCoreOutput per request that got tokens, prompt logprobs, or finished.
            scheduler_stats is left unset: the engine core attaches make_stats() when it logs.
        """
        cache_blocks = self.kv_cache_manager.cache_blocks
        block_size = self.block_size
        requests = self.requests
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        max_model_len = self.max_model_len
        running_status = RequestStatus.RUNNING
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        self.routed_tokens.add(model_runner_output.expert_routed_tokens)
        proposals = model_runner_output.spec_token_ids
        pooler_output = model_runner_output.pooler_output
        outputs = []
        kv_output = model_runner_output.kv_connector_output
        if kv_output is not None and self.kv_transfer is not None:
            outputs = self.kv_transfer.update(kv_output, self)  # before the tokens: a failed load voids them
        any_finished = False
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if (request is None or request.status is not running_status
                    or request.preempted_at_step > scheduler_output.step_id):
                continue  # finished (aborted) or preempted since schedule(): its tokens are stale
            num_computed_tokens = request.num_computed_tokens
            start = num_computed_tokens - num_scheduled  # computed before this step
            index = req_id_to_index.get(req_id)
            new_token_ids = sampled_token_ids[index] if index is not None else None
            if new_token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1  # --async-scheduling: the token is known now
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                # Roll back over the rejected drafts before any block is cached: their K/V stays in blocks
                # past num_computed_tokens, which later steps overwrite and the prefix cache never sees.
                num_accepted = max(len(new_token_ids or ()) - 1, 0)
                num_computed_tokens = request.num_computed_tokens = start + 1 + num_accepted
                self._spec_stats.observe(len(drafts), num_accepted)
                self.spec_decoding_totals.observe(len(drafts), num_accepted)
            if request.spec_token_ids and new_token_ids and request.spec_acceptance is not None:
                # The drafts proposed before this step against what it produced, verified or not (the guard's
                # acceptance estimate; the metrics above count verified drafts only).
                request.spec_acceptance.observe(request.spec_token_ids, new_token_ids)
            finished = False
            if not new_token_ids or num_computed_tokens < len(request.all_token_ids):
                new_token_ids = []  # a prefill chunk that did not reach the end samples nothing
            elif request.structured_output_request is not None:
                request.structured_output_request.accept_tokens(new_token_ids)
                new_token_ids = append_and_check_stop(request, new_token_ids, max_model_len)
                finished = request.status is not running_status
            elif len(new_token_ids) == 1:
                request.append_output_token_id(new_token_ids[0])
                finished = check_stop(request, new_token_ids[0], max_model_len)
            else:
                new_token_ids = append_and_check_stop(request, new_token_ids, max_model_len)
                finished = request.status is not running_status
            pooled = pooler_output.get(req_id) if pooler_output else None
            if pooled is not None:  # a pooling request's prompt is computed: it ends with its vector
                request.status, finished = RequestStatus.FINISHED_STOPPED, True
            if proposals is not None and index is not None:
                # The next step's drafts. Under a grammar they are cut at the first token it refuses after the
                # tokens just accepted (vLLM's update_draft_token_ids): the cut ones are never verified nor counted.
                next_drafts = proposals[index]
                if next_drafts and request.structured_output_request is not None and not finished:
                    next_drafts = request.structured_output_request.validate_tokens(next_drafts)
                request.spec_token_ids = next_drafts
            if new_token_ids and not finished and request.structured_output_request is not None:
                request.structured_output_request.prepare_mask(request.spec_token_ids)  # off the busy loop
            if num_computed_tokens // block_size != start // block_size:
                cache_blocks(request, num_computed_tokens)  # this step filled at least one block
            new_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not (new_token_ids or finished or new_prompt_logprobs):
                continue
            new_logprobs = logprobs.get(req_id) if logprobs and new_token_ids else None
            if new_logprobs is not None and len(new_logprobs) > len(new_token_ids):
                new_logprobs = new_logprobs[:len(new_token_ids)]
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.status.finish_reason if finished else None,
                stop_reason=request.stop_reason,
                new_logprobs=new_logprobs,
                new_prompt_logprobs=new_prompt_logprobs,
                num_cached_tokens=request.num_cached_tokens,
                first_scheduled_time=None if request.first_output_sent else request.first_scheduled_time,
                pooled=pooled,
            ))
            request.first_output_sent = True
            if finished:
                any_finished = True
                outputs[-1].kv_transfer_params = self._free_request(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())
