"""A worker process of the mp executor: one rank's Worker behind two ZMQ sockets.

    executor ──broadcast (SUB)──▶ busy loop: ExecuteModel ▸ Worker.execute_model ▸ StepResult (driver only)
                                             RpcCall ▸ Worker.<method> ▸ RpcResult (every rank)
    executor ◀──results (PUSH)───

Lifetime: exits on Shutdown, on SIGTERM, when the engine process dies (stdin reaches EOF), or, at world size > 1,
after a step raised (the other ranks may be stuck in a collective or a receive; the executor stops the engine).

Run as `python -m pagedllm.executor.worker_proc --rank R --broadcast-addr A --result-addr A
--distributed-init-method tcp://HOST:PORT` with the EngineConfig as one JSON line on stdin; MultiprocExecutor
does this.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import msgspec
import zmq

from pagedllm.child_process import exit_after_cleanup, raise_system_exit, remove_ipc_files
from pagedllm.config import EngineConfig
from pagedllm.executor.worker_messages import (
    ExecuteModel,
    RpcCall,
    RpcResult,
    Shutdown,
    StepResult,
    ToWorker,
    WorkerFailed,
    WorkerReady,
)
from pagedllm.messages import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

RPC_METHODS = frozenset({"determine_num_blocks", "initialize_kv_cache", "kv_cache_spec",
                         "calculate_kv_scales", "wait_kv_cache_resident", "check_health",
                         "get_step_spans", "sleep", "wake_up"})
"""The Worker methods an RpcCall may name."""


def run_worker(config: EngineConfig, rank: int, broadcast_addr: str, result_addr: str, init_method: str) -> int:
    from pagedllm.worker.worker import Worker

    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.setsockopt(zmq.SNDHWM, 0)
    results.connect(result_addr)
    broadcast = ctx.socket(zmq.SUB)
    broadcast.setsockopt(zmq.LINGER, 0)
    broadcast.setsockopt(zmq.RCVHWM, 0)
    broadcast.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    broadcast.setsockopt(zmq.SUBSCRIBE, b"")
    broadcast.connect(broadcast_addr)
    encoder = msgspec.msgpack.Encoder()
    worker = None
    try:
        try:
            worker = Worker(config, rank, init_method)
            worker.init_device()
            worker.load_model()
        except Exception as e:
            logger.exception("worker %d failed to start", rank)
            results.send(encoder.encode(WorkerFailed(rank, f"{type(e).__name__}: {e}")))
            return 1
        results.send(encoder.encode(WorkerReady(rank, os.getpid(), worker.model_info if rank == 0 else None)))
        return _busy_loop(worker, rank, config.parallel_config.world_size, broadcast, results, encoder)
    except SystemExit:
        return 0
    finally:
        if worker is not None:
            worker.shutdown()
        ctx.destroy(linger=0)


def _busy_loop(worker, rank: int, world_size: int, broadcast: zmq.Socket, results: zmq.Socket,
               encoder: msgspec.msgpack.Encoder) -> int:
    decoder = msgspec.msgpack.Decoder(ToWorker)
    while True:
        message = decoder.decode(broadcast.recv(copy=False).buffer)
        if isinstance(message, ExecuteModel):
            try:
                output = worker.execute_model(message.scheduler_output, message.grammar())
            except Exception as e:
                logger.exception("worker %d: the step failed", rank)
                results.send(encoder.encode(StepResult(rank, None, f"{type(e).__name__}: {e}")))
                if world_size > 1:
                    return 1
                continue
            if output is not None:  # the driver rank's (executor/abstract.py)
                results.send(encoder.encode(StepResult(rank, output)), copy=False)
        elif isinstance(message, RpcCall):
            try:
                if message.method not in RPC_METHODS:
                    raise ValueError(f"unknown worker method {message.method!r}")
                reply = RpcResult(rank, message.call_id, getattr(worker, message.method)(*message.args))
            except Exception as e:
                logger.exception("worker %d: %s failed", rank, message.method)
                reply = RpcResult(rank, message.call_id, None, f"{type(e).__name__}: {e}")
            results.send(encoder.encode(reply))
        elif isinstance(message, Shutdown):
            return 0


def _exit_when_parent_dies(*addrs: str) -> None:
    """stdin is a pipe from the engine process: EOF means it exited (or closed it to stop us). The engine removes
    its socket directory when it shuts down; killed, it cannot, so the workers remove the socket files and the
    directory (once empty) on their way out."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    remove_ipc_files(*addrs)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pagedllm worker process (started by the mp executor)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--broadcast-addr", required=True)
    parser.add_argument("--result-addr", required=True)
    parser.add_argument("--distributed-init-method", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(levelname)s %(asctime)s [worker {args.rank}] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    signal.signal(signal.SIGTERM, raise_system_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the engine decides
    config = msgspec.json.decode(sys.stdin.buffer.readline(), type=EngineConfig)
    threading.Thread(target=_exit_when_parent_dies, args=(args.broadcast_addr, args.result_addr), name="parent-watch",
                     daemon=True).start()
    return run_worker(config, args.rank, args.broadcast_addr, args.result_addr, args.distributed_init_method)


if __name__ == "__main__":
    exit_after_cleanup(main())
