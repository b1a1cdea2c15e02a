"""`pagedllm serve [MODEL] [flags]`: the OpenAI-compatible server.

Engine flags are generated from the config dataclasses (ModelConfig, CacheConfig, SchedulerConfig) and
server flags from `ServerConfig` below, each documented by its field docstring, with vLLM's names.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Literal

from pagedllm.config import (
    EngineConfig,
    ModelConfig,
    add_dataclass_flags,
    add_engine_flags,
    engine_kwargs_from_args,
    field_docs,
    parse_bytes,  # noqa: F401  (re-exported for the CLI tests)
)

logger = logging.getLogger("pagedllm.serve")

# Set elsewhere: the positional MODEL, and SchedulerConfig.max_model_len (copied from ModelConfig's).
_SKIPPED = {"model"}


@dataclass
class ServerConfig:
    host: str | None = None
    """Host name or address to listen on; default: all interfaces."""
    port: int = 8000
    """Port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route except /health (and /metrics unless
    --protect-metrics). Several keys (one per tenant): comma-separated; a blank key anywhere in the list is
    refused at start-up. Default: the VLLM_API_KEY environment variable, if set (keeps the key out of ps)."""
    cache_salt_from_api_key: bool = False
    """Derive each request's cache_salt on the server from the caller's API key (HMAC-SHA256 under a
    per-process secret, combined with any client cache_salt), so tenants never share prefix-cache blocks,
    even when a client sends no salt. Needs --api-key."""
    protect_metrics: bool = False
    """Make --api-key guard /metrics too."""
    disable_log_requests: bool = False
    """Do not log each request's id, prompt length and sampling parameters."""
    disable_log_stats: bool = False
    """Do not log throughput, queue and KV-cache statistics every 10 seconds."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Log level of uvicorn (access log, server events)."""
    health_check_timeout: float = 10.0
    """Seconds the engine-core process may take to answer /health before it answers 503. The engine core
    answers during a step, so a long step (a long prefill chunk) does not fail /health."""
    engine_hang_timeout: float = 300.0
    """Seconds with unfinished requests in the engine core and no step finished before it is declared hung:
    its open requests fail, /health answers 503 and the server exits (0: never). Requests the engine has
    finished do not count, however slowly their clients read; a slow step on a busy machine must not kill
    the server."""
    max_buffered_outputs: int = 4096
    """Most outputs (one per choice per engine step) a streaming request may have waiting for its client;
    beyond, the client is taken as stalled and the request is aborted, its KV blocks freed."""
    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for open requests to finish before aborting them and exiting."""
    engine_startup_timeout: float = 600.0
    """Seconds to wait for the engine core to load the model and report ready."""
    engine_death_exit_delay: float = 3.0
    """Seconds the server keeps answering 503 after the engine core dies, before it exits."""
    max_n: int = 128
    """Largest `n` (choices per request) accepted; checked before anything else is done."""
    max_prompts: int = 1024
    """Most prompts in one /v1/completions request (a list of prompts); checked before tokenization."""
    max_choices: int = 1024
    """Most choices in one request: prompts x n (64 prompts with n=128 are 8,192 sequences to generate); HTTP 400
    beyond, checked before tokenization."""
    max_logit_bias: int = 1024
    """Most logit_bias entries in one request."""
    max_stop: int = 64
    """Most stop strings (and, separately, stop_token_ids) in one request."""
    chat_template_timeout: float = 1.0
    """Seconds a chat template may take to render before the request is rejected (HTTP 400)."""
    max_chat_template_chars: int = 1 << 20
    """Most characters a chat template may render (or build in one value) before HTTP 400."""
    trust_request_chat_template: bool = False
    """Accept a chat template sent in a request (`chat_template`, or `chat_template_kwargs.chat_template`);
    without this flag such a request is refused with HTTP 400, as vLLM does. A request's template is code:
    it is compiled and rendered in a child process with a memory limit, killed past --chat-template-timeout."""
    max_request_bytes: int = 16 << 20
    """Largest request body accepted, in bytes (HTTP 413 beyond; chunked bodies are counted as they
    arrive)."""
    max_header_bytes: int = 64 << 10
    """Largest request head (request line and headers) accepted, in bytes (HTTP 431 beyond)."""
    max_connections: int = 4096
    """Most open client connections; beyond, a new connection gets HTTP 503 at once and is closed (kept
    below the open-file limit, which start-up raises to its hard limit)."""
    header_read_timeout: float = 10.0
    """Seconds a connection has to deliver a request's head (request line and headers) from when it opens,
    or from its first byte after a keep-alive pause; then HTTP 408 and the connection is closed."""
    body_read_timeout: float = 60.0
    """Seconds a request's body has to arrive in full after its head; then the connection is closed."""
    enable_debug_routes: bool = False
    """Serve GET /debug/kv_cache (free and total KV blocks, running and waiting requests) for tests."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (an API-server process and an engine-core "
                    "process).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=field_docs(ModelConfig)["model"])
    parser.add_argument("--model", dest="model", default=None, help="Same as the positional MODEL.")
    add_dataclass_flags(parser.add_argument_group("server"), ServerConfig, "server_")
    add_engine_flags(parser.add_argument_group("engine"), skip=_SKIPPED)
    parser.set_defaults(dispatch_function=cmd)
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Raises ValueError (a message for the user) when the flags do not make a valid configuration."""
    engine_kwargs = engine_kwargs_from_args(args)
    server_kwargs = {k[len("server_"):]: v for k, v in vars(args).items() if k.startswith("server_")}
    api_key = server_kwargs.get("api_key")
    server_kwargs["api_key"] = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
    parse_api_keys(server_kwargs["api_key"], "--api-key" if api_key is not None else "VLLM_API_KEY")
    if server_kwargs.get("cache_salt_from_api_key") and server_kwargs["api_key"] is None:
        raise ValueError("--cache-salt-from-api-key needs --api-key (or VLLM_API_KEY): without a key there is "
                         "no tenant to derive a salt from.")
    for name in ("max_n", "max_prompts", "max_choices", "max_logit_bias", "max_stop", "max_chat_template_chars",
                 "max_request_bytes", "max_header_bytes", "max_connections", "max_buffered_outputs"):
        if name in server_kwargs and server_kwargs[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1.")
    for name in ("header_read_timeout", "body_read_timeout"):
        if name in server_kwargs and not server_kwargs[name] > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive.")
    model = args.model or args.model_tag
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}.")
    return EngineConfig.from_kwargs(model=model, **engine_kwargs), ServerConfig(**server_kwargs)


def parse_api_keys(value: str | None, source: str = "--api-key") -> list[str]:
    """The keys of --api-key (or VLLM_API_KEY): comma-separated, each stripped; None: no key needed.

    Raises ValueError for a blank key anywhere in the list (`" "`, `"a,,b"`, `"a, "`): dropping it would
    leave authentication off, or weaker than asked, without a word."""
    if value is None:
        return []
    keys = [key.strip() for key in value.split(",")]
    if not all(keys):
        raise ValueError(f"{source} contains a blank key: every comma-separated key must be non-empty (leave "
                         f"{source} unset to serve without authentication).")
    return keys


def cmd(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    from pagedllm.entrypoints.openai.run import run

    return run(engine_config, server_config)
