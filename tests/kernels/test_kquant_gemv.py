"""Triton GEMV / dequantization for the 5-bit and k-quant GGUF formats (kquant_gemv.py)
against a float64 reference decoded straight from the block bytes (llama.cpp's
dequantize_row_* loops, written independently of quant.py). On CPU the kernels run in
Triton's interpreter; fp16 rows with M > 1 take the tl.dot (tensor-core) path."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import triton  # noqa: E402

from specdec.kernels import kquant_gemv as kg  # noqa: E402
from specdec.kernels.quant import KQUANT_BLOCKS, from_gguf_kquant  # noqa: E402
from specdec.kernels.quant_gemv import quant_linear  # noqa: E402
from specdec.kernels.utils import target_of  # noqa: E402
from tests.kernels.test_kquant import random_blocks  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = sorted(KQUANT_BLOCKS)
# max |out - ref| <= tol * max |ref| (as in test_quant_gemv)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float64)


def dequant64(raw: np.ndarray, fmt: str, n: int, k: int) -> torch.Tensor:
    """float64 [N, K] from GGUF block bytes, element by element as llama.cpp decodes them."""
    bb, g = KQUANT_BLOCKS[fmt]
    b = raw.reshape(n, k // g, bb).astype(np.int64)
    out = np.zeros((n, k // g, g))
    if fmt in ("q5_0", "q5_1"):
        d = _f16(raw.reshape(n, k // g, bb)[..., 0:2])
        off = 2 if fmt == "q5_0" else 4
        qh = sum(b[..., off + i] << (8 * i) for i in range(4))
        for j in range(32):
            lo = (b[..., off + 4 + j % 16] >> (4 * (j // 16))) & 15
            q = lo | (((qh >> j) & 1) << 4)
            if fmt == "q5_0":
                out[..., j] = d * (q - 16)
            else:
                out[..., j] = d * q + _f16(raw.reshape(n, k // g, bb)[..., 2:4])
    elif fmt in ("q4_k", "q5_k"):
        blocks = raw.reshape(n, k // g, bb)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc_b = b[..., 4:16]
        qs0 = 16 if fmt == "q4_k" else 48
        for j in range(8):
            if j < 4:
                sc, m = sc_b[..., j] & 63, sc_b[..., j + 4] & 63
            else:
                sc = (sc_b[..., j + 4] & 15) | ((sc_b[..., j - 4] >> 6) << 4)
                m = (sc_b[..., j + 4] >> 4) | ((sc_b[..., j] >> 6) << 4)
            for l in range(32):
                q = (b[..., qs0 + (j // 2) * 32 + l] >> (4 * (j % 2))) & 15
                if fmt == "q5_k":
                    q = q | (((b[..., 16 + l] >> j) & 1) << 4)
                out[..., 32 * j + l] = d * sc * q - dmin * m
    else:  # q6_k
        blocks = raw.reshape(n, k // g, bb)
        d = _f16(blocks[..., 208:210])
        sc = blocks[..., 192:208].view(np.int8).astype(np.float64)
        for h in range(2):
            for l in range(32):
                ql0, ql1 = b[..., 64 * h + l], b[..., 64 * h + l + 32]
                qh = b[..., 128 + 32 * h + l]
                for t, (ql, shift) in enumerate([(ql0, 0), (ql1, 0), (ql0, 4), (ql1, 4)]):
                    q = ((ql >> shift) & 15) | (((qh >> (2 * t)) & 3) << 4)
                    e = 128 * h + 32 * t + l
                    out[..., e] = d * sc[..., 8 * h + e % 128 // 16] * (q - 32)
    return torch.from_numpy(out.reshape(n, k))


def make(fmt: str, n: int, blocks: int, seed: int):
    k = blocks * KQUANT_BLOCKS[fmt][1]
    raw = random_blocks(fmt, n, k, seed)
    return from_gguf_kquant(raw, fmt, (n, k)).to(DEVICE), dequant64(raw, fmt, n, k)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("fmt", FORMATS)
def test_float64_reference_agrees_with_torch_dequantize(fmt):
    w, ref = make(fmt, 5, 2, 11)
    torch.testing.assert_close(w.dequantize().double().cpu(), ref, rtol=1e-6, atol=1e-6)


# odd N; K of 3 blocks of 32 (not a multiple of the 128-wide q5 tile) or 3 super-blocks
@pytest.mark.parametrize("layout", kg.LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "m, dtype", [(1, torch.float32), (3, torch.float32), (16, torch.float32), (5, torch.bfloat16)]
)
def test_gemv_matches_float64(fmt, m, dtype, layout):
    w, w64 = make(fmt, 37, 3, m)
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    bias = torch.randn(37).to(DEVICE, dtype)
    out = torch.full((m, 37), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    with kg.tile_layout(layout):
        kg.launch_kquant_gemv(x, w, bias, out)
    check(out, x.double().cpu() @ w64.t() + bias.double().cpu(), dtype)


@pytest.mark.parametrize("layout", kg.LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [2, 9, 16])
def test_tensor_core_path_fp16(fmt, m, layout):
    """fp16 with 2..16 rows goes through tl.dot (weights rounded to fp16 first)."""
    w, w64 = make(fmt, 19, 2, 30 + m)
    assert kg.kquant_gemv_config(m, w, torch.float16, target_of(DEVICE)).use_dot
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    x = x.half()
    out = torch.full((m, 19), float("nan"), dtype=torch.float16, device=DEVICE)
    with kg.tile_layout(layout):
        kg.launch_kquant_gemv(x, w, None, out)
    check(out, x.double().cpu() @ w64.t(), torch.float16)


@pytest.mark.parametrize("layout", kg.LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_sums_partials_in_order(fmt, layout):
    w, w64 = make(fmt, 21, 12 if KQUANT_BLOCKS[fmt][1] == 32 else 4, 5)  # 3 or 4 K tiles
    x = torch.randn(2, w.in_features, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    bias = torch.randn(21).to(DEVICE)
    ref = x.double().cpu() @ w64.t() + bias.double().cpu()
    for split in (2, 3):
        out = torch.full((2, 21), float("nan"), device=DEVICE)
        cfg = kg.kquant_gemv_config(2, w, x.dtype, target_of(DEVICE), block_n=16, split_k=split)
        assert cfg.split_k > 1
        with kg.tile_layout(layout):
            kg.launch_kquant_gemv(x, w, bias, out, cfg)
        check(out, ref, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_and_dispatch_through_quant_linear(fmt, dtype):
    """quant_linear(backend='triton'): 17+ rows dequantize with the Triton kernel + matmul;
    leading dims are flattened; the torch backend gives the same answer."""
    w, w64 = make(fmt, 13, 3, 7)
    x = torch.randn(2, 10, w.in_features, generator=torch.Generator().manual_seed(3))
    x = x.to(DEVICE, dtype)
    ref = x.double().cpu() @ w64.t()
    check(quant_linear(x, w, backend="triton"), ref, dtype)
    check(quant_linear(x[:1, :3], w, backend="triton"), ref[:1, :3], dtype)
    check(quant_linear(x, w, backend="torch"), ref, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_triton_equals_torch(fmt):
    w, _ = make(fmt, 33, 3, 9)
    got = kg.dequantize_kquant_triton(w, torch.float32)
    torch.testing.assert_close(got, w.dequantize(torch.float32), rtol=0, atol=0)


def test_tile_layouts_are_chosen_per_format_and_path():
    """The default tile layout is "elements" only where it took fewer sm_90 registers under
    the installed triton's table: 3.6 (and anything before 3.9) for the q5_0 / q5_1 / q4_k
    broadcast rows, 3.9 and later for q5_1's tensor-core rows; "halves" everywhere else.
    tile_layout() overrides it inside its block only and refuses unknown names."""
    old = kg.default_layouts("3.6.0")
    assert old == {
        ("q5_0", "m1"): "elements",
        ("q5_1", "m1"): "elements",
        ("q4_k", "m1"): "elements",
    }
    assert kg.default_layouts("3.5.1") == old
    assert (
        kg.default_layouts("3.9.0")
        == kg.default_layouts("3.10.0+gitabc")
        == {("q5_1", "dot"): "elements"}
    )
    with pytest.raises(ValueError, match="cannot read triton version"):
        kg.default_layouts("nightly")
    assert kg.DEFAULT_LAYOUT == kg.default_layouts(triton.__version__)
    for fmt in FORMATS:
        for use_dot in (False, True):
            want = kg.DEFAULT_LAYOUT.get((fmt, "dot" if use_dot else "m1"), "halves")
            assert kg.layout_for(fmt, use_dot) == want
    assert kg.layout_for("q4_k", use_dot=True) == kg.layout_for("q6_k", use_dot=True) == "halves"
    with kg.tile_layout("elements"):
        assert kg.layout_for("q4_k", use_dot=True) == "elements"
        with kg.tile_layout("halves"):
            assert kg.layout_for("q5_1", use_dot=True) == "halves"
        assert kg.layout_for("q6_k", use_dot=False) == "elements"
    assert kg.layout_for("q4_k", use_dot=True) == "halves"
    with pytest.raises(ValueError, match="unknown k-quant tile layout"):
        with kg.tile_layout("rows"):
            pass


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_layouts_compute_the_same_fp32_rows(fmt):
    """fp32 broadcast rows of the two layouts agree to rounding (different summation
    orders: within TOL of the largest output), and each layout is batch-invariant: row r of
    a 5-row call equals a 1-row call."""
    w, _ = make(fmt, 29, 2, 41)
    x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    outs = {}
    for layout in kg.LAYOUTS:
        with kg.tile_layout(layout):
            out = torch.full((5, 29), float("nan"), device=DEVICE)
            kg.launch_kquant_gemv(x, w, None, out)
            one = torch.full((1, 29), float("nan"), device=DEVICE)
            kg.launch_kquant_gemv(x[3:4].contiguous(), w, None, one)
        assert torch.equal(out[3:4], one), layout
        outs[layout] = out
    err = (outs["halves"] - outs["elements"]).abs().max().item()
    assert err <= TOL[torch.float32] * outs["elements"].abs().max().item(), err
