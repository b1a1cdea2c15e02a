"""--api-server-count N > 1: N API-server processes in front of the engine core(s), as `vllm serve` runs them.

    pagedllm serve (this process: starts, watches and stops the others; serves nothing)
      ├─ engine core [rank r] ×data-parallel size   input ◀─ each API server's PUSH; one output per API server
      └─ API server i ×N (api_server_proc.py)       all accept on the one listening socket made here

The parent resolves the model once (a hub id is downloaded once), binds the listening socket, makes a private
folder for the `ipc://` sockets (each API server binds its own pair per engine core, named by engine and server,
and every engine core connects to all of them) and, unless PROMETHEUS_MULTIPROC_DIR is set, one for the metrics of
prometheus_client's multiprocess mode. Then it starts the engine cores and the API servers at once: each API
server waits for the engines' READY on its own sockets.

Signals: the API servers and engine cores run in sessions of their own, so SIGTERM/SIGINT reach this process
alone; it forwards them to every API server (SIGTERM: drain; SIGINT: abort open requests), waits for them, then
stops the engine cores (SIGTERM, then stdin closed) and exits 0. Failures: an API server that exits by itself
stops the others (SIGTERM) and the engine cores; an engine core that exits is noticed by every API server (it
fails its open requests, answers 503 for --engine-death-exit-delay and exits 1), which this process waits for
before stopping the rest. Either way it exits 1. If this process is killed, every child sees its stdin reach EOF
and stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec

from pagedllm import envs
from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.core_client import _stop_process, data_parallel_env, spawn_engine_core
from pagedllm.entrypoints.openai.api_server_proc import APIServerSpec, EngineAddress
from pagedllm.entrypoints.openai.run import engine_core_config

logger = logging.getLogger(__name__)

_POLL_S = 0.1


def bind_listening_socket(host: str | None, port: int) -> socket.socket:
    """The socket every API server accepts on (inheritable: handed to them by its descriptor)."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class APIServerManager:
    """The children of one `pagedllm serve --api-server-count N` and their lifetime."""

    def __init__(self, engine_config: EngineConfig, sc: ServerConfig):
        self.engine_config = engine_config
        self.sc = sc
        self.engines: list[subprocess.Popen] = []
        self.api_servers: list[subprocess.Popen] = []
        self.signal: int | None = None
        self.socket_dir = tempfile.mkdtemp(prefix="pagedllm-")  # mode 0700: only this user can connect
        self.metrics_dir: str | None = None
        self.env = {**os.environ}
        if not envs.PROMETHEUS_MULTIPROC_DIR:
            self.metrics_dir = tempfile.mkdtemp(prefix="pagedllm-metrics-")
            self.env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir

    def start(self, sock: socket.socket) -> None:
        num_servers = self.sc.api_server_count
        num_replicas = self.engine_config.parallel_config.data_parallel_size
        core_config = engine_core_config(self.engine_config)
        engine_env, threads = data_parallel_env(num_replicas) if num_replicas > 1 else (self.env, None)
        addresses: list[list[EngineAddress]] = [[] for _ in range(num_servers)]
        salt_secret = os.urandom(32)
        for rank in range(num_replicas):
            inputs = [f"ipc://{self.socket_dir}/e{rank}-s{i}-input" for i in range(num_servers)]
            outputs = [f"ipc://{self.socket_dir}/e{rank}-s{i}-output" for i in range(num_servers)]
            proc = spawn_engine_core(core_config, inputs, outputs, rank if num_replicas > 1 else None, engine_env)
            self.engines.append(proc)
            for i in range(num_servers):
                addresses[i].append(EngineAddress(proc.pid, inputs[i], outputs[i]))
        logger.info("engine cores started: %s%s", ", ".join(f"pid {p.pid}" for p in self.engines),
                    "" if threads is None else f" (data parallel size {num_replicas}, {threads} threads each)")
        for i in range(num_servers):
            spec = APIServerSpec(self.engine_config, self.sc, i, sock.fileno(), addresses[i], salt_secret)
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server_proc"],
                                    stdin=subprocess.PIPE, pass_fds=(sock.fileno(),), env=self.env,
                                    start_new_session=True)
            proc.stdin.write(msgspec.json.encode(spec) + b"\n")
            proc.stdin.flush()
            self.api_servers.append(proc)
        logger.info("%d API servers started: %s", num_servers, ", ".join(f"pid {p.pid}" for p in self.api_servers))

    def watch(self) -> int:
        """Until a signal or a death; then stop everything. Returns the exit code."""
        while self.signal is None:
            if dead := [p for p in self.api_servers if p.poll() is not None]:
                logger.error("API server pid %d exited (code %d); stopping the server", dead[0].pid,
                             dead[0].returncode)
                self._signal_api_servers(signal.SIGTERM)
                break
            if dead := [p for p in self.engines if p.poll() is not None]:
                logger.error("engine core pid %d exited (code %d); the API servers stop after "
                             "--engine-death-exit-delay", dead[0].pid, dead[0].returncode)
                self._wait_api_servers(self.sc.engine_death_exit_delay + 20.0)
                break
            time.sleep(_POLL_S)
        else:
            self._signal_api_servers(self.signal)
        clean = self.signal is not None
        self._wait_api_servers(self.sc.drain_timeout + 20.0)
        return 0 if clean and all(p.returncode == 0 for p in self.api_servers) else 1

    def on_signal(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signum
        else:  # a second signal: forwarded as it comes (a second SIGTERM or a Ctrl-C aborts the drain)
            self._signal_api_servers(signum)

    def _signal_api_servers(self, signum: int) -> None:
        for proc in self.api_servers:
            if proc.poll() is None:
                proc.send_signal(signum)

    def _wait_api_servers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.api_servers) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for proc in self.api_servers:
            if proc.poll() is None:
                logger.warning("API server pid %d did not exit within %.0f s; killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop whatever still runs (API servers first: they may still be using the engines), remove the folders."""
        self._signal_api_servers(signal.SIGTERM)
        self._wait_api_servers(10.0)
        for proc in self.api_servers:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.engines:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # all at once, then each waited for
        for proc in self.engines:
            _stop_process(proc, timeout_s=5.0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def run_api_servers(engine_config: EngineConfig, sc: ServerConfig) -> int:
    """`pagedllm serve --api-server-count N` (N > 1). Returns the exit code."""
    from pagedllm.models.model_info import ModelLoadError
    from pagedllm.models.resolve import resolve_model_config

    try:
        resolve_model_config(engine_config.model_config)  # download once, before N + 1 processes look for it
    except ModelLoadError as e:
        logger.error("The server failed to start: %s", e)
        return 1
    try:
        sock = bind_listening_socket(sc.host, sc.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", sc.host or "0.0.0.0", sc.port, e)
        return 1
    manager = APIServerManager(engine_config, sc)
    previous = {sig: signal.signal(sig, manager.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        manager.start(sock)
        sock.close()  # the API servers hold it now
        return manager.watch()
    finally:
        manager.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
