"""`--config FILE`: flags from a YAML file, read as vLLM's FlexibleArgumentParser reads it, and vLLM's spelling of
flag names with underscores (`--max_num_seqs`).

The file's keys are flag names without the dashes (`-` or `_`), its values as on the command line:

    port: 8001
    max-num-seqs: 8
    enable_prefix_caching: false      # a switch: true gives --x, false gives --no-x (nothing where there is none)
    served-model-name: [a, b]          # a list: the flag followed by each item
    speculative-config:                # an object: the flag with its JSON
      method: ngram
      num_speculative_tokens: 4

They are inserted right after `serve` (and MODEL when it is given on the command line), so a flag on the command
line wins over the file, and the file over the defaults, as in vLLM. Unlike vLLM (argparse's "unrecognized
arguments"), a key that is no flag is refused naming the key and the file.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_NAME = re.compile(r"(?<=^--)[^=.]*")


def normalize_flag_names(argv: list[str]) -> list[str]:
    """`--max_num_seqs 4` and `--max_num_seqs=4` as `--max-num-seqs` (vLLM takes both spellings), and vLLM's
    `-O3` / `-O=3` / `-O 3` as `--optimization-level 3`; values are kept."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            out.append(_NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1))
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def load_config_file(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The file's flags as command-line arguments. Raises ValueError naming the file and, for an unknown key, the
    key."""
    import yaml

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise ValueError(f"--config {path}: the config file must be YAML (.yaml or .yml), as vLLM's.")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e.strerror or e}.") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: the file must be a mapping of flag names to values, as vLLM's.")
    known = parser._option_string_actions  # noqa: SLF001 - argparse's table of option strings
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: unknown key {key!r}: {flag} is not a `pagedllm serve` flag.")
        args += _as_args(flag, value, known)
    return args


def _as_args(flag: str, value: Any, known: dict) -> list[str]:
    if isinstance(value, bool):
        if value:
            return [flag]
        no_flag = "--no-" + flag[2:]
        return [no_flag] if no_flag in known else []
    if isinstance(value, list):
        return [flag, *map(str, value)] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`serve [MODEL] ... --config FILE ...` -> `serve [MODEL] <the file's flags> ...` (vLLM's order: the command
    line wins). argv starts with the subcommand. Raises ValueError as load_config_file does."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("more than one --config file given.")
    index = at[0]
    if argv[index] == "--config":
        if index + 1 >= len(argv):
            raise ValueError("--config needs a file: --config FILE.")
        path, rest = argv[index + 1], argv[:index] + argv[index + 2:]
    else:
        path, rest = argv[index].split("=", 1)[1], argv[:index] + argv[index + 1:]
    file_args = load_config_file(path, parser)
    model_in_cli = len(rest) > 1 and not rest[1].startswith("-")
    if model_in_cli and "--model" in file_args:  # vLLM keeps the command line's MODEL
        at_model = file_args.index("--model")
        del file_args[at_model:at_model + 2]
    head = 2 if model_in_cli else 1  # serve [MODEL]
    return rest[:head] + file_args + rest[head:]
