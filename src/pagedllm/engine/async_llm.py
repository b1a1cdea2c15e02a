"""AsyncLLM: the API server's engine frontend, over an engine-core process.

`add_request` validates, sends the request and returns an async iterator of RequestOutputs fed by one
output handler per engine step (detokenize, stop strings, n > 1 aggregation, stats). Leaving the iterator
early (client disconnect, cancellation) aborts the request in the engine at once. When the engine dies,
every open iterator raises EngineDeadError. With data parallelism, the death of any replica is the death of the
whole server (fail fast, as one engine and as vLLM's data-parallel engines): every open request on every replica
fails, the live replicas abort theirs, the dead replica's gauges are removed from /metrics, and `on_death` stops
the server, which exits non-zero so that its orchestrator restarts it.

A consumer that stops taking its outputs (a client that no longer reads its stream) costs only its own
request: past `max_buffered_outputs` outputs waiting for it, the request is aborted in the engine (its blocks
freed) and the consumer, if it ever reads again, gets RequestAbortedError after what was waiting. Liveness is
the engine's, never a consumer's: the hang watchdog counts only while the engine core holds unfinished
requests, and /health asks the engine core's input thread, which answers during a long step.

Admission control (--max-num-queued-reqs) admits or refuses a whole request, before tokenization and again
just before it is sent; the engine core never refuses part of an admitted one. The cap counts what
vllm:num_requests_waiting counts: engine requests, one per choice per prompt, so a request with n=16 (or 16
prompts) needs 16 places. `check_admission` estimates the waiting queue as the engine requests not finished
(sent, in flight, or n > 1 children not yet sent) less those running at the latest scheduler stats.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from pagedllm.core.scheduler import QueueFullError
from pagedllm.engine.core_client import EngineCoreClient, EngineDeadError
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine.input_processor import InputProcessor, InvalidRequestError
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.utility_calls import UtilityCalls
from pagedllm.messages import (
    EngineCoreRequest,
    FromEngine,
    LoRARequest,
    Outputs,
    Ready,
    Rejected,
    SchedulerStats,
    UtilityResult,
)
from pagedllm.metrics.loggers import IterationStats, LoggingStatLogger, RequestStatsTracker
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.tracing import RequestTrace, RequestTracer, current_request_trace
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine finished a request with an error (finish_reason "error"); `code`: its kind (None: a failure;
    messages.SLO_UNATTAINABLE: shed by --scheduling-policy slo)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class RequestAbortedError(RuntimeError):
    """The server aborted the request (e.g. the drain timeout passed at shutdown)."""


class AsyncLLM(UtilityCalls):
    def __init__(self, clients: EngineCoreClient | Sequence[EngineCoreClient], tokenizer, model_name: str,
                 max_num_queued_reqs: int | None = None, log_stats: bool = True,
                 watchdog_timeout_s: float | None = None, max_buffered_outputs: int = 4096):
        self.clients = list(clients) if isinstance(clients, list | tuple) else [clients]
        """One engine-core client per data-parallel replica (rank = index)."""
        self.client = self.clients[0]
        self.ready: Ready = self.client.ready
        """Replica 0's READY; every replica loads the same model with the same configuration."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_buffered_outputs = max_buffered_outputs
        ready = self.ready
        num_replicas = len(self.clients)
        self.router = DPRouter(num_replicas, ready.block_size, ready.num_blocks,
                               prefix_caching=ready.cache_config_info.get("enable_prefix_caching") != "False")
        self.input_processor = InputProcessor(ready.limits, getattr(tokenizer, "eos_token_id", None), model_name)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats_tracker = RequestStatsTracker()
        self.prometheus = PrometheusStatLogger(model_name, cache_config_info=ready.cache_config_info,
                                               num_engines=num_replicas)
        self.log_loggers = [LoggingStatLogger(prefix=f"Engine {i:03d}: " if num_replicas > 1 else "")
                            for i in range(num_replicas)] if log_stats else []
        self.scheduler_stats = [SchedulerStats(num_total_blocks=ready.num_blocks, num_free_blocks=ready.num_blocks)
                                for _ in range(num_replicas)]
        """Each replica's latest scheduler stats."""
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._engine_to_request: dict[str, str] = {}
        """Every engine request (child) sent or about to be sent and not finished there -> its request id."""
        self.last_progress_time = [time.monotonic()] * num_replicas
        """Per replica: when it last finished a step (or got work while idle)."""
        self.tracer: RequestTracer | None = None
        """--otlp-traces-endpoint: one span per finished engine request (set by the server)."""
        self._pending_traces: dict[str, tuple[RequestTrace, SamplingParams]] = {}
        """With a tracer: each engine request not yet sent -> its request's trace and parameters."""
        self.num_api_servers = 1
        """How many API servers share the engine cores (--api-server-count; set by the server)."""
        self.on_death: Callable[[str], None] = lambda reason: None
        """Called once, when the first replica dies: the server stops (fail fast)."""
        self._pending_sends: set[asyncio.Future] = set()
        for replica, client in enumerate(self.clients):
            client.on_message = functools.partial(self._on_message, replica)
            client.on_death = functools.partial(self._on_death, replica)
            if client.is_dead:  # died while the other replicas were starting: see run_server
                self.router.mark_dead(replica)
                self.prometheus.remove_engine(replica)
        self._log_task = asyncio.create_task(self._log_loop()) if log_stats else None
        self.watchdog_timeout_s = watchdog_timeout_s
        self._watchdog_task = asyncio.create_task(self._watchdog_loop()) if watchdog_timeout_s else None

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def is_dead(self) -> bool:
        """A replica is dead (the only one, or one of the data-parallel replicas): the server is dead."""
        return any(client.is_dead for client in self.clients)

    @property
    def dead_reason(self) -> str | None:
        """Why the dead replicas died (None while all are alive); prefixed with each one's rank when data-parallel."""
        if len(self.clients) == 1:
            return self.client.dead_reason
        reasons = [f"engine {i}: {c.dead_reason}" for i, c in enumerate(self.clients) if c.is_dead]
        return "; ".join(reasons) or None

    @property
    def num_open_requests(self) -> int:
        return len(self.queues)

    # ---- admission and requests ---------------------------------------------------------------------

    def estimated_num_waiting(self) -> int:
        """With several API servers (--api-server-count), the engine's running requests are not all this server's:
        its own unfinished ones less them may be below what the engine reports waiting, so the larger counts."""
        shared = self.num_api_servers > 1
        return sum(max(0, self.router.num_unfinished(replica) - stats.num_running_reqs,
                       stats.num_waiting_reqs if shared else 0)
                   for replica, stats in enumerate(self.scheduler_stats))

    def check_admission(self, num_seqs: int = 1) -> None:
        """Admit a request of num_seqs engine requests (n times its number of prompts) or raise.

        Raises:
            InvalidRequestError: num_seqs alone is over --max-num-queued-reqs (it could never be admitted).
            QueueFullError: the waiting queue has no room for it now (counted in vllm:admission_rejections).
            EngineDeadError: the engine is gone.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        cap = self.max_num_queued_reqs
        if cap is None:
            return
        if num_seqs > cap:
            raise InvalidRequestError(
                f"This request needs {num_seqs} places in the waiting queue (one per choice per prompt: n times "
                f"the number of prompts), more than the server's --max-num-queued-reqs={cap}, so it can never "
                f"be admitted. Send at most {cap} choices times prompts in one request.", code="too_many_sequences")
        waiting = self.estimated_num_waiting()
        if waiting + num_seqs > cap:
            self.prometheus.record_admission_rejection()
            raise QueueFullError(f"The server is at capacity: {waiting} requests are waiting and this one needs "
                                 f"{num_seqs} (--max-num-queued-reqs={cap}). Retry later.")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, output_kind: OutputKind = "delta", priority: int = 0,
                    cache_salt: str | None = None, pooling_params: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None,
                    kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Validate and send one request (n > 1: its first child); returns its output stream. With pooling_params
        (a pooling server), an embedding request: `params` is unused and the stream yields one
        EmbeddingRequestOutput. lora_request: the adapter it runs with (None: the base model). kv_transfer_params:
        vLLM's, for the KV connector (disaggregated prefill/decode).

        Raises:
            InvalidRequestError: bad prompt or parameters. EngineDeadError: the engine is gone.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if request_id in self.queues:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        arrival_time = time.time()
        requests = fan_out(self.input_processor, self.output_processor, request_id, prompt_token_ids, params, prompt,
                           output_kind, arrival_time, priority, cache_salt, pooling_params, lora_request,
                           kv_transfer_params)
        first = requests[0]  # the prompt exactly as the engine will hash it
        replica = self.router.route([r.request_id for r in requests], first.prompt_token_ids, first.cache_salt)
        if self.router.num_unfinished(replica) == len(requests):  # it was idle: the watchdog counts from now
            self.last_progress_time[replica] = time.monotonic()
        for request in requests:
            self._engine_to_request[request.request_id] = request_id
        if self.tracer is not None:
            trace = current_request_trace.get() or RequestTrace()
            for request in requests:
                self._pending_traces[request.request_id] = (trace, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        self._send_add(requests[0])
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error, getattr(item, "error_code", None))
                yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Forget a request in the frontend and abort it (all its children) in the engine, now.

        A consumer still waiting on its stream gets `error` (default RequestAbortedError)."""
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error or RequestAbortedError("The request was aborted by the server."))
        engine_ids = self.output_processor.abort_requests([request_id])
        self._abort_in_engine(engine_ids)

    def finish_aborted(self, request_id: str) -> None:
        """End an open request now with finish_reason "abort": its consumer gets the text so far as a
        normal last output (a 200, a last chunk and [DONE]), and the engine frees its blocks."""
        queue = self.queues.get(request_id)
        outputs, engine_ids = self.output_processor.finish_requests(request_id, "abort")
        self._abort_in_engine(engine_ids)
        if queue is None:
            return
        for output in outputs:
            queue.put_nowait(output)
        if not any(output.finished for output in outputs):  # nothing to finish it with: fail it instead
            self.queues.pop(request_id, None)
            queue.put_nowait(RequestAbortedError("The request was aborted by the server."))

    def finish_all_aborted(self) -> None:
        """finish_aborted for every open request (the drain timeout at shutdown)."""
        for request_id in list(self.queues):
            self.finish_aborted(request_id)

    def _abort_in_engine(self, engine_ids: list[str]) -> None:
        """Count the engine requests as aborted (metrics) and abort them in their replicas' engine cores."""
        by_replica: dict[int, list[str]] = {}
        for engine_id in engine_ids:
            replica = self._forget(engine_id)
            if replica is not None:
                by_replica.setdefault(replica, []).append(engine_id)
        for replica, ids in by_replica.items():
            stats = IterationStats()
            for engine_id in ids:
                self.stats_tracker.finish(engine_id, "abort", stats)
            self._record(replica, None, stats)
            self._send_abort(replica, ids)

    def _forget(self, engine_id: str) -> int | None:
        """An engine request is over (finished, rejected, aborted, failed to send): drop it from the frontend's
        counts. Returns its replica (None if it was already forgotten)."""
        self._engine_to_request.pop(engine_id, None)
        self._pending_traces.pop(engine_id, None)
        return self.router.release(engine_id)

    # ---- sends that never wait (safe in finally blocks of cancelled tasks) ---------------------------

    def _send_add(self, request: EngineCoreRequest) -> None:
        replica = self.router.replica_of(request.request_id)
        if replica is None:  # aborted before it could be sent
            return
        self.stats_tracker.add(request.request_id, request.arrival_time, len(request.prompt_token_ids),
                               self._pending_traces.pop(request.request_id, None))
        self._track(self.clients[replica].add_request(request), replica, request.request_id)

    def _send_abort(self, replica: int, engine_ids: list[str]) -> None:
        if engine_ids and not self.clients[replica].is_dead:
            self._track(self.clients[replica].abort_requests(engine_ids), replica)

    def _track(self, coro, replica: int, engine_id: str | None = None) -> None:
        task = asyncio.ensure_future(coro)
        self._pending_sends.add(task)
        task.add_done_callback(lambda t: self._send_done(t, replica, engine_id))

    def _send_done(self, task: asyncio.Future, replica: int, engine_id: str | None) -> None:
        """A failed send of a request fails that request (its consumer would otherwise wait forever)."""
        self._pending_sends.discard(task)
        if task.cancelled() or task.exception() is None or self.clients[replica].is_dead:
            return
        logger.error("could not send to the engine core: %r", task.exception())
        request_id = self._engine_to_request.get(engine_id) if engine_id is not None else None
        if request_id is not None:
            self._forget(engine_id)
            self.stats_tracker.finish(engine_id, "error")
            self.abort(request_id, RequestFailedError("The request could not be sent to the engine."))

    # ---- engine messages ------------------------------------------------------------------------------

    def _on_message(self, replica: int, message: FromEngine) -> None:
        if isinstance(message, Outputs):
            self._on_outputs(replica, message)
        elif isinstance(message, Rejected):
            self._on_rejected(message)
        elif isinstance(message, UtilityResult) and message.stats is not None:
            self._set_scheduler_stats(replica, message.stats)
            self._record(replica, message.stats, None)

    def _set_scheduler_stats(self, replica: int, stats: SchedulerStats) -> None:
        self.scheduler_stats[replica] = stats
        self.router.set_running(replica, stats.num_running_reqs)

    def _on_outputs(self, replica: int, message: Outputs) -> None:
        outputs = message.outputs
        self.last_progress_time[replica] = time.monotonic()
        if outputs.scheduler_stats is not None:
            self._set_scheduler_stats(replica, outputs.scheduler_stats)
        stats = self.stats_tracker.update(outputs)
        processed = self.output_processor.process_outputs(outputs)
        for engine_id in processed.reqs_to_abort:  # finished here by a stop string: over for the frontend too
            self.stats_tracker.finish(engine_id, "stop", stats)
            self._forget(engine_id)
        self._send_abort(replica, processed.reqs_to_abort)
        if processed.reqs_failed:  # their output handling raised: failed here alone (vllm:request_success "error")
            failed_in_engine = []
            for engine_id in processed.reqs_failed:
                self.stats_tracker.finish(engine_id, "error", stats)
                if self._forget(engine_id) is not None:
                    failed_in_engine.append(engine_id)
            self._send_abort(replica, failed_in_engine)
        for request in processed.reqs_to_add:
            self._send_add(request)
        for output in outputs.outputs:
            if output.finished:
                self._forget(output.request_id)
        for request_output in processed.request_outputs:
            queue = self.queues.get(request_output.request_id)
            if queue is None:
                continue
            if queue.qsize() >= self.max_buffered_outputs:
                self._abort_stalled(request_output.request_id)
            else:
                queue.put_nowait(request_output)
        self._record(replica, outputs.scheduler_stats, stats)

    def _abort_stalled(self, request_id: str) -> None:
        """The consumer has not taken its outputs (its client stopped reading): abort the request."""
        logger.warning("aborting request %s: its client is not reading its stream (%d outputs waiting)",
                       request_id, self.max_buffered_outputs)
        self.abort(request_id, RequestAbortedError(
            f"The request was aborted: its client did not read {self.max_buffered_outputs} waiting outputs."))

    def _on_rejected(self, message: Rejected) -> None:
        request_id = self._engine_to_request.get(message.request_id)
        self._forget(message.request_id)
        self.stats_tracker.finish(message.request_id, "abort")
        if request_id is None:
            return
        if message.code == "queue_full":
            self.prometheus.record_admission_rejection()
            error: Exception = QueueFullError(message.message)
        else:
            error = InvalidRequestError(message.message)
        self.abort(request_id, error)

    def _on_death(self, replica: int, reason: str) -> None:
        """A replica died, so the server is dead (fail fast): every open request ends with EngineDeadError, those
        on live replicas are aborted there, the dead replica's gauges leave /metrics (they would stay at their
        last values) and on_death stops the server. A later replica's death (while stopping) changes nothing."""
        first = all(r.alive for r in self.router.replicas)
        self.router.mark_dead(replica)
        self.prometheus.remove_engine(replica)
        self.scheduler_stats[replica] = SchedulerStats()
        if self.log_loggers:
            self.log_loggers[replica].record(self.scheduler_stats[replica], None)
        if not first:
            return
        error = EngineDeadError(self.dead_reason if len(self.clients) > 1 else reason)
        open_requests = list(self.queues)
        for request_id in open_requests:
            self.abort(request_id, error)
        if len(self.clients) > 1:
            logger.error("engine %d is dead, so the server is (data parallelism fails fast): %d open requests "
                         "failed; the other replicas stop when it exits", replica, len(open_requests))
        self.on_death(reason)

    def _record(self, replica: int, scheduler_stats: SchedulerStats | None, stats: IterationStats | None) -> None:
        self.prometheus.record(scheduler_stats, stats, engine=replica)
        if self.tracer is not None and stats is not None:
            for finished in stats.finished_requests:
                if finished.trace is not None:
                    trace, params = finished.trace
                    self.tracer.record(trace, params, finished)
        if self.log_loggers:
            self.log_loggers[replica].record(scheduler_stats, stats)

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_loggers[0].interval_s)
            for log_logger in self.log_loggers:
                log_logger.log()

    async def _watchdog_loop(self) -> None:
        """A hung engine core (unfinished requests in it, no step finished for watchdog_timeout_s) is treated
        as dead: every open request fails at once instead of waiting forever, and /health answers 503.
        Requests the engine has finished do not count, however slowly their clients read."""
        timeout_s = self.watchdog_timeout_s
        while not self.is_dead:
            await asyncio.sleep(min(0.5, timeout_s / 4))
            if self.sleeping:  # no step runs while the engines sleep (utility_calls.py)
                continue
            for replica, client in enumerate(self.clients):
                stalled_s = time.monotonic() - self.last_progress_time[replica]
                unfinished = self.router.num_unfinished(replica)
                if unfinished and stalled_s > timeout_s and not client.is_dead:
                    client.mark_dead(f"engine core hung: no step finished for {stalled_s:.1f} s while it held "
                                     f"{unfinished} unfinished requests")

    # ---- health -----------------------------------------------------------------------------------------

    async def check_health(self, timeout_s: float) -> None:
        """Raise if any replica is dead, its process does not answer within timeout_s (stopped, or its IO
        threads stuck), or it has been in one step for longer than the watchdog timeout. A long step alone
        (a long prefill chunk) is not a failure: the engine core's input thread answers during it."""
        if any(client.is_dead for client in self.clients):
            raise EngineDeadError(self.dead_reason)
        await asyncio.gather(*(self._ping(replica, timeout_s) for replica in range(len(self.clients))))

    async def _ping(self, replica: int, timeout_s: float) -> None:
        name = "the engine core" if len(self.clients) == 1 else f"engine core {replica}"
        try:
            result = await self.clients[replica].call_utility("ping", timeout_s)
        except TimeoutError:  # asyncio's carries no message: /health answered just "TimeoutError"
            raise TimeoutError(f"{name} did not answer a health check within {timeout_s:g} s "
                               "(stopped, or its IO threads stuck)") from None
        hang_s = self.watchdog_timeout_s
        if hang_s and result.step_running_s > hang_s:
            raise TimeoutError(f"{name} has been in one step for {result.step_running_s:.0f} s")

    async def debug_stats(self, timeout_s: float = 5.0) -> list[SchedulerStats | None]:
        """Each replica's scheduler stats, asked now (None for a dead replica)."""
        async def ask(client: EngineCoreClient) -> SchedulerStats | None:
            return None if client.is_dead else (await client.call_utility("stats", timeout_s)).stats

        return list(await asyncio.gather(*(ask(client) for client in self.clients)))

    def shutdown(self) -> None:
        for task in (self._log_task, self._watchdog_task, *self._pending_sends):
            if task is not None:
                task.cancel()  # a send still pending is moot: its engine core stops now
        if len(self.clients) > 1:
            for client in self.clients:
                client.request_stop()
        for client in self.clients:
            client.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # the spans still queued are exported now
