"""Helpers for the reliability suite: a real `pagedllm serve` with its output captured, and the checks
every bad-input and fault case ends with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai

from server_process import MODEL_NAME, STARTUP_TIMEOUT_S, free_port, pid_alive, serve_command, serve_env, wait_healthy

__all__ = ["MODEL_NAME", "Server", "free_port", "pid_alive"]


# Every step 5 ms longer (a real model's step length): with the tiny model's ~1 ms steps the engine can finish a
# test's requests seconds ahead of an API server on busy cores, before a kill, a close or a SIGTERM reaches them.
REAL_STEP_ENV = {"PAGEDLLM_FAULT_INJECT": "sleep_in_forward:after_steps=0,times=1000000000,seconds=0.005"}

def port_bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def stream_until_error(client: openai.OpenAI, request: dict, started: threading.Barrier | None, results: list,
                       lock: threading.Lock) -> None:
    """Stream `request` (completions.create arguments) to its end; append (outcome, time.monotonic()) to
    `results`: "completed" or the openai.APIError that ended it. With `started`, wait at that barrier after
    the first chunk (so a fault comes while every stream is open)."""
    try:
        stream = client.completions.create(**request, stream=True)
        iterator = iter(stream)
        next(iterator)
        if started is not None:
            started.wait(timeout=60)
        for _ in iterator:
            pass
        outcome = "completed"
    except openai.APIError as e:
        outcome = e
    with lock:
        results.append((outcome, time.monotonic()))


def stream_to_its_end(server: Server, results: list, lock: threading.Lock, max_tokens: int = 300,
                      extra: dict | None = None) -> None:
    """A long completion stream (with the request fields in `extra`) read to its end; appends (finish reasons,
    whether [DONE] came) to `results`, or the httpx error that ended it."""
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, **(extra or {})}
    reasons, done = [], False
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    reasons += [c["finish_reason"] for c in chunk.get("choices", []) if c["finish_reason"]]
                done |= line == "data: [DONE]"
        outcome: tuple | Exception = (reasons, done)
    except httpx.HTTPError as e:
        outcome = e
    with lock:
        results.append(outcome)


def unavailable(server: Server) -> bool:
    """/health answers 503, or the API server is already gone (it may exit after its engine died)."""
    try:
        return server.http.get("/health").status_code == 503
    except httpx.ConnectError:
        return server.proc.poll() is not None


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, grandchildren, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


ALARMING = ("ERROR", "CRITICAL", "Traceback", "unexpectedly", "killing it")


def alarming_lines(log: str) -> list[str]:
    """The lines of a server log that would alarm an operator at a normal shutdown."""
    return [line for line in log.splitlines() if any(word in line for word in ALARMING)]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Server:
    """`pagedllm serve` of the tiny model on a free port; stdout+stderr go to `log_path`. `model` None serves
    the embedded default model (SmolLM2); flags in `extra_args` override the defaults below (last one wins)."""

    def __init__(self, model: Path | None, log_path: Path, *extra_args: str, env: dict[str, str] | None = None,
                 wait_ready: bool = True, api_key: str | None = None, new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ready = False
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(serve_command(model, self.port, *extra_args), env=serve_env(env),
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=new_session)
        """With new_session, a process group of its own: os.killpg signals it as a terminal's Ctrl-C or `kill %1`
        signals a job."""
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        self._clients: list[openai.OpenAI] = []
        self._client_cache: dict[tuple, openai.OpenAI] = {}
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> Server:
        """Wait until /health is 200 (at once if it was before); returns the server."""
        if not self.ready:
            wait_healthy(self.proc, self.url, timeout_s, self.log)
            self.ready = True
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> openai.OpenAI:
        """An openai client of this server (one per set of arguments, closed with the server)."""
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        key = tuple(sorted(kwargs.items()))
        if key not in self._client_cache:
            self._client_cache[key] = openai.OpenAI(base_url=self.url + "/v1", **kwargs)
            self._clients.append(self._client_cache[key])
        return self._client_cache[key]

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", **kwargs)

    def kv(self) -> dict:
        return self.http.get("/debug/kv_cache", headers=self.headers).json()

    def metrics(self) -> dict[str, float]:
        """Every sample in /metrics by its full name with labels, e.g. `vllm:num_preemptions_total{...}`."""
        samples = {}
        for line in self.http.get("/metrics", headers=self.headers).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def metric(self, prefix: str) -> float:
        """The sum of the samples whose name (labels included) starts with prefix."""
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def engine_pid(self) -> int:
        return self.kv()["engine_pid"]

    def close(self) -> None:
        self.http.close()  # first: an open keep-alive connection would hold uvicorn's graceful shutdown
        for client in self._clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def assert_error_body(response: httpx.Response, status: int, param: str | None = "*", code: str | None = "*") -> dict:
    """The exact status, OpenAI's error shape, and the class the openai SDK raises for it."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param != "*":
        assert error["param"] == param, error
    if code != "*":
        assert error["code"] == code, error
    expected_class = {400: openai.BadRequestError, 401: openai.AuthenticationError, 404: openai.NotFoundError,
                      413: openai.APIStatusError, 431: openai.APIStatusError, 503: openai.InternalServerError}[status]
    sdk_error = openai.OpenAI(api_key="x", base_url="http://unused")._make_status_error_from_response(response)
    assert isinstance(sdk_error, expected_class) and sdk_error.status_code == status
    return error


def assert_server_intact(server: Server, engine_pid: int, idle_timeout_s: float = 30.0) -> None:
    """Same engine process, /health 200, a valid request succeeds, then nothing runs or waits (waiting up to
    idle_timeout_s for that: a hang guard, not a speed limit) and every KV block is free."""
    assert server.engine_pid() == engine_pid
    assert server.http.get("/health").status_code == 200
    response = server.http.post("/v1/completions", headers=server.headers,
                                json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, response.text[:300]
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    deadline = time.monotonic() + idle_timeout_s
    while True:
        kv = server.kv()
        idle = kv["num_running_reqs"] + kv["num_waiting_reqs"] == 0 and kv["num_open_requests"] == 0
        if (idle and kv["num_free_blocks"] == kv["num_total_blocks"]) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert kv["num_running_reqs"] + kv["num_waiting_reqs"] == 0, kv
    assert kv["num_free_blocks"] == kv["num_total_blocks"], kv
    assert kv["total_ref_cnt"] == 0, kv
    metrics = server.metrics()
    free = next(v for k, v in metrics.items() if k.startswith("pagedllm:kv_cache_free_blocks"))
    total = next(v for k, v in metrics.items() if k.startswith("pagedllm:kv_cache_total_blocks"))
    assert free == total, (free, total)
