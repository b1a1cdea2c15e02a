"""The engine-core process: EngineCore's busy loop behind two ZMQ sockets.

    API server ──PUSH ipc://…/input──▶ input thread ──queue──▶ main thread: busy loop
    API server ◀─PULL ipc://…/output── output thread ◀──queue── (schedule ▸ execute ▸ update)

Only the main thread touches the scheduler and the KV cache. The IO threads decode and encode msgspec
msgpack, so serialization overlaps the model's forward pass (zmq and msgspec release the GIL). Nothing is
pickled: the configuration arrives as JSON on stdin, every socket message is one of the typed envelopes
of `pagedllm.messages`.

Lifetime: the process exits when the API server dies (stdin reaches EOF: the kernel closes the pipe when
the parent exits, however it exits), on SIGTERM, or when a step raises (after reporting the error).

On exit the process removes its `ipc://` socket files and their directory (if empty), so nothing is left
behind when the API server was killed before it could clean up.

Several API servers (--api-server-count N): the input socket connects to each one's input address (fair-queued:
one batch serves them all) and there is one output socket per API server. Every request and utility call carries
its sender's `client_index`; its outputs, rejection or answer go back on that server's socket. Every step sends
each API server its own outputs (possibly none) and the scheduler's gauges, but the step's counters
(`*_delta`, speculative decoding, routed tokens) only to API server 0, so that summed over the API servers'
metrics they count once. READY and failures go to all of them.

Run as `python -m pagedllm.engine.core_proc --input-addr ADDR --output-addr ADDR` (each given once per API
server) with the EngineConfig as one JSON line on stdin; `EngineCoreClient` (or, with several API servers,
`api_server_manager`) does this.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq
from msgspec.structs import replace

from pagedllm.child_process import exit_after_cleanup, raise_system_exit, remove_ipc_files
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.gc_heap import freeze_gc_heap
from pagedllm.log_escape import escape_control
from pagedllm.messages import (
    MAX_MESSAGE_BYTES,
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    FromEngine,
    Outputs,
    Ready,
    Rejected,
    SchedulerStats,
    StartupFailed,
    ToEngine,
    UtilityCall,
    UtilityResult,
)
from pagedllm.native_thread_name import set_native_thread_name

logger = logging.getLogger(__name__)


@dataclass
class _WorkerDied:
    """Put on the input queue by the executor's failure callback (in this process only, never sent)."""

    reason: str


class EngineCoreProc:
    """Owns an EngineCore and its sockets; `run_busy_loop` runs until shutdown."""

    def __init__(self, engine_core, input_addrs: list[str], output_addrs: list[str]):
        self.engine_core = engine_core
        self.input_queue: queue.Queue[ToEngine] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, FromEngine] | None] = queue.Queue()
        self.num_added = 0
        self.step_started: float | None = None
        """time.monotonic() when the current step began; None between steps (read by the input thread)."""
        self.num_clients = len(output_addrs)
        self.client_of: dict[str, int] = {}
        """With several API servers: each unfinished request's sender."""
        self.ctx = zmq.Context()
        self.input_socket = _connect(self.ctx, zmq.PULL, *input_addrs)
        self.output_sockets = [_connect(self.ctx, zmq.PUSH, addr) for addr in output_addrs]
        threading.Thread(target=self._input_thread, name="engine-input", daemon=True).start()
        # A worker that dies while the loop idles wakes it, and the loop stops the engine.
        engine_core.executor.register_failure_callback(lambda reason: self.input_queue.put(_WorkerDied(reason)))
        self.output_thread = threading.Thread(target=self._output_thread, name="engine-output", daemon=True)
        self.output_thread.start()

    def send(self, message: FromEngine, client: int = -1) -> None:
        """Queue `message` for API server `client` (-1: every one)."""
        self.output_queue.put((client, message))

    def send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """One step's outputs, each to its API server; the scheduler's counters to API server 0 alone."""
        if self.num_clients == 1:
            self.send(Outputs(outputs, self.num_added), 0)
            return
        by_client: list[list] = [[] for _ in range(self.num_clients)]
        for output in outputs.outputs:
            client = self.client_of.pop(output.request_id, 0) if output.finished else \
                self.client_of.get(output.request_id, 0)
            by_client[client].append(output)
        stats = outputs.scheduler_stats
        gauges = None if stats is None else replace(
            stats, prefix_cache_queries_delta=0, prefix_cache_hits_delta=0, num_preemptions_delta=0,
            num_slo_shed_delta=0, spec_decoding_stats=None, grammar_compiles_delta=0, grammar_compile_seconds_delta=0.0,
            grammar_cache_hits_delta=0, expert_routed_tokens_delta=None, kv_connector_stats_delta=None,
            external_prefix_cache_queries_delta=0, external_prefix_cache_hits_delta=0)
        for client, client_outputs in enumerate(by_client):
            self.send(Outputs(EngineCoreOutputs(outputs=client_outputs, scheduler_stats=stats if client == 0 else
                                                gauges, timestamp=outputs.timestamp), self.num_added), client)

    def run_busy_loop(self) -> None:
        """schedule ▸ execute ▸ update while there is work; block on the input queue when idle."""
        while True:
            self._process_input_queue(block=not self.engine_core.has_unfinished_requests())
            if self.engine_core.has_unfinished_requests():
                self.step_started = time.monotonic()
                outputs = self.engine_core.step()
                self.step_started = None
                self.send_outputs(outputs)

    def close(self) -> None:
        """Stop the IO threads, then the context. Each socket is closed by the thread that uses it (zmq
        sockets are not thread-safe: destroying the context under a blocked recv aborts the process)."""
        self.output_queue.put(None)
        self.output_thread.join(timeout=2.0)
        if self.output_thread.is_alive():
            self.ctx.destroy(linger=0)
            return
        for sock in self.output_sockets:
            sock.close(linger=0)
        self.ctx.term()  # the input thread's recv raises ContextTerminated; it closes its socket

    # ---- main thread -------------------------------------------------------------------------------

    def _process_input_queue(self, block: bool) -> None:
        changed = False
        try:
            message = self.input_queue.get(timeout=1.0) if block else self.input_queue.get_nowait()
            while True:
                changed |= self._handle(message)
                message = self.input_queue.get_nowait()
        except queue.Empty:
            pass
        if changed and not self.engine_core.has_unfinished_requests():
            # Idle after aborts: no step will report the freed blocks, so report them now.
            self.send_outputs(EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time()))

    def _handle(self, message: ToEngine | _WorkerDied) -> bool:
        if isinstance(message, _WorkerDied):
            raise ExecutorDeadError(message.reason)
        if isinstance(message, AddRequest):
            return self._add(message.request)
        if isinstance(message, AbortRequests):
            self.engine_core.abort_requests(message.request_ids)
            if self.num_clients > 1:
                for request_id in message.request_ids:
                    self.client_of.pop(request_id, None)
            return True
        if message.method == "stats":
            self.send(UtilityResult(message.call_id, self._stats()), message.client_index)
            return False
        return self._call_utility(message)

    def _call_utility(self, message: UtilityCall) -> bool:
        """An EngineCore method named by the call (reset_prefix_cache, sleep, wake_up, is_sleeping); its ValueError
        is the call's error, anything else fails the engine. sleep's outputs (the requests it aborted) go out
        before its result."""
        engine_core = self.engine_core
        try:
            if message.method == "sleep":
                outputs = engine_core.sleep(*message.args)
                self.send_outputs(EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats(),
                                                    timestamp=time.time()))
                result = True
            elif message.method == "wake_up":
                result = engine_core.wake_up([str(tag) for tag in message.args] or None)
            elif message.method == "is_sleeping":
                result = engine_core.is_sleeping()
            else:
                result = engine_core.reset_prefix_cache()
        except ValueError as e:
            self.send(UtilityResult(message.call_id, error=str(e)), message.client_index)
            return False
        self.send(UtilityResult(message.call_id, result=result), message.client_index)
        return False

    def _add(self, request: EngineCoreRequest) -> bool:
        from pagedllm.core.scheduler import QueueFullError

        self.num_added += 1
        client = request.client_index
        if not 0 <= client < self.num_clients:
            logger.error("dropped request %s from unknown API server %d", escape_control(request.request_id), client)
            return False
        try:
            self.engine_core.add_request(request)
        except QueueFullError as e:
            self.send(Rejected(request.request_id, "queue_full", str(e) or "The waiting queue is full."), client)
        except ValueError as e:
            self.send(Rejected(request.request_id, "invalid", str(e)), client)
        except Exception:  # one bad request must not take the engine down
            logger.exception("could not add request %s", escape_control(request.request_id))
            self.send(Rejected(request.request_id, "invalid", "The engine could not accept this request."), client)
        else:
            if self.num_clients > 1:
                self.client_of[request.request_id] = client
        return False

    def _stats(self) -> SchedulerStats | None:
        scheduler = getattr(self.engine_core, "scheduler", None)
        if scheduler is None:
            return None
        stats = scheduler.make_stats()
        pool = scheduler.kv_cache_manager.block_pool
        stats.total_ref_cnt = sum(b.ref_cnt for b in pool.blocks if b is not pool.null_block)
        return stats

    # ---- IO threads ----------------------------------------------------------------------------------

    def _input_thread(self) -> None:
        set_native_thread_name("engine-input")
        decoder = msgspec.msgpack.Decoder(ToEngine)
        while True:
            try:
                frame = self.input_socket.recv(copy=False)
            except zmq.ContextTerminated:
                self.input_socket.close(linger=0)
                return
            try:
                message = decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                logger.error("dropped an undecodable message from the API server: %s", e)
                continue
            if isinstance(message, UtilityCall) and message.method == "ping":
                started = self.step_started
                self.send(UtilityResult(message.call_id, None, 0.0 if started is None else time.monotonic() - started),
                          message.client_index)
            else:
                self.input_queue.put(message)

    def _output_thread(self) -> None:
        set_native_thread_name("engine-output")
        encoder = msgspec.msgpack.Encoder()
        while (item := self.output_queue.get()) is not None:
            client, message = item
            frame = encoder.encode(message)
            if client >= self.num_clients:
                continue  # an unknown API server's utility call: nobody to answer
            for sock in self.output_sockets if client < 0 else (self.output_sockets[client],):
                sock.send(frame, copy=False)


def _connect(ctx: zmq.Context, kind: int, *addrs: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    for addr in addrs:
        sock.connect(addr)
    return sock


def _exit_when_parent_dies(*addrs: str) -> None:
    """stdin is a pipe from the API server: EOF means it exited (or closed it to stop us)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    logger.info("API server is gone; engine core exiting.")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)
    remove_ipc_files(*addrs)
    os._exit(1)  # the main thread did not get out of its step in time


def run_engine_core(config, input_addrs: list[str], output_addrs: list[str], data_parallel_rank: int = 0) -> int:
    """Load the engine, report READY (or why not), run until shutdown. Returns the exit code."""
    signal.signal(signal.SIGTERM, raise_system_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    threading.Thread(target=_exit_when_parent_dies, args=(*input_addrs, *output_addrs), name="parent-watch",
                     daemon=True).start()
    from pagedllm.engine.core import EngineCore

    proc = None
    engine_core = None
    ready = False
    try:
        engine_core = EngineCore(config, data_parallel_rank)
        proc = EngineCoreProc(engine_core, input_addrs, output_addrs)
        resolved = engine_core.resolved_model
        proc.send(Ready(num_blocks=engine_core.num_blocks, block_size=config.cache_config.block_size,
                        max_model_len=engine_core.max_model_len, limits=engine_core.model_limits(),
                        model_name=getattr(resolved, "name", None) or str(config.model_config.model),
                        pid=os.getpid(), cache_config_info=engine_core.cache_config_info()))
        ready = True
        freeze_gc_heap()
        proc.run_busy_loop()
    except SystemExit:
        return 0
    except Exception as e:
        logger.exception("engine core failed")
        message = f"{type(e).__name__}: {e}"
        if proc is None:
            _report_startup_failure(output_addrs, message)
        else:
            proc.send(EngineFailed(message) if ready else StartupFailed(message))
        return 1
    finally:
        if proc is not None:
            proc.close()
        if engine_core is not None:
            engine_core.shutdown()  # the mp executor's workers
        remove_ipc_files(*input_addrs, *output_addrs)
    return 0


def _report_startup_failure(output_addrs: list[str], message: str) -> None:
    ctx = zmq.Context()
    sockets = [_connect(ctx, zmq.PUSH, addr) for addr in output_addrs]  # kept: a collected socket drops its message
    for sock in sockets:
        sock.send(msgspec.msgpack.encode(StartupFailed(message)))
    time.sleep(0.2)  # let the message leave before the context is destroyed
    ctx.destroy(linger=1000)


def main(argv: list[str] | None = None) -> int:
    from pagedllm.config import EngineConfig

    parser = argparse.ArgumentParser(description="pagedllm engine-core process (started by the API server)")
    parser.add_argument("--input-addr", required=True, action="append", help="once per API server")
    parser.add_argument("--output-addr", required=True, action="append", help="once per API server, in order")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--engine-index", type=int, default=None,
                        help="data-parallel rank (log prefix, KV events rank and port offset)")
    args = parser.parse_args(argv)
    name = "engine" if args.engine_index is None else f"engine {args.engine_index}"
    logging.basicConfig(level=args.log_level, format=f"%(levelname)s %(asctime)s [{name}] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    config_line = sys.stdin.buffer.readline()
    try:
        config = msgspec.json.decode(config_line, type=EngineConfig)
    except (msgspec.DecodeError, ValueError) as e:
        _report_startup_failure(args.output_addr, f"invalid engine configuration: {e}")
        return 1
    return run_engine_core(config, args.input_addr, args.output_addr, args.engine_index or 0)


if __name__ == "__main__":
    exit_after_cleanup(main())
