"""The small routes deployments probe (issue 35 item 7) and `pagedllm chat` / `pagedllm complete` (item 8), against
one real server: GET /load with --enable-server-load-tracking, vLLM's development routes (/reset_prefix_cache,
/sleep, /wake_up, /is_sleeping) with --enable-debug-routes, sleep mode (--enable-sleep-mode), the API key on every
new route, and the terminal clients' text against the same requests made directly."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from server_utils import MODEL_NAME, RemoteServer

from pagedllm.entrypoints.openai.dev_routes import dev_mode

pytestmark = pytest.mark.slow

KEY = "sleepy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores the KV cache in fixed-size blocks."
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # greedy and 12 tokens by default, so that the terminal clients (which send no sampling parameters, as
    # vLLM's) are deterministic and short
    s = RemoteServer(tiny_llama_dir, "--enable-sleep-mode", "--enable-server-load-tracking",
                     "--enable-prompt-tokens-details", "--api-key", KEY,
                     "--override-generation-config", '{"temperature": 0.0, "max_new_tokens": 12}')
    s.headers = AUTH
    yield s
    s.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _complete(server: RemoteServer, **kwargs):
    return server.client(api_key=KEY).completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs)


def test_new_routes_need_the_api_key_as_every_route_but_health(server):
    for method, path in (("GET", "/load"), ("GET", "/is_sleeping"), ("POST", "/sleep"), ("POST", "/wake_up"),
                         ("POST", "/reset_prefix_cache")):
        assert getattr(server, method.lower())(path).status_code == 401, path
    assert server.get("/health").status_code == 200
    assert server.get("/load", headers=AUTH).json() == {"server_load": 0}


def test_load_counts_the_requests_being_served(server):
    stream = _complete(server, stream=True, **LONG)
    next(iter(stream))
    assert server.get("/load", headers=AUTH).json() == {"server_load": 1}
    # a prefix cache in use cannot be reset (vLLM: success false, retry when idle)
    assert server.post("/reset_prefix_cache", headers=AUTH).json() == {"success": False}
    stream.close()  # the client goes away: its request ends, and with it the count
    server.wait_idle()
    deadline = time.monotonic() + 10
    while server.get("/load", headers=AUTH).json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.get("/load", headers=AUTH).json() == {"server_load": 0}


def test_reset_prefix_cache_forgets_cached_prefixes(server):
    _complete(server, max_tokens=2)
    assert _complete(server, max_tokens=2).usage.prompt_tokens_details.cached_tokens > 0
    server.wait_idle()
    assert server.post("/reset_prefix_cache", headers=AUTH).json() == {"success": True}
    hits, queries = server.metric("vllm:prefix_cache_hits_total"), server.metric("vllm:prefix_cache_queries_total")
    assert _complete(server, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 0
    assert server.metric("vllm:prefix_cache_hits_total") == hits
    assert server.metric("vllm:prefix_cache_queries_total") > queries
    response = server.post("/reset_prefix_cache?reset_running_requests=true", headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "reset_running_requests"


def test_sleep_frees_memory_queues_requests_and_wake_up_restores_greedy_output(server):
    before = _complete(server, max_tokens=12).choices[0].text
    pid = server.kv_cache()["engine_pid"]
    rss_awake = _rss_bytes(pid)

    stream = _complete(server, stream=True, **LONG)  # open when the engine falls asleep: aborted
    next(iter(stream))
    assert server.post("/sleep?level=1", headers=AUTH).json() == {"status": "sleeping", "level": 1}
    assert [c.choices[0].finish_reason for c in stream][-1] == "abort"
    assert server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert server.metric('vllm:engine_sleep_state{model_name="tiny",sleep_state="weights_offloaded"}') == 1.0
    assert server.metric('vllm:engine_sleep_state{model_name="tiny",sleep_state="awake"}') == 0.0
    assert rss_awake - _rss_bytes(pid) > 32 << 20  # the 64 MiB KV pool (and the weights) went back to the OS

    result = {}
    waiting = threading.Thread(target=lambda: result.setdefault("text", _complete(server, max_tokens=12)
                                                                .choices[0].text))
    waiting.start()  # arrives while asleep: waits for wake_up, as in vLLM
    time.sleep(1.0)
    assert waiting.is_alive() and server.get("/health").status_code == 200
    assert server.post("/wake_up?tags=bogus", headers=AUTH).status_code == 400
    assert server.post("/wake_up?tags=weights", headers=AUTH).json() == {"status": "sleeping", "tags": ["weights"]}
    assert waiting.is_alive()
    assert server.post("/wake_up?tags=kv_cache", headers=AUTH).json() == {"status": "awake", "tags": ["kv_cache"]}
    waiting.join(30)
    assert result["text"] == before
    assert server.get("/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert server.metric('vllm:engine_sleep_state{model_name="tiny",sleep_state="awake"}') == 1.0

    assert server.post("/sleep?level=3", headers=AUTH).status_code == 400
    assert server.post("/sleep?level=2", headers=AUTH).json() == {"status": "sleeping", "level": 2}
    assert server.post("/wake_up", headers=AUTH).json() == {"status": "awake", "tags": None}
    after = _complete(server, max_tokens=12)
    assert after.choices[0].text == before and after.usage.prompt_tokens_details.cached_tokens == 0


def _cli(server: RemoteServer, *args: str, stdin: str = "") -> str:
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", *args, "--url", server.url + "/v1",
                           "--api-key", KEY], input=stdin, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_complete_quick_prints_the_greedy_completion(server):
    expected = _complete(server, max_tokens=10).choices[0].text
    assert _cli(server, "complete", "--quick", PROMPT, "--max-tokens", "10") == f"Using model: {MODEL_NAME}\n" \
                                                                                 f"{expected}\n"


def test_chat_reads_stdin_until_eof_keeping_the_conversation(server):
    client = server.client(api_key=KEY)
    conversation = [{"role": "system", "content": "Be brief."}]
    expected = []
    for line in ("Hello world!", "How are you today?"):
        conversation.append({"role": "user", "content": line})
        text = client.chat.completions.create(model=MODEL_NAME, messages=conversation).choices[0].message.content
        conversation.append({"role": "assistant", "content": text})
        expected.append(text)
    out = _cli(server, "chat", "--system-prompt", "Be brief.", stdin="Hello world!\nHow are you today?\n")
    assert out == (f"Using model: {MODEL_NAME}\nPlease enter a message for the chat model:\n"
                   f"> {expected[0]}\n> {expected[1]}\n> ")


def test_dev_mode_switches(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not dev_mode(False) and dev_mode(True)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_mode(False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not dev_mode(False)
