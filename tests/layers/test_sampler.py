"""Sampler tests on synthetic logits, against naive per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.layers.sampler import (
    Sampler,
    build_sampling_metadata,
    compute_prompt_logprobs,
    logprobs_to_entries,
)
from pagedllm.sampling_params import SamplingParams

V = 64
CPU = torch.device("cpu")


def make_metadata(params, prompts=None, outputs=None, generators=None, eos=None, vocab_size=V):
    n = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [None] * n,
        vocab_size,
        CPU,
    )


def sample(logits, params, **kwargs):
    return Sampler()(logits.clone(), make_metadata(params, **kwargs))


def random_logits(n, vocab_size=V, seed=0):
    return torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- greedy


def test_all_greedy_fast_path_is_argmax():
    logits = random_logits(8)
    md = make_metadata([SamplingParams(temperature=0.0)] * 8)
    assert md.all_greedy and md.temperature is None and not md.needs_logits_processing
    out = Sampler()(logits.clone(), md)
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5) for i in range(6)]
    for seed in range(10):
        torch.manual_seed(seed)
        out = sample(logits, params).sampled_token_ids
        assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


# ---------------------------------------------------------------- truncation


def test_top_k_1_and_tiny_top_p_are_argmax():
    logits = random_logits(5)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        for seed in range(10):
            torch.manual_seed(seed)
            assert torch.equal(sample(logits, [params] * 5).sampled_token_ids, logits.argmax(-1))


def test_top_k_samples_only_from_top_k():
    logits = random_logits(4)
    allowed = logits.topk(3, dim=-1).indices
    torch.manual_seed(0)
    for _ in range(50):
        out = sample(logits, [SamplingParams(temperature=2.0, top_k=3)] * 4).sampled_token_ids
        assert all(out[i] in allowed[i] for i in range(4))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    seen = set()
    torch.manual_seed(0)
    for _ in range(300):
        seen.add(int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)]).sampled_token_ids[0]))
    assert seen == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_min_p_filters_relative_to_best():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.19, 0.11] + [0.0] * (V - 4)]).clamp_min(1e-12))
    seen = set()
    torch.manual_seed(0)
    for _ in range(300):
        seen.add(int(sample(logits, [SamplingParams(temperature=1.0, min_p=0.45)]).sampled_token_ids[0]))
    assert seen == {0, 1, 2}  # 0.11 < 0.45 * 0.4 = 0.18 <= 0.19


def test_top_k_and_top_p_per_row_independent():
    logits = random_logits(3)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0)]
    torch.manual_seed(0)
    for _ in range(30):
        out = sample(logits, params).sampled_token_ids
        assert out[0] in logits[0].topk(2).indices
        assert out[1] == logits[1].argmax()


def test_sampling_frequencies_match_softmax():
    """Chi-square goodness of fit of 20k draws against softmax(logits / T), restricted to top-k."""
    vocab_size, draws, temperature = 8, 20000, 0.7
    logits = torch.randn(1, vocab_size, generator=seeded(3))
    params = [SamplingParams(temperature=temperature, top_k=6)] * draws
    torch.manual_seed(1234)
    out = sample(logits.expand(draws, vocab_size).contiguous(), params, vocab_size=vocab_size)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab_size).double()
    scaled = (logits[0] / temperature).double()
    keep = scaled >= scaled.topk(6).values[-1]
    expected = torch.where(keep, scaled.softmax(-1), 0.0)
    expected = expected / expected.sum() * draws
    assert counts[~keep].sum() == 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 30.0  # 5 degrees of freedom: p(chi2 > 30) ~ 1.5e-5


# ---------------------------------------------------------------- penalties, bias, min_tokens


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for i, p in enumerate(params):
        row = out[i]
        seen = set(prompts[i]) | set(outputs[i])
        for t in seen:
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(outputs[i]):
            row[t] -= p.frequency_penalty * outputs[i].count(t) + p.presence_penalty
    return out


def test_penalties_match_naive_reference():
    gen = seeded(7)
    logits = random_logits(4, seed=7)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=-1.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.7),
    ]
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 0, 9, 3)]
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (4, 7, 0, 12)]
    md = make_metadata(params, prompts=prompts, outputs=outputs)
    assert not md.no_penalties
    adjusted = logits.clone()
    Sampler()(adjusted, md)  # modifies in place
    expected = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(adjusted, expected)
    changed = (adjusted != logits).nonzero().tolist()
    for i, t in changed:
        assert t in set(prompts[i]) | set(outputs[i])


def test_logit_bias_forces_token_and_touches_only_biased():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={1: -2.0, 2: 3.0})]
    adjusted = logits.clone()
    out = Sampler()(adjusted, make_metadata(params))
    assert out.sampled_token_ids[0] == 5
    expected = logits.clone()
    expected[0, 5] += 100.0
    expected[2, 1] -= 2.0
    expected[2, 2] += 3.0
    torch.testing.assert_close(adjusted, expected)


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # EOS
    logits[:, 9] = 9.0  # stop token id
    logits[:, 3] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    out = sample(logits, [params] * 2, outputs=[[1, 1], [1, 1, 1]], eos=[7, 7]).sampled_token_ids
    assert out.tolist() == [3, 7]  # row 0 is below min_tokens, row 1 reached it
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits[:1], [ignore], outputs=[[1]], eos=[7]).sampled_token_ids.tolist() == [7]


# ---------------------------------------------------------------- seeds


def test_seeded_row_independent_of_batch():
    vocab_size = 1000
    logits = random_logits(1, vocab_size, seed=11)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42)

    def run_alone(steps):
        gen = seeded(42)
        return [int(sample(logits, [params], generators=[gen], vocab_size=vocab_size).sampled_token_ids[0])
                for _ in range(steps)]

    alone = run_alone(8)
    gen = seeded(42)
    other_gen = seeded(42)  # another request with the same seed, in a different row
    batched, batched_other = [], []
    for step in range(8):
        others = random_logits(4, vocab_size, seed=100 + step)
        batch = torch.cat([others[:2], logits, others[2:], logits])
        rows = [SamplingParams(temperature=0.5 + 0.1 * j, min_p=0.01 * j) for j in range(6)]
        rows[2] = rows[5] = params
        gens = [None, None, gen, None, None, other_gen]
        out = sample(batch, rows, generators=gens, vocab_size=vocab_size).sampled_token_ids
        batched.append(int(out[2]))
        batched_other.append(int(out[5]))
    assert alone == batched == batched_other
    gen2 = seeded(43)
    different = [int(sample(logits, [params], generators=[gen2], vocab_size=vocab_size).sampled_token_ids[0])
                 for _ in range(8)]
    assert different != alone


# ---------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_topk():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, logprobs=5)]
    out = sample(logits, params)
    lp = out.logprobs
    assert lp.logprobs.shape == (4, 6)
    ref = logits.log_softmax(-1)
    entries = logprobs_to_entries(lp, [p.logprobs for p in params])
    assert entries[2] is None
    for i in (0, 1, 3):
        token = int(out.sampled_token_ids[i])
        entry = entries[i]
        k = params[i].logprobs
        assert entry.token_ids[0] == token and len(entry.token_ids) == k + 1
        assert math.isclose(entry.logprobs[0], float(ref[i, token]), rel_tol=1e-5)
        assert entry.rank == int((ref[i] > ref[i, token]).sum()) + 1
        top = ref[i].topk(k)
        assert entry.token_ids[1:] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top.values)
    assert entries[0].rank == 1  # greedy picks the best token


def _processed(logits, params, outputs):
    """The logits the rows are drawn from, computed naively: bias, presence penalty, temperature (1 when greedy),
    top-k, min-p (the parameters these tests use)."""
    x = logits.clone()
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            x[i, token] += bias
        x[i, sorted(set(outputs[i]))] -= p.presence_penalty
        x[i] /= p.temperature if p.temperature > 0 else 1.0
        if p.top_k > 0:
            x[i, x[i] < x[i].topk(p.top_k).values[-1]] = float("-inf")
        if p.min_p > 0:
            probs = x[i].softmax(-1)
            x[i, probs < p.min_p * probs.max()] = float("-inf")
    return x


MODE_PARAMS = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 5.0}, presence_penalty=1.0),
               SamplingParams(temperature=0.7, top_k=5, logprobs=3, seed=1),
               SamplingParams(temperature=1.3, min_p=0.2, logprobs=0, seed=2)]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("params", [MODE_PARAMS, MODE_PARAMS[:1]], ids=["mixed", "all-greedy"])
def test_logprobs_modes(mode, params):
    """vLLM's --logprobs-mode: raw (the model's logits, before logit_bias and penalties) or processed (the logits
    each row is drawn from), as logprobs (log_softmax) or logits; the sampled token first, then the top k."""
    logits = random_logits(len(params))
    outputs = [[1, 2]] * len(params)
    metadata = make_metadata(params, outputs=outputs, generators=[None] + [seeded(1), seeded(2)][:len(params) - 1])
    out = Sampler(mode)(logits.clone(), metadata)
    ref = logits if mode.startswith("raw") else _processed(logits, params, outputs)
    ref = ref.log_softmax(-1) if mode.endswith("logprobs") else ref
    for i, p in enumerate(params):
        token = int(out.sampled_token_ids[i])
        assert out.logprobs.logprob_token_ids[i, 0] == token
        torch.testing.assert_close(out.logprobs.logprobs[i, 0], ref[i, token])
        torch.testing.assert_close(out.logprobs.logprobs[i, 1:1 + p.logprobs], ref[i].topk(p.logprobs).values)
        assert int(out.logprobs.selected_token_ranks[i]) == int((ref[i] > ref[i, token]).sum()) + 1
    assert out.sampled_token_ids[0] == _processed(logits, params, outputs)[0].argmax()  # the mode changes no token


def test_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler("logits")


def test_prompt_logprobs():
    logits = random_logits(7)
    targets = torch.randint(0, V, (7,), generator=seeded(1))
    entries = compute_prompt_logprobs(logits, targets, 4)
    ref = logits.log_softmax(-1)
    assert len(entries) == 7
    for i, entry in enumerate(entries):
        assert entry.token_ids[0] == int(targets[i])
        assert math.isclose(entry.logprobs[0], float(ref[i, targets[i]]), rel_tol=1e-5)
        assert entry.rank == int((ref[i] > ref[i, targets[i]]).sum()) + 1
        assert entry.token_ids[1:] == ref[i].topk(4).indices.tolist()


@pytest.mark.parametrize("n", [1, 3])
def test_all_random_without_extras_samples_valid_tokens(n):
    logits = random_logits(n)
    out = sample(logits, [SamplingParams(temperature=1.0)] * n)
    assert out.sampled_token_ids.shape == (n,) and out.sampled_token_ids.dtype == torch.int64
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < V)).all()


@pytest.mark.parametrize("ks", [[0, 2, -1], [0, 2, 40]])  # top-k only via topk, and via the sort path
def test_top_k_off_rows_keep_whole_vocab(ks):
    logits = torch.zeros(3, V)
    logits[:, :2] = 0.1  # nearly flat: an unrestricted row must often pick beyond the top 2
    seen = [set() for _ in ks]
    torch.manual_seed(0)
    for _ in range(40):
        out = sample(logits, [SamplingParams(temperature=1.0, top_k=k) for k in ks]).sampled_token_ids
        for i, t in enumerate(out.tolist()):
            seen[i].add(t)
    assert seen[1] <= {0, 1}
    assert len(seen[0]) > 10 and len(seen[2]) > 10
