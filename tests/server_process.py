"""What tests/entrypoints (server_utils.RemoteServer) and tests/reliability (reliability_utils.Server) share
about a real `pagedllm serve` child process: its command line and environment, a free port, waiting for
/health, and whether a pid is alive; and a router process in front of servers (router_client)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def serve_command(model: Path | None, port: int, *extra_args: str, debug_routes: bool = True) -> list[str]:
    """`pagedllm serve` of `model` (None: the embedded default) on 127.0.0.1:port, fp32, a 64 MiB KV pool;
    flags in extra_args come last, so they override these."""
    return [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *([str(model)] if model else []),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--kv-cache-memory", "64MiB", "--disable-log-stats",
            "--uvicorn-log-level", "warning", *(["--enable-debug-routes"] if debug_routes else []), *extra_args]


FAULT_INJECTION_DIR = Path(__file__).parent / "fault_injection"


def serve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One thread per server: several run at once on the 2-core machines. With PAGEDLLM_FAULT_INJECT in
    `extra`, the test-only fault hook (fault_injection/sitecustomize.py) goes on PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(extra or {})}
    if env.get("PAGEDLLM_FAULT_INJECT"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_INJECTION_DIR), env.get("PYTHONPATH")) if p)
    return env


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = STARTUP_TIMEOUT_S,
                 log: Callable[[], str] = lambda: "") -> None:
    """Until GET /health is 200; raises if the process exits first (with the tail of `log()`) or on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting:\n{log()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server did not become healthy")


@contextlib.contextmanager
def router_client(argv: list[str], port: int) -> Iterator[openai.OpenAI]:
    """A router in front of servers (vllm-router, benchmarks/disagg_proxy.py) started from `argv` and listening
    on 127.0.0.1:port: waits for its /health, yields an openai client pointed at it, stops it (SIGINT, then
    SIGKILL). Shared by tests/entrypoints/test_vllm_router.py and tests/kv_transfer/test_pd_router.py."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"{argv[0]} did not become healthy"
            time.sleep(0.1)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def build_tiny_model(folder: Path, max_position_embeddings: int = 512) -> Path:
    """The tiny random Llama of tests/conftest.py as an F32 GGUF file in `folder` (for the benchmarks that
    start their own server: benchmarks/load_test.py, benchmarks/fuzz_openapi.py); a longer context for prompts
    past 512 tokens (benchmarks/dp_routing_hit_rate.py's 1,024-token prefixes)."""
    spec = importlib.util.spec_from_file_location("pagedllm_tests_conftest", Path(__file__).with_name("conftest.py"))
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    hf = folder / "tiny-llama"
    hf.mkdir(parents=True, exist_ok=True)
    tokenizer = fixtures._build_tokenizer(hf)
    model = fixtures._build_model(hf, len(tokenizer), max_position_embeddings)
    path = folder / "tiny-llama-F32.gguf"
    fixtures.write_llama_gguf(path, model, tokenizer)
    return path
