"""vLLM's API-server flags, each through a real `pagedllm serve` and real HTTP: --root-path, CORS (--allowed-origins,
--allowed-methods, --allowed-headers, --allow-credentials), TLS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs, --ssl-ciphers, --enable-ssl-refresh), request logging (--enable-log-requests, --enable-log-outputs,
--max-log-len), --response-role, --return-tokens-as-token-ids, --enable-prompt-tokens-details,
--enable-force-include-usage, --enable-request-id-headers, --disable-fastapi-docs and --disable-uvicorn-access-log.

Two servers: one over plain HTTP with all the other flags on, and one over mutual TLS with the defaults of the others
(docs off), so that each flag is seen on and off."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, free_port

from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args
from server_process import serve_command, serve_env

pytestmark = pytest.mark.slow

API_KEY = "sk-http-flags"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://app.example"
CIPHER = "ECDHE-ECDSA-AES128-GCM-SHA256"
MAX_LOG_LEN = 5
LONG_PROMPT = " ".join(["paged attention keeps the cache in blocks"] * 8)
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
SDK_GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


class Server:
    """`pagedllm serve` with its output (logs, uvicorn's access log) in a file."""

    def __init__(self, model: Path, log: Path, scheme: str, *args: str):
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(serve_command(model, self.port, *args), env=serve_env(), stdout=err,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, client: httpx.Client) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()[-3000:]
            try:
                if client.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log()[-3000:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def _sign(folder: Path, name: str) -> None:
    """`name`.key and `name`.pem in `folder`: a new EC key and its certificate for 127.0.0.1, signed by ca.pem."""
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
                                    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n"
                                    "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl(folder, "req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf")


def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, and a server and a client certificate it signs (EC keys, 127.0.0.1), made by the openssl CLI."""
    _openssl(folder, "req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj",
             "/CN=pagedllm-test-ca")
    for name in ("server", "client"):
        _sign(folder, name)
    return {name: folder / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return _certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory, certs):
    """(the HTTP server with the flags on, the mutual-TLS server), started together."""
    logs = tmp_path_factory.mktemp("logs")
    flagged = Server(tiny_llama_dir, logs / "flagged.log", "http", "--api-key", API_KEY, "--root-path", "/api",
                     "--allowed-origins", json.dumps([ORIGIN]), "--allowed-methods", '["GET", "POST"]',
                     "--allowed-headers", '["Authorization", "Content-Type"]', "--allow-credentials",
                     "--enable-log-requests", "--enable-log-outputs", "--max-log-len", str(MAX_LOG_LEN),
                     "--response-role", "bot", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
                     "--enable-force-include-usage", "--enable-request-id-headers", "--disable-uvicorn-access-log",
                     "--uvicorn-log-level", "info")
    serving = certs["ca.pem"].parent / "serving"  # the server's own copies: test_ssl_refresh replaces them
    serving.mkdir(exist_ok=True)
    for name in ("server.key", "server.pem"):
        shutil.copy(certs[name], serving / name)
    tls = Server(tiny_llama_dir, logs / "tls.log", "https", "--ssl-keyfile", str(serving / "server.key"),
                 "--ssl-certfile", str(serving / "server.pem"), "--ssl-ca-certs", str(certs["ca.pem"]),
                 "--ssl-cert-reqs", "2", "--ssl-ciphers", CIPHER, "--enable-ssl-refresh", "--disable-fastapi-docs",
                 "--uvicorn-log-level", "info")
    try:
        flagged.wait_ready(httpx.Client(timeout=5))
        tls.wait_ready(_mtls_client(certs))
        yield flagged, tls
    finally:
        flagged.close()
        tls.close()


def _mtls_client(certs, with_cert: bool = True) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    if with_cert:
        context.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
    return httpx.Client(verify=context, timeout=30)


@pytest.fixture(scope="module")
def flagged(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def tls(servers) -> Server:
    return servers[1]


def _chunks(response: httpx.Response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- --root-path and the docs ---------------------------------------------------------------------------------


def test_root_path_routes_and_docs_behind_a_prefix_stripping_proxy(flagged):
    for prefix in ("", "/api"):  # as the proxy forwards it (prefix stripped), and as sent to the server itself
        assert httpx.get(f"{flagged.url}{prefix}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
        assert httpx.get(f"{flagged.url}{prefix}/health").status_code == 200  # unguarded under the prefix too
        assert httpx.get(f"{flagged.url}{prefix}/v1/models").status_code == 401
    document = httpx.get(flagged.url + "/openapi.json", headers=AUTH).json()
    assert document["servers"] == [{"url": "/api"}] and "/v1/completions" in document["paths"]
    assert "/api/openapi.json" in httpx.get(flagged.url + "/docs", headers=AUTH).text
    assert "/api/openapi.json" in httpx.get(flagged.url + "/redoc", headers=AUTH).text


def test_disable_fastapi_docs(tls, certs):
    with _mtls_client(certs) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(tls.url + path).status_code == 404, path


# ---- CORS -----------------------------------------------------------------------------------------------------


def test_cors_preflight_is_answered_without_the_api_key(flagged):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    answer = httpx.options(flagged.url + "/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert answer.headers["access-control-allow-credentials"] == "true"
    assert set(answer.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    url = flagged.url + "/v1/chat/completions"
    refused = httpx.options(url, headers={**preflight, "Origin": "https://evil.example"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert httpx.options(url, headers={**preflight, "Access-Control-Request-Method": "PUT"}).status_code == 400


def test_cors_headers_on_cross_origin_requests(flagged):
    ok = httpx.get(flagged.url + "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    unauthorized = httpx.get(flagged.url + "/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(flagged.url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_cross_origin_access_is_off_by_default(tls, certs):
    with _mtls_client(certs) as client:
        answer = client.options(tls.url + "/v1/models", headers={"Origin": ORIGIN,
                                                                 "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in answer.headers
        assert "access-control-allow-origin" not in client.get(tls.url + "/v1/models",
                                                               headers={"Origin": ORIGIN}).headers


# ---- X-Request-Id ---------------------------------------------------------------------------------------------


def test_request_id_headers(flagged, tls, certs):
    echoed = httpx.get(flagged.url + "/v1/models", headers={**AUTH, "X-Request-Id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(flagged.url + "/v1/models", headers=AUTH).headers["x-request-id"])
    assert httpx.get(flagged.url + "/v1/models", headers={"X-Request-Id": "t"}).headers["x-request-id"] == "t"  # 401
    stream = httpx.post(flagged.url + "/v1/completions", headers={**AUTH, "X-Request-Id": "s-1"},
                        json={**GREEDY, "prompt": "Hi", "stream": True})
    assert stream.headers["x-request-id"] == "s-1"
    named = httpx.post(flagged.url + "/v1/completions", headers={**AUTH, "X-Request-Id": "trace-7"}, timeout=30,
                       json={**GREEDY, "prompt": "Hi", "request_id": "body-id"})
    assert named.json()["id"] == "cmpl-trace-7"  # vLLM's: the header names the request, before request_id
    with _mtls_client(certs) as client:
        assert "x-request-id" not in client.get(tls.url + "/v1/models", headers={"X-Request-Id": "x"}).headers


# ---- TLS ------------------------------------------------------------------------------------------------------


def test_mutual_tls(tls, certs):
    with _mtls_client(certs) as http:
        client = openai.OpenAI(base_url=tls.url + "/v1", api_key="unused", http_client=http, max_retries=0)
        assert client.completions.create(prompt="Hello", **SDK_GREEDY).usage.completion_tokens == 4
    with _mtls_client(certs, with_cert=False) as anonymous, pytest.raises(httpx.TransportError):
        anonymous.get(tls.url + "/health")  # refused: --ssl-cert-reqs 2 and no client certificate
    with pytest.raises(httpx.ConnectError):
        httpx.get(tls.url + "/health")  # a server certificate from an unknown CA
    with pytest.raises(httpx.TransportError):
        httpx.get(tls.url.replace("https", "http") + "/health")  # no plain HTTP


def _handshake(tls: Server, certs, ciphers: str | None = None, tls12: bool = False) -> ssl.SSLSocket:
    """A TLS connection to `tls` with the client certificate (closed by the caller)."""
    context = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    context.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    if ciphers:
        context.set_ciphers(ciphers)
    raw = socket.create_connection(("127.0.0.1", tls.port), timeout=10)
    try:
        return context.wrap_socket(raw, server_hostname="127.0.0.1")
    except BaseException:
        raw.close()
        raise


def test_ssl_ciphers(tls, certs):
    """TLS 1.2 (the ciphers flag's range) negotiates the one cipher given; a client without it is refused."""
    with _handshake(tls, certs, tls12=True) as conn:
        assert conn.cipher()[0] == CIPHER
    with pytest.raises(ssl.SSLError):
        _handshake(tls, certs, "ECDHE-ECDSA-AES256-GCM-SHA384", tls12=True)


def test_ssl_refresh(tls, certs):
    """A renewed certificate written over the served files is served to new connections, without a restart."""
    def served_certificate() -> bytes:
        with _handshake(tls, certs) as conn:
            return conn.getpeercert(binary_form=True)

    before = served_certificate()
    folder = certs["ca.pem"].parent
    _sign(folder, "renewed")
    serving = folder / "serving"
    for suffix in ("key", "pem"):
        (serving / f"server.{suffix}.new").write_bytes((folder / f"renewed.{suffix}").read_bytes())
        os.replace(serving / f"server.{suffix}.new", serving / f"server.{suffix}")  # as cert managers swap them
    renewed = ssl.PEM_cert_to_DER_cert((folder / "renewed.pem").read_text())
    assert _wait_for(lambda: served_certificate() == renewed, 15), tls.log()[-2000:]
    assert before != renewed and "Reloading SSL certificate chain" in tls.log()
    with _mtls_client(certs) as client:
        assert client.get(tls.url + "/health").status_code == 200


def test_bad_tls_files_fail_before_the_engine_starts(tiny_llama_dir, tmp_path):
    done = subprocess.run(serve_command(tiny_llama_dir, free_port(), "--ssl-certfile", str(tmp_path / "none.pem")),
                          env=serve_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Cannot set up TLS" in done.stderr and "engine core ready" not in done.stderr


# ---- responses ------------------------------------------------------------------------------------------------


def test_response_role(flagged, tls, certs):
    messages = [{"role": "user", "content": "Hello"}]
    chat = {**GREEDY, "messages": messages}
    answer = httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, json=chat, timeout=30).json()
    assert answer["choices"][0]["message"]["role"] == "bot"
    first = _chunks(httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, json={**chat, "stream": True},
                               timeout=30))[0]
    assert first["choices"][0]["delta"]["role"] == "bot"
    continued = {**chat, "messages": [*messages, {"role": "assistant", "content": "Hi"}],
                 "add_generation_prompt": False, "continue_final_message": True}
    answer = httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, json=continued, timeout=30).json()
    assert answer["choices"][0]["message"]["role"] == "assistant"  # the last message's role
    with _mtls_client(certs) as client:
        assert client.post(tls.url + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]["role"] == \
            "assistant"


def test_return_tokens_as_token_ids(flagged):
    body = {**GREEDY, "prompt": "Hello", "logprobs": 2, "return_token_ids": True}
    choice = httpx.post(flagged.url + "/v1/completions", headers=AUTH, json=body, timeout=30).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in choice["logprobs"]["top_logprobs"] for key in top)
    streamed = _chunks(httpx.post(flagged.url + "/v1/completions", headers=AUTH, json={**body, "stream": True},
                                  timeout=30))
    assert [t for c in streamed if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]] == \
        choice["logprobs"]["tokens"]
    plain = httpx.post(flagged.url + "/v1/completions", headers=AUTH, timeout=30,
                       json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in plain["logprobs"]["tokens"])  # the request's own choice
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Hello"}], "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True}
    choice = httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, json=chat, timeout=30).json()["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", top["token"]) for e in choice["logprobs"]["content"]
               for top in e["top_logprobs"])
    streamed = _chunks(httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, json={**chat, "stream": True},
                                  timeout=30))
    tokens = [e["token"] for c in streamed if c["choices"] and c["choices"][0].get("logprobs")
              for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{i}" for i in choice["token_ids"]]


def test_prompt_tokens_details(flagged, tls, certs):
    client = openai.OpenAI(base_url=flagged.url + "/v1", api_key=API_KEY, max_retries=0)
    first = client.completions.create(prompt=LONG_PROMPT, **SDK_GREEDY)
    second = client.completions.create(prompt=LONG_PROMPT, **SDK_GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0  # whole blocks
    chat = client.chat.completions.create(messages=[{"role": "user", "content": LONG_PROMPT}], **SDK_GREEDY)
    again = client.chat.completions.create(messages=[{"role": "user", "content": LONG_PROMPT}], **SDK_GREEDY)
    assert chat.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    with _mtls_client(certs) as http:
        for _ in range(2):
            usage = http.post(tls.url + "/v1/completions", json={**GREEDY, "prompt": LONG_PROMPT}).json()["usage"]
        assert usage["prompt_tokens_details"] is None  # off by default, as in vLLM


def test_force_include_usage(flagged, tls, certs):
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        chunks = _chunks(httpx.post(flagged.url + path, headers=AUTH, json={**GREEDY, **body, "stream": True},
                                    timeout=30))
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        assert all(c["usage"] is not None for c in chunks)
        with _mtls_client(certs) as http:
            plain = _chunks(http.post(tls.url + path, json={**GREEDY, **body, "stream": True}))
        assert all(c.get("usage") is None for c in plain) and plain[-1]["choices"]


# ---- logs -----------------------------------------------------------------------------------------------------


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_request_and_output_logs_and_access_log(flagged, tls, certs):
    prompt = "Logged prompt text"
    completion = httpx.post(flagged.url + "/v1/completions", headers=AUTH, timeout=30,
                            json={**GREEDY, "prompt": prompt, "max_tokens": 8, "request_id": "logme"}).json()
    httpx.post(flagged.url + "/v1/chat/completions", headers=AUTH, timeout=30,
               json={**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                     "request_id": "logstream"})
    assert _wait_for(lambda: "Generated response chatcmpl-logstream" in flagged.log()), flagged.log()[-2000:]
    log = flagged.log()
    assert re.search(r"Received request cmpl-logme-\w+: params: SamplingParams\(", log)
    output = re.search(r"Generated response cmpl-logme-\w+: output: (.*), finish_reason: length", log)
    assert output and output.group(1) == repr(completion["choices"][0]["text"][:MAX_LOG_LEN])  # --max-log-len
    assert re.search(r"Generated response chatcmpl-logstream-\w+ \(streaming complete\): output: .*, "
                     r"finish_reason: length", log)
    assert '"POST /v1/completions HTTP/1.1" 200' not in log  # --disable-uvicorn-access-log
    with _mtls_client(certs) as http:
        http.post(tls.url + "/v1/completions", json={**GREEDY, "prompt": prompt})
    assert _wait_for(lambda: '"POST /v1/completions HTTP/1.1" 200' in tls.log()), tls.log()[-2000:]
    assert "Received request" not in tls.log() and "Generated response" not in tls.log()  # off by default


# ---- the flags' parsing -----------------------------------------------------------------------------------------


def _configs(*flags: str):
    parser = argparse.ArgumentParser(prog="pagedllm")
    return configs_from_args(add_parser(parser.add_subparsers()).parse_args(list(flags)))[1]


def test_flag_parsing_and_checks():
    config = _configs()
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers) == ([], ["*"], ["*"])
    assert not config.log_requests and config.response_role == "assistant" and config.ssl_cert_reqs == 0
    assert _configs("--allowed-origins", '["*"]', "--allowed-methods", '["GET"]').allowed_methods == ["GET"]
    with pytest.raises(SystemExit):
        _configs("--allowed-origins", "https://a.example")  # not a JSON list
    with pytest.raises(ValueError, match="--enable-log-outputs requires --enable-log-requests"):
        _configs("--enable-log-outputs")
    with pytest.raises(ValueError, match="--ssl-cert-reqs"):
        _configs("--ssl-cert-reqs", "3")
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        _configs("--ssl-keyfile", "key.pem")
    assert not _configs("--enable-log-requests", "--disable-log-requests").log_requests  # the deprecated flag wins
