"""The scheduler with several steps in flight (pipeline parallelism's batch queue, engine/core.py): what it
schedules again before a step's output is applied, the sampled tokens it sends to the stages before the last, and
the late outputs it drops."""

from pagedllm.core.request import RequestStatus
from pagedllm.messages import ModelRunnerOutput

from .utils import create_requests, create_scheduler


def _output(so, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[sampled.get(r, []) for r in req_ids])


def test_prefill_chunks_pipeline_decodes_wait_for_their_token():
    """a's second chunk is scheduled while its first is in flight; a decode is not scheduled again until its
    token is applied; with pipeline parallelism the next step carries the sampled token for the first stages."""
    scheduler = create_scheduler(max_num_batched_tokens=8, max_model_len=64)
    scheduler.pipeline_parallel = True
    a, b = create_requests(2, num_tokens=12, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    s1 = scheduler.schedule()
    s2 = scheduler.schedule()  # s1 still in flight
    s3 = scheduler.schedule()
    assert s1.num_scheduled_tokens == {"0": 8}
    assert s2.num_scheduled_tokens == {"0": 4, "1": 4}  # a's last chunk pipelines behind its first
    assert s3.num_scheduled_tokens == {"1": 8}  # a waits: its last chunk's token is not known yet
    assert [s.step_id for s in (s1, s2, s3)] == [0, 1, 2]
    scheduler.update_from_output(s1, _output(s1, {}))
    assert not scheduler.schedule().num_scheduled_tokens  # everything left is in flight
    scheduler.update_from_output(s2, _output(s2, {"0": [77]}))
    s5 = scheduler.schedule()
    assert s5.num_scheduled_tokens == {"0": 1}
    assert s5.scheduled_cached_reqs.new_token_ids == [[77]]  # the first stage learns a's token here
    scheduler.pipeline_parallel = False
    scheduler.update_from_output(s3, _output(s3, {"1": [5]}))
    assert scheduler.schedule().scheduled_cached_reqs.new_token_ids == []  # nothing extra without it


def test_output_of_a_request_preempted_in_flight_is_dropped_even_once_resumed():
    """b's step is in flight when a's decode preempts it; b is resumed (a aborted) before that step's output is
    applied (three steps in flight, as at pp 3): the stale token is not appended."""
    scheduler = create_scheduler(block_size=4, num_blocks=3, max_num_batched_tokens=8, max_model_len=12)
    a, = create_requests(1, num_tokens=4, block_size=4, max_tokens=8, id_prefix="a")
    b, = create_requests(1, num_tokens=8, block_size=4, max_tokens=8, id_prefix="b", arrival_times=[1.0])
    scheduler.add_request(a)
    s1 = scheduler.schedule()
    scheduler.add_request(b)
    s2 = scheduler.schedule()
    assert s1.num_scheduled_tokens == {"a0": 4} and s2.num_scheduled_tokens == {"b0": 8}
    scheduler.update_from_output(s1, _output(s1, {"a0": [9]}))
    s3 = scheduler.schedule()  # a needs a second block: b, the latest arrival, is preempted while in flight
    assert s3.preempted_req_ids == {"b0"} and b.status is RequestStatus.PREEMPTED
    scheduler.finish_requests("a0", RequestStatus.FINISHED_ABORTED)
    s4 = scheduler.schedule()
    assert [r.req_id for r in s4.scheduled_new_reqs] == ["b0"] and b.status is RequestStatus.RUNNING
    outputs = scheduler.update_from_output(s2, _output(s2, {"b0": [7]}))  # b's stale step
    assert not outputs.outputs and b.output_token_ids == [] and b.num_computed_tokens == 8
    outputs = scheduler.update_from_output(s4, _output(s4, {"b0": [8]}))
    assert b.output_token_ids == [8]
