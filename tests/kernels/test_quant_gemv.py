"""Quantized linear (specdec/kernels/quant_gemv.py) against a float64 reference.

The reference dequantizes the QuantizedWeight planes in float64 straight from the formulas
(GGUF block formats in shared/REFERENCE.md, nibble order in quant.py's docstring) and
multiplies in float64. On CPU the Triton kernels run in Triton's interpreter, where bf16
rows take the broadcast path instead of tl.dot (the interpreter's tl.dot mishandles bf16);
the bf16 tl.dot path is covered by the fp16 tests' code and by the GPU tests.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402

from specdec.errors import BackendError  # noqa: E402
from specdec.kernels import quant_gemv as qg  # noqa: E402
from specdec.kernels import utils  # noqa: E402
from specdec.kernels.dequantize import dequantize_triton  # noqa: E402
from specdec.kernels.quant import (  # noqa: E402
    GGUF_BLOCK,
    GGUF_BLOCK_BYTES,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TARGET = utils.target_of(DEVICE)
FORMATS = ["q8_0", "q4_0", "q4_1", "int8", "int4-g32", "int4-g64", "int4-g128"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |out - ref| <= tol * max |ref|: fp32 differs only in summation order; fp16/bf16 round
# the output (and, in tl.dot, the dequantized weights) to the activation dtype
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_gguf(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Random GGUF blocks: random codes, finite fp16 scales (and mins) of sensible size."""
    nb, bb = k // GGUF_BLOCK, GGUF_BLOCK_BYTES[fmt]
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=gen).numpy()
    qmax = 127.0 if fmt == "q8_0" else 8.0
    sign = torch.randint(0, 2, (n, nb), generator=gen) * 2 - 1
    d = (0.5 + torch.rand(n, nb, generator=gen)) * sign / qmax
    raw[:, :, 0:2] = d.half().numpy().view(np.uint8).reshape(n, nb, 2)
    if fmt == "q4_1":
        m = -8.0 * d.abs() + 0.1 * torch.randn(n, nb, generator=gen)
        raw[:, :, 2:4] = m.half().numpy().view(np.uint8).reshape(n, nb, 2)
    return from_gguf_blocks(raw.reshape(n, nb * bb), fmt, (n, k))


def make_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    if fmt in ("q8_0", "q4_0", "q4_1"):
        w = random_gguf(fmt, n, k, gen)
    elif fmt == "int8":
        w = quantize_int8(torch.randn(n, k, generator=gen))
    else:
        w = quantize_int4(torch.randn(n, k, generator=gen), int(fmt.split("-g")[1]))
    return w.to(DEVICE)


def gemv_k(fmt: str) -> int:
    """An in_features that is not a multiple of the tile: GGUF needs whole blocks of 32;
    int4/int8 get a K that is not a multiple of their group (padded K_pad)."""
    return 96 if fmt in ("q8_0", "q4_0", "q4_1") else 100


def dequant64(w: QuantizedWeight) -> torch.Tensor:
    n, k = w.shape
    g = w.group_size
    d = w.scales.double().repeat_interleave(g, dim=1)  # [N, K_pad]
    if w.bits == 8:
        q = w.qweight.double()
        return (q * d)[:, :k]
    p = w.qweight.view(n, -1, g // 2)  # byte j of a group: element j (low), j + g/2 (high)
    q = torch.cat([p & 0x0F, p >> 4], dim=2).reshape(n, -1).double()
    if w.mins is None:
        wd = (q - 8.0) * d
    else:
        wd = q * d + w.mins.double().repeat_interleave(g, dim=1)
    return wd[:, :k]


def reference64(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dequant64(w).t()
    return y if bias is None else y + bias.double()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "some output elements were not written"
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"


def inputs(m: int, k: int, n: int, dtype: torch.dtype, has_bias: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if has_bias else None
    return x, bias


def run_gemv(x, w, bias, config=None) -> torch.Tensor:
    """The launcher with NaN-poisoned output and split-K workspace."""
    m, n = x.shape[0], w.out_features
    cfg = config or qg.gemv_config(m, w, x.dtype, utils.target_of(x.device))
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
    ws = torch.full((cfg.split_k * m * n,), float("nan"), device=x.device)
    return qg.launch_quant_gemv(x, w, bias, out, cfg, workspace=ws)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 5, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_matches_float64(fmt, m, dtype, has_bias):
    n, k = 41, gemv_k(fmt)
    w = make_weight(fmt, n, k)
    x, bias = inputs(m, k, n, dtype, has_bias)
    assert_matches(run_gemv(x, w, bias), reference64(x, w, bias), dtype)


@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_odd_n(fmt, n):
    k = gemv_k(fmt)
    w = make_weight(fmt, n, k, seed=2)
    for m, dtype in [(1, torch.float32), (5, torch.float16)]:  # broadcast and tl.dot paths
        x, bias = inputs(m, k, n, dtype, True, seed=3)
        assert_matches(run_gemv(x, w, bias), reference64(x, w, bias), dtype)


@pytest.mark.parametrize(("m", "split_k"), [(1, 3), (16, 2)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_split_k(fmt, m, split_k):
    """Small K tiles and a split that is uneven for most formats."""
    n, k = 37, (320 if fmt in ("q8_0", "q4_0", "q4_1") else 300)
    w = make_weight(fmt, n, k, seed=4)
    block_k = max(64, w.group_size) if w.bits == 4 else 64
    dtype = torch.float16
    cfg = qg.gemv_config(m, w, dtype, TARGET, block_n=16, block_k=block_k, split_k=split_k)
    assert cfg.split_k == split_k
    x, bias = inputs(m, k, n, dtype, True, seed=5)
    out = run_gemv(x, w, bias, cfg)
    assert_matches(out, reference64(x, w, bias), dtype)
    assert torch.equal(out, run_gemv(x, w, bias, cfg)), "split-K reduction must be deterministic"


def test_default_config_splits_k_when_n_is_small():
    w = make_weight("int4-g32", 16, 1024)
    cfg = qg.gemv_config(1, w, torch.bfloat16, TARGET)
    assert cfg.split_k > 1 and cfg.k_per_split % cfg.block_k == 0
    x, bias = inputs(1, 1024, 16, torch.bfloat16, True)
    assert_matches(run_gemv(x, w, bias), reference64(x, w, bias), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_triton(fmt, dtype):
    n, k = 37, gemv_k(fmt)
    w = make_weight(fmt, n, k, seed=6)
    out = torch.full((n, k), float("nan"), dtype=dtype, device=DEVICE)
    dequantize_triton(w, dtype, out=out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dequant64(w).to(dtype))  # exact up to double rounding


@pytest.mark.parametrize("m", [17, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "int8", "int4-g128"])
def test_prefill_path(fmt, dtype, m):
    n, k = 41, gemv_k(fmt)
    w = make_weight(fmt, n, k, seed=7)
    x, bias = inputs(m, k, n, dtype, True, seed=8)
    out = qg.quant_linear(x, w, bias, backend="triton")
    assert_matches(out, reference64(x, w, bias), dtype)


@pytest.mark.parametrize("t", [3, 9])  # 6 rows: GEMV; 18 rows: prefill
def test_3d_input(t):
    n, k, dtype = 37, 100, torch.float16
    w = make_weight("int4-g64", n, k, seed=9)
    x, bias = inputs(2 * t, k, n, dtype, True, seed=10)
    out = qg.quant_linear(x.view(2, t, k), w, bias, backend="triton")
    assert out.shape == (2, t, n)
    assert_matches(out.reshape(2 * t, n), reference64(x, w, bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_reference_matches_float64(fmt, dtype):
    n, k = 41, gemv_k(fmt)
    w = make_weight(fmt, n, k, seed=11)
    x, bias = inputs(4, k, n, dtype, True, seed=12)
    out = qg.quant_linear(x.view(2, 2, k), w, bias, backend="torch")
    assert_matches(out.view(4, n), reference64(x, w, bias), dtype)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    w = make_weight("q4_0", 8, 64).to("cpu")
    x = torch.randn(1, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        qg.quant_linear(x, w, backend="triton")
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        qg.quant_linear(x, w)


def test_interpreter_switched_after_import_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if utils.triton_interpret() else "1")
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        utils.launchable(qg._quant_gemv_kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (4096, 14336)], ids=str)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "int8", "int4-g128"])
def test_gpu_large_shapes(fmt, shape, m):
    n, k = shape
    w = make_weight(fmt, n, k, seed=13)
    x, bias = inputs(m, k, n, torch.bfloat16, True, seed=14)
    if m <= qg.MAX_GEMV_ROWS:
        out = run_gemv(x, w, bias)
    else:
        out = qg.quant_linear(x, w, bias, backend="triton")
    ref = (x.float() @ w.dequantize(torch.float32).t() + bias.float()).double()
    assert_matches(out, ref, torch.bfloat16)


# the configurations an H100 / H200 (132 SMs) launches, run in the interpreter with fp16
# rows: tensor-core tiles (BLOCK_M 16, BLOCK_N 32), the GPU's BLOCK_N for M = 1 and its
# split-K, instead of the interpreter's one-big-tile choice
GPU = utils.Target(num_sms=132, interpreter=False)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_config_in_interpreter(fmt, m):
    n, k = 45, (320 if fmt in ("q8_0", "q4_0", "q4_1") else 300)
    w = make_weight(fmt, n, k, seed=15)
    cfg = qg.gemv_config(m, w, torch.float16, GPU)
    assert cfg.use_dot == (m > 1)
    assert cfg.block_n == (32 if m > 1 else 8192 // cfg.block_k)
    assert cfg.split_k == utils.cdiv(
        w.k_padded, cfg.block_k
    )  # small N: every K tile its own program
    x, bias = inputs(m, k, n, torch.float16, True, seed=16)
    assert_matches(run_gemv(x, w, bias, cfg), reference64(x, w, bias), torch.float16)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4-g128"])
def test_broadcast_rows_equal_one_row_calls(fmt):
    """fp32 rows take the broadcast path at any M, planned as M = 1 (same tiles, same split-K
    on a 132-SM GPU): row r of an M-row call is bit-identical to a one-row call on x[r], K
    split across several programs. That is what keeps greedy speculative decoding's
    verification rows equal to decode steps in fp32 (the tuned-table case:
    test_gemv_tuning.test_fp32_rows_take_the_one_row_entry)."""
    n, k = 48, 1024  # small N, long K: the one-row plan splits K into many programs
    w = make_weight(fmt, n, k, seed=int(torch.randint(0, 2**31, ())))
    one = qg.gemv_config(1, w, torch.float32, GPU)
    for m in (2, 5, 16):
        cfg = qg.gemv_config(m, w, torch.float32, GPU)
        assert not cfg.use_dot and cfg.block_m == utils.next_power_of_2(m)
        assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.k_per_split, cfg.grid) == (
            one.block_n,
            one.block_k,
            one.split_k,
            one.k_per_split,
            one.grid,
        )
    assert one.split_k > 1
    x, bias = inputs(5, k, n, torch.float32, True, seed=int(torch.randint(0, 2**31, ())))
    cfg = qg.gemv_config(5, w, torch.float32, GPU)
    out = run_gemv(x, w, bias, cfg)
    assert_matches(out, reference64(x, w, bias), torch.float32)
    for r in range(5):
        assert torch.equal(out[r : r + 1], run_gemv(x[r : r + 1], w, bias, one)), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (4096, 14336)], ids=str)
def test_gpu_fp32_rows_equal_one_row_calls(shape):
    """The same on the GPU, with the device's own plan (and its tuned table, if it has one)."""
    n, k = shape
    w = make_weight("int4-g128", n, k, seed=17)
    x, bias = inputs(9, k, n, torch.float32, True, seed=18)
    out = run_gemv(x, w, bias)
    for r in range(9):
        assert torch.equal(out[r : r + 1], run_gemv(x[r : r + 1], w, bias)), r
