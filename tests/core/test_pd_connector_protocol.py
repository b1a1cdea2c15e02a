"""The P/D connector's scheduler side against vLLM's NixlConnector protocol (no processes: the end-to-end pair is
tests/entrypoints/test_pd_connector_server.py), and the heads a consumer rank reads from producer ranks."""

from __future__ import annotations

import json

import pytest

from pagedllm.config import EngineConfig
from pagedllm.config.kv_transfer import KVTransferConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.kv_transfer.base import KVConnectorRole
from pagedllm.kv_transfer.factory import KVConnectorFactory
from pagedllm.kv_transfer.pd_wire import consumers_per_producer, producer_reads
from pagedllm.sampling_params import SamplingParams


def _connector(role: str, connector: str = "NixlConnector", **extra):
    config = EngineConfig()
    config.kv_transfer_config = KVTransferConfig(kv_connector=connector, kv_role=role, kv_port=15000,
                                                 engine_id="engine-p", kv_connector_extra_config=extra)
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, (0, 0, 1))


def _request(params: dict | None, num_prompt: int = 40) -> Request:
    return Request("r1", list(range(1, num_prompt + 1)), SamplingParams(max_tokens=1), None, 0.0, 16,
                   kv_transfer_params=params)


def test_producer_answers_with_vllms_fields_and_keeps_the_blocks():
    producer = _connector("kv_producer", abort_request_timeout=5)
    request = _request({"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    producer.update_state_after_alloc(request, [7, 8, 9], 0)
    assert producer.build_connector_meta(None) == {"reqs_in_batch": ["r1"]}
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = producer.request_finished(request, [7, 8, 9])
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
                      "remote_engine_id": "engine-p", "remote_request_id": "r1", "remote_host": "127.0.0.1",
                      "remote_port": 15000, "tp_size": 1}
    json.dumps(params)
    assert set(producer.build_connector_meta(None)["reqs_to_send"]) == {"r1"}


def test_producer_does_not_keep_an_aborted_or_stopped_request():
    producer = _connector("kv_both")
    request = _request({"do_remote_decode": True})
    request.status = RequestStatus.FINISHED_STOPPED  # EOS as the first token: nothing to pull (vLLM's)
    assert producer.request_finished(request, [1, 2, 3]) == (False, None)
    assert producer.build_connector_meta(None) == {"reqs_not_processed": ["r1"]}


def test_consumer_loads_past_its_local_hit_once():
    consumer = _connector("kv_consumer", connector="PagedLLMPDConnector")
    remote = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5, 6],
              "remote_engine_id": "engine-p", "remote_request_id": "p1", "remote_host": "10.0.0.1",
              "remote_port": 15000, "tp_size": 1}
    request = _request(dict(remote))
    assert consumer.get_num_new_matched_tokens(request, 16) == (24, True)  # 40 tokens, one block cached here
    consumer.update_state_after_alloc(request, [11, 12, 13], 24)
    recv = consumer.build_connector_meta(None)["reqs_to_recv"]["r1"]
    assert recv["local_block_ids"] == [12, 13] and recv["remote_block_ids"] == [5, 6]  # the same places
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert consumer.get_num_new_matched_tokens(request, 16) == (0, False)  # one transfer per request


@pytest.mark.parametrize("bad", [{"remote_port": "15000"}, {"remote_block_ids": ["a"]}, {"remote_host": None},
                                 {"tp_size": 0}, {"remote_engine_id": 3}])
def test_consumer_computes_a_request_whose_params_are_not_a_producers_answer(bad):
    consumer = _connector("kv_consumer")
    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e", "remote_request_id": "p",
              "remote_host": "h", "remote_port": 1, **bad}
    request = _request(params)
    assert consumer.get_num_new_matched_tokens(request, 0) == (0, False)
    consumer.update_state_after_alloc(request, [3, 4, 5], 0)
    assert consumer.build_connector_meta(None) == {}


def test_allowed_remote_hosts_limits_where_a_consumer_connects():
    consumer = _connector("kv_consumer", allowed_remote_hosts=["10.0.0.1"])
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_engine_id": "e",
              "remote_request_id": "p", "remote_port": 1}
    assert consumer.get_num_new_matched_tokens(_request({**params, "remote_host": "10.0.0.1"}), 0) == (40, True)
    assert consumer.get_num_new_matched_tokens(_request({**params, "remote_host": "169.254.169.254"}), 0) == (0, False)


def test_a_consumer_request_ended_before_it_ran_still_tells_the_producer():
    consumer = _connector("kv_consumer")
    request = _request({"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_engine_id": "e",
                        "remote_request_id": "p", "remote_host": "h", "remote_port": 1})
    request.status = RequestStatus.FINISHED_ABORTED
    assert consumer.request_finished(request, []) == (False, None)
    assert consumer.build_connector_meta(None)["reqs_to_recv"]["r1"]["local_block_ids"] == []


def test_heads_read_across_tensor_parallel_sizes():
    assert producer_reads(1, 2, 4, 2) == [(1, None)]  # same size: rank to rank, all its heads
    assert producer_reads(1, 2, 2, 1) == [(0, (2, 4))]  # 4 heads: consumer rank 1 of 2 reads heads 2-3 of rank 0
    assert producer_reads(0, 1, 4, 2) == [(0, (0, 2)), (1, (2, 4))]  # one consumer rank reads both producers
    assert consumers_per_producer(2, 1) == 2 and consumers_per_producer(1, 2) == 1
    with pytest.raises(ValueError):
        producer_reads(0, 1, 3, 2)
