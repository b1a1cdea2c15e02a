import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import QueueFullError
from pagedllm.messages import FinishReason, LogprobsEntry, ModelRunnerOutput

from .utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    check_pool_invariants,
    create_requests,
    create_scheduler,
    make_output,
    step,
)


def test_basic_schedule_and_decode():
    scheduler = create_scheduler(block_size=4, num_blocks=20)
    requests = create_requests(3, num_tokens=6, block_size=4, max_tokens=2)
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["0", "1", "2"]
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0, 1], [2, 3], [4, 5]]
    assert out.num_scheduled_tokens == {"0": 6, "1": 6, "2": 6}
    assert out.total_num_scheduled_tokens == 18
    assert all(r.num_computed_tokens == 6 and r.status == RequestStatus.RUNNING for r in requests)
    eo = scheduler.update_from_output(out, make_output(scheduler, out, token_id=7))
    assert [(o.request_id, o.new_token_ids) for o in eo.outputs] == [("0", [7]), ("1", [7]), ("2", [7])]
    assert all(o.first_scheduled_time is not None for o in eo.outputs)

    out, eo = step(scheduler, token_id=8)
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["0", "1", "2"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [6, 6, 6]
    assert out.scheduled_cached_reqs.new_block_ids == [[], [], []]
    assert all(o.finish_reason == FinishReason.LENGTH for o in eo.outputs)
    assert all(o.first_scheduled_time is None for o in eo.outputs)
    assert scheduler.schedule().finished_req_ids == {"0", "1", "2"}
    assert_all_free(scheduler)


def test_chunked_prefill_over_several_steps():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_num_batched_tokens=8, max_model_len=64)
    (r,) = create_requests(1, num_tokens=20, block_size=4, max_tokens=3)
    scheduler.add_request(r)
    out, eo = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 8} and out.scheduled_new_reqs[0].block_ids == [0, 1]
    assert eo.outputs == [] and r.num_output_tokens == 0 and r.num_computed_tokens == 8
    # Blocks filled by the chunk are registered once it ran.
    assert scheduler.kv_cache_manager.num_cached_blocks["0"] == 2
    out, eo = step(scheduler)
    assert out.scheduled_cached_reqs.new_block_ids == [[2, 3]]
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert eo.outputs == []
    out, eo = step(scheduler, token_id=5)
    assert out.num_scheduled_tokens == {"0": 4}
    assert [o.new_token_ids for o in eo.outputs] == [[5]]
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1} and out.scheduled_cached_reqs.new_block_ids == [[5]]


def test_long_prefill_threshold_lets_decodes_through():
    scheduler = create_scheduler(block_size=4, num_blocks=40, max_num_batched_tokens=64, max_model_len=64,
                                 long_prefill_token_threshold=6)
    (a,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=10)
    scheduler.add_request(a)
    step(scheduler)
    (b,) = create_requests(1, num_tokens=30, block_size=4, id_prefix="b")
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "b0": 6}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "b0": 6}


def test_prefill_chunks_shrink_with_context_so_no_step_is_long():
    """Issue 17: a 7,000-token prompt ran in chunks of the whole token budget (2,048), the last attending
    2,048 x 7,000 pairs: a step of over 10 s on the CPU, while every other stream waited. With the default
    attention budget (2,048 x 1,024 pairs), chunks shrink as the context grows, and the decoding neighbour
    advances every step."""
    scheduler = create_scheduler(max_num_batched_tokens=2048, max_model_len=8192)
    (a,) = create_requests(1, num_tokens=4, max_tokens=1000, ignore_eos=True)
    scheduler.add_request(a)
    step(scheduler)
    (b,) = create_requests(1, num_tokens=7000, max_tokens=1, id_prefix="b")
    scheduler.add_request(b)
    chunks = []
    while b.num_computed_tokens < 7000:
        computed = b.num_computed_tokens
        out, _ = step(scheduler)
        assert out.num_scheduled_tokens["0"] == 1  # the neighbour decodes every step
        num_tokens = out.num_scheduled_tokens["b0"]
        assert num_tokens * (computed + num_tokens) <= 2048 * 1024, (computed, num_tokens)
        chunks.append(num_tokens)
    assert chunks == sorted(chunks, reverse=True) and chunks[0] == 1448 and len(chunks) == 13, chunks


def test_prefill_attention_budget_off_and_first_chunk_always_advances():
    scheduler = create_scheduler(max_num_batched_tokens=2048, max_model_len=8192, max_prefill_attention_pairs=0)
    (b,) = create_requests(1, num_tokens=7000, max_tokens=1)
    scheduler.add_request(b)
    assert [step(scheduler)[0].num_scheduled_tokens["0"] for _ in range(4)] == [2048, 2048, 2048, 856]
    scheduler = create_scheduler(max_num_batched_tokens=2048, max_model_len=8192, max_prefill_attention_pairs=10)
    (b,) = create_requests(1, num_tokens=100, max_tokens=1)
    scheduler.add_request(b)
    # 3 x 3, 2 x 5, then 1 x 6 ... 1 x 10 fit 10 pairs; from 10 tokens on, none does: one token a step anyway
    assert [step(scheduler)[0].num_scheduled_tokens["0"] for _ in range(9)] == [3, 2, 1, 1, 1, 1, 1, 1, 1]


def test_spent_attention_budget_admits_no_more_prompts_a_token_each():
    """The budget's last pairs once let every waiting prompt in with a one-token chunk (such chunks went
    uncounted): 29 long prompts admitted in one step, each holding blocks it would not use for many steps."""
    scheduler = create_scheduler(max_num_batched_tokens=2048, max_model_len=8192)
    for request in create_requests(12, num_tokens=6000, max_tokens=1):
        scheduler.add_request(request)
    out, _ = step(scheduler)
    # 1,448 x 1,448 pairs, 21 x 21 and 2 x 2 of the 448 left, 1 x 1 three times for the last 3, and no more
    assert list(out.num_scheduled_tokens.values()) == [1448, 21, 2, 1, 1, 1]
    assert len(scheduler.running) == 6 and len(scheduler.waiting) == 6


def test_chunked_prefill_off_waits_for_whole_prompt():
    scheduler = create_scheduler(block_size=4, num_blocks=40, max_num_batched_tokens=16, max_model_len=16,
                                 enable_chunked_prefill=False)
    a, b = create_requests(2, num_tokens=10, block_size=4, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 10}  # b (10) does not fit the 6 left
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"0": 1, "1": 10}
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        create_scheduler(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_max_num_seqs():
    scheduler = create_scheduler(block_size=4, num_blocks=40, max_num_seqs=2)
    for r in create_requests(3, num_tokens=4, block_size=4):
        scheduler.add_request(r)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1


def test_prefix_hits_reported_and_counted_once():
    scheduler = create_scheduler(block_size=4, num_blocks=40)
    a, b = create_requests(2, num_tokens=13, block_size=4, same_prompt=True, max_tokens=1)
    scheduler.add_request(a)
    _, eo = step(scheduler)
    assert eo.outputs[0].num_cached_tokens == 0
    scheduler.add_request(b)
    out, eo = step(scheduler)
    new = out.scheduled_new_reqs[0]
    assert new.block_ids[:3] == [0, 1, 2] and new.num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"1": 1}
    assert eo.outputs[0].num_cached_tokens == 12
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries_delta, stats.prefix_cache_hits_delta) == (26, 12)
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries_delta, stats.prefix_cache_hits_delta) == (0, 0)
    assert stats.num_free_blocks == 40 and stats.num_total_blocks == 40


def test_salt_isolation():
    scheduler = create_scheduler(block_size=4, num_blocks=40)
    (a,) = create_requests(1, num_tokens=9, block_size=4, cache_salt="alice", max_tokens=1, id_prefix="a")
    (b,) = create_requests(1, num_tokens=9, block_size=4, cache_salt="bob", max_tokens=1, id_prefix="b")
    (c,) = create_requests(1, num_tokens=9, block_size=4, cache_salt=None, max_tokens=1, id_prefix="c")
    (d,) = create_requests(1, num_tokens=9, block_size=4, cache_salt="alice", max_tokens=1, id_prefix="d")
    scheduler.add_request(a)
    step(scheduler)
    for r in (b, c):
        scheduler.add_request(r)
        out, _ = step(scheduler)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    scheduler.add_request(d)
    out, _ = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.scheduled_new_reqs[0].block_ids[:2] == [0, 1]


def test_preemption_and_resumption():
    # 6 blocks of 4 tokens. Two 8-token prompts take 2 blocks each; decode grows them until the pool
    # is exhausted and the later one is preempted.
    scheduler = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    a, b = create_requests(2, num_tokens=8, block_size=4, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, token_id=1)  # a: 9 tokens, b: 9 tokens, 4 blocks used
    out, _ = step(scheduler, token_id=2)  # each needs a 3rd block: 6 used
    assert out.scheduled_cached_reqs.new_block_ids == [[4], [5]]
    for _ in range(3):
        step(scheduler, token_id=3)  # 13 tokens each, 12 computed
    assert scheduler.num_free_blocks == 0
    out = scheduler.schedule()  # a needs a 4th block: b (latest arrival) is preempted
    assert out.preempted_req_ids == {"1"}
    assert out.num_scheduled_tokens == {"0": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert scheduler.waiting.peek() is b
    assert scheduler.kv_cache_manager.get_block_ids("1") == []
    check_pool_invariants(scheduler)
    scheduler.update_from_output(out, make_output(scheduler, out, token_id=4))
    assert scheduler.make_stats().num_preemptions_delta == 1
    # b is resumed only once blocks free up; it comes back as a new request with its outputs.
    for _ in range(20):
        out, _ = step(scheduler, token_id=5)
        if out.scheduled_new_reqs:
            break
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "1" and new.output_token_ids == [1, 2, 3, 3, 3]
    assert len(new.block_ids) == 4 and new.num_computed_tokens + out.num_scheduled_tokens["1"] == 13
    assert a.is_finished and a.num_output_tokens == 12
    while scheduler.has_unfinished_requests():
        step(scheduler, token_id=6)
    assert b.output_token_ids[:5] == [1, 2, 3, 3, 3] and b.num_output_tokens == 12
    assert_all_free(scheduler)


def test_request_preempts_itself_when_alone_in_need():
    # a runs first; b's chunk is scheduled; then a needs a block while b holds the rest.
    scheduler = create_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=16, max_model_len=16)
    a, b = create_requests(2, num_tokens=4, block_size=4, max_tokens=8)
    b.arrival_time = -1.0  # b arrived first, so a (latest) is the victim
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # a: blocks [0], b: blocks [1]; 4 computed each
    for _ in range(4):
        step(scheduler)  # 8 computed each: both hold 2 blocks, pool full
    out = scheduler.schedule()  # a needs a 3rd block; a itself is the latest arrival
    assert out.preempted_req_ids == {"0"}
    assert out.num_scheduled_tokens == {"1": 1}
    assert a.status == RequestStatus.PREEMPTED


def test_preempting_an_already_scheduled_request_returns_its_budget():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=64, max_model_len=16)
    (a,) = create_requests(1, prompt_token_ids=[1, 2], block_size=4, arrival_times=[5.0], id_prefix="a")
    (b,) = create_requests(1, num_tokens=8, block_size=4, arrival_times=[1.0], id_prefix="b")
    (c,) = create_requests(1, num_tokens=8, block_size=4, arrival_times=[2.0], id_prefix="c")
    for r in (a, b, c):
        scheduler.add_request(r)
    out, _ = step(scheduler)
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[0], [1, 2], [3, 4]]
    # a (first in the running list, room left in its block) is scheduled; b then needs a block and
    # the latest arrival, a, is preempted: its token goes back to the budget and its block to b.
    # c then needs a block too and, now the latest arrival, preempts itself.
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"a0", "c0"}
    assert out.num_scheduled_tokens == {"b0": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == ["b0"]
    assert out.scheduled_cached_reqs.new_block_ids == [[0]]
    assert [r.request_id for r in scheduler.waiting] == ["c0", "a0"]
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 9
    check_pool_invariants(scheduler)


def test_priority_ordering_and_victim():
    scheduler = create_scheduler(block_size=4, num_blocks=40, max_num_seqs=2, scheduling_policy="priority")
    reqs = create_requests(4, num_tokens=4, block_size=4, priorities=[3, 1, 2, 1], max_tokens=1)
    for r in reqs:
        scheduler.add_request(r)
    assert [r.request_id for r in scheduler.waiting] == ["1", "3", "2", "0"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["1", "3"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["2", "0"]


def test_priority_preempts_lowest_priority():
    scheduler = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=64, max_model_len=24,
                                 scheduling_policy="priority")
    reqs = create_requests(3, num_tokens=4, block_size=4, priorities=[0, 5, 1], max_tokens=20)
    for r in reqs:
        scheduler.add_request(r)
    for _ in range(5):
        step(scheduler)  # 8 computed each, 2 blocks each: pool full
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"1"}  # priority 5 is the lowest, though "2" arrived later
    assert reqs[1].status == RequestStatus.PREEMPTED


def test_queue_cap():
    scheduler = create_scheduler(max_num_queued_reqs=2)
    a, b, c = create_requests(3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    with pytest.raises(QueueFullError):
        scheduler.add_request(c)
    step(scheduler)
    scheduler.add_request(c)  # the queue drained into running
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(c)


def test_add_request_validation():
    scheduler = create_scheduler(block_size=4, num_blocks=4, max_model_len=16)
    (too_long,) = create_requests(1, num_tokens=17, block_size=4)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(too_long)
    (wrong_block,) = create_requests(1, num_tokens=4, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        scheduler.add_request(wrong_block)
    with pytest.raises(ValueError, match="cannot hold one request"):
        create_scheduler(block_size=4, num_blocks=3, max_model_len=16)


@pytest.mark.parametrize("state", ["waiting", "running", "mid_chunk", "preempted", "mid_step"])
def test_abort_in_every_state(state):
    scheduler = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    if state == "mid_chunk":
        scheduler = create_scheduler(block_size=4, num_blocks=10, max_num_batched_tokens=8, max_model_len=40)
    a, b = create_requests(2, num_tokens=20 if state == "mid_chunk" else 8, block_size=4, max_tokens=12)
    scheduler.add_request(a)
    if state == "waiting":
        scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    elif state in ("running", "mid_step"):
        step(scheduler)
        assert a.status == RequestStatus.RUNNING
        if state == "mid_step":
            out = scheduler.schedule()
            scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
            eo = scheduler.update_from_output(out, ModelRunnerOutput(["0"], [[9]]))
            assert eo.outputs == [] and a.num_output_tokens == 1
        else:
            scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    elif state == "mid_chunk":
        step(scheduler)
        assert a.num_computed_tokens == 8 and a.num_tokens == 20
        scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    elif state == "preempted":
        scheduler.add_request(b)
        for _ in range(6):
            step(scheduler)
        assert b.status == RequestStatus.PREEMPTED
        scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
        assert len(scheduler.waiting) == 0
        scheduler.finish_requests(["0", "nope"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == FinishReason.ABORT
    check_pool_invariants(scheduler)
    assert_all_free(scheduler)
    out = scheduler.schedule()
    assert "0" in out.finished_req_ids and out.total_num_scheduled_tokens == 0
    assert scheduler.schedule().finished_req_ids == set()
    with pytest.raises(ValueError):
        scheduler.finish_requests(["0"], RequestStatus.RUNNING)


def run_to_end(scheduler, tokens):
    """Feed `tokens` one per step to the single request; return all EngineCoreOutputs."""
    outputs = []
    for token in tokens:
        _, eo = step(scheduler, token_id=token)
        outputs.extend(eo.outputs)
        if not scheduler.has_unfinished_requests():
            break
    return outputs


def test_stop_on_eos_unless_ignored():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    (r,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=10)
    scheduler.add_request(r)
    outs = run_to_end(scheduler, [1, EOS_TOKEN_ID, 2])
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason is None
    assert r.output_token_ids == [1, EOS_TOKEN_ID] and r.status == RequestStatus.FINISHED_STOPPED
    (r,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=3, ignore_eos=True, id_prefix="i")
    scheduler.add_request(r)
    outs = run_to_end(scheduler, [EOS_TOKEN_ID] * 5)
    assert r.num_output_tokens == 3 and outs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_and_min_tokens():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    (r,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    scheduler.add_request(r)
    outs = run_to_end(scheduler, [42, EOS_TOKEN_ID, 42, 7])
    assert r.output_token_ids == [42, EOS_TOKEN_ID]  # both ignored before min_tokens; EOS counts at 2
    (r,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=10, min_tokens=1, stop_token_ids=[42],
                           id_prefix="s")
    scheduler.add_request(r)
    outs = run_to_end(scheduler, [3, 42, 5])
    assert r.output_token_ids == [3, 42]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 42


def test_max_model_len_caps_length():
    scheduler = create_scheduler(block_size=4, num_blocks=4, max_model_len=10)
    (r,) = create_requests(1, num_tokens=8, block_size=4, max_tokens=None)
    scheduler.add_request(r)
    outs = run_to_end(scheduler, [1] * 10)
    assert r.num_tokens == 10 and outs[-1].finish_reason == FinishReason.LENGTH
    assert_all_free(scheduler)


def test_multiple_sampled_tokens_truncated_at_stop_with_logprobs():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    (r,) = create_requests(1, num_tokens=4, block_size=4, max_tokens=10, stop_token_ids=[9])
    scheduler.add_request(r)
    out = scheduler.schedule()
    entries = [LogprobsEntry([t], [-0.5], 1) for t in (1, 9, 2)]
    prompt_lp = [None, LogprobsEntry([1], [-1.0], 1)]
    eo = scheduler.update_from_output(out, ModelRunnerOutput(
        ["0"], [[1, 9, 2]], logprobs={"0": entries}, prompt_logprobs={"0": prompt_lp}))
    (o,) = eo.outputs
    assert o.new_token_ids == [1, 9] and o.new_logprobs == entries[:2]
    assert o.new_prompt_logprobs == prompt_lp and o.stop_reason == 9


def test_prompt_logprobs_emitted_for_partial_chunk():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_num_batched_tokens=4, max_model_len=16)
    (r,) = create_requests(1, num_tokens=8, block_size=4)
    scheduler.add_request(r)
    out = scheduler.schedule()
    lp = [None, LogprobsEntry([1], [-1.0], 1)]
    eo = scheduler.update_from_output(out, ModelRunnerOutput(["0"], [[]], prompt_logprobs={"0": lp}))
    (o,) = eo.outputs
    assert o.new_token_ids == [] and o.new_prompt_logprobs == lp and o.first_scheduled_time is not None
    _, eo = step(scheduler, token_id=3)
    assert eo.outputs[0].new_token_ids == [3] and eo.outputs[0].first_scheduled_time is None


def test_make_stats_counts():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_num_seqs=1)
    for r in create_requests(2, num_tokens=4, block_size=4):
        scheduler.add_request(r)
    step(scheduler)
    stats = scheduler.make_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 1
    assert stats.kv_cache_usage == pytest.approx(1 / 20)
    assert scheduler.get_num_unfinished_requests() == 2
