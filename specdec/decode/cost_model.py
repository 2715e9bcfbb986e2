"""The speculative decoding cost model (Leviathan, Kalman, Matias 2023; shared/REFERENCE.md).

With per-token acceptance alpha (i.i.d.), k drafts per round and c = draft step time /
target step time:

    E(alpha, k)    = (1 - alpha^(k+1)) / (1 - alpha)           tokens per target forward
    S(alpha, k, c) = E(alpha, k) / (k c + 1)                    wall-clock speedup

A layer-streamed target (specdec/models/streaming.py) pays for its weights on every
forward: a step costs about streamed bytes / host-to-device bandwidth, so c becomes tiny and
the best k grows (at c = 0, S keeps rising with k).
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round with k drafts, the bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); k = 0 is plain decoding (1.0)."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


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
