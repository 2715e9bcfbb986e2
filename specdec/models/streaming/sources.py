"""Where a streamed model's layers live off the device.

    HostSource  one contiguous buffer per unit in host memory (pinned for CUDA), copied into
                a slot as it is
    GGUFSource  the memory-mapped GGUF file the model was loaded from; each copy re-splits the
                file's blocks into the loader's layout (the planes of `gguf_loader.BLOCK_PLANES`,
                q/k rows un-permuted and q|k|v, gate|up stacked as `tensor_map` declares). A
                tensor the file cannot give in that layout (a fused pair of mixed formats)
                stays in host memory.

A source has `direct` (copies straight into a device slot, or is assembled on the host
first), `describe()`, `check()` (before every forward) and `fill(unit, flat, views)`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import GGUF_BLOCK
from specdec.models.config import ModelConfig
from specdec.models.gguf_loader import (
    DENSE_TYPES,
    QUANT_TYPES,
    gguf_shape,
    mapped_dense,
    mapped_planes,
    open_gguf,
    read_config,
)
from specdec.models.streaming.layout import Unit, assign
from specdec.models.tensor_map import NORMS, PACKED, PACKED_BIAS, gguf_row_order, layer_names
from specdec.models.transformer import Linear

log = logging.getLogger(__name__)


class HostSource:
    """One contiguous buffer per unit in host memory (pinned for CUDA)."""

    direct = True  # copies straight into a device slot

    def __init__(self, units: list[Unit], dtype: torch.dtype, pin: bool):
        self.buffers: dict = {}
        for u in units:
            try:
                buf = torch.empty(u.nbytes, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError as e:
                raise SpecDecError(
                    f"could not allocate {u.nbytes / 2**20:.1f} MiB of "
                    f"{'pinned ' if pin else ''}host memory for {u.name}: {e}"
                ) from e
            views = u.views(buf)
            for k, t in u.host_tensors(dtype).items():
                views[k].copy_(t)
            assign(u.module, views)  # the template now reads the host copy; originals freed
            self.buffers[u.key] = buf

    def describe(self) -> str:
        return "host memory"

    def check(self) -> None:
        pass

    def fill(self, unit: Unit, flat: torch.Tensor, views: dict) -> None:
        flat[: unit.nbytes].copy_(self.buffers[unit.key], non_blocking=True)


@dataclass
class CopyOp:
    """Rows [row0, row0 + n) of `key` <- `src` ([n, ...] over the mapped file). With `raw`
    the rows are filled as bytes viewed as src's shape (block planes); `scatter` gives the
    destination row of each source row (q/k un-permutation)."""

    key: str
    row0: int
    src: torch.Tensor
    raw: bool = False
    scatter: torch.Tensor | None = None

    def target(self, views: dict) -> torch.Tensor:
        dst = views[self.key]
        if self.raw:
            dst = dst.view(torch.uint8)
        dst = dst[self.row0 : self.row0 + self.src.shape[0]]
        return dst.view(self.src.shape) if self.raw else dst

    def run(self, views: dict) -> None:
        dst = self.target(views)
        if self.scatter is None:
            dst.copy_(self.src)
        else:
            dst.index_copy_(0, self.scatter, self.src.to(dst.dtype))


def _file_id(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class GGUFSource:
    """Layers memory-mapped from the GGUF file, re-split into the loader's layout per copy."""

    direct = False  # assembled on the host (a pinned staging buffer for CUDA)

    def __init__(self, path: Path, config: ModelConfig, units: list[Unit], dtype: torch.dtype):
        self.path = Path(path)
        reader = open_gguf(self.path)
        self._id = _file_id(self.path)
        got = read_config(reader, self.path)
        dims = ("arch", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
        if any(getattr(got, d) != getattr(config, d) for d in dims):
            raise SpecDecError(
                f"stream source {self.path} does not hold this model "
                f"({', '.join(f'{d}={getattr(got, d)}' for d in dims)}); stream from the "
                f"file the model was loaded from"
            )
        self.config = config
        self.tensors = {t.name: t for t in reader.tensors}
        self.ops: dict = {}
        self.fallback: dict = {}  # unit key -> {field: host tensor} the file cannot give
        n_fallback = 0
        for u in units:
            if not isinstance(u.key, int):  # the LM head streams from host memory
                self.fallback[u.key] = u.host_tensors(dtype)
                assign(u.module, self.fallback[u.key])
                continue
            ops, covered = self._layer_ops(u)
            rest = {k: t for k, t in u.host_tensors(dtype).items() if k not in covered}
            n_fallback += len(rest)
            self.ops[u.key], self.fallback[u.key] = ops, rest
            assign(u.module, u.meta())  # the layer's weights now live in the file only
        if n_fallback:
            log.info("%s: %d layer tensors stream from host memory", self.path, n_fallback)

    def _layer_ops(self, unit: Unit) -> tuple[list[CopyOp], set[str]]:
        names = layer_names("gguf", unit.key)
        ops: list[CopyOp] = []
        for path, parts in PACKED.items():
            lin = unit.module.get_submodule(path)
            ops += self._linear_ops(lin, path, parts, names) or []
            bias = [self.tensors.get(names[b]) for b in PACKED_BIAS.get(path, ())]
            if lin.bias is not None and bias and all(b is not None for b in bias):
                row = 0
                for b in bias:
                    src = mapped_dense(b)
                    ops.append(CopyOp(f"{path}.bias", row, src))
                    row += src.shape[0]
        for norm in NORMS:
            t = self.tensors.get(names[norm])
            if t is not None and t.tensor_type.name in DENSE_TYPES:
                ops.append(CopyOp(f"{norm}.weight", 0, mapped_dense(t)))
        # keep only ops whose rows land exactly in the layout; a field counts as covered
        # when its ops fill all of its rows
        meta = unit.meta()
        rows: dict[str, int] = {}
        good = []
        for op in ops:
            if op.key not in meta:
                continue
            try:
                dst = op.target(meta)
            except RuntimeError:
                continue
            if tuple(dst.shape) == tuple(op.src.shape):
                good.append(op)
                rows[op.key] = rows.get(op.key, 0) + op.src.shape[0]
        covered = {k for k, n in rows.items() if n == meta[k].shape[0]}
        return [op for op in good if op.key in covered], covered

    def _linear_ops(
        self, lin: Linear, path: str, parts: tuple[str, ...], names: dict[str, str]
    ) -> list[CopyOp] | None:
        """Ops filling the Linear's fields from its parts' tensors; None if the file cannot."""
        ops, row = [], 0
        for part in parts:
            t = self.tensors.get(names[part])
            if t is None or len(t.shape) != 2:
                return None
            n = gguf_shape(t)[0]
            order = gguf_row_order(self.config, part, n)
            scatter = None if order is None else order.argsort()
            ttype = t.tensor_type.name
            if lin.qweight is not None:
                planes = mapped_planes(t)
                if (
                    planes is None
                    or QUANT_TYPES[ttype] != lin.qweight.fmt
                    or lin.qweight.group_size != GGUF_BLOCK
                ):
                    return None
                for plane, src in planes.items():
                    ops.append(CopyOp(f"{path}.{plane}", row, src, True, scatter))
            elif ttype in DENSE_TYPES:
                ops.append(CopyOp(f"{path}.dense", row, mapped_dense(t), False, scatter))
            else:
                return None
            row += n
        return ops

    def describe(self) -> str:
        return str(self.path)

    def check(self) -> None:
        try:
            now = _file_id(self.path)
        except FileNotFoundError:
            raise SpecDecError(
                f"stream source {self.path} disappeared (deleted or moved) while the model was "
                f"streaming its layers from it; restore the file and reload the model"
            ) from None
        except OSError as e:
            raise SpecDecError(f"stream source {self.path} is unreadable: {e}") from e
        if now[2] < self._id[2]:
            raise SpecDecError(
                f"stream source {self.path} was truncated from {self._id[2]} to {now[2]} bytes "
                f"while the model was streaming its layers from it; reload the model"
            )
        if now != self._id:
            raise SpecDecError(
                f"stream source {self.path} was replaced or modified while the model was "
                f"streaming its layers from it; reload the model"
            )

    def fill(self, unit: Unit, flat: torch.Tensor, views: dict) -> None:
        for op in self.ops.get(unit.key, ()):
            op.run(views)
        for k, t in self.fallback[unit.key].items():
            views[k].copy_(t)
