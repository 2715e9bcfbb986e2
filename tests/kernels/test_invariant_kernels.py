"""Batch-invariant launches of the Triton kernels (interpreter): inside `rows_as_one()` a row
of a GEMV call of M rows, a query row of a T-token attention call and a row of the RMSNorm
kernel compute the bits of the same row computed alone (a decode step at its slot), and
stay within float64 references. The configurations are checked as pure functions for a
GPU target too (where fp16 / bf16 rows would otherwise take tl.dot)."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import BackendError
from specdec.kernels.attention_splits import attention_config
from specdec.kernels.quant_gemv import gemv_config, quant_linear, quant_linear_reference
from specdec.kernels.rms_norm import rms_norm_rows, rms_norm_rows_reference
from specdec.kernels.utils import INVARIANT_GEMV_ENV, Target, rows_are_one, rows_as_one
from specdec.kernels.verify_attention import (
    _verify_attention_triton,
    verify_attention,
    verify_attention_reference,
)
from tests.kernels.test_kquant_gemv import make as make_kquant
from tests.kernels.test_quant_gemv import make_weight

H200 = Target(num_sms=132, interpreter=False, device="NVIDIA H200")


def _seed() -> int:
    return int(torch.randint(0, 2**31, ()))


def test_rows_as_one_is_scoped():
    assert not rows_are_one()
    with rows_as_one():
        assert rows_are_one()
        with rows_as_one(False):
            assert not rows_are_one()
        assert rows_are_one()
    assert not rows_are_one()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["dot", "broadcast"])
def test_gemv_plan_of_many_rows_is_the_one_row_plan_on_a_gpu(dtype, path, monkeypatch):
    """Outside the mode 16-bit rows take tl.dot with tiles and splits planned for M rows
    (M = 1: the broadcast path); inside it every M gets one plan: tl.dot planned for 16
    rows, M = 1 included ("dot"), or the broadcast path planned for one row."""
    monkeypatch.setenv(INVARIANT_GEMV_ENV, path)
    w = make_weight("int4-g128", 1536, 576)
    assert not gemv_config(1, w, dtype, H200).use_dot
    plans = set()
    for m in (1, 2, 5, 9, 16):
        assert gemv_config(m, w, dtype, H200).use_dot == (m > 1)
        with rows_as_one():
            cfg = gemv_config(m, w, dtype, H200)
        assert cfg.use_dot == (path == "dot")
        # (the broadcast path's BLOCK_M is how many rows one program loops over, each alone)
        block_m = cfg.block_m if cfg.use_dot else None
        plans.add((block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.k_per_split))
    assert len(plans) == 1
    with rows_as_one():  # float32 rows: the broadcast path either way
        assert not gemv_config(5, w, torch.float32, H200).use_dot
    monkeypatch.setenv(INVARIANT_GEMV_ENV, "tensor")
    with rows_as_one(), pytest.raises(BackendError, match="SPECDEC_INVARIANT_GEMV"):
        gemv_config(5, w, dtype, H200)


@pytest.mark.parametrize("fmt", ["int4-g32", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 16, 21])
def test_gemv_rows_equal_one_row_calls(fmt, dtype, m):
    """M = 21 runs as calls of 16 and 5 (outside the mode: dequantize + matmul)."""
    n, k = 80, 96
    w = make_weight(fmt, n, k, seed=_seed())
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    with rows_as_one():
        full = quant_linear(x, w, bias, backend="triton")
        rows = [quant_linear(x[i : i + 1], w, bias, backend="triton") for i in range(m)]
    assert torch.equal(full, torch.cat(rows))
    ref = quant_linear_reference(x.double(), w, bias.double())
    torch.testing.assert_close(full.double(), ref, atol=3e-2, rtol=3e-2)


def test_invariant_attention_config_depends_on_nothing_a_row_does_not():
    """Tiles, KV blocks, warps and the chunk are the same for a decode step and any
    verification width, batch and cache length; only the grid changes."""
    base = attention_config((1, 1, 9, 64), 3, 300, torch.bfloat16, H200, invariant=True)
    assert base.invariant and base.block_m == 16 and base.min_chunk == 256
    for shape, max_kv in [((1, 5, 9, 64), 300), ((8, 17, 9, 64), 4096), ((2, 64, 9, 64), 70)]:
        cfg = attention_config(shape, 3, max_kv, torch.bfloat16, H200, invariant=True)
        same = ("block_m", "block_n", "min_chunk", "num_warps", "num_stages", "dot_precision")
        assert all(getattr(cfg, f) == getattr(base, f) for f in same)
        assert cfg.num_splits == -(-max_kv // 256)
    # the heuristic launch, for contrast, sizes its tiles and splits by T and the cache
    h1 = attention_config((1, 1, 9, 64), 3, 4096, torch.bfloat16, H200)
    h17 = attention_config((1, 17, 9, 64), 3, 4096, torch.bfloat16, H200)
    assert (h1.block_m, h1.num_splits) != (h17.block_m, h17.num_splits)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 32)])
def test_attention_rows_equal_decode_steps(dtype, tol, hq, hkv, d):
    """Two sequences at different lengths, chunks of 64 keys (several splits, rows on both
    sides of a split boundary): row t of a T = 7 call equals the one-token call at its
    slot, in a cache of the same length and in a longer one (plain decoding's cache is
    shorter than speculative decoding's), bit for bit."""
    g = torch.Generator().manual_seed(_seed())
    B, T, Lmax = 2, 7, 200
    k_cache = torch.randn(B, hkv, Lmax, d, generator=g).to(dtype)
    v_cache = torch.randn(B, hkv, Lmax, d, generator=g).to(dtype)
    q = torch.randn(B, T, hq, d, generator=g).to(dtype)
    lens = torch.tensor([60, 125])  # rows at 60..66 and 125..131 cross the 64 / 128 boundaries
    kw = {"invariant": True, "min_chunk": 64}
    full = _verify_attention_triton(q, k_cache, v_cache, lens, d**-0.5, None, **kw)
    ref = verify_attention_reference(q.double(), k_cache.double(), v_cache.double(), lens)
    torch.testing.assert_close(full.double(), ref, atol=tol, rtol=tol)
    longer = [
        torch.cat([c, torch.randn(B, hkv, 150, d, generator=g).to(dtype)], 2)
        for c in (
            k_cache,
            v_cache,
        )
    ]
    for t in range(T):
        for kc, vc in ((k_cache, v_cache), longer):
            one = _verify_attention_triton(q[:, t : t + 1], kc, vc, lens + t, d**-0.5, None, **kw)
            assert torch.equal(one, full[:, t : t + 1]), t
    # the public entry point takes the same launch
    public = verify_attention(q, k_cache, v_cache, lens, backend="triton", invariant=True)
    torch.testing.assert_close(public.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [576, 96])
def test_rms_norm_rows(out_dtype, d):
    x = torch.randn(3, 5, d) * 3
    w = torch.randn(d)
    out = rms_norm_rows(x, w, 1e-5, out_dtype, backend="triton")
    assert out.dtype == out_dtype and out.shape == x.shape
    ref = rms_norm_rows_reference(x, w, 1e-5, torch.float64)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    one = rms_norm_rows(x[1:2, 2:3], w, 1e-5, out_dtype, backend="triton")
    assert torch.equal(one[0, 0], out[1, 2])
    with pytest.raises(ValueError, match="does not match"):
        rms_norm_rows(x, w[:-1], 1e-5, out_dtype, backend="triton")


# --- on a GPU: tl.dot's tensor-core tiles, real shapes ---------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hq, hkv, d, lens",
    [(9, 3, 64, (300, 1000)), (32, 8, 128, (127, 4000))],  # SmolLM2, Llama-3-8B heads
)
def test_gpu_attention_rows_equal_decode_steps(dtype, hq, hkv, d, lens):
    """Row t of invariant launches of T = 5, 9 and 17 (batch 2) equals the one-token launch
    at its slot bit for bit, over caches of two lengths; the heuristic launch (other tiles
    and splits for each T) is not required to."""
    g = torch.Generator(device="cuda").manual_seed(_seed())
    B, Lmax = 2, max(lens) + 40
    kc, vc = (
        torch.randn(B, hkv, Lmax + 300, d, device="cuda", generator=g).to(dtype) for _ in "kv"
    )
    lens_t = torch.tensor(lens, device="cuda")
    for T in (5, 9, 17):
        q = torch.randn(B, T, hq, d, device="cuda", generator=g).to(dtype)
        full = verify_attention(q, kc[:, :, :Lmax], vc[:, :, :Lmax], lens_t, invariant=True)
        ref = verify_attention_reference(q, kc[:, :, :Lmax], vc[:, :, :Lmax], lens_t)
        torch.testing.assert_close(full.float(), ref.float(), atol=2e-2, rtol=2e-2)
        for t in range(T):
            for L in (Lmax, Lmax + 300):  # plain decoding's cache vs speculative's
                one = verify_attention(
                    q[:, t : t + 1], kc[:, :, :L], vc[:, :, :L], lens_t + t, invariant=True
                )
                assert torch.equal(one, full[:, t : t + 1]), (T, t, L)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int4-g128", "q4_1", "q8_0", "q4_k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["dot", "broadcast"])
def test_gpu_gemv_rows_equal_one_row_calls(fmt, dtype, path, monkeypatch):
    """Llama-3-8B's down projection (N 4096, K 14336): rows of M = 5, 16 and 40 (three
    calls) inside rows_as_one() equal one-row calls bit for bit, on either invariant path
    (outside the mode M = 1 takes the broadcast path and M > 1 tl.dot)."""
    monkeypatch.setenv(INVARIANT_GEMV_ENV, path)
    if fmt == "q4_k":  # Qwen2.5-Coder's k-quants: their own kernel file, same plans
        w = make_kquant(fmt, 4096, 14336 // 256, seed=_seed())[0]
    else:
        w = make_weight(fmt, 4096, 14336, seed=_seed())
    for m in (5, 16, 40):
        x = torch.randn(m, 14336, device="cuda").to(dtype)
        with rows_as_one():
            full = quant_linear(x, w, backend="triton")
            rows = torch.cat([quant_linear(x[i : i + 1], w, backend="triton") for i in range(m)])
        assert torch.equal(full, rows), m
        ref = quant_linear_reference(x, w)
        torch.testing.assert_close(full.float(), ref.float(), atol=5e-2, rtol=2e-2)
