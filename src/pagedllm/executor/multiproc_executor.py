"""MultiprocExecutor: one worker process per rank (tensor-parallel rank or pipeline stage) on this machine.

Each worker is a fresh interpreter (`python -m pagedllm.executor.worker_proc`; never fork: the engine holds torch
and threads), given the configuration as JSON on stdin; the pipe stays open, so a worker exits when the engine
process dies however it dies. Each worker runs in a session of its own, so that a signal to the process group of
the program that started the engine (Ctrl-C, `kill %1`) reaches the workers only through the engine's orderly
shutdown, never before it ("worker exited unexpectedly" at a normal Ctrl-C). The steps go over ipc:// ZMQ sockets
in a private directory (executor/zmq_executor.py); the ranks' tensors over torch.distributed (gloo; on one host the
CPU's all-reduces go through shared memory, distributed/shm_communicator.py, whose leftover segments are removed
when the workers stop).

A worker that exits is noticed at once (a thread waits on each pid) and stops the engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import torch
import zmq

from pagedllm.distributed.shm_communicator import remove_leftover_segments
from pagedllm.executor.zmq_executor import ZmqExecutor, free_port, log_level_name

logger = logging.getLogger(__name__)


class MultiprocExecutor(ZmqExecutor):
    def _make_worker_resources(self) -> tuple:
        self.socket_dir = tempfile.mkdtemp(prefix="pagedllm-workers-")  # 0700: only this user connects
        self.procs: list[subprocess.Popen] = []
        return self.ctx, self.procs, self.socket_dir

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        addr = f"ipc://{self.socket_dir}/{name}"
        sock.bind(addr)
        return addr

    def _start_workers(self, broadcast_addr: str, result_addr: str) -> None:
        init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        # Each rank gets its share of this process's threads (2 cores, 2 ranks: 1 thread each).
        threads = max(1, torch.get_num_threads() // self.world_size)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        config_line = msgspec.json.encode(self.config) + b"\n"
        for rank in range(self.world_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.executor.worker_proc", "--rank", str(rank),
                 "--broadcast-addr", broadcast_addr, "--result-addr", result_addr,
                 "--distributed-init-method", init_method, "--log-level", log_level_name()],
                stdin=subprocess.PIPE, env=env, close_fds=True, start_new_session=True)
            self.procs.append(proc)
            proc.stdin.write(config_line)
            proc.stdin.flush()
        logger.info("started %d worker processes (%d threads each): pids %s", self.world_size, threads,
                    [p.pid for p in self.procs])

    def _watch_workers(self) -> None:
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"worker-{rank}-watch", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._fail(f"worker {rank} (pid {proc.pid}) exited unexpectedly (exit code {code})")

    @staticmethod
    def _stop_workers(ctx: zmq.Context, procs: list[subprocess.Popen], socket_dir: str,  # type: ignore[override]
                      timeout_s: float = 5.0) -> None:
        """Ask (stdin EOF, SIGTERM), then kill; every worker is waited for."""
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

