"""Requests whose grammar compiles (WAITING_FOR_FSM) wait without holding up the requests behind them, and each
accepted token advances their matcher."""

from __future__ import annotations

from pagedllm.core.request import RequestStatus

from .utils import assert_all_free, create_requests, create_scheduler, step


class FakeGrammar:
    """A StructuredOutputRequest stand-in: ready when the test says so; records the tokens it accepts."""

    def __init__(self):
        self.ready = False
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return self.ready

    def accept_tokens(self, token_ids: list[int]) -> None:
        self.accepted.extend(token_ids)


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
