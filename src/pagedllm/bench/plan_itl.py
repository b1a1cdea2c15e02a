"""p99 inter-token latency under Poisson arrivals: how many prefills share a decode step.

A running request's next token comes at the end of the replica's next engine step. That step decodes the batch
(mean ITL at the batch, d) and also prefills every request admitted at its start: those that arrived during the
previous step. At a replica's arrival rate lambda_r the number K of prefills in a step is Poisson with mean
lambda_r x (the previous step's duration), and a step with k prefills lasts d + k x p (p: one prompt's prefill),
so a long step makes the next one longer: K is a Markov chain, K' ~ Poisson(lambda_r x (d + K x p)). Its
stationary distribution gives the share of steps, and so (each step giving every running request one token) of
tokens, with k prefills; the p99 ITL is d + k99 x p, k99 the 99th percentile of K. A closed-loop sweep (`bench
serve --max-concurrency C`) admits one request as one leaves, so its own p99 ITL under-counts these bursts.
The chain is stable while lambda_r x p < 1 (prefills alone take less than the replica's time).
"""

from __future__ import annotations

import math


def prefill_count_distribution(rate_per_s: float, decode_s: float, prefill_s: float, kmax: int = 200,
                               rounds: int = 200) -> list[float]:
    """Stationary P(K = k), k = 0..kmax, of the prefills per step (module docstring); [] when unstable."""
    if rate_per_s <= 0:
        return [1.0]
    if rate_per_s * prefill_s >= 1:
        return []
    mean = rate_per_s * decode_s / (1 - rate_per_s * prefill_s)  # E[K] at the fixed point
    kmax = min(kmax, max(20, math.ceil(mean + 12 * math.sqrt(mean + 1) + 10)))
    # transition rows: Poisson pmf with mean rate x (d + k p), over 0..kmax (the tail folded into kmax)
    rows = []
    for k in range(kmax + 1):
        mu = rate_per_s * (decode_s + k * prefill_s)
        row, term = [], math.exp(-mu)
        for j in range(kmax + 1):
            row.append(term)
            term *= mu / (j + 1)
        row[-1] += max(0.0, 1 - sum(row))
        rows.append(row)
    pi = [1.0] + [0.0] * kmax
    for _ in range(rounds):
        nxt = [0.0] * (kmax + 1)
        for k, w in enumerate(pi):
            if w > 1e-15:
                row = rows[k]
                for j in range(kmax + 1):
                    nxt[j] += w * row[j]
        pi = nxt
    return pi


def p99_itl_poisson_ms(rate_per_s: float, decode_ms: float, prefill_ms: float, p: float = 0.99) -> float:
    """p99 ITL (ms) at a replica's arrival rate: d + k99 x p (module docstring); inf when unstable."""
    pi = prefill_count_distribution(rate_per_s, decode_ms / 1000, prefill_ms / 1000)
    if not pi:
        return math.inf
    cdf = 0.0
    for k, w in enumerate(pi):
        cdf += w
        if cdf >= p - 1e-12:
            return decode_ms + k * prefill_ms
    return math.inf
