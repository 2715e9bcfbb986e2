"""A streamed unit (a layer or the LM head) as one flat byte buffer.

Every weight a unit's forward reads (`fields`) lies at an ALIGN-byte aligned offset of the
buffer; `Unit.views` gives the tensors over a buffer and `assign` points a module at them.
Packed planes keep their dtype, dense weights, biases and norms are stored in the compute
dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specdec.models.transformer import Linear, RMSNorm

ALIGN = 256  # byte alignment of every tensor in a layer buffer
CAST = ("dense", "bias")  # fields stored in the compute dtype (not packed planes)
FP32 = ("weight",)  # RMSNorm weights: fp32 like the residual stream they scale (setup does this)


def fields(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of every weight the module's forward reads, in a fixed order."""
    out = []
    for name, m in module.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Linear):
            if m.qweight is not None:
                qw = m.qweight
                out += [(p + "qweight", qw.qweight), (p + "scales", qw.scales)]
                if qw.mins is not None:
                    out.append((p + "mins", qw.mins))
            else:
                out.append((p + "dense", m.dense))
            if m.bias is not None:
                out.append((p + "bias", m.bias))
        elif isinstance(m, RMSNorm):
            out.append((p + "weight", m.weight))
    return out


def _stored_dtype(key: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a unit stores field `key` in: compute dtype, fp32 (norms) or as packed."""
    field = key.rsplit(".", 1)[-1]
    return dtype if field in CAST else torch.float32 if field in FP32 else t.dtype


def assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point the module's weights at `tensors` (keys as in `fields`)."""
    for name, m in module.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Linear):
            if m.qweight is not None:
                m.qweight = dataclasses.replace(
                    m.qweight,
                    qweight=tensors[p + "qweight"],
                    scales=tensors[p + "scales"],
                    mins=tensors.get(p + "mins"),
                )
                m.dense = None
            else:
                m.dense = tensors[p + "dense"]
            if m.bias is not None:
                m.bias = tensors[p + "bias"]
        elif isinstance(m, RMSNorm):
            m.weight = tensors[p + "weight"]


def clone(module: nn.Module) -> nn.Module:
    """A copy of the module tree sharing no module objects (tensors shared until reassigned)."""
    new = copy.copy(module)
    new._modules = {k: clone(m) for k, m in module._modules.items()}
    return new


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class Unit:
    """A streamed layer (or the LM head): its template module, which keeps the model's
    structure with the weights off the device, and its layout in a slot."""

    key: int | str  # layer index or "lm_head"
    name: str
    module: nn.Module
    layout: list[tuple[str, int, tuple[int, ...], torch.dtype]]  # key, byte offset, shape, dtype
    nbytes: int  # extent in a slot (payload + alignment)
    payload: int  # bytes of the tensors
    dequant_bytes: int  # torch backend: its quantized weights dequantized to the compute dtype
    # CPU, torch backend: the slot kernels' own weight copies (LayerStream._build_kernels), at
    # most each Linear's weight in the compute dtype (oneDNN's prepacked copy)
    kernel_bytes: int = 0

    @classmethod
    def of(
        cls,
        key: int | str,
        name: str,
        module: nn.Module,
        dtype: torch.dtype,
        dequant: bool,
        cpu_kernels: bool = False,
    ) -> Unit:
        layout, off, payload = [], 0, 0
        for k, t in fields(module):
            dt = _stored_dtype(k, t, dtype)
            n = nbytes(t.shape, dt)
            layout.append((k, off, tuple(t.shape), dt))
            off += -(-n // ALIGN) * ALIGN
            payload += n
        lins = [m for m in module.modules() if isinstance(m, Linear)]
        dq = 0
        if dequant:
            dq = sum(nbytes(m.qweight.shape, dtype) for m in lins if m.qweight is not None)
        kb = 0
        if cpu_kernels:
            kb = sum(
                nbytes(m.qweight.shape if m.qweight is not None else m.dense.shape, dtype)
                for m in lins
            )
        return cls(key, name, module, layout, off, payload, dq, kb)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's tensors over a byte buffer (a slot, a staging or host buffer)."""
        return {
            k: buf[off : off + nbytes(shape, dt)].view(dt).view(shape)
            for k, off, shape, dt in self.layout
        }

    def meta(self) -> dict[str, torch.Tensor]:
        """The unit's tensors as meta tensors (shapes and dtypes, no storage)."""
        return {k: torch.empty(shape, dtype=dt, device="meta") for k, _, shape, dt in self.layout}

    def host_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The template's weights on the CPU, cast as in the layout."""
        out = {}
        for k, t in fields(self.module):
            t = t.detach().to("cpu")
            t = t.to(_stored_dtype(k, t, dtype))
            out[k] = t
        return out
