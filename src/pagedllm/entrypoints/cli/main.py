"""The `pagedllm` command. Subcommands import their heavy modules only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers) and cmd(args)
SUBCOMMANDS = {
    "serve": "pagedllm.entrypoints.cli.serve",
    "bench": "pagedllm.entrypoints.cli.bench",
    "chat": "pagedllm.entrypoints.cli.chat",
    "complete": "pagedllm.entrypoints.cli.complete",
    "plan": "pagedllm.entrypoints.cli.plan",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="pagedllm", description="Serve and benchmark LLMs with a paged KV cache.")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="subcommand", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, module_name in SUBCOMMANDS.items():
        if name == chosen:
            module = importlib.import_module(module_name)
            subparser = module.add_parser(subparsers)
            if hasattr(module, "preprocess_argv"):  # serve: --config FILE, --flag_names_with_underscores
                argv = module.preprocess_argv(argv, subparser)
        else:
            subparsers.add_parser(name, help=f"see `pagedllm {name} --help`")
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help()
        return 2
    return importlib.import_module(SUBCOMMANDS[args.subcommand]).cmd(args) or 0


def _version() -> str:
    from pagedllm import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
