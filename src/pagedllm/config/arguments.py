"""Command-line flags, generated from the config dataclasses (one flag per field, its docstring the help), plus
the flags of vLLM's that pagedllm accepts or refuses (config/vllm_flags.py), and the checks that turn a parsed
namespace into the configuration (`configs_from_args`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import logging
import re
import textwrap
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

from pagedllm import envs
from pagedllm.config.engine import (
    ENGINE_SECTIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
    KVEventsConfig,
)
from pagedllm.config.server import ServerConfig, parse_api_keys

logger = logging.getLogger("pagedllm.config")

HUMAN_READABLE_INTS = frozenset({"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"})
"""Fields whose flag takes vLLM's human-readable integers (`32k`, `1Gi`... see human_readable_int)."""
VLLM_ONLY_PREFIX = "vllm_only_"
"""Where an accepted or refused flag's value lands in the namespace (present only when the flag is given)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source.

    >>> field_docs(CacheConfig)["block_size"]
    'Tokens per KV-cache block.'
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ---- command-line flags, generated from the dataclasses above ----------------------------------------

def add_dataclass_flags(group, cls: type, prefix: str, skip: frozenset[str] | set[str] = frozenset(),
                        suppress_defaults: bool = False) -> None:
    """One flag per field: `--field-name`, its docstring as help, bools as --x/--no-x, Literals as choices,
    `*_memory`/`*_bytes` fields as sizes (`4GiB`). Values land in `args.<prefix><field>`.

    With suppress_defaults, a flag the user does not pass is absent from the namespace, so the
    dataclass default stays the only default.
    """
    from pagedllm.config.vllm_flags import ALIASES, COMMA_JOINED  # not at the top: `python -m ...vllm_flags`

    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        names = (flag, *ALIASES.get(flag, ()))
        field_default = f.default_factory() if f.default_factory is not MISSING else f.default
        default = argparse.SUPPRESS if suppress_defaults else field_default
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": default, "help": docs.get(f.name, "")}
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if flag in COMMA_JOINED:  # vLLM's `--api-key k1 k2`, and pagedllm's `--api-key k1,k2`
            group.add_argument(*names, nargs="+", action=_CommaJoined, metavar=f.name.upper(), **kwargs)
        elif kind is bool or args == [bool]:  # bool | None: None until --x / --no-x says otherwise
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(kind) is Literal:
            group.add_argument(*names, choices=typing.get_args(kind), **kwargs)
        elif len(args) == 1 and typing.get_origin(args[0]) is Literal:  # Literal[...] | None
            group.add_argument(*names, choices=typing.get_args(args[0]), **kwargs)
        elif typing.get_origin(kind) is list:  # list[str] with a default list: one JSON list, as vLLM's CORS flags
            group.add_argument(*names, type=json_list_flag, metavar="JSON_LIST", **kwargs)
        elif len(args) == 1 and typing.get_origin(args[0]) is list:  # list[X] | None: `--flag a b`, as vLLM's
            group.add_argument(*names, nargs="+", type=typing.get_args(args[0])[0], metavar=f.name.upper(), **kwargs)
        else:
            base = args[0] if args else kind
            if f.name in HUMAN_READABLE_INTS:
                base = human_readable_int_or_auto if f.name == "max_model_len" else human_readable_int
            elif f.name.endswith("_memory") or f.name.endswith("_bytes"):
                base = parse_bytes
            known = (int, float, parse_bytes, human_readable_int, human_readable_int_or_auto)
            group.add_argument(*names, type=base if base in known else str, metavar=f.name.upper(), **kwargs)


def json_list_flag(text: str) -> list[str]:
    """A flag's value as a JSON list of strings (`'["https://a.example", "https://b.example"]'`), as vLLM parses
    --allowed-origins, --allowed-methods and --allowed-headers."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} (write e.g. '[\"*\"]')") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


class _CommaJoined(argparse.Action):
    """Several values stored as one comma-separated string."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(values))


def add_engine_flags(group, skip: frozenset[str] | set[str] = frozenset(), suppress_defaults: bool = False,
                     prefix: str = "engine_") -> None:
    """Flags for every engine argument (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)
    except `skip`."""
    seen = set(skip)
    for cls in ENGINE_SECTIONS:
        add_dataclass_flags(group, cls, prefix, frozenset(seen), suppress_defaults)
        seen |= {f.name for f in fields(cls)}
    from pagedllm.config.vllm_flags import ALIASES

    if "speculative_config" not in seen:
        group.add_argument("--speculative-config", *ALIASES["--speculative-config"],
                           dest=prefix + "speculative_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="Speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'. Methods: "
                                + ", ".join(SPECULATIVE_METHODS) + ". Default: off.")
    if "structured_outputs_config" not in seen:
        group.add_argument("--structured-outputs-config", dest=prefix + "structured_outputs_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="vLLM's JSON, e.g. '{\"backend\": \"guidance\"}'; backends: auto, guidance.")
    if "kv_transfer_config" not in seen:
        group.add_argument("--kv-transfer-config", dest=prefix + "kv_transfer_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="vLLM's JSON, e.g. '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": "
                                "\"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 4e9}}': a KV "
                                "connector (offload tier, disaggregated prefill/decode). Default: none.")
    if "kv_events_config" not in seen:
        group.add_argument("--kv-events-config", dest=prefix + "kv_events_config", metavar="JSON",
                           default=argparse.SUPPRESS if suppress_defaults else None,
                           help="vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}': publish the prefix "
                                "cache's BlockStored/BlockRemoved/AllBlocksCleared events on ZMQ. Keys: "
                                + ", ".join(f.name for f in fields(KVEventsConfig)) + ". Default: off.")



def engine_kwargs_from_args(args: argparse.Namespace, prefix: str = "engine_") -> dict[str, Any]:
    """The engine arguments present in a namespace filled by add_engine_flags."""
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}


def parse_bytes(text: str) -> int:
    """`4GiB`, `512M`, `1e9` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary.startswith("i") else 1000
    try:
        return int(float(number) * base ** " kmgt".index(unit or " "))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def human_readable_int(text: str) -> int:
    """vLLM's human-readable integers: `25.6k` = 25,600 (k, m, g, t: powers of 1000), `1K` = 1,024 (K, M, G, T:
    powers of 1024, no decimals; `1Gi` too, as the --kv-cache-memory-bytes help writes it), or a plain integer."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip()) or re.fullmatch(r"(\d+)([KMGT])i", text.strip())
    if match:
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 1000 ** " kmgt".index(suffix))
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix}: "
                                             f"{text!r} (did you mean {number}{suffix.lower()}?)")
        return int(number) * 1024 ** " KMGT".index(suffix)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer (1000, 32k, 1Gi...): {text!r}") from None


def human_readable_int_or_auto(text: str) -> int | None:
    """human_readable_int, or `auto` / `-1` (None here): the model's own value, as vLLM reads --max-model-len."""
    return None if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


# ---- vLLM's flags that pagedllm accepts (no effect) or refuses (config/vllm_flags.py) ----------------------------

_SPEC_TYPES = {"int": int, "float": float, "str": str, "json": str, "hri": human_readable_int}


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """The accepted and refused flags, with vLLM's option strings, nargs and types, in their own help group.
    A flag's value lands in `args.vllm_only_<name>` only when the flag is given."""
    from pagedllm.config.vllm_flags import VLLM_ONLY_FLAGS, vllm_option_strings

    group = parser.add_argument_group(
        "vLLM flags without effect (accepted) or not available (refused)",
        "Parsed as vLLM parses them; an accepted flag logs that it has no effect here, a refused one stops start-up "
        "with the reason (docs/vllm-flags.md).")
    strings = vllm_option_strings()
    for key, (spec, cls, note) in VLLM_ONLY_FLAGS.items():
        flag = key.split()[0]
        kwargs: dict[str, Any] = {"dest": VLLM_ONLY_PREFIX + flag[2:].replace("-", "_"), "default": argparse.SUPPRESS,
                                  "help": f"{cls}: {note}."}
        if spec == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec == "true":
            kwargs["action"] = "store_true"
        elif spec == "append":
            kwargs["action"] = "append"
        else:
            kwargs["type"] = _SPEC_TYPES[spec.rstrip("+?")]
            kwargs["metavar"] = "VALUE"
            if spec[-1] in "+?":
                kwargs["nargs"] = spec[-1]
        group.add_argument(*strings[flag], **kwargs)


def vllm_only_flags_given(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The accepted and the refused flags the user gave, each as (flag, note), in the table's order."""
    from pagedllm.config.vllm_flags import ACCEPTED, VLLM_ONLY_FLAGS

    given = {k[len(VLLM_ONLY_PREFIX):] for k in vars(args) if k.startswith(VLLM_ONLY_PREFIX)}
    accepted: list[tuple[str, str]] = []
    refused: list[tuple[str, str]] = []
    for key, (_, cls, note) in VLLM_ONLY_FLAGS.items():
        flag = key.split()[0]
        if flag[2:].replace("-", "_") in given:
            (accepted if cls == ACCEPTED else refused).append((flag, note))
    return accepted, refused


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configuration from `pagedllm serve`'s parsed flags.

    Raises ValueError (a message for the user, naming the flags) when a refused vLLM flag is given or the flags do
    not make a valid configuration. Logs one line per accepted vLLM flag given (it has no effect here).
    """
    accepted, refused = vllm_only_flags_given(args)
    if refused:
        raise ValueError("; ".join(f"{flag} is not supported by pagedllm: {note}" for flag, note in refused)
                         + " (docs/vllm-flags.md lists every vLLM flag and its status).")
    for flag, note in accepted:
        logger.info("%s has no effect in pagedllm: %s.", flag, note)
    engine_kwargs = engine_kwargs_from_args(args)
    server_kwargs = {k[len("server_"):]: v for k, v in vars(args).items() if k.startswith("server_")}
    if server_kwargs.get("api_key") is None and envs.VLLM_API_KEY is not None:
        server_kwargs["api_key"] = envs.VLLM_API_KEY
        parse_api_keys(server_kwargs["api_key"], "VLLM_API_KEY")  # a blank key, named where it came from
    _server_defaults_from_environment(server_kwargs)
    model = args.model or args.model_tag
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}.")
    engine, server = EngineConfig.from_kwargs(model=model, **engine_kwargs), ServerConfig(**server_kwargs)
    if server.api_server_count > 1 and envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        raise ValueError("VLLM_ALLOW_RUNTIME_LORA_UPDATING is not supported with --api-server-count above 1: an "
                         "adapter loaded at run time would be known to one API server only.")
    return engine, server


_SERVER_ENV_DEFAULTS = {"engine_startup_timeout": "VLLM_ENGINE_READY_TIMEOUT_S"}
"""ServerConfig fields whose default a vLLM environment variable sets, when it is set (envs.py)."""


def _server_defaults_from_environment(server_kwargs: dict[str, Any]) -> None:
    """vLLM's environment equivalents of server flags: where the flag keeps its default and the variable is set,
    the variable's value holds (a flag given with a value other than the default wins)."""
    defaults = {f.name: f.default for f in fields(ServerConfig)}
    for name, variable in _SERVER_ENV_DEFAULTS.items():
        value = getattr(envs, variable)
        if envs.is_set(variable) and value is not None and server_kwargs.get(name, defaults[name]) == defaults[name]:
            server_kwargs[name] = value
