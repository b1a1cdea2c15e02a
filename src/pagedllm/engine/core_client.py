"""The API server's side of the engine-core process: start it, talk to it over ZMQ, notice its death.

`EngineCoreClient.start(config)` makes a private 0700 directory for the `ipc://` sockets, binds them, starts
`python -m pagedllm.engine.core_proc` (a fresh interpreter: forking a process that holds torch is unsafe),
hands it the configuration as JSON on stdin and waits for READY, or raises `EngineStartupError` with the
engine's own message. The stdin pipe stays open: when this process dies, the engine sees EOF and exits.

The engine core runs in a session of its own, so that the signals meant for the server (Ctrl-C's SIGINT to the
terminal's foreground group, `kill %1`, `timeout`: SIGTERM to the server's group) reach the API server alone,
which then stops its engine cores in order (SIGTERM, then the stdin pipe closed) after its own shutdown. Before,
a group SIGTERM killed the engine core under the server's drain: "engine core process exited unexpectedly",
exit code 1, and with Ray workers left behind.

Engine death is noticed at once: a thread waits on the child's pid and calls `on_death` on the loop.

`start_engine_cores(config, n)` starts the n replicas of data parallelism at once, each with its share of the
CPU threads; if one fails, the others are stopped.

Several API servers (--api-server-count N, `api_server_manager`): the `pagedllm serve` parent starts the engine
cores (`spawn_engine_core`, one input and one output address per API server) and each API server `attach`es to
them: it binds its own pair of sockets, waits for READY on its output socket, tags its requests and utility calls
with its `client_index`, and watches the engine core, which is not its child, through a pidfd. It never stops
an engine core; the parent does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from pagedllm import envs
from pagedllm.messages import (
    MAX_MESSAGE_BYTES,
    AbortRequests,
    AddRequest,
    EngineCoreRequest,
    EngineFailed,
    FromEngine,
    Ready,
    StartupFailed,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message is the engine's own reason."""


class EngineDeadError(RuntimeError):
    """The engine core died (or failed) while the server was running."""


class EngineCoreClient:
    """Sends requests, aborts and utility calls; delivers engine messages to `on_message`."""

    def __init__(self, proc: subprocess.Popen | ForeignProcess, ctx: zmq.asyncio.Context,
                 input_socket: zmq.asyncio.Socket, output_socket: zmq.asyncio.Socket, socket_dir: str | None,
                 ready: Ready, engine_index: int | None = None, client_index: int = 0):
        self.proc = proc
        self.engine_index = engine_index
        """The data-parallel rank (None: the only engine core)."""
        self.client_index = client_index
        """This API server's index among --api-server-count (0: the only one)."""
        self.ctx = ctx
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.socket_dir = socket_dir
        self.ready = ready
        self.dead_reason: str | None = None
        self.on_message: Callable[[FromEngine], None] = lambda message: None
        self.on_death: Callable[[str], None] = lambda reason: None
        self.last_message_time = time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-output")
        threading.Thread(target=self._watch_process, name="engine-watch", daemon=True).start()

    # ---- start -------------------------------------------------------------------------------------------

    @classmethod
    async def start(cls, config, startup_timeout_s: float = 600.0, log_level: str = "INFO",
                    engine_index: int | None = None, env: dict[str, str] | None = None) -> EngineCoreClient:
        socket_dir = tempfile.mkdtemp(prefix="pagedllm-")  # mode 0700, only this user can connect
        ctx = zmq.asyncio.Context()
        proc = None
        try:
            input_socket = _bind(ctx, zmq.PUSH, f"ipc://{socket_dir}/input")
            output_socket = _bind(ctx, zmq.PULL, f"ipc://{socket_dir}/output")
            proc = spawn_engine_core(config, [f"ipc://{socket_dir}/input"], [f"ipc://{socket_dir}/output"],
                                     engine_index, env, log_level)
            ready = await _wait_ready(proc, output_socket, startup_timeout_s)
        except BaseException:
            if proc is not None:
                _stop_process(proc, timeout_s=5.0)
            ctx.destroy(linger=0)
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        name = "engine core" if engine_index is None else f"engine core {engine_index}"
        logger.info("%s ready (pid %d): %d KV blocks of %d tokens, max_model_len %d", name,
                    ready.pid, ready.num_blocks, ready.block_size, ready.max_model_len)
        return cls(proc, ctx, input_socket, output_socket, socket_dir, ready, engine_index)

    @classmethod
    async def attach(cls, pid: int, input_addr: str, output_addr: str, client_index: int,
                     startup_timeout_s: float, engine_index: int | None = None) -> EngineCoreClient:
        """Become API server `client_index` of an engine core that the parent started (--api-server-count)."""
        ctx = zmq.asyncio.Context()
        proc = ForeignProcess(pid)
        try:
            input_socket = _bind(ctx, zmq.PUSH, input_addr)
            output_socket = _bind(ctx, zmq.PULL, output_addr)
            ready = await _wait_ready(proc, output_socket, startup_timeout_s)
        except BaseException:
            ctx.destroy(linger=0)
            raise
        return cls(proc, ctx, input_socket, output_socket, None, ready, engine_index, client_index)

    # ---- requests ----------------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        await self._send(AddRequest(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            await self._send(AbortRequests(request_ids))

    async def call_utility(self, method: str, timeout_s: float | None, *args: int | str) -> UtilityResult:
        """Ask the engine core ("ping": its input thread; the others, its busy loop: see UtilityCall); raises
        TimeoutError if it does not answer in time (None: no limit), EngineDeadError if dead."""
        call_id = next(self._call_ids)
        future: asyncio.Future[UtilityResult] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            await self._send(UtilityCall(call_id, method, list(args), self.client_index))
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the engine core did not answer within {timeout_s:g} s") from None
        finally:
            self._calls.pop(call_id, None)

    async def _send(self, message) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        await self.input_socket.send(self._encoder.encode(message), copy=False)

    # ---- engine messages and death -----------------------------------------------------------------------

    async def _output_loop(self) -> None:
        """Deliver the engine's messages. If this loop dies (an error outside any one request's output handling,
        which OutputProcessor contains), no output reaches any request again: the engine is as good as dead, so
        it is marked dead (every open request fails, /health answers 503, the server exits to be restarted)."""
        try:
            await self._receive_outputs()
        except Exception as e:
            logger.exception("the output loop failed")
            self._mark_dead(f"the API server's output loop failed ({type(e).__name__}; see its log)")

    async def _receive_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(FromEngine)
        while True:
            frame = await self.output_socket.recv(copy=False)
            self.last_message_time = time.monotonic()
            try:
                message = decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                logger.error("dropped an undecodable message from the engine core: %s", e)
                continue
            if isinstance(message, UtilityResult):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, EngineFailed):
                self._mark_dead(f"engine core failed: {message.message}")
            else:
                self.on_message(message)

    def _watch_process(self) -> None:
        code = self.proc.wait()
        if not self._closing:
            reason = f"engine core process exited unexpectedly (exit code {'unknown' if code is None else code})"
            self._loop.call_soon_threadsafe(self._mark_dead, reason)

    def mark_dead(self, reason: str) -> None:
        """Give up on the engine core (it died, failed, or hung): fail open calls, tell `on_death`."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.is_dead or self._closing:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.on_death(reason)

    # ---- stop --------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM the engine core now without waiting (data parallelism: every replica stops at once, then
        `shutdown` waits for each)."""
        self._closing = True
        if self.proc.poll() is None and not isinstance(self.proc, ForeignProcess):
            self.proc.send_signal(signal.SIGTERM)

    def shutdown(self) -> None:
        """Stop the engine core (SIGTERM, then SIGKILL), close the sockets, remove the socket directory."""
        self._closing = True
        self._output_task.cancel()
        if not isinstance(self.proc, ForeignProcess):
            _stop_process(self.proc, timeout_s=5.0)
        self.ctx.destroy(linger=0)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


class ForeignProcess:
    """An engine core started by another process (the `pagedllm serve` parent of several API servers), watched
    through a pidfd: readable once it has exited, even while it waits, a zombie, for its parent. Its exit code is
    the parent's to read, so `returncode` is None here."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exited = False
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd, self.exited = None, True
        self.returncode = None

    def poll(self) -> int | None:
        """-1 once it has exited (the code is unknown here), else None."""
        self.wait(0)
        return -1 if self.exited else None

    def wait(self, timeout: float | None = None) -> None:
        if not self.exited and select.select([self._pidfd], [], [], timeout)[0]:
            self.exited = True


def spawn_engine_core(config, input_addrs: list[str], output_addrs: list[str], engine_index: int | None = None,
                      env: dict[str, str] | None = None, log_level: str = "INFO") -> subprocess.Popen:
    """Start an engine-core process that connects to each pair of addresses (one pair per API server), with the
    configuration on its stdin, which stays open (EOF: its parent is gone)."""
    args = [sys.executable, "-m", "pagedllm.engine.core_proc", "--log-level", log_level]
    for input_addr, output_addr in zip(input_addrs, output_addrs, strict=True):
        args += ["--input-addr", input_addr, "--output-addr", output_addr]
    if engine_index is not None:
        args += ["--engine-index", str(engine_index)]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, close_fds=True, env=env, start_new_session=True)
    try:
        proc.stdin.write(msgspec.json.encode(config) + b"\n")
        proc.stdin.flush()
    except OSError:  # it exited at once: _wait_ready says so
        pass
    return proc


async def start_engine_cores(config, num: int, startup_timeout_s: float = 600.0) -> list[EngineCoreClient]:
    """Start `num` engine cores of `config` at once (num > 1: data-parallel replicas, ranks 0..num-1, each with
    OMP_NUM_THREADS set to its share of this process's CPUs or of OMP_NUM_THREADS). Raises EngineStartupError
    (naming the replica) after stopping the others when one cannot start."""
    if num == 1:
        return [await EngineCoreClient.start(config, startup_timeout_s)]
    env, threads = data_parallel_env(num)
    results = await asyncio.gather(*(EngineCoreClient.start(config, startup_timeout_s, engine_index=i, env=env)
                                     for i in range(num)), return_exceptions=True)
    clients = [r for r in results if isinstance(r, EngineCoreClient)]
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if failed:
        for client in clients:
            client.shutdown()
        index, error = failed[0]
        if isinstance(error, EngineStartupError):
            raise EngineStartupError(f"engine core {index}: {error}") from error
        raise error
    logger.info("data parallel size %d: %s, %d threads each", num,
                ", ".join(f"engine {c.engine_index} pid {c.ready.pid}" for c in clients), threads)
    return clients


def data_parallel_env(num: int) -> tuple[dict[str, str], int]:
    """The environment of each of `num` data-parallel engine cores: OMP_NUM_THREADS, its share of this process's
    CPUs (or of OMP_NUM_THREADS); and that share."""
    available = envs.OMP_NUM_THREADS or len(os.sched_getaffinity(0))
    threads = max(1, available // num)
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}, threads


def _bind(ctx: zmq.asyncio.Context, kind: int, addr: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    sock.bind(addr)
    return sock


async def _wait_ready(proc: subprocess.Popen | ForeignProcess, output_socket: zmq.asyncio.Socket,
                      timeout_s: float) -> Ready:
    deadline = time.monotonic() + timeout_s
    decoder = msgspec.msgpack.Decoder(FromEngine)
    while time.monotonic() < deadline:
        if await output_socket.poll(timeout=100):
            message = decoder.decode(await output_socket.recv())
            if isinstance(message, Ready):
                return message
            if isinstance(message, StartupFailed):
                raise EngineStartupError(message.message)
            logger.warning("unexpected %s before READY", type(message).__name__)
        elif proc.poll() is not None:
            code = "unknown" if proc.returncode is None else proc.returncode
            raise EngineStartupError(f"engine core exited with code {code} while starting "
                                     "(see its log above)")
    raise EngineStartupError(f"engine core did not become ready within {timeout_s:.0f} s")


def _stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the engine core's orderly stop), then SIGKILL past timeout_s; the stdin pipe is closed last (closed
    first, the engine core would log that the API server is gone)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("engine core did not exit within %.0f s; killing it", timeout_s)
            proc.kill()
            proc.wait()
    try:
        proc.stdin.close()
    except OSError:
        pass
