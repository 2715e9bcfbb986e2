"""Weight-only quantized linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W a QuantizedWeight.

Decode and verification run M = 1..16 activation rows through a GEMV kernel that reads the
QuantizedWeight planes (quant.py) as they are, with no repacking:

- Memory-bound: the floor is bytes of packed weights + scales over bandwidth. One program owns
  BLOCK_N output features and one K range (split-K when N alone gives too few programs), and
  computes all M rows from a single read of its weight tile, so M = 16 costs about M = 1.
- A weight tile is [BLOCK_N, TILE_GROUPS, TILE_GROUP / 2] per half: every row reads contiguous
  bytes, each group's scale (and min) is loaded once and broadcast over the group.
- 4-bit: byte j of a group holds elements j and j + G/2, so the low and high nibbles multiply
  two slices of x instead of being interleaved. 8-bit tiles are split into the same two
  halves, so both widths share the accumulation code.
- fp16/bf16 with 2..16 rows use tl.dot (tensor cores, rows padded to 16, weights rounded to
  the activation dtype); M = 1 and fp32 activations multiply each row against the fp32 tile
  and sum (exact fp32).
- Split-K programs write fp32 partials [SPLIT_K, M, N]; a second kernel sums them in a fixed
  order (deterministic, no atomics), adds the bias and casts to the activation dtype.
- M > 16 (prefill): a Triton kernel dequantizes W to the activation dtype, then torch matmul.
- Inside `rows_as_one()` (batch-invariant forwards, `specdec.models.batch_invariant`) a
  call of any M plans its tiles and split-K as every other M does (16-bit rows on a GPU:
  tl.dot tiles planned for 16 rows, M = 1 included; else the broadcast path planned for
  one row; `utils.invariant_gemv_path`), and more than 16 rows run as calls of 16: row r
  of any call then computes the bits a one-row call computes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.kernels import gemv_tuning
from specdec.kernels.dequantize import check_weight, default_block_k, dequantize_triton, tile_group
from specdec.kernels.quant import KQUANT_BLOCKS, QuantizedWeight
from specdec.kernels.utils import (
    Target,
    WeightFormat,
    cdiv,
    invariant_gemv_path,
    launch,
    next_power_of_2,
    pick_backend,
    register_weight_format,
    rows_are_one,
    target_of,
)

MAX_GEMV_ROWS = 16
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def store_gemv_tile(
    acc,
    bias_ptr,
    out_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    out_base,
    stride_om,
    HAS_BIAS: tl.constexpr,
):
    """The GEMV epilogue shared by every weight format: acc [BLOCK_M, BLOCK_N] fp32 (+ bias)
    cast to the output dtype and stored at out_ptr + out_base (a split-K partial's slice)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_offs = out_base + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _quant_gemv_kernel(
    # pointers
    x_ptr,  # [M, K] activations
    qweight_ptr,  # [N, K_PAD] int8 or [N, K_PAD // 2] uint8
    scales_ptr,  # [N, N_GROUPS] fp16
    mins_ptr,  # [N, N_GROUPS] fp16 (HAS_MINS)
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or fp32 partials [SPLIT_K, M, N]
    # sizes
    M,
    N,
    K,
    K_PAD,
    GROUP,
    N_GROUPS,
    K_PER_SPLIT,
    # strides (elements)
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_os,
    # meta-parameters
    BITS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_GROUPS: tl.constexpr,  # groups per K tile: BLOCK_K = TILE_GROUPS * TILE_GROUP
    TILE_GROUP: tl.constexpr,  # elements per scale inside a tile (the block size, per channel)
):
    HALF: tl.constexpr = TILE_GROUP // 2
    BLOCK_K: tl.constexpr = TILE_GROUPS * TILE_GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, TILE_GROUPS)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # element (within a K tile) of the low half of each group: [TILE_GROUPS, HALF]
    tile_k = offs_g[:, None] * TILE_GROUP + tl.arange(0, HALF)[None, :]
    # the same elements flattened in the order of the reshaped [BLOCK_N, BLOCK_K // 2] tile
    offs_t = tl.arange(0, BLOCK_K // 2)
    x_k = (offs_t // HALF) * TILE_GROUP + offs_t % HALF
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = qweight_ptr + offs_n[:, None, None].to(tl.int64) * stride_qn
    s_rows = offs_n[:, None] * stride_sn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K_PER_SPLIT is a multiple of BLOCK_K: the hint makes every 4-bit row slice 16-byte
    # aligned (without it Triton only knows 8 bytes and splits the weight loads in two)
    k_start = tl.multiple_of(pid_k * K_PER_SPLIT, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K_PAD)
    for k0 in range(k_start, k_end, BLOCK_K):
        # one scale (and min) per group of the tile: [BLOCK_N, TILE_GROUPS, 1]
        s_idx = (k0 + offs_g * TILE_GROUP) // GROUP
        s_mask = mask_n[:, None] & (s_idx < N_GROUPS)[None, :]
        d = tl.load(scales_ptr + s_rows + s_idx[None, :], mask=s_mask, other=0.0)
        d = d.to(tl.float32)[:, :, None]
        k_lo = k0 + tile_k
        lo_mask = mask_n[:, None, None] & (k_lo < K_PAD)[None, :, :]
        if BITS == 8:
            hi_mask = mask_n[:, None, None] & (k_lo + HALF < K_PAD)[None, :, :]
            q_lo = tl.load(
                w_rows + k_lo[None], mask=lo_mask, other=0, eviction_policy="evict_first"
            )
            q_hi = tl.load(
                w_rows + (k_lo + HALF)[None], mask=hi_mask, other=0, eviction_policy="evict_first"
            )
            w_lo = q_lo.to(tl.float32) * d
            w_hi = q_hi.to(tl.float32) * d
        else:
            byte = k0 // 2 + offs_g[:, None] * HALF + tl.arange(0, HALF)[None, :]
            q = tl.load(w_rows + byte[None], mask=lo_mask, other=0, eviction_policy="evict_first")
            q_lo = (q & 0xF).to(tl.float32)
            q_hi = (q >> 4).to(tl.float32)
            if HAS_MINS:
                mn = tl.load(mins_ptr + s_rows + s_idx[None, :], mask=s_mask, other=0.0)
                mn = mn.to(tl.float32)[:, :, None]
                w_lo = q_lo * d + mn
                w_hi = q_hi * d + mn
            else:
                w_lo = (q_lo - 8.0) * d
                w_hi = (q_hi - 8.0) * d
        w_lo = tl.reshape(w_lo, [BLOCK_N, BLOCK_K // 2])
        w_hi = tl.reshape(w_hi, [BLOCK_N, BLOCK_K // 2])
        # x is zero beyond K (the padded tail of the last group)
        xk_lo = k0 + x_k
        xk_hi = xk_lo + HALF
        if USE_DOT:
            x_lo_mask = mask_m[:, None] & (xk_lo < K)[None, :]
            x_hi_mask = mask_m[:, None] & (xk_hi < K)[None, :]
            x_lo = tl.load(x_rows + xk_lo[None, :], mask=x_lo_mask, other=0.0)
            x_hi = tl.load(x_rows + xk_hi[None, :], mask=x_hi_mask, other=0.0)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc)
        else:
            # one row at a time, x broadcast into the weight tile's layout
            for r in tl.static_range(BLOCK_M):
                x_r = x_ptr + r * stride_xm
                row_ok = tl.full([BLOCK_K // 2], r, tl.int32) < M
                x_lo = tl.load(x_r + xk_lo, mask=row_ok & (xk_lo < K), other=0.0)
                x_hi = tl.load(x_r + xk_hi, mask=row_ok & (xk_hi < K), other=0.0)
                row = tl.sum(w_lo * x_lo.to(tl.float32)[None, :], axis=1)
                row += tl.sum(w_hi * x_hi.to(tl.float32)[None, :], axis=1)
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
def _splitk_reduce_kernel(
    # pointers
    partial_ptr,  # [SPLIT_K, M * N] fp32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] contiguous
    # sizes
    MN,
    N,
    SPLIT_K,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of `_quant_gemv_kernel` for one problem shape."""

    block_m: int
    block_n: int
    block_k: int
    tile_group: int  # elements that share one scale inside a K tile
    split_k: int
    k_per_split: int  # a multiple of block_k
    use_dot: bool
    grid: tuple[int, int]  # (N tiles, split_k)
    num_warps: int = 4
    num_stages: int = 3


def uses_tensor_cores(m: int, x_dtype: torch.dtype, target: Target) -> bool:
    """tl.dot (tensor cores) for 2..16 fp16/bf16 rows; fp32 rows stay exact in the broadcast
    path; Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584).
    Inside rows_as_one() on a GPU: 16-bit rows of every M, M = 1 included, with the "dot"
    invariant path (`invariant_gemv_path`), none with "broadcast" or in the interpreter."""
    sixteen = x_dtype == torch.float16 or (x_dtype == torch.bfloat16 and not target.interpreter)
    if rows_are_one():
        return sixteen and not target.interpreter and invariant_gemv_path() == "dot"
    return m > 1 and sixteen


def gemv_config(
    m: int,
    w: QuantizedWeight,
    x_dtype: torch.dtype,
    target: Target,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> GemvConfig:
    """Tile sizes and split-K for M rows against `w` on `target`: the device's tuned entry
    for this weight shape and row path where its table has one (`gemv_tuning`), else a pure
    function of the shapes; keyword arguments override either."""
    tuned = None
    if target.device and not target.interpreter:
        # broadcast rows of any M take the one-row entry: each row is then computed exactly
        # as a one-row call computes it (tiled_gemv_config)
        path = "dot" if uses_tensor_cores(m, x_dtype, target) else "m1"
        group = w.group_size or w.k_padded
        tuned = gemv_tuning.lookup(
            target.device,
            w.bits,
            group,
            w.mins is not None,
            w.out_features,
            w.in_features,
            path,
        )
    if tuned is not None:
        block_n = block_n or tuned.block_n
        block_k = block_k or tuned.block_k
        split_k = split_k or tuned.split_k
    block_k = default_block_k(w, block_k)
    cfg = tiled_gemv_config(
        m,
        w.out_features,
        w.k_padded,
        block_k,
        tile_group(w, block_k),
        x_dtype,
        target,
        block_n=block_n,
        split_k=split_k,
    )
    if tuned is None:
        return cfg
    return replace(cfg, num_warps=tuned.num_warps, num_stages=tuned.num_stages)


def tiled_gemv_config(
    m: int,
    n: int,
    k: int,
    block_k: int,
    tile_group: int,
    x_dtype: torch.dtype,
    target: Target,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    broadcast_per_sm: int = 8,
) -> GemvConfig:
    """The GemvConfig of an [n, k] weight read in K tiles of `block_k` (the rules both GEMV
    kernel files share); `broadcast_per_sm` is how many M = 1 programs an SM holds."""
    if not 1 <= m <= MAX_GEMV_ROWS:
        raise ValueError(f"the GEMV kernel takes 1..{MAX_GEMV_ROWS} rows, got {m}")
    use_dot = uses_tensor_cores(m, x_dtype, target)
    if block_n is None:
        # broadcast path: a [BLOCK_N, BLOCK_K / 2] fp32 product of 4096 elements per row
        block_n = 32 if use_dot else 8192 // block_k
        if target.interpreter:  # cost is per program, numpy vectorizes tiles
            block_n = 1024
        block_n = min(block_n, max(16, next_power_of_2(n)))
    n_tiles, k_tiles = cdiv(n, block_n), cdiv(k, block_k)
    if split_k is None:
        # programs per SM: tl.dot tiles are software-pipelined num_stages deep, the broadcast
        # path (M = 1) keeps one K tile in flight per program, so its grid must fill every
        # resident slot (8 programs of 4 warps at 64 registers); the fp32 partials stay
        # small enough to live in L2
        # (the broadcast path plans every M as M = 1: its rows are independent, so with the
        # same tiles and split a row of a verification computes the bits of a decode step,
        # which greedy speculative decoding needs to stay token-identical to plain decoding)
        # (inside rows_as_one() tl.dot rows are planned as 16, every M alike)
        per_sm = 4 if use_dot else broadcast_per_sm
        rows = (MAX_GEMV_ROWS if rows_are_one() else m) if use_dot else 1
        split_k = min(k_tiles, per_sm * target.num_sms // n_tiles, (4 << 20) // (4 * rows * n))
    split_k = max(1, min(split_k, k_tiles))
    tiles_per_split = cdiv(k_tiles, split_k)
    split_k = cdiv(k_tiles, tiles_per_split)
    return GemvConfig(
        block_m=16 if use_dot else next_power_of_2(m),
        block_n=block_n,
        block_k=block_k,
        tile_group=tile_group,
        split_k=split_k,
        k_per_split=tiles_per_split * block_k,
        use_dot=use_dot,
        grid=(n_tiles, split_k),
    )


def launch_quant_gemv(
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemvConfig | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T (+ bias) for M <= 16; `workspace` holds the fp32 split-K
    partials (at least [split_k, M, N] elements; allocated when None)."""
    m, k = x.shape
    n = w.out_features
    check_weight(w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if out.shape != (m, n) or out.stride() != (n, 1) or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    cfg = config or gemv_config(m, w, x.dtype, target_of(x.device))
    split = cfg.split_k > 1
    if split:
        if workspace is None:
            workspace = torch.empty(cfg.split_k * m * n, dtype=torch.float32, device=x.device)
        dest = workspace
    else:
        dest = out
    mins = w.mins if w.mins is not None else w.scales
    launch(
        _quant_gemv_kernel,
        cfg.grid,
        x,
        w.qweight,
        w.scales,
        mins,
        bias if bias is not None else w.scales,
        dest,
        m,
        n,
        k,
        w.k_padded,
        w.group_size,
        w.scales.shape[1],
        cfg.k_per_split,
        x.stride(0),
        w.qweight.stride(0),
        w.scales.stride(0),
        n,
        m * n,
        BITS=w.bits,
        HAS_MINS=w.mins is not None,
        HAS_BIAS=bias is not None and not split,
        USE_DOT=cfg.use_dot,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TILE_GROUPS=cfg.block_k // cfg.tile_group,
        TILE_GROUP=cfg.tile_group,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        launch_splitk_reduce(workspace, bias, out, cfg.split_k)
    return out


def launch_splitk_reduce(
    workspace: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split_k: int
) -> None:
    """out[M, N] = sum of the fp32 partials workspace[:split_k * M * N] (+ bias), in order."""
    m, n = out.shape
    block = 1024
    launch(
        _splitk_reduce_kernel,
        (cdiv(m * n, block),),
        workspace,
        bias if bias is not None else out,
        out,
        m * n,
        n,
        split_k,
        HAS_BIAS=bias is not None,
        BLOCK=block,
    )


def quant_linear_reference(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain torch: dequantize to fp32, fp32 matmul, bias added in fp32, output in x's dtype."""
    y = x.float() @ w.dequantize(torch.float32).t()  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quant_linear(
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """x[..., K] @ W^T (+ bias) -> [..., N] in x's dtype, on the backend `resolve_backend` picks.

    Triton: GEMV kernel for up to 16 rows (leading dims flattened); more rows dequantize W to
    x's dtype with a Triton kernel and use torch's matmul (bias then added in x's dtype), or,
    inside rows_as_one(), run as GEMV calls of 16 rows.
    """
    backend = pick_backend(backend, x.device)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be fp32, fp16 or bf16, got {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.device}")
    if backend == "torch":
        return quant_linear_reference(x, w, bias)
    gemv, dequantize = launch_quant_gemv, dequantize_triton
    if w.fmt in KQUANT_BLOCKS:  # 5-bit and k-quant GGUF formats: their own kernels
        from specdec.kernels.kquant_gemv import dequantize_kquant_triton, launch_kquant_gemv

        gemv, dequantize = launch_kquant_gemv, dequantize_kquant_triton

    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)  # [M, K]
    m = x2d.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    if m <= MAX_GEMV_ROWS:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        gemv(x2d, w, bias, out)
    elif rows_are_one():
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        for r in range(0, m, MAX_GEMV_ROWS):
            gemv(x2d[r : r + MAX_GEMV_ROWS], w, bias, out[r : r + MAX_GEMV_ROWS])
    else:
        w_dq = dequantize(w, x.dtype)  # [N, K]
        out = F.linear(x2d, w_dq, None if bias is None else bias.to(x.dtype))
    return out.view(*lead, n)


def _empty_weight(fmt: str, bits: int, group: int | None, has_mins: bool):
    """(out, in, device) -> an uninitialised QuantizedWeight (meta tensors for compile_check);
    group None means one group per row (int8 per channel)."""

    def make(n: int, k: int, device: torch.device) -> QuantizedWeight:
        g = group or k
        k_pad = cdiv(k, g) * g
        codes = (n, k_pad) if bits == 8 else (n, k_pad // 2)
        q = torch.empty(codes, dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
        scales = torch.empty(n, k_pad // g, dtype=torch.float16, device=device)
        mins = torch.empty_like(scales) if has_mins else None
        return QuantizedWeight(fmt, bits, g, (n, k), q, scales, mins)

    return make


def _triton_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None):
    return quant_linear(x, w, bias, backend="triton")


for _name, _fmt, _bits, _group, _mins in [
    ("q8_0", "q8_0", 8, 32, False),
    ("q4_0", "q4_0", 4, 32, False),
    ("q4_1", "q4_1", 4, 32, True),
    ("int8", "int8", 8, None, False),
    ("int4-g32", "int4", 4, 32, True),
    ("int4-g64", "int4", 4, 64, True),
    ("int4-g128", "int4", 4, 128, True),
]:
    register_weight_format(
        WeightFormat(_name, _empty_weight(_fmt, _bits, _group, _mins), _triton_linear)
    )
