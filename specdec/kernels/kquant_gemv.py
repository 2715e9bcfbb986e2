"""Weight-only linear layer for GGUF's 5-bit and k-quant formats (q5_0, q5_1, q4_k, q5_k,
q6_k): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W a QuantizedWeight in the planes that
`quant.py` documents, read as they are.

- Two `@triton.jit` tile helpers decode a K tile; both are exact and tested, and
  `DEFAULT_LAYOUT` picks one per format and row path (`tile_layout()` overrides it):
  "halves" (`_kquant_tile`) decodes it as quant_gemv decodes Q4_1's: two fp32 halves
  [BLOCK_N, BLOCK_K / 2], the low and the high nibbles of the same code bytes, each
  multiplied by its own slice of x. A 2 * HALF-weight period holds HALF code bytes: one
  32-weight block for q5_0 / q5_1 (HALF 16), a 64-weight chunk of two sub-blocks for q4_k /
  q5_k (HALF 32), half a super-block for q6_k (HALF 64). Every code and high-bit byte is
  loaded once and the scales are loaded per period as 2-D tensors and broadcast, so Triton
  lays them out like the codes. "elements" (`_kquant_tile_elements`, the only tile before
  2026-12-06) decodes [BLOCK_N, NSUB, SUBLEN] in element order, gathering bytes per element
  (q4_k's code bytes twice, q6_k's high bits four times). On sm_90 (`compile_check`) the
  q4_k tensor-core tile takes 68-71 registers in halves against 168 in elements under
  triton 3.6 (80-86 against 168 under 3.9: with the 3-D scale loads Triton converted the
  whole fp32 tile to their layout through shared memory), while the q5_0 / q5_1 / q4_k
  broadcast tiles are smaller in elements under 3.6. The halves tile forms the q5_k / q6_k
  high bits with constant shifts joined into the period axis (`tl.join`), not with a shift
  by a period-dependent tensor, which kept triton 3.6 from giving the tensor-core tile the
  operand layout (q5_k 168 -> 96-128 registers, q6_k 185 -> 80-88; 2026-12-06).
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

import re
from contextlib import contextmanager
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
def _k_scale_min(b, s, rows):
    """Six-bit scales and mins of q4_k / q5_k sub-blocks `s` from the 12 packed bytes at `b`
    (get_scale_min_k4 in llama.cpp), [BLOCK_N, NP] fp32."""
    b_s = tl.load(b + s, mask=rows, other=0).to(tl.int32)
    b_s4 = tl.load(b + s + 4, mask=rows, other=0).to(tl.int32)
    b_m4 = tl.load(b + tl.where(s >= 4, s - 4, s), mask=rows, other=0).to(tl.int32)
    sc = tl.where(s < 4, b_s & 63, (b_s4 & 15) | ((b_m4 >> 6) << 4))
    mn = tl.where(s < 4, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,  # 16 (q5_0 / q5_1), 32 (q4_k / q5_k), 64 (q6_k)
    DOT_TILE: tl.constexpr,  # the tile feeds tl.dot or a store, not the broadcast rows
):
    """fp32 weights of one K tile as two halves [BLOCK_N, BLOCK_K // 2], the low and the high
    nibbles of the same code bytes: position p of the low half is element
    (p // HALF) * 2 * HALF + p % HALF of the tile, the high half's is HALF further on. Every
    code byte is loaded once, and the kernels multiply each half by its own slice of x.
    Scales, mins and per-block words are loaded as [BLOCK_N, NP] (NP = periods of 2 * HALF
    weights in the tile) and broadcast over the period's HALF bytes, so Triton lays the
    small tensors out like the code tile rather than converting the tile to theirs (a
    3-D scale load made it move the whole fp32 tile through shared memory).

    Where two decodings of a format compute the same fp32 values, DOT_TILE picks one per
    consumer: the tensor-core tile (and the dequantize kernel's) the one with fewer sm_90
    registers, the broadcast rows the one with fewer instructions in the K loop
    (`compile_check`'s loop_instructions_per_kb)."""
    NP: tl.constexpr = BLOCK_K // (2 * HALF)
    p2 = tl.arange(0, NP)[None, :]  # [1, NP]
    u = tl.arange(0, HALF)[None, None, :]  # [1, 1, HALF]
    n2 = offs_n[:, None].to(tl.int64)  # [BLOCK_N, 1]
    rows2 = mask_n[:, None]
    n = n2[:, :, None]
    rows = rows2[:, :, None]
    q_rows = qweight_ptr + n * stride_qn
    if FMT <= 1:  # q5_0 / q5_1: period p is block blk0 + p; byte u holds elements u, u + 16
        blk2 = blk0 + p2
        ok2 = rows2 & (blk2 * 32 < K)
        qs = tl.load(q_rows + blk2[:, :, None] * 16 + u, mask=ok2[:, :, None], other=0)
        # a block's 4 qh bytes are one little-endian 32-bit word whose bit l is the high bit
        # of element l; rows are 4-byte aligned (K is a multiple of 32). Loading words, not
        # bytes, gives 4-byte loads on every triton (3.6 ignores an alignment hint here and
        # loads bytes)
        h_words = (qhigh_ptr + n2 * stride_hn).to(tl.pointer_type(tl.int32))
        qh = tl.load(h_words + blk2, mask=ok2, other=0)[:, :, None]
        lo = (qs & 0xF).to(tl.int32) | (((qh >> u) & 1) << 4)
        hi = (qs >> 4).to(tl.int32) | (((qh >> (u + 16)) & 1) << 4)
        d = tl.load(scales_ptr + n2 * stride_sn + blk2, mask=ok2, other=0.0).to(tl.float32)
        d = d[:, :, None]
        if FMT == 0 and DOT_TILE:
            w_lo = (lo.to(tl.float32) - 16.0) * d
            w_hi = (hi.to(tl.float32) - 16.0) * d
        else:
            if FMT == 0:  # d * (q - 16) as q * d - 16 d, one fused multiply-add: the same fp32
                # value (a 5-bit code times an fp16 scale, 16 d and their difference are exact
                # in fp32, fused or not); 1.38 -> 1.20x Q4_1's loop instructions per KB at
                # M = 1 on sm_90 under triton 3.6, but 96 -> 102 registers in the tensor-core
                # tile
                mn = -16.0 * d
            else:
                mn = tl.load(mins_ptr + n2 * stride_sn + blk2, mask=ok2, other=0.0)
                mn = mn.to(tl.float32)[:, :, None]
            w_lo = lo.to(tl.float32) * d + mn
            w_hi = hi.to(tl.float32) * d + mn
    elif FMT <= 3:  # q4_k / q5_k: one super-block; period p = 64-weight chunk p, whose byte u
        # holds element u of sub-block 2p (low nibble) and of sub-block 2p + 1 (high)
        d = tl.load(scales_ptr + n2 * stride_sn + blk0, mask=rows2, other=0.0).to(tl.float32)
        dmin = tl.load(mins_ptr + n2 * stride_sn + blk0, mask=rows2, other=0.0).to(tl.float32)
        b = sub_ptr + n2 * stride_un + blk0 * 12
        sc_lo, mn_lo = _k_scale_min(b, 2 * p2, rows2)
        sc_hi, mn_hi = _k_scale_min(b, 2 * p2 + 1, rows2)
        # the sub-block scales are formed as (d * sc) in fp32 first, the order of
        # gguf.quants, so fp32 results match the torch dequantization
        s_lo, m_lo = (d * sc_lo)[:, :, None], (dmin * mn_lo)[:, :, None]
        s_hi, m_hi = (d * sc_hi)[:, :, None], (dmin * mn_hi)[:, :, None]
        qs = tl.load(q_rows + blk0 * 128 + p2[:, :, None] * 32 + u, mask=rows, other=0)
        lo = (qs & 0xF).to(tl.int32)
        hi = (qs >> 4).to(tl.int32)
        if FMT == 3 and DOT_TILE:  # bit s of high-bit byte u: element u of sub-block s, so
            # period p takes bit 2p (low half) and 2p + 1 (high half). Each bit is moved to bit 4
            # by a constant shift and the four periods are joined into the p axis: a shift by a
            # p-dependent tensor kept triton 3.6 from giving the tensor-core tile the operand
            # layout (the bf16 tile went through shared memory: 168 registers on sm_90, 96-128
            # this way), while the broadcast rows take fewer registers with that shift under
            # triton 3.9 (96 against 126), so the kernels choose per row path (DOT_TILE)
            tl.static_assert(NP == 4)
            u2 = tl.arange(0, HALF)[None, :]
            qh = tl.load(qhigh_ptr + n2 * stride_hn + blk0 * 32 + u2, mask=rows2, other=0)
            qh = qh.to(tl.int32)
            # [BLOCK_N, HALF, 2 (p % 2), 2 (p // 2)] -> [BLOCK_N, NP, HALF]
            h_lo = tl.join(
                tl.join((qh << 4) & 16, (qh << 2) & 16), tl.join(qh & 16, (qh >> 2) & 16)
            )
            h_hi = tl.join(
                tl.join((qh << 3) & 16, (qh << 1) & 16), tl.join((qh >> 1) & 16, (qh >> 3) & 16)
            )
            lo = lo | tl.reshape(tl.permute(h_lo, 0, 3, 2, 1), [BLOCK_N, NP, HALF])
            hi = hi | tl.reshape(tl.permute(h_hi, 0, 3, 2, 1), [BLOCK_N, NP, HALF])
        elif FMT == 3:
            qh = tl.load(qhigh_ptr + n * stride_hn + blk0 * 32 + u, mask=rows, other=0)
            qh = qh.to(tl.int32)
            p = p2[:, :, None]
            lo = lo | (((qh >> (2 * p)) & 1) << 4)
            hi = hi | (((qh >> (2 * p + 1)) & 1) << 4)
        w_lo = s_lo * lo.to(tl.float32) - m_lo
        w_hi = s_hi * hi.to(tl.float32) - m_hi
    else:  # q6_k: one super-block; period p = its half p of 128 weights, element j < 64 of
        # it the low nibble of code byte j, element 64 + j the high nibble. The tile is
        # [BLOCK_N, 2, 2, 2, 16] = (p, t, r, v) with j = 32 t + 16 r + v: sub-block (16
        # weights) 8 p + 2 t + r (low) or 4 more (high); high-bit byte 32 p + 16 r + v, its
        # bits 2 t (low) and 2 t + 4 (high), so each byte is loaded once for both t
        t3 = tl.arange(0, 2)[None, None, :]
        r4 = tl.arange(0, 2)[None, None, None, :]
        p4 = p2[:, :, None, None]
        n4 = n2[:, :, None, None]
        rows4 = rows2[:, :, None, None]
        s_row = sub_ptr + n4 * stride_un + blk0 * 16 + p4 * 8 + t3[:, :, :, None] * 2 + r4
        d = tl.load(scales_ptr + n2 * stride_sn + blk0, mask=rows2, other=0.0).to(tl.float32)
        d = d[:, :, None, None]
        s_lo = (d * tl.load(s_row, mask=rows4, other=0).to(tl.float32))[:, :, :, :, None]
        s_hi = (d * tl.load(s_row + 4, mask=rows4, other=0).to(tl.float32))[:, :, :, :, None]
        p5 = p4[:, :, :, :, None]
        t = t3[:, :, :, None, None]
        r = r4[:, :, :, :, None]
        v = tl.arange(0, 16)[None, None, None, None, :]
        n5 = n4[:, :, :, :, None]
        rows5 = rows4[:, :, :, :, None]
        ql_ptr = qweight_ptr + n5 * stride_qn + blk0 * 128 + p5 * 64 + t * 32 + r * 16 + v
        ql = tl.load(ql_ptr, mask=rows5, other=0)
        # the high-bit bytes as [BLOCK_N, 2 (p), 2 (r), 16 (v)]: each t's bit pair is moved to
        # bits 4-5 by a constant shift and the two are joined into the t axis (a shift by the
        # t tensor took 185 registers in the tensor-core tile on sm_90 under triton 3.6, 80
        # this way; as for q5_k above)
        r_h = tl.arange(0, 2)[None, None, :, None]
        v_h = tl.arange(0, 16)[None, None, None, :]
        qh_ptr = qhigh_ptr + n4 * stride_hn + blk0 * 64 + p4 * 32 + r_h * 16 + v_h
        qh = tl.load(qh_ptr, mask=rows4, other=0).to(tl.int32)
        h_lo = tl.permute(tl.join(qh << 4, qh << 2) & 48, 0, 1, 4, 2, 3)
        h_hi = tl.permute(tl.join(qh, qh >> 2) & 48, 0, 1, 4, 2, 3)
        lo = (ql & 0xF).to(tl.int32) | h_lo
        hi = (ql >> 4).to(tl.int32) | h_hi
        w_lo = s_lo * (lo.to(tl.float32) - 32.0)
        w_hi = s_hi * (hi.to(tl.float32) - 32.0)
    w_lo = tl.reshape(w_lo, [BLOCK_N, BLOCK_K // 2])
    w_hi = tl.reshape(w_hi, [BLOCK_N, BLOCK_K // 2])
    return w_lo, w_hi


@triton.jit
def _kquant_tile_elements(
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
    DOT_TILE: tl.constexpr,  # as for _kquant_tile
):
    """fp32 weights [BLOCK_N, NSUB, SUBLEN] of one K tile in element order (the "elements"
    layout): NSUB sub-blocks that each share one scale; q5_0 / q5_1 tiles hold NSUB 32-weight
    blocks, q4_k / q5_k one super-block of 8 x 32, q6_k one super-block of 16 x 16. Code
    bytes are gathered per element (q4_k's twice, q6_k's high bits four times)."""
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
        if FMT == 0 and DOT_TILE:
            w = (q.to(tl.float32) - 16.0) * d
        else:
            if FMT == 0:  # one fused multiply-add, as in _kquant_tile
                mn = -16.0 * d
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
            # bit s of byte l moved to bit 4 as (qh << 4) >> s: the same bits as
            # ((qh >> s) & 1) << 4 in one instruction less (sm_90, triton 3.6: 1.32 -> 1.23x
            # Q4_1's loop instructions per KB at M = 1)
            q = q | (((qh << 4) >> s) & 16)
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
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    SUBLEN: tl.constexpr,  # weights per sub-block scale ("elements" layout)
    HALVES: tl.constexpr,  # the tile layout: True "halves" (_kquant_tile), False "elements"
    GROUP: tl.constexpr,  # weights per block (32 or 256)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # the elements of the tile's low half in the order of its flat [BLOCK_N, BLOCK_K // 2]
    # layout (_kquant_tile); the high half's are HALF further on
    offs_t = tl.arange(0, BLOCK_K // 2)
    x_k = (offs_t // HALF) * (2 * HALF) + offs_t % HALF

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K_PER_SPLIT is a multiple of BLOCK_K: the hint lets every tile's row slices be
    # loaded as aligned vectors
    k_start = tl.multiple_of(pid_k * K_PER_SPLIT, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if HALVES:
            w_lo, w_hi = _kquant_tile(
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
                BLOCK_N,
                BLOCK_K,
                HALF,
                USE_DOT,
            )
            # x is zero beyond K (a q5_* tile may run past the last block)
            xk_lo = k0 + x_k
            xk_hi = xk_lo + HALF
            if USE_DOT:
                x_rows = x_ptr + offs_m[:, None] * stride_xm
                x_lo = tl.load(
                    x_rows + xk_lo[None, :], mask=mask_m[:, None] & (xk_lo < K)[None, :], other=0.0
                )
                x_hi = tl.load(
                    x_rows + xk_hi[None, :], mask=mask_m[:, None] & (xk_hi < K)[None, :], other=0.0
                )
                acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc)
                acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc)
            else:
                for r in tl.static_range(BLOCK_M):
                    x_r = x_ptr + r * stride_xm
                    row_ok = tl.full([BLOCK_K // 2], r, tl.int32) < M
                    x_lo = tl.load(x_r + xk_lo, mask=row_ok & (xk_lo < K), other=0.0)
                    x_hi = tl.load(x_r + xk_hi, mask=row_ok & (xk_hi < K), other=0.0)
                    row = tl.sum(w_lo * x_lo.to(tl.float32)[None, :], axis=1)
                    row += tl.sum(w_hi * x_hi.to(tl.float32)[None, :], axis=1)
                    acc = tl.where(offs_m[:, None] == r, acc + row[None, :], acc)
        else:  # the "elements" layout: one [BLOCK_N, BLOCK_K] tile in element order
            w = _kquant_tile_elements(
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
                BLOCK_K // SUBLEN,
                SUBLEN,
                USE_DOT,
            )
            w = tl.reshape(w, [BLOCK_N, BLOCK_K])
            xk = k0 + tl.arange(0, BLOCK_K)
            if USE_DOT:
                x_mask = mask_m[:, None] & (xk < K)[None, :]
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + xk[None, :]
                x = tl.load(x_ptrs, mask=x_mask, other=0.0)
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
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_TILE: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    mask_n = offs_n < N
    w_lo, w_hi = _kquant_tile(
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
        BLOCK_N,
        BLOCK_K,
        HALF,
        DOT_TILE,
    )
    offs_t = tl.arange(0, BLOCK_K // 2)
    k_lo = k0 + (offs_t // HALF) * (2 * HALF) + offs_t % HALF
    rows = out_ptr + offs_n[:, None].to(tl.int64) * stride_on
    k_hi = k_lo + HALF
    dt = out_ptr.dtype.element_ty
    tl.store(rows + k_lo[None, :], w_lo.to(dt), mask=mask_n[:, None] & (k_lo < K)[None, :])
    tl.store(rows + k_hi[None, :], w_hi.to(dt), mask=mask_n[:, None] & (k_hi < K)[None, :])


# Two tile layouts decode the same weights (both exact, both tested): "halves"
# (`_kquant_tile`: low / high nibbles of each code byte as two halves, each byte loaded once,
# scales per period) and "elements" (`_kquant_tile_elements`: one tile in element order,
# bytes gathered per element). Which one takes fewer registers depends on the format, the
# row path and the triton version, so the default is per (format, path) and per triton
# version: the layout with fewer sm_90 registers (`compile_check`, bf16 / fp16 rows, all
# model shapes, 2026-12-06, results/2026-12-06-kquant-compile-check). Under triton 3.6, the
# lent H200's, the element order is smaller for the q5_0 / q5_1 / q4_k broadcast rows (56-80
# registers against 78-95); under 3.9 it takes 128 there against 72-80 and is smaller only
# for q5_1's tensor-core rows (96 against 96-104). A triton before 3.9 gets 3.6's table, 3.9
# and later 3.9's. `tile_layout()` overrides it for A/B runs.
LAYOUTS = ("halves", "elements")
_ELEMENT_ORDER_ROWS = {
    (3, 6): (("q5_0", "m1"), ("q5_1", "m1"), ("q4_k", "m1")),
    (3, 9): (("q5_1", "dot"),),
}


def default_layouts(triton_version: str) -> dict[tuple[str, str], str]:
    """{(format, "m1" | "dot"): "elements"} for the rows where `triton_version` takes fewer
    registers in element order; every other row uses "halves"."""
    found = re.match(r"(\d+)\.(\d+)", triton_version)
    if found is None:
        raise ValueError(f"cannot read triton version {triton_version!r}")
    table = (3, 6) if (int(found[1]), int(found[2])) < (3, 9) else (3, 9)
    return {row: "elements" for row in _ELEMENT_ORDER_ROWS[table]}


DEFAULT_LAYOUT = default_layouts(triton.__version__)
# M = 1 programs an SM holds (what split-K plans for): 65,536 registers over 4 warps of the
# M = 1 tile's registers on sm_90 under triton 3.6 (halves: q5_0 78, q5_1 80, q4_k 80, q5_k 96,
# q6_k 72; elements: q5_0 56, q5_1 64, q4_k 64-80, q5_k 96-128, q6_k 118; Q4_1: 72)
M1_PROGRAMS_PER_SM = {
    "halves": {"q5_0": 6, "q5_1": 6, "q4_k": 6, "q5_k": 5, "q6_k": 7},
    "elements": {"q5_0": 8, "q5_1": 8, "q4_k": 6, "q5_k": 4, "q6_k": 4},
}
_layout_override: list[str] = []


@contextmanager
def tile_layout(layout: str):
    """Every k-quant GEMV launched inside uses `layout` ("halves" or "elements") instead of
    DEFAULT_LAYOUT's (benchmarks compare the two on a GPU). Not thread-safe."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown k-quant tile layout {layout!r}: one of {LAYOUTS}")
    _layout_override.append(layout)
    try:
        yield
    finally:
        _layout_override.pop()


def layout_for(fmt: str, use_dot: bool) -> str:
    """The tile layout of `fmt` on one row path (tl.dot or broadcast)."""
    if _layout_override:
        return _layout_override[-1]
    return DEFAULT_LAYOUT.get((fmt, "dot" if use_dot else "m1"), "halves")


def _tile_shape(fmt: str, k: int) -> tuple[int, int]:
    """(BLOCK_K, HALF) of a K tile: up to 4 blocks of 32 for q5_* (HALF 16: a block's 16 code
    bytes), one super-block for k-quants (HALF 32: q4_k / q5_k's 64-weight chunks of 32 code
    bytes; 64: q6_k's halves of 64 code bytes)."""
    if fmt in ("q5_0", "q5_1"):
        return 32 * min(4, next_power_of_2(k // 32)), 16
    return 256, 64 if fmt == "q6_k" else 32


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
    pure function of the shapes; keyword arguments override the choice). A K tile of
    block_k weights is read as two halves; tile_group is the period of that split (2 * HALF
    of `_kquant_tile`)."""
    n, k = w.shape
    block_k, half = _tile_shape(w.fmt, k)
    return tiled_gemv_config(
        m,
        n,
        k,
        block_k,
        2 * half,
        x_dtype,
        target,
        block_n=block_n,
        split_k=split_k,
        broadcast_per_sm=M1_PROGRAMS_PER_SM[layout_for(w.fmt, False)][w.fmt],
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
        BLOCK_K=cfg.block_k,
        HALF=cfg.tile_group // 2,
        SUBLEN=16 if w.fmt == "q6_k" else 32,
        HALVES=layout_for(w.fmt, cfg.use_dot) == "halves",
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
    block_k, half = _tile_shape(w.fmt, k)
    block_n = 32
    ptrs, strides = _planes(w)
    launch(
        _kquant_dequantize_kernel,
        (cdiv(n, block_n), cdiv(k, block_k)),
        *ptrs,
        out,
        n,
        k,
        *strides,
        out.stride(0),
        FMT=FMT_IDS[w.fmt],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HALF=half,
        GROUP=KQUANT_BLOCKS[w.fmt][1],
        DOT_TILE=True,  # q5_k: fewer registers in both triton versions (64 against 72, bf16)
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
