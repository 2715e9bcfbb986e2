"""KV compaction (Triton; interpreter on CPU) and logical rollback.

Expected caches are built entry by entry from a snapshot, so the torch reference is
checked too; a copy is exact, so results must be bit-identical and every slot outside the
destinations unchanged.
"""

from __future__ import annotations

import pytest
import torch

from specdec.decode.rollback import rollback_lens
from specdec.errors import BackendError
from specdec.kernels.kv_rollback import compact_kv, compact_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GARBAGE = 10**9  # unused src_pos entries: must never be read
BACKENDS = ["triton", "torch"]


def make_cache(n_layers, B, Hkv, lmax, D, dtype, *, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * D if strided else D  # strided: the head dim is a slice of a wider tensor
    k = torch.randn(n_layers, B, Hkv, lmax, width, generator=g).to(DEVICE, dtype)[..., :D]
    v = torch.randn(n_layers, B, Hkv, lmax, width, generator=g).to(DEVICE, dtype)[..., :D]
    return k, v


def expected(k, v, lens, src_pos, n_accepted):
    """Snapshot, then copy entry by entry from the snapshot."""
    k_new, v_new = k.clone(), v.clone()
    for b in range(k.shape[1]):
        for j in range(int(n_accepted[b])):
            src, dst = int(src_pos[b, j]), int(lens[b]) + j
            k_new[:, b, :, dst] = k[:, b, :, src]
            v_new[:, b, :, dst] = v[:, b, :, src]
    return k_new, v_new


def pad_src(rows, A):
    return torch.tensor([r + [GARBAGE] * (A - len(r)) for r in rows], device=DEVICE)


# (lens, accepted source slots per sequence, A): overlapping ranges, different counts per
# sequence, nothing accepted, a permutation (gather semantics), a prefix already in place
CASES = {
    "overlap": ([5], [[6, 8]], 2),
    "ragged": ([3, 10, 0, 7], [[4, 5, 7], [], [2], [8, 9, 11, 14]], 6),
    "none": ([4, 2], [[], []], 3),
    "swap": ([6, 1], [[7, 6], [3, 2, 1]], 3),
    "in_place": ([2], [[2, 3, 6]], 4),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "n_layers, Hkv, D, dtype, strided",
    [(3, 2, 64, torch.float16, False), (2, 3, 128, torch.bfloat16, True)],
)
def test_compact_kv(case, n_layers, Hkv, D, dtype, strided, backend):
    lens_list, rows, A = CASES[case]
    B = len(lens_list)
    k, v = make_cache(n_layers, B, Hkv, 24, D, dtype, strided=strided)
    lens = torch.tensor(lens_list, device=DEVICE)
    n_acc = torch.tensor([len(r) for r in rows], device=DEVICE)
    src = pad_src(rows, A)
    want_k, want_v = expected(k, v, lens, src, n_acc)
    compact_kv(k, v, lens, src, n_acc, backend=backend)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_random_tree_paths_fp32():
    """Paths through random token trees: increasing slots after the prefix, root first."""
    g = torch.Generator().manual_seed(1)
    n_layers, B, Hkv, D, T = 4, 5, 2, 64, 9
    k, v = make_cache(n_layers, B, Hkv, 40, D, torch.float32, seed=1)
    lens = torch.randint(0, 30, (B,), generator=g)
    n_acc = torch.randint(0, T + 1, (B,), generator=g)
    rows = []
    for b in range(B):
        rest = sorted(torch.randperm(T - 1, generator=g)[: max(int(n_acc[b]) - 1, 0)].tolist())
        path = [0] + [1 + i for i in rest] if n_acc[b] > 0 else []
        rows.append([int(lens[b]) + i for i in path])
    lens, n_acc, src = lens.to(DEVICE), n_acc.to(DEVICE), pad_src(rows, T)
    want_k, want_v = expected(k, v, lens, src, n_acc)
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_reference(k_ref, v_ref, lens, src, n_acc)
    compact_kv(k, v, lens.int(), src, n_acc.int(), backend="triton")  # int32 lengths too
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(k_ref, want_k) and torch.equal(v_ref, want_v)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k = torch.randn(1, 1, 1, 8, 16)
    with pytest.raises(BackendError):
        compact_kv(k, k.clone(), torch.tensor([1]), torch.tensor([[2]]), torch.tensor([1]),
                   backend="triton")  # fmt: skip


def test_rollback_lens():
    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    out = rollback_lens(lens, torch.tensor([3, 1, 0]))
    assert out.dtype == torch.int32 and out.tolist() == [8, 1, 9]
    assert lens.tolist() == [5, 0, 9]
    assert rollback_lens(lens, 2).tolist() == [7, 2, 11]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama8b_cache_gpu():
    n_layers, B, Hkv, lmax, D, T = 32, 8, 8, 2048, 128, 9
    k, v = make_cache(n_layers, B, Hkv, lmax, D, torch.bfloat16, seed=2)
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(0, lmax - T, (B,), generator=g)
    n_acc = torch.randint(4, T, (B,), generator=g)
    rows = [
        [int(lens[b]) + i for i in sorted(torch.randperm(T, generator=g)[: n_acc[b]].tolist())]
        for b in range(B)
    ]
    lens, n_acc, src = lens.to(DEVICE), n_acc.to(DEVICE), pad_src(rows, T)
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_reference(k_ref, v_ref, lens, src, n_acc)
    compact_kv(k, v, lens, src, n_acc)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
