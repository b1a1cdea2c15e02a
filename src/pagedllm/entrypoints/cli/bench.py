"""`pagedllm bench serve | throughput | latency`: the benchmark subcommands, named and flagged as vLLM's."""

from __future__ import annotations

import argparse
import logging
import sys

# bench subcommand -> (module, help)
BENCH_COMMANDS = {
    "serve": ("pagedllm.bench.serve", "Load-test an OpenAI-compatible server (like `vllm bench serve`)."),
    "throughput": ("pagedllm.bench.throughput", "Offline generation throughput through LLM.generate."),
    "latency": ("pagedllm.bench.latency", "Latency of one batch, and of one decode step."),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    import importlib

    parser = subparsers.add_parser("bench", help="Benchmark a server or the offline engine.",
                                   description="Benchmark a server or the offline engine.")
    bench_subparsers = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(BENCH_COMMANDS) + "}")
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        sub = bench_subparsers.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_cli_args(sub)
    parser.set_defaults(bench_parser=parser)
    return parser


def cmd(args: argparse.Namespace) -> int:
    bench_parser = vars(args).pop("bench_parser")
    if not getattr(args, "bench_command", None):
        bench_parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.bench_command == "serve":
            from pagedllm.bench import serve

            _, table = serve.run(args)
            print(table)
        else:
            import importlib

            module = importlib.import_module(BENCH_COMMANDS[args.bench_command][0])
            result = module.run(args)
            print(module.format_result(result))
            if args.output_json:
                module.save(result, args.output_json)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
