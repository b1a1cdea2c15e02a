"""KVOutputAggregator: with tensor parallelism a request is done once every rank has reported it."""

from pagedllm.executor.kv_output_aggregator import KVOutputAggregator
from pagedllm.messages import KVConnectorOutput


def test_a_request_is_done_once_every_rank_reported_it_in_any_step():
    agg = KVOutputAggregator(world_size=2)
    first = agg.aggregate([KVConnectorOutput(finished_sending={"a"}, finished_recving={"b"}),
                           KVConnectorOutput(finished_recving={"b"}, invalid_block_ids={7})])
    assert first.finished_sending == set() and first.finished_recving == {"b"} and first.invalid_block_ids == {7}
    second = agg.aggregate([None, KVConnectorOutput(finished_sending={"a"})])
    assert second.finished_sending == {"a"} and second.is_empty() is False
    assert agg.aggregate([KVConnectorOutput(), KVConnectorOutput()]).is_empty()
