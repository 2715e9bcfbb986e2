"""Weight-only linear layer for GGUF's 5-bit and k-quant formats (q5_0, q5_1, q4_k, q5_k,
q6_k): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W a QuantizedWeight in the planes that
`quant.py` documents, read as they are.

- One `@triton.jit` helper, `_kquant_tile`, decodes a [BLOCK_N, NSUB, SUBLEN] weight tile in
  element order (NSUB sub-blocks that each share one scale): q5_0/q5_1 tiles hold NSUB
  32-weight blocks, q4_k/q5_k one super-block of 8 x 32, q6_k one super-block of 16 x 16.
  The sub-block scales are formed as (d * sc) in fp32 first, the order of `gguf.quants`, so
  fp32 results match the torch dequantization.
- GEMV (M = 1..16): one program owns BLOCK_N output features and one K range (split-K when N
  alone gives too few programs) and computes all M rows from one read of each tile. fp16 /
  bf16 with 2..16 rows use tl.dot (tensor cores, rows padded to 16, weights rounded to the
  activation dtype); M = 1 and fp32 multiply each row against the fp32 tile and sum.
  Split-K partials are summed by quant_gemv's deterministic reduction kernel.
- M > 16 (prefill): the same tile helper dequantizes W to the activation dtype, then torch
  matmul.
- Tiling and split-K come from `kquant_gemv_config` (a pure function of the shapes and the
  `Target`), launches go through `utils.launch`, and each format registers a `WeightFormat`,
  so `benchmarks/compile_check.py` compiles what the launchers pick. Code planes load
  16 bytes per thread (high bits: q6_k 16, q5_k 8, q5_0 / q5_1 4: one block's qh word).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from specdec.kernels.quant import KQUANT_BITS, KQUANT_BLOCKS, QuantizedWeight
from specdec.kernels.quant_gemv import (
    GemvConfig,
    launch_splitk_reduce,
    quant_linear,
    store_gemv_tile,
    tiled_gemv_config,
)
from specdec.kernels.utils import (
    Target,
    WeightFormat,
    cdiv,
    launch,
    next_power_of_2,
    register_weight_format,
    target_of,
)

FMT_IDS = {"q5_0": 0, "q5_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4}


@triton.jit
def _kquant_tile(
    # pointers (planes of quant.py; unused planes may alias `scales_ptr`)
    qweight_ptr,  # [N, K / 2] uint8: low 4 bits of the codes
    scales_ptr,  # [N, K / G] fp16: d
    mins_ptr,  # [N, K / G] fp16: m (q5_1) or dmin (q4_k, q5_k)
    qhigh_ptr,  # uint8: high bits (q5_*, q6_k)
    sub_ptr,  # uint8 [N, K / 256 * 12] (q4_k, q5_k) or int8 [N, K / 16] (q6_k)
    # rows and tile position
    offs_n,  # [BLOCK_N] output features
    mask_n,  # [BLOCK_N]
    blk0,  # index of the tile's first block of G weights
    K,
    # strides (elements)
    stride_qn,
    stride_sn,
    stride_hn,
    stride_un,
    # meta-parameters
    FMT: tl.constexpr,  # FMT_IDS
    NSUB: tl.constexpr,
    SUBLEN: tl.constexpr,
):
    """fp32 weights [BLOCK_N, NSUB, SUBLEN] of one K tile, in element order."""
    s = tl.arange(0, NSUB)[None, :, None]  # sub-block
    l = tl.arange(0, SUBLEN)[None, None, :]  # element within the sub-block
    n = offs_n[:, None, None].to(tl.int64)
    rows = mask_n[:, None, None]
    q_rows = qweight_ptr + n * stride_qn
    h_rows = qhigh_ptr + n * stride_hn
    if FMT <= 1:  # q5_0 / q5_1: sub-block s is block blk0 + s of 32 weights
        blk = blk0 + s
        ok = rows & (blk * 32 < K)
        qs = tl.load(q_rows + blk * 16 + l % 16, mask=ok, other=0).to(tl.int32)
        # a block's 4 qh bytes are one little-endian 32-bit word whose bit l is the high bit
        # of element l; rows are 4-byte aligned (K is a multiple of 32). Loading words, not
        # bytes, gives 4-byte loads on every triton (3.6 ignores an alignment hint here and
        # loads bytes)
        qh = tl.load(h_rows.to(tl.pointer_type(tl.int32)) + blk, mask=ok, other=0)
        hi = (qh >> l) & 1  # [BLOCK_N, NSUB, SUBLEN]
        q = ((qs >> ((l // 16) * 4)) & 0xF) | (hi << 4)
        d = tl.load(scales_ptr + n * stride_sn + blk, mask=ok, other=0.0).to(tl.float32)
        if FMT == 0:
            w = (q.to(tl.float32) - 16.0) * d
        else:
            mn = tl.load(mins_ptr + n * stride_sn + blk, mask=ok, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * d + mn
    elif FMT <= 3:  # q4_k / q5_k: one super-block, 8 sub-blocks of 32
        d = tl.load(scales_ptr + n * stride_sn + blk0, mask=rows, other=0.0).to(tl.float32)
        dmin = tl.load(mins_ptr + n * stride_sn + blk0, mask=rows, other=0.0).to(tl.float32)
        # 64-weight chunk s // 2: byte l holds element l (low nibble) and l + 32 (high)
        qs = tl.load(q_rows + blk0 * 128 + (s // 2) * 32 + l, mask=rows, other=0).to(tl.int32)
        q = (qs >> ((s % 2) * 4)) & 0xF
        if FMT == 3:
            qh = tl.load(h_rows + blk0 * 32 + l, mask=rows, other=0).to(tl.int32)
            q = q | (((qh >> s) & 1) << 4)
        # six-bit scale and min of sub-block s from the 12 packed bytes b
        b = sub_ptr + n * stride_un + blk0 * 12
        b_s = tl.load(b + s, mask=rows, other=0).to(tl.int32)
        b_s4 = tl.load(b + s + 4, mask=rows, other=0).to(tl.int32)
        b_m4 = tl.load(b + tl.where(s >= 4, s - 4, s), mask=rows, other=0).to(tl.int32)
        sc = tl.where(s < 4, b_s & 63, (b_s4 & 15) | ((b_m4 >> 6) << 4))
        mn = tl.where(s < 4, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
        w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    else:  # q6_k: one super-block, 16 sub-blocks of 16
        r = s * SUBLEN + l  # element in the super-block
        half = r // 128
        i = r % 128
        ql = tl.load(q_rows + blk0 * 128 + half * 64 + i % 64, mask=rows, other=0).to(tl.int32)
        qh = tl.load(h_rows + blk0 * 64 + half * 32 + i % 32, mask=rows, other=0).to(tl.int32)
        q = ((ql >> ((i // 64) * 4)) & 0xF) | (((qh >> ((i // 32) * 2)) & 3) << 4)
        sc = tl.load(sub_ptr + n * stride_un + blk0 * 16 + s, mask=rows, other=0).to(tl.float32)
        d = tl.load(scales_ptr + n * stride_sn + blk0, mask=rows, other=0.0).to(tl.float32)
        w = (d * sc) * (q.to(tl.float32) - 32.0)
    return w


@triton.jit
def _kquant_gemv_kernel(
    # pointers
    x_ptr,  # [M, K] activations
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    qhigh_ptr,
    sub_ptr,
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or fp32 partials [SPLIT_K, M, N]
    # sizes
    M,
    N,
    K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    # strides (elements)
    stride_xm,
    stride_qn,
    stride_sn,
    stride_hn,
    stride_un,
    stride_om,
    stride_os,
    # meta-parameters
    FMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NSUB: tl.constexpr,
    SUBLEN: tl.constexpr,
    GROUP: tl.constexpr,  # weights per block (32 or 256)
):
    BLOCK_K: tl.constexpr = NSUB * SUBLEN
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K_PER_SPLIT is a multiple of BLOCK_K: the hint lets every tile's row slices be
    # loaded as aligned vectors
    k_start = tl.multiple_of(pid_k * K_PER_SPLIT, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = _kquant_tile(
            qweight_ptr,
            scales_ptr,
            mins_ptr,
            qhigh_ptr,
            sub_ptr,
            offs_n,
            mask_n,
            k0 // GROUP,
            K,
            stride_qn,
            stride_sn,
            stride_hn,
            stride_un,
            FMT,
            NSUB,
            SUBLEN,
        )
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        xk = k0 + offs_k
        if USE_DOT:
            x_mask = mask_m[:, None] & (xk < K)[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + xk[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        else:
            for r in tl.static_range(BLOCK_M):
                row_ok = tl.full([BLOCK_K], r, tl.int32) < M
                x_r = tl.load(x_ptr + r * stride_xm + xk, mask=row_ok & (xk < K), other=0.0)
                row = tl.sum(w * x_r.to(tl.float32)[None, :], axis=1)
                acc = tl.where(offs_m[:, None] == r, acc + row[None, :], acc)

    store_gemv_tile(
        acc,
        bias_ptr,
        out_ptr,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        pid_k * stride_os,
        stride_om,
        HAS_BIAS,
    )


@triton.jit
def _kquant_dequantize_kernel(
    # pointers
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    qhigh_ptr,
    sub_ptr,
    out_ptr,  # [N, K]
    # sizes
    N,
    K,
    # strides (elements)
    stride_qn,
    stride_sn,
    stride_hn,
    stride_un,
    stride_on,
    # meta-parameters
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NSUB: tl.constexpr,
    SUBLEN: tl.constexpr,
    GROUP: tl.constexpr,
):
    BLOCK_K: tl.constexpr = NSUB * SUBLEN
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    mask_n = offs_n < N
    w = _kquant_tile(
        qweight_ptr,
        scales_ptr,
        mins_ptr,
        qhigh_ptr,
        sub_ptr,
        offs_n,
        mask_n,
        k0 // GROUP,
        K,
        stride_qn,
        stride_sn,
        stride_hn,
        stride_un,
        FMT,
        NSUB,
        SUBLEN,
    )
    w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    ok = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + ok[None, :]
    mask = mask_n[:, None] & (ok < K)[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(fmt: str, k: int) -> tuple[int, int]:
    """(NSUB, SUBLEN) of a K tile: up to 4 blocks of 32 for q5_*, one super-block for
    k-quants."""
    if fmt in ("q5_0", "q5_1"):
        return min(4, next_power_of_2(k // 32)), 32
    return (16, 16) if fmt == "q6_k" else (8, 32)


def kquant_gemv_config(
    m: int,
    w: QuantizedWeight,
    x_dtype: torch.dtype,
    target: Target,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
) -> GemvConfig:
    """Tile sizes and split-K of `_kquant_gemv_kernel` for M rows against `w` on `target` (a
    pure function of the shapes; keyword arguments override the choice). A K tile is
    [NSUB, SUBLEN] = (block_k // tile_group, tile_group)."""
    n, k = w.shape
    nsub, sublen = _tile(w.fmt, k)
    # M = 1: a [BLOCK_N, BLOCK_K] fp32 tile (twice quant_gemv's half tiles) takes 128-168
    # registers per thread, so an SM holds about 4 programs of 4 warps
    return tiled_gemv_config(
        m,
        n,
        k,
        nsub * sublen,
        sublen,
        x_dtype,
        target,
        block_n=block_n,
        split_k=split_k,
        broadcast_per_sm=4,
    )


def _check_weight(w: QuantizedWeight) -> None:
    if w.fmt not in FMT_IDS:
        raise ValueError(f"not a k-quant QuantizedWeight: {w.fmt}")
    if w.in_features % KQUANT_BLOCKS[w.fmt][1]:
        raise ValueError(f"{w.fmt} weight with in_features={w.in_features}")
    for t in (w.qweight, w.scales, w.mins, w.qhigh, w.sub):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("QuantizedWeight planes must be contiguous along K")


def _planes(w: QuantizedWeight) -> tuple[list[torch.Tensor], list[int]]:
    """Plane pointers (absent planes alias `scales`) and their row strides."""
    alias = lambda t: w.scales if t is None else t  # noqa: E731
    ptrs = [w.qweight, w.scales, alias(w.mins), alias(w.qhigh), alias(w.sub)]
    strides = [w.qweight.stride(0), w.scales.stride(0), ptrs[3].stride(0), ptrs[4].stride(0)]
    return ptrs, strides


def launch_kquant_gemv(
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T (+ bias) for M <= 16 (`config` from `kquant_gemv_config`)."""
    m, k = x.shape
    n = w.out_features
    _check_weight(w)
    if out.shape != (m, n) or out.stride() != (n, 1) or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    x = x if x.stride(-1) == 1 else x.contiguous()
    bias = None if bias is None else bias.contiguous()
    cfg = config or kquant_gemv_config(m, w, x.dtype, target_of(x.device))
    split = cfg.split_k > 1
    dest = out
    if split:
        dest = torch.empty(cfg.split_k * m * n, dtype=torch.float32, device=x.device)
    ptrs, strides = _planes(w)
    launch(
        _kquant_gemv_kernel,
        cfg.grid,
        x,
        *ptrs,
        bias if bias is not None and not split else w.scales,
        dest,
        m,
        n,
        k,
        cfg.k_per_split,
        x.stride(0),
        *strides,
        n,
        m * n,
        FMT=FMT_IDS[w.fmt],
        HAS_BIAS=bias is not None and not split,
        USE_DOT=cfg.use_dot,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        NSUB=cfg.block_k // cfg.tile_group,
        SUBLEN=cfg.tile_group,
        GROUP=KQUANT_BLOCKS[w.fmt][1],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        launch_splitk_reduce(dest, bias, out, cfg.split_k)
    return out


def dequantize_kquant_triton(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] weight in `dtype`, computed in fp32 like `QuantizedWeight.dequantize`."""
    _check_weight(w)
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    nsub, sublen = _tile(w.fmt, k)
    block_n = 32
    ptrs, strides = _planes(w)
    launch(
        _kquant_dequantize_kernel,
        (cdiv(n, block_n), cdiv(k, nsub * sublen)),
        *ptrs,
        out,
        n,
        k,
        *strides,
        out.stride(0),
        FMT=FMT_IDS[w.fmt],
        BLOCK_N=block_n,
        NSUB=nsub,
        SUBLEN=sublen,
        GROUP=KQUANT_BLOCKS[w.fmt][1],
    )
    return out


# row length of each plane per block of G weights: (qweight, scales, mins, qhigh, sub);
# None = the format has no such plane
PLANES = {
    "q5_0": (16, 1, None, 4, None),
    "q5_1": (16, 1, 1, 4, None),
    "q4_k": (128, 1, 1, None, 12),
    "q5_k": (128, 1, 1, 32, 12),
    "q6_k": (128, 1, None, 64, 16),
}


# the planes whose load width compile_check checks, and the width the tiles allow: the code
# plane is read in rows of >= 16 contiguous, 16-byte aligned bytes per tile, q6_k's high bits
# too (64 B per super-block); q5_k's 32 B of high bits per super-block make a [BLOCK_N = 32,
# 32] byte tile, 8 B per thread of 4 warps; q5_0 / q5_1 hold 4 high-bit bytes per block, rows
# only 4-byte aligned (K / 8 bytes) and masked block by block: 4 B
PACKED_ARGS = {
    "q5_0": ("qweight_ptr", "qhigh_ptr"),
    "q5_1": ("qweight_ptr", "qhigh_ptr"),
    "q4_k": ("qweight_ptr",),
    "q5_k": ("qweight_ptr", "qhigh_ptr"),
    "q6_k": ("qweight_ptr", "qhigh_ptr"),
}
MIN_LOAD_BYTES = {"q5_0": 4, "q5_1": 4, "q4_k": 16, "q5_k": 8, "q6_k": 16}


def empty_kquant_weight(fmt: str, n: int, k: int, device: torch.device) -> QuantizedWeight:
    """An uninitialised `fmt` QuantizedWeight [n, k] in the planes of quant.py (meta tensors
    for compile_check; the benchmarks fill them)."""
    g = KQUANT_BLOCKS[fmt][1]
    sub_dtype = torch.int8 if fmt == "q6_k" else torch.uint8
    dtypes = (torch.uint8, torch.float16, torch.float16, torch.uint8, sub_dtype)
    planes = [
        None if per is None else torch.empty(n, k // g * per, dtype=dt, device=device)
        for per, dt in zip(PLANES[fmt], dtypes)
    ]
    q, scales, mins, qhigh, sub = planes
    return QuantizedWeight(fmt, KQUANT_BITS[fmt], g, (n, k), q, scales, mins, qhigh, sub)


def _triton_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None):
    return quant_linear(x, w, bias, backend="triton")


for _fmt in FMT_IDS:
    register_weight_format(
        WeightFormat(
            _fmt,
            partial(empty_kquant_weight, _fmt),
            _triton_linear,
            packed_args=PACKED_ARGS[_fmt],
            min_load_bytes=MIN_LOAD_BYTES[_fmt],
            k_multiple=KQUANT_BLOCKS[_fmt][1],
        )
    )
