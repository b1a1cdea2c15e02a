"""MultiprocExecutor: one worker process per rank (tensor-parallel rank or pipeline stage) on this machine.

Each worker is a fresh interpreter (`python -m pagedllm.executor.worker_proc`; never fork: the engine holds torch
and threads), given the configuration as JSON on stdin; the pipe stays open, so a worker exits when the engine
process dies however it dies. The scheduler output is encoded once per step and published to every rank on one
ZMQ socket; the driver rank (rank 0, or the last pipeline stage) answers with the sampled tokens
(executor/worker_messages.py). The ranks' tensors move over torch.distributed (gloo on the CPU, NCCL on CUDA;
on one host the CPU's all-reduces go through shared memory, distributed/shm_communicator.py), never through the
executor.

A worker that exits is noticed at once (a thread waits on each pid): the step in progress raises
ExecutorDeadError, and between steps the failure callback wakes the engine, which then stops (the engine-death
path of engine/core_proc.py). A worker that hangs holds the step, which the API server's --engine-hang-timeout
watchdog turns into the same death.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import check_tensor_parallel_size
from pagedllm.distributed.pipeline_parallel import check_pipeline_parallel_size
from pagedllm.distributed.shm_communicator import remove_leftover_segments
from pagedllm.executor.abstract import Executor, ExecutorDeadError
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


class MultiprocExecutor(Executor):
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
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self.socket_dir = tempfile.mkdtemp(prefix="pagedllm-workers-")  # 0700: only this user connects
        self.ctx = zmq.Context()
        self.procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.ctx, self.socket_dir)
        try:
            self.broadcast = self.ctx.socket(zmq.XPUB)
            self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not just the first
            self.broadcast.setsockopt(zmq.SNDHWM, 0)
            self.broadcast.setsockopt(zmq.LINGER, 0)
            self.broadcast.bind(f"ipc://{self.socket_dir}/broadcast")
            self.results = self.ctx.socket(zmq.PULL)
            self.results.setsockopt(zmq.RCVHWM, 0)
            self.results.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.results.setsockopt(zmq.LINGER, 0)
            self.results.bind(f"ipc://{self.socket_dir}/results")
            self._start_workers()
            self.model_info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"worker-{rank}-watch", daemon=True).start()

    # ---- start -----------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # Each rank gets its share of this process's threads (2 cores, 2 ranks: 1 thread each).
        threads = max(1, torch.get_num_threads() // self.world_size)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        config_line = msgspec.json.encode(self.config) + b"\n"
        level = logging.getLevelName(logging.getLogger("pagedllm").getEffectiveLevel())
        for rank in range(self.world_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.executor.worker_proc", "--rank", str(rank),
                 "--broadcast-addr", f"ipc://{self.socket_dir}/broadcast",
                 "--result-addr", f"ipc://{self.socket_dir}/results", "--distributed-init-method", init_method,
                 "--log-level", level if isinstance(level, str) else "INFO"],
                stdin=subprocess.PIPE, env=env, close_fds=True)
            self.procs.append(proc)
            proc.stdin.write(config_line)
            proc.stdin.flush()
        logger.info("started %d worker processes (%d threads each): pids %s", self.world_size, threads,
                    [p.pid for p in self.procs])

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
            events = dict(poller.poll(POLL_MS))
            if self.broadcast in events:
                if self.broadcast.recv()[:1] == b"\x01":
                    subscribed += 1
            if self.results in events:
                message = self._decoder.decode(self.results.recv())
                if isinstance(message, WorkerFailed):
                    raise RuntimeError(f"worker {message.rank} failed to start: {message.message}")
                if isinstance(message, WorkerReady):
                    ready[message.rank] = message
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None and rank not in ready:
                    raise RuntimeError(f"worker {rank} exited with code {proc.returncode} while starting "
                                       "(see its log above)")
        return ready[0].model_info

    # ---- calls -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        self._publish(ExecuteModel.of(scheduler_output, grammar))
        while True:
            message = self._receive(None)
            if not isinstance(message, StepResult):
                logger.warning("unexpected %s from worker during a step", type(message).__name__)
                continue
            if message.error is not None:
                if self.world_size > 1:  # the other ranks may wait in a collective for ever: the engine stops
                    raise ExecutorDeadError(f"worker {message.rank} failed: {message.error}")
                raise RuntimeError(message.error)
            return message.output

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None) -> list[Any]:
        call_id = next(self._call_ids)
        self._publish(RpcCall(call_id, method, list(args)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            message = self._receive(deadline)
            if isinstance(message, RpcResult) and message.call_id == call_id:
                if message.error is not None:
                    raise RuntimeError(f"worker {message.rank}: {method} failed: {message.error}")
                results[message.rank] = message.result
        return [results[rank] for rank in range(self.world_size)]

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

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing or self.failure_reason is not None:
            return
        self.failure_reason = f"worker {rank} (pid {proc.pid}) exited unexpectedly (exit code {code})"
        logger.error("%s", self.failure_reason)
        if self.failure_callback is not None:
            self.failure_callback(self.failure_reason)

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
        self._finalizer()


def _stop_workers(procs: list[subprocess.Popen], ctx: zmq.Context, socket_dir: str, timeout_s: float = 5.0) -> None:
    """Ask (stdin EOF, SIGTERM), then kill; every worker is waited for. Also runs at garbage collection and exit."""
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("worker pid %d did not exit within %.0f s; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.wait()
    ctx.destroy(linger=0)
    shutil.rmtree(socket_dir, ignore_errors=True)
    remove_leftover_segments(os.getpid())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
