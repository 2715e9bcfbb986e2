"""CPU linear backends (specdec.models.cpu_linear): each kernel against float64 math on the
same weights, the policy, and greedy speculative == plain greedy in the native mode."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.kernels.quant import (
    QuantizedWeight,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from specdec.models.cpu_linear import (
    CpuLinear,
    choose_backend,
    cpu_features,
    describe,
    resolve_mode,
)
from specdec.models.load import load_model


def _q4_0(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    b = w.view(n, k // 32, 32)
    d = (b.abs().amax(dim=2) / 7.0).half()
    q = (torch.round(b / d.float()[..., None]) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight("q4_0", 4, 32, (n, k), pack_int4(q, 32), d)


def _q8_0(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    b = w.view(n, k // 32, 32)
    d = (b.abs().amax(dim=2) / 127.0).half()
    q = torch.round(b / d.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight("q8_0", 8, 32, (n, k), q, d)


def _weights(n=96, k=160):
    w = torch.randn(n, k) * 0.05
    return {
        "q4_0": _q4_0(w),
        "int4_g32": quantize_int4(w, 32),  # Q4_1's w = d q + m
        "int4_g64_padded": quantize_int4(w, 64),  # K=160 pads to 192
        "int8": quantize_int8(w),
        "q8_0": _q8_0(w),
    }


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g32", "int4_g64_padded", "int8", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_backends_match_float64(fmt, dtype, bias):
    q = _weights()[fmt]
    b = torch.randn(q.out_features) if bias else None
    x = torch.randn(2, 3, q.in_features)  # [B, T, K]
    ref_w = q.dequantize().double()
    ref = x.double() @ ref_w.T + (b.double() if bias else 0)
    packed = "int4pack" if q.bits == 4 else "int8pack"
    for backend in ("mkl", "onednn", packed):
        if backend == "onednn" and dtype != torch.float32:
            continue
        lin = CpuLinear(
            backend,
            dense=None if backend == packed else q.dequantize(dtype),
            qweight=q,
            bias=None if b is None else b.to(dtype),
            dtype=dtype,
        )
        y = lin(x.to(dtype)).double()
        assert y.shape == (2, 3, q.out_features)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        if backend == "int8pack" and fmt == "q8_0":
            # per-32-block scales requantized per channel: a documented, bounded loss
            assert err < 5e-2
        else:
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (backend, err)


def test_q4_k_maps_exactly_to_int4pack():
    """Q4_K's 32-weight sub-blocks ((d sc_j) q - dmin m_j) as int4pack groups of 32: fp32
    activations give fp32 math on the dequantized weight (the mapping is exact), bf16 the
    bf16 rounding; the other k-quants have no int4pack mapping and get the dense choice."""
    from specdec.kernels.quant import from_gguf_kquant
    from tests.kernels.test_kquant import random_blocks

    n, k = 32, 512
    q = from_gguf_kquant(random_blocks("q4_k", n, k, seed=3), "q4_k", (n, k))
    x = torch.randn(5, k)
    ref = x.double() @ q.dequantize().double().T
    # fp32: 1e-5 as for the other formats (the kernel forms s (q - 8) + z and sums in its own
    # order: 1.2e-6 seen on AMD Zen 4, a wrong code or scale gives ~1e-2)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        lin = CpuLinear("int4pack", dense=None, qweight=q, bias=None, dtype=dtype)
        y = lin(x.to(dtype)).double()
        assert ((y - ref).abs().max() / ref.abs().max()).item() < tol, dtype
    assert choose_backend("native", q, torch.bfloat16).backend == "int4pack"
    odd = from_gguf_kquant(random_blocks("q4_k", 24, k, seed=5), "q4_k", (24, k))
    assert "multiple of 16" in choose_backend("native", odd, torch.bfloat16).reason
    for fmt in ("q5_0", "q5_k", "q6_k"):
        w = from_gguf_kquant(random_blocks(fmt, n, k, seed=4), fmt, (n, k))
        c = choose_backend("native", w, torch.bfloat16)
        if _ort_available():  # no torch kernel: ONNX Runtime's, named
            assert c.backend == "ort" and "no kernel" in c.reason, (fmt, c)
        else:
            assert c.backend in ("mkl", "onednn") and "n/a" in c.reason, (fmt, c)


def test_native_policy_without_onnxruntime(monkeypatch):
    """Without the cpu-ort extra, native keeps torch's kernels where they exist (Q8_0 ->
    int8pack) and names the dense fallback for the 5/6-bit formats."""
    import specdec.models.cpu_linear as cl

    monkeypatch.setitem(cl.cpu_features(), "onnxruntime", None)
    q8 = _weights()["q8_0"]
    assert choose_backend("native", q8, torch.bfloat16).backend == (
        "int8pack" if cpu_features()["avx2"] else cl.dense_choice(torch.bfloat16).backend
    )
    w = _kquant("q6_k", 32, 256)
    c = choose_backend("native", w, torch.bfloat16)
    assert c.backend in ("mkl", "onednn") and "n/a" in c.reason, c
    assert cl.mixed_ort_choice("native", [w, q8], torch.bfloat16) is None
    assert describe("native")["backends"]["bfloat16 5/6-bit"].startswith(("onednn", "mkl"))
    monkeypatch.undo()
    if _ort_available():
        picks = describe("native")["backends"]
        assert picks["bfloat16 5/6-bit"].startswith("ort: native: q5_0"), picks
        assert picks["float32 5/6-bit"].startswith(("onednn", "mkl")), picks


def test_policy():
    feats = cpu_features()
    q4 = _weights()["int4_g32"]
    dense_fp32 = choose_backend("dense", q4, torch.float32)
    assert dense_fp32.backend == ("onednn" if feats["mkldnn"] else "mkl")
    # native computes in bf16 from the codes; fp32 activations fall back to the dense choice
    assert choose_backend("native", q4, torch.float32).backend == dense_fp32.backend
    if feats["avx2"]:
        assert choose_backend("native", q4, torch.bfloat16).backend == "int4pack"
        assert choose_backend("native", _weights()["q8_0"], torch.bfloat16).backend == "int8pack"
        assert choose_backend("native", _weights()["int8"], torch.bfloat16).backend == "int8pack"
    assert choose_backend("native", None, torch.bfloat16).backend in ("mkl", "onednn")
    assert choose_backend("int8pack", q4, torch.bfloat16).backend != "int8pack"
    with pytest.raises(SpecDecError, match="invalid CPU linear mode"):
        resolve_mode("fast")


def _check_spec_equals_plain(model, prompts, n, drafters, ks):
    ref = generate(model, prompts, n)
    for kind in drafters:
        for k in ks:
            dec = SpeculativeDecoder(
                model,
                make_drafter(kind, model, skip="every2", exit_layer=1),
                "greedy",
                schedule=make_schedule("constant", k),
            )
            assert dec.generate(prompts, n).tokens == ref.tokens, (kind, k)


def _ort_available() -> bool:
    return cpu_features()["onnxruntime"] is not None


needs_ort = pytest.mark.skipif(
    not _ort_available(), reason="onnxruntime not installed (extra cpu-ort)"
)

# the modes that compute from the codes: (mode, dtype, the backends every linear of the tiny
# GGUFs gets); both are batch-invariant (specdec.models.batch_invariant)
PACKED_MODES = [
    pytest.param("native", "bfloat16", ("int4pack", "int8pack", "ort"), id="native"),
    pytest.param("ort", "float32", ("ort",), id="ort", marks=needs_ort),
]


@pytest.mark.parametrize("mode, dtype, backends", PACKED_MODES)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_packed_speculative_equals_plain_tiny(tiny_gguf, qtype, mode, dtype, backends, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_LINEAR", mode)
    model, tok = load_model(str(tiny_gguf("llama", qtype)), dtype=dtype, backend="torch")
    report = model.cpu_linear_report()
    assert report and all(v.startswith(backends) for v in report.values()), report
    # bf16 and int8 activations: verification rows are computed exactly as decode steps
    assert model.batch_invariant, model.batch_invariant_reason
    prompts = [tok.encode(t) for t in ["The quick brown fox", "1 + 2 = 3, 10 * 7 ="]]
    _check_spec_equals_plain(model, prompts, 20, ["ngram", "layerskip"], [1, 2, 4, 8])


@pytest.mark.parametrize("mode, dtype, backends", PACKED_MODES)
def test_packed_speculative_equals_plain_smollm2(smollm2_path, mode, dtype, backends, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_LINEAR", mode)
    model, tok = load_model(str(smollm2_path), dtype=dtype, backend="torch")
    assert any(v.startswith(backends[0]) for v in model.cpu_linear_report().values())
    prompts = [tok.encode("Repeat after me: one two three four, one two three four, one")]
    _check_spec_equals_plain(model, prompts, 16, ["ngram"], [4])


# --- ONNX Runtime's MatMulNBits (cpu_linear=ort): int8 activations, exact weight mapping ---


def _ort_reference(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """float64 model of MLAS's CompInt8 path: each block of an activation row is quantized
    to int8 with scale max|a| / 127, as MLAS does it in float32 (a times the reciprocal of
    the scale, rounded half to even), multiplied with the integer codes exactly, scaled by
    the activation's and the weight's block scales; Q4_1/int4 add the block constants
    m + 8 d times the block sums of the (unquantized) activation. Near a half this model
    and MLAS may round a code differently (float64 division: 18 of 6,000 random trials,
    this float32 one 6, 2026-12-03): the test exempts such rows from its tight bound."""
    g, n, k = q.group_size, q.out_features, q.in_features
    kb = k // g
    xb = x.double().reshape(-1, kb, g)
    a32 = x.float().reshape(-1, kb, g)
    sa32 = a32.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(sa32 > 0, 1 / sa32, torch.zeros_like(sa32))
    qa = torch.round(a32 * inv).double()
    sa = sa32.double()
    if q.bits == 4:
        qw = unpack_int4(q.qweight, g)[:, :k].double() - 8  # zero point 8
    else:
        qw = q.qweight[:, :k].double()
    dot = torch.einsum("mbj,nbj->mnb", qa, qw.view(n, kb, g))
    y = (dot * sa.squeeze(-1)[:, None, :] * q.scales[:, :kb].double()[None]).sum(-1)
    if q.mins is not None:  # d q + m = d (q - 8) + (m + 8 d)
        y = y + xb.sum(-1) @ (q.mins[:, :kb].double() + 8 * q.scales[:, :kb].double()).T
    return y


@needs_ort
@pytest.mark.parametrize("fmt", ["q4_0", "int4_g32", "int4_g64", "q8_0"])
@pytest.mark.parametrize("bias", [False, True])
def test_ort_matches_int8_activation_reference(fmt, bias):
    w = torch.randn(80, 192) * 0.05
    q = {
        "q4_0": _q4_0(w),
        "int4_g32": quantize_int4(w, 32),
        "int4_g64": quantize_int4(w, 64),
        "q8_0": _q8_0(w),
    }[fmt]
    b = torch.randn(q.out_features) if bias else None
    lin = CpuLinear("ort", dense=None, qweight=q, bias=b, dtype=torch.float32)
    x = torch.randn(2, 3, q.in_features)
    y = lin(x)
    assert y.shape == (2, 3, q.out_features) and y.dtype == torch.float32
    ref = _ort_reference(x.reshape(6, -1), q).view(2, 3, -1) + (0 if b is None else b.double())
    exact = x.double() @ q.dequantize().double().T + (0 if b is None else b.double())
    scale = exact.abs().max()
    # the algorithm: within fp32 rounding of the float64 model of it, on every row whose
    # activations hold no near-tie (a code within 1e-4 of a half, where MLAS's float32
    # scaling may round the other way: 6 of 36,000 random rows, all such, 2026-12-03);
    # those rows are held to the int8 bound below
    g = q.group_size
    a32 = x.reshape(6, -1, g)
    codes = a32 * (127 / a32.abs().amax(-1, keepdim=True))
    tie = ((codes.abs() - codes.abs().floor() - 0.5).abs() < 1e-4).flatten(1).any(1).view(2, 3)
    assert not tie.all()
    rows_err = (y.double() - ref).abs().amax(-1) / scale  # [2, 3]
    assert rows_err[~tie].max().item() < 2e-6
    # and what it costs against exact math: int8 activation rounding (~0.5 %), not more
    err = ((y.double() - exact).abs().max() / scale).item()
    assert 1e-5 < err < 3e-2, err


@needs_ort
@pytest.mark.parametrize("fmt", ["int4_g32", "q8_0", "q5_0", "q4_k", "q6_k"])
def test_ort_rows_do_not_depend_on_m(fmt):
    """Decode (M = 1) and verification (M = k + 1) must compute the same numbers per row,
    bit for bit, or greedy speculative decoding could leave plain greedy on a near-tie."""
    q = _ort_weight(fmt, 256, 256)
    lin = CpuLinear("ort", dense=None, qweight=q, bias=None, dtype=torch.float32)
    x = torch.randn(9, q.in_features)
    full = lin(x)
    for m in (1, 2, 5):
        assert torch.equal(lin(x[:m]), full[:m]), m
    for i in range(9):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1]), i


def _kquant(fmt: str, n: int, k: int) -> QuantizedWeight:
    import numpy as np

    from specdec.kernels.quant import from_gguf_kquant
    from tests.kernels.test_kquant import random_blocks

    return from_gguf_kquant(
        random_blocks(fmt, n, k, seed=int(np.random.default_rng().integers(1 << 30))), fmt, (n, k)
    )


ORT_EXACT = ["q4_0", "int4_g32", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def _ort_weight(fmt: str, n: int, k: int) -> QuantizedWeight:
    w = torch.randn(n, k) * 0.05
    if fmt == "q4_0":
        return _q4_0(w)
    if fmt == "int4_g32":
        return quantize_int4(w, 32)
    if fmt == "q8_0":
        return _q8_0(w)
    return _kquant(fmt, n, k)


@needs_ort
@pytest.mark.parametrize("fmt", ORT_EXACT)
def test_ort_weight_mapping_is_exact(fmt):
    """Every format's MatMulNBits blocks (codes, scales, offsets) reproduce its dequantized
    weight: with activations MLAS quantizes without rounding (int8 codes times a power of
    two, a +-127 in every 16-wide block), ORT's result equals float64 math on the gguf-exact
    dequantization up to fp32 summation; a wrong code, scale or offset costs ~1e-2."""
    n, k = 48, 512
    q = _ort_weight(fmt, n, k)
    codes = torch.randint(-127, 128, (7, k // 16, 16))
    codes[..., 0] = 127 * (torch.randint(0, 2, (7, k // 16)) * 2 - 1)  # every block's max
    codes = codes[:, :, torch.randperm(16)]  # at a random place
    # one power of two per 256 weights: a block of 16 or 32 shares its scale
    e = torch.randint(-8, 3, (7, k // 256, 1)).float().repeat_interleave(16, dim=1)
    x = (codes.float() * torch.exp2(e)).view(7, k)
    y = CpuLinear("ort", dense=None, qweight=q, bias=None, dtype=torch.float32)(x).double()
    ref = x.double() @ q.dequantize().double().T
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, (fmt, err)
    # random activations: the int8 rounding of the activation, nothing more
    x = torch.randn(7, k)
    y = CpuLinear("ort", dense=None, qweight=q, bias=None, dtype=torch.float32)(x).double()
    ref = x.double() @ q.dequantize().double().T
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert 1e-5 < err < 3e-2, (fmt, err)


@needs_ort
def test_ort_mixed_parts_fuse_exactly():
    """A fused weight whose parts have different formats (Qwen2.5-Coder's q/k Q5_0 next to a
    Q8_0 or Q6_K v) runs as one MatMulNBits: every part recoded to 8-bit codes on the
    smallest block; the same exactness as a single format, and the rows equal the parts'
    own results."""
    from specdec.models.ort_linear import OrtLinear

    k = 256
    parts = [
        _ort_weight(f, n, k) for f, n in (("q5_0", 64), ("q4_k", 32), ("q6_k", 16), ("q8_0", 16))
    ]
    lin = OrtLinear(parts, None)
    codes = torch.randint(-127, 128, (5, k // 16, 16))
    codes[..., 3] = -127
    x = (codes.float() * 0.25).view(5, k)
    y = lin(x).double()
    ref = x.double() @ torch.cat([p.dequantize().double() for p in parts]).T
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-5
    n = sum(p.out_features for p in parts)
    # one byte per code, fp32 scales and offsets on Q6_K's 16-wide blocks
    assert lin.bytes == n * k + 2 * 4 * n * (k // 16)
    x = torch.randn(3, k)
    y = lin(x)
    for i in range(3):
        assert torch.equal(lin(x[i : i + 1]), y[i : i + 1]), i


def test_auto_dtype(monkeypatch):
    """dtype auto: bf16 where the CPU has bf16 dot products (AVX512-BF16 / AMX-BF16), else
    fp32; CUDA stays fp32 until a GPU run has measured it."""
    import specdec.models.cpu_linear as cl
    from specdec.models.load import auto_dtype, parse_dtype

    flags = cl.cpu_features()
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setitem(flags, "bf16_native", native)
        assert auto_dtype("cpu") == want and parse_dtype("auto") == want
        assert auto_dtype("cuda") == torch.float32
    with pytest.raises(SpecDecError, match="choose one of float32, bfloat16, float16, auto"):
        parse_dtype("fp8")


def test_flags_within_torch_capability():
    """AVX-512 / AMX flags count only where torch's capability runs them: capped at AVX2
    (ATEN_CPU_CAPABILITY=avx2, or a torch that stops there) they are dropped, at DEFAULT
    AVX2 and FMA too; AVX512 and other architectures keep every flag."""
    import specdec.models.cpu_linear as cl

    zen4 = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}
    spr = zen4 | {"amx_tile", "amx_bf16", "avx_vnni", "avx_ne_convert"}
    assert cl.flags_within(spr, "AVX512") == spr
    assert cl.flags_within(spr, "AVX2") == {
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert"
    }  # fmt: skip
    assert cl.flags_within(zen4, "DEFAULT") == {"sse4_2", "f16c"}
    assert cl.flags_within(zen4, "ZVECTOR") == zen4


def test_isa_limit_in_the_environment_reaches_dtype_auto_and_the_names():
    """A process started with ATEN_CPU_CAPABILITY=avx2 sees no bf16 dot products (dtype
    auto = float32, as on an AVX2 CPU) and says so in the names results print; without a
    limit the record is empty."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, torch; from specdec.models import cpu_linear as c;"
        "from specdec.models.load import auto_dtype; from benchmarks.harness import cpu_name;"
        "from experiments.run import hardware_name; f = c.cpu_features();"
        "print(json.dumps([f['capability'], f['isa_limits'], f['bf16_native'], f['amx'],"
        " str(auto_dtype('cpu')), cpu_name(), hardware_name('cpu')]))"
    )
    from specdec.models.cpu_linear import ISA_LIMITS

    base = {k: v for k, v in os.environ.items() if k not in ISA_LIMITS}

    def run(extra):
        out = subprocess.run(
            [sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    limit = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    cap, limits, native, amx, dtype, cpu, hw = run(limit)
    assert cap == "AVX2" and limits == limit and not native and not amx
    assert dtype == "torch.float32"
    note = "(ISA limited: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)"
    assert cpu.endswith(note) and note in hw, (cpu, hw)
    cap, limits, *_, cpu, hw = run({})
    assert limits == {} and "ISA limited" not in cpu + hw


def test_ort_policy(monkeypatch):
    q4 = _weights()["int4_g32"]
    if _ort_available():
        assert choose_backend("ort", q4, torch.float32).backend == "ort"
        assert choose_backend("ort", _weights()["q8_0"], torch.float32).backend == "ort"
        # per-channel int8 (no power-of-2 block), padded K, dense weights: the dense
        # choice, with the reason
        for w in (_weights()["int8"], _weights()["int4_g64_padded"], None):
            c = choose_backend("ort", w, torch.float32)
            assert c.backend in ("mkl", "onednn") and c.reason.startswith("ort n/a"), c
        # a bf16 model would get ort nowhere: an error, not a silent dense run
        with pytest.raises(SpecDecError, match="computes in float32"):
            choose_backend("ort", q4, torch.bfloat16)
        picks = describe("ort")["backends"]
        assert picks["float32 4-bit"].startswith("ort") and picks["bfloat16 4-bit"].startswith(
            "error: cpu_linear=ort computes in float32"
        ), picks
    import specdec.models.cpu_linear as cl

    monkeypatch.setitem(cl.cpu_features(), "onnxruntime", None)
    with pytest.raises(SpecDecError, match="needs onnxruntime"):
        choose_backend("ort", q4, torch.float32)


@needs_ort
@pytest.mark.parametrize("mode, dtype", [("native", torch.bfloat16), ("ort", torch.float32)])
def test_copy_pointed_at_other_weights_runs_the_same_ort_kernel(mode, dtype):
    """A streamed layer's slot is a copy of a prepared Linear pointed at other tensors of the
    same weight: it must run the kernel its original chose (here ort, for a Q5_0 weight and a
    Q5_0 / Q6_K / Q8_0 fusion, in both modes that pick it) and compute the same numbers."""
    import copy

    from specdec.models.transformer import Linear

    k = 256
    q5 = _ort_weight("q5_0", 64, k)
    parts = [_ort_weight(f, n, k) for f, n in (("q5_0", 32), ("q6_k", 16), ("q8_0", 16))]
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(3, k).to(dtype)
    for lin in (Linear(q5), Linear(dense, parts=parts)):
        lin.prepare("torch", dtype, mode)
        assert lin.cpu.backend == "ort", lin.cpu_choice
        want = lin(x)
        slot = copy.copy(lin)  # the streaming runtime's clone, then its own tensors
        if lin.qweight is not None:
            slot.qweight = copy.copy(lin.qweight)
        else:
            slot.dense = lin.dense.clone()
        assert torch.equal(slot(x), want)


@needs_ort
def test_unprepared_linear_follows_the_mode(monkeypatch):
    """A Linear never prepared (no kernel of its own) picks its kernel from the mode, per
    weight: under cpu_linear=ort a dense weight runs the dense path, a mixed fusion ort."""
    from specdec.models.transformer import Linear

    monkeypatch.setenv("SPECDEC_CPU_LINEAR", "ort")
    k = 256
    parts = [_ort_weight(f, n, k) for f, n in (("q5_0", 32), ("q8_0", 16))]
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(3, k)
    ref = x.double() @ dense.double().T
    y = Linear(dense.clone())(x).double()  # dense: fp32 math
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-5
    y = Linear(dense.clone(), parts=parts)(x)
    ort = CpuLinear("ort", dense=None, qweight=parts, bias=None, dtype=torch.float32)(x)
    assert torch.equal(y, ort)


def test_forced_onednn_bf16_refused_without_bf16_prepack(monkeypatch):
    """On a CPU whose oneDNN cannot prepack bf16 (AVX2 without avx512bw/vl/dq or
    avx_ne_convert: _reorder_linear_weight raises deep inside torch), cpu_linear=onednn in
    bf16 is refused with one clear error, and the dense default names MKL instead."""
    from specdec.models import cpu_linear as cl

    feats = dict(cl.cpu_features(), mkldnn=True, avx512_bf16_ok=False, avx_ne_convert=False)
    monkeypatch.setattr(cl, "cpu_features", lambda: feats)
    with pytest.raises(SpecDecError, match="onednn torch.bfloat16 is not supported on this CPU"):
        cl.choose_backend("onednn", None, torch.bfloat16)
    assert cl.dense_choice(torch.bfloat16).backend == "mkl"
    assert cl.choose_backend("onednn", None, torch.float32).backend == "onednn"


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g64_padded", "q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_row_chunks_equal_one_call_and_single_rows(fmt, threads):
    """Calls whose row count is not a multiple of the kernels' 4-row block are split into
    near-equal chunks (`packed_row_chunks`, for thread balance): every row must equal, bit
    for bit, torch's kernel in one call and the row computed alone, and the chunks must
    come back in order (distinct random rows), matching float64 math on the weight."""
    from specdec.models.cpu_linear import packed_row_chunks

    assert packed_row_chunks(4) is None and packed_row_chunks(8) is None
    assert packed_row_chunks(5) == [3, 2] and packed_row_chunks(9) == [3, 3, 3]
    assert packed_row_chunks(17) == [4, 4, 3, 3, 3]
    q = _weights(n=160, k=192)[fmt]
    lin = CpuLinear(
        "int4pack" if q.bits == 4 else "int8pack",
        dense=None,
        qweight=q,
        bias=None,
        dtype=torch.bfloat16,
    )
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(17, q.in_features).to(torch.bfloat16)
        xp = torch.nn.functional.pad(x, (0, lin.k_pad)) if lin.k_pad else x
        for m in (5, 6, 7, 9, 11, 17):
            y = lin(x[:m])
            if lin.backend == "int4pack":
                one = torch.ops.aten._weight_int4pack_mm_for_cpu(xp[:m], lin.w, lin.group, lin.sz)
            else:
                one = torch.ops.aten._weight_int8pack_mm(x[:m], lin.w, lin.s)
            assert torch.equal(y, one), m
            for i in (0, m // 2, m - 1):
                assert torch.equal(y[i : i + 1], lin(x[i : i + 1])), (m, i)
        ref = x.double() @ q.dequantize().double().T
        err = ((lin(x).double() - ref).abs().max() / ref.abs().max()).item()
        assert err < (5e-2 if fmt == "q8_0" else 2e-2), err
    finally:
        torch.set_num_threads(old)


def test_q8_0_requantized_in_row_steps_equals_the_whole_weight(monkeypatch):
    """int8pack's per-channel requantization of Q8_0 runs in steps of rows (DEQUANT_STEP,
    here 5 rows of 13): the codes and scales of the formula applied to the whole float64
    dequantized weight, rows with their own max, bit for bit (row 3 is 100x larger, so a
    scale shared across a step would show)."""
    from specdec.kernels import quant
    from specdec.models.cpu_linear import q8_0_to_int8_per_channel

    n, k = 13, 96
    w = torch.randn(n, k) * 0.05
    w[3] *= 100
    q8 = _q8_0(w)
    monkeypatch.setitem(quant.DEQUANT_STEP, "cpu", 5 * k)
    assert len(q8.row_steps()) == 3
    q, s = q8_0_to_int8_per_channel(q8)
    dense = q8.scales.double().repeat_interleave(32, dim=1) * q8.qweight.double()
    ref_s = (dense.abs().amax(dim=1) / 127.0).float().clamp_min(1e-12)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    ref_q = torch.round(dense.float() / ref_s[:, None]).clamp(-127, 127).to(torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q)
    assert int(q.abs().amax(dim=1).min()) == 127  # every row spans its own range
