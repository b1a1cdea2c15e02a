"""The low-acceptance guard (pagedllm's; vLLM always verifies every draft): each request drafts only as many tokens
as pay for their verification at its recent acceptance rate, none when no number does.

A verify step with d drafts costs about 1 + c * d plain decode steps (c: SpeculativeConfig.
verify_cost_per_draft_token, by default measured from the engine's own steps: VerifyCost) and yields
E(d) = 1 + r0 + r0 r1 + ... + r0...r(d-1) tokens, r_i being the odds that draft i is accepted after drafts
0..i-1 were. The guard picks the d in 0..k with the most tokens per unit of cost, E(d) / (1 + c * d); d = 0 is a
plain step (1 token for 1). E.g. c = 0.375 and the same r at every position: no drafts below r = 0.375, 1 draft
up to r ~ 0.65, 2 up to ~0.8, 4 from ~0.9.

The rates are per-request exponential moving averages over its recent drafts, observed on every step whose tokens
can be compared with the drafts proposed before it, verified or not: the proposal made after step t against the
tokens step t + 1 produced (the leading matches accepted, the first mismatch rejected). For drafts that were not
verified this is free and gives the same odds as verifying (greedy: exact; random sampling: the sampled token
equals the draft with probability p_target(draft), the acceptance probability when p_draft = 1), so a request that
stopped drafting starts again as soon as its proposals start matching, without probe steps. Which drafts are
verified never changes the distribution of what is sampled (the rejection sampler is lossless for any drafts), so
the guard changes speed only; the metrics count verified drafts only. It does change which random draws a seeded
request consumes, so a seeded request with temperature > 0 is guarded with a cost that does not depend on timing
(VerifyCost.for_request): the same seed gives the same tokens on every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import SpeculativeConfig
    from pagedllm.core.request import Request

ACCEPTANCE_DECAY = 0.85
"""Weight of the past per observed draft token: about the last 1 / (1 - 0.85) ~ 7 tokens count."""

PRIOR_ACCEPTED = PRIOR_REJECTED = 1.0
"""A new request's estimate: 0.5, worth two observations (it fades like any other)."""


class DraftAcceptance:
    """One request's recent draft acceptance by position: rates[i] estimates the odds that draft i is accepted
    when drafts 0..i-1 were (decayed counts; in a copy the later positions are the likelier ones).

    Args:
        k: num_speculative_tokens.
    """

    __slots__ = ("accepted", "rejected")

    def __init__(self, k: int) -> None:
        self.accepted = [PRIOR_ACCEPTED] * k
        self.rejected = [PRIOR_REJECTED] * k

    def rates(self) -> list[float]:
        return [a / (a + r) for a, r in zip(self.accepted, self.rejected, strict=True)]

    def observe(self, proposed: list[int], produced: list[int]) -> None:
        """Count the drafts `proposed` before a step against the tokens it `produced` (accepted drafts plus the
        target's token, or one token for a step that verified none): the leading matches are accepted at their
        positions, the first mismatch is rejected at its; positions past it or past the produced tokens tell
        nothing.

        Example: proposed [5, 6, 7], produced [5, 9] -> position 0 accepted, 1 rejected; [5] -> 0 accepted."""
        n = min(len(proposed), len(produced), len(self.accepted))
        for i in range(n):
            hit = proposed[i] == produced[i]
            self.accepted[i] = self.accepted[i] * ACCEPTANCE_DECAY + hit
            self.rejected[i] = self.rejected[i] * ACCEPTANCE_DECAY + (not hit)
            if not hit:
                return

    def num_drafts(self, verify_cost_per_draft_token: float) -> int:
        """The d in 0..k with the most expected tokens per unit of step cost, E(d) / (1 + cost * d), where
        E(d) = 1 + r0 + r0 r1 + ... + r0...r(d-1); ties go to fewer drafts. Cost 0 (the guard off): k.

        Example: rates [0.5, 0.5, ...], cost 0.375 -> 1 (1.5 / 1.375 = 1.09 beats 1.75 / 1.75 and 1 / 1)."""
        k = len(self.accepted)
        if verify_cost_per_draft_token <= 0:
            return k
        best, best_gain, tokens, reach = 0, 1.0, 1.0, 1.0
        for d, rate in enumerate(self.rates(), start=1):
            reach *= rate
            tokens += reach
            gain = tokens / (1 + verify_cost_per_draft_token * d)
            if gain > best_gain * (1 + 1e-9):
                best, best_gain = d, gain
        return best


class VerifyCost:
    """The guard's verify_cost_per_draft_token: the configured value, or (None, the default) the engine's own
    measure of it. Every decode-only step is timed (EngineCore.step): steps without drafts keep an average step
    time per batch size; a step of B requests verifying D drafts in t seconds gives (t / plain(B) - 1) * B / D,
    averaged over the recent steps. Until the first estimate, MEASURED_PRIOR; a batch size at which every step
    verifies drafts gives none (no plain time to compare with). The measure moves only speed, never what is
    sampled.

    Example: batch 1, plain steps 10 ms, a step verifying 4 drafts 13.2 ms -> (1.32 - 1) * 1 / 4 = 0.08.
    """

    MEASURED_PRIOR = 0.33
    """A 5-row verify step cost ~2.3 plain steps on the first AVX2 kernels; Zen 5 measures ~0.1, AVX2 ~0.2 now."""
    MAX_ESTIMATE = 1.0
    """A step's estimate is cut to this: a draft row costing a whole plain step would mean the rows share nothing,
    slower than any kernel here (9 rows, off the multi-row path: 0.33); above it is a preempted step, and one
    such step should not stop every request's drafting."""
    PLAIN_DECAY = 0.9
    ESTIMATE_DECAY = 0.95
    """Weight of the past per step: the estimate follows about the last 20 verify steps."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.k = spec.num_speculative_tokens
        self.measured = spec.verify_cost_per_draft_token is None
        self.fixed = self.MEASURED_PRIOR if self.measured else spec.verify_cost_per_draft_token
        self.value = self.fixed  # the measured value once steps are observed
        self._plain_s: dict[int, float] = {}  # batch size -> recent step seconds without drafts

    def for_request(self, request: Request) -> float:
        """The cost that guards `request`: a seeded request that samples gets the timing-free value (the configured
        one, else MEASURED_PRIOR), since its draws, unlike greedy argmaxes, depend on how many drafts each step
        verified; the others get the measured value."""
        params = request.sampling_params
        return self.fixed if params.seed is not None and not params.greedy else self.value

    def observe(self, num_scheduled_tokens: dict[str, int], drafts: dict[str, list[int]], seconds: float) -> None:
        """Time of a step that ran `num_scheduled_tokens` with `drafts` (SchedulerOutput's fields); steps that
        compute any prompt tokens are skipped."""
        if not self.measured or not num_scheduled_tokens or seconds <= 0:
            return
        num_drafts = 0
        for req_id, n in num_scheduled_tokens.items():
            d = len(drafts.get(req_id, ()))
            if n != 1 + d:
                return  # a prefill chunk
            num_drafts += d
        batch = len(num_scheduled_tokens)
        plain = self._plain_s.get(batch)
        if num_drafts == 0:
            self._plain_s[batch] = seconds if plain is None else \
                plain * self.PLAIN_DECAY + seconds * (1 - self.PLAIN_DECAY)
        elif plain is not None:
            estimate = min(max((seconds / plain - 1) * batch / num_drafts, 0.0), self.MAX_ESTIMATE)
            self.value = self.value * self.ESTIMATE_DECAY + estimate * (1 - self.ESTIMATE_DECAY)


def drafts_to_verify(request: Request, budget: int, max_model_len: int, cost: VerifyCost) -> list[int]:
    """The request's drafts that its next step verifies: cut so the step fits `budget` more tokens and, if all are
    accepted, the bonus token still keeps within max_tokens and max_model_len (e.g. max_tokens 10 with 8 outputs:
    1 draft; accepted, it and the bonus token make output 10), then to the number worth verifying at the
    request's recent acceptance."""
    room = min(budget, max_model_len - len(request.all_token_ids) - 1)
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - len(request.output_token_ids) - 1)
    if request.spec_acceptance is None:
        request.spec_acceptance = DraftAcceptance(cost.k)
    room = min(room, request.spec_acceptance.num_drafts(cost.for_request(request)))
    return request.spec_token_ids[:max(room, 0)]
