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

GGUF's 5-bit and k-quant formats (the mix of a Q4_K_M file) keep their blocks' planes too,
with two more: `qhigh` (the high bits of each code) and `sub` (per-sub-block scales inside a
256-weight super-block). The planes are the block fields, split and laid side by side per
row, so a row of any plane is contiguous; `gemv` kernels live in `kquant_gemv.py`:

    q5_0  G = 32   qweight uint8 [N, K/2]    Q4_0 nibble order (low 4 bits of each code)
                   qhigh   uint8 [N, K/8]    4 bytes per block = little-endian u32 qh:
                                             bit j = 5th bit of element j
                   scales  fp16  [N, K/32]   d
                   w = d * (q - 16)                                 (5.5 bits/weight)
    q5_1  G = 32   as q5_0, plus mins fp16 [N, K/32] m; w = d * q + m  (6 bits/weight)
    q4_k  G = 256  qweight uint8 [N, K/2]    per 64-weight chunk, byte j (0..31) holds
                                             element j (low nibble) and j + 32 (high):
                                             the nibble order above with G = 64
                   scales  fp16  [N, K/256]  d        mins fp16 [N, K/256] dmin
                   sub     uint8 [N, K/256 * 12]   eight 6-bit scales sc_j and mins m_j of
                                             the 32-weight sub-blocks j, packed as in GGUF
                                             (j < 4: sc = b[j] & 63, m = b[j+4] & 63;
                                             j >= 4: sc = b[j+4] & 15 | (b[j-4] >> 6) << 4,
                                             m = b[j+4] >> 4 | (b[j] >> 6) << 4)
                   w = (d * sc_j) * q - (dmin * m_j)                (4.5 bits/weight)
    q5_k  G = 256  as q4_k, plus qhigh uint8 [N, K/256 * 32]: bit j of byte l is the 5th
                   bit of element 32 j + l of the super-block       (5.5 bits/weight)
    q6_k  G = 256  qweight uint8 [N, K/2]    low 4 bits, nibble order with G = 128
                   qhigh   uint8 [N, K/4]    per 128-weight half, bits 2t..2t+1 of byte l
                                             (0..31) are bits 4..5 of element 32 t + l
                   sub     int8  [N, K/16]   sc_j, one per 16 weights
                   scales  fp16  [N, K/256]  d
                   w = (d * sc_j) * (q - 32)                        (6.5625 bits/weight)

The products (d * sc_j), (dmin * m_j) are formed in fp32 first, as `gguf.quants` does, so
the torch dequantization equals gguf's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGUF block layouts: (bytes per block of 32, bits)
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
GGUF_BLOCK = 32
# GGUF 5-bit and k-quant layouts: (bytes per block, weights per block)
KQUANT_BLOCKS = {
    "q5_0": (22, 32),
    "q5_1": (24, 32),
    "q4_k": (144, 256),
    "q5_k": (176, 256),
    "q6_k": (210, 256),
}
KQUANT_BITS = {"q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6}
# weights per step of `QuantizedWeight.dequantize` (and of the CPU kernels' builds from
# codes): its fp32 / int32 temporaries, about 20 bytes per weight at once, stay bounded, and
# on CPU they stay in cache. One call over Qwen2.5-Coder's 151936 x 896 Q8_0 LM head took
# 506 ms and a 4096 x 4096 Q4_1 weight 97 ms, against 102 and 15 ms in steps of 2^20
# weights (2-vCPU AMD Zen 5, 2 threads, bf16 out; 2^18 and 2^22 were no faster). On a GPU
# the steps only bound the temporaries (not timed there).
DEQUANT_STEP = {"cpu": 1 << 20, "cuda": 1 << 24}


def row_steps(n: int, k: int, device_type: str = "cpu") -> list[tuple[int, int]]:
    """(start, stop) ranges of the rows of an [n, k] weight, each of at most DEQUANT_STEP
    weights on that device type (one row at least; one range at least)."""
    step = max(1, DEQUANT_STEP.get(device_type, DEQUANT_STEP["cuda"]) // max(k, 1))
    return [(a, min(n, a + step)) for a in range(0, max(n, 1), step)]


@dataclass
class QuantizedWeight:
    fmt: str  # "q8_0" | "q4_0" | "q4_1" | "int8" | "int4" | a KQUANT_BLOCKS key
    bits: int  # 4 or 8 (4, 5 or 6 for the KQUANT_BLOCKS formats)
    group_size: int
    shape: tuple[int, int]  # (out_features, in_features), unpadded
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    qhigh: torch.Tensor | None = None  # high bits of the codes (q5_*, q6_k)
    sub: torch.Tensor | None = None  # sub-block scales (k-quants)

    def _map(self, fn, shape: tuple[int, int] | None = None) -> QuantizedWeight:
        """The same weight with `fn` applied to every plane."""
        opt = lambda t: None if t is None else fn(t)
        return QuantizedWeight(
            self.fmt,
            self.bits,
            self.group_size,
            shape or self.shape,
            fn(self.qweight),
            fn(self.scales),
            opt(self.mins),
            opt(self.qhigh),
            opt(self.sub),
        )

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
        planes = (self.qweight, self.scales, self.mins, self.qhigh, self.sub)
        return sum(t.numel() * t.element_size() for t in planes if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self._map(lambda t: t.to(device))

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows (output features) in the given order: used to undo GGUF's q/k permutation
        and to gather embedding rows, without dequantizing."""
        return self._map(lambda t: t.index_select(0, index), (int(index.numel()), self.shape[1]))

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
        cat = lambda plane: (
            None if getattr(p0, plane) is None else torch.cat([getattr(p, plane) for p in parts])
        )
        return QuantizedWeight(
            p0.fmt,
            p0.bits,
            p0.group_size,
            (sum(p.out_features for p in parts), p0.in_features),
            cat("qweight"),
            cat("scales"),
            cat("mins"),
            cat("qhigh"),
            cat("sub"),
        )

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Rows start..stop (output features) as views of the planes: every plane is
        row-major with one row per output feature."""
        return self._map(lambda t: t[start:stop], (stop - start, self.shape[1]))

    def row_steps(self) -> list[tuple[int, int]]:
        """(start, stop) row ranges of at most DEQUANT_STEP weights (one range at least)."""
        return row_steps(*self.shape, self.device.type)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain-torch reference dequantization: [N, K] in `dtype` (computed in fp32), in
        steps of rows (`DEQUANT_STEP`: each element depends on its own block only, so the
        result is the same bit for bit)."""
        steps = self.row_steps()
        if len(steps) == 1:
            return self._dequantize(dtype)
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        for a, b in steps:
            out[a:b] = self.rows(a, b)._dequantize(dtype)
        return out

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        if self.fmt in KQUANT_BLOCKS:
            return dequantize_kquant(self).to(dtype).contiguous()
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


def _bit_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., B] -> uint8 [..., 8 // bits, B]: field t of each byte (bits t*bits...)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << bits) - 1)


def kquant_scale_min(sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k/q5_k `sub` uint8 [N, S * 12] -> 6-bit scales and mins, int32 [N, S, 8] each."""
    b = sub.view(sub.shape[0], -1, 12).to(torch.int32)  # [N, S, 12]
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def kquant_codes(w: QuantizedWeight) -> torch.Tensor:
    """Unsigned codes of a KQUANT_BLOCKS weight, int32 [N, K] in element order."""
    n, k = w.shape
    if w.fmt in ("q5_0", "q5_1"):
        lo = unpack_int4(w.qweight, 32)  # [N, K]
        hi = _bit_planes(w.qhigh.view(n, -1, 4), 1)  # [N, K/32, 8 (bit), 4 (byte)]
        hi = hi.transpose(-1, -2).reshape(n, k)  # element 8 * byte + bit
    elif w.fmt == "q4_k":
        return unpack_int4(w.qweight, 64).to(torch.int32)
    elif w.fmt == "q5_k":
        lo = unpack_int4(w.qweight, 64)
        hi = _bit_planes(w.qhigh.view(n, -1, 32), 1).reshape(n, k)  # element 32 j + l
    elif w.fmt == "q6_k":
        lo = unpack_int4(w.qweight, 128)
        hi = _bit_planes(w.qhigh.view(n, -1, 32), 2).reshape(n, k)  # element 32 t + l
    else:
        raise ValueError(f"not a k-quant format: {w.fmt}")
    return lo.to(torch.int32) | (hi.to(torch.int32) << 4)


def kquant_sub_scales(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 products of a k-quant's sub-blocks, formed as gguf.quants forms them:
    q6_k (d sc_j per 16 weights, None), q4_k / q5_k (d sc_j, dmin m_j per 32 weights);
    [N, K / sub-block] each."""
    d = w.scales.float()
    if w.fmt == "q6_k":
        return d.repeat_interleave(16, dim=1) * w.sub.float(), None
    sc, mn = kquant_scale_min(w.sub)  # [N, S, 8]
    return (d[..., None] * sc.float()).flatten(1), (w.mins.float()[..., None] * mn.float()).flatten(
        1
    )


def dequantize_kquant(w: QuantizedWeight) -> torch.Tensor:
    """fp32 [N, K] of a KQUANT_BLOCKS weight, computed in gguf.quants' order."""
    n, k = w.shape
    q = kquant_codes(w).float()
    d = w.scales.float()
    if w.fmt == "q5_0":
        return (q - 16.0) * d.repeat_interleave(32, dim=1)
    if w.fmt == "q5_1":
        return q * d.repeat_interleave(32, dim=1) + w.mins.float().repeat_interleave(32, dim=1)
    ds, dm = kquant_sub_scales(w)
    if w.fmt == "q6_k":
        return ((q - 32.0).view(n, -1, 16) * ds[..., None]).view(n, k)
    return (q.view(n, -1, 32) * ds[..., None] - dm[..., None]).view(n, k)


def from_gguf_kquant(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Split GGUF 5-bit / k-quant block bytes ([N, K/G * block_bytes] uint8) into planes."""
    n, k = shape
    if fmt not in KQUANT_BLOCKS:
        raise ValueError(f"not a GGUF k-quant format: {fmt}")
    bb, g = KQUANT_BLOCKS[fmt]
    if k % g:
        raise ValueError(f"GGUF {fmt} tensor with in_features={k} not a multiple of {g}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // g, bb)

    def plane(lo: int, hi: int, dtype=np.uint8) -> torch.Tensor:
        return torch.from_numpy(blocks[:, :, lo:hi].copy().view(dtype).reshape(n, -1))

    f16, mins, qhigh, sub = np.float16, None, None, None
    if fmt == "q5_0":
        scales, qhigh, q = plane(0, 2, f16), plane(2, 6), plane(6, 22)
    elif fmt == "q5_1":
        scales, mins, qhigh, q = plane(0, 2, f16), plane(2, 4, f16), plane(4, 8), plane(8, 24)
    elif fmt == "q4_k":
        scales, mins, sub, q = plane(0, 2, f16), plane(2, 4, f16), plane(4, 16), plane(16, 144)
    elif fmt == "q5_k":
        scales, mins, sub = plane(0, 2, f16), plane(2, 4, f16), plane(4, 16)
        qhigh, q = plane(16, 48), plane(48, 176)
    else:  # q6_k
        q, qhigh = plane(0, 128), plane(128, 192)
        sub, scales = plane(192, 208, np.int8), plane(208, 210, f16)
    return QuantizedWeight(fmt, KQUANT_BITS[fmt], g, (n, k), q, scales, mins, qhigh, sub)


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
