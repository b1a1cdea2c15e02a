"""`pagedllm serve [MODEL] [flags]`: the OpenAI-compatible server.

Engine flags are generated from the config dataclasses (ModelConfig, CacheConfig, SchedulerConfig) and
server flags from `ServerConfig`, each documented by its field docstring, with vLLM's names; vLLM's other flags
are accepted (no effect here) or refused with the reason (config/vllm_flags.py).
"""

from __future__ import annotations

import argparse
import logging

from pagedllm import envs
from pagedllm.config import (
    ModelConfig,
    ServerConfig,
    add_dataclass_flags,
    add_engine_flags,
    add_vllm_only_flags,
    configs_from_args,
    field_docs,
)
from pagedllm.config.config_file import expand_config_file, normalize_flag_names

__all__ = ["add_parser", "cmd", "configs_from_args", "preprocess_argv"]

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
    parser.add_argument("--config", dest="config_file", default=None, metavar="FILE",
                        help="A YAML file of flags, as vLLM reads it: keys are flag names (with - or _), values as "
                             "on the command line (true/false for switches, lists, nested objects for JSON "
                             "flags); flags on the command line win.")
    add_dataclass_flags(parser.add_argument_group("server"), ServerConfig, "server_")
    add_engine_flags(parser.add_argument_group("engine"), skip=_SKIPPED)
    add_vllm_only_flags(parser)
    parser.set_defaults(dispatch_function=cmd)
    return parser


def preprocess_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's spellings before parsing: `--flag_name` as `--flag-name`, and `--config FILE`'s flags inserted where
    the command line overrides them (config/config_file.py). A bad file exits with code 2, naming it."""
    argv = normalize_flag_names(argv)
    start = argv.index("serve") if "serve" in argv else 0
    try:
        return argv[:start] + expand_config_file(argv[start:], parser)
    except ValueError as e:
        parser.error(str(e))


def cmd(args: argparse.Namespace) -> int:
    if envs.VLLM_CONFIGURE_LOGGING:
        level = envs.VLLM_LOGGING_LEVEL
        if level not in logging.getLevelNamesMapping():
            logger.error("VLLM_LOGGING_LEVEL=%s is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL).", level)
            return 2
        logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                            datefmt="%m-%d %H:%M:%S")
    try:
        engine_config, server_config = configs_from_args(args)
        if server_config.otlp_traces_endpoint is not None:
            from pagedllm.metrics.tracing import check_tracing_available

            check_tracing_available()
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
