"""Dequantize a QuantizedWeight to fp32/fp16/bf16 with a Triton kernel (the prefill path of
`quant_gemv.quant_linear`), and the K-tiling rules both kernels share.

A tile is [BLOCK_N, TILE_GROUPS, TILE_GROUP / 2] per half (quant_gemv.py explains the
halves): BLOCK_K = TILE_GROUPS * TILE_GROUP elements along K, one scale per TILE_GROUP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.quant import QuantizedWeight
from specdec.kernels.utils import cdiv, launch, next_power_of_2


@triton.jit
def _dequantize_kernel(
    # pointers
    qweight_ptr,  # [N, K_PAD] int8 or [N, K_PAD // 2] uint8
    scales_ptr,  # [N, N_GROUPS] fp16
    mins_ptr,  # [N, N_GROUPS] fp16 (HAS_MINS)
    out_ptr,  # [N, K]
    # sizes
    N,
    K,
    K_PAD,
    GROUP,
    N_GROUPS,
    # strides (elements)
    stride_qn,
    stride_sn,
    stride_on,
    # meta-parameters
    BITS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    TILE_GROUP: tl.constexpr,
):
    HALF: tl.constexpr = TILE_GROUP // 2
    BLOCK_K: tl.constexpr = TILE_GROUPS * TILE_GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_g = tl.arange(0, TILE_GROUPS)
    mask_n = offs_n < N
    k_lo = k0 + offs_g[:, None] * TILE_GROUP + tl.arange(0, HALF)[None, :]  # [TILE_GROUPS, HALF]
    k_hi = k_lo + HALF
    n3 = offs_n[:, None, None].to(tl.int64)

    s_idx = (k0 + offs_g * TILE_GROUP) // GROUP
    s_mask = mask_n[:, None] & (s_idx < N_GROUPS)[None, :]
    s_offs = offs_n[:, None] * stride_sn + s_idx[None, :]
    d = tl.load(scales_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)[:, :, None]
    if BITS == 8:
        lo_mask = mask_n[:, None, None] & (k_lo < K_PAD)[None, :, :]
        hi_mask = mask_n[:, None, None] & (k_hi < K_PAD)[None, :, :]
        w_lo = tl.load(qweight_ptr + n3 * stride_qn + k_lo[None], mask=lo_mask, other=0) * d
        w_hi = tl.load(qweight_ptr + n3 * stride_qn + k_hi[None], mask=hi_mask, other=0) * d
    else:
        mask = mask_n[:, None, None] & (k_lo < K_PAD)[None, :, :]
        byte = k0 // 2 + offs_g[:, None] * HALF + tl.arange(0, HALF)[None, :]
        q = tl.load(qweight_ptr + n3 * stride_qn + byte[None], mask=mask, other=0)
        q_lo = (q & 0xF).to(tl.float32)
        q_hi = (q >> 4).to(tl.float32)
        if HAS_MINS:
            mn = tl.load(mins_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)[:, :, None]
            w_lo = q_lo * d + mn
            w_hi = q_hi * d + mn
        else:
            w_lo = (q_lo - 8.0) * d
            w_hi = (q_hi - 8.0) * d
    out_rows = out_ptr + n3 * stride_on
    dtype = out_ptr.dtype.element_ty
    tl.store(out_rows + k_lo[None], w_lo.to(dtype), mask=mask_n[:, None, None] & (k_lo < K)[None])
    tl.store(out_rows + k_hi[None], w_hi.to(dtype), mask=mask_n[:, None, None] & (k_hi < K)[None])


def tile_group(w: QuantizedWeight, block_k: int) -> int:
    g = w.group_size
    if block_k % g == 0:
        return g
    if w.bits == 8 and (g % block_k == 0 or g == w.k_padded):  # int8 per channel
        return block_k
    raise ValueError(f"block_k={block_k} does not tile {w.fmt} groups of {g}")


def default_block_k(w: QuantizedWeight, block_k: int | None) -> int:
    """128 contiguous bytes per row and K step, no wider than the (padded) row."""
    min_k = max(32, w.group_size) if w.bits == 4 else 32
    if block_k is None:
        block_k = min(256 if w.bits == 4 else 128, max(next_power_of_2(w.k_padded), min_k))
    if block_k < min_k or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of 2 >= {min_k} for {w.fmt}")
    return block_k


def check_weight(w: QuantizedWeight) -> None:
    want = torch.int8 if w.bits == 8 else torch.uint8
    if w.bits not in (4, 8) or w.qweight.dtype != want:
        raise ValueError(f"unsupported QuantizedWeight: {w.fmt}, {w.bits} bits, {w.qweight.dtype}")
    for t in (w.qweight, w.scales, w.mins):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("QuantizedWeight planes must be contiguous along K")


def dequantize_triton(
    w: QuantizedWeight, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, K] weight in `dtype`, computed in fp32 like `QuantizedWeight.dequantize`."""
    check_weight(w)
    n, k = w.shape
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.device)
    if out.shape != (n, k) or out.stride(-1) != 1 or out.dtype != dtype:
        raise ValueError(f"out must be a [{n}, {k}] {dtype} tensor contiguous along K")
    block_k = default_block_k(w, None)
    group = tile_group(w, block_k)
    block_n = 32
    mins = w.mins if w.mins is not None else w.scales
    launch(
        _dequantize_kernel,
        (cdiv(n, block_n), cdiv(w.k_padded, block_k)),
        w.qweight,
        w.scales,
        mins,
        out,
        n,
        k,
        w.k_padded,
        w.group_size,
        w.scales.shape[1],
        w.qweight.stride(0),
        w.scales.stride(0),
        out.stride(0),
        BITS=w.bits,
        HAS_MINS=w.mins is not None,
        BLOCK_N=block_n,
        TILE_GROUPS=block_k // group,
        TILE_GROUP=group,
    )
    return out
