"""KV-cache rollback after verification: logical (lengths only) and physical (compaction).

After a verification step the cache holds L_b committed entries plus the T entries of the
verified tokens. If the accepted tokens are a prefix of the new ones (chain drafts),
rollback is logical: the sequence length becomes L_b + n_accepted[b] and the rejected
slots are overwritten next step (`specdec.decode.rollback.rollback_lens`). If they are not (a path through a token
tree), the accepted entries must be moved to the slots right after the prefix:

    k, v        [n_layers, B, Hkv, Lmax, D]  all layers at once, updated in place
    lens        [B]      committed length L_b
    src_pos     [B, A]   int64 source slot of each accepted entry, in sequence order
    n_accepted  [B]      entries of src_pos[b] that are used (<= A; 0 moves nothing)

    for j < n_accepted[b]:  k[:, b, :, L_b + j] = k_old[:, b, :, src_pos[b, j]]  (same for v)

with gather semantics: every source is read before any destination is written, so
overlapping ranges (src [L+1, L+3] -> dst [L, L+1]) and permutations are safe.
Triton kernel: one program per (layer, sequence, KV head) and slice of the head dim loads
all its sources, synchronises its threads, then stores; programs touch disjoint slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.utils import cdiv, launch, next_power_of_2, pick_backend


@triton.jit
def _compact_kv_kernel(
    # pointers
    K,
    V,
    LENS,
    SRC,
    N_ACC,
    # sizes
    B,
    Hkv,
    A,
    D,
    # strides
    stride_kl,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vl,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_sb,
    stride_sa,
    # meta-parameters
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    head = pid % Hkv
    b = (pid // Hkv) % B
    layer = pid // (Hkv * B)

    n_acc = tl.load(N_ACC + b)
    dst0 = tl.load(LENS + b).to(tl.int64)
    offs_a = tl.arange(0, BLOCK_A)
    a_ok = (offs_a < A) & (offs_a < n_acc)
    src = tl.load(SRC + b.to(tl.int64) * stride_sb + offs_a * stride_sa, mask=a_ok, other=0)
    dst = dst0 + offs_a
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = a_ok[:, None] & (offs_d < D)[None, :]

    k_base = K + layer.to(tl.int64) * stride_kl + b.to(tl.int64) * stride_kb + head * stride_kh
    v_base = V + layer.to(tl.int64) * stride_vl + b.to(tl.int64) * stride_vb + head * stride_vh
    k_rows = tl.load(k_base + src[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=ok)
    v_rows = tl.load(v_base + src[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=ok)
    # another thread of this program may store over a slot this thread has yet to read
    tl.debug_barrier()
    tl.store(k_base + dst[:, None] * stride_kn + offs_d[None, :] * stride_kd, k_rows, mask=ok)
    tl.store(v_base + dst[:, None] * stride_vn + offs_d[None, :] * stride_vd, v_rows, mask=ok)


def compact_kv_config(n_entries: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_D): all accepted entries of a head in one tile of <= 4096 elements."""
    block_a = max(2, next_power_of_2(n_entries))
    return block_a, min(next_power_of_2(head_dim), max(16, 4096 // block_a))


def _compact_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    committed_lens: torch.Tensor,
    src_pos: torch.Tensor,
    n_accepted: torch.Tensor,
) -> None:
    n_layers, B, Hkv, _, D = k.shape
    A = src_pos.shape[1]
    block_a, block_d = compact_kv_config(A, D)
    launch(
        _compact_kv_kernel,
        (n_layers * B * Hkv, cdiv(D, block_d)),
        k,
        v,
        committed_lens,
        src_pos,
        n_accepted,
        B,
        Hkv,
        A,
        D,
        *k.stride(),
        *v.stride(),
        *src_pos.stride(),
        BLOCK_A=block_a,
        BLOCK_D=block_d,
        num_warps=4,
    )


def compact_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    committed_lens: torch.Tensor,
    src_pos: torch.Tensor,
    n_accepted: torch.Tensor,
) -> None:
    """Plain torch, same semantics: gather every accepted entry into a temporary, then
    scatter it after the prefix (one host sync for the ragged counts)."""
    A = src_pos.shape[1]
    j = torch.arange(A, device=src_pos.device)
    b_idx, j_idx = (j[None, :] < n_accepted.to(src_pos.device)[:, None]).nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    src = src_pos[b_idx, j_idx]
    dst = committed_lens.to(src_pos.device, torch.long)[b_idx] + j_idx
    for cache in (k, v):
        rows = cache[:, b_idx, :, src]  # [N, n_layers, Hkv, D]: a copy
        cache[:, b_idx, :, dst] = rows


def compact_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    committed_lens: torch.Tensor,
    src_pos: torch.Tensor,
    n_accepted: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Move accepted entries src_pos[b, :n_accepted[b]] to slots committed_lens[b] + j of
    every layer of k and v, in place (see module docstring). Other slots are untouched."""
    if k.dim() != 5 or v.shape != k.shape:
        raise ValueError(
            f"compact_kv: k and v must be [n_layers, B, Hkv, Lmax, D], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    B = k.shape[1]
    if src_pos.dim() != 2 or src_pos.shape[0] != B or src_pos.dtype != torch.int64:
        raise ValueError(
            f"compact_kv: src_pos must be int64 [{B}, A], "
            f"got {src_pos.dtype} {tuple(src_pos.shape)}"
        )
    if committed_lens.shape != (B,) or n_accepted.shape != (B,):
        raise ValueError(
            f"compact_kv: committed_lens and n_accepted must be [{B}], "
            f"got {tuple(committed_lens.shape)} and {tuple(n_accepted.shape)}"
        )
    backend = pick_backend(backend, k.device)
    if src_pos.shape[1] == 0:
        return
    if backend == "torch":
        compact_kv_reference(k, v, committed_lens, src_pos, n_accepted)
    else:
        _compact_kv_triton(k, v, committed_lens, src_pos, n_accepted)
