"""The shared-memory all-reduce (distributed/shm_communicator.py, kernels/shm_all_reduce_cpu.c) between real
processes of a gloo group: at 2 and 3 ranks its result is bitwise the rank-order float32 sum on every rank, within
float32 rounding of the float64 sum, and (2 ranks) bitwise gloo's; its /dev/shm name is gone once the group is set
up; a peer killed mid-all-reduce (even one left a zombie) ends the wait with an error, not a hang, and leaves
nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.distributed.shm_communicator import SEGMENT_PREFIX, SHM_DIR
from pagedllm.kernels import shm_all_reduce
from server_process import free_port

pytestmark = pytest.mark.slow

RANK_SCRIPT = Path(__file__).with_name("shm_all_reduce_ranks.py")


@pytest.fixture(autouse=True)
def _needs_shared_memory():
    if not SHM_DIR.is_dir() or not shm_all_reduce.available():
        pytest.skip("needs /dev/shm and the native kernels")


def _start_ranks(size: int, out: Path, *flags: str) -> list[subprocess.Popen]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(RANK_SCRIPT), "--rank", str(r), "--size", str(size),
                              "--init-method", init_method, "--out", str(out), *flags], env=env)
            for r in range(size)]


def _wait(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    try:
        for p in procs:
            p.wait(timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _our_segments() -> list[Path]:
    """Segment names left by groups whose rank 0 is a child of this process."""
    return list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}-*"))


def _check(results: list[dict]) -> None:
    """Every rank used the segment (mapped, its name already unlinked: nothing to leak) and got, in every case,
    the rank-order float32 sum bit for bit, within float32 rounding of the float64 sum, the same bits as every
    other rank."""
    assert all(r["shm"] for r in results)
    assert all(len(r["mapped"]) == 1 and r["mapped"][0].endswith("(deleted)") for r in results)
    assert len({r["mapped"][0] for r in results}) == 1
    for r in results:
        assert r["stress_ok"]
        for case in r["cases"]:
            assert case["rank_order_bitwise"] and case["within_f64_bound"], case
    for i in range(len(results[0]["cases"])):
        assert len({r["cases"][i]["digest"] for r in results}) == 1
    gloo = [(c["shape"], c["gloo_bitwise"], c["gloo_differing"]) for c in results[0]["cases"]]
    print(f"FIGURE shm all-reduce vs gloo at {len(results)} ranks (shape, bitwise equal, elements differing): {gloo}")


def test_two_ranks_sum_as_gloo_does_and_a_killed_peer_ends_the_wait(tmp_path):
    """Then rank 0 waits in an all-reduce that rank 1 never joins; rank 1 is killed and left a zombie (not reaped
    until rank 0 is done): rank 0 raises within a few tenths of a second."""
    procs = _start_ranks(2, tmp_path, "--peer-dies")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "waiting1").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None and procs[1].poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0 is asleep in the all-reduce by now
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        procs[0].wait(30)
        waited_after_kill = time.monotonic() - killed_at
    finally:
        _wait(procs, 0)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    _check(results)
    assert all(c["gloo_bitwise"] for c in results[0]["cases"])  # one addition: the same whichever rank adds
    assert results[0]["raised"] is not None and "rank 1 exited" in results[0]["raised"]
    print(f"FIGURE rank 0 raised {waited_after_kill:.2f} s after its peer was killed")
    assert _our_segments() == []


def test_three_ranks_sum_in_rank_order(tmp_path):
    """Gloo sums each part of the tensor starting at another rank, so it differs from the rank-order sum in the
    last bits of some elements (printed); the shared-memory sum is the same on every rank."""
    procs = _start_ranks(3, tmp_path)
    _wait(procs)
    assert [p.returncode for p in procs] == [0] * 3
    _check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)])
    assert _our_segments() == []
