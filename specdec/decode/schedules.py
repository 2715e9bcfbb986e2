"""How many tokens to draft each round.

- constant:   k every round.
- heuristic:  Hugging Face's rule: k += 2 after a round where every draft was accepted,
              k -= 1 otherwise, kept within [1, k_max].
- confidence: up to k per round, but the drafter stops at its first guess whose top
              probability is below p_min (llama.cpp's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError


def check_p_min(p_min: float) -> None:
    """The confidence cut-off of draft chains (schedules, the head drafters): [0, 1)."""
    if not 0.0 <= p_min < 1.0:
        raise SpecDecError(f"p_min must be in [0, 1), got {p_min}")


@dataclass
class Schedule:
    k: int
    k_max: int = 0  # heuristic only; 0 -> 2 * k
    p_min: float = 0.0  # confidence only

    name = "constant"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise SpecDecError(f"k must be >= 1, got {self.k}")
        if not self.k_max:
            self.k_max = max(self.k, 2 * self.k)
        if self.k_max < self.k:
            raise SpecDecError(f"k_max ({self.k_max}) must be >= k ({self.k})")
        check_p_min(self.p_min)
        self.current = self.k

    @property
    def max_k(self) -> int:
        return self.k

    def next_k(self) -> int:
        return self.current

    def update(self, n_accepted: torch.Tensor, n_draft: torch.Tensor) -> None:
        pass


class ConstantSchedule(Schedule):
    name = "constant"


class HeuristicSchedule(Schedule):
    name = "heuristic"

    @property
    def max_k(self) -> int:
        return self.k_max

    def update(self, n_accepted, n_draft):
        if bool((n_accepted >= n_draft).all()):
            self.current = min(self.current + 2, self.k_max)
        else:
            self.current = max(self.current - 1, 1)


class ConfidenceSchedule(Schedule):
    name = "confidence"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.p_min <= 0.0:
            raise SpecDecError("the confidence schedule needs p_min > 0")


SCHEDULES: dict[str, type[Schedule]] = {
    "constant": ConstantSchedule,
    "heuristic": HeuristicSchedule,
    "confidence": ConfidenceSchedule,
}


def make_schedule(name: str, k: int, k_max: int = 0, p_min: float = 0.0) -> Schedule:
    if name not in SCHEDULES:
        raise SpecDecError(f"unknown schedule {name!r} (choose one of {', '.join(SCHEDULES)})")
    if name != "confidence":
        p_min = 0.0
    return SCHEDULES[name](k=k, k_max=k_max, p_min=p_min)
