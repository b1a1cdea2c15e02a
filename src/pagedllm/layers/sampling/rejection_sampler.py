"""Lossless verification of draft tokens (speculative decoding), as vLLM's rejection sampler.

A request with k drafts d_0..d_{k-1} brings k + 1 rows of target logits: row j is the target's distribution for
the token after d_{j-1} (row 0: after the request's last real token). The result is 1 to k + 1 tokens:
- greedy (temperature 0): accept d_j while it equals argmax(row j); at the first mismatch emit argmax(row j) and
  stop; when all k are accepted, the bonus token argmax(row k). The tokens are exactly the ones plain greedy
  decoding would produce, one step at a time.
- random: p_j = row j after temperature, top-k, top-p and min-p (as the sampler applies them). Accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); proposers without probabilities (n-gram) have q_j = one-hot(d_j), so
  that is p_j(d_j). At the first rejection, sample from the residual max(0, p_j - q_j) renormalised (p_j with d_j
  removed); when all are accepted, the bonus token from p_k. Each emitted token is then distributed as p_j
  (Leviathan et al. 2023). A seeded request draws its uniforms from its own generator.
"""

from __future__ import annotations

import torch

from pagedllm.layers.sampling import categorical
from pagedllm.layers.sampling.metadata import build_sampling_metadata
from pagedllm.layers.sampling.ops import apply_min_p, apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5


def can_speculate(params: SamplingParams) -> bool:
    """Whether the verifier keeps this request's distribution exactly. Penalties, min_tokens, logit_bias and
    logprobs (sample or prompt) are not applied to the verify rows, so such requests run without drafts. A
    structured-output grammar is: its mask is applied to each verify row (structured_output/manager.py)."""
    return (params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty
            and not params.min_tokens and not params.logit_bias and params.logprobs is None
            and params.prompt_logprobs is None)


def rejection_sample(logits: torch.Tensor, num_rows: list[int], draft_token_ids: list[list[int]],
                     params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[list[int]]:
    """Verify each request's drafts against the target logits.

    Args:
        logits: [sum(num_rows), V] float32, the target's logits; request i owns num_rows[i] = len(drafts) + 1
            consecutive rows (modified in place).
        num_rows: rows per request.
        draft_token_ids: each request's drafts.
        params, generators: each request's sampling parameters and its own generator (None: the global one).
    Returns:
        per request, the accepted drafts followed by one token from the target (1 to len(drafts) + 1 tokens).
    """
    greedy = [p.greedy for p in params]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
    probs = None
    if not all(greedy):
        probs = _target_probs(logits, num_rows, params)
    results = []
    offset = 0
    for i, drafts in enumerate(draft_token_ids):
        if greedy[i]:
            targets = argmax[offset:offset + num_rows[i]]
            n = 0
            while n < len(drafts) and drafts[n] == targets[n]:
                n += 1
            results.append(drafts[:n] + [targets[n]])
        else:
            results.append(_verify_random(probs[offset:offset + num_rows[i]], drafts, generators[i]))
        offset += num_rows[i]
    return results


def _target_probs(logits: torch.Tensor, num_rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """[M, V] the target's sampling distribution on every row (greedy rows get a temperature of 1: unused)."""
    row_params = [p for p, n in zip(params, num_rows, strict=True) for _ in range(n)]
    md = build_sampling_metadata(row_params, [[]] * len(row_params), [[]] * len(row_params),
                                 [None] * len(row_params), [None] * len(row_params), logits.shape[1], logits.device)
    temperature = md.temperature
    logits.div_(torch.where(temperature < _GREEDY_EPS, 1.0, temperature).unsqueeze(1))
    apply_top_k_top_p(logits, md.top_k, md.top_p)
    if md.min_p is not None:
        apply_min_p(logits, md.min_p)
    return logits.softmax(dim=-1)


def _verify_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    # probs: [k + 1, V]
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist()
    draft_probs = probs[torch.arange(k, device=probs.device),
                        torch.tensor(drafts, device=probs.device)].tolist() if k else []
    for j in range(k):
        if not uniforms[j] < draft_probs[j]:  # rejected: the residual, p_j without d_j
            residual = probs[j].clone()
            residual[drafts[j]] = 0.0
            return drafts[:j] + [_draw(residual, generator)]
    return drafts + [_draw(probs[k], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from weights / weights.sum() [V] (inverse CDF, sampling/categorical.py)."""
    u = categorical.uniforms(1, {0: generator} if generator is not None else {}, weights.device)
    return int(categorical.draw(weights.unsqueeze(0), u)[0])
