"""The CPU attention path for a few query rows over a bf16 / fp16 cache outside batch-invariant
mode (`specdec.models.transformer._small_attention`): against float64 and torch's SDPA, with
the masks decode steps, verifications and ragged batches use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.transformer import _small_attention


def _reference(q, k, v, mask, scale):
    """float64, keys repeated per query head (GQA: head h reads KV head h // G)."""
    G = q.shape[2] // k.shape[1]
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    s = torch.einsum("bthd,bhld->bhtl", q.double(), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhtl,bhld->bthd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, hq, hkv, d", [(1, 1, 9, 3, 64), (5, 1, 6, 2, 16), (3, 7, 4, 4, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_small_attention_matches_float64_and_sdpa(dtype, B, T, hq, hkv, d, masked):
    L = 37
    q = torch.randn(B, T, hq, d).to(dtype)
    k, v = (torch.randn(B, hkv, L, d).to(dtype) for _ in range(2))
    mask = None
    if masked:  # ragged rows: sequence b's row t sees slots 0 .. start_b + t
        starts = torch.randint(0, L - T, (B,))
        pos = starts[:, None] + torch.arange(T)
        mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, L]
    scale = d**-0.5
    got = _small_attention(q, k, v, mask, scale)
    assert got.dtype == dtype and got.shape == q.shape
    ref = _reference(q, k, v, mask, scale)
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err  # one rounding to 16 bits of an fp32 result
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    err_sdpa = ((sdpa.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= err_sdpa + 4e-3, (err, err_sdpa)  # no less accurate than SDPA
