"""ONNX Runtime's block-quantized GEMM (MLAS `MatMulNBits`) as a CPU linear backend.

ONNX Runtime (the `onnxruntime` CPU wheel, optional extra `cpu-ort`) ships hand-tuned AVX2 /
AVX-512 / NEON kernels for weights quantized in blocks along K: `com.microsoft.MatMulNBits`
computes Y = A @ dequant(B)^T with dequant = (code - zero_point) * scale per block of
`block_size` weights. With `accuracy_level=4` ("CompInt8") MLAS quantizes each block of the
activation row to int8 on the fly and multiplies int8 x int4/int8 codes with int32
accumulation, as llama.cpp does with its Q8_1 activation blocks: lossy (~5e-3 relative error
per GEMV, reported by `benchmarks.bench_cpu_linear`), and the fastest path MLAS has.

Mapping of the GGUF formats (exact for the weights; only the activation is rounded). Every
format becomes w = s (c - z) + o per block of B weights: codes c with MatMulNBits' default
zero point z (8 for 4-bit, 128 for 8-bit), fp32 scales s, and, where the format has an
offset o, a correction sum_b o[n, b] * (sum of A over block b) computed in fp32 in the same
graph (ReduceSum + MatMul over a [K/B, N] matrix): MLAS's fast path takes integer zero
points only, and the default zero points keep the int8 x code products centred (zero point
0 doubled the activation-rounding error: 1.3e-2). Formats with 5- or 6-bit codes ride the
8-bit kernel, their codes shifted to c = q - q0 + 128:

    Q4_0  w = d (q - 8)                   4-bit, B 32, s = d
    Q4_1  w = d q + m                     4-bit, B 32, s = d, o = m + 8 d
    int4  (as Q4_1, B = its group size)
    Q8_0  w = d q                         8-bit, B 32, c = q + 128, s = d
    Q5_0  w = d (q - 16)                  8-bit, B 32, c = q + 112, s = d
    Q5_1  w = d q + m                     8-bit, B 32, c = q + 112, s = d, o = m + 16 d
    Q4_K  w = (d sc_j) q - dmin m_j       4-bit, B 32 (sub-block j), s = d sc_j,
                                          o = 8 s - dmin m_j
    Q5_K  (as Q4_K, 5-bit codes)          8-bit, B 32, c = q + 112, o = 16 s - dmin m_j
    Q6_K  w = (d sc_j) (q - 32)           8-bit, B 16 (sub-block j), c = q + 96, s = d sc_j

The k-quant products d sc_j and dmin m_j are formed in fp32, as their dequantization does.

MLAS keeps its own packed copy of the codes (prepacked when the session is created from
constant initializers). One `InferenceSession` per weight; a call passes the torch tensor's
buffer as numpy without a copy. The activation is fp32 (the only MLAS CompInt8 input type on
x86): `cpu_linear=ort` runs float32 models; `native` (bfloat16) sends the formats torch has no
kernel for here, widening the activation to fp32 for the call. Nothing here parses a model
file: the graph is built by us from validated tensors, never loaded from disk.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref

import numpy as np
import torch

from specdec.kernels.quant import (
    KQUANT_BLOCKS,
    QuantizedWeight,
    kquant_codes,
    kquant_sub_scales,
    unpack_int4,
)

BLOCK_SIZES = (16, 32, 64, 128, 256)
ORT_FORMATS = ("q4_0", "q4_1", "int4", "q8_0", "int8", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# MatMulNBits block of the formats whose block is not their `group_size` (k-quants: the
# sub-block that carries one scale)
ORT_BLOCKS = {"q4_k": 32, "q5_k": 32, "q6_k": 16}
ACCURACY_LEVEL = 4  # CompInt8: int8 activations, int32 accumulation
BATCH_INVARIANT = os.environ.get("SPECDEC_ORT_BATCH_INVARIANT", "1") != "0"
# ORT's worker threads spin after a call by default; next to torch's own OpenMP threads on a
# few cores that steals the cores the next op needs ("1" restores ORT's default)
SPIN = os.environ.get("SPECDEC_ORT_SPIN", "0")


@functools.lru_cache(maxsize=1)
def ort_modules():
    """(onnxruntime, onnx) or None when the optional extra is not installed."""
    try:
        import onnx
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime, onnx


def ort_version() -> str | None:
    mods = ort_modules()
    return None if mods is None else mods[0].__version__


def ort_blocks(w: QuantizedWeight) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray | None]:
    """`w` as MatMulNBits blocks (module docstring): (bits, block size B, codes uint8
    [N, K] with the default zero point, scales fp32 [N, K/B], offsets fp32 [N, K/B] or
    None), with w = s (c - z) + o exactly."""
    n, k = w.shape
    fmt = w.fmt
    block = ORT_BLOCKS.get(fmt, w.group_size)
    offsets = None
    if fmt in KQUANT_BLOCKS:
        q = kquant_codes(w)  # int32 [N, K], unsigned
        bits = 4 if fmt == "q4_k" else 8
        zero = {"q4_k": 8, "q6_k": 32}.get(fmt, 16)  # the codes' centre: s (q - zero) + o
        if fmt in ("q5_0", "q5_1"):
            s = w.scales.float()
            if fmt == "q5_1":  # d q + m
                offsets = w.mins.float() + zero * s
        else:  # per sub-block (ORT_BLOCKS)
            s, dm = kquant_sub_scales(w)
            if dm is not None:  # (d sc_j) q - dmin m_j
                offsets = zero * s - dm
        codes = q if bits == 4 else q - zero + 128
    else:
        kb = k // block
        s = w.scales[:, :kb].float()
        if w.bits == 4:
            codes = unpack_int4(w.qweight, block)[:, :k].to(torch.int32)
            bits = 4
            if w.mins is not None:  # d q + m = d (q - 8) + (m + 8 d)
                offsets = w.mins[:, :kb].float() + 8.0 * s
        else:
            codes = w.qweight[:, :k].to(torch.int32) + 128
            bits = 8
    codes = codes.to(torch.uint8).numpy()
    to_np = lambda t: np.ascontiguousarray(t.contiguous().numpy(), dtype=np.float32)
    return bits, block, codes, to_np(s), None if offsets is None else to_np(offsets)


def fuse_blocks(blocks: list[tuple]) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray | None]:
    """Stack the `ort_blocks` of weights with one input size along N (a fused q/k/v or
    gate/up whose parts have different formats). Mixed bit widths move to 8-bit codes
    (c4 - 8 + 128: the same w); mixed block sizes to the smallest, each block's scale and
    offset repeated over the smaller blocks it covers. Exact, like each part's mapping."""
    if len(blocks) == 1:
        return blocks[0]
    bits = max(b[0] for b in blocks)
    bs = min(b[1] for b in blocks)
    codes, scales, offsets = [], [], []
    for b_bits, b_bs, c, sc, off in blocks:
        codes.append(c.astype(np.int32) + 120 if b_bits < bits else c)
        rep = b_bs // bs
        scales.append(np.repeat(sc, rep, axis=1))
        offsets.append(np.zeros_like(scales[-1]) if off is None else np.repeat(off, rep, axis=1))
    has_off = any(b[4] is not None for b in blocks)
    return (
        bits,
        bs,
        np.concatenate(codes).astype(np.uint8),
        np.ascontiguousarray(np.concatenate(scales)),
        np.ascontiguousarray(np.concatenate(offsets)) if has_off else None,
    )


def ort_unsupported(w: QuantizedWeight | None, dtype: torch.dtype) -> str | None:
    """None when MatMulNBits can run `w` with `dtype` activations, else why not."""
    if ort_modules() is None:
        return "onnxruntime is not installed (pip install 'specdec[cpu-ort]')"
    if w is None:
        return "weight is dense"
    if dtype != torch.float32:
        return f"MatMulNBits' int8 path takes fp32 activations, not {str(dtype)[6:]}"
    if w.fmt not in ORT_FORMATS:
        return f"{w.fmt} has no MatMulNBits mapping"
    block = ORT_BLOCKS.get(w.fmt, w.group_size)
    if block not in BLOCK_SIZES:
        return f"block size {block} not in {BLOCK_SIZES}"
    if w.in_features % block:
        return f"K = {w.in_features} is not a multiple of the block size {block}"
    return None


class OrtLinear:
    """One weight as a MatMulNBits session: `y = x @ W^T (+ bias)`, x [M, K] fp32.
    `handle` names it for compiled steps (`specdec.models.cpu_compile.ort_linear`)."""

    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _handles = itertools.count()

    @classmethod
    def by_handle(cls, handle: int) -> OrtLinear:
        lin = cls._live.get(handle)
        if lin is None:  # its model is gone; a compiled graph outlived it
            raise RuntimeError(f"OrtLinear {handle} no longer exists")
        return lin

    def __init__(
        self,
        w: QuantizedWeight | list[QuantizedWeight],
        bias: torch.Tensor | None,
        threads: int | None = None,
    ):
        parts = w if isinstance(w, list) else [w]
        for p in parts:
            why = ort_unsupported(p, torch.float32)
            if why is not None:
                raise ValueError(f"ort backend: {why}")
        from onnx import TensorProto, helper, numpy_helper

        bits, bs, codes, scales, offsets = fuse_blocks([ort_blocks(p) for p in parts])
        n, k = codes.shape
        kb = k // bs
        init = [numpy_helper.from_array(scales, "scales")]
        nodes = []
        if bits == 4:
            c = codes.reshape(n, kb, bs)
            blob = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
        else:
            blob = codes.reshape(n, kb, bs)
        init.append(numpy_helper.from_array(np.ascontiguousarray(blob), "codes"))
        inputs = ["A", "codes", "scales"]  # zero point: the default (8 for 4-bit, 128 for 8)
        out = "Y0" if (offsets is not None or bias is not None) else "Y"
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                inputs,
                [out],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=bits,
                block_size=bs,
                accuracy_level=ACCURACY_LEVEL,
            )
        )
        if offsets is not None:  # + blocksum(A) @ offsets^T, in fp32
            init += [
                numpy_helper.from_array(np.ascontiguousarray(offsets.T), "offsetsT"),  # [kb, N]
                numpy_helper.from_array(np.array([-1, kb, bs], dtype=np.int64), "blk_shape"),
                numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
            ]
            nodes += [
                helper.make_node("Reshape", ["A", "blk_shape"], ["Ab"]),
                helper.make_node("ReduceSum", ["Ab", "axis2"], ["Asum"], keepdims=0),
                helper.make_node("MatMul", ["Asum", "offsetsT"], ["corr"]),
                helper.make_node("Add", [out, "corr"], ["Y1" if bias is not None else "Y"]),
            ]
            out = "Y1"
        if bias is not None:
            init.append(numpy_helper.from_array(bias.float().numpy().copy(), "bias"))
            nodes.append(helper.make_node("Add", [out, "bias"], ["Y"]))
        graph = helper.make_graph(
            nodes,
            "specdec_linear",
            [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
            initializer=init,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        self.handle = next(OrtLinear._handles)
        OrtLinear._live[self.handle] = self
        self._model = model.SerializeToString()
        self._threads = threads
        self._sessions: dict[int, object] = {}
        _ = self.session  # built now for the current thread count: errors surface here
        self.in_features = k
        # MLAS runs 4-bit M = 1 through a GEMV kernel whose fp32 sums differ in the last bits
        # from the GEMM kernel of M >= 2 (which agree with each other, row by row): decode
        # pads to 2 rows so that decode and verification compute the same numbers and
        # greedy speculative decoding stays token-identical to plain greedy (8-bit: the same
        # kernel at every M)
        self.min_rows = 2 if (bits == 4 and BATCH_INVARIANT) else 1
        self._pad = np.zeros((self.min_rows, k), dtype=np.float32)
        self.out_features = n
        self.bytes = blob.nbytes + scales.nbytes + (0 if offsets is None else offsets.nbytes)

    @property
    def session(self):
        """The session for torch's current thread count (an ORT session sizes its thread
        pool when it is created; benchmarks change threads within one process)."""
        n = self._threads or torch.get_num_threads()
        entry = self._sessions.get(n)
        if entry is None:
            ort, _ = ort_modules()
            so = ort.SessionOptions()
            so.intra_op_num_threads = max(1, n)
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.log_severity_level = 3
            so.add_session_config_entry("session.intra_op.allow_spinning", SPIN)
            sess = ort.InferenceSession(self._model, so, providers=["CPUExecutionProvider"])
            entry = self._sessions[n] = (sess, sess.io_binding())
        return entry

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        a = x2.numpy()
        if m < self.min_rows:  # M = 1 -> 2 rows: the GEMM path every M >= 2 takes
            pad = self._pad  # [min_rows, K]; rows past m stay zero; consumed by this run only
            pad[:m] = a
            a = pad
        rows = a.shape[0]
        y = np.empty((rows, self.out_features), dtype=np.float32)  # fresh: callers keep it
        sess, io = self.session
        # IO binding: ORT reads the activation and writes the result in place (no copies,
        # no name lookups per call: ~10 us instead of ~25 us for session.run)
        io.bind_cpu_input("A", a)
        io.bind_output("Y", "cpu", 0, np.float32, [rows, self.out_features], y.ctypes.data)
        sess.run_with_iobinding(io)
        return torch.from_numpy(y[:m] if m < rows else y)
