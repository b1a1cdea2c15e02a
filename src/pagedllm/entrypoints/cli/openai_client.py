"""`pagedllm chat` and `pagedllm complete`: a terminal client for a running OpenAI-compatible server, as `vllm chat`
and `vllm complete` (the same flags and output).

Both connect with the `openai` client to --url (default http://localhost:8000/v1), with --api-key (default: the
OPENAI_API_KEY environment variable, else "EMPTY"), and use --model-name (default: the first model /v1/models
lists, printed as "Using model: NAME"). `-q/--quick MESSAGE` sends one message and exits; without it they read
one line after another from stdin (prompt "> ") until end of input, streaming each answer to stdout. `chat`
keeps the conversation (with --system-prompt first) and prints reasoning between <think> and </think>;
`complete` sends each line as a new prompt (--max-tokens). --stats prints TTFT and tokens/s after each answer.
Like vLLM's, they send no sampling parameters but max_tokens: the server's defaults apply (the model's generation
config, or --override-generation-config).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from pagedllm import envs


def add_query_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", type=str, default="http://localhost:8000/v1",
                        help="url of the running OpenAI-Compatible RESTful API server")
    parser.add_argument("--model-name", type=str, default=None,
                        help="The model name used in prompt completion, default to the first model in list models "
                             "API call.")
    parser.add_argument("--api-key", type=str, default=None,
                        help="API key for OpenAI services. If provided, this api key will overwrite the api key "
                             "obtained through environment variables (OPENAI_API_KEY).")
    parser.add_argument("--stats", action="store_true", help="Print TTFT and TPS statistics after each response.")


def connect(args: argparse.Namespace):
    """(model name, openai.OpenAI client); Ctrl-C and Ctrl-Z end the program quietly (exit code 0), as vLLM's."""
    from openai import OpenAI

    for sig in (signal.SIGINT, signal.SIGTSTP):
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    client = OpenAI(api_key=args.api_key or envs.OPENAI_API_KEY or "EMPTY", base_url=args.url)
    model_name = args.model_name or client.models.list().data[0].id
    print(f"Using model: {model_name}")
    return model_name, client


def read_lines(banner: str):
    """The lines typed (or piped) after the banner, each after a "> " prompt, until end of input."""
    print(banner)
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def print_chat_stream(stream, stats: bool = False) -> str:
    """Print the answer's content as it streams (reasoning between <think> and </think>); returns the content."""
    output = ""
    in_reasoning = False
    start = time.perf_counter()
    ttft = None
    completion_tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = getattr(delta, "reasoning", None) or getattr(delta, "reasoning_content", None)
        if ttft is None and (reasoning or delta.content):
            ttft = time.perf_counter() - start
        if reasoning:
            if not in_reasoning:
                print("<think>", flush=True)
                in_reasoning = True
            print(reasoning, end="", flush=True)
        if delta.content:
            if in_reasoning:
                print("\n</think>", flush=True)
                in_reasoning = False
            output += delta.content
            print(delta.content, end="", flush=True)
    if in_reasoning:
        print("\n</think>", end="", flush=True)
    print()
    if stats:
        print_metrics(start, ttft, completion_tokens)
    return output


def print_completion_stream(stream, stats: bool = False) -> str:
    output = ""
    start = time.perf_counter()
    ttft = None
    completion_tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        text = chunk.choices[0].text
        if text:
            if ttft is None:
                ttft = time.perf_counter() - start
            output += text
            print(text, end="", flush=True)
    print()
    if stats:
        print_metrics(start, ttft, completion_tokens)
    return output


def print_metrics(start: float, ttft: float | None, completion_tokens: int) -> None:
    total_s = time.perf_counter() - start
    if ttft is None or total_s <= 0:
        return
    print(f"{'TTFT:':<5} {ttft * 1000:.2f} ms")
    print(f"{'TPS:':<5} {completion_tokens / total_s:.2f} tokens/s ({completion_tokens} tokens in {total_s:.2f}s)")
