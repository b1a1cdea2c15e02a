"""The KV offload tier on a real data-parallel server: two replicas (engine-core processes) share one region, so a
prompt computed by replica 0 is an external prefix-cache hit on replica 1, counted in /metrics with vLLM's names
per replica and per tier; the region is gone once the server exits."""

from __future__ import annotations

import json
import os
import random
import uuid

import pytest
from server_utils import MODEL_NAME

pytestmark = pytest.mark.slow  # starts a server with two engine cores


def _samples(text: str, name: str) -> dict[str, float]:
    """{label text: value} of one metric's samples."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_dp_replicas_share_the_tier_and_metrics_count_it(remote_server_factory, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DP_ROUTER", "round_robin")  # request 1 -> replica 0, request 2 -> replica 1
    shm_name = f"pagedllm-test-{uuid.uuid4().hex}"
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 20, "shm_name": shm_name}}
    server = remote_server_factory("--data-parallel-size", "2", "--kv-transfer-config", json.dumps(config))
    prompt = [random.Random(3).randrange(300) for _ in range(80)]  # 5 full blocks of 16
    texts = [server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                                temperature=0.0).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    metrics = server.get("/metrics").text
    hits = _samples(metrics, "vllm:external_prefix_cache_hits_total")
    queries = _samples(metrics, "vllm:external_prefix_cache_queries_total")
    assert [hits[f'engine="{e}",model_name="{MODEL_NAME}"'] for e in (0, 1)] == [0, 79], metrics
    assert queries[f'engine="0",model_name="{MODEL_NAME}"'] == 80
    tier_hits = _samples(metrics, "vllm:kv_offload_tiering_block_hits_total")
    assert tier_hits[f'engine="1",model_name="{MODEL_NAME}",tier="0:primary"'] == 5
    stored = _samples(metrics, "vllm:kv_offload_total_bytes_total")
    assert stored[f'engine="0",model_name="{MODEL_NAME}",transfer_type="GPU_to_CPU"'] > 0
    assert os.path.exists(f"/dev/shm/{shm_name}")
    server.close()
    assert server.proc.returncode is not None
    assert not os.path.exists(f"/dev/shm/{shm_name}"), "the region outlived the server"
