"""`pagedllm serve [MODEL] [flags]`: the OpenAI-compatible server.

Engine flags are generated from the config dataclasses (ModelConfig, CacheConfig, SchedulerConfig) and
server flags from `ServerConfig`, each documented by its field docstring, with vLLM's names.
"""

from __future__ import annotations

import argparse
import logging
import os

from pagedllm.config import (
    EngineConfig,
    ModelConfig,
    ServerConfig,
    add_dataclass_flags,
    add_engine_flags,
    engine_kwargs_from_args,
    field_docs,
    parse_api_keys,
)

logger = logging.getLogger("pagedllm.serve")

# Set elsewhere: the positional MODEL.
_SKIPPED = {"model"}


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
    if server_kwargs.get("api_key") is None and "VLLM_API_KEY" in os.environ:
        server_kwargs["api_key"] = os.environ["VLLM_API_KEY"]
        parse_api_keys(server_kwargs["api_key"], "VLLM_API_KEY")  # a blank key, named where it came from
    model = args.model or args.model_tag
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}.")
    server_config = ServerConfig(**server_kwargs)
    if server_config.otlp_traces_endpoint is not None:
        from pagedllm.metrics.tracing import check_tracing_available

        check_tracing_available()
    return EngineConfig.from_kwargs(model=model, **engine_kwargs), server_config


def cmd(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    from pagedllm.child_process import exit_after_cleanup

    if server_config.api_server_count > 1:  # a parent of N API servers and the engine cores
        from pagedllm.entrypoints.openai.api_server_manager import run_api_servers as run
    else:
        from pagedllm.entrypoints.openai.run import run

    # The engine cores have exited and the sockets are closed: skip the interpreter's teardown (see child_process).
    exit_after_cleanup(run(engine_config, server_config))
