"""The speculative decoding cost model (Leviathan, Kalman, Matias 2023; shared/REFERENCE.md).

With per-token acceptance alpha (i.i.d.), k drafts per round and c = draft step time /
target step time:

    E(alpha, k)       = (1 - alpha^(k+1)) / (1 - alpha)        tokens per target forward
    S(alpha, k, c)    = E(alpha, k) / (k c + 1)                 wall-clock speedup
    S(alpha, k, c, v) = E(alpha, k) / (k c + v)                 with the verification
                        forward over k + 1 tokens costing v target steps (measured)

A layer-streamed target (specdec/models/streaming.py) pays for its weights on every
forward: a step costs about streamed bytes / host-to-device bandwidth, so c becomes tiny and
the best k grows (at c = 0, S keeps rising with k).

Batches (`batch_speedup`). A batch of B sequences decodes in lockstep: plain decoding takes
max_i(n_i) - 1 batched steps after the prefill (n_i: tokens of sequence i), speculative
decoding max_i(R_i) batched rounds, each paying the same draft + verification forwards for
the whole batch although every sequence accepts its own prefix. E / (k c + v) is the
speedup of one sequence in the steady state; a batch's measured speedup also pays for
    - the prefill (the same forward in both runs: it dilutes the speedup of short outputs),
    - the per-round work outside the draft and verification forwards (acceptance
      bookkeeping, emission, the drafter's catch-up on committed tokens): o target steps,
    - waiting for the slowest sequence: E[max_i R_i] >= max_i E[R_i], the gap growing
      with B and with the spread of the accepted lengths.
`rounds_distribution` gives P(R = r) for one sequence under the i.i.d. model with the
engine's token budget (a round drafts at most the tokens left - 1), `expected_max_rounds`
the expectation of the maximum over independent sequences (one alpha for all, or each
sequence's own: prompts differ, n-gram lookup most of all), and `batch_speedup` the
predicted speedup of one batch from measured step times. A drafter may propose nothing
(an n-gram without an earlier match: on specbench_mini about 40 % of the n-gram rounds):
such a round emits one token and counts no rejection, so alpha alone overstates the
tokens per round; `empty` is the measured share of those rounds.

    T_plain = P_plain + (max_i n_i - 1) t
    T_spec  = P_spec  + E[max_i R_i] (f c + v + o) t      (f: drafter forwards per round)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round with k drafts, the bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(k c + v)); k = 0 is plain decoding (1.0 at v = 1).
    v: the verification forward's cost in target steps (1: the classic formula)."""
    return expected_tokens(alpha, k) / (k * c + v)


def best_k(alpha: float, c: float, k_max: int = 64) -> int:
    """The k in [0, k_max] with the highest predicted speedup (0: do not speculate)."""
    return max(range(k_max + 1), key=lambda k: (predicted_speedup(alpha, k, c), -k))


def streamed_step_s(
    streamed_bytes: float, h2d_bytes_per_s: float, resident_s: float = 0.0
) -> float:
    """Seconds per forward of a streamed target: its streamed weights over the host-to-device
    bandwidth, plus the time of the parts that stay on the device (`resident_s`, usually
    negligible next to the stream)."""
    return streamed_bytes / h2d_bytes_per_s + resident_s


@lru_cache(maxsize=256)
def _rounds_table(
    alpha: float, k: int, m_max: int, empty: float = 0.0
) -> tuple[tuple[float, ...], ...]:
    """table[m][r] = P(r rounds emit exactly m tokens) for m <= m_max (module docstring);
    a round drafts nothing with probability `empty` (an n-gram without a match)."""
    table: list[tuple[float, ...]] = [(1.0,)]
    for m in range(1, m_max + 1):
        drafts = min(k, m - 1)  # the engine drafts at most the tokens left - 1
        # a round emits j tokens: j - 1 accepted drafts, then a rejection or the bonus
        emit = [alpha ** (j - 1) * (1.0 - alpha) for j in range(1, drafts + 1)]
        emit.append(alpha**drafts)
        emit = [(1.0 - empty) * p for p in emit]
        emit[0] += empty
        dist = [0.0] * (m + 1)
        for j, pj in enumerate(emit, start=1):
            for r, pr in enumerate(table[m - j]):
                dist[r + 1] += pj * pr
        table.append(tuple(dist))
    return tuple(table)


def rounds_distribution(alpha: float, k: int, m: int, empty: float = 0.0) -> list[float]:
    """P(R = r) for r = 0..m: the rounds one sequence needs to emit m tokens after the
    prefill's first, drafts accepted i.i.d. with probability alpha, a round without drafts
    with probability `empty`."""
    if m < 0 or k < 1:
        raise ValueError(f"need m >= 0 and k >= 1, got m={m}, k={k}")
    return list(_rounds_table(float(alpha), int(k), int(m), float(empty))[m])


def _per_sequence(x: float | Sequence[float], n: int, name: str) -> list[float]:
    xs = [x] * n if isinstance(x, int | float) else list(x)
    if len(xs) != n:
        raise ValueError(f"{len(xs)} values of {name} for {n} sequences")
    return xs


def expected_max_rounds(
    alpha: float | Sequence[float],
    k: int,
    tokens: Sequence[int],
    empty: float | Sequence[float] = 0.0,
) -> float:
    """E[max_i R_i] over independent sequences emitting tokens[i] tokens after the first:
    the batched rounds a lockstep batch takes (sum over r of P(max > r)). alpha and the
    share of rounds without drafts (`empty`): one for all, or one per sequence (prompts
    accept differently)."""
    if not tokens:
        return 0.0
    alphas = _per_sequence(alpha, len(tokens), "alpha")
    empties = _per_sequence(empty, len(tokens), "empty")
    cdfs = []
    for a, z, m in zip(alphas, empties, tokens):
        acc, cdf = 0.0, []
        for p in _rounds_table(float(a), int(k), int(m), float(z))[m]:
            acc += p
            cdf.append(acc)
        cdfs.append(cdf)
    expected = 0.0
    for r in range(max(tokens)):
        below = 1.0
        for cdf in cdfs:
            below *= cdf[r] if r < len(cdf) else 1.0
        expected += 1.0 - below
    return expected


def speculative_batch_s(
    alpha: float | Sequence[float],
    k: int,
    emitted: Sequence[int],
    step_s: float,
    round_steps: float,
    prefill_s: float,
    empty: float | Sequence[float] = 0.0,
) -> float:
    """Predicted seconds of one lockstep speculative batch whose sequences emit emitted[i]
    tokens after the prefill's first: prefill_s + E[max_i R_i] * round_steps * step_s, with
    round_steps = f c + v + o (a round in plain decode steps of step_s)."""
    rounds = expected_max_rounds(alpha, k, emitted, empty)
    return prefill_s + rounds * round_steps * step_s


def batch_speedup(
    alpha: float,
    k: int,
    tokens: Sequence[int],
    step_s: float,
    round_steps: float,
    prefill_plain_s: float,
    prefill_spec_s: float,
) -> float:
    """Predicted speedup of one lockstep batch (module docstring): tokens[i] = tokens
    sequence i generates (the prefill's first included), step_s = one plain batched decode
    step, round_steps = f c + v + o."""
    emitted = [n - 1 for n in tokens]
    plain = prefill_plain_s + max(emitted) * step_s
    return plain / speculative_batch_s(alpha, k, emitted, step_s, round_steps, prefill_spec_s)
