"""`pagedllm complete`: complete prompts with a running server from the terminal, as `vllm complete`
(cli/openai_client.py)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.cli.openai_client import add_query_options, connect, print_completion_stream, read_lines

DESCRIPTION = "Generate text completions based on the given prompt via the running API server."


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("complete", help=DESCRIPTION, description=DESCRIPTION,
                                   usage="pagedllm complete [options]")
    add_query_options(parser)
    parser.add_argument("--max-tokens", type=int, help="Maximum number of tokens to generate per output sequence.")
    parser.add_argument("-q", "--quick", type=str, metavar="PROMPT",
                        help="Send a single prompt and print the completion output, then exit.")
    return parser


def cmd(args: argparse.Namespace) -> int:
    model_name, client = connect(args)
    kwargs: dict = {"model": model_name, "stream": True}
    if args.max_tokens is not None:
        kwargs["max_tokens"] = args.max_tokens
    if args.stats:
        kwargs["stream_options"] = {"include_usage": True}
    prompts = [args.quick] if args.quick is not None else read_lines("Please enter prompt to complete:")
    for prompt in prompts:
        print_completion_stream(client.completions.create(prompt=prompt, **kwargs), args.stats)
    return 0
