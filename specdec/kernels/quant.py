"""Weight-only quantized formats consumed by the GEMV kernel (`quant_gemv.py`).

One in-memory layout serves GGUF blocks and quantize-on-load checkpoints, so the
kernel has a single code path per bit width:

    qweight  8-bit: int8  [N, K_pad]           one byte per weight
             4-bit: uint8 [N, K_pad // 2]      per group of G weights, byte j of the
                                               group holds element j (low nibble) and
                                               element j + G/2 (high nibble): GGUF's
                                               Q4_0/Q4_1 order, generalised to any G
    scales   fp16 [N, K_pad // G]              d
    mins     fp16 [N, K_pad // G] or None      m (asymmetric 4-bit only)

    8-bit:            w = d * q                    (Q8_0: G = 32; int8: G = K_pad, per channel)
    4-bit, no mins:   w = d * (q - 8)              (Q4_0)
    4-bit, mins:      w = d * q + m                (Q4_1: G = 32; int4: G in {32, 64, 128})

N = out_features, K = in_features; K_pad rounds K up to a multiple of G (the padding
weights are zero). GGUF rows are already [out, in] blocks along `in` (shared/REFERENCE.md),
so loading a GGUF tensor is a reinterpretation of its bytes, never a dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGUF block layouts: (bytes per block of 32, bits)
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
GGUF_BLOCK = 32


@dataclass
class QuantizedWeight:
    fmt: str  # "q8_0" | "q4_0" | "q4_1" | "int8" | "int4"
    bits: int  # 4 or 8
    group_size: int
    shape: tuple[int, int]  # (out_features, in_features), unpadded
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def k_padded(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes a kernel must read to use this weight once (packed weights + scales + mins)."""
        n = self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2
        return n + (self.mins.numel() * 2 if self.mins is not None else 0)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(
            self.fmt,
            self.bits,
            self.group_size,
            self.shape,
            self.qweight.to(device),
            self.scales.to(device),
            None if self.mins is None else self.mins.to(device),
        )

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows (output features) in the given order: used to undo GGUF's q/k permutation
        and to gather embedding rows, without dequantizing."""
        return QuantizedWeight(
            self.fmt,
            self.bits,
            self.group_size,
            (int(index.numel()), self.shape[1]),
            self.qweight.index_select(0, index),
            self.scales.index_select(0, index),
            None if self.mins is None else self.mins.index_select(0, index),
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights with identical formats along the output dimension (fused QKV, gate/up)."""
        p0 = parts[0]
        for p in parts[1:]:
            if (p.fmt, p.group_size, p.k_padded, p.in_features) != (
                p0.fmt,
                p0.group_size,
                p0.k_padded,
                p0.in_features,
            ):
                raise ValueError("cat_rows needs weights of one format and input size")
        return QuantizedWeight(
            p0.fmt,
            p0.bits,
            p0.group_size,
            (sum(p.out_features for p in parts), p0.in_features),
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if p0.mins is None else torch.cat([p.mins for p in parts]),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain-torch reference dequantization: [N, K] in `dtype` (computed in fp32)."""
        n, k = self.shape
        g = self.group_size
        d = self.scales.float().repeat_interleave(g, dim=1)  # [N, K_pad]
        if self.bits == 8:
            w = self.qweight.float() * d
        else:
            q = unpack_int4(self.qweight, g).float()
            if self.mins is None:
                w = (q - 8.0) * d
            else:
                w = q * d + self.mins.float().repeat_interleave(g, dim=1)
        return w[:, :k].to(dtype).contiguous()


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K] in element order (see module docstring)."""
    n = packed.shape[0]
    half = group_size // 2
    p = packed.view(n, -1, half)  # [N, groups, G/2]
    lo = p & 0x0F
    hi = p >> 4
    return torch.cat([lo, hi], dim=2).reshape(n, -1)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 codes in [0, 15], [N, K] (K a multiple of group_size) -> packed uint8 [N, K/2]."""
    n = codes.shape[0]
    half = group_size // 2
    c = codes.to(torch.uint8).view(n, -1, 2, half)  # [N, groups, 2, G/2]
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, -1).contiguous()


def from_gguf_blocks(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Split GGUF block bytes ([N, K/32 * block_bytes] uint8) into the planes above."""
    n, k = shape
    if fmt not in GGUF_BLOCK_BYTES:
        raise ValueError(f"not a GGUF block format: {fmt}")
    if k % GGUF_BLOCK:
        raise ValueError(f"GGUF {fmt} tensor with in_features={k} not a multiple of 32")
    bb = GGUF_BLOCK_BYTES[fmt]
    nb = k // GGUF_BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, nb, bb)
    scales = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16).reshape(n, nb))
    mins = None
    if fmt == "q8_0":
        q = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(n, k))
        bits = 8
    else:
        off = 2
        if fmt == "q4_1":
            mins = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16).reshape(n, nb))
            off = 4
        q = torch.from_numpy(blocks[:, :, off:].copy().reshape(n, k // 2))
        bits = 4
    return QuantizedWeight(fmt, bits, GGUF_BLOCK, (n, k), q, scales, mins)


def _pad_k(w: torch.Tensor, multiple: int) -> torch.Tensor:
    k = w.shape[1]
    pad = (-k) % multiple
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one fp16 scale per output channel (group = whole row)."""
    n, k = w.shape
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12).half()
    q = torch.round(wf / scale.float()).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", 8, k, (n, k), q.contiguous(), scale.contiguous())


def quantize_int4(w: torch.Tensor, group_size: int = 64) -> QuantizedWeight:
    """Asymmetric int4 per group along K: w ~ s * q + m, q in [0, 15]."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"int4 group size must be 32, 64 or 128, got {group_size}")
    n, k = w.shape
    wf = _pad_k(w.float(), group_size).view(n, -1, group_size)
    lo = wf.amin(dim=2)
    hi = wf.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).half()
    mins = lo.half()
    q = torch.round((wf - mins.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    packed = pack_int4(q.view(n, -1).to(torch.uint8), group_size)
    return QuantizedWeight("int4", 4, group_size, (n, k), packed, scale, mins)
