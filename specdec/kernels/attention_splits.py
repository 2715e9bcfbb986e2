"""How verify_attention splits the KV length across programs, and the merge of the splits.

`attention_config` is the launch plan (row tiles, KV block, number of splits, warps,
stages) as a pure function of the shapes and the target, shared by the launcher in
verify_attention.py and benchmarks/compile_check.py. Each split writes a normalised
partial output and its base-2 log-sum-exp; `merge_splits_kernel` combines them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from specdec.kernels.utils import Target, cdiv, next_power_of_2

MIN_CHUNK_KEYS = 256  # a split reads at least this many keys (GPU default)
MAX_SPLITS = 128


@triton.jit
def program_rows(pid, num_m_blocks, Hkv, T, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Sequence b and tile rows of program `pid` (same mapping in both kernels): row
    r = t * GROUP + g is query t of head kv_head * GROUP + g."""
    m_block = pid % num_m_blocks
    kv_head = (pid // num_m_blocks) % Hkv
    b = pid // (num_m_blocks * Hkv)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T * GROUP
    t = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    return b, t, head, row_ok


@triton.jit
def split_chunk(
    kv_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, FIXED: tl.constexpr
):
    """Keys per split, sized from the sequence's own length (whole KV blocks); FIXED (batch-
    invariant launches): MIN_CHUNK keys, so split s covers the same key slots whatever the
    number of new tokens, the cache's length or the grid."""
    if FIXED:
        return tl.full([], MIN_CHUNK, tl.int32)
    return tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def merge_splits_kernel(
    # pointers
    PART_O,
    PART_LSE,
    LENS,
    OUT,
    # sizes
    T,
    Hkv,
    num_m_blocks,
    num_splits,
    # strides
    stride_pb,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    # meta-parameters
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    FIXED_CHUNK: tl.constexpr,
):
    b, t, head, row_ok = program_rows(tl.program_id(0), num_m_blocks, Hkv, T, GROUP, BLOCK_M)
    kv_len = tl.load(LENS + b).to(tl.int32) + T
    chunk = split_chunk(kv_len, num_splits, BLOCK_N, MIN_CHUNK, FIXED_CHUNK)
    n_used = tl.cdiv(kv_len, chunk)  # splits past n_used were never written
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    lse_ptrs = PART_LSE + b64 * stride_lb + t * stride_lt + head * stride_lh
    o_ptrs = PART_O + b64 * stride_pb + t * stride_pt + head * stride_ph

    # online log-sum-exp over the splits (base 2)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, n_used):
        lse = tl.load(lse_ptrs + s, mask=row_ok, other=float("-inf"))
        o = tl.load(
            o_ptrs[:, None] + s * stride_ps + offs_d[None, :], mask=row_ok[:, None], other=0.0
        )
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        denom = denom * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m_i = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_ptrs = OUT + b64 * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptrs + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=row_ok[:, None]
    )


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of `_verify_attention_kernel` (and the merge) for one shape."""

    block_m: int
    block_n: int
    num_m_blocks: int
    min_chunk: int
    num_splits: int
    num_warps: int
    num_stages: int
    dot_precision: str | None  # None: Triton's default for 16-bit inputs
    dot_fp32: bool  # upcast dot operands (the interpreter mis-multiplies bf16)
    programs: int  # B * Hkv * num_m_blocks: the grid is (programs, num_splits)
    # batch-invariant launch: 16-row tiles, splits of exactly min_chunk keys from slot 0,
    # always merged, every KV block through the masked loop (see attention_config)
    invariant: bool = False
    # products as broadcast sums instead of tl.dot: the interpreter's tl.dot is numpy's BLAS,
    # whose result for a row depends on its place in the tile (rows 6..15 of a 16-row sgemm
    # differ from the same row at row 0 on an AVX2 CPU), so invariant launches there use it
    row_sums: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        return (self.programs, self.num_splits)


def pick_num_splits(target: Target, programs: int, max_kv: int, min_chunk: int) -> int:
    """Enough programs for ~2 waves of SMs, but no split shorter than `min_chunk` keys.
    `max_kv` is an upper bound (Lmax): each sequence sizes its own chunks from its own
    length inside the kernel, so over-provisioned splits exit without work."""
    want = cdiv(2 * target.num_sms, programs)
    return max(1, min(want, cdiv(max_kv, min_chunk), MAX_SPLITS))


def attention_config(
    q_shape: tuple[int, int, int, int],
    n_kv_heads: int,
    max_kv: int,
    dtype: torch.dtype,
    target: Target,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    min_chunk: int | None = None,
    invariant: bool = False,
) -> AttentionConfig:
    """Tiles, splits and launch options for q [B, T, Hq, D] over a cache of `max_kv` slots
    (a pure function of the shapes; keyword arguments override the heuristics; `invariant`:
    `invariant_attention_config`)."""
    B, T, Hq, D = q_shape
    if invariant:
        chunk = min_chunk or INVARIANT_CHUNK_KEYS  # tests pass short chunks
        return invariant_attention_config(q_shape, n_kv_heads, max_kv, dtype, target, chunk)
    if D < 16 or D != next_power_of_2(D):
        raise ValueError(f"verify_attention (triton): head dim must be a power of 2 >= 16, got {D}")
    rows = T * (Hq // n_kv_heads)
    fp32 = dtype == torch.float32
    # 16-bit: 128-row blocks take 8 warps (compile_check under triton 3.6: 4 warps at
    # 128 x 64 reach 255 registers and spill 64-88 B on Qwen2.5's T = 26 trees/chains).
    # fp32 (ieee dot) holds q, the accumulator and both KV tiles in fp32 registers: rows
    # stop at 64, 8 warps, KV blocks of 16 at D = 128 (compile_check: 4 warps or 32-key
    # blocks spill up to ~2.9 KB per thread; these configurations spill nothing)
    block_m = min(64 if (fp32 or D > 128) else 128, max(16, next_power_of_2(rows)))
    num_m_blocks = cdiv(rows, block_m)
    if block_n is None:
        if fp32:
            block_n = 16 if D >= 128 else 32
        else:
            block_n = 32 if D > 128 else 64
    if min_chunk is None:
        min_chunk = max(MIN_CHUNK_KEYS, block_n)
    min_chunk = cdiv(min_chunk, block_n) * block_n
    programs = B * n_kv_heads * num_m_blocks
    if num_splits is None:
        num_splits = pick_num_splits(target, programs, max_kv, min_chunk)
    return AttentionConfig(
        block_m=block_m,
        block_n=block_n,
        num_m_blocks=num_m_blocks,
        min_chunk=min_chunk,
        num_splits=num_splits,
        num_warps=8 if (fp32 or block_m >= 128) else 4,
        num_stages=2 if fp32 else 3,
        dot_precision="ieee" if fp32 else None,
        dot_fp32=dtype == torch.bfloat16 and target.interpreter,
        programs=programs,
    )


INVARIANT_CHUNK_KEYS = 256  # keys per split of a batch-invariant launch


def invariant_attention_config(
    q_shape: tuple[int, int, int, int],
    n_kv_heads: int,
    max_kv: int,
    dtype: torch.dtype,
    target: Target,
    chunk: int = INVARIANT_CHUNK_KEYS,
) -> AttentionConfig:
    """The launch of a batch-invariant forward: a query row at slot p computes the bits a
    one-token decode step at p computes, whatever T, the batch or the cache's length.

    - Tiles of 16 rows, KV blocks of a size fixed by the head dim and dtype, the warps and
      stages of a 16-row tile: a row's tl.dot products and softmax reductions are taken in
      the same tile shapes (rows of a tile do not mix).
    - Split s covers key slots [s * chunk, (s + 1) * chunk) in every launch, and the splits
      are always merged: the heuristic sizes chunks from kv_len = L + T, which differs
      between a verification and the decode step at the same slot.
    - Every KV block goes through the masked loop: the unmasked prefix loop ends at the
      committed length L, which also differs. Keys past a row's slot are masked to exactly
      zero weight (a fully masked block or split leaves the running sums unchanged bit for
      bit), so the extra keys a verification's later rows need add nothing to earlier rows.
    """
    B, T, Hq, D = q_shape
    base = attention_config((1, 1, Hq, D), n_kv_heads, max_kv, dtype, target)
    block_n = base.block_n
    chunk = cdiv(chunk, block_n) * block_n
    num_m_blocks = cdiv(T * (Hq // n_kv_heads), 16)
    programs = B * n_kv_heads * num_m_blocks
    return replace(
        base,
        block_m=16,
        num_m_blocks=num_m_blocks,
        min_chunk=chunk,
        num_splits=cdiv(max_kv, chunk),
        num_warps=8 if dtype == torch.float32 else 4,
        programs=programs,
        invariant=True,
        row_sums=target.interpreter,
    )
