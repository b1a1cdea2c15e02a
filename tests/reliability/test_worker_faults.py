"""Faults of the mp executor's workers (tensor-parallel size 2 on the tiny model): kill -9 of a worker under
streaming requests takes the engine-death path (streams end within 2 s, /health 503), and no process is left;
kill -9 of the engine core takes its workers with it. Neither leaves a shared-memory all-reduce segment behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest
from reliability_utils import MODEL_NAME, pid_alive, stream_until_error, unavailable, wait_for

from pagedllm.distributed.shm_communicator import SEGMENT_PREFIX, SHM_DIR, maps_segment

pytestmark = pytest.mark.slow

LONG = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 400, "extra_body": {"ignore_eos": True}}
TP2 = ("--tensor-parallel-size", "2", "--engine-death-exit-delay", "5")


@pytest.fixture(scope="module")
def servers(launcher) -> dict:
    return {"worker-kill": launcher(*TP2, wait_ready=False), "engine-kill": launcher(*TP2, wait_ready=False)}


def _workers(engine_pid: int) -> list[int]:
    """The engine core's worker processes (its children running pagedllm.executor.worker_proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == engine_pid and "pagedllm.executor.worker_proc" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def test_worker_kill_under_streams_ends_them_and_leaves_no_process(servers):
    server = servers["worker-kill"].wait_ready()
    engine_pid = server.engine_pid()
    workers = _workers(engine_pid)
    assert len(workers) == 2, workers
    assert all(maps_segment(w) for w in workers)  # the all-reduces run over shared memory
    client = server.client(timeout=60.0)
    results: list = []
    lock = threading.Lock()
    started = threading.Barrier(5)
    threads = [threading.Thread(target=stream_until_error, args=(client, LONG, started, results, lock))
               for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    killed_at = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)

    unhealthy = wait_for(lambda: unavailable(server), 30.0)
    health_s = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4
    assert all(isinstance(outcome, openai.APIError) for outcome, _ in results), results
    last_error_s = max(at for _, at in results) - killed_at
    print(f"FIGURE worker kill (TP=2): 4/4 streams errored, last after {last_error_s:.2f} s; /health 503 after "
          f"{health_s:.2f} s")
    assert unhealthy
    # the executor's watcher names the dead worker, or (shared-memory all-reduce) rank 0 does first: its all-reduce
    # notices the dead peer and fails the step
    log = server.log()
    assert ("worker 1" in log and "exited unexpectedly" in log) or "rank 1 exited" in log
    assert server.proc.wait(timeout=60) != 0
    assert wait_for(lambda: not any(pid_alive(p) for p in [engine_pid, *workers]), 30.0)
    assert list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{engine_pid}-*")) == []  # no segment left behind


def test_engine_kill_takes_its_workers(servers):
    server = servers["engine-kill"].wait_ready()
    engine_pid = server.engine_pid()
    workers = _workers(engine_pid)
    assert len(workers) == 2, workers
    cmdline = open(f"/proc/{workers[0]}/cmdline").read().split("\0")
    socket_dir = os.path.dirname(cmdline[cmdline.index("--broadcast-addr") + 1].removeprefix("ipc://"))
    assert os.path.isdir(socket_dir)
    killed_at = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    assert wait_for(lambda: not any(pid_alive(p) for p in workers), 30.0), "workers outlived the engine core"
    assert wait_for(lambda: not os.path.exists(socket_dir), 30.0), os.listdir(socket_dir)
    print(f"FIGURE engine kill (TP=2): both workers exited {time.monotonic() - killed_at:.2f} s after the kill")
    assert list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{engine_pid}-*")) == []
