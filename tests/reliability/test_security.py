"""Security: no pickle on the engine socket, private ipc sockets, the API key on every route whatever the
path spelling or Host, the key out of the logs, cache isolation by salt and by API key."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import socket
import stat
import time

import pytest
from reliability_utils import MODEL_NAME, Server, assert_error_body, wait_for

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.messages import EngineCoreRequest, Outputs
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

KEYS = ("sk-tenant-one-5f2c9e", "sk-tenant-two-a81d04")
PROMPT = " ".join(["paged attention keeps the key value cache in fixed size blocks"] * 4)


class _Canary:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_frame_to_engine_socket_has_no_effect(tiny_llama_dir, tmp_path):
    canary = tmp_path / "canary"

    async def scenario():
        config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 << 20)
        client = await EngineCoreClient.start(config, startup_timeout_s=120)
        try:
            assert client.socket_dir and stat.S_IMODE(os.stat(client.socket_dir).st_mode) == 0o700
            assert sorted(os.listdir(client.socket_dir)) == ["input", "output"]
            assert all(stat.S_ISSOCK(os.stat(os.path.join(client.socket_dir, n)).st_mode) for n in ("input", "output"))
            messages: asyncio.Queue = asyncio.Queue()
            client.on_message = messages.put_nowait
            for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
                await client.input_socket.send(pickle.dumps(_Canary(str(canary)), protocol=protocol))
            await client.add_request(EngineCoreRequest(
                request_id="after-pickle", prompt_token_ids=list(range(20, 40)), eos_token_id=None,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                arrival_time=time.time()))
            tokens = []
            while True:
                message = await asyncio.wait_for(messages.get(), 30)
                if isinstance(message, Outputs):
                    out = next((o for o in message.outputs.outputs if o.request_id == "after-pickle"), None)
                    if out is not None:
                        tokens += out.new_token_ids
                        if out.finished:
                            break
            assert len(tokens) == 3 and not client.is_dead
        finally:
            client.shutdown()

    asyncio.run(scenario())
    # the frames were dropped before the request after them was served; a code run would have been done
    assert not canary.exists(), "a pickle frame sent to the engine socket ran code"


def _listening_inodes() -> dict[int, str]:
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes[int(fields[9])] = fields[1]
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


@pytest.fixture(scope="module", autouse=True)
def _keyed_server_launch(launcher):
    """Two tenants' keys, /metrics guarded, cache salts derived from the key: one server for the module,
    launched before the first test so that its start-up overlaps the engine-socket test's."""
    return launcher("--api-key", ",".join(KEYS), "--protect-metrics", "--cache-salt-from-api-key",
                    "--enable-prompt-tokens-details", "--enable-log-requests", api_key=KEYS[0], wait_ready=False)


@pytest.fixture
def keyed_server(_keyed_server_launch):
    return _keyed_server_launch.wait_ready()


def test_engine_sockets_are_private_ipc_and_only_http_listens(keyed_server):
    engine_pid = keyed_server.engine_pid()
    cmdline = open(f"/proc/{engine_pid}/cmdline").read().split("\0")
    addrs = [cmdline[i + 1] for i, arg in enumerate(cmdline) if arg in ("--input-addr", "--output-addr")]
    assert len(addrs) == 2 and all(a.startswith("ipc://") for a in addrs)
    socket_dir = os.path.dirname(addrs[0][len("ipc://"):])
    st = os.stat(socket_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    listening = _listening_inodes()
    assert not _socket_inodes(engine_pid) & set(listening), "the engine core listens on a TCP port"
    server_listens = [listening[i] for i in _socket_inodes(keyed_server.proc.pid) if i in listening]
    assert server_listens == [f"0100007F:{keyed_server.port:04X}"], server_listens  # 127.0.0.1:PORT only


def _raw_request(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items()), "Connection: close"]
    body = b'{"prompt": "hi", "max_tokens": 1}' if method == "POST" else b""
    head = "\r\n".join([*lines, "Content-Type: application/json", f"Content-Length: {len(body)}", "", ""]).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2]


ROUTES = [("GET", "/v1/models"), ("GET", "//v1/models"), ("GET", "/v1/../v1/models"), ("GET", "/v1/%6Dodels"),
          ("GET", "/v1/models/"), ("GET", "/v1//models"), ("GET", "/%761/models"), ("GET", "/V1/models"),
          ("POST", "/v1/completions"), ("POST", "//v1/completions"), ("POST", "/v1/completions/"),
          ("POST", "/v1/./completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/metrics/"),
          ("GET", "//metrics"), ("GET", "/debug/kv_cache"), ("GET", "/health/"), ("GET", "//health"),
          ("GET", "/health/../v1/models"), ("GET", "/nope"), ("GET", "/openapi.json"), ("GET", "/docs"),
          # the live page's HTML (/ and /dashboard) is open, its figures are not, however the path is spelt
          ("GET", "/dashboard/data"), ("GET", "//dashboard/data"), ("GET", "/dashboard/data/"),
          ("GET", "/dashboard//data"), ("GET", "/dashboard/../dashboard/data"), ("GET", "/%64ashboard/data")]
HOSTS = ["127.0.0.1", "localhost", "evil.example", "127.0.0.1:1", "", "[::1]", "localhost/health"]
BAD_AUTH = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEYS[0]}x"},
            {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer "}]


def _auth_cases(route_index: int) -> list[tuple[str, dict[str, str]]]:
    """Every bad Authorization with one Host, and every Host without a key (the Host rotates with the
    route): each path spelling meets every Host and every bad key, without the 7 x 6 cross product."""
    host = HOSTS[route_index % len(HOSTS)]
    return [(host, auth) for auth in BAD_AUTH] + [(h, {}) for h in HOSTS if h != host]


@pytest.mark.parametrize("index", range(len(ROUTES)), ids=[f"{m}-{p}" for m, p in ROUTES])
def test_every_route_but_health_needs_the_key(keyed_server, index):
    method, path = ROUTES[index]
    for host, auth in _auth_cases(index):
        status, body = _raw_request(keyed_server.port, method, path, {"Host": host, **auth})
        assert status == 401, (method, path, host, auth, status, body[:200])
    status, _ = _raw_request(keyed_server.port, method, path, {"Host": "x", "Authorization": f"Bearer {KEYS[1]}"})
    assert status != 401


def test_health_is_open_and_the_key_never_reaches_the_log(keyed_server):
    assert _raw_request(keyed_server.port, "GET", "/health", {"Host": "evil"})[0] == 200
    response = keyed_server.http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_error_body(response, 401, code="invalid_api_key")
    ok = keyed_server.client(api_key=KEYS[1]).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert ok.choices
    log = keyed_server.log()
    assert "Serving" in log or "engine core ready" in log  # the log is captured
    for key in KEYS:
        assert key not in log and key[3:] not in log


def _cached(server: Server, key: str, prompt: str = PROMPT, **extra) -> tuple[int, float]:
    hits_before = server.metric("vllm:prefix_cache_hits_total")
    response = server.client(api_key=key).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                                               temperature=0.0, extra_body=extra)
    assert wait_for(lambda: server.kv()["num_open_requests"] == 0, 30)
    hits = server.metric("vllm:prefix_cache_hits_total") - hits_before
    return response.usage.prompt_tokens_details.cached_tokens, hits


def test_cache_salt_isolates_prefix_cache(keyed_server):
    key = KEYS[0]
    assert _cached(keyed_server, key, cache_salt="salt-A-1") == (0, 0)
    assert _cached(keyed_server, key, cache_salt="salt-B-1") == (0, 0)
    cached, hits = _cached(keyed_server, key, cache_salt="salt-A-1")
    assert cached >= 32 and hits == cached


def test_cache_salt_from_api_key_isolates_tenants(keyed_server):
    server = keyed_server
    one, two = KEYS
    prompt = PROMPT + " tenants"  # not the prompt of the salt test
    assert _cached(server, one, prompt) == (0, 0)
    assert _cached(server, two, prompt) == (0, 0), "tenant two read tenant one's cache without a salt"
    cached, hits = _cached(server, one, prompt)
    assert cached >= 32 and hits == cached
    assert _cached(server, two, prompt, cache_salt="shared")[0] == 0
    assert _cached(server, one, prompt, cache_salt="shared")[0] == 0, "a client salt let tenants share cache"
    assert _cached(server, one, prompt, cache_salt="shared")[0] >= 32
    bad = server.http.post("/v1/completions", headers={"Authorization": f"Bearer {one}"},
                           json={"prompt": "hi", "cache_salt": ""})
    assert_error_body(bad, 400, "cache_salt")
    assert one not in server.log() and two not in server.log()


def test_openapi_document_and_docs_need_the_key(keyed_server):
    for path in ("/openapi.json", "/docs"):
        assert keyed_server.http.get(path).status_code == 401
        assert keyed_server.http.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert keyed_server.http.get(path, headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    document = keyed_server.http.get("/openapi.json", headers=keyed_server.headers).json()
    assert "/v1/chat/completions" in document["paths"]
    assert not any(key in json.dumps(document) for key in KEYS)


def test_control_characters_from_a_request_are_escaped_in_the_log(keyed_server):
    """A request_id (or a stop string) with a newline, a NUL, an ANSI escape or U+2028 must not write them
    raw: a newline forged a whole log line."""
    forged = "INFO 12-01 00:00:00 [pagedllm.serving] forged line"
    ids = [f"inject\n{forged}", "inject\r\0nul", "inject\x1b[31mred", "inject\u2028sep\x85nel"]
    client = keyed_server.client(api_key=KEYS[1])
    for request_id in ids:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1,
                                  extra_body={"request_id": request_id, "stop": ["\n\0x"]})
    assert wait_for(lambda: keyed_server.log().count("Received request cmpl-inject") >= len(ids), 30)
    log = keyed_server.log_path.read_bytes()
    lines = [line for line in log.split(b"\n") if b"inject" in line]
    assert len(lines) == len(ids), lines  # one line per request: nothing forged a line of its own
    assert not any(line.startswith(forged.encode()) for line in log.split(b"\n"))
    for raw in (b"\0", b"\r", b"\x1b", "\u2028".encode(), "\x85".encode()):
        assert not any(raw in line for line in lines), raw
    assert b"cmpl-inject\\nINFO 12-01" in log and b"cmpl-inject\\r\\x00nul" in log and b"inject\\x1b[31mred" in log


def test_request_chat_template_is_refused_unless_trusted(keyed_server):
    """A chat template in a request is code; as vLLM does, it is refused (400) unless the server runs with
    --trust-request-chat-template (one request's template held the API server at 1.2 GB)."""
    http, headers = keyed_server.http, keyed_server.headers
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for changes in ({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                    {"chat_template": "{{ '%999999999s' % 'a' }}"},
                    {"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}):
        response = http.post("/v1/chat/completions", headers=headers, json={**body, **changes})
        error = assert_error_body(response, 400, "chat_template")  # refused before any rendering
        assert "--trust-request-chat-template" in error["message"]
    response = http.post("/v1/chat/completions", headers=headers,
                         json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 200, response.text[:300]  # other template variables stay accepted
