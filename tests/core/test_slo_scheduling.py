"""--scheduling-policy slo (core/slo_queue.py): order by slack, priority aging and the starvation bound, early
shedding (which frees everything), and the preemption victim. A simulated clock: no sleeps."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.messages import SLO_UNATTAINABLE, FinishReason

from .utils import assert_all_free, check_pool_invariants, create_requests, create_scheduler, step


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def slo_scheduler(clock: Clock, **kwargs):
    scheduler = create_scheduler(scheduling_policy="slo", **kwargs)
    scheduler.waiting.clock = clock
    return scheduler


def with_slo(request, ttft_ms=None, tpot_ms=None):
    request.sampling_params = msgspec.structs.replace(request.sampling_params, ttft_slo_ms=ttft_ms,
                                                      tpot_slo_ms=tpot_ms)
    return request


def test_waiting_requests_go_by_slack_and_without_deadline_last():
    clock = Clock()
    scheduler = slo_scheduler(clock, block_size=4, max_num_seqs=1)
    reqs = create_requests(4, num_tokens=4, block_size=4, arrival_times=[100.0, 100.1, 100.2, 100.3])
    with_slo(reqs[1], ttft_ms=5000)
    with_slo(reqs[2], ttft_ms=1000)  # the tightest; reqs[0] has no deadline: after every request with one
    with_slo(reqs[3], ttft_ms=3000)
    for r in reqs:
        scheduler.add_request(r)
    clock.now = 100.4
    assert [r.request_id for r in scheduler.waiting] == ["2", "3", "1", "0"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["2"]


def test_slack_counts_the_prefill_estimate():
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4)
    (long,) = create_requests(1, num_tokens=40, block_size=4, arrival_times=[0.0], id_prefix="long")
    (short,) = create_requests(1, num_tokens=4, block_size=4, arrival_times=[0.0], id_prefix="short")
    with_slo(long, ttft_ms=3000)
    with_slo(short, ttft_ms=2500)
    scheduler.add_request(long)
    scheduler.add_request(short)
    assert scheduler.waiting.peek() is short  # no measure yet: the earlier deadline
    scheduler.waiting.observe_step(10, 1.0)  # 10 tokens/s: long's 40 tokens take 4 s, short's 4 take 0.4 s
    assert scheduler.waiting.peek() is long  # slack 3 - 4 = -1 s against 2.5 - 0.4 = 2.1 s


def test_priority_first_then_aging_then_the_bound():
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4, slo_max_wait_s=8.0)  # a level per 2 s waited
    low, high = create_requests(2, num_tokens=4, block_size=4, priorities=[3, 0], arrival_times=[0.0, 1.0])
    scheduler.add_request(low)
    scheduler.add_request(high)
    clock.now = 1.0
    assert scheduler.waiting.peek() is high
    clock.now = 7.9  # low: 3 - 3 = 0; high: 0 - 3 = -3
    assert scheduler.waiting.peek() is high
    clock.now = 8.0  # low reached the bound: ahead of everything newer
    assert scheduler.waiting.peek() is low
    # aging alone: priority 1 that waited 5 s (1 - 2 = -1) passes a fresh priority 0
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4, slo_max_wait_s=8.0)
    older, fresh = create_requests(2, num_tokens=4, block_size=4, priorities=[1, 0], arrival_times=[0.0, 5.0])
    scheduler.add_request(older)
    scheduler.add_request(fresh)
    clock.now = 5.0
    assert scheduler.waiting.peek() is older


def test_pop_takes_what_peek_returned_even_if_the_clock_moved_ranks():
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4, slo_max_wait_s=8.0)
    old, new = create_requests(2, num_tokens=4, block_size=4, priorities=[3, 0], arrival_times=[0.0, 1.0])
    scheduler.add_request(old)
    scheduler.add_request(new)
    clock.now = 7.99
    assert scheduler.waiting.peek() is new
    clock.now = 8.0  # old is overdue now: the next peek would rank it first
    assert scheduler.waiting.pop() is new  # but pop takes what was peeked (the scheduler allocated it)
    assert list(scheduler.waiting) == [old]


def test_low_priority_admitted_within_the_bound_under_a_stream_of_high_priority():
    """One running slot; a high-priority request with a deadline arrives every step, each step takes 0.5 s: the
    low-priority request without a deadline still starts once it has waited slo_max_wait_s."""
    clock = Clock(0.0)
    bound = 10.0
    scheduler = slo_scheduler(clock, block_size=4, max_num_seqs=1, slo_max_wait_s=bound)
    (low,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=1, priorities=[5], arrival_times=[0.0],
                             id_prefix="low")
    scheduler.add_request(low)
    started = None
    for i in range(100):
        (high,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=1, priorities=[0],
                                  arrival_times=[clock.now], id_prefix=f"high{i}-")
        scheduler.add_request(with_slo(high, ttft_ms=1000))
        out, _ = step(scheduler)
        if "low0" in out.num_scheduled_tokens:
            started = clock.now
            break
        assert len(out.num_scheduled_tokens) == 1  # a high-priority request went first
        clock.now += 0.5
    assert started == bound
    assert all(r.request_id.startswith("high") for r in scheduler.waiting)


def test_unattainable_request_is_shed_with_an_error_and_frees_everything():
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4, num_blocks=8, max_num_seqs=1, max_num_batched_tokens=64,
                              max_model_len=32)
    plain, tight, loose = create_requests(3, num_tokens=8, block_size=4, max_tokens=4, arrival_times=[0, 0, 0])
    with_slo(tight, ttft_ms=1500)
    with_slo(loose, ttft_ms=60_000)
    for r in (plain, tight, loose):
        scheduler.add_request(r)
    scheduler.waiting.observe_step(8, 1.0)  # 8 tokens/s: an 8-token prompt takes 1 s
    out, _ = step(scheduler)  # tight has the least slack (0.5 s) and can still make it: it runs
    assert list(out.num_scheduled_tokens) == ["1"] and scheduler.shed_outputs == []
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    (late,) = create_requests(1, num_tokens=8, block_size=4, arrival_times=[1.0], id_prefix="late")
    scheduler.add_request(with_slo(late, ttft_ms=1900))  # due at 2.9 s; at 2.0 s + 1 s of prefill: too late
    clock.now = 2.0
    out, _ = step(scheduler)
    assert late.status == RequestStatus.FINISHED_ERROR and "late0" not in scheduler.requests
    assert "late0" not in out.num_scheduled_tokens and "late0" in out.finished_req_ids
    (shed,) = scheduler.shed_outputs
    assert shed.request_id == "late0" and shed.finish_reason == FinishReason.ERROR and not shed.new_token_ids
    assert shed.error_code == SLO_UNATTAINABLE and "ttft_slo_ms of 1900 ms" in shed.error
    assert "1000 ms" in shed.error  # the estimate it was shed on
    assert scheduler.make_stats().num_slo_shed_delta == 1
    assert list(out.num_scheduled_tokens) == ["2"]  # loose goes on; plain (no deadline) is never shed
    check_pool_invariants(scheduler)
    while scheduler.has_unfinished_requests():
        clock.now += 0.1
        step(scheduler)
    assert plain.status == loose.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(scheduler)


def test_victim_has_most_slack_and_a_request_that_streamed_is_never_shed():
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4, num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    a, b = create_requests(2, num_tokens=8, block_size=4, max_tokens=12, arrival_times=[0.0, 0.1])
    with_slo(a, ttft_ms=1000, tpot_ms=100)  # a arrived first but has more slack: it is the victim (fcfs: b)
    with_slo(b, ttft_ms=500, tpot_ms=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(5):
        step(scheduler)  # 13 tokens each, 12 computed: the pool is full
    clock.now = 0.5
    scheduler.waiting.observe_step(4, 40.0)  # a very slow engine: a's TTFT deadline is long out of reach
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"0"} and a.status == RequestStatus.PREEMPTED
    assert a.num_output_tokens == 5 and scheduler.shed_outputs == []  # it streamed tokens: kept, not shed
    while scheduler.has_unfinished_requests():
        clock.now += 0.1
        step(scheduler)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED and scheduler.shed_outputs == []
    assert_all_free(scheduler)


def test_fields_are_refused_without_the_slo_policy_and_checked_with_it():
    from pagedllm.engine.input_processor import InputProcessor, InvalidRequestError
    from pagedllm.messages import ModelLimits
    from pagedllm.sampling_params import SamplingParams

    fcfs = InputProcessor(ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=None))
    slo = InputProcessor(ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=None, slo_scheduling=True,
                                     priority_scheduling=True))
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        params = SamplingParams(max_tokens=2, **{name: 100.0})
        with pytest.raises(InvalidRequestError, match=f"{name}.*--scheduling-policy slo") as e:
            fcfs.process("r", [1, 2], params)
        assert e.value.param == name
        request = slo.process("r", [1, 2], params, priority=3)
        assert getattr(request.sampling_params, name) == 100.0 and request.priority == 3
        with pytest.raises(InvalidRequestError, match=name) as e:
            slo.process("r", [1, 2], SamplingParams(max_tokens=2, **{name: 0.0}))
        assert e.value.param == name


def test_prefill_estimate_counts_prefill_steps_only():
    """Decode steps (4 requests, a token each, 200 ms on a loaded machine) do not price a prompt's tokens; prefill
    steps (64 tokens of one request in 100 ms) do: 1.5625 ms a token."""
    clock = Clock(0.0)
    scheduler = slo_scheduler(clock, block_size=4)
    queue = scheduler.waiting
    (request,) = create_requests(1, num_tokens=100, block_size=4)
    queue.observe_step(4, 0.200, num_reqs=4)
    assert queue.prefill_estimate_s(request) == 0.0 and queue.tokens_per_s is None and not queue.unattainable()
    for _ in range(20):
        queue.observe_step(4, 0.200, num_reqs=4)
        queue.observe_step(64, 0.100, num_reqs=1)
    assert abs(queue.prefill_estimate_s(request) - 0.15625) < 1e-9
    assert abs(queue.tokens_per_s - 640) < 1e-6
