"""The low-acceptance guard's estimate and choice: drafts compared with what a step produced, by position, and the
number of drafts worth verifying at a given cost (core/acceptance_guard.py)."""

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.core.acceptance_guard import ACCEPTANCE_DECAY, DraftAcceptance, VerifyCost
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def _at(rates: list[float]) -> DraftAcceptance:
    acceptance = DraftAcceptance(len(rates))
    acceptance.accepted = list(rates)
    acceptance.rejected = [1 - r for r in rates]
    return acceptance


def test_observe_counts_leading_matches_and_the_first_mismatch_by_position():
    acceptance = DraftAcceptance(4)
    acceptance.observe([5, 6, 7, 8], [5, 9])  # 0 accepted, 1 rejected, 2 and 3 unknown
    acceptance.observe([5, 6, 7, 8], [5])  # a plain step: 0 accepted, the rest unknown
    d = ACCEPTANCE_DECAY
    assert acceptance.accepted == pytest.approx([(d + 1) * d + 1, d, 1, 1])
    assert acceptance.rejected == pytest.approx([d * d, d + 1, 1, 1])
    acceptance.observe([], [5])
    acceptance.observe([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])  # past k: ignored
    assert acceptance.rates()[3] == pytest.approx((d + 1) / (d + 1 + d))


@pytest.mark.parametrize("rate, expected", [(0.3, 0), (0.37, 0), (0.4, 1), (0.6, 1), (0.7, 2), (0.8, 2), (0.9, 4)])
def test_num_drafts_maximises_tokens_per_unit_of_cost(rate, expected):
    assert _at([rate] * 4).num_drafts(0.375) == expected


def test_later_positions_count_and_cost_zero_turns_the_guard_off():
    assert _at([0.5, 0.95, 0.95, 0.95]).num_drafts(0.375) == 4  # a copy: once the first is right, so is the rest
    assert _at([0.0] * 4).num_drafts(0) == 4
    assert _at([0.9] * 4).num_drafts(10.0) == 0


def test_config_default_and_bounds():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=4).verify_cost_per_draft_token is None  # measured
    with pytest.raises(ValueError, match="verify_cost_per_draft_token"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "verify_cost_per_draft_token": -1}')
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                   '"verify_cost_per_draft_token": 0}').verify_cost_per_draft_token == 0


def _cost(value: float | None) -> VerifyCost:
    return VerifyCost(SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost_per_draft_token=value))


def test_the_measured_cost_follows_the_step_times():
    cost = _cost(None)
    assert cost.value == VerifyCost.MEASURED_PRIOR
    cost.observe({"a": 5}, {"a": [1, 2, 3, 4]}, 0.0132)  # no plain step at batch 1 yet: nothing to compare with
    assert cost.value == VerifyCost.MEASURED_PRIOR
    for _ in range(3):
        cost.observe({"a": 1}, {}, 0.010)
    for _ in range(200):
        cost.observe({"a": 5}, {"a": [1, 2, 3, 4]}, 0.0132)  # (1.32 - 1) * 1 / 4
    assert cost.value == pytest.approx(0.08, abs=1e-3)
    for _ in range(3):  # batch 2: two plain rows 12 ms; one verifying 2 drafts, the other none, 13.2 ms
        cost.observe({"a": 1, "b": 1}, {}, 0.012)
    for _ in range(200):
        cost.observe({"a": 3, "b": 1}, {"a": [1, 2]}, 0.0132)  # (1.1 - 1) * 2 / 2
    assert cost.value == pytest.approx(0.1, abs=1e-3)


def test_a_preempted_step_moves_the_measure_by_little():
    cost = _cost(None)
    cost.observe({"a": 1}, {}, 0.010)
    cost.observe({"a": 5}, {"a": [1, 2, 3, 4]}, 0.5)  # descheduled: 50 plain steps' time for 4 drafts
    assert cost.value == pytest.approx(VerifyCost.MEASURED_PRIOR * cost.ESTIMATE_DECAY
                                       + VerifyCost.MAX_ESTIMATE * (1 - cost.ESTIMATE_DECAY))


def test_prompt_steps_and_a_configured_cost_are_not_measured():
    cost = _cost(None)
    cost.observe({"a": 1}, {}, 0.010)
    cost.observe({"a": 5, "b": 17}, {"a": [1, 2, 3, 4]}, 0.5)  # "b" computes prompt tokens
    cost.observe({"a": 5}, {"a": [1, 2]}, 0.5)  # 5 tokens for 2 drafts: a prompt chunk, not a verify row
    assert cost.value == VerifyCost.MEASURED_PRIOR
    fixed = _cost(0.2)
    fixed.observe({"a": 1}, {}, 0.010)
    fixed.observe({"a": 5}, {"a": [1, 2, 3, 4]}, 0.030)
    assert fixed.value == 0.2 and _cost(0).value == 0


def _request(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=4, **params), eos_token_id=0, arrival_time=0.0,
                   block_size=16)


def test_a_seeded_sampling_request_is_guarded_without_timing():
    """A seeded request's draws depend on how many drafts each step verified: its guard must not follow the
    wall clock, or the same seed gives other tokens on another run (greedy and unseeded requests may)."""
    cost = _cost(None)
    cost.observe({"a": 1}, {}, 0.010)
    for _ in range(200):
        cost.observe({"a": 5}, {"a": [1, 2, 3, 4]}, 0.0132)
    assert cost.value == pytest.approx(0.08, abs=1e-3)

    def guarded(**params) -> float:
        return cost.for_request(_request(**params))

    assert guarded(temperature=1.0, seed=7) == VerifyCost.MEASURED_PRIOR
    assert guarded(temperature=1.0) == guarded(temperature=0.0, seed=7) == cost.value
    assert _cost(0.2).for_request(_request(temperature=1.0, seed=7)) == 0.2
