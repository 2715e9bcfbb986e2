"""Attention of T new tokens per sequence over a static KV cache (decode and verification).

    q        [B, T, Hq, D]        T = 1 for decode, k + 1 to verify k drafted tokens
    k_cache  [B, Hkv, Lmax, D]    one layer; any strides (last dim contiguous is fastest)
    v_cache  [B, Hkv, Lmax, D]
    lens     [B]                  committed keys before the new tokens (L_b)
    out      [B, T, Hq, D]        in q.dtype

The new tokens' keys and values are already in the cache at slots L_b .. L_b + T - 1.
Query i of sequence b sits at position L_b + i and sees keys 0 .. L_b + i (causal), or,
with `tree_mask` [B, T] int64, keys 0 .. L_b - 1 plus the new tokens j whose bit j is set
in tree_mask[b, i] (token trees, T <= 64). A query that sees no key at all returns zeros.
GQA: query head h reads KV head h // (Hq // Hkv). Softmax is computed in fp32.

Triton kernel (flash-decoding): one program owns the T x group query rows that share one
KV head, so the KV tile loaded once serves every query of the group (T x group rows in a
tl.dot tile). The KV length is split across programs (also for T > 1): each split writes a
normalised partial output and its log-sum-exp, and a second kernel merges the splits.
Caller's contract, not checked on the Triton path (it would cost a device sync):
L_b + T <= Lmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specdec.kernels.attention_splits import (
    AttentionConfig,
    attention_config,
    merge_splits_kernel,
    program_rows,
    split_chunk,
)
from specdec.kernels.utils import launch, pick_backend, target_of

LOG2E = 1.4426950408889634
MAX_TREE_TOKENS = 64


@triton.jit
def _online_softmax_update(
    s,  # [BLOCK_M, BLOCK_N] scores of one KV block, base 2 (-inf where masked)
    v,  # [BLOCK_N, BLOCK_D]
    m_i,  # [BLOCK_M] running max
    l_i,  # [BLOCK_M] running sum of exp2(s - m_i)
    acc,  # [BLOCK_M, BLOCK_D] running unnormalised output
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # some rows may have seen no key yet (their max is -inf)
    ROW_SUMS: tl.constexpr = False,  # p v as a broadcast sum (AttentionConfig.row_sums)
):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ROW_SUMS:
        pv = tl.sum(p.to(v.dtype)[:, :, None].to(tl.float32) * v[None, :, :].to(tl.float32), 1)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _verify_attention_kernel(
    # pointers
    Q,
    K,
    V,
    LENS,
    TREE,
    OUT,
    PART_O,
    PART_LSE,
    # sizes
    T,
    Hkv,
    num_m_blocks,
    num_splits,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    # strides
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pb,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_tb,
    # meta-parameters
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    HAS_TREE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast dot operands: Triton's interpreter mis-multiplies bf16
    INVARIANT: tl.constexpr,  # batch-invariant launch (attention_splits.invariant_attention_config)
    ROW_SUMS: tl.constexpr,  # products as broadcast sums (AttentionConfig.row_sums)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = (pid // num_m_blocks) % Hkv
    b, t, head, row_ok = program_rows(pid, num_m_blocks, Hkv, T, GROUP, BLOCK_M)

    L = tl.load(LENS + b).to(tl.int32)
    kv_len = L + T
    # the merge sizes them alike
    chunk = split_chunk(kv_len, num_splits, BLOCK_N, MIN_CHUNK, INVARIANT)
    start = split * chunk  # splits past kv_len run no iteration and store nothing
    end = tl.minimum(start + chunk, kv_len)
    offs_d = tl.arange(0, BLOCK_D)

    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    if HAS_TREE:
        tree = tl.load(TREE + b64 * stride_tb + t, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # full blocks inside the committed prefix: every row sees every key, no masks
    # (none in a batch-invariant launch: where the prefix ends depends on L, and a block must
    # take the same path in a verification and in the decode step at a row's slot)
    n_prefix = tl.maximum(tl.minimum(end, L) - start, 0)
    prefix_end = start + (n_prefix // BLOCK_N) * BLOCK_N
    if INVARIANT:
        prefix_end = start
    for n0 in range(start, prefix_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_t = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        if DOT_FP32:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION, False)

    # the rest: partial prefix block, the new tokens (causal or tree rule), the ragged end
    for n0 in range(prefix_end, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_kv = offs_n < end  # never read slots past L + T: they may hold garbage
        k_t = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=in_kv[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=in_kv[:, None],
            other=0.0,
        )
        if DOT_FP32:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        if ROW_SUMS:
            s = tl.sum(q.to(tl.float32)[:, :, None] * k_t.to(tl.float32)[None, :, :], 1) * qk_scale
        else:
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if HAS_TREE:
            j = tl.minimum(tl.maximum(offs_n - L, 0), 63).to(tl.int64)
            bit = (tree[:, None] >> j[None, :]) & 1
            visible = (offs_n[None, :] < L) | (bit != 0)
        else:
            visible = offs_n[None, :] <= (L + t)[:, None]
        visible = visible & in_kv[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION, True, ROW_SUMS)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        # a vector compare: the interpreter turns a scalar bool into int32 when broadcast
        store_ok = row_ok & ((start + tl.zeros([BLOCK_M], dtype=tl.int32)) < kv_len)
        row_off = b64 * stride_pb + t * stride_pt + head * stride_ph + split * stride_ps
        tl.store(PART_O + row_off[:, None] + offs_d[None, :], o, mask=store_ok[:, None])
        lse_off = b64 * stride_lb + t * stride_lt + head * stride_lh + split
        tl.store(PART_LSE + lse_off, lse, mask=store_ok)
    else:
        o_ptrs = OUT + b64 * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            o_ptrs + offs_d[None, :] * stride_od,
            o.to(OUT.dtype.element_ty),
            mask=row_ok[:, None],
        )


def _verify_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None,
    *,
    config: AttentionConfig | None = None,
    invariant: bool = False,
    **overrides: int,
) -> torch.Tensor:
    """Launcher. `config` (or `overrides` of attention_config: num_splits, block_n,
    min_chunk; tests use them to force several splits on short caches) replaces the
    heuristics."""
    B, T, Hq, D = q.shape
    Hkv, Lmax = k_cache.shape[1], k_cache.shape[2]
    cfg = config or attention_config(
        q.shape, Hkv, Lmax, q.dtype, target_of(q.device), invariant=invariant, **overrides
    )
    out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    lens = cache_lens.contiguous()
    tree = tree_mask.contiguous() if tree_mask is not None else lens  # dummy when unused
    split = cfg.num_splits > 1 or cfg.invariant  # an invariant launch always merges
    if split:
        part_o = torch.empty(B, T, Hq, cfg.num_splits, D, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(B, T, Hq, cfg.num_splits, device=q.device, dtype=torch.float32)
    else:
        part_o, part_lse = out, out  # unused
    launch(
        _verify_attention_kernel,
        cfg.grid,
        q,
        k_cache,
        v_cache,
        lens,
        tree,
        out,
        part_o,
        part_lse,
        T,
        Hkv,
        cfg.num_m_blocks,
        cfg.num_splits,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *(part_o.stride()[:4] if split else (0, 0, 0, 0)),
        *(part_lse.stride()[:3] if split else (0, 0, 0)),
        tree.stride(0) if tree_mask is not None else 0,
        GROUP=Hq // Hkv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=D,
        MIN_CHUNK=cfg.min_chunk,
        HAS_TREE=tree_mask is not None,
        SPLIT=split,
        DOT_PRECISION=cfg.dot_precision,
        DOT_FP32=cfg.dot_fp32,
        INVARIANT=cfg.invariant,
        ROW_SUMS=cfg.row_sums,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        launch(
            merge_splits_kernel,
            (cfg.programs,),
            part_o,
            part_lse,
            lens,
            out,
            T,
            Hkv,
            cfg.num_m_blocks,
            cfg.num_splits,
            *part_o.stride()[:4],
            *part_lse.stride()[:3],
            *out.stride(),
            GROUP=Hq // Hkv,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=D,
            MIN_CHUNK=cfg.min_chunk,
            FIXED_CHUNK=cfg.invariant,
            num_warps=cfg.num_warps,
        )
    return out


def verify_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, same semantics: explicit visibility mask and softmax, computed in fp32
    (or in the input dtype if it is wider, e.g. float64 for tests)."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdt = torch.promote_types(q.dtype, torch.float32)
    lens = cache_lens.to(device=q.device, dtype=torch.long)
    n_keys = int(lens.max()) + T
    if n_keys > k_cache.shape[2]:
        raise ValueError(f"cache_lens + T = {n_keys} exceeds the cache length {k_cache.shape[2]}")

    pos = torch.arange(n_keys, device=q.device)  # key slots
    qpos = lens[:, None] + torch.arange(T, device=q.device)  # [B, T]
    if tree_mask is None:
        visible = pos[None, None, :] <= qpos[:, :, None]  # [B, T, n_keys]
    else:
        bits = torch.arange(T, device=q.device)
        ancestors = ((tree_mask[:, :, None] >> bits) & 1).bool()  # [B, T, T]
        j = (pos[None, :] - lens[:, None]).clamp(0, T - 1)  # [B, n_keys] new-token index
        is_new = (pos[None, :] >= lens[:, None]) & (pos[None, :] < qpos[:, -1:] + 1)
        tree_vis = torch.gather(ancestors, 2, j[:, None, :].expand(B, T, n_keys))
        visible = (pos[None, None, :] < lens[:, None, None]) | (tree_vis & is_new[:, None, :])
    in_kv = pos[None, :] < lens[:, None] + T  # [B, n_keys]: slots past L + T are never read

    k = k_cache[:, :, :n_keys].to(cdt)
    v = v_cache[:, :, :n_keys].to(cdt)
    if not bool(in_kv.all()):  # shorter sequences: zero their slots past L_b + T
        k = torch.where(in_kv[:, None, :, None], k, 0.0)
        v = torch.where(in_kv[:, None, :, None], v, 0.0)
    qg = q.to(cdt).reshape(B, T, Hkv, group, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    s = torch.einsum("bhgtd,bhnd->bhgtn", qg, k) * scale
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    denom = p.sum(-1, keepdim=True)
    o = torch.einsum("bhgtn,bhnd->bhgtd", p, v) / torch.where(denom > 0, denom, 1.0)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    tree_mask: torch.Tensor | None = None,
    backend: str | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] over cache slots 0 .. cache_lens[b] + T - 1 (see module
    docstring). backend: None follows resolve_backend; "triton" or "torch" forces one.
    invariant (Triton): the batch-invariant launch, in which the row of query t computes the
    bits of a one-token call at its slot (causal rows; a tree row reads its ancestors at
    other slots than the decode step does and is not covered)."""
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"verify_attention: q must be [B, T, Hq, D] and k/v caches [B, Hkv, Lmax, D], "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, T, Hq, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D or Hq % k_cache.shape[1] != 0:
        raise ValueError(
            f"verify_attention: q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"verify_attention: q, k_cache, v_cache dtypes differ: "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if cache_lens.shape != (B,) or cache_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"verify_attention: cache_lens must be int32/int64 [{B}], "
            f"got {cache_lens.dtype} {tuple(cache_lens.shape)}"
        )
    if tree_mask is not None:
        if T > MAX_TREE_TOKENS:
            raise ValueError(f"verify_attention: tree masks hold at most 64 tokens, got T={T}")
        if tree_mask.shape != (B, T) or tree_mask.dtype != torch.int64:
            raise ValueError(
                f"verify_attention: tree_mask must be int64 [{B}, {T}], "
                f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
            )
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    if pick_backend(backend, q.device) == "torch":
        return verify_attention_reference(
            q, k_cache, v_cache, cache_lens, scale=scale, tree_mask=tree_mask
        )
    return _verify_attention_triton(
        q, k_cache, v_cache, cache_lens, scale, tree_mask, invariant=invariant
    )
