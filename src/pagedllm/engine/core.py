"""EngineCore: the loop body every frontend drives: schedule -> execute -> update (with pipeline parallelism,
up to pp steps in flight at once, and with --async-scheduling two: step_with_batch_queue).

It owns the Scheduler (and through it the KV cache manager) and the Executor (executor/), which runs the
model on one or more ranks. Only the thread that calls `step()` touches scheduler or KV state. The offline
LLM calls it in-process; the server runs it in its own process (engine/core_proc.py) behind ZMQ sockets.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from pagedllm.config import EngineConfig
from pagedllm.config.pooler import resolve_pooler, runner_type, wrong_runner_message
from pagedllm.core.async_scheduler import AsyncScheduler
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.kv_event_publisher import create_kv_event_publisher
from pagedllm.engine.sleep_mode import SleepMode
from pagedllm.executor.abstract import ExecutorDeadError, StepFuture
from pagedllm.executor.factory import create_executor
from pagedllm.kv_transfer.base import KVConnectorRole
from pagedllm.kv_transfer.factory import create_kv_connector
from pagedllm.lora.peft import module_shapes
from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelLimits,
    ModelRunnerOutput,
    SchedulerStats,
)
from pagedllm.models.loader import resolve_model
from pagedllm.models.registry import get_model_class, kv_cache_layout
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer, tokenizer_source
from pagedllm.worker.worker import resolve_max_model_len

logger = logging.getLogger(__name__)

MASK_WAIT_FRACTION = 0.25
"""Structured outputs: before a step, the engine waits for the grammar masks still being computed (on the mask
thread, structured_output/manager.py) at most this fraction of a recent step's model time (MASK_WAIT_MIN_S to
MASK_WAIT_MAX_S); a request whose mask is still not ready then sits the step out, so a costly mask delays the
other requests' steps by at most this much (issue 32). A mask of ~0.1 ms is ready well within it."""
MASK_WAIT_MIN_S = 0.002
MASK_WAIT_MAX_S = 0.05
MASK_IDLE_WAIT_S = 0.05
"""When every request that could run waits for its mask, the engine waits this long at most for one of them
before the loop comes back (to take in new requests and aborts)."""


class EngineCore(SleepMode):
    """Starts the executor (which loads the model on every rank), sizes the KV pool, and runs steps.

    Raises ValueError at construction when the configuration cannot work (e.g. one request of
    max_model_len tokens does not fit in the KV pool: the scheduler's KVCacheManager checks, after the pool's
    size in blocks, tokens and MiB is logged).
    """

    def __init__(self, config: EngineConfig, data_parallel_rank: int = 0):
        """data_parallel_rank: this replica's rank under --data-parallel-size (its KV events carry it and go
        out on the endpoint's port + rank, vLLM's layout)."""
        if config.kv_transfer_config is not None:  # each replica's connector knows its data-parallel rank
            config = dataclasses.replace(config, kv_transfer_config=dataclasses.replace(
                config.kv_transfer_config, kv_rank=data_parallel_rank))
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        start = time.perf_counter()
        self.resolved_model = resolve_model(mc)
        self.executor = create_executor(config)
        try:
            info = self.model_info = self.executor.model_info
            self.max_model_len = resolve_max_model_len(mc.max_model_len, info.max_position_embeddings)
            """The one resolved value: the scheduler, the runner and the frontend (ModelLimits) all get it from here."""
            self.num_blocks = self._determine_num_blocks()
            kec = config.kv_events_config
            # Before the KV cache is allocated: the scheduler refuses a pool that cannot hold one longest request.
            pp_size = config.parallel_config.pipeline_parallel_size
            scheduler_cls = AsyncScheduler if sc.async_scheduling else Scheduler
            layout = kv_cache_layout(info, sc.disable_hybrid_kv_cache_manager)
            tp_size = config.parallel_config.tensor_parallel_size
            self.kv_connector = create_kv_connector(config, KVConnectorRole.SCHEDULER,
                                                    (data_parallel_rank, 0, tp_size))
            """The KV connector's scheduler side (kv_transfer/); None without --kv-transfer-config."""
            if self.kv_connector is not None and layout.num_groups > 1:
                raise ValueError(f"{info.architecture} has {layout.num_groups} KV cache groups (sliding-window "
                                 "layers): a KV connector moves one block table's blocks; not supported yet.")
            self.scheduler = scheduler_cls(sc, cc, self.num_blocks, self.max_model_len, config.speculative_config,
                                           enable_kv_cache_events=kec is not None and kec.enable_kv_cache_events,
                                           pipeline_parallel=pp_size > 1,
                                           kv_cache_layout=layout,
                                           max_loras=config.lora_config.max_loras if config.lora_config.enable_lora
                                           else None, kv_connector=self.kv_connector)
            self.async_scheduling = sc.async_scheduling
            self.batch_queue_size = 2 if self.async_scheduling else pp_size
            """Steps kept in flight (vLLM's batch queue): one per pipeline stage, so every stage has work; with
            --async-scheduling two: step N+1 is scheduled and submitted before step N's outputs are applied."""
            self.batch_queue: deque[tuple[StepFuture, SchedulerOutput]] = deque()
            """Submitted steps not yet applied, oldest first (pipeline parallelism or async scheduling only)."""
            self.max_batch_queue_depth = 0
            """The most steps in flight at once so far (tests and diagnostics)."""
            self._submitted_at: dict[int, float] = {}  # step_id -> perf_counter at submission (batch queue)
            self._last_result_at = 0.0
            self.step_seconds = 0.0
            """A moving average of the model's time per step (the mask wait's budget is a fraction of it)."""
            self.executor.initialize_kv_cache(self.num_blocks)
            if cc.kv_scales_calculated:
                self.executor.collective_rpc("calculate_kv_scales")
            self.kv_event_publisher = create_kv_event_publisher(kec, data_parallel_rank)
            """None unless --kv-events-config enables events (then step() publishes one batch per step with events)."""
            if self.kv_event_publisher is not None and not cc.enable_prefix_caching:
                logger.warning("KV cache events are on but prefix caching is off: no block is ever cached, so "
                               "none will be published.")
        except BaseException:
            self.executor.shutdown()
            raise
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config, self._load_tokenizer, self.vocab_size)
        model_dir = str(self.resolved_model.path) if self.resolved_model.kind == "hf" else None
        self.runner_type = runner_type(mc.runner, mc.convert, model_dir)
        """generate or pooling (--runner resolved): a request of the other kind is refused."""
        self.pooler = (resolve_pooler(mc.pooler, model_dir, info.hf_config, info.hidden_size)
                       if self.runner_type == "pooling" else None)
        pc = config.parallel_config
        logger.info("EngineCore ready in %.1f s: %s, %s executor, tensor-parallel size %d, pipeline-parallel "
                    "size %d", time.perf_counter() - start, self.resolved_model.path, pc.executor_backend,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size)

    @property
    def runner(self):
        """The in-process ModelRunner (uni executor only; tests and fault injection reach it here)."""
        return self.executor.driver_worker.model_runner

    # ---- facts the frontend needs ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    def model_limits(self) -> ModelLimits:
        eos_ids = list(self.model_info.eos_token_ids)
        so_config = self.config.structured_outputs_config
        return ModelLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           eos_token_id=eos_ids[0] if eos_ids else None, extra_stop_token_ids=eos_ids[1:],
                           generation_defaults=self._generation_defaults(),
                           max_tokens_cap=self._max_tokens_cap(),
                           max_logprobs=self.config.model_config.max_logprobs,
                           logprobs_are_logits=self.config.model_config.logprobs_mode.endswith("logits"),
                           grammar_compile_timeout_s=so_config.compile_timeout_s,
                           priority_scheduling=self.config.scheduler_config.scheduling_policy in ("priority", "slo"),
                           slo_scheduling=self.config.scheduler_config.scheduling_policy == "slo",
                           json_disable_any_whitespace=so_config.disable_any_whitespace,
                           json_disable_additional_properties=so_config.disable_additional_properties,
                           runner_type=self.runner_type, pooler=self.pooler, **self._lora_limits())

    def _lora_limits(self) -> dict:
        """ModelLimits' LoRA fields (--enable-lora): the rank cap and the target modules' shapes."""
        lc = self.config.lora_config
        if not lc.enable_lora:
            return {}
        family = get_model_class(self.model_info.architecture, self.resolved_model.path)
        dense = all(family.moe_options(self.model_info, i) is None for i in range(self.model_info.num_layers))
        return {"max_lora_rank": lc.max_lora_rank, "num_layers": self.model_info.num_layers,
                "lora_module_shapes": module_shapes(self.model_info, dense_mlp=dense)}

    def cache_config_info(self) -> dict[str, str]:
        """The labels of vLLM's `vllm:cache_config_info` gauge (its CacheConfig's names, values as strings): the
        pool's token capacity is num_gpu_blocks * block_size."""
        cc = self.config.cache_config
        return {"block_size": str(cc.block_size), "cache_dtype": cc.kv_cache_dtype,
                "enable_prefix_caching": str(cc.enable_prefix_caching),
                "calculate_kv_scales": str(cc.kv_scales_calculated),
                "gpu_memory_utilization": str(cc.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(cc.kv_cache_memory), "num_gpu_blocks": str(self.num_blocks),
                "num_gpu_blocks_override": str(cc.num_gpu_blocks_override)}

    def _generation_defaults(self) -> dict:
        return dict(self.model_info.generation_config or {})  # the loader honours --generation-config

    def _max_tokens_cap(self) -> int | None:
        if self.config.model_config.generation_config in ("auto", "vllm"):
            return None
        cap = self._generation_defaults().get("max_new_tokens")
        return int(cap) if isinstance(cap, int) and cap > 0 else None

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request. Raises QueueFullError when the waiting queue is at its cap."""
        if (request.pooling_params is not None) != (self.runner_type == "pooling"):
            raise ValueError(wrong_runner_message(self.runner_type))
        req = Request.from_engine_core_request(request, self.config.cache_config.block_size)
        if request.sampling_params.structured_outputs is not None:
            req.structured_output_request = self.structured_output_manager.add_request(
                request.sampling_params.structured_outputs)
            req.status = RequestStatus.WAITING_FOR_FSM
        self.scheduler.add_request(req)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or steps still in flight (whose outputs step() must still collect). While asleep
        (sleep_mode.py), False: the requests that arrive wait for wake_up, and the busy loop idles."""
        if self.paused:
            return False
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once. With nothing to run, returns outputs with stats only.

        With pipeline parallelism, step_with_batch_queue instead: one call submits a step or applies the oldest.
        The errors of requests --scheduling-policy slo shed while scheduling go out first."""
        outputs = self._step()
        if self.scheduler.shed_outputs:
            outputs.outputs[:0], self.scheduler.shed_outputs = self.scheduler.shed_outputs, []
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if self.paused:  # asleep: nothing runs (sleep_mode.py)
            return EngineCoreOutputs(scheduler_stats=self.make_stats(), timestamp=time.time())
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time())
        scheduler_output = self._schedule()
        try:
            grammar = self.structured_output_manager.grammar_bitmask(self.scheduler.requests, scheduler_output)
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output, grammar)
            seconds = time.perf_counter() - start
            if scheduler_output.num_scheduled_tokens:
                self.step_seconds = seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds
                if self.scheduler.slo:  # the throughput its prefill estimates use (core/slo_queue.py)
                    self.scheduler.waiting.observe_step(scheduler_output.total_num_scheduled_tokens, seconds,
                                                        len(scheduler_output.num_scheduled_tokens))
            if self.scheduler.verify_cost is not None:  # the speculation guard's measure of a draft's cost
                self.scheduler.verify_cost.observe(scheduler_output.num_scheduled_tokens,
                                                   scheduler_output.scheduled_spec_decode_tokens, seconds)
        except ExecutorDeadError:
            raise  # a worker is gone: the engine stops (engine/core_proc.py reports it)
        except Exception:
            return self._step_failed(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def _schedule(self) -> SchedulerOutput:
        """scheduler.schedule(), after waiting (a bounded time) for the masks being computed; when it schedules
        nothing, waits a little for what it waits for (a grammar's compile, a mask) instead of spinning."""
        masks = self.structured_output_manager
        masks.wait_for_masks(self._mask_wait_s())
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.num_scheduled_tokens:
            if self.scheduler.num_waiting_for_mask:  # every request that could run waits for its mask
                masks.wait_for_masks(MASK_IDLE_WAIT_S, any_one=True)
            elif self.scheduler.waiting or self.kv_connector is not None:
                time.sleep(0.001)  # e.g. a grammar compiles, a KV load is in flight: no busy spin meanwhile
        return scheduler_output

    def _mask_wait_s(self) -> float:
        return min(max(MASK_WAIT_FRACTION * self.step_seconds, MASK_WAIT_MIN_S), MASK_WAIT_MAX_S)

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.scheduler_stats = self.make_stats()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """vLLM's batch queue: while fewer than pp steps are in flight and something can be scheduled, schedule
        and submit without waiting (stats-only outputs), so stage 0 starts step N+1 while stage 1 runs step N;
        otherwise (queue full, nothing schedulable: e.g. every running decode waits for its token) wait for the
        oldest step and apply it. Outputs are applied in submission order.

        --async-scheduling (two in flight): each call schedules and submits step N+1 (its decodes counting the
        tokens step N samples as placeholders, core/async_scheduler.py), then waits for step N and applies it
        while N+1 runs. While a constrained request waits for a token in flight, its next mask needs that token:
        the call applies the oldest step first instead (those batches step synchronously)."""
        queue = self.batch_queue
        submitted = False
        if (self.scheduler.has_unfinished_requests() and len(queue) < self.batch_queue_size
                and not (queue and self.async_scheduling and self.scheduler.has_pending_grammar_tokens())):
            self.structured_output_manager.wait_for_masks(self._mask_wait_s())  # see _schedule
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.num_scheduled_tokens and self.scheduler.num_waiting_for_mask and not queue:
                self.structured_output_manager.wait_for_masks(MASK_IDLE_WAIT_S, any_one=True)
            if scheduler_output.num_scheduled_tokens or scheduler_output.preempted_req_ids:
                try:
                    grammar = self.structured_output_manager.grammar_bitmask(self.scheduler.requests,
                                                                             scheduler_output)
                    future = self.executor.execute_model(scheduler_output, grammar, non_block=True)
                except ExecutorDeadError:
                    raise
                except Exception:
                    return self._step_failed(scheduler_output)
                queue.append((future, scheduler_output))
                self._submitted_at[scheduler_output.step_id] = time.perf_counter()
                self.max_batch_queue_depth = max(self.max_batch_queue_depth, len(queue))
                submitted = bool(scheduler_output.num_scheduled_tokens)
            else:  # nothing ran: the next step tells the workers what finished meanwhile
                self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
                if not queue and self.scheduler.waiting:
                    time.sleep(0.001)  # e.g. every request waits for its grammar: no busy spin while it compiles
        if not queue or (submitted and len(queue) < self.batch_queue_size and not queue[0][0].done()):
            return EngineCoreOutputs(scheduler_stats=self.make_stats(), timestamp=time.time())
        future, scheduler_output = queue.popleft()
        try:
            runner_output = future.result()
        except ExecutorDeadError:
            raise
        except Exception:
            return self._step_failed(scheduler_output)
        self._observe_pipelined_step(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def _observe_pipelined_step(self, scheduler_output: SchedulerOutput) -> None:
        """--scheduling-policy slo's step-time measure with steps in flight: from the later of the step's submission
        and the previous step's result to its own result (the pipeline's time per step)."""
        now, submitted = time.perf_counter(), self._submitted_at.pop(scheduler_output.step_id, None)
        if self.scheduler.slo and submitted is not None and scheduler_output.total_num_scheduled_tokens:
            self.scheduler.waiting.observe_step(scheduler_output.total_num_scheduled_tokens,
                                                now - max(submitted, self._last_result_at),
                                                len(scheduler_output.num_scheduled_tokens))
        self._last_result_at = now

    def publish_kv_events(self) -> None:
        """Hand the KV-cache events recorded since the last call to the publisher, as one batch (if any)."""
        events = self.scheduler.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (only when no request holds blocks); AllBlocksCleared goes out at once."""
        done = self.scheduler.reset_prefix_cache()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        return done

    def make_stats(self) -> SchedulerStats:
        """The scheduler's snapshot with the grammar compiles since the last one."""
        stats = self.scheduler.make_stats()
        grammar = self.structured_output_manager.take_stats()
        stats.grammar_compiles_delta = grammar.num_compiles
        stats.grammar_compile_seconds_delta = grammar.compile_seconds
        stats.grammar_cache_hits_delta = grammar.num_cache_hits
        return stats

    def _step_failed(self, scheduler_output: SchedulerOutput) -> EngineCoreOutputs:
        """A step raised (not a dead worker): its requests finish with an error, the engine goes on."""
        logger.exception("model execution failed; failing the %d requests of this step",
                         len(scheduler_output.num_scheduled_tokens))
        return self._fail_requests(list(scheduler_output.num_scheduled_tokens))

    def _fail_requests(self, req_ids: list[str]) -> EngineCoreOutputs:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        outputs = [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                    error="The engine failed while running this request.") for r in req_ids]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.time())

    def wait_kv_cache_resident(self) -> None:
        """Block until the background prefault has faulted the KV pool in on every rank (CPU; a no-op elsewhere)."""
        self.executor.collective_rpc("wait_kv_cache_resident")

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.executor.shutdown()
        if self.kv_connector is not None:  # after the workers: it may be the last user of what they share
            self.kv_connector.shutdown()

    def _load_tokenizer(self):
        return get_tokenizer(tokenizer_source(self.config.model_config, self.resolved_model))

    # ---- sizing ----------------------------------------------------------------------------------
    def _determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        num_blocks = self.executor.determine_num_blocks()
        per_block, kv_dtype = self.executor.collective_rpc("kv_cache_spec")[0]
        num_tokens = num_blocks * cc.block_size
        per_rank = " per rank" if self.config.parallel_config.world_size > 1 else ""
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB%s, %s); maximum concurrency at "
                    "max_model_len %d: %.2fx", num_blocks, cc.block_size, num_tokens,
                    num_blocks * per_block / (1 << 20), per_rank, kv_dtype, self.max_model_len,
                    num_tokens / self.max_model_len)
        return num_blocks
