"""Requests whose grammar compiles (WAITING_FOR_FSM) wait without holding up the requests behind them, each
accepted token advances their matcher, and their drafts are cut where the grammar refuses them."""

from __future__ import annotations

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import RequestStatus
from pagedllm.messages import ModelRunnerOutput

from .utils import assert_all_free, create_requests, create_scheduler, step


class FakeGrammar:
    """A StructuredOutputRequest stand-in: ready when the test says so; records the tokens it accepts and the
    drafts it validates (it refuses the tokens in `refused`)."""

    def __init__(self):
        self.ready = False
        self.mask_ready = True
        self.prepared: list[list[int]] = []
        """The drafts of each prepare_mask call."""
        self.accepted: list[int] = []
        self.refused: set[int] = set()
        self.validated: list[tuple[list[int], list[int]]] = []
        """(tokens accepted so far, drafts) per validate_tokens call."""

    def is_ready(self) -> bool:
        return self.ready

    def is_mask_ready(self) -> bool:
        return self.mask_ready

    def prepare_mask(self, drafts: list[int]) -> None:
        self.prepared.append(list(drafts))

    def accept_tokens(self, token_ids: list[int]) -> None:
        self.accepted.extend(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        self.validated.append((list(self.accepted), list(token_ids)))
        return token_ids[:next((i for i, t in enumerate(token_ids) if t in self.refused), len(token_ids))]


def _constrained(request) -> FakeGrammar:
    request.structured_output_request = grammar = FakeGrammar()
    request.status = RequestStatus.WAITING_FOR_FSM
    return grammar


def test_a_request_waits_for_its_grammar_without_blocking_others():
    scheduler = create_scheduler()
    first, second, third = create_requests(3, max_tokens=3)
    grammar = _constrained(first)
    for request in (first, second, third):
        scheduler.add_request(request)
    output, _ = step(scheduler, token_id=7)
    assert set(output.num_scheduled_tokens) == {"1", "2"}
    assert first.status == RequestStatus.WAITING_FOR_FSM and list(scheduler.waiting) == [first]
    grammar.ready = True
    output, _ = step(scheduler, token_id=8)
    assert set(output.num_scheduled_tokens) == {"0", "1", "2"}
    assert first.status == RequestStatus.RUNNING
    assert grammar.accepted == [8]  # only the constrained request's matcher, with its sampled token
    step(scheduler, token_id=9)
    step(scheduler, token_id=10)
    assert grammar.accepted == [8, 9, 10] and first.output_token_ids == [8, 9, 10]
    assert_all_free(scheduler)


def test_aborting_a_request_that_waits_for_its_grammar():
    scheduler = create_scheduler()
    (request,) = create_requests(1)
    _constrained(request)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting
    assert_all_free(scheduler)


def test_preemption_keeps_the_matcher_in_step():
    # 2 blocks of 16: two requests of 10 prompt tokens cannot both grow past 16 tokens -> the later one is
    # preempted (recompute) and resumes; its matcher has seen exactly its output tokens, once each.
    scheduler = create_scheduler(num_blocks=2, max_num_batched_tokens=64, max_model_len=32)
    requests = create_requests(2, max_tokens=10)
    grammars = [_constrained(r) for r in requests]
    for grammar in grammars:
        grammar.ready = True
    for request in requests:
        scheduler.add_request(request)
    token = 100
    while scheduler.has_unfinished_requests():
        step(scheduler, token_id=token)
        token += 1
    assert scheduler.num_preemptions >= 1
    for request, grammar in zip(requests, grammars, strict=True):
        assert grammar.accepted == request.output_token_ids and len(grammar.accepted) == 10
    assert_all_free(scheduler)


def test_drafts_are_cut_where_the_grammar_refuses_them_and_only_verified_ones_count():
    """The proposer's drafts are validated after the step's tokens were accepted, cut before the first refused one
    (vLLM's update_draft_token_ids); the cut ones are neither scheduled nor counted in the spec-decode counters."""
    scheduler = create_scheduler(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                      verify_cost_per_draft_token=0))  # no guard
    (request,) = create_requests(1, max_tokens=16, ignore_eos=True)
    grammar = _constrained(request)
    grammar.ready = True
    grammar.refused = {13}
    scheduler.add_request(request)

    def update(output, sampled, drafts):
        runner_output = ModelRunnerOutput(req_ids=["0"], sampled_token_ids=[sampled], spec_token_ids=[drafts])
        scheduler.update_from_output(output, runner_output)

    update(scheduler.schedule(), [7], [11, 12, 13, 14])  # the prefill samples 7; 13 is refused
    assert grammar.validated == [([7], [11, 12, 13, 14])]
    assert request.spec_token_ids == [11, 12]
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"0": [11, 12]} and output.num_scheduled_tokens == {"0": 3}
    update(output, [11, 12, 20], [13, 5])  # both drafts accepted, then 20; the next drafts are all cut
    assert grammar.accepted == [7, 11, 12, 20] and request.spec_token_ids == []
    assert scheduler.schedule().scheduled_spec_decode_tokens == {}
    stats = scheduler.spec_decoding_totals
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 2)
    assert grammar.prepared == [[11, 12], []]  # after each sampled step, with the drafts it may verify next


def test_a_request_whose_mask_is_not_ready_sits_the_step_out():
    """A running constrained request that would sample without its mask is left out of the step: it keeps its
    place and its blocks, the others run, and it joins the step after its mask is ready. A prefill chunk that
    does not reach the end needs no mask."""
    scheduler = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    constrained, plain = create_requests(2, num_tokens=10, max_tokens=3)
    grammar = _constrained(constrained)
    grammar.ready = True
    for request in (constrained, plain):
        scheduler.add_request(request)
    step(scheduler, token_id=7)
    grammar.mask_ready = False
    output, _ = step(scheduler, token_id=7)  # its prompt's second chunk of 4 (of 10) samples nothing: no mask needed
    assert output.num_scheduled_tokens == {"0": 4, "1": 4} and scheduler.num_waiting_for_mask == 0
    output, _ = step(scheduler, token_id=7)  # the last chunk would sample: it waits
    assert output.num_scheduled_tokens == {"1": 2} and scheduler.num_waiting_for_mask == 1
    blocks = scheduler.kv_cache_manager.get_block_ids("0")
    assert constrained.status == RequestStatus.RUNNING and constrained.num_computed_tokens == 8 and blocks
    output, _ = step(scheduler, token_id=8)
    assert output.num_scheduled_tokens == {"1": 1} and grammar.accepted == []
    grammar.mask_ready = True
    output, _ = step(scheduler, token_id=9)
    assert output.num_scheduled_tokens == {"0": 2, "1": 1} and scheduler.num_waiting_for_mask == 0
    assert grammar.accepted == [9] and grammar.prepared == [[]]
    assert scheduler.kv_cache_manager.get_block_ids("0") == blocks
    while scheduler.has_unfinished_requests():
        step(scheduler, token_id=10)
    assert constrained.output_token_ids == [9, 10, 10] and grammar.accepted == [9, 10, 10]
    assert_all_free(scheduler)


def test_a_waiting_request_whose_first_mask_is_not_ready_lets_the_others_go_first():
    scheduler = create_scheduler()
    first, second = create_requests(2, max_tokens=2)
    grammar = _constrained(first)
    grammar.ready = True
    grammar.mask_ready = False
    for request in (first, second):
        scheduler.add_request(request)
    output, _ = step(scheduler, token_id=7)
    assert set(output.num_scheduled_tokens) == {"1"} and list(scheduler.waiting) == [first]
    assert scheduler.num_waiting_for_mask == 1 and not scheduler.kv_cache_manager.get_block_ids("0")
    grammar.mask_ready = True
    output, _ = step(scheduler, token_id=8)
    assert set(output.num_scheduled_tokens) == {"0", "1"}
    while scheduler.has_unfinished_requests():
        step(scheduler, token_id=9)
    assert first.output_token_ids == [8, 9]
    assert_all_free(scheduler)
