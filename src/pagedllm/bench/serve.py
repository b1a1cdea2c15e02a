"""`pagedllm bench serve`: a load generator for any OpenAI-compatible server, flag- and
result-compatible with `vllm bench serve`.

Requests leave at a fixed rate (`--request-rate inf`: all at once), or with gamma-distributed gaps
(`--burstiness 1`: a Poisson process), at most `--max-concurrency` in flight; each one streams and is timed
by `request_func`. The run ends with vLLM's summary table and, with `--save-result`, its JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from pagedllm.bench import datasets
from pagedllm.bench.copy_heavy import sample_copy_heavy
from pagedllm.bench.datasets import SampleRequest
from pagedllm.bench.metrics import PERCENTILE_METRICS, calculate_metrics
from pagedllm.bench.report import DETAILED_FIELDS, build_result, format_table
from pagedllm.bench.request_func import REQUEST_FUNCS, RequestFuncInput, RequestFuncOutput

logger = logging.getLogger(__name__)

DATASETS = ("random", "prefix-repetition", "prefix_repetition", "copy-heavy", "custom")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register `vllm bench serve`'s flags (the subset this client implements) on `parser`."""
    parser.add_argument("--backend", default="openai", choices=sorted(REQUEST_FUNCS),
                        help="API flavour: openai (/v1/completions) or openai-chat (/v1/chat/completions).")
    parser.add_argument("--base-url", default=None, help="Server base URL, instead of --host and --port.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", help="API path appended to the base URL.")
    parser.add_argument("--model", default=None,
                        help="Model name sent to the server; default: the first model of /v1/models.")
    parser.add_argument("--served-model-name", default=None,
                        help="Name sent in requests when it differs from --model.")
    parser.add_argument("--tokenizer", default=None,
                        help="Hugging Face folder or .gguf file of the tokenizer; default: --model.")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--label", default=None, help="Prefix of the result file name; default: --backend.")
    _add_dataset_args(parser)
    _add_traffic_args(parser)
    _add_sampling_args(parser)
    _add_result_args(parser)


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=DATASETS)
    group.add_argument("--dataset-path", default=None, help="The JSONL file of --dataset-name custom.")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--input-len", type=int, default=None, help="Sets --random-input-len.")
    group.add_argument("--output-len", type=int, default=None,
                       help="Sets the output length of every dataset (--random-output-len, ...).")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--disable-shuffle", action="store_true", help="Keep the dataset's order.")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="Lengths are drawn from [len * (1 - r), len * (1 + r)].")
    group.add_argument("--random-prefix-len", type=int, default=0,
                       help="Random tokens shared by every prompt, before its random-input-len tokens.")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group.add_argument("--copy-heavy-output-len", type=int, default=256,
                       help="Output tokens of every copy-heavy prompt (repeat, edit or reformat given text or code).")
    group.add_argument("--custom-output-len", type=int, default=256,
                       help="Output tokens of every custom prompt; -1 takes each line's \"output_tokens\".")
    group.add_argument("--skip-chat-template", action="store_true",
                       help="Send custom prompts as they are, not wrapped in the chat template.")
    group.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                       help="Request i is sent with the header x-request-id: PREFIX + i.")


def _add_traffic_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traffic")
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Requests per second; inf sends every request at once.")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="Shape of the gamma-distributed gaps: 1 is Poisson, <1 burstier, >1 more even.")
    group.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    group.add_argument("--num-warmups", type=int, default=0, help="Requests sent (and discarded) first.")
    group.add_argument("--ready-check-timeout-sec", type=int, default=0,
                       help="Retry a first test request this long until the server answers; 0 skips it.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--ignore-eos", action="store_true", help="Ask the server not to stop at EOS.")
    group.add_argument("--logprobs", type=int, default=None)
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--extra-body", type=json.loads, default=None,
                       help="JSON object merged into every request body.")


def _add_result_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("result")
    group.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                       help=f"Comma-separated metrics to report percentiles of: {','.join(PERCENTILE_METRICS)}.")
    group.add_argument("--metric-percentiles", default="99", help="Comma-separated percentiles, e.g. 50,90,99.")
    group.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                       help="Service-level objectives (ttft, tpot, e2el in ms) for the goodput count.")
    group.add_argument("--save-result", action="store_true", help="Write the result JSON.")
    group.add_argument("--save-detailed", action="store_true",
                       help="Keep the per-request lists (input_lens, ttfts, itls, generated_texts, ...) in it.")
    group.add_argument("--result-dir", default=None)
    group.add_argument("--result-filename", default=None)
    group.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                       help="Extra KEY=VALUE pairs stored in the result JSON.")


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """Build the requests of `--dataset-name` from the parsed flags."""
    if args.dataset_name == "random":
        return datasets.sample_random(
            tokenizer, args.num_prompts, input_len=args.random_input_len, output_len=args.random_output_len,
            range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len, seed=args.seed,
            request_id_prefix=args.request_id_prefix)
    if args.dataset_name in ("prefix-repetition", "prefix_repetition"):
        return datasets.sample_prefix_repetition(
            tokenizer, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len, num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len, seed=args.seed, shuffle=not args.disable_shuffle,
            request_id_prefix=args.request_id_prefix)
    if args.dataset_name == "copy-heavy":
        return sample_copy_heavy(tokenizer, args.num_prompts, output_len=args.copy_heavy_output_len, seed=args.seed,
                                 shuffle=not args.disable_shuffle, skip_chat_template=args.skip_chat_template,
                                 request_id_prefix=args.request_id_prefix)
    if args.dataset_path is None:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl.")
    return datasets.sample_custom(
        tokenizer, args.dataset_path, args.num_prompts, output_len=args.custom_output_len,
        skip_chat_template=args.skip_chat_template, seed=args.seed, shuffle=not args.disable_shuffle,
        request_id_prefix=args.request_id_prefix)


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.RandomState) -> list[float]:
    """Send time of each request, in seconds after the first.

    Gaps are gamma(shape=burstiness, scale=1 / (rate * burstiness)), mean 1 / rate; the cumulative times are
    then scaled so the last request leaves at exactly num_requests / rate, which keeps throughput stable
    across seeds. An infinite rate sends everything at t=0.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}.")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if burstiness == float("inf"):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def paced(requests: list[SampleRequest], offsets: list[float]) -> AsyncIterator[SampleRequest]:
    """Yield each request at its offset from now."""
    start = time.perf_counter()
    for request, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield request


async def get_first_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"The server at {base_url} lists no model; pass --model.")
    return models[0]["id"]


async def run_benchmark(args: argparse.Namespace, api_url: str, model_id: str, model_name: str | None,
                        tokenizer, requests: list[SampleRequest]) -> dict[str, Any]:
    """Send `requests` as the traffic flags say and return the per-run part of the result."""
    request_func = REQUEST_FUNCS[args.backend]
    extra_body = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                    ("top_k", args.top_k), ("min_p", args.min_p)) if v is not None}
    extra_body.update(args.extra_body or {})

    def to_input(request: SampleRequest) -> RequestFuncInput:
        return RequestFuncInput(
            prompt=request.prompt, api_url=api_url, prompt_len=request.prompt_len,
            output_len=request.expected_output_len, model=model_id, model_name=model_name,
            logprobs=args.logprobs, extra_body=extra_body or None, ignore_eos=args.ignore_eos,
            request_id=request.request_id)

    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, limit_per_host=args.max_concurrency or 0,
                                     keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True) as session:
        await _ready_check(request_func, to_input(requests[0]), session, args.ready_check_timeout_sec)
        if args.num_warmups > 0:
            logger.info("Warming up with %d requests...", args.num_warmups)
            await asyncio.gather(*(request_func(to_input(requests[0]), session) for _ in range(args.num_warmups)))
        logger.info("Traffic request rate: %s", args.request_rate)
        logger.info("Burstiness factor: %s (%s)", args.burstiness,
                    "Poisson process" if args.burstiness == 1.0 else "Gamma distribution")
        logger.info("Maximum request concurrency: %s", args.max_concurrency)
        offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness,
                                  np.random.RandomState(args.seed))
        pbar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(requests))
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def limited(inp: RequestFuncInput, arrival_time: float) -> RequestFuncOutput:
            async with semaphore:
                output = await request_func(inp, session, pbar)
            output.client_queue_time = output.start_time - arrival_time
            return output

        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(to_input(r), time.perf_counter()))
                 async for r in paced(requests, offsets)]
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        if pbar is not None:
            pbar.close()

    goodput = parse_goodput(args.goodput)
    metrics, output_lens = calculate_metrics(outputs, duration_s, tokenizer, goodput)
    return build_result(metrics, outputs, output_lens, duration_s, selected_metrics(args),
                        selected_percentiles(args), bool(goodput), args.max_concurrency, args.request_rate)


async def _ready_check(request_func, inp: RequestFuncInput, session: aiohttp.ClientSession,
                       timeout_s: int) -> None:
    if timeout_s <= 0:
        return
    logger.info("Waiting up to %d s for the endpoint to answer a test request...", timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        output = await request_func(inp, session)
        if output.success:
            return
        if time.monotonic() > deadline:
            raise ValueError(f"The test request still fails after {timeout_s} s: {output.error}")
        await asyncio.sleep(1)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes KEY:MS with KEY one of ttft, tpot, e2el; got {pair!r}.")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair}: the objective must be non-negative.")
    return slos


def selected_metrics(args: argparse.Namespace) -> list[str]:
    names = [name.strip() for name in args.percentile_metrics.split(",") if name.strip()]
    if unknown := [name for name in names if name not in PERCENTILE_METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {list(PERCENTILE_METRICS)}.")
    return names


def selected_percentiles(args: argparse.Namespace) -> list[float]:
    return [float(p) for p in args.metric_percentiles.split(",")]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run `bench serve`. Returns the result JSON object and the summary table text; with
    `--save-result`, the JSON is written first."""
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from pagedllm.bench.tokenizer import get_tokenizer

    logger.info("%s", args)
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be at least 1.")
    selected_metrics(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_url = f"{base_url}{args.endpoint}"
    model_id = args.model or await get_first_model(base_url)
    tokenizer_id = args.tokenizer or model_id
    tokenizer = get_tokenizer(tokenizer_id, trust_remote_code=args.trust_remote_code)
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.custom_output_len = args.prefix_repetition_output_len = args.output_len
        args.copy_heavy_output_len = args.output_len
    if args.dataset_name == "random":
        args.ignore_eos = True  # as vLLM: random prompts run to the requested length
    if args.temperature is None:
        logger.warning("No --temperature: the server's default applies (vLLM's client no longer sends 0).")
    requests = get_samples(args, tokenizer)
    if args.dataset_name != "custom":
        requests = await align_to_server_tokenizer(base_url, model_id, requests)
    benchmark_result = await run_benchmark(args, api_url, model_id, args.served_model_name, tokenizer, requests)

    current_dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": current_dt,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE pairs; got {item!r}.")
        result[key.strip()] = value.strip()
    result["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    result["burstiness"] = args.burstiness
    result["max_concurrency"] = args.max_concurrency
    result.update(benchmark_result)
    table = format_table(result, selected_metrics(args), args.max_concurrency, args.request_rate)
    if not args.save_detailed:
        for key in DETAILED_FIELDS:
            result.pop(key, None)
    if args.save_result:
        path = result_path(args, model_id, current_dt)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        logger.info("Saved the result to %s", path)
    return result, table


async def align_to_server_tokenizer(base_url: str, model_id: str,
                                    requests: list[SampleRequest]) -> list[SampleRequest]:
    """Cut prompts that the server's tokenizer splits into more tokens than ours, as vLLM's client does.

    Asks the server's /tokenize for the first prompt; when that count matches, or the server has no
    /tokenize of vLLM's shape (none, or llama.cpp's, which answers no tokens), the prompts go as they are.
    Otherwise each longer prompt is cut to `prompt_len` server tokens and turned back into text with /detokenize.
    """
    if not requests or not isinstance(requests[0].prompt, str):
        return requests
    async with aiohttp.ClientSession() as session:
        async def tokenize(prompt: str) -> list[int]:
            body = {"model": model_id, "prompt": prompt, "add_special_tokens": False}
            async with session.post(f"{base_url}/tokenize", json=body) as response:
                response.raise_for_status()
                return (await response.json())["tokens"]

        try:
            num_server_tokens = len(await tokenize(requests[0].prompt))
        except (aiohttp.ClientError, KeyError, ValueError):
            logger.info("The server has no /tokenize; prompts are sent as generated.")
            return requests
        if num_server_tokens == 0:  # llama.cpp's /tokenize reads "content" and answers [] to this request
            logger.info("The server's /tokenize does not take vLLM's request; prompts are sent as generated.")
            return requests
        if num_server_tokens == requests[0].prompt_len:
            return requests
        logger.warning("Tokenizer mismatch (server %d tokens, expected %d): re-aligning prompts.",
                       num_server_tokens, requests[0].prompt_len)
        for request in requests:
            try:
                token_ids = await tokenize(request.prompt)
                if len(token_ids) > request.prompt_len:
                    body = {"model": model_id, "tokens": token_ids[:request.prompt_len]}
                    async with session.post(f"{base_url}/detokenize", json=body) as response:
                        response.raise_for_status()
                        request.prompt = (await response.json())["prompt"]
            except (aiohttp.ClientError, KeyError, ValueError) as e:
                logger.warning("Could not re-align request %s: %s", request.request_id, e)
    return requests


def result_path(args: argparse.Namespace, model_id: str, current_dt: str) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, in --result-dir."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    file_name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{current_dt}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        file_name = os.path.join(args.result_dir, file_name)
    return file_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm bench serve", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _, table = run(args)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
