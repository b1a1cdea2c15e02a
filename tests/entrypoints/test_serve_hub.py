"""`pagedllm serve ORG/NAME` (issue 33 item 4), offline from a Hugging Face cache that huggingface_hub filled
(`tiny_hub_cache`, tests/conftest.py): the served model name is the repo id, as in vLLM, and a chat completion
answers; a repo the cache lacks stops the start-up with one line naming it and the cache."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from fake_hub import HUB_REPO
from server_process import free_port, serve_env, wait_healthy

pytestmark = pytest.mark.slow


def _serve(hf_home, *args: str) -> tuple[list[str], dict[str, str]]:
    env = serve_env({"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    env.pop("HF_HUB_CACHE", None)
    return [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *args, "--host", "127.0.0.1",
            "--dtype", "float32", "--kv-cache-memory", "64MiB", "--disable-log-stats",
            "--uvicorn-log-level", "warning"], env


def test_serve_a_repo_id_offline_from_the_cache(tiny_hub_cache):
    port = free_port()
    command, env = _serve(tiny_hub_cache.hf_home, HUB_REPO, "--port", str(port))
    proc = subprocess.Popen(command, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [HUB_REPO]
        chat = client.chat.completions.create(model=HUB_REPO, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=5, temperature=0.0)
        assert chat.model == HUB_REPO and chat.usage.completion_tokens > 0
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_a_repo_the_cache_lacks_fails_in_one_line(tiny_hub_cache):
    command, env = _serve(tiny_hub_cache.hf_home, "--model", "tiny-org/not-downloaded", "--port", str(free_port()))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "failed to start" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "tiny-org/not-downloaded (revision main)" in errors[0] and "HF_HUB_OFFLINE is set" in errors[0]
    assert str(tiny_hub_cache.hf_home / "hub") in errors[0]
    assert "Traceback" not in done.stderr
