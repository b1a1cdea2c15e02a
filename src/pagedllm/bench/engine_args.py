"""Engine flags for the offline benchmarks, generated from the config dataclasses (vLLM's names).

Only flags the user passes reach `LLM(**engine_args)`, so the engine's own defaults stay in one place.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from typing import Any

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig, field_docs

# Set by the engine itself or by the benchmark's own flags.
_SKIPPED = {"model", "seed"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine", "Passed to LLM(...); default: the engine's.")
    seen: set[str] = set()
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in fields(cls):
            if f.name in _SKIPPED or f.name in seen:
                continue
            seen.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": f"engine_{f.name}", "default": argparse.SUPPRESS,
                                      "metavar": f.name.upper(),
                                      "help": docs.get(f.name, "")}
            kind = hints[f.name]
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **{**kwargs, "metavar": None})
            elif typing.get_origin(kind) is typing.Literal:
                group.add_argument(flag, choices=typing.get_args(kind), **kwargs)
            else:
                base = args[0] if args else kind
                group.add_argument(flag, type=base if base in (int, float) else str, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set on the command line."""
    return {key[len("engine_"):]: value for key, value in vars(args).items() if key.startswith("engine_")}
