"""A real `pagedllm serve` process on a free port, driven over HTTP (helpers for tests/entrypoints)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai

from server_process import MODEL_NAME, STARTUP_TIMEOUT_S, free_port, pid_alive, serve_command, serve_env, wait_healthy

__all__ = ["MODEL_NAME", "TINY_API_KEY", "RemoteServer", "free_port", "pid_alive"]

TINY_API_KEY = "sk-test-key"
"""The --api-key of the shared tiny server (conftest.tiny_api_server)."""


class RemoteServer:
    """`pagedllm serve MODEL --port P ...` as a child process; `close()` stops it (SIGTERM, then SIGKILL)."""

    def __init__(self, model: Path, *extra_args: str, wait_ready: bool = True, debug_routes: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers: dict[str, str] = {}
        """Sent by kv_cache(), wait_idle() and metric() (set it when the server has --api-key)."""
        self.proc = subprocess.Popen(serve_command(model, self.port, *extra_args, debug_routes=debug_routes),
                                     env=serve_env())
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_healthy(self.proc, self.url, timeout_s)

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kwargs.pop("timeout", 10.0), **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=kwargs.pop("timeout", 30.0), **kwargs)

    def kv_cache(self, **kwargs) -> dict:
        return self.get("/debug/kv_cache", headers=self.headers, **kwargs).json()

    def metric(self, name: str) -> float:
        """The value of one sample in /metrics, e.g. `vllm:num_requests_running`; 0.0 if absent."""
        for line in self.get("/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Wait until nothing runs or waits and every KV block is free; returns the last debug snapshot."""
        deadline = time.monotonic() + timeout_s
        while True:
            kv = self.kv_cache()
            idle = (kv["num_running_reqs"], kv["num_waiting_reqs"], kv["num_open_requests"]) == (0, 0, 0)
            if (idle and kv["num_free_blocks"] == kv["num_total_blocks"]) or time.monotonic() > deadline:
                return kv
            time.sleep(0.05)

    def child_pids(self) -> list[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

