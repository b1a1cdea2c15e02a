"""ZmqExecutor: the executors whose workers live in other processes, fed over two ZMQ sockets.

    executor ──XPUB broadcast──▶ every worker (executor/worker_proc.py): ExecuteModel | RpcCall | Shutdown
    executor ◀──PULL results─── every worker: WorkerReady | WorkerFailed | StepResult | RpcResult

The scheduler output is encoded once per step (msgspec msgpack, executor/worker_messages.py) and published to
every rank; the driver rank (rank 0, or the last pipeline stage) answers with the sampled tokens. A step may be
submitted without waiting (execute_model(..., non_block=True) returns a PendingStep): with pipeline parallelism
the first stage starts the next step while the later stages finish this one; the answers come in order. The ranks'
tensors move over torch.distributed (gloo on the CPU, NCCL on CUDA), never through the executor.

A subclass says where the sockets are and starts and watches the workers:
    mp  (executor/multiproc_executor.py): one child process per rank on this machine, ipc:// sockets
    ray (executor/ray_executor.py):       one Ray actor per rank on a Ray cluster, tcp:// sockets
Its watcher calls `_fail(reason)` when a worker is gone: the step in progress raises ExecutorDeadError, and
between steps the failure callback wakes the engine, which then stops (the engine-death path of
engine/core_proc.py). A worker that hangs holds the step, which the API server's --engine-hang-timeout watchdog
turns into the same death.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
import weakref
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import check_tensor_parallel_size
from pagedllm.distributed.pipeline_parallel import check_pipeline_parallel_size
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.executor.kv_output_aggregator import KVOutputAggregator
from pagedllm.executor.worker_messages import (
    ExecuteModel,
    FromWorker,
    RpcCall,
    RpcResult,
    Shutdown,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from pagedllm.messages import MAX_MESSAGE_BYTES, ModelRunnerOutput
from pagedllm.models.loader import load_model_info
from pagedllm.structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)

POLL_MS = 50
"""How often a wait for workers looks at whether one died."""
STARTUP_TIMEOUT_S = 600.0


class ZmqExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        pc, mc = config.parallel_config, config.model_config
        self.world_size = pc.world_size
        info = load_model_info(mc)  # metadata only: a size that cannot split the model fails before any process
        check_tensor_parallel_size(pc.tensor_parallel_size, info.num_heads, info.num_kv_heads,
                                   info.intermediate_size)
        check_pipeline_parallel_size(pc.pipeline_parallel_size, info.num_layers)
        self.failure_reason: str | None = None
        self.failure_callback: Callable[[str], None] | None = None
        self._closing = False
        self._call_ids = itertools.count()
        self._pending_steps: deque[PendingStep] = deque()
        """Steps published and not yet answered, oldest first."""
        self.kv_aggregator = KVOutputAggregator(self.world_size) \
            if config.kv_transfer_config is not None and self.world_size > 1 else None
        """With a KV connector every rank answers each step (its connector's report); else the driver alone."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self.ctx = zmq.Context()
        # Stops the workers at shutdown, at garbage collection and at exit; holds no reference to self.
        self._finalizer = weakref.finalize(self, type(self)._stop_workers, *self._make_worker_resources())
        try:
            self._place_workers()
            self.broadcast = self.ctx.socket(zmq.XPUB)
            self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not just the first
            self.broadcast.setsockopt(zmq.SNDHWM, 0)
            self.broadcast.setsockopt(zmq.LINGER, 0)
            broadcast_addr = self._bind(self.broadcast, "broadcast")
            self.results = self.ctx.socket(zmq.PULL)
            self.results.setsockopt(zmq.RCVHWM, 0)
            self.results.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.results.setsockopt(zmq.LINGER, 0)
            result_addr = self._bind(self.results, "results")
            self._start_workers(broadcast_addr, result_addr)
            self._watch_workers()
            self.model_info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ---- what a subclass provides ------------------------------------------------------------------
    def _make_worker_resources(self) -> tuple:
        """Create what `_stop_workers` releases; returns its arguments (the context first, then containers the
        subclass fills later; never self)."""
        return (self.ctx,)

    def _place_workers(self) -> None:
        """Decide where the ranks run, before the sockets exist (Ray: the placement group)."""

    @abstractmethod
    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind `sock`; returns the address the workers connect to."""

    @abstractmethod
    def _start_workers(self, broadcast_addr: str, result_addr: str) -> None:
        """Start one worker per rank (executor/worker_proc.py's run_worker) connected to the two addresses."""

    @abstractmethod
    def _watch_workers(self) -> None:
        """Start watching the workers: `_fail(reason)` as soon as one is gone."""

    @staticmethod
    def _stop_workers(ctx: zmq.Context, *resources) -> None:
        """Stop every worker (Shutdown has been sent if the workers were healthy) and destroy `ctx`."""
        ctx.destroy(linger=0)

    # ---- start -----------------------------------------------------------------------------------
    def _wait_ready(self):
        """Every rank's READY (rank 0 brings the model's facts) and its subscription to the broadcast."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ready: dict[int, WorkerReady] = {}
        subscribed = 0
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.broadcast, zmq.POLLIN)
        while len(ready) < self.world_size or subscribed < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not become ready within {STARTUP_TIMEOUT_S:.0f} s")
            failed = self.failure_reason
            # A worker that exits may have said why first: read what it sent before giving up.
            events = dict(poller.poll(4 * POLL_MS if failed else POLL_MS))
            if self.broadcast in events:
                if self.broadcast.recv()[:1] == b"\x01":
                    subscribed += 1
            if self.results in events:
                message = self._decoder.decode(self.results.recv())
                if isinstance(message, WorkerFailed):
                    raise RuntimeError(f"worker {message.rank} failed to start: {message.message}")
                if isinstance(message, WorkerReady):
                    ready[message.rank] = message
            elif failed is not None:
                raise RuntimeError(f"{failed} while starting (see its log above)")
        return ready[0].model_info

    # ---- calls -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput, grammar: GrammarOutput | None = None,
                      non_block: bool = False) -> ModelRunnerOutput | PendingStep:
        self._publish(ExecuteModel.of(scheduler_output, grammar))
        step = PendingStep(self)
        self._pending_steps.append(step)
        return step if non_block else step.result()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None) -> list[Any]:
        call_id = next(self._call_ids)
        self._publish(RpcCall(call_id, method, list(args)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            message = self._receive(deadline)
            if isinstance(message, StepResult):  # a step submitted before the call (the workers keep the order)
                self._complete_step(message)
            elif isinstance(message, RpcResult) and message.call_id == call_id:
                if message.error is not None:
                    raise RuntimeError(f"worker {message.rank}: {method} failed: {message.error}")
                results[message.rank] = message.result
        return [results[rank] for rank in range(self.world_size)]

    def _collect_one(self) -> None:
        """Wait for the next worker message and hand a step's result to the oldest pending step."""
        message = self._receive(None)
        if isinstance(message, StepResult):
            self._complete_step(message)
        else:
            logger.warning("unexpected %s from worker during a step", type(message).__name__)

    def _complete_step(self, message: StepResult) -> None:
        if not self._pending_steps:
            logger.warning("a step result from worker %d but no step is pending", message.rank)
            return
        if self.kv_aggregator is not None and message.error is None:
            step = next((s for s in self._pending_steps if message.rank not in s.parts), None)
            if step is None:
                logger.warning("a step result from worker %d but no step waits for it", message.rank)
                return
            step.parts[message.rank] = message.output
            if len(step.parts) < self.world_size:
                return
            self._pending_steps.remove(step)
            driver = step.parts[self.world_size - self.config.parallel_config.tensor_parallel_size]
            driver.kv_connector_output = self.kv_aggregator.aggregate(
                [o.kv_connector_output for o in step.parts.values()])
            step.output, step.finished = driver, True
            return
        step = self._pending_steps.popleft()
        if message.error is None:
            step.output = message.output
        elif self.world_size > 1:  # the other ranks may wait in a collective for ever: the engine stops
            step.error = ExecutorDeadError(f"worker {message.rank} failed: {message.error}")
        else:
            step.error = RuntimeError(message.error)
        step.finished = True

    def _publish(self, message) -> None:
        self.check_health()
        self.broadcast.send(self._encoder.encode(message), copy=False)

    def _receive(self, deadline: float | None):
        """The next worker message; ExecutorDeadError as soon as a worker is gone, TimeoutError past deadline."""
        while not self.results.poll(POLL_MS):
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the workers did not answer in time")
        return self._decoder.decode(self.results.recv(copy=False).buffer)

    # ---- health ----------------------------------------------------------------------------------
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self.failure_callback = callback
        if self.failure_reason is not None:
            callback(self.failure_reason)

    def _fail(self, reason: str) -> None:
        """A watcher saw a worker go (ignored while shutting down, and after the first failure)."""
        if self._closing or self.failure_reason is not None:
            return
        self.failure_reason = reason
        logger.error("%s", reason)
        if self.failure_callback is not None:
            self.failure_callback(reason)

    def check_health(self) -> None:
        if self.failure_reason is not None:
            raise ExecutorDeadError(self.failure_reason)

    # ---- stop ------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            if self.failure_reason is None and hasattr(self, "broadcast"):
                self.broadcast.send(self._encoder.encode(Shutdown()))
        except zmq.ZMQError:
            pass
        if hasattr(self, "_finalizer"):
            self._finalizer()


class PendingStep:
    """A step submitted with non_block=True. The driver rank answers the steps in submission order, so waiting
    for one first completes the older ones; the caller's thread reads the socket (no thread of its own)."""

    def __init__(self, executor: ZmqExecutor):
        self._executor = executor
        self.finished = False
        self.output: ModelRunnerOutput | None = None
        self.error: BaseException | None = None
        self.parts: dict[int, ModelRunnerOutput] = {}
        """With a KV connector and several ranks: each rank's answer, until all are in."""

    def done(self) -> bool:
        executor = self._executor
        while not self.finished and executor.failure_reason is None and executor.results.poll(0):
            executor._collect_one()
        return self.finished or executor.failure_reason is not None

    def result(self) -> ModelRunnerOutput:
        while not self.finished:
            self._executor._collect_one()  # ExecutorDeadError as soon as a worker is gone
        if self.error is not None:
            raise self.error
        return self.output


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for torch.distributed's rendezvous)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_level_name() -> str:
    """The level of pagedllm's logger, for the workers."""
    level = logging.getLevelName(logging.getLogger("pagedllm").getEffectiveLevel())
    return level if isinstance(level, str) else "INFO"
