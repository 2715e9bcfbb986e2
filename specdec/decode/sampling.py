"""Logits -> probabilities (temperature, top-k, top-p) and sampling.

The same processing is applied to the target's p and the drafter's q in speculative
sampling, so the lossless guarantee holds for the *processed* target distribution.
temperature == 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kernels.argmax import argmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature/top-k/top-p."""
    logits = logits.float()
    if params.greedy:
        idx = argmax(logits)[..., None]
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of [..., V] probabilities -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator=None) -> torch.Tensor:
    """Greedy argmax or a sample from the processed distribution: [..., V] -> [...]."""
    if params.greedy:
        return argmax(logits)
    return sample(logits_to_probs(logits, params), generator)
