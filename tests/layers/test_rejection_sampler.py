"""The rejection sampler: greedy acceptance rules, and a chi-square test that random verification keeps the target's
distribution (temperature, top-k, top-p, min-p applied) at every position."""

import math

import pytest
import torch

from pagedllm.layers.sampling.rejection_sampler import can_speculate, rejection_sample
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0)


def _onehot_logits(targets: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_accepts_until_the_first_mismatch_then_emits_the_target():
    out = rejection_sample(torch.cat([_onehot_logits([1, 2, 3, 4]), _onehot_logits([5, 6, 7]),
                                      _onehot_logits([8, 9])]),
                           [4, 3, 2], [[1, 2, 3], [5, 0], [8]], [GREEDY] * 3, [None] * 3)
    assert out == [[1, 2, 3, 4], [5, 6], [8, 9]]  # all accepted + bonus; mismatch at 2; all accepted + bonus
    assert rejection_sample(_onehot_logits([4, 2]), [2], [[1]], [GREEDY], [None]) == [[4]]


def test_unsupported_options_run_without_speculation():
    assert can_speculate(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3))
    assert can_speculate(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    for bad in (dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.2),
                dict(min_tokens=3), dict(logit_bias={1: 2.0}), dict(logprobs=1), dict(prompt_logprobs=0)):
        assert not can_speculate(SamplingParams(**bad))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0  # never a token the target excludes (top-k / top-p / min-p)
    expected = probs[keep] * n
    stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
    return stat, int(keep.sum()) - 1


def _critical(df: int) -> float:
    """Chi-square value exceeded with probability ~1e-4 (Wilson-Hilferty)."""
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.95, min_p=0.02)])
def test_random_verification_keeps_the_target_distribution(params):
    vocab, trials, batch = 8, 12000, 2000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 1.5  # rows 0, 1: verify drafts; row 2: the bonus
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # a plausible and a likely draft
    scaled = logits / params.temperature
    target = []
    for row in scaled:  # the target distribution, as the sampler shapes it
        probs = row.softmax(-1)
        keep = torch.ones(vocab, dtype=torch.bool)
        if params.top_k > 0:
            keep &= row >= row.topk(params.top_k).values[-1]
        if params.top_p < 1:
            order = probs.argsort(descending=True)
            mass = torch.where(keep[order], probs[order], 0).cumsum(0)
            nucleus = torch.zeros(vocab, dtype=torch.bool)
            nucleus[order[: int((mass < params.top_p * mass[-1]).sum()) + 1]] = True
            keep &= nucleus
        p = torch.where(keep, probs, 0)
        p = p / p.sum()
        if params.min_p > 0:
            p = torch.where(p >= params.min_p * p.max(), p, 0)
            p = p / p.sum()
        target.append(p)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # the token after an accepted first draft
    run_lengths = torch.zeros(4)
    torch.manual_seed(1234)
    for _ in range(trials // batch):  # `batch` requests per call, each with the same logits and drafts
        outs = rejection_sample(logits.repeat(batch, 1), [3] * batch, [drafts] * batch, [params] * batch,
                                [None] * batch)
        for out in outs:
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
            run_lengths[len(out)] += 1
    for counts, p in ((first, target[0]), (second, target[1])):
        stat, df = _chi_square(counts, p)
        assert stat < _critical(df), (stat, df, counts, p)
    # acceptance of draft 0 is p0(d0); the run is 3 tokens with probability p0(d0) p1(d1)
    expected_all = target[0][drafts[0]] * target[1][drafts[1]] * trials
    assert abs(run_lengths[3] - expected_all) < 5 * math.sqrt(expected_all) + 1


def test_seeded_requests_draw_from_their_own_generator():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def run():
        gen = torch.Generator().manual_seed(7)
        return [rejection_sample(logits.clone(), [4], [[1, 2, 3]], [params], [gen])[0] for _ in range(20)]

    first = run()
    torch.rand(100)  # the global generator moves: a seeded request must not notice
    assert run() == first
