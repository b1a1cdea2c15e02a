"""Speculative decoding in the scheduler, without a model: drafts in the budget, trimming, rollback of rejected
drafts before blocks are cached, stops inside an accepted run, preemption and the spec-decode counters."""

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import RequestStatus
from pagedllm.messages import ModelRunnerOutput

from .utils import assert_all_free, check_pool_invariants, create_requests, create_scheduler, step

NGRAM4 = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost_per_draft_token=0)  # no guard


def _decoding(num_tokens=10, max_tokens=16, block_size=16, num_requests=1, **kwargs):
    """A scheduler whose requests finished their prefill (one output token each), drafts set to [1, 2, 3, 4]."""
    scheduler = create_scheduler(block_size=block_size, speculative_config=kwargs.pop("spec", NGRAM4), **kwargs)
    requests = create_requests(num_requests, num_tokens=num_tokens, block_size=block_size, max_tokens=max_tokens,
                               ignore_eos=True)
    for r in requests:
        scheduler.add_request(r)
    step(scheduler, token_id=7)
    for r in requests:
        r.spec_token_ids = [1, 2, 3, 4]
    return scheduler, requests


def _verify(scheduler, output, results: dict[str, list[int]], proposals: dict[str, list[int]] | None = None):
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[results[r] for r in req_ids],
        spec_token_ids=[(proposals or {}).get(r, []) for r in req_ids])
    return scheduler.update_from_output(output, runner_output)


def test_drafts_are_scheduled_after_the_last_token_and_count_in_the_budget():
    scheduler, (req,) = _decoding()
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"0": [1, 2, 3, 4]}
    assert output.num_scheduled_tokens == {"0": 5}
    assert output.total_num_scheduled_tokens == 5
    assert req.num_computed_tokens == 15  # 11 tokens + 4 drafts


def test_drafts_are_trimmed_to_the_budget_max_tokens_and_max_model_len():
    scheduler, (a, b) = _decoding(num_requests=2)
    scheduler.max_num_batched_tokens = 7
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"0": 5, "1": 2}  # 7 tokens: b keeps one draft
    assert output.scheduled_spec_decode_tokens == {"0": [1, 2, 3, 4], "1": [1]}
    # max_tokens 3 with 1 output: one draft, so that it and the bonus token make 3 outputs
    scheduler, (req,) = _decoding(max_tokens=3)
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"0": [1]}
    # max_model_len 13 with 11 tokens: one draft (12 tokens, then the bonus token makes 13)
    scheduler, (req,) = _decoding(max_model_len=13, max_tokens=100)
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"0": [1]}
    scheduler, (req,) = _decoding(max_model_len=12, max_tokens=100)
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {} and output.num_scheduled_tokens == {"0": 1}


def test_rejected_drafts_roll_back_before_blocks_are_cached():
    """Block 0 (tokens 0-7, block_size 8) is completed only by drafts; they are rejected, so it must not be cached
    with their K/V: num_computed_tokens goes back to 6 first."""
    scheduler, (req,) = _decoding(num_tokens=5, block_size=8)  # 6 tokens, 5 computed
    kv = scheduler.kv_cache_manager
    output = scheduler.schedule()  # computes tokens 5..9: the last token and drafts 1..4 at positions 6..9
    assert req.num_computed_tokens == 10
    _verify(scheduler, output, {"0": [9]})  # draft 1 rejected: the target says 9
    assert req.num_computed_tokens == 6
    assert req.all_token_ids[-2:] == [7, 9]
    assert kv.num_cached_blocks["0"] == 0
    assert not kv.block_pool.cached_block_hash_to_block
    check_pool_invariants(scheduler)
    # next step: the two real tokens at positions 6, 7 complete block 0, which is cached with its real hash
    req.spec_token_ids = []
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"0": 1}
    _verify(scheduler, output, {"0": [3]})
    assert req.num_computed_tokens == 7  # 8 tokens: block 0 is not full of computed tokens yet
    output = scheduler.schedule()
    _verify(scheduler, output, {"0": [4]})
    assert kv.num_cached_blocks["0"] == 1
    assert kv.block_pool.cached_block_hash_to_block[req.block_hashes[0]].block_id == kv.req_to_blocks["0"][0].block_id


def test_accepted_drafts_fill_and_cache_blocks():
    scheduler, (req,) = _decoding(num_tokens=5, block_size=8)
    kv = scheduler.kv_cache_manager
    output = scheduler.schedule()
    _verify(scheduler, output, {"0": [1, 2, 3, 4, 5]}, {"0": [6, 6]})
    assert req.output_token_ids == [7, 1, 2, 3, 4, 5]
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    assert kv.num_cached_blocks["0"] == 1  # tokens 0..7 are computed and real
    assert req.spec_token_ids == [6, 6]  # the runner's next proposal
    stats = scheduler.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 4)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 1, 1]


def test_stop_token_inside_an_accepted_run_truncates_there():
    scheduler = create_scheduler(speculative_config=NGRAM4)
    (req,) = create_requests(1, num_tokens=10, stop_token_ids=[3])
    scheduler.add_request(req)
    step(scheduler, token_id=7)
    req.spec_token_ids = [1, 3, 5, 6]
    output = scheduler.schedule()
    (out,) = _verify(scheduler, output, {"0": [1, 3, 5, 6, 8]}).outputs
    assert out.new_token_ids == [1, 3]
    assert out.finish_reason is not None and out.stop_reason == 3
    assert req.output_token_ids == [7, 1, 3]
    assert_all_free(scheduler)


def test_eos_inside_an_accepted_run_and_partial_acceptance_stats():
    scheduler, (a, b) = _decoding(num_requests=2)
    a.sampling_params.ignore_eos = False
    eos = a.eos_token_id
    a.spec_token_ids = [1, eos, 3, 4]
    output = scheduler.schedule()
    outs = {o.request_id: o for o in _verify(scheduler, output, {"0": [1, eos, 9], "1": [1, 2, 9]}).outputs}
    assert outs["0"].new_token_ids == [1, eos] and outs["0"].finish_reason is not None
    assert outs["1"].new_token_ids == [1, 2, 9] and b.num_computed_tokens == 13
    stats = scheduler.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0, 0]
    assert scheduler.make_stats().spec_decoding_stats.num_drafts == 0  # deltas: reset by each snapshot


def test_preemption_drops_drafts_and_frees_everything():
    scheduler, requests = _decoding(num_requests=2, num_tokens=16, block_size=16, num_blocks=3)
    output = scheduler.schedule()  # both need a second block for their drafts: one preempts the other
    assert len(output.preempted_req_ids) == 1
    (victim,) = [r for r in requests if r.request_id in output.preempted_req_ids]
    assert victim.spec_token_ids == [] and victim.request_id not in output.scheduled_spec_decode_tokens
    check_pool_invariants(scheduler)
    scheduler.finish_requests(["0", "1"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)


def test_disable_by_batch_size():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=2,
                             verify_cost_per_draft_token=0)
    scheduler, _ = _decoding(num_requests=2, spec=spec)
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {} and output.total_num_scheduled_tokens == 2
    scheduler, _ = _decoding(num_requests=1, spec=spec)
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"0": [1, 2, 3, 4]}


def test_without_speculation_drafts_are_never_scheduled():
    scheduler = create_scheduler()
    (req,) = create_requests(1)
    scheduler.add_request(req)
    step(scheduler)
    req.spec_token_ids = [1, 2]
    assert scheduler.schedule().num_scheduled_tokens == {"0": 1}
    assert scheduler.make_stats().spec_decoding_stats is None


def test_guard_stops_drafting_at_low_acceptance_and_resumes_when_proposals_match():
    """The low-acceptance guard (default verify_cost_per_draft_token): proposals that are always rejected stop
    being verified after one try; the counters count verified drafts only. Once the proposals match what the
    steps produce (checked without verifying them), drafting resumes and grows to all 4."""
    scheduler, (req,) = _decoding(max_tokens=400, spec=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    drafted = []
    for token in range(100, 112):  # the target never produces the proposal's tokens
        output = scheduler.schedule()
        drafted.append(len(output.scheduled_spec_decode_tokens.get("0", [])))
        _verify(scheduler, output, {"0": [token]}, {"0": [1, 2, 3, 4]})
    assert drafted == [1] + [0] * 11
    assert scheduler.spec_decoding_totals.num_draft_tokens == 1 and scheduler.spec_decoding_totals.num_drafts == 1
    nxt = 200
    req.spec_token_ids = [nxt, nxt + 1, nxt + 2, nxt + 3]
    drafted = []
    for _ in range(20):  # the target produces what was proposed (all drafts accepted, then the next token)
        output = scheduler.schedule()
        d = len(output.scheduled_spec_decode_tokens.get("0", []))
        drafted.append(d)
        produced = list(range(nxt, nxt + d + 1))
        nxt += d + 1
        _verify(scheduler, output, {"0": produced}, {"0": list(range(nxt, nxt + 4))})
    assert drafted[:2] == [0, 0] and 0 < drafted.index(1) < 6 and drafted[-1] == 4
    assert drafted == sorted(drafted)
    totals = scheduler.spec_decoding_totals
    assert totals.num_draft_tokens == 1 + sum(drafted) and totals.num_accepted_tokens == sum(drafted)
    assert req.output_token_ids[-1] == nxt - 1 and len(req.output_token_ids) == 1 + 12 + nxt - 200
