"""The lockstep-batch cost model (specdec/decode/cost_model.py) against a simulation of
the engine's rounds: i.i.d. acceptance, the token budget, the slowest sequence."""

from __future__ import annotations

import random

import pytest

from specdec.decode.cost_model import (
    batch_speedup,
    expected_max_rounds,
    expected_tokens,
    predicted_speedup,
    rounds_distribution,
)


def simulate_rounds(alpha: float, k: int, m: int, rng: random.Random, empty: float = 0.0) -> int:
    """Rounds to emit m tokens: each drafts min(k, left - 1) (none with probability
    `empty`), accepts a prefix, emits it + 1."""
    rounds = 0
    while m > 0:
        drafts = 0 if rng.random() < empty else min(k, m - 1)
        accepted = 0
        while accepted < drafts and rng.random() < alpha:
            accepted += 1
        m -= accepted + 1
        rounds += 1
    return rounds


@pytest.mark.parametrize(
    "alpha,k,m,empty",
    [(0.3, 2, 9, 0.0), (0.7, 4, 31, 0.0), (0.9, 6, 20, 0.0), (0.5, 1, 5, 0.0), (0.8, 3, 25, 0.4)],
)
def test_rounds_distribution_matches_simulation(alpha, k, m, empty):
    rng = random.Random(f"{alpha}-{k}-{m}")
    n = 20000
    counts = [0] * (m + 1)
    for _ in range(n):
        counts[simulate_rounds(alpha, k, m, rng, empty)] += 1
    dist = rounds_distribution(alpha, k, m, empty)
    assert sum(dist) == pytest.approx(1.0, abs=1e-12)
    for r, p in enumerate(dist):  # binomial standard error, 5 sigma
        assert abs(counts[r] / n - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9, r


def test_rounds_distribution_exact_cases():
    assert rounds_distribution(0.0, 4, 7) == [0.0] * 7 + [1.0]  # one token per round
    dist = rounds_distribution(1.0, 4, 12)  # every draft accepted: 5 tokens, then 2 left
    assert dist[3] == 1.0 and sum(dist) == 1.0
    assert rounds_distribution(0.5, 3, 0) == [1.0]
    assert rounds_distribution(1.0, 4, 6, empty=1.0)[6] == pytest.approx(1.0)  # never drafts


@pytest.mark.parametrize(
    "alpha,k,tokens",
    [(0.6, 3, [20, 20, 20, 20]), (0.8, 4, [31, 5, 17]), ([0.9, 0.2, 0.5], 4, [30, 12, 25])],
)
def test_expected_max_rounds_matches_simulation(alpha, k, tokens):
    rng = random.Random(1)
    n = 20000
    alphas = alpha if isinstance(alpha, list) else [alpha] * len(tokens)
    # per sequence: some rounds without drafts (an n-gram without a match)
    empty = [0.3, 0.0, 0.6] if isinstance(alpha, list) else 0.0
    empties = empty if isinstance(empty, list) else [empty] * len(tokens)
    sims = [
        max(simulate_rounds(a, k, m, rng, z) for a, z, m in zip(alphas, empties, tokens))
        for _ in range(n)
    ]
    mean = sum(sims) / n
    sd = (sum((x - mean) ** 2 for x in sims) / (n - 1)) ** 0.5
    expected = expected_max_rounds(alpha, k, tokens, empty)
    assert expected == pytest.approx(mean, abs=5 * sd / n**0.5)
    # the slowest sequence of a batch takes more rounds than each one on average
    for a, z, m in zip(alphas, empties, tokens):
        one = sum(r * p for r, p in enumerate(rounds_distribution(a, k, m, z)))
        assert expected > one


def test_batch_speedup_reduces_to_the_classic_formula():
    # one long sequence, no prefill, no overhead, alpha 0 or 1: rounds are deterministic
    for alpha, k, c, v in [(1.0, 4, 0.1, 1.3), (0.0, 3, 0.05, 1.1)]:
        m = 20 * (k + 1) if alpha == 1.0 else 100
        s = batch_speedup(alpha, k, [m + 1], 0.01, k * c + v, 0.0, 0.0)
        assert s == pytest.approx(predicted_speedup(alpha, k, c, v), rel=1e-9)
    assert predicted_speedup(0.7, 3, 0.1) == predicted_speedup(0.7, 3, 0.1, 1.0)
    assert predicted_speedup(0.7, 3, 0.1, 2.0) == pytest.approx(expected_tokens(0.7, 3) / 2.3)
    # prefill dilutes the speedup: same model with a prefill as long as the decode
    fast = batch_speedup(0.8, 4, [65], 0.01, 1.5, 0.0, 0.0)
    slow = batch_speedup(0.8, 4, [65], 0.01, 1.5, 0.64, 0.64)
    assert 1.0 < slow < fast
