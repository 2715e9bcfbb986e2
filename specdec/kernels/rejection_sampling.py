"""Rejection sampling for one verification round: which drafts to accept, what comes next.

One program per sequence walks its drafts in order (shared/REFERENCE.md, kernel notes):

    greedy      accept draft i while it equals argmax p[i]; next token = argmax of p at the
                first mismatch, or of the bonus row p[n_draft] when every draft matched
    stochastic  accept draft x_i while u_i * q_i(x_i) < p_i(x_i), i.e. with probability
                min(1, p/q); at the first rejection sample from norm(max(p - q, 0)) (from p
                if the residual race is zero everywhere), else the bonus from p[n_draft];
                q = None means a drafter without probabilities: q is one-hot on the draft

Shapes: draft_tokens [B, k] int64, p [B, k+1, V] fp32, q [B, k, V] fp32 or None,
n_draft [B] (valid drafts per sequence, 0..k; positions >= n_draft are never accepted).

Sampling uses the exponential race: argmax_v r_v / E_v with E_v ~ Exp(1) draws v with
probability r_v / sum(r), so the residual needs no normalisation and the vocabulary is
read once, tile by tile. The randomness comes in as tensors drawn by torch from the
caller's generator (`draw_acceptance_noise`): uniforms [B, k] and race weights 1/E [B, V]
(one sampling event per sequence per round). Both backends then compute the same
correctly rounded products and comparisons (no division), so Triton and the torch
reference agree bit for bit on n_accepted and next_token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specdec.kernels.argmax import argmax
from specdec.kernels.utils import check_triton, launch, next_power_of_2, pick_backend


class AcceptResult(NamedTuple):
    """Tokens emitted for sequence b: draft_tokens[b, :n_accepted[b]] then next_token[b]."""

    n_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64


@triton.jit
def _greedy_accept_kernel(
    # pointers
    draft_ptr,
    p_ptr,
    n_draft_ptr,
    n_accepted_ptr,
    next_token_ptr,
    # sizes
    V,
    # strides
    stride_db,
    stride_pb,
    stride_pr,
    # meta-parameters
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(n_draft_ptr + b).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    row = tl.full([], 0, tl.int32)
    token = tl.full([], 0, tl.int32)
    matching = n >= 0
    while matching:
        # argmax of p[b, row] over vocabulary tiles; ties go to the lowest index
        p_row = p_ptr + b * stride_pb + row.to(tl.int64) * stride_pr
        best = tl.full([], float("-inf"), tl.float32)
        token = tl.full([], 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            vals = tl.load(p_row + offs, mask=offs < V, other=float("-inf"))
            tile_best, tile_idx = tl.max(vals, axis=0, return_indices=True)
            better = tile_best > best
            token = tl.where(better, start + tile_idx, token)
            best = tl.where(better, tile_best, best)
        draft = tl.load(draft_ptr + b * stride_db + row, mask=row < n, other=-1)
        matching = (row < n) & (draft == token)
        row += matching.to(tl.int32)
    tl.store(n_accepted_ptr + b, row.to(tl.int64))
    tl.store(next_token_ptr + b, token.to(tl.int64))


@triton.jit
def _stochastic_accept_kernel(
    # pointers
    draft_ptr,
    p_ptr,
    q_ptr,
    n_draft_ptr,
    uniform_ptr,
    race_ptr,
    n_accepted_ptr,
    next_token_ptr,
    # sizes
    V,
    # strides
    stride_db,
    stride_pb,
    stride_pr,
    stride_qb,
    stride_qr,
    stride_ub,
    stride_wb,
    # meta-parameters
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(n_draft_ptr + b).to(tl.int32)

    # acceptance tests: scalar loads of p (and q) at each drafted token
    n_acc = tl.full([], 0, tl.int32)
    alive = n >= 0
    for i in range(0, n):
        x = tl.load(draft_ptr + b * stride_db + i)
        px = tl.load(p_ptr + b * stride_pb + i * stride_pr + x)
        u = tl.load(uniform_ptr + b * stride_ub + i)
        if HAS_Q:
            qx = tl.load(q_ptr + b * stride_qb + i * stride_qr + x)
            ok = u * qx < px
        else:
            ok = u < px
        alive = alive & ok
        n_acc += alive.to(tl.int32)

    # one race over row n_acc: residual max(p - q, 0) after a rejection, p for the bonus
    rejected = n_acc < n
    row = n_acc.to(tl.int64)
    x_rej = tl.load(draft_ptr + b * stride_db + row, mask=rejected, other=-1)
    p_row = p_ptr + b * stride_pb + row * stride_pr
    q_row = q_ptr + b * stride_qb + row * stride_qr
    w_row = race_ptr + b * stride_wb
    q_len = tl.where(rejected, V, 0)  # q is zero for the bonus row
    cols = tl.arange(0, BLOCK_V)
    best_res = tl.full([], -1.0, tl.float32)
    tok_res = tl.full([], 0, tl.int32)
    best_p = tl.full([], -1.0, tl.float32)
    tok_p = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        pv = tl.load(p_row + offs, mask=mask, other=0.0)
        w = tl.load(w_row + offs, mask=mask, other=0.0)
        if HAS_Q:
            qv = tl.load(q_row + offs, mask=offs < q_len, other=0.0)
            res = tl.maximum(pv - qv, 0.0)
        else:
            res = tl.where(offs == x_rej, 0.0, pv)
        key, idx = tl.max(tl.where(mask, res * w, -1.0), axis=0, return_indices=True)
        better = key > best_res
        tok_res = tl.where(better, start + idx, tok_res)
        best_res = tl.where(better, key, best_res)
        key, idx = tl.max(tl.where(mask, pv * w, -1.0), axis=0, return_indices=True)
        better = key > best_p
        tok_p = tl.where(better, start + idx, tok_p)
        best_p = tl.where(better, key, best_p)
    token = tl.where(best_res > 0.0, tok_res, tok_p)  # zero residual: fall back to p
    tl.store(n_accepted_ptr + b, n_acc.to(tl.int64))
    tl.store(next_token_ptr + b, token.to(tl.int64))


def _prepare(draft_tokens, p, q, n_draft):
    """Check shapes; contiguous last dims; n_draft as [B] int64 (default: all k)."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, k], got {tuple(draft_tokens.shape)}")
    B, k = draft_tokens.shape
    if p.dim() != 3 or p.shape[:2] != (B, k + 1):
        raise ValueError(f"p must be [B, k+1, V] = [{B}, {k + 1}, V], got {tuple(p.shape)}")
    V = p.shape[-1]
    if q is not None and q.shape != (B, k, V):
        raise ValueError(f"q must be [B, k, V] = [{B}, {k}, {V}], got {tuple(q.shape)}")
    if n_draft is None:
        n_draft = torch.full((B,), k, dtype=torch.int64, device=p.device)
    elif n_draft.shape != (B,):
        raise ValueError(f"n_draft must be [B] = [{B}], got {tuple(n_draft.shape)}")
    draft_tokens = draft_tokens.to(torch.int64).contiguous()
    p = p.float() if p.stride(-1) == 1 else p.float().contiguous()
    if q is not None:
        q = q.float() if q.stride(-1) == 1 else q.float().contiguous()
    return draft_tokens, p, q, n_draft.to(torch.int64).contiguous()


def _check_noise(uniforms, race_weights, B: int, k: int, V: int) -> None:
    if uniforms is None or race_weights is None:
        raise ValueError("stochastic rejection sampling needs uniforms and race_weights")
    if uniforms.shape != (B, k) or race_weights.shape != (B, V):
        raise ValueError(
            f"uniforms must be [B, k] = [{B}, {k}] and race_weights [B, V] = [{B}, {V}], "
            f"got {tuple(uniforms.shape)} and {tuple(race_weights.shape)}"
        )


def draw_acceptance_noise(
    batch: int, k: int, vocab: int, device: torch.device | str, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomness for one stochastic round: uniforms [B, k] in [0, 1) and race weights
    1 / Exp(1) [B, V] (E clamped away from 0 so the weights stay finite)."""
    uniforms = torch.rand(batch, k, device=device, generator=generator)
    e = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    return uniforms, e.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()


def sample_config(vocab: int, block_v: int | None = None) -> tuple[int, int]:
    """(BLOCK_V, num_warps): vocabulary tiles of up to 4096 entries."""
    block = block_v or min(next_power_of_2(vocab), 4096)
    return block, 8 if block >= 2048 else 4


def rejection_sample_triton(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor | None = None,
    *,
    greedy: bool,
    uniforms: torch.Tensor | None = None,
    race_weights: torch.Tensor | None = None,
    block_v: int | None = None,
    out: AcceptResult | None = None,
) -> AcceptResult:
    """Triton kernels; `uniforms`/`race_weights` as from `draw_acceptance_noise` (stochastic
    only). `block_v` overrides the vocabulary tile; `out` receives the results in place."""
    check_triton(p.device)
    draft_tokens, p, q, n_draft = _prepare(draft_tokens, p, q, n_draft)
    B, V = p.shape[0], p.shape[-1]
    if out is None:
        out = AcceptResult(
            torch.empty(B, dtype=torch.int64, device=p.device),
            torch.empty(B, dtype=torch.int64, device=p.device),
        )
    if B == 0:
        return out
    block, num_warps = sample_config(V, block_v)
    if greedy:
        launch(
            _greedy_accept_kernel,
            (B,),
            draft_tokens,
            p,
            n_draft,
            out.n_accepted,
            out.next_token,
            V,
            draft_tokens.stride(0),
            p.stride(0),
            p.stride(1),
            BLOCK_V=block,
            num_warps=num_warps,
        )
        return out
    _check_noise(uniforms, race_weights, B, draft_tokens.shape[1], V)
    uniforms = uniforms.float().contiguous()
    race_weights = race_weights.float().contiguous()
    q_arg = p if q is None else q  # never read when HAS_Q is False
    launch(
        _stochastic_accept_kernel,
        (B,),
        draft_tokens,
        p,
        q_arg,
        n_draft,
        uniforms,
        race_weights,
        out.n_accepted,
        out.next_token,
        V,
        draft_tokens.stride(0),
        p.stride(0),
        p.stride(1),
        q_arg.stride(0),
        q_arg.stride(1),
        uniforms.stride(0),
        race_weights.stride(0),
        HAS_Q=q is not None,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return out


def rejection_sample_reference(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor | None = None,
    *,
    greedy: bool,
    uniforms: torch.Tensor | None = None,
    race_weights: torch.Tensor | None = None,
) -> AcceptResult:
    """Plain-torch version of the kernels, consuming the same uniforms and race weights."""
    draft_tokens, p, q, n_draft = _prepare(draft_tokens, p, q, n_draft)
    B, k = draft_tokens.shape
    V = p.shape[-1]
    batch = torch.arange(B, device=p.device)
    valid = torch.arange(k, device=p.device) < n_draft[:, None]  # [B, k]
    x = draft_tokens.clamp(0, V - 1)  # padding beyond n_draft may be any value
    if greedy:
        top = argmax(p)  # [B, k+1]
        ok = x == top[:, :k]
    else:
        _check_noise(uniforms, race_weights, B, k, V)
        uniforms, race_weights = uniforms.float(), race_weights.float()
        px = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        if q is None:
            ok = uniforms < px
        else:
            ok = uniforms * q.gather(-1, x[..., None]).squeeze(-1) < px
    n_accepted = (ok & valid).to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    if greedy:
        return AcceptResult(n_accepted, top[batch, n_accepted])

    rejected = n_accepted < n_draft  # [B]
    p_row = p[batch, n_accepted]  # [B, V]
    if k == 0:
        res = p_row
    elif q is None:
        x_rej = x[batch, n_accepted.clamp(max=k - 1)]
        drop = (torch.arange(V, device=p.device) == x_rej[:, None]) & rejected[:, None]
        res = p_row.masked_fill(drop, 0.0)
    else:
        q_row = q[batch, n_accepted.clamp(max=k - 1)]
        res = (p_row - q_row.masked_fill(~rejected[:, None], 0.0)).clamp_min(0.0)
    key_res = res * race_weights
    from_p = (p_row * race_weights).argmax(dim=-1)
    token = torch.where(key_res.amax(dim=-1) > 0, key_res.argmax(dim=-1), from_p)
    return AcceptResult(n_accepted, token)


def rejection_sample(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor | None = None,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
    backend: str | None = None,
) -> AcceptResult:
    """Accept a prefix of the drafts and pick the next token (see the module docstring).

    backend: None/"auto" follows `resolve_backend`; "triton" or "torch" forces one
    ("triton" raises BackendError where it cannot run). Greedy draws no randomness.
    """
    backend = pick_backend(backend, p.device)
    uniforms = race_weights = None
    if not greedy:
        B, k = draft_tokens.shape
        uniforms, race_weights = draw_acceptance_noise(B, k, p.shape[-1], p.device, generator)
    fn = rejection_sample_triton if backend == "triton" else rejection_sample_reference
    return fn(
        draft_tokens,
        p,
        q,
        n_draft,
        greedy=greedy,
        uniforms=uniforms,
        race_weights=race_weights,
    )
