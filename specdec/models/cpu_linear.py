"""CPU linear backends for `Linear` on the torch backend, chosen by measurement.

Every backend is a kernel torch already ships (no C++ of ours):

    mkl       F.linear on a dense copy (fp32 / bf16 / fp16): aten's BLAS path (MKL on x86)
    onednn    fp32 (bf16 where the CPU has it) oneDNN matmul on a weight prepacked once with
              torch.ops.mkldnn._reorder_linear_weight, run by _linear_pointwise (what
              inductor's freezing pass emits for a frozen linear)
    int4pack  torch.ops.aten._weight_int4pack_mm_for_cpu on the packed 4-bit codes
              (Q4_0 / Q4_1 / int4, group-wise scales and zeros; exact mapping, see below)
    int8pack  torch.ops.aten._weight_int8pack_mm on int8 codes with one scale per output
              channel (int8 as loaded: exact; Q8_0's per-32-block scales are requantized to
              per channel: lossy, see `q8_0_to_int8_per_channel`)
    ort       ONNX Runtime's MLAS MatMulNBits on the GGUF blocks (Q4_0 / Q4_1 / int4 /
              Q8_0, exact weight mapping) with int8-quantized fp32 activations, like
              llama.cpp: lossy, optional extra `cpu-ort` (`specdec.models.ort_linear`)

Modes (`--cpu-linear`, config `cpu_linear`, `SPECDEC_CPU_LINEAR`, `set_mode`,
`Transformer.setup(cpu_linear=...)`):

    dense   (default) fp32/bf16 math on the dequantized weight, the same numbers as the
            reference; the backend is onednn where it runs, otherwise mkl (named)
    native  computes from the packed codes: int4pack for 4-bit weights, int8pack for 8-bit
            ones; dense (unquantized) weights use the dense choice
    ort     float32: 4/8-bit GGUF weights through ONNX Runtime's MatMulNBits (int8
            activations; an error when onnxruntime is absent or the dtype is not float32),
            dense weights as in `dense`
    mkl | onednn | int4pack | int8pack   force one backend everywhere it applies (benchmarks)

Not a backend: torch.compile with inductor's freezing and its CPP GEMM template. Its fp32
GEMV is faster than oneDNN's at M = 1, but only inside a compiled graph whose weights are
constants (2 minutes of compilation per forward shape on 2 cores, and the whole compiled
forward was not reliably faster): `python -m benchmarks.bench_cpu_compile`, docs/results.md
"CPU backend: measurements". What compiling does pay for is the work around the linears: `cpu_compile=on`
(`specdec.models.cpu_compile`) compiles the decode steps with these kernels as opaque ops.

The choice (`choose_backend`) is a static policy justified by `python -m
benchmarks.bench_cpu_linear` (docs/results.md, "CPU backend: measurements"); it never depends on M: decode and
verification go through the same kernel so greedy speculative decoding stays token-identical
to plain greedy decoding in the same mode.

Int4 mapping. `_weight_int4pack_mm_for_cpu` computes w = (q - 8) * s + z per group with
`scales_and_zeros` [K/G, N, 2] in the activation dtype. Q4_0 (w = d (q - 8)) is s = d, z = 0;
Q4_1 and int4 (w = d q + m) are s = d, z = m + 8 d. Both are exact up to rounding z to the
activation dtype.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.errors import SpecDecError
from specdec.kernels.quant import (
    QuantizedWeight,
    kquant_codes,
    kquant_sub_scales,
    row_steps,
    unpack_int4,
)
from specdec.models.ort_linear import OrtLinear, ort_unsupported, ort_version
from specdec.models.settings import ProcessSetting

PACKED = ("int4pack", "int8pack", "ort")  # run from the codes: no dense copy
MODES = ("dense", "native", "ort", "mkl", "onednn", "int4pack", "int8pack")
ENV = "SPECDEC_CPU_LINEAR"
# batch-invariant calls (decode steps, verifications, batched or not) run in blocks of the
# largest of INVARIANT_BLOCKS rows the probe passes; a call of x [B, T, K] with more than
# PREFILL_T tokens per sequence is a prefill (the same call in plain and speculative
# decoding), left whole
INVARIANT_BLOCKS = (32, 16, 8)
PREFILL_T = 64


# environment variables that cap the instruction sets of torch's own kernels, oneDNN and MKL
# (set all three to run a newer x86 CPU as an older one, e.g. AVX2: README "CPU backend")
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def flags_within(flags: set[str], capability: str) -> set[str]:
    """The /proc/cpuinfo flags that torch's CPU capability lets this process use.

    `ATEN_CPU_CAPABILITY=avx2` (or a CPU torch only runs at AVX2) caps torch's kernels at
    AVX2: the AVX-512 and AMX flags then describe instructions nothing here will run, so
    the backends and `dtype auto` must not count on them; `default` drops AVX2 and FMA too.
    """
    cap = capability.upper()
    if cap == "AVX2":
        return {f for f in flags if not f.startswith(("avx512", "amx"))}
    if cap == "DEFAULT":
        return {f for f in flags if not f.startswith(("avx", "amx", "fma"))}
    return set(flags)  # AVX512 (x86: all of it), or a non-x86 capability


@functools.lru_cache(maxsize=1)
def cpu_features() -> dict:
    """What the backends need: torch's CPU capability, the /proc/cpuinfo flags it lets this
    process use (`flags_within`), ops present, and the ISA limits set in the environment."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    flags = flags_within(flags, capability)
    aten = torch.ops.aten
    return {
        "capability": capability,
        "isa_limits": {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)},
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
        "avx512_bf16_ok": {"avx512bw", "avx512vl", "avx512dq"} <= flags,
        "avx_ne_convert": "avx_ne_convert" in flags,
        # bf16 dot products in hardware (vdpbf16ps / AMX tiles): bf16 beats fp32 (dtype auto)
        "bf16_native": bool({"avx512_bf16", "amx_bf16"} & flags),
        "amx": "amx_tile" in flags,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "int4pack": hasattr(aten, "_weight_int4pack_mm_for_cpu"),
        "int8pack": hasattr(aten, "_weight_int8pack_mm"),
        "onnxruntime": ort_version(),
    }


def isa_note() -> str:
    """'' or ' (ISA limited: VAR=value ...)' for CPU names in printed results."""
    limits = cpu_features()["isa_limits"]
    return f" (ISA limited: {' '.join(f'{k}={v}' for k, v in limits.items())})" if limits else ""


_SETTING = ProcessSetting("CPU linear mode", ENV, MODES, "dense", booleans=False)
# force the CPU linear mode for this process (None restores $SPECDEC_CPU_LINEAR); resolve one
set_mode = _SETTING.force
resolve_mode = _SETTING.resolve


@dataclass(frozen=True)
class Choice:
    backend: str  # mkl | onednn | int4pack | int8pack | ort
    reason: str


def dense_choice(dtype: torch.dtype) -> Choice:
    f = cpu_features()
    if dtype == torch.float32:
        if f["mkldnn"]:
            return Choice(
                "onednn", "fp32: oneDNN prepacked beats MKL at every M (bench_cpu_linear)"
            )
        return Choice("mkl", "fp32: torch built without oneDNN (next best: MKL)")
    if dtype == torch.bfloat16:
        if f["mkldnn"] and (f["avx512_bf16_ok"] or f["avx_ne_convert"]):
            return Choice(
                "onednn", "bf16: oneDNN prepacked (CPU has avx512bw/vl/dq or avx_ne_convert)"
            )
        return Choice(
            "mkl",
            "bf16: oneDNN's bf16 prepack needs avx512bw/vl/dq or avx_ne_convert (next best: MKL)",
        )
    return Choice("mkl", f"{dtype}: only MKL/aten F.linear")


def _packed_ok(backend: str, w: QuantizedWeight | None) -> str | None:
    """None when `backend` can run `w` from its codes, else why not."""
    f = cpu_features()
    if w is None:
        return "weight is dense"
    if not f[backend]:
        return f"torch has no {backend} CPU op"
    if not f["avx2"]:
        return f"{backend} needs AVX2 to beat the dense path (capability {f['capability']})"
    if backend == "int4pack":
        if w.fmt not in INT4PACK_FORMATS:
            return f"{w.fmt} is not one of the 4-bit formats {', '.join(INT4PACK_FORMATS)}"
        if w.out_features % 16:
            return f"N = {w.out_features} is not a multiple of 16 (int4pack's tiles)"
        if w.group_size not in (32, 64, 128, 256):
            return f"group size {w.group_size} not in 32/64/128/256"
    if backend == "int8pack" and w.bits != 8:
        return f"{w.fmt} is not 8-bit"
    return None


def choose_backend(mode: str, w: QuantizedWeight | None, dtype: torch.dtype) -> Choice:
    """The backend for one weight (w None: dense weight) in `mode` and compute `dtype`."""
    if mode == "mkl":
        return Choice("mkl", "forced")
    if mode == "onednn":
        if dtype != torch.float32 and dense_choice(dtype).backend != "onednn":
            raise SpecDecError(f"onednn {dtype} is not supported on this CPU")
        if not cpu_features()["mkldnn"]:
            raise SpecDecError("onednn requested but torch was built without it")
        return Choice("onednn", "forced")
    if mode == "ort":
        if cpu_features()["onnxruntime"] is None:
            raise SpecDecError(
                "cpu_linear=ort needs onnxruntime: pip install 'specdec[cpu-ort]' "
                "(or choose dense / native)"
            )
        if dtype != torch.float32:  # would leave every weight on the dense path, silently
            raise SpecDecError(
                f"cpu_linear=ort computes in float32 (MatMulNBits' int8 path takes fp32 "
                f"activations), not {str(dtype)[6:]}: use dtype float32"
            )
        why = ort_unsupported(w, dtype)
        if why is None:
            return Choice("ort", f"ort: {w.fmt} blocks -> MatMulNBits (int8 activations)")
        c = dense_choice(dtype)
        return Choice(c.backend, f"ort n/a ({why}); {c.reason}")
    if mode in ("int4pack", "int8pack"):
        why = _packed_ok(mode, w)
        if why is None:
            return Choice(mode, "forced")
        c = dense_choice(dtype)
        return Choice(c.backend, f"{mode} n/a ({why}); {c.reason}")
    if mode == "native" and w is not None:
        packed = "int4pack" if w.bits == 4 else "int8pack"  # others: refused by _packed_ok
        if (
            dtype != torch.float32
            and w.fmt in NATIVE_ORT
            and cpu_features()["onnxruntime"] is not None
            and ort_unsupported(w, torch.float32) is None
        ):
            return Choice("ort", f"native: {w.fmt} blocks -> ort MatMulNBits ({NATIVE_ORT[w.fmt]})")
        if dtype == torch.float32:
            c = dense_choice(dtype)
            return Choice(
                c.backend,
                f"native: {packed}'s fp32-activation path is 7-12x slower than its bf16 one "
                f"(bench_cpu_linear); use bfloat16; {c.reason}",
            )
        why = _packed_ok(packed, w)
        if why is None:
            return Choice(packed, f"native: {w.fmt} codes -> {packed}")
        c = dense_choice(dtype)
        return Choice(c.backend, f"native: {packed} n/a ({why}); {c.reason}")
    return dense_choice(dtype)


def mixed_ort_choice(mode: str, parts: list[QuantizedWeight], dtype: torch.dtype) -> Choice | None:
    """The ort choice for a fused weight whose quantized parts have different formats (the
    builder fuses them dense; MatMulNBits runs them from their codes as one 8-bit weight,
    `ort_linear.fuse_blocks`), or None: another mode, or a part ort cannot map."""
    if cpu_features()["onnxruntime"] is None:
        return None
    if not (
        mode == "ort" and dtype == torch.float32 or mode == "native" and dtype != torch.float32
    ):
        return None
    if any(ort_unsupported(p, torch.float32) is not None for p in parts):
        return None
    fmts = "/".join(p.fmt for p in parts)
    return Choice(
        "ort", f"ort: mixed {fmts} parts -> one MatMulNBits (8-bit codes, int8 activations)"
    )


def q8_0_to_int8_per_channel(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit weight -> (int8 codes [N, K], fp32 per-channel scales [N]) for int8pack.

    Per-channel int8 ("int8" format) passes through unchanged. Q8_0's 32-wide blocks each
    have their own scale d_b: the dequantized row is requantized with s = max|w| / 127,
    q = round(w / s). That adds up to s/2 of error per weight (reported by the benchmarks).
    """
    if w.group_size == w.k_padded:
        return w.qweight[:, : w.in_features].contiguous(), w.scales[:, 0].float()
    # in steps of rows (each row has its own scale): whole, an LM head's fp32 temporaries
    # took ~16 bytes per weight at once (Qwen2.5-Coder's 151936 x 896: its bf16 native
    # setup peaked at 4,220 MiB, 3,029 MiB in steps)
    q = torch.empty(w.shape, dtype=torch.int8)
    s = torch.empty(w.out_features)
    for a, b in w.row_steps():
        dense = w.rows(a, b).dequantize(torch.float32)  # [rows, K]
        s[a:b] = (dense.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q[a:b] = torch.round(dense / s[a:b, None]).clamp(-127, 127)
    return q, s


INT4PACK_FORMATS = ("q4_0", "q4_1", "int4", "q4_k")
# formats `native` (bf16) runs through ONNX Runtime's MatMulNBits when it is installed (int8
# activations; the bf16 activation is widened to fp32 for the call), and why
NATIVE_ORT = {
    "q5_0": "torch has no kernel for 5-bit codes",
    "q5_1": "torch has no kernel for 5-bit codes",
    "q5_k": "torch has no kernel for 5-bit codes",
    "q6_k": "torch has no kernel for 6-bit codes",
}
# (Q8_0 stays on int8pack: through ort, Qwen2.5-Coder's 151936 x 896 LM head ran 1.03x
# faster end to end, SmolLM2's 49152 x 576 one 0.98x, AMD Zen 4; eleventh session)


def int4_groups(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A 4-bit weight as group-wise w = s (q - 8) + z -> (codes int32 [N, K_pad], s and z
    fp32 [N, K_pad / g], g). Q4_0 is s = d, z = 0; Q4_1 / int4 (d q + m) is s = d,
    z = m + 8 d; Q4_K's 32-weight sub-block j ((d sc_j) q - dmin m_j) is s = d sc_j,
    z = 8 s - dmin m_j, with the products formed in fp32 as its dequantization does."""
    if w.fmt == "q4_k":
        s, dm = kquant_sub_scales(w)  # [N, K/32]
        return kquant_codes(w), s, 8.0 * s - dm, 32
    d = w.scales.float()  # [N, K_pad / G]
    z = torch.zeros_like(d) if w.mins is None else w.mins.float() + 8.0 * d
    return unpack_int4(w.qweight, w.group_size).to(torch.int32), d, z, w.group_size


def int4pack_planes(
    w: QuantizedWeight, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """4-bit weight -> (int4pack weight, scales_and_zeros [K_pad/g, N, 2] in `dtype`, g)."""
    codes, s, z, g = int4_groups(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/g, N, 2]
    return packed, sz, g


def _spread(shape: tuple[int, ...], e: int, g: torch.Generator) -> torch.Tensor:
    """Random powers of two 2^-e .. 2^e: magnitudes over many binades, so sums round."""
    return torch.exp2(torch.randint(-e, e + 1, shape, generator=g, dtype=torch.int8).float())


class CpuLinear:
    """A prepared weight: `y = kernel(x) (+ bias)` for x [..., K] -> [..., N]."""

    def __init__(
        self,
        backend: str,
        *,
        dense: torch.Tensor | None,
        qweight: QuantizedWeight | list[QuantizedWeight] | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ):
        self.backend = backend
        self.dtype = dtype
        self.bias = bias
        self.k_pad = 0
        self.invariant = False  # rows independent of M (`make_invariant`)
        self.pad_single = False  # one row computed as two (`make_invariant`)
        self.block = INVARIANT_BLOCKS[-1]  # rows per call of a batch-invariant call
        parts = qweight if isinstance(qweight, list) else None  # ort: mixed fused parts
        if parts is not None:
            if backend != "ort":
                raise ValueError("only the ort backend runs a list of quantized parts")
            qweight = None
        self.in_features = (
            dense.shape[1] if dense is not None else (parts or [qweight])[0].in_features
        )
        if backend == "mkl":
            self.w = dense
        elif backend == "onednn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(dense, None)
        elif backend == "int4pack":
            self.w, self.sz, self.group = int4pack_planes(qweight, dtype)
            self.k_pad = qweight.k_padded - qweight.in_features
        elif backend == "int8pack":
            q, s = q8_0_to_int8_per_channel(qweight)
            self.w, self.s = q, s.to(dtype)
        elif backend == "ort":
            self.w = OrtLinear(parts or qweight, bias)
        else:
            raise ValueError(f"unknown CPU linear backend {backend}")
        self.out_features = (
            dense.shape[0] if dense is not None else sum(p.out_features for p in parts or [qweight])
        )

    def nbytes(self) -> int:
        """Weight bytes one call reads."""
        if self.backend == "mkl":
            return self.w.numel() * self.w.element_size()
        if self.backend == "onednn":
            return self.out_features * self.w.shape[1] * self.dtype.itemsize
        if self.backend == "int4pack":
            return self.w.numel() + self.sz.numel() * self.sz.element_size()
        if self.backend == "ort":
            return self.w.bytes
        return self.w.numel() + self.s.numel() * self.s.element_size()

    def make_invariant(self, verdicts: dict) -> str | None:
        """Batch-invariant calls from now on (`specdec.models.batch_invariant`): a row's
        result must not depend on how many rows share the call. Probes, once per backend,
        shape and dtype (`verdicts` caches them), whether every row of calls of 1 .. 32 rows
        equals, bit for bit, the same row computed in a call of 2. Where only M = 1 differs
        (a GEMV kernel beside the GEMM one: oneDNN fp32 with K >= 1536, oneDNN bf16 with
        K = 1536 on AVX-512 without AMX), a single row is computed as two; larger calls (but
        prefills) run in blocks of the largest size in INVARIANT_BLOCKS whose calls all
        agree (oneDNN bf16 on AMX: 32; row 0 of 33 rows differs).

        The probe runs on a twin of the weight (`_cancelling_twin`: same backend, shape and
        dtype, so the same kernels) whose outputs are sums that cancel exactly: what is left
        is rounding, so any change of summation order shows. Random inputs on the real
        weights hide it in bfloat16: a kernel that sums in another order changes one output
        in thousands by one bf16 ulp (seen: oneDNN bf16 [576x1536] on AMD EPYC Zen 4,
        M = 1 vs 2, found by no random probe, broke greedy speculative == plain).
        -> None, or why rows depend on M on this machine."""
        key = (self.backend, self.out_features, self.in_features, self.dtype)
        if key not in verdicts:
            g = torch.Generator().manual_seed(0)
            lin, x = self._cancelling_twin(g), None
            if lin is None:  # ort: integer sums, order-free; random rows on its own weight
                lin = self
                x = torch.randn(INVARIANT_BLOCKS[0] + 1, self.in_features, generator=g)
            else:
                x = lin._cancelling_rows(INVARIANT_BLOCKS[0] + 1, g)
            x = x.to(self.dtype)
            canon = torch.cat([lin._call(x[r : r + 2].contiguous())[:1] for r in range(len(x) - 1)])
            rows = range(1, INVARIANT_BLOCKS[0] + 1)
            differ = [
                m for m in rows[2:] if not torch.equal(lin._call(x[:m].contiguous()), canon[:m])
            ]
            single = not torch.equal(lin._call(x[:1].contiguous()), canon[:1])
            ok = [b for b in INVARIANT_BLOCKS if not differ or differ[0] > b]
            why = None
            if not ok:
                why = (
                    f"{self.backend} {str(self.dtype)[6:]} [{self.out_features}x"
                    f"{self.in_features}]: rows of {differ[0]}-row calls differ from the "
                    "same rows in 2-row calls"
                )
            verdicts[key] = (single, ok[0] if ok else None, why)
        self.pad_single, self.block, problem = verdicts[key]
        self.invariant = problem is None
        return problem

    def _cancelling_twin(self, g: torch.Generator) -> CpuLinear | None:
        """A linear of the same backend, shape and dtype whose weight columns K/2 .. K-1 are
        the negated columns 0 .. K/2-1 (more exactly: of the first `self._half` columns),
        with magnitudes spread over 2^-6 .. 2^6; `_cancelling_rows` repeats the inputs the
        same way, so every output is exactly 0 in real arithmetic and what a kernel returns
        is its rounding. bf16 x bf16 products are exact in fp32, so only the order of the
        sums decides it. None for ort (int8 x int8 sums in int32: no order to detect)."""
        n, k = self.out_features, self.in_features
        bias = None if self.bias is None else torch.zeros_like(self.bias)
        if self.backend in ("mkl", "onednn"):
            h = k // 2
            # drawn in steps of rows straight into the compute dtype: drawn whole, an LM head's
            # fp32 and int64 temporaries took ~20 bytes per weight at once (Qwen2.5-Coder's
            # 151936 x 896: its bf16 dense setup peaked at 4,222 MiB, 2,665 MiB in steps).
            # Rounding to the dtype keeps the columns' exact negation (round to nearest even
            # is symmetric)
            w = torch.empty(n, k, dtype=self.dtype)
            for a, b in row_steps(n, k):
                c = torch.randn(b - a, k, generator=g) * _spread((b - a, k), 6, g)
                c[:, h : 2 * h] = -c[:, :h]
                c[:, 2 * h :] = 0
                w[a:b] = c
            twin = CpuLinear(self.backend, dense=w, qweight=None, bias=bias, dtype=self.dtype)
        elif self.backend == "int8pack":
            h = k // 2
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            q[:, h : 2 * h] = -q[:, :h]
            q[:, 2 * h :] = 0
            twin = CpuLinear.__new__(CpuLinear)
            twin.__dict__.update(self.__dict__)
            twin.w, twin.s, twin.bias = q, _spread((n,), 4, g).to(self.dtype), bias
        elif self.backend == "int4pack":  # w = s (q - 8) per group of self.group columns
            kp, grp = k + self.k_pad, self.group
            h = (k // (2 * grp)) * grp  # whole groups, inside the real K
            codes = torch.full((n, kp), 8, dtype=torch.int32)
            codes[:, :h] = torch.randint(1, 16, (n, h), generator=g, dtype=torch.int32)
            codes[:, h : 2 * h] = 16 - codes[:, :h]
            s = _spread((n, kp // grp), 6, g)
            s[:, h // grp : 2 * h // grp] = s[:, : h // grp]
            twin = CpuLinear.__new__(CpuLinear)
            twin.__dict__.update(self.__dict__)
            twin.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            sz = torch.stack([s, torch.zeros_like(s)], dim=-1).transpose(0, 1)
            twin.sz, twin.bias = sz.contiguous().to(self.dtype), bias
        else:
            return None
        twin._half = h
        return twin

    def _cancelling_rows(self, m: int, g: torch.Generator) -> torch.Tensor:
        """m input rows for a `_cancelling_twin`: columns K/2 .. repeat columns 0 .. K/2-1."""
        h = self._half
        x = torch.randn(m, self.in_features, generator=g) * _spread((m, self.in_features), 8, g)
        x[:, h : 2 * h] = x[:, :h]
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.invariant:
            return self._call(x)
        m = x.numel() // x.shape[-1]
        if m == 1 and self.pad_single:
            y = self._call(x.reshape(1, -1).expand(2, -1).contiguous())[:1]
            return y.view(*x.shape[:-1], self.out_features)
        if m > self.block and (x.dim() < 3 or x.shape[-2] <= PREFILL_T):
            x2 = x.reshape(m, x.shape[-1])
            y = torch.cat([self(c) for c in x2.split(self.block)])
            return y.view(*x.shape[:-1], self.out_features)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "mkl":
            return F.linear(x, self.w, self.bias)
        if self.backend == "onednn":
            return _kernels().onednn_linear(x, self.w, self.bias)
        lead = x.shape[:-1]
        if self.backend == "ort":  # bias inside the graph; fp32 in and out (native: bf16)
            if torch.compiler.is_compiling():
                from specdec.models import cpu_compile

                x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
                y = cpu_compile.ort_linear(x2, self.w.handle)
            else:
                y = self.w(x)
            return y.view(*lead, self.out_features).to(self.dtype)
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if self.backend == "int4pack":
            if self.k_pad:
                x2 = F.pad(x2, (0, self.k_pad))
            y = _kernels().int4pack_mm(x2, self.w, self.group, self.sz)
        else:
            y = _kernels().int8pack_mm(x2, self.w, self.s)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


PACKED_BLOCK_M = 4  # rows per block of torch's int4pack / int8pack CPU kernels


def packed_row_chunks(m: int) -> list[int] | None:
    """How to split an M-row call of torch's weight-only kernels (int4pack, int8pack) so
    that every thread gets the same work: None for one call, else near-equal chunk sizes.

    Both kernels walk blocks of 4 rows (x 32 or 64 columns for int4pack, 4 for int8pack),
    unpack each weight block once per row block, and hand the (row block, column block)
    pairs to the threads in contiguous, row-block-major ranges. When M is not a multiple
    of 4 the last row block is short, so with 2 threads one thread gets the full rows and
    the other the short ones: a 5-row call costs as much as 8 rows (30 int4 gate-up
    weights, 2 threads, AVX2 EPYC: 29.6 ms for M = 5 against 7.3 ms for M = 1 and 14.9 for
    M = 4). Calls of at most 4 rows split the columns evenly instead: 3 + 2 rows take 23.8
    ms, with as many passes over the weights as one call (`python -m
    benchmarks.bench_cpu_linear` times both; its "one call" rows are torch's kernel alone).
    A row's numbers do not depend on the rows beside it in these kernels (each row sums
    over K in the same order), so the chunks equal the single call bit for bit
    (tests/models/test_cpu_linear.py)."""
    if m <= PACKED_BLOCK_M or m % PACKED_BLOCK_M == 0:
        return None
    n = -(-m // PACKED_BLOCK_M)
    base, extra = divmod(m, n)
    return [base + (i < extra) for i in range(n)]


class EagerKernels:
    """The kernels torch ships, called directly (eager forwards; `specdec.models.cpu_compile`
    wraps these calls as opaque ops for compiled steps). The packed kernels split calls
    whose row count leaves the threads unbalanced (`packed_row_chunks`)."""

    @staticmethod
    def onednn_linear(x, w, bias):
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

    @staticmethod
    def int4pack_mm(x, w, group, sz):
        return _in_row_chunks(torch.ops.aten._weight_int4pack_mm_for_cpu, x, w, group, sz)

    @staticmethod
    def int8pack_mm(x, w, s):
        return _in_row_chunks(torch.ops.aten._weight_int8pack_mm, x, w, s)


def _in_row_chunks(kernel, x: torch.Tensor, *args) -> torch.Tensor:
    """`kernel(x, *args)` for x [M, K], called per `packed_row_chunks(M)` chunk of rows."""
    chunks = packed_row_chunks(x.shape[0])
    if chunks is None:
        return kernel(x, *args)
    return torch.cat([kernel(c, *args) for c in x.split(chunks)])


def _kernels():
    """`EagerKernels`, or inside a compiled step the same calls as opaque custom ops
    (`specdec.models.cpu_compile`)."""
    if torch.compiler.is_compiling():
        from specdec.models import cpu_compile

        return cpu_compile
    return EagerKernels


def describe(mode: str | None = None) -> dict:
    """The environment record: the mode, the CPU features and what each kind of weight gets."""
    mode = resolve_mode(mode)
    q4 = QuantizedWeight("q4_1", 4, 32, (1, 32), torch.empty(0), torch.empty(0))
    q8 = QuantizedWeight("q8_0", 8, 32, (1, 32), torch.empty(0), torch.empty(0))
    q5 = QuantizedWeight("q5_0", 5, 32, (1, 32), torch.empty(0), torch.empty(0))
    picks = {}
    for dt in (torch.float32, torch.bfloat16):
        for kind, w in (("dense", None), ("4-bit", q4), ("8-bit", q8), ("5/6-bit", q5)):
            try:
                c = choose_backend(mode, w, dt)
                pick = f"{c.backend}: {c.reason}"
            except SpecDecError as e:  # a forced mode this dtype cannot run (ort, onednn)
                pick = f"error: {e}"
            picks[f"{str(dt)[6:]} {kind}"] = pick
    return {"mode": mode, "features": cpu_features(), "backends": picks}
