"""`pagedllm chat`: chat with a running server from the terminal, as `vllm chat` (cli/openai_client.py)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.cli.openai_client import add_query_options, connect, print_chat_stream, read_lines

DESCRIPTION = "Generate chat completions via the running API server."


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help=DESCRIPTION, description=DESCRIPTION, usage="pagedllm chat [options]")
    add_query_options(parser)
    parser.add_argument("--system-prompt", type=str, default=None,
                        help="The system prompt to be added to the chat template, used for models that support "
                             "system prompts.")
    parser.add_argument("-q", "--quick", type=str, metavar="MESSAGE",
                        help="Send a single prompt as MESSAGE and print the response, then exit.")
    return parser


def cmd(args: argparse.Namespace) -> int:
    model_name, client = connect(args)
    conversation: list[dict] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    create_kwargs: dict = {"model": model_name, "stream": True}
    if args.stats:
        create_kwargs["stream_options"] = {"include_usage": True}
    messages = [args.quick] if args.quick is not None else read_lines("Please enter a message for the chat model:")
    for message in messages:
        conversation.append({"role": "user", "content": message})
        output = print_chat_stream(client.chat.completions.create(messages=conversation, **create_kwargs),
                                   args.stats)
        conversation.append({"role": "assistant", "content": output})
    return 0
