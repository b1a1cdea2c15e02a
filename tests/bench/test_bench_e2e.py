"""`pagedllm bench serve` against a real `pagedllm serve` process with the tiny test model."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from fake_openai_server import free_port

pytestmark = pytest.mark.slow

SERVER_MODULE = "pagedllm.entrypoints.cli.serve"
STARTUP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def pagedllm_server(tiny_llama_dir):
    if importlib.util.find_spec(SERVER_MODULE) is None:
        pytest.skip(f"{SERVER_MODULE} does not exist yet")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", str(tiny_llama_dir),
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--disable-log-stats", "--disable-log-requests",
         "--uvicorn-log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"pagedllm serve exited with code {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pagedllm serve did not become healthy"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _bench(capsys, *args: str) -> str:
    """Run `pagedllm bench serve ARGS` in this process (the CLI entry point, minus a second interpreter's
    start-up); returns its stdout."""
    from pagedllm.entrypoints.cli.main import main

    assert main(["bench", "serve", *args]) == 0
    return capsys.readouterr().out


def test_bench_serve_against_pagedllm_serve(pagedllm_server, tiny_llama_dir, tmp_path, capsys):
    stdout = _bench(capsys, "--base-url", pagedllm_server, "--model", "tiny", "--tokenizer", str(tiny_llama_dir),
                  "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
                  "--num-prompts", "8", "--max-concurrency", "4", "--percentile-metrics", "ttft,tpot,itl,e2el",
                  "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
                  "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm")
    assert "============ Serving Benchmark Result ============" in stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (8, 0), result["errors"]
    assert result["output_lens"] == [8] * 8  # random prompts run with ignore_eos
    assert all(len(itl) == 7 for itl in result["itls"])
    assert all(abs(n - 32) <= 2 for n in result["input_lens"])  # the server's prompt_tokens
    assert result["max_concurrent_requests"] <= 8
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["p99_itl_ms"] >= result["p50_itl_ms"] > 0


def test_bench_serve_prefix_repetition_over_chat(pagedllm_server, tiny_llama_dir, tmp_path, capsys):
    _bench(capsys, "--base-url", pagedllm_server, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                  "--tokenizer", str(tiny_llama_dir), "--dataset-name", "prefix-repetition",
                  "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
                  "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4",
                  "--num-prompts", "4", "--ignore-eos", "--save-result", "--save-detailed",
                  "--result-dir", str(tmp_path), "--result-filename", "c.json", "--disable-tqdm")
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["model_id"] == "tiny"  # from /v1/models
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["output_lens"] == [4] * 4
