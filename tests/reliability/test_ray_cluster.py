"""`--distributed-executor-backend ray` on a two-node Ray cluster on this machine: `ray start --head` on 127.0.0.2 and
`ray start --address` on 127.0.0.3 (distinct loopback addresses, one CPU each, so the two pipeline stages land on
different nodes), `pagedllm serve --pipeline-parallel-size 2` on it. Greedy outputs equal the in-process engine's;
a SIGTERM to the server's group stops it cleanly, its Ray workers with it; on a fresh server node 2 freezes (the
node is lost without closing its connections) and /health turns 503 within the health timeout; last, on a fresh
server, every process of node 2 is killed (kill -9) under 4 streams, which end within 2 s; the cluster is torn down
with no process left.

Needs Ray (the test extra installs it, as `pip install -e ".[ray]"` does); skipped without it, except in CI."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from reliability_utils import (
    MODEL_NAME,
    Server,
    alarming_lines,
    descendants,
    free_port,
    pid_alive,
    stream_to_its_end,
    stream_until_error,
    unavailable,
    wait_for,
)

if not os.environ.get("CI"):  # in CI (the test extra installs Ray) a missing Ray fails instead of skipping
    pytest.importorskip("ray", reason='the ray extra is not installed (pip install -e ".[ray]")')

pytestmark = pytest.mark.slow

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
MARK = "PAGEDLLM_TEST_RAY_CLUSTER"
"""An environment variable every process of the test cluster inherits (its value unique), to find them all."""
NODE_FLAGS = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(80 << 20), "--disable-usage-stats"]
HEALTH_TIMEOUT_S = 10.0  # --health-check-timeout's default
PROMPTS = ["The quick brown fox jumps over", "Hello world! How are you", "Paged attention stores the KV cache",
           "Numbers like 12345 and 2024 appear", "user assistant system: write a short poem"]
LONG = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 480, "extra_body": {"ignore_eos": True}}


@dataclass
class RayCluster:
    address: str
    mark: str
    head: subprocess.Popen
    node: subprocess.Popen
    logs: Path

    def node_pids(self) -> list[int]:
        """Node 2's processes: its `ray start --block` and everything in its session (raylet, workers, agents)."""
        return [pid for pid in _marked_pids(self.mark) if _session(pid) == self.node.pid]


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _marked_pids(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _cluster_pids(mark: str, procs: list[subprocess.Popen]) -> list[int]:
    """The test cluster's processes: marked ones, and any in the session of a `ray start` (Ray's agents rewrite
    their process title over their environment, so the mark alone misses them)."""
    sessions = {proc.pid for proc in procs}
    marked = set(_marked_pids(mark))
    return sorted(marked | {int(e) for e in os.listdir("/proc") if e.isdigit() and _session(int(e)) in sessions})


def _listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0


@contextlib.contextmanager
def start_ray_cluster(logs: Path) -> Iterator[RayCluster]:
    """Head on HEAD_IP, a second node on NODE_IP (logs in `logs`); torn down on exit with no process left. Also
    used by benchmarks/parallel_identity.py."""
    ray_cli = shutil.which("ray", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert ray_cli, "the ray package is installed but its `ray` command is not on PATH"
    mark = uuid.uuid4().hex
    temp_root = Path(tempfile.mkdtemp(prefix="pgr", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # RAY_AUTH_MODE: without it, a ~/.ray/auth_token left by any local ray.init() turns token authentication on
    # for `ray start`, and the engine (which has no token) cannot join
    env.update({MARK: mark, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([ray_cli, "start", "--block", *args, *NODE_FLAGS, "--temp-dir",
                                     str(temp_root / name), "--dashboard-agent-listen-port", str(free_port())],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        port = free_port()
        head = start("head", "--head", "--node-ip-address", HEAD_IP, "--port", str(port), "--include-dashboard",
                     "false", "--dashboard-port", str(free_port()))  # its minimal head process still binds one
        assert wait_for(lambda: _listening(HEAD_IP, port) or head.poll() is not None, 90.0, 0.25)
        assert head.poll() is None, (logs / "head.log").read_text()[-3000:]
        node = start("node", "--address", f"{HEAD_IP}:{port}", "--node-ip-address", NODE_IP)
        yield RayCluster(f"{HEAD_IP}:{port}", mark, head, node, logs)
    finally:
        for pid in _marked_pids(mark):  # a frozen node goes on first
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proc in reversed(procs):  # `ray start --block` stops its node's processes on SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = _cluster_pids(mark, procs)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_for(lambda: not _cluster_pids(mark, procs), 30.0, 0.1), _cluster_pids(mark, procs)
        shutil.rmtree(temp_root, ignore_errors=True)
        if left:
            print(f"ray cluster teardown: killed {len(left)} leftover processes: {[_cmdline(p)[:80] for p in left]}")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with start_ray_cluster(tmp_path_factory.mktemp("ray-cluster")) as cluster:
        yield cluster


def _ray_server(model: Path, cluster: RayCluster, log: Path, death_exit_delay: str) -> Server:
    """`pagedllm serve --pipeline-parallel-size 2` on the cluster, in a process group of its own."""
    return Server(model, log, "--distributed-executor-backend", "ray", "--pipeline-parallel-size", "2",
                  "--ray-address", cluster.address, "--engine-death-exit-delay", death_exit_delay, wait_ready=False,
                  new_session=True)


@pytest.fixture(scope="module")
def ray_server(ray_cluster, serve_model, tmp_path_factory):
    """Started while the first test computes its reference; the shutdown test stops it."""
    server = _ray_server(serve_model, ray_cluster, tmp_path_factory.mktemp("ray-server") / "server.log", "10")
    yield server
    server.close()


def _reference(model: Path) -> list[str]:
    """Greedy texts of the in-process engine with one thread, as each Ray rank runs (one CPU per node)."""
    import torch

    from pagedllm import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(str(model), dtype="float32", kv_cache_memory=8 << 20)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)
        return [o.outputs[0].text for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        torch.set_num_threads(threads)


def test_pipeline_stages_on_two_nodes_give_the_one_process_tokens(ray_server, serve_model):
    expected = _reference(serve_model)
    start = time.monotonic()
    server = ray_server.wait_ready(timeout_s=240.0)
    print(f"FIGURE ray PP=2 over 2 nodes: healthy {time.monotonic() - start:.1f} s after the reference finished")
    placed = next(line for line in server.log().splitlines() if "Ray workers on" in line)
    assert "started 2 Ray workers on 2 nodes" in placed and f"on {HEAD_IP}" in placed and f"on {NODE_IP}" in placed
    response = server.client().completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=24, temperature=0.0,
                                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected


def test_a_group_sigterm_stops_the_server_and_its_ray_workers_cleanly(ray_server, ray_cluster):
    """`kill %1` or `timeout` (SIGTERM to the server's process group) under two open streams: the server drains them
    (a finish reason and [DONE] each), exits 0, logs nothing alarming, and leaves none of its processes, nor its
    Ray workers on either node (issue 32 item 14: before, the engine core died of the signal under the drain,
    "engine core process exited unexpectedly", exit 1)."""
    server = ray_server.wait_ready(timeout_s=240.0)
    workers = [pid for pid in _cluster_pids(ray_cluster.mark, [ray_cluster.head, ray_cluster.node])
               if "RayWorker" in _cmdline(pid)]
    assert len(workers) == 2, [_cmdline(p)[:100] for p in _marked_pids(ray_cluster.mark)]
    results: list = []
    lock = threading.Lock()
    threads = [threading.Thread(target=stream_to_its_end, args=(server, results, lock, 200)) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.kv()["num_running_reqs"] == 2, 60.0), server.kv()
    processes = [server.proc.pid, *descendants(server.proc.pid)]
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 0, server.log()[-3000:]  # a hang guard
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and all(not isinstance(r, Exception) and r[1] and len(r[0]) == 1 for r in results), \
        results
    left = lambda: [pid for pid in processes + workers if pid_alive(pid)]  # noqa: E731
    assert wait_for(lambda: not left(), 30.0), [_cmdline(p)[:100] for p in left()]
    assert alarming_lines(server.log()) == [], server.log()[-3000:]


def test_losing_a_node_turns_health_503_within_the_health_timeout(ray_cluster, serve_model, tmp_path):
    """Node 2 freezes while the engine idles (every process of it SIGSTOPped: a hung machine or a cut network, so
    no connection closes and no collective is waiting): the engine's heartbeats on its worker's connection go
    unanswered and the engine stops, /health 503 within the health timeout and new requests 503. Ray alone would
    not notice for longer (its node health checks), and not at all with only the worker process frozen. (A killed
    raylet, the easier case, closes the connection at once: 3.5-3.9 s here, the worker noticing its raylet gone.)"""
    server = _ray_server(serve_model, ray_cluster, tmp_path / "server.log", "10")
    try:
        _freeze_node_while_idle(server.wait_ready(timeout_s=240.0), ray_cluster)
    finally:
        server.close()


def _freeze_node_while_idle(server: Server, ray_cluster: RayCluster) -> None:
    node = ray_cluster.node_pids()
    assert any("raylet" in _cmdline(pid) for pid in node), [_cmdline(p)[:100] for p in node]
    assert any("RayWorker" in _cmdline(pid) for pid in node), [_cmdline(p)[:100] for p in node]
    assert server.http.get("/health").status_code == 200
    frozen_at = time.monotonic()
    for pid in node:
        os.kill(pid, signal.SIGSTOP)

    def unavailable() -> bool:  # /health 503, or the API server already gone
        try:
            return server.http.get("/health").status_code == 503
        except httpx.HTTPError:
            return server.proc.poll() is not None

    try:
        unhealthy = wait_for(unavailable, HEALTH_TIMEOUT_S + 60, 0.05)
        health_s = time.monotonic() - frozen_at
        print(f"FIGURE ray node frozen while idle (SIGSTOP): /health 503 after {health_s:.2f} s")
        assert unhealthy, f"/health still 200 a minute after the node froze:\n{server.log()[-3000:]}"
        if server.proc.poll() is None:  # within --engine-death-exit-delay: new requests are refused with a 503
            with pytest.raises(openai.APIStatusError) as refused:
                server.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
            assert refused.value.status_code == 503
        assert "connection to the engine" in server.log(), server.log()[-3000:]
    finally:  # the node comes back (the next test kills it), even when this test fails: Ray has not declared it
        for pid in node:  # dead yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_killing_a_node_under_streams_ends_them(ray_cluster, serve_model, tmp_path):
    """kill -9 of every process of node 2 (its `ray start`, raylet, agents, rank 1's worker) while 4 streams are
    producing tokens: every stream ends with an error (not the client's 60 s timeout), /health answers 503, and
    the API server exits as after any engine death. Runs last: it destroys node 2."""
    server = _ray_server(serve_model, ray_cluster, tmp_path / "server.log", "3")
    try:
        _kill_node_under_streams(server.wait_ready(timeout_s=240.0), ray_cluster)
    finally:
        server.close()


def _kill_node_under_streams(server: Server, ray_cluster: RayCluster) -> None:
    assert "started 2 Ray workers on 2 nodes" in server.log(), server.log()[-3000:]
    client = server.client(timeout=60.0)
    results: list = []
    lock = threading.Lock()
    started = threading.Barrier(5)
    threads = [threading.Thread(target=stream_until_error, args=(client, LONG, started, results, lock), daemon=True)
               for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    node = ray_cluster.node_pids()
    assert any("RayWorker" in _cmdline(pid) for pid in node), [_cmdline(p)[:100] for p in node]
    killed_at = time.monotonic()
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    unhealthy = wait_for(lambda: unavailable(server), 60.0)
    health_s = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4, f"{4 - len(results)} streams still open:\n{server.log()[-3000:]}"
    assert all(isinstance(outcome, openai.APIError) and not isinstance(outcome, openai.APITimeoutError)
               for outcome, _ in results), results
    last_error_s = max(at for _, at in results) - killed_at
    print(f"FIGURE ray node kill -9 (PP=2 over 2 nodes): 4/4 streams errored, last after {last_error_s:.2f} s; "
          f"/health 503 after {health_s:.2f} s")
    assert unhealthy, f"/health not 503 a minute after the node was killed:\n{server.log()[-3000:]}"
    assert server.proc.wait(timeout=60) != 0
