"""verify_attention (Triton; interpreter on CPU) against a float64 torch reference.

Cache slots past L_b + T are NaN in every case: a kernel that reads them leaks NaN into
the output. The reference itself is checked against a per-row loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.errors import BackendError
from specdec.kernels import verify_attention as va
from specdec.kernels.attention_splits import MIN_CHUNK_KEYS, attention_config
from specdec.kernels.utils import Target, target_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {  # (atol, rtol) against float64
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# tiny KV blocks and chunks so short caches span several blocks and several splits
SMALL = dict(block_n=16, min_chunk=16)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_case(B, T, Hq, Hkv, D, lens, dtype, *, layout="plain", seed=0):
    """q [B, T, Hq, D], caches [B, Hkv, Lmax, D] with NaN in every slot >= L_b + T."""
    g = torch.Generator().manual_seed(seed)
    lmax = max(lens) + T + 7
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, Hkv, lmax, D, generator=g)
    v = torch.randn(B, Hkv, lmax, D, generator=g)
    for b, L in enumerate(lens):
        k[b, :, L + T :] = float("nan")
        v[b, :, L + T :] = float("nan")
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    if layout == "layers":  # one layer of a [n_layers, B, Hkv, Lmax, D] cache
        k = torch.stack([torch.randn_like(k), k, torch.randn_like(k)])[1]
        v = torch.stack([torch.randn_like(v), v, torch.randn_like(v)])[1]
    elif layout == "token_major":  # [B, Lmax, Hkv, D] storage seen as [B, Hkv, Lmax, D]
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
        q = torch.cat([q, torch.randn_like(q)], -1)[..., :D]  # q strided too
    return q, k, v, torch.tensor(lens, device=DEVICE)


def random_tree_mask(B, T, seed=0):
    """Ancestor masks of random trees over T new tokens: token 0 is the root, token i's
    parent is a random earlier token; bit j of row i is set iff j is i or an ancestor."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        rows = [1]
        for i in range(1, T):
            parent = int(torch.randint(0, i, (1,), generator=g))
            rows.append(rows[parent] | (1 << i))
        mask[b] = torch.tensor(rows)
    return mask.to(DEVICE)


def reference64(q, k, v, lens, tree_mask=None):
    return va.verify_attention_reference(
        q.double(), k.double(), v.double(), lens, tree_mask=tree_mask
    )


def assert_matches(out, ref, dtype):
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def loop_attention(q, k, v, lens, tree_mask=None):
    """One query row at a time in float64: the definition, spelled out."""
    B, T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        for i in range(T):
            if tree_mask is None:
                keys = list(range(L + i + 1))
            else:
                bits = int(tree_mask[b, i])
                keys = list(range(L)) + [L + j for j in range(T) if bits >> j & 1]
            if not keys:
                continue
            for h in range(Hq):
                kk = k[b, h // group, keys].double().cpu()
                vv = v[b, h // group, keys].double().cpu()
                w = torch.softmax(kk @ q[b, i, h].double().cpu() / math.sqrt(D), 0)
                out[b, i, h] = w @ vv
    return out


# (B, T, Hq, Hkv, D, lens): L = 1, L = 0, L not a multiple of the KV block, T = 1 / 5 / 9 /
# 17 (two row tiles of 128 with group 8), GQA group 1 / 3 / 4 / 8, mixed lengths
SHAPES = [
    (1, 1, 4, 4, 64, [1]),
    (2, 5, 6, 2, 64, [37, 0]),
    (3, 9, 8, 2, 64, [20, 5, 48]),
    (2, 9, 8, 1, 128, [33, 17]),
    (1, 17, 8, 1, 64, [10]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-Hq{}-Hkv{}-D{}-L{}".format(*s))
def test_split_kv_matches_reference(shape, dtype):
    B, T, Hq, Hkv, D, lens = shape
    q, k, v, cl = make_case(B, T, Hq, Hkv, D, lens, dtype)
    out = va._verify_attention_triton(q, k, v, cl, D**-0.5, None, num_splits=3, **SMALL)
    assert_matches(out, reference64(q, k, v, cl), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_counts(num_splits):
    # 5 splits over 42 keys in chunks of 16: two programs per head find nothing to do
    q, k, v, cl = make_case(2, 5, 8, 2, 64, [37, 12], torch.float16, seed=1)
    out = va._verify_attention_triton(q, k, v, cl, 0.1, None, num_splits=num_splits, **SMALL)
    ref = va.verify_attention_reference(q.double(), k.double(), v.double(), cl, scale=0.1)
    assert_matches(out, ref, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["plain", "layers", "token_major"])
def test_public_function(layout, dtype):
    q, k, v, cl = make_case(2, 9, 8, 2, 128, [21, 3], dtype, layout=layout, seed=2)
    out = va.verify_attention(q, k, v, cl, backend="triton")
    assert_matches(out, reference64(q, k, v, cl), dtype)


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float32, (2, 9, 8, 2, 64, [21, 0])),
        (torch.float16, (2, 9, 4, 4, 64, [16, 5])),
        (torch.bfloat16, (1, 5, 8, 1, 128, [30])),
    ],
)
def test_tree_mask(dtype, shape):
    B, T, Hq, Hkv, D, lens = shape
    q, k, v, cl = make_case(B, T, Hq, Hkv, D, lens, dtype, seed=3)
    tree = random_tree_mask(B, T, seed=3)
    out = va._verify_attention_triton(q, k, v, cl, D**-0.5, tree, num_splits=2, **SMALL)
    assert_matches(out, reference64(q, k, v, cl, tree), dtype)


def test_chain_tree_equals_causal():
    q, k, v, cl = make_case(2, 5, 4, 2, 64, [9, 0], torch.float32, seed=4)
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(5)], device=DEVICE).repeat(2, 1)
    a = va.verify_attention(q, k, v, cl.int(), tree_mask=chain, backend="triton")
    b = va.verify_attention(q, k, v, cl.int(), backend="triton")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_query_seeing_nothing_gets_zeros():
    q, k, v, cl = make_case(1, 3, 4, 2, 64, [0], torch.float32, seed=5)
    tree = torch.tensor([[1, 0, 0b101]], device=DEVICE)  # row 1 sees no key at all
    out = va._verify_attention_triton(q, k, v, cl, 0.125, tree, num_splits=2, **SMALL)
    ref = va.verify_attention_reference(q, k, v, cl, scale=0.125, tree_mask=tree)
    assert (out[0, 1] == 0).all() and (ref[0, 1] == 0).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_reference_matches_loop(tree):
    B, T = 2, 5
    q, k, v, cl = make_case(B, T, 6, 2, 16, [7, 0], torch.float64, seed=6)
    mask = random_tree_mask(B, T, seed=6) if tree else None
    out = va.verify_attention(q, k, v, cl, tree_mask=mask, backend="torch")
    torch.testing.assert_close(out.cpu(), loop_attention(q, k, v, cl, mask))


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(BackendError):
        va.verify_attention(q, k, v, torch.tensor([2]), backend="triton")


def test_bad_head_dim_raises():
    q, k, v, cl = make_case(1, 1, 2, 2, 48, [3], torch.float32)
    with pytest.raises(ValueError, match="power of 2"):
        va.verify_attention(q, k, v, cl, backend="triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("L", [4096, 32768])
@pytest.mark.parametrize("T", [1, 9])
def test_large_gpu(L, T):
    B, Hq, Hkv, D = 8, 32, 8, 128
    lens = [L - 37 * b for b in range(B)]
    q, k, v, cl = make_case(B, T, Hq, Hkv, D, lens, torch.bfloat16, seed=7)
    cfg = attention_config(q.shape, Hkv, k.shape[2], q.dtype, target_of(q.device))
    assert cfg.num_splits > 1
    out = va.verify_attention(q, k, v, cl)
    ref = va.verify_attention_reference(q.float(), k.float(), v.float(), cl)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# the configuration an H100 / H200 (132 SMs) launches (row tiles up to 128, KV blocks of 64,
# chunks of >= 256 keys, its split count) run in the interpreter with fp16 inputs
GPU = Target(num_sms=132, interpreter=False)


@pytest.mark.parametrize(
    "shape, tree",
    [
        ((2, 9, 8, 2, 64, [600, 290]), False),  # 36 rows: one 64-row tile, 3 and 2 splits
        ((1, 1, 4, 1, 64, [513]), False),  # decode: a ragged last block after full ones
        ((2, 17, 8, 1, 64, [300, 40]), True),  # 136 rows: two 128-row tiles, tree masks
    ],
)
def test_gpu_config_in_interpreter(shape, tree):
    B, T, Hq, Hkv, D, lens = shape
    q, k, v, cl = make_case(B, T, Hq, Hkv, D, lens, torch.float16, seed=8)
    cfg = attention_config(q.shape, Hkv, k.shape[2], torch.float16, GPU)
    assert cfg.block_n == 64 and cfg.min_chunk == MIN_CHUNK_KEYS and not cfg.dot_fp32
    assert cfg.num_splits > 1
    mask = random_tree_mask(B, T, seed=8) if tree else None
    out = va._verify_attention_triton(q, k, v, cl, D**-0.5, mask, config=cfg)
    assert_matches(out, reference64(q, k, v, cl, mask), torch.float16)
