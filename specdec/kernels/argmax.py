"""Argmax over a vocabulary on CPU, exact and fast: `argmax(x)` is `x.argmax(-1)`.

torch's CPU argmax is a scalar loop over its reduced dimension, and on bfloat16 it widens
every element on the way: over Qwen2.5-Coder's 151,936 logits it takes about 510 us a row
in bfloat16 and 86 us in float32 (AMD EPYC Zen 5, 2 threads, 2026-12-07), against 7 us
for `amax`, which is vectorized. A greedy decode step of that model takes ~26 ms, so the
bfloat16 argmax was 2 % of it, and a 5-row verification's acceptance (argmax of the
logits, then of their one-hot) about 0.7 ms.

Here the row is cut into chunks of CHUNK values: `amax` per chunk, the first chunk whose
maximum is the row's, and torch's argmax inside that chunk alone. Chunks are taken in
order and argmax inside one returns its first maximal index, so the result is the first
maximal index of the row: torch's answer, ties included. Rows holding a NaN (which torch's
argmax treats as the maximum) take torch's argmax. Elsewhere (CUDA, short rows) this is
torch's argmax itself, as it is for tensors that are not floating point.
"""

from __future__ import annotations

import torch

CHUNK = 1024  # values per chunk; rows shorter than 4 chunks take torch's argmax


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: the first index of each row's maximum, as `x.argmax(-1)`."""
    V = x.shape[-1]
    if x.device.type != "cpu" or V < 4 * CHUNK or x.numel() == 0 or not x.is_floating_point():
        return x.argmax(dim=-1)
    rows = x.reshape(-1, V)
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()  # bf16 / fp16 widen exactly
    n = V // CHUNK
    whole = rows[:, : n * CHUNK].unflatten(-1, (n, CHUNK)).amax(-1)  # [R, n]
    if V > n * CHUNK:  # the short last chunk
        whole = torch.cat([whole, rows[:, n * CHUNK :].amax(-1, keepdim=True)], dim=1)
    best = whole.amax(-1, keepdim=True)  # [R, 1]
    if torch.isnan(best).any():  # NaN: torch's argmax picks it; amax hides where
        return x.argmax(dim=-1)
    first = (whole == best).to(torch.uint8).argmax(-1)  # the first chunk holding the max
    start = first * CHUNK
    # that chunk's values, indices past the row clamped to its last (a later position: the
    # first maximal index inside the gathered chunk is still a real one)
    cols = (start[:, None] + torch.arange(CHUNK)).clamp_(max=V - 1)
    inside = rows.gather(1, cols).argmax(-1)
    return (start + inside).view(x.shape[:-1])
