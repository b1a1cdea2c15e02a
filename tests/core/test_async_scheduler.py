"""AsyncScheduler (--async-scheduling) without a model: step N+1 is scheduled before step N's token is applied
(placeholders), a request is not scheduled past its last token, a request that stops while its next step is in
flight drops that step's token and frees every block, and preemption clears the placeholders."""

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.async_scheduler import AsyncScheduler
from pagedllm.core.request import RequestStatus
from pagedllm.messages import ModelRunnerOutput

from .utils import assert_all_free, check_pool_invariants, create_requests


def _scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=64, max_model_len=64) -> AsyncScheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=True)
    return AsyncScheduler(config, CacheConfig(block_size=block_size), num_blocks, max_model_len)


def _output(so, sampled: dict[str, int]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids])


def test_decodes_are_scheduled_before_the_token_in_flight_is_applied():
    scheduler = _scheduler()
    a, = create_requests(1, num_tokens=6, block_size=4, max_tokens=4)
    scheduler.add_request(a)
    s0 = scheduler.schedule()
    assert s0.num_scheduled_tokens == {"0": 6} and a.num_output_placeholders == 1
    s1 = scheduler.schedule()  # s0 in flight: a decodes the token s0 samples (position 6)
    assert s1.num_scheduled_tokens == {"0": 1} and a.num_computed_tokens == 7 and a.num_output_placeholders == 2
    assert s1.scheduled_cached_reqs.num_computed_tokens == [6]
    scheduler.update_from_output(s0, _output(s0, {"0": 100}))
    assert a.output_token_ids == [100] and a.num_output_placeholders == 1
    s2 = scheduler.schedule()
    scheduler.update_from_output(s1, _output(s1, {"0": 101}))
    s3 = scheduler.schedule()  # tokens 100..103 are the 4 of max_tokens once s2 and s3 sample: nothing more
    assert s2.num_scheduled_tokens == s3.num_scheduled_tokens == {"0": 1} and a.num_output_placeholders == 2
    assert not scheduler.schedule().num_scheduled_tokens
    scheduler.update_from_output(s2, _output(s2, {"0": 102}))
    outputs = scheduler.update_from_output(s3, _output(s3, {"0": 103}))
    assert a.output_token_ids == [100, 101, 102, 103] and outputs.outputs[0].finish_reason is not None
    assert_all_free(scheduler)


def test_prefill_chunks_get_no_placeholder_until_the_last():
    scheduler = _scheduler(max_num_batched_tokens=8)
    a, = create_requests(1, num_tokens=12, block_size=4, max_tokens=8)
    scheduler.add_request(a)
    s0 = scheduler.schedule()
    assert a.num_output_placeholders == 0  # 8 of 12 prompt tokens: samples nothing
    s1 = scheduler.schedule()
    assert s1.num_scheduled_tokens == {"0": 4} and a.num_output_placeholders == 1
    s2 = scheduler.schedule()
    assert s2.num_scheduled_tokens == {"0": 1} and a.num_output_placeholders == 2
    scheduler.update_from_output(s0, _output(s0, {}))
    assert a.num_output_placeholders == 2 and not a.output_token_ids


def test_a_request_that_stops_in_flight_drops_the_extra_token_and_frees_its_blocks():
    """a stops (a stop token) at s1 while s2, which already decodes it again, is in flight; b keeps going."""
    scheduler = _scheduler()
    a, b = create_requests(2, num_tokens=7, block_size=4, max_tokens=10, stop_token_ids=[7])
    for r in (a, b):
        scheduler.add_request(r)
    s0 = scheduler.schedule()
    s1 = scheduler.schedule()
    scheduler.update_from_output(s0, _output(s0, {"0": 1, "1": 1}))
    s2 = scheduler.schedule()
    outputs = scheduler.update_from_output(s1, _output(s1, {"0": 7, "1": 2}))
    assert a.status is RequestStatus.FINISHED_STOPPED and [o.request_id for o in outputs.outputs] == ["0", "1"]
    assert "0" not in scheduler.requests and "0" not in scheduler.kv_cache_manager.req_to_blocks
    check_pool_invariants(scheduler)
    outputs = scheduler.update_from_output(s2, _output(s2, {"0": 3, "1": 3}))  # a's extra token: dropped
    assert [o.request_id for o in outputs.outputs] == ["1"] and a.output_token_ids == [1, 7]
    s3 = scheduler.schedule()
    assert s3.finished_req_ids == {"0"} and list(s3.num_scheduled_tokens) == ["1"]
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)  # an abort with s3 in flight
    assert not scheduler.update_from_output(s3, _output(s3, {"1": 4})).outputs
    assert_all_free(scheduler)


def test_preemption_in_flight_clears_the_placeholders_and_drops_the_stale_token():
    scheduler = _scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, = create_requests(1, num_tokens=4, block_size=4, max_tokens=8, id_prefix="a")
    b, = create_requests(1, num_tokens=8, block_size=4, max_tokens=8, id_prefix="b", arrival_times=[1.0])
    scheduler.add_request(a)
    scheduler.add_request(b)
    s0 = scheduler.schedule()  # a: 1 block, b: 2 blocks of the 3 usable
    assert s0.num_scheduled_tokens == {"a0": 4, "b0": 8}
    s1 = scheduler.schedule()  # a needs a second block for position 4: b, the latest arrival, is preempted
    assert s1.preempted_req_ids == {"b0"} and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    assert a.num_output_placeholders == 2
    scheduler.update_from_output(s0, _output(s0, {"a0": 5, "b0": 9}))
    assert b.output_token_ids == [] and a.output_token_ids == [5]  # b's token was stale
    check_pool_invariants(scheduler)


def test_no_step_past_max_model_len():
    scheduler = _scheduler(max_model_len=8)
    a, = create_requests(1, num_tokens=6, block_size=4, max_tokens=None)
    scheduler.add_request(a)
    s0 = scheduler.schedule()
    s1 = scheduler.schedule()  # position 6; its token is the 8th: the request then stops
    assert s1.num_scheduled_tokens == {"0": 1}
    assert not scheduler.schedule().num_scheduled_tokens
    scheduler.update_from_output(s0, _output(s0, {"0": 1}))
    scheduler.update_from_output(s1, _output(s1, {"0": 2}))
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED and a.all_token_ids[-2:] == [1, 2]
    assert_all_free(scheduler)
