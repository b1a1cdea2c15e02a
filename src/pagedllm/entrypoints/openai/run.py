"""Run the server: start the engine core (and load the tokenizer meanwhile), then uvicorn until exit.

With --api-server-count N > 1, `pagedllm serve` runs api_server_manager.py instead: the parent of N API servers,
each of which runs `run` here with `shared`: the engine cores and the listening socket the parent made."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from socket import socket

import uvicorn
import uvicorn.config

from pagedllm import envs
from pagedllm.config import EngineConfig, ModelConfig, ServerConfig
from pagedllm.config.lora import parse_lora_modules
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineCoreClient, EngineStartupError, start_engine_cores
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.entrypoints.openai.chat_template import load_chat_template
from pagedllm.entrypoints.openai.connection_limits import (
    ConnectionLimitedH11Protocol,
    ConnectionLimits,
    effective_max_connections,
    raise_fd_limit,
)
from pagedllm.entrypoints.openai.draining import DrainingServer
from pagedllm.entrypoints.openai.loop_errors import RateLimitedLoopErrors
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.ssl_refresh import SSLCertRefresher
from pagedllm.gc_heap import freeze_gc_heap

logger = logging.getLogger(__name__)


@dataclass
class SharedEngines:
    """What an API server of several (--api-server-count) gets from its parent: the listening socket, and how to
    attach to the engine cores the parent started (an awaitable of their clients, taking the startup timeout)."""

    client_index: int
    socket: socket
    attach: Callable[[float], Awaitable[list[EngineCoreClient]]]
    salt_secret: bytes
    """--cache-salt-from-api-key's key, the same in every API server."""


def run(engine_config: EngineConfig, server_config: ServerConfig, shared: SharedEngines | None = None) -> int:
    """Serve until SIGTERM/SIGINT or engine death. Returns the process exit code.

    With PAGEDLLM_API_PROFILE=PATH in the environment, the event loop's thread runs under cProfile and its stats
    are written to PATH at exit (benchmarks/serving_cpu.py; read with `python -m pstats PATH`)."""
    profile_path = envs.PAGEDLLM_API_PROFILE
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(run_server(engine_config, server_config, shared))
    except KeyboardInterrupt:
        return 0
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)


def _loop_factory():
    """uvloop's event loop where it is installed, as vLLM's API server runs (c1, 1,536 streamed tokens: 0.66-0.73
    ms of API-server CPU per token against 0.74-0.79 on asyncio's loop, output tok/s +4-5%); asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _load_tokenizer_soon(mc: ModelConfig) -> asyncio.Future | None:
    """The tokenizer's loading, started in a thread, after the model is resolved once, here: a hub id is found in
    (or downloaded to) the Hugging Face cache before the engine cores look for it. None (logged) where it is not."""
    from pagedllm.models.model_info import ModelLoadError
    from pagedllm.models.resolve import resolve_model_config
    from pagedllm.tokenizer import get_tokenizer, tokenizer_source

    try:
        resolved = await asyncio.to_thread(resolve_model_config, mc)
        source = await asyncio.to_thread(tokenizer_source, mc, resolved)
    except ModelLoadError as e:
        logger.error("The server failed to start: %s", e)
        return None
    return asyncio.ensure_future(asyncio.to_thread(get_tokenizer, source))


def engine_core_config(engine_config: EngineConfig) -> EngineConfig:
    """What each engine core runs. The API server admits or refuses whole requests against --max-num-queued-reqs
    (AsyncLLM.check_admission): the engine core must not refuse one child of an admitted request (n > 1, a list of
    prompts). Data parallelism: N engine cores of the same configuration, each one whole replica."""
    return dataclasses.replace(
        engine_config,
        scheduler_config=dataclasses.replace(engine_config.scheduler_config, max_num_queued_reqs=None),
        parallel_config=dataclasses.replace(engine_config.parallel_config, data_parallel_size=1))


def _make_tracer(sc: ServerConfig, model_name: str):
    """--otlp-traces-endpoint: the span exporter (None without the flag)."""
    if sc.otlp_traces_endpoint is None:
        return None
    from pagedllm.metrics.tracing import RequestTracer

    return RequestTracer(sc.otlp_traces_endpoint, model_name)


async def _serve(server: DrainingServer, config: uvicorn.Config, sc: ServerConfig,
                 sockets: list[socket] | None = None) -> None:
    """uvicorn until it exits (on `sockets`: the listening socket of several API servers), with
    --enable-ssl-refresh's watch of the TLS files meanwhile."""
    refresher = None
    if sc.tls and sc.enable_ssl_refresh:
        config.load()  # the TLS context the server will listen with
        refresher = SSLCertRefresher(config.ssl, sc.ssl_keyfile, sc.ssl_certfile, sc.ssl_ca_certs)
    try:
        await server.serve(sockets=sockets)
    finally:
        if refresher is not None:
            await refresher.stop()


def uvicorn_config(app, sc: ServerConfig, limits: ConnectionLimits) -> uvicorn.Config:
    return uvicorn.Config(app, host=sc.host or "0.0.0.0", port=sc.port, log_level=sc.uvicorn_log_level,
                          timeout_graceful_shutdown=5, timeout_keep_alive=5,
                          http=functools.partial(ConnectionLimitedH11Protocol, limits=limits),
                          h11_max_incomplete_event_size=sc.max_header_bytes,
                          access_log=not sc.disable_uvicorn_access_log, **ssl_options(sc))


def ssl_options(sc: ServerConfig) -> dict:
    """uvicorn's TLS settings from --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs and
    --ssl-ciphers (none without --ssl-certfile: plain HTTP), as vLLM passes them."""
    if not sc.tls:
        return {}
    return {"ssl_keyfile": sc.ssl_keyfile, "ssl_certfile": sc.ssl_certfile, "ssl_ca_certs": sc.ssl_ca_certs,
            "ssl_cert_reqs": sc.ssl_cert_reqs, "ssl_ciphers": sc.ssl_ciphers}


def check_ssl_options(sc: ServerConfig) -> None:
    """Raises ValueError (a message for the user) when the TLS files or ciphers cannot make a TLS context: checked
    before the engine starts, so a wrong path fails in a second, not after the model has loaded."""
    if not sc.tls:
        return
    try:
        uvicorn.config.create_ssl_context(sc.ssl_certfile, sc.ssl_keyfile, None, ssl.PROTOCOL_TLS_SERVER,
                                          sc.ssl_cert_reqs, sc.ssl_ca_certs, sc.ssl_ciphers)
    except (OSError, ssl.SSLError, ValueError) as e:
        raise ValueError(f"Cannot set up TLS from --ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-ciphers: "
                         f"{e}") from None


async def run_server(engine_config: EngineConfig, sc: ServerConfig, shared: SharedEngines | None = None) -> int:
    try:
        check_ssl_options(sc)
        chat_template = None if sc.chat_template is None else load_chat_template(sc.chat_template)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 1
    fd_limit = raise_fd_limit()
    asyncio.get_running_loop().set_exception_handler(RateLimitedLoopErrors())
    mc = engine_config.model_config
    tokenizer_task = await _load_tokenizer_soon(mc)
    if tokenizer_task is None:
        return 1
    try:
        if shared is None:
            clients = await start_engine_cores(engine_core_config(engine_config),
                                               engine_config.parallel_config.data_parallel_size,
                                               sc.engine_startup_timeout)
        else:
            clients = await shared.attach(sc.engine_startup_timeout)
    except EngineStartupError as e:
        logger.error("The engine core failed to start: %s", e)
        tokenizer_task.cancel()
        return 1
    try:
        tokenizer = await tokenizer_task
    except Exception as e:
        logger.error("Cannot load the tokenizer: %s", e)
        for client in clients:
            client.shutdown()
        return 1
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    names = list(mc.served_model_name or [clients[0].ready.model_name])
    engine = AsyncLLM(clients, tokenizer, names[0], engine_config.scheduler_config.max_num_queued_reqs,
                      log_stats=not sc.disable_log_stats and (shared is None or shared.client_index == 0),
                      watchdog_timeout_s=sc.engine_hang_timeout or None, max_buffered_outputs=sc.max_buffered_outputs)
    engine.num_api_servers = sc.api_server_count
    engine.tracer = _make_tracer(sc, names[0])
    models = ServingModels(names, clients[0].ready.model_name,
                           engine.input_processor.check_lora if engine_config.lora_config.enable_lora else None)
    try:
        models.load_static(parse_lora_modules(sc.lora_modules))
    except ValueError as e:
        logger.error("%s", e)
        engine.shutdown()
        return 1
    pc = engine_config.parallel_config
    parallel = {"data_parallel_size": pc.data_parallel_size, "tensor_parallel_size": pc.tensor_parallel_size,
                "pipeline_parallel_size": pc.pipeline_parallel_size}
    state = ServerState(engine, sc, names, models=models, parallel=parallel,
                        salt_secret=os.urandom(32) if shared is None else shared.salt_secret)
    return await _serve_app(state, fd_limit, shared)


async def _serve_app(state: ServerState, fd_limit: int, shared: SharedEngines | None) -> int:
    """Serve the app until shut down; returns the exit status (1 when the engine died or the server never started)."""
    engine, sc, names = state.engine, state.config, state.served_model_names
    limits = ConnectionLimits(effective_max_connections(sc.max_connections, fd_limit), sc.header_read_timeout,
                              sc.body_read_timeout)
    config = uvicorn_config(build_app(state), sc, limits)
    server = DrainingServer(config, state, sc.drain_timeout)
    engine.on_death = lambda reason: server.exit_later(sc.engine_death_exit_delay)
    if engine.is_dead:  # a replica died while the others were starting: fail fast all the same
        engine.on_death(engine.dead_reason)
    logger.info("%sServing %s on %s://%s:%d%s", "" if shared is None else f"API server {shared.client_index} "
                f"(pid {os.getpid()}): ", names[0], "https" if sc.tls else "http", sc.host or "0.0.0.0", sc.port,
                sc.root_path or "")
    freeze_gc_heap()
    try:
        await _serve(server, config, sc, None if shared is None else [shared.socket])
    finally:
        engine.shutdown()
    if engine.is_dead:
        return 1
    return 0 if server.started else 1
