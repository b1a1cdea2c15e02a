"""The compile worker and its cache, the per-step bitmask, and its application to the logits, with the tiny
test tokenizer and no model."""

from __future__ import annotations

import llguidance.numpy
import numpy as np
import pytest
import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.layers.sampling.grammar_bitmask import apply_grammar_bitmask
from pagedllm.sampling_params import StructuredOutputsParams as S
from pagedllm.structured_output.manager import StructuredOutputManager


class _Req:
    """What grammar_bitmask reads of a core Request."""

    def __init__(self, so_request, num_tokens: int, num_computed_tokens: int):
        self.structured_output_request = so_request
        self.all_token_ids = [0] * num_tokens
        self.num_computed_tokens = num_computed_tokens


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


@pytest.fixture
def manager(tiny_tokenizer):
    m = StructuredOutputManager(StructuredOutputsConfig(), lambda: tiny_tokenizer, len(tiny_tokenizer))
    yield m
    m.shutdown()


def _ready(manager, params):
    so = manager.add_request(params)
    so.future.result(timeout=60)
    assert so.is_ready()  # the future may be done before its callback has started the first mask
    so.is_mask_ready()  # started now if not yet (and never again by the callback)
    so.mask_rows([])  # the first mask is computed ahead, with the matcher: the test touches it after that
    return so


def test_the_compile_cache_is_keyed_by_grammar(manager):
    a, b = _ready(manager, S(regex="[0-9]{3}")), _ready(manager, S(regex="[0-9]{3}"))
    _ready(manager, S(regex="[a-c]+"))
    stats = manager.take_stats()
    assert (stats.num_compiles, stats.num_cache_hits) == (2, 1)
    assert stats.compile_seconds > 0
    assert a.matcher is not b.matcher  # a cache hit is a copy: each request advances its own matcher
    assert manager.take_stats().num_compiles == 0  # counters since the last snapshot


def test_bitmask_rows_are_the_constrained_rows_that_sample(manager, tiny_tokenizer):
    digits = _ready(manager, S(regex="[0-9]{2}"))
    choice = _ready(manager, S(choice=["yes"]))
    requests = {"digits": _Req(digits, 10, 10), "plain": _Req(None, 10, 10), "chunk": _Req(choice, 10, 4),
                "choice": _Req(choice, 5, 5)}
    out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                          num_scheduled_tokens={k: 1 for k in requests}, total_num_scheduled_tokens=4,
                          finished_req_ids=set(), preempted_req_ids=set())
    grammar = manager.grammar_bitmask(requests, out)
    assert grammar.req_id_to_row == {"digits": 0, "choice": 1}  # not the unconstrained one, not a mid-prompt chunk
    allowed = {tiny_tokenizer.decode([t]) for t in _allowed(grammar.bitmask[0])}
    assert allowed and all(text.isdigit() and len(text) <= 2 for text in allowed)
    assert all("yes".startswith(tiny_tokenizer.decode([t])) for t in _allowed(grammar.bitmask[1]))


def test_verify_rows_follow_the_drafts_and_the_matcher_comes_back(manager, tiny_tokenizer):
    """With drafts d_0..d_{k-1} scheduled, a constrained request's rows are its masks after each draft prefix (the
    verify step's rows), up to the first draft the grammar refuses; the matcher ends where it started."""
    so = _ready(manager, S(regex="ab-[0-9]{3}"))
    drafts = [tiny_tokenizer.convert_tokens_to_ids(c) for c in "ab-z1"]  # "z" is refused after "ab-"
    assert so.validate_tokens(drafts) == drafts[:3]
    other = _ready(manager, S(choice=["yes"]))
    requests = {"r": _Req(so, 10, 10 + len(drafts)), "other": _Req(other, 5, 5)}
    out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                          num_scheduled_tokens={"r": 1 + len(drafts), "other": 1}, total_num_scheduled_tokens=7,
                          finished_req_ids=set(), preempted_req_ids=set(), scheduled_spec_decode_tokens={"r": drafts})
    grammar = manager.grammar_bitmask(requests, out)
    assert grammar.req_id_to_row == {"r": 0, "other": 1 + len(drafts)} and len(grammar.bitmask) == 2 + len(drafts)
    reference = so.matcher.deep_copy()
    expected = np.zeros((4, grammar.bitmask.shape[1]), dtype=np.int32)
    for j in range(4):  # the masks at the start, after "a", "ab" and "ab-"
        llguidance.numpy.fill_next_token_bitmask(reference, expected, j)
        if j < 3:
            assert reference.consume_token(drafts[j])
    assert np.array_equal(grammar.bitmask[:4], expected)
    assert drafts[3] not in _allowed(grammar.bitmask[3])  # the verify step rejects "z" at its own row
    assert len({grammar.bitmask[j].tobytes() for j in range(4)}) == 4
    so.accept_tokens(drafts[:3])  # the matcher was back at the start: "ab-" is accepted from there
    assert not so.matcher.is_error()
    assert so.validate_tokens(drafts[3:]) == []


def test_masks_computed_ahead_are_the_masks_of_the_step(manager, tiny_tokenizer, monkeypatch):
    """prepare_mask computes, on the mask thread, the rows grammar_bitmask would compute itself: with the drafts
    it was given, for any prefix of them the step verifies; the step then computes nothing."""
    so = _ready(manager, S(regex="ab-[0-9]{3}"))
    drafts = [tiny_tokenizer.convert_tokens_to_ids(c) for c in "ab-1"]
    reference = so.matcher.deep_copy()
    expected = np.zeros((5, manager._backend.allocate_bitmask(1).shape[1]), dtype=np.int32)
    for j in range(5):
        llguidance.numpy.fill_next_token_bitmask(reference, expected, j)
        if j < 4:
            assert reference.consume_token(drafts[j])
    so.prepare_mask(drafts)
    assert manager.wait_for_masks(30.0) and so.is_mask_ready()
    monkeypatch.setattr(type(manager._backend), "fill_bitmask", lambda *a: pytest.fail("computed in the step"))
    for k in (0, 2, 4):  # the step verifies the first k drafts
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={"r": 1 + k},
                              total_num_scheduled_tokens=1 + k, finished_req_ids=set(), preempted_req_ids=set(),
                              scheduled_spec_decode_tokens={"r": drafts[:k]} if k else {})
        grammar = manager.grammar_bitmask({"r": _Req(so, 10, 10 + k)}, out)
        assert np.array_equal(grammar.bitmask, expected[:1 + k])
    so.accept_tokens(drafts[:1])  # a new state: the rows computed ahead are not used for it
    assert so.mask_rows([]) is None


def test_a_dead_end_allows_eos(manager, tiny_tokenizer):
    so = _ready(manager, S(choice=["yes"]))
    yes = tiny_tokenizer.encode("yes")
    so.accept_tokens(yes)  # the grammar is complete: only EOS may follow
    eos = tiny_tokenizer.eos_token_id
    out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={"r": 1},
                          total_num_scheduled_tokens=1, finished_req_ids=set(), preempted_req_ids=set())
    assert _allowed(manager.grammar_bitmask({"r": _Req(so, 5, 5)}, out).bitmask[0]).tolist() == [eos]
    so.accept_tokens(yes[:1])  # a token the grammar refuses: the matcher's error state, still EOS
    assert _allowed(manager.grammar_bitmask({"r": _Req(so, 5, 5)}, out).bitmask[0]).tolist() == [eos]


def test_masked_rows_get_minus_inf_and_other_rows_stay_bitwise_unchanged():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = np.zeros((1, 2), dtype=np.int32)  # 64 tokens: 2 words; tokens 64..69 are past the mask
    bitmask[0, 0] = 0b1010
    bitmask[0, 1] = np.array([1 << 31], dtype=np.uint32).view(np.int32)[0]  # token 63
    apply_grammar_bitmask(logits, bitmask, {"b": 0}, ["a", "b", "c"])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == [1, 3, 63]
    assert torch.equal(logits[1, finite], before[1, finite])


def test_verify_rows_of_a_request_are_masked_with_its_consecutive_mask_rows():
    logits = torch.zeros(4, 40)
    bitmask = np.array([[1 << 5, 0], [1 << 6, 0], [1 << 7, 0]], dtype=np.int32)
    # "a": one unconstrained row; "b": 2 verify rows with mask rows 1, 2; "c": one row with mask row 0
    apply_grammar_bitmask(logits, bitmask, {"b": 1, "c": 0}, ["a", "b", "c"], [1, 2, 1])
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [list(range(40)), [6], [7], [5]]


def test_a_failed_compile_leaves_only_eos(manager, tiny_tokenizer):
    from concurrent.futures import Future

    from pagedllm.structured_output.request import StructuredOutputRequest

    _ready(manager, S(regex="a"))  # the backend exists
    future = Future()
    future.set_exception(RuntimeError("backend failure"))
    so = StructuredOutputRequest(future)
    assert so.is_ready() and so.failed and so.matcher is None
    out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={"r": 1},
                          total_num_scheduled_tokens=1, finished_req_ids=set(), preempted_req_ids=set())
    row = manager.grammar_bitmask({"r": _Req(so, 5, 5)}, out).bitmask[0]
    assert _allowed(row).tolist() == [tiny_tokenizer.eos_token_id]  # never an all-zero row
    assert so.validate_tokens([5, 6]) == []  # and no drafts


def test_a_late_compile_callback_starts_no_second_mask():
    """The compile future's done-callback (which starts the first mask at once) can run after a waiter has seen the
    result: the scheduler may have started the first mask itself and even accepted tokens by then. The late
    callback must not start a mask on a matcher the step is using (llguidance: "Already mutably borrowed"; seen
    with both cores loaded)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from pagedllm.structured_output.request import StructuredOutputRequest

    class LateCallbackFuture(Future):
        def add_done_callback(self, fn):
            self.late_callback = fn  # run by the test, late

    class Matcher:
        consumed: list[int] = []

        def is_stopped(self):
            return False

        def consume_tokens(self, tokens):
            self.consumed += tokens

    future, submitted = LateCallbackFuture(), []
    future.set_result(Matcher())
    with ThreadPoolExecutor(1) as pool:
        so = StructuredOutputRequest(future, pool, lambda matcher, drafts: np.zeros((1 + len(drafts), 1), np.int32),
                                     submitted.append)
        assert so.is_ready()
        so.is_mask_ready()  # what the scheduler asks before a step: starts the first mask
        assert so.mask_rows([]) is not None and len(submitted) == 1  # the scheduler started the first mask
        so.accept_tokens([7])
        future.late_callback(future)
        assert len(submitted) == 1, "the late callback started a mask on the matcher in use"
