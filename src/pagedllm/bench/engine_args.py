"""Engine flags for the offline benchmarks: the engine's own flags (vLLM's names), from pagedllm.config.

Only flags the user passes reach `LLM(**engine_args)`, so the engine's own defaults stay in one place.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.config import add_engine_flags, engine_kwargs_from_args

# Set by the benchmark's own flags.
_SKIPPED = frozenset({"model", "seed"})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine", "Passed to LLM(...); default: the engine's.")
    add_engine_flags(group, skip=_SKIPPED, suppress_defaults=True)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set on the command line."""
    return engine_kwargs_from_args(args)
