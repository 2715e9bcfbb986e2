"""Logical KV-cache rollback: after verification only the committed lengths change."""

from __future__ import annotations

import torch


def rollback_lens(cache_lens: torch.Tensor, n_keep: torch.Tensor | int) -> torch.Tensor:
    """The committed lengths after keeping the first n_keep[b] of this step's new entries,
    cache_lens[b] + n_keep[b] (a new tensor). No data moves; slots past the new length are
    overwritten by the next step (physical moves: `specdec.kernels.kv_rollback.compact_kv`)."""
    if isinstance(n_keep, torch.Tensor):
        n_keep = n_keep.to(device=cache_lens.device, dtype=cache_lens.dtype)
    return cache_lens + n_keep
