"""Faults in the KV offload tier (issue 36) on real `pagedllm serve` processes: a tier filled far past its size,
disk-tier files corrupted on disk (flipped bytes, truncated) before their prefix is requested again, under both
kv_load_failure_policy values. Each time the request ends cleanly (recomputed to the same greedy tokens, or that
one request fails with a 500 while another one in flight completes), the pool gets every block back, the server
stays healthy, and its shutdown leaves no shared-memory region and no disk-tier directory behind.

The tier (--kv-transfer-config, OffloadingConnector): 8 blocks of RAM over 24 of disk, a pool of 16 blocks, and
64-token prompts (4 full blocks, 16 tokens each): the pool keeps the last three requests at most, so a prompt
sent again after four others comes from the tier, and after four more from the disk tier."""

from __future__ import annotations

import json
import os
import random
import threading
import uuid
from pathlib import Path

import pytest
from reliability_utils import MODEL_NAME, Server, assert_server_intact

pytestmark = pytest.mark.slow

BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4
"""The tiny Llama's block over its 3 layers (K and V, 16 tokens, 2 KV heads of 16, fp32)."""
RAM_BLOCKS, DISK_BLOCKS, POOL_BLOCKS = 8, 24, 16
DISK_HEADER = 8 + 40 + 4 + 8
"""A disk-tier file's header (kv_transfer/offloading/disk.py): magic, key, CRC-32, length."""


def _tier(policy: str, disk: Path) -> tuple[list[str], Path, Path]:
    """The server flags of a tier with `policy`, its region's path and its disk-tier directory."""
    name = f"pagedllm-test-faults-{uuid.uuid4().hex}"
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
              "kv_connector_extra_config": {"cpu_bytes_to_use": RAM_BLOCKS * BLOCK_BYTES, "shm_name": name,
                                            "disk_path": str(disk),
                                            "disk_bytes_to_use": DISK_BLOCKS * (BLOCK_BYTES + DISK_HEADER)}}
    flags = ["--kv-transfer-config", json.dumps(config), "--block-size", "16", "--num-gpu-blocks-override",
             str(POOL_BLOCKS), "--max-model-len", "128", "--enable-prompt-tokens-details"]
    return flags, Path("/dev/shm") / name, disk / name


@pytest.fixture(scope="module")
def servers(launcher, tmp_path_factory):
    """One server per policy, started together (their start-ups overlap)."""
    started = {}
    for policy in ("recompute", "fail"):
        flags, region, disk = _tier(policy, tmp_path_factory.mktemp(f"disk-{policy}"))
        started[policy] = (launcher(*flags, name=policy, wait_ready=False), region, disk)
    for server, _, _ in started.values():
        server.wait_ready()
    return started


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(64)] for _ in range(n)]


def _complete(server: Server, prompt: list[int]) -> tuple[list[int] | None, int, dict]:
    """(greedy token ids or None on an error status, the HTTP status, the body)."""
    response = server.http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    body = response.json()
    if response.status_code != 200:
        return None, response.status_code, body
    return body["choices"][0]["token_ids"], 200, body


def _tokens(server: Server, prompt: list[int]) -> list[int]:
    tokens, status, body = _complete(server, prompt)
    assert status == 200, body
    return tokens


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _disk_hits(server: Server) -> float:
    return sum(v for k, v in server.metrics().items()
               if k.startswith("vllm:kv_offload_tiering_block_hits_total{") and 'tier="1:disk"' in k)


def _corrupt_every_file(disk: Path) -> int:
    """Flip a byte in the data of every other disk-tier file and cut the rest short; returns the files hit."""
    files = sorted(disk.glob("*.kvblock"))
    for i, path in enumerate(files):
        if i % 2:
            os.truncate(path, path.stat().st_size // 2)
        else:
            with open(path, "r+b") as f:
                f.seek(DISK_HEADER + 100)
                byte = f.read(1)
                f.seek(DISK_HEADER + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
    return len(files)


def _to_disk(server: Server, prompt: list[int], seed: int) -> list[int]:
    """Send `prompt` (its tokens back), then four other prompts: its blocks leave the pool and the RAM tier for
    the disk tier."""
    tokens = _tokens(server, prompt)
    for other in _prompts(4, seed):
        _tokens(server, other)
    return tokens


def test_a_tier_filled_far_past_its_size_evicts_and_corrupted_disk_files_are_recomputed(servers):
    server, region, disk = servers["recompute"]
    engine_pid = server.engine_pid()
    assert region.exists() and disk.is_dir()
    first, *fill = _prompts(21, seed=1)
    expected = _tokens(server, first)
    for prompt in fill:  # 80 blocks into a tier of 32: LRU eviction, no error
        _tokens(server, prompt)
    files = list(disk.glob("*.kvblock"))
    assert 0 < len(files) <= DISK_BLOCKS
    assert server.metric("vllm:kv_offload_tiering_write_bytes_total") > 0  # RAM spilled to disk
    tokens, _, body = _complete(server, first)  # evicted from every tier: computed again
    assert tokens == expected and _cached(body) == 0
    tokens, _, body = _complete(server, fill[-1])  # the newest: still in the tier
    assert _cached(body) > 0

    prompt = _prompts(1, seed=2)[0]
    expected = _to_disk(server, prompt, seed=3)
    disk_hits = _disk_hits(server)
    errors = server.metric("pagedllm:kv_offload_load_errors_total")
    assert _corrupt_every_file(disk) > 0
    tokens, status, body = _complete(server, prompt)
    assert status == 200 and tokens == expected, body
    assert server.metric("pagedllm:kv_offload_load_errors_total") > errors
    assert _disk_hits(server) > disk_hits
    # its fresh copy, from the RAM tier (the step of the failed load once saved that load's garbage under the
    # prefix's hashes, and this request got it)
    assert _tokens(server, prompt) == expected
    assert_server_intact(server, engine_pid)
    assert "Traceback" not in server.log()
    server.close()
    assert not region.exists() and not disk.exists()


def test_a_failed_load_under_policy_fail_fails_that_request_only(servers):
    server, region, disk = servers["fail"]
    engine_pid = server.engine_pid()
    prompt = _prompts(1, seed=4)[0]
    expected = _to_disk(server, prompt, seed=5)
    assert _corrupt_every_file(disk) > 0
    results: dict[str, tuple] = {}
    threads = [threading.Thread(target=lambda k=k, p=p: results.__setitem__(k, _complete(server, p)))
               for k, p in (("prompt", prompt), ("fresh", _prompts(1, seed=7)[0]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens, status, body = results["prompt"]
    assert status == 500 and "kv_load_failure_policy" in body["error"]["message"], body
    assert results["fresh"][1] == 200
    assert _tokens(server, prompt) == expected  # its corrupted files were dropped: computed again
    assert_server_intact(server, engine_pid)
    server.close()
    assert not region.exists() and not disk.exists()
