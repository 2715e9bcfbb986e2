"""ONNX Runtime's block-quantized GEMM (MLAS `MatMulNBits`) as a CPU linear backend.

ONNX Runtime (the `onnxruntime` CPU wheel, optional extra `cpu-ort`) ships hand-tuned AVX2 /
AVX-512 / NEON kernels for weights quantized in blocks along K: `com.microsoft.MatMulNBits`
computes Y = A @ dequant(B)^T with dequant = (code - zero_point) * scale per block of
`block_size` weights. With `accuracy_level=4` ("CompInt8") MLAS quantizes each block of the
activation row to int8 on the fly and multiplies int8 x int4/int8 codes with int32
accumulation, as llama.cpp does with its Q8_1 activation blocks: lossy (~5e-3 relative error
per GEMV, reported by `benchmarks.bench_cpu_linear`), and the fastest path MLAS has.

Mapping of the GGUF formats (exact for the weights; only the activation is rounded):

    Q4_0  w = d (q - 8)   -> 4-bit codes q, scale d, zero point 8 (MatMulNBits' default)
    Q4_1  w = d q + m     -> w = d (q - 8) + (m + 8 d): 4-bit codes q, scale d, zero point 8,
    int4  (the same)         plus sum_b (m + 8 d)[n, b] * (sum of A over block b), computed
                             in fp32 in the same graph (ReduceSum + MatMul over a [K/G, N]
                             matrix, 1/32 of the weight): MLAS's fast path takes integer zero
                             points only, and a zero point of 8 keeps the products centred
    Q8_0  w = d q         -> 8-bit codes q + 128, scale d, zero point 128 (the default)

MLAS keeps its own packed copy of the codes (prepacked when the session is created from
constant initializers). One `InferenceSession` per weight; a call passes the torch tensor's
buffer as numpy without a copy. The activation is fp32 (the only MLAS CompInt8 input type on
x86), so the backend applies to float32 models only. Nothing here parses a model file: the
graph is built by us from validated tensors, never loaded from disk.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from specdec.kernels.quant import QuantizedWeight, unpack_int4

BLOCK_SIZES = (16, 32, 64, 128, 256)
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


def ort_unsupported(w: QuantizedWeight | None, dtype: torch.dtype) -> str | None:
    """None when MatMulNBits can run `w` with `dtype` activations, else why not."""
    if ort_modules() is None:
        return "onnxruntime is not installed (pip install 'specdec[cpu-ort]')"
    if w is None:
        return "weight is dense"
    if dtype != torch.float32:
        return f"MatMulNBits' int8 path takes fp32 activations, not {str(dtype)[6:]}"
    if w.fmt not in ("q4_0", "q4_1", "int4", "q8_0"):
        return f"{w.fmt} has no MatMulNBits mapping"
    if w.group_size not in BLOCK_SIZES:
        return f"block size {w.group_size} not in {BLOCK_SIZES}"
    if w.in_features % w.group_size:
        return f"K = {w.in_features} is not a multiple of the block size {w.group_size}"
    return None


class OrtLinear:
    """One weight as a MatMulNBits session: `y = x @ W^T (+ bias)`, x [M, K] fp32."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, threads: int | None = None):
        why = ort_unsupported(w, torch.float32)
        if why is not None:
            raise ValueError(f"ort backend: {why}")
        from onnx import TensorProto, helper, numpy_helper

        n, k = w.shape
        bs = w.group_size
        kb = k // bs
        scales = w.scales[:, :kb].float().numpy().reshape(n, kb)
        init = [numpy_helper.from_array(np.ascontiguousarray(scales), "scales")]
        nodes = []
        if w.bits == 4:
            codes = unpack_int4(w.qweight, bs)[:, :k].numpy().reshape(n, kb, bs)
            blob = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # low first
        else:
            q = w.qweight[:, :k].numpy().astype(np.int16) + 128
            blob = q.astype(np.uint8).reshape(n, kb, bs)
        init.append(numpy_helper.from_array(np.ascontiguousarray(blob), "codes"))
        inputs = ["A", "codes", "scales"]  # zero point: the default (8 for 4-bit, 128 for 8)
        out = "Y0" if (w.mins is not None or bias is not None) else "Y"
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                inputs,
                [out],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=w.bits,
                block_size=bs,
                accuracy_level=ACCURACY_LEVEL,
            )
        )
        if w.mins is not None:  # + blocksum(A) @ (m + 8 d)^T, in fp32
            # d q + m = d (q - 8) + (m + 8 d): the default zero point 8 keeps the int8 x int4
            # products centred (zero point 0 doubled the activation-rounding error: 1.3e-2)
            mins = w.mins[:, :kb].float() + 8.0 * w.scales[:, :kb].float()
            mins_t = np.ascontiguousarray(mins.numpy().T)  # [kb, N]
            init += [
                numpy_helper.from_array(mins_t, "minsT"),
                numpy_helper.from_array(np.array([-1, kb, bs], dtype=np.int64), "blk_shape"),
                numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
            ]
            nodes += [
                helper.make_node("Reshape", ["A", "blk_shape"], ["Ab"]),
                helper.make_node("ReduceSum", ["Ab", "axis2"], ["Asum"], keepdims=0),
                helper.make_node("MatMul", ["Asum", "minsT"], ["corr"]),
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
        self.min_rows = 2 if (w.bits == 4 and BATCH_INVARIANT) else 1
        self._pad = np.zeros((self.min_rows, k), dtype=np.float32)
        self.out_features = n
        self.bytes = blob.nbytes + scales.nbytes + (0 if w.mins is None else n * kb * 4)

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
