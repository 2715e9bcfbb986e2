"""Layer-streamed targets: run a model whose layers do not fit on the device.

    model, tok = load_streamed("big.gguf", device="cuda", dtype="bfloat16", resident_layers=8)
    generate(model, prompts, 64).stats["bytes_streamed_per_token"]

`stream_model(model, device, ...)` puts what `Transformer.setup` would on the device
(embedding, final norm, LM head and the `resident_layers`) and keeps every other layer off it,
in the form it was loaded in: a 4-bit layer moves its packed codes + scales, 4x fewer bytes
than bf16. Where the layers live off the device (`source`):

    "host"        one contiguous buffer per layer in host memory, pinned on CUDA
    <path.gguf>   memory-mapped from the GGUF file the model was loaded from; each copy
                  re-splits the file's blocks into the loader's layout (scale / min / code
                  planes, q/k rows un-permuted, q|k|v and gate|up fused). A tensor the file
                  cannot give in that layout (a fused pair of mixed formats) stays in host memory.

The device holds two layer slots. A forward walks its layers in order, and while layer j
runs from one slot, the next streamed layer (or the LM head) is copied into the other:

    CUDA  a worker thread issues each copy on a side stream; the copy into a slot waits for
          the event recorded after the last layer that read it, the layer waits for the
          copy's event. A GGUF source is first assembled in a pinned staging buffer.
    CPU   the "device" is the CPU: the worker thread copies (or re-splits from the mapped
          file) into one slot while the main thread computes from the other.

On the torch backend a quantized layer is dequantized in its slot after the copy (the
resident model does that once at setup, so the outputs are identical); on the Triton backend
the GEMV kernel reads the packed slot. `LayerStream.bytes_streamed` counts the bytes of every
layer copied (tensor payload; each tensor also moves up to ALIGN - 1 bytes of padding).

A memory-mapped source is checked before every forward: a file deleted, replaced or
truncated under the running model raises SpecDecError. (Reading past the end of a truncated
mapping would kill the process with SIGBUS, so the size check comes first; a truncation
racing a forward is not caught.) Device memory for the two slots is checked up front.

The forward hook is `Transformer.layer_stream`; do not call `setup` on a streamed model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecDecError
from specdec.kernels.quant import GGUF_BLOCK, GGUF_BLOCK_BYTES, QuantizedWeight
from specdec.kernels.utils import resolve_backend
from specdec.models.transformer import Linear, RMSNorm, Transformer

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of every tensor in a layer buffer
SOURCES = ("auto", "host", "mmap")
_CAST = ("dense", "bias", "weight")  # fields stored in the compute dtype (not packed planes)


# -- a unit's tensors in one flat buffer -------------------------------------------------
def _fields(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
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


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point the module's weights at `tensors` (keys as in `_fields`)."""
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


def _clone(module: nn.Module) -> nn.Module:
    """A copy of the module tree sharing no module objects (tensors shared until reassigned)."""
    new = copy.copy(module)
    new._modules = {k: _clone(m) for k, m in module._modules.items()}
    return new


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class _Unit:
    """A streamed layer (or the LM head): its template module, which keeps the model's
    structure with the weights off the device, and its layout in a slot."""

    key: int | str  # layer index or "lm_head"
    name: str
    module: nn.Module
    layout: list[tuple[str, int, tuple[int, ...], torch.dtype]]  # key, byte offset, shape, dtype
    nbytes: int  # extent in a slot (payload + alignment)
    payload: int  # bytes of the tensors
    dequant_bytes: int  # torch backend: its quantized weights dequantized to the compute dtype

    @classmethod
    def of(cls, key, name: str, module: nn.Module, dtype: torch.dtype, dequant: bool) -> _Unit:
        layout, off, payload = [], 0, 0
        for k, t in _fields(module):
            dt = dtype if k.rsplit(".", 1)[-1] in _CAST else t.dtype
            n = _nbytes(t.shape, dt)
            layout.append((k, off, tuple(t.shape), dt))
            off += -(-n // ALIGN) * ALIGN
            payload += n
        dq = 0
        if dequant:
            dq = sum(
                _nbytes(m.qweight.shape, dtype)
                for m in module.modules()
                if isinstance(m, Linear) and m.qweight is not None
            )
        return cls(key, name, module, layout, off, payload, dq)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            k: buf[off : off + _nbytes(shape, dt)].view(dt).view(shape)
            for k, off, shape, dt in self.layout
        }

    def host_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The template's weights on the CPU, cast as in the layout."""
        out = {}
        for k, t in _fields(self.module):
            t = t.detach().to("cpu")
            if k.rsplit(".", 1)[-1] in _CAST:
                t = t.to(dtype)
            out[k] = t
        return out


# -- where streamed layers live off the device --------------------------------------------
class _HostSource:
    """One contiguous buffer per unit in host memory (pinned for CUDA)."""

    direct = True  # copies straight into a device slot

    def __init__(self, units: list[_Unit], dtype: torch.dtype, pin: bool):
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
            _assign(u.module, views)  # the template now reads the host copy; originals freed
            self.buffers[u.key] = buf

    def describe(self) -> str:
        return "host memory"

    def check(self) -> None:
        pass

    def fill(self, unit: _Unit, flat: torch.Tensor, views: dict) -> None:
        flat[: unit.nbytes].copy_(self.buffers[unit.key], non_blocking=True)


@dataclass
class _CopyOp:
    """Rows [row0, row0 + n) of `key` <- `src` ([n, ...] over the mapped file). With
    `byte_shape` the rows are filled as raw bytes viewed as that shape (block planes);
    `scatter` gives the destination row of each source row (q/k un-permutation)."""

    key: str
    row0: int
    src: torch.Tensor
    byte_shape: tuple[int, ...] | None = None
    scatter: torch.Tensor | None = None

    def target(self, views: dict) -> torch.Tensor:
        dst = views[self.key]
        if self.byte_shape is not None:
            dst = dst.view(torch.uint8)
        dst = dst[self.row0 : self.row0 + self.src.shape[0]]
        return dst if self.byte_shape is None else dst.view(self.byte_shape)

    def run(self, views: dict) -> None:
        dst = self.target(views)
        if self.scatter is None:
            dst.copy_(self.src)
        else:
            dst.index_copy_(0, self.scatter, self.src.to(dst.dtype))


def _file_id(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _mapped(array) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapping is read-only; we never write through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _unpermute_scatter(n: int, n_heads: int) -> torch.Tensor:
    """Destination rows of llama.cpp's permuted q/k rows (inverse of the loader's gather)."""
    idx = torch.arange(n).view(n_heads, n // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(n)
    return inv


class _GGUFSource:
    """Layers memory-mapped from the GGUF file, re-split into the loader's layout per copy."""

    direct = False  # assembled on the host (a pinned staging buffer for CUDA)

    def __init__(self, path: Path, config, units: list[_Unit], dtype: torch.dtype):
        from specdec.models.gguf_loader import QUANT_TYPES, open_gguf, read_config

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
        tensors = {t.name: t for t in reader.tensors}
        self.ops: dict = {}
        self.fallback: dict = {}  # unit key -> {field: host tensor} the file cannot give
        n_fallback = 0
        for u in units:
            if not isinstance(u.key, int):  # the LM head streams from host memory
                self.fallback[u.key] = u.host_tensors(dtype)
                _assign(u.module, self.fallback[u.key])
                continue
            ops, covered = self._layer_ops(config, u, tensors, QUANT_TYPES)
            rest = {k: t for k, t in u.host_tensors(dtype).items() if k not in covered}
            n_fallback += len(rest)
            self.ops[u.key], self.fallback[u.key] = ops, rest
            meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, _, shape, dt in u.layout}
            _assign(u.module, meta)  # the layer's weights now live in the file only
        if n_fallback:
            log.info("%s: %d layer tensors stream from host memory", self.path, n_fallback)

    def _layer_ops(self, cfg, unit: _Unit, tensors: dict, quant_types: dict):
        p = f"blk.{unit.key}."
        heads = (cfg.n_heads, cfg.n_kv_heads) if cfg.arch == "llama" else (0, 0)
        linears = {
            "attn.wqkv": [("attn_q", heads[0]), ("attn_k", heads[1]), ("attn_v", 0)],
            "attn.wo": [("attn_output", 0)],
            "ffn.w_gate_up": [("ffn_gate", 0), ("ffn_up", 0)],
            "ffn.w_down": [("ffn_down", 0)],
        }
        ops: list[_CopyOp] = []
        for name, parts in linears.items():
            lin = unit.module.get_submodule(name)
            lin_ops = self._linear_ops(
                lin, name, [(p + t, h) for t, h in parts], tensors, quant_types
            )
            if lin_ops is not None:
                ops += lin_ops
            if lin.bias is not None:
                bias = [tensors.get(p + t + ".bias") for t, _ in linears[name]]
                if all(b is not None for b in bias):
                    row = 0
                    for b in bias:
                        src = self._dense(b)
                        ops.append(_CopyOp(f"{name}.bias", row, src))
                        row += src.shape[0]
        for norm in ("attn_norm", "ffn_norm"):
            t = tensors.get(p + norm + ".weight")
            if t is not None and t.tensor_type.name in ("F32", "F16", "BF16"):
                ops.append(_CopyOp(f"{norm}.weight", 0, self._dense(t)))
        # keep only ops whose rows land exactly in the layout; a field counts as covered
        # when its ops fill all of its rows
        meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, _, shape, dt in unit.layout}
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

    def _linear_ops(self, lin: Linear, name: str, parts, tensors: dict, quant_types: dict):
        ops, row = [], 0
        for tname, heads in parts:
            t = tensors.get(tname + ".weight")
            if t is None or len(t.shape) != 2:
                return None
            n, k = (int(s) for s in reversed(t.shape.tolist()))  # GGUF lists [in, out]
            scatter = _unpermute_scatter(n, heads) if heads else None
            ttype = t.tensor_type.name
            if lin.qweight is not None:
                fmt = quant_types.get(ttype)
                if fmt != lin.qweight.fmt or lin.qweight.group_size != GGUF_BLOCK:
                    return None
                bb, nb = GGUF_BLOCK_BYTES[fmt], k // GGUF_BLOCK
                blocks = _mapped(t.data).view(n, nb, bb)
                code0 = 4 if fmt == "q4_1" else 2
                planes = [("scales", 0, 2), ("qweight", code0, bb)]
                if fmt == "q4_1":
                    planes.append(("mins", 2, 4))
                for plane, a, b in planes:
                    src = blocks[:, :, a:b]
                    ops.append(_CopyOp(f"{name}.{plane}", row, src, (n, nb, b - a), scatter))
            elif ttype in ("F32", "F16", "BF16"):
                ops.append(_CopyOp(f"{name}.dense", row, self._dense(t), None, scatter))
            else:
                return None
            row += n
        return ops

    @staticmethod
    def _dense(t) -> torch.Tensor:
        src = _mapped(t.data)
        if t.tensor_type.name == "BF16":  # stored as raw bytes
            src = src.view(torch.bfloat16)
        return src.reshape(tuple(int(s) for s in reversed(t.shape.tolist())))

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

    def fill(self, unit: _Unit, flat: torch.Tensor, views: dict) -> None:
        for op in self.ops.get(unit.key, ()):
            op.run(views)
        for k, t in self.fallback[unit.key].items():
            views[k].copy_(t)


# -- the stream ----------------------------------------------------------------------------
class LayerStream:
    """Double-buffered layer streaming for one model (`Transformer.layer_stream`)."""

    def __init__(
        self,
        model: Transformer,
        units: list[_Unit],
        head: _Unit | None,
        source,
        embed_host: torch.Tensor | None,
    ):
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.cuda = self.device.type == "cuda"
        self.units = {u.key: u for u in units}
        self.head = head
        self.source = source
        self.embed_host = embed_host
        self.bytes_streamed = 0  # payload bytes copied to the device, all forwards
        self.loads = 0
        every = [*units, *([head] if head else [])]
        self.slot_bytes = max((u.nbytes for u in every), default=0)
        self.slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        kernel = model.backend == "triton"
        self.runners: dict = {}
        self.dequant: dict = {}
        self.views: dict = {}
        for u in every:
            for s in range(2):
                r = _clone(u.module)
                views = u.views(self.slots[s])
                _assign(r, views)
                lins = [m for m in r.modules() if isinstance(m, Linear)]
                for m in lins:
                    m.use_kernel = kernel and m.qweight is not None
                self.runners[u.key, s] = r
                self.dequant[u.key, s] = [m for m in lins if m.qweight is not None and not kernel]
                self.views[u.key, s] = views
        self.staging = None
        if self.cuda:
            self.side = torch.cuda.Stream(self.device)
            self.ready = [torch.cuda.Event() for _ in range(2)]
            self.free = [torch.cuda.Event() for _ in range(2)]
            if not source.direct:
                self.staging = [
                    torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
                    for _ in range(2)
                ]
                self.staged = [torch.cuda.Event() for _ in range(2)]
                self.staging_views = {
                    (u.key, s): u.views(self.staging[s]) for u in every for s in range(2)
                }
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-stream")
        self._next_slot = 0
        self._inflight: deque[tuple[_Unit, int, Future]] = deque()

    @property
    def streamed_layers(self) -> list[int]:
        return sorted(self.units)

    def bytes_per_forward(self, layers: Iterable[int] | None = None) -> int:
        """Payload bytes one forward over `layers` (default all) streams."""
        idx = range(self.model.config.n_layers) if layers is None else layers
        n = sum(self.units[i].payload for i in idx if i in self.units)
        return n + (self.head.payload if self.head else 0)

    def stats(self, since: int, generated: int) -> dict:
        """Generation statistics since `bytes_streamed` was `since`."""
        n = self.bytes_streamed - since
        return {"bytes_streamed": n, "bytes_streamed_per_token": n / max(1, generated)}

    # -- forward hooks (Transformer.forward) ------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_host is None:
            return self.model.embed_dense[tokens]
        return self.embed_host[tokens.cpu()].to(self.device, non_blocking=True)

    def blocks(self, idx: Iterable[int]) -> Iterator[tuple[int, nn.Module]]:
        """(i, block) for the forward's layers; streamed ones arrive in a slot just in time."""
        idx = list(idx)
        plan = [self.units[i] for i in idx if i in self.units]
        if self.head is not None:
            plan.append(self.head)
        self._begin()
        if plan:
            self._submit(plan[0])
        nxt = 1
        for i in idx:
            if i not in self.units:
                yield i, self.model.layers[i]
                continue
            if nxt < len(plan):  # into the other slot, while this layer computes
                self._submit(plan[nxt])
                nxt += 1
            unit, s, fut = self._inflight.popleft()
            yield i, self._acquire(unit, s, fut)
            self._release(unit, s)

    def lm_head(self) -> nn.Module:
        if self.head is None:
            return self.model.lm_head
        return self._acquire(*self._inflight.popleft())  # submitted by `blocks`

    # -- internals ----------------------------------------------------------------------------
    def _begin(self) -> None:
        self._drain()
        self.source.check()
        if self.cuda:  # nothing copies into a slot that earlier work may still read
            self.side.wait_stream(torch.cuda.current_stream(self.device))

    def _drain(self) -> None:
        """Settle copies left by a forward that did not finish (their errors went with it)."""
        while self._inflight:
            unit, _, fut = self._inflight.popleft()
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - the forward that needed it has failed
                log.debug("dropped prefetch of %s: %s", unit.name, e)
        for lins in self.dequant.values():
            for m in lins:
                m.dense = None

    def _submit(self, unit: _Unit) -> None:
        s = self._next_slot
        self._next_slot ^= 1
        self.bytes_streamed += unit.payload
        self.loads += 1
        self._inflight.append((unit, s, self._pool.submit(self._load, unit, s)))

    def _load(self, unit: _Unit, s: int) -> None:
        """Worker thread: fill slot s with the unit."""
        with torch.inference_mode():
            if not self.cuda:
                self.source.fill(unit, self.slots[s], self.views[unit.key, s])
                self._dequantize(unit, s)  # off the main thread as well
                return
            with torch.cuda.device(self.device), torch.cuda.stream(self.side):
                self.side.wait_event(self.free[s])
                if self.staging is None:
                    self.source.fill(unit, self.slots[s], self.views[unit.key, s])
                else:
                    self.staged[s].synchronize()  # the last copy out of this staging buffer
                    self.source.fill(unit, self.staging[s], self.staging_views[unit.key, s])
                    dst = self.slots[s][: unit.nbytes]
                    dst.copy_(self.staging[s][: unit.nbytes], non_blocking=True)
                    self.staged[s].record(self.side)
                self.ready[s].record(self.side)

    def _acquire(self, unit: _Unit, s: int, fut: Future) -> nn.Module:
        try:
            fut.result()
        except SpecDecError:
            raise
        except Exception as e:
            raise SpecDecError(
                f"streaming {unit.name} from {self.source.describe()} failed "
                f"({type(e).__name__}: {e})"
            ) from e
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[s])
            self._dequantize(unit, s)
        return self.runners[unit.key, s]

    def _dequantize(self, unit: _Unit, s: int) -> None:
        """Torch backend: the dense weights the runner's Linears compute with."""
        for m in self.dequant[unit.key, s]:
            m.dense = m.qweight.dequantize(self.dtype)

    def _release(self, unit: _Unit, s: int) -> None:
        for m in self.dequant[unit.key, s]:
            m.dense = None
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))


# -- building a streamed model ---------------------------------------------------------------
def device_free_bytes(device: torch.device) -> int | None:
    """Bytes still allocatable on `device` (CUDA: free + torch's unused cache; CPU:
    MemAvailable), None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_memory(device: torch.device, units: list[_Unit], n_resident: int) -> None:
    if not units:
        return
    slot = max(u.nbytes for u in units)
    work = max(u.dequant_bytes for u in units)
    need = 2 * (slot + work)
    free = device_free_bytes(device)
    if free is None or free >= need:
        return
    extra = f" (+ {work / 2**20:.1f} MiB dequantized, torch backend)" if work else ""
    raise SpecDecError(
        f"not enough {device} memory to stream this model: two layer buffers of "
        f"{slot / 2**20:.1f} MiB{extra} need {need / 2**30:.2f} GiB but {free / 2**30:.2f} GiB "
        f"is free after the embedding, LM head and {n_resident} resident layers; keep fewer "
        f"layers resident, stream the LM head (head_on_device=False) or use a smaller dtype"
    )


def _resident_set(resident_layers: int | Iterable[int], n_layers: int) -> set[int]:
    if isinstance(resident_layers, int):
        if not 0 <= resident_layers <= n_layers:
            raise SpecDecError(
                f"resident_layers={resident_layers} out of range for a {n_layers}-layer model"
            )
        return set(range(resident_layers))
    out = {int(i) for i in resident_layers}
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad:
        raise SpecDecError(f"resident layers {bad} out of range for a {n_layers}-layer model")
    return out


def stream_model(
    model: Transformer,
    device: str | torch.device = "cuda",
    *,
    dtype: str | torch.dtype = "float32",
    backend: str | None = None,
    source: str | Path = "host",
    resident_layers: int | Iterable[int] = 0,
    embed_on_device: bool = True,
    head_on_device: bool = True,
) -> Transformer:
    """Set `model` (as the loaders return it, on the CPU) up on `device` with its layers
    streamed; returns the same model. source: "host" or the .gguf file it was loaded from.
    resident_layers: N (the first N) or indices kept on the device, e.g. an early-exit
    draft's layers. embed_on_device / head_on_device: False keeps the embedding table on the
    host (rows gathered there) / streams the LM head after the last layer."""
    from specdec.models.load import parse_device, parse_dtype

    dev, dt = parse_device(device), parse_dtype(dtype)
    backend = backend or resolve_backend(dev)
    n = model.config.n_layers
    resident = _resident_set(resident_layers, n)
    if model.layer_stream is not None:
        raise SpecDecError("this model is already streamed")
    path = None if str(source) == "host" else Path(source)
    if path is not None and (path.suffix != ".gguf" or not path.is_file()):
        raise SpecDecError(
            f"stream source must be 'host' or the model's .gguf file, got {str(source)!r}"
        )
    layers = model.layers
    model.layers = nn.ModuleList([layers[i] for i in sorted(resident)])
    try:
        with torch.inference_mode():
            model.setup(dt, dev, backend)
    except torch.cuda.OutOfMemoryError as e:
        raise SpecDecError(
            f"the resident parts (embedding, LM head, {len(resident)} layers) do not fit on "
            f"{dev}: {e}"
        ) from e
    finally:
        model.layers = layers
    model.eval()
    pin = dev.type == "cuda"
    embed_host = None
    if not embed_on_device:  # rows are gathered on the host; the device copy goes
        embed_host = model.embed_dense.to("cpu")
        embed_host = embed_host.pin_memory() if pin else embed_host
        model.embed_dense = None
        if isinstance(model.tok_embeddings, torch.Tensor):
            model.tok_embeddings = embed_host
    dequant = model.backend != "triton"
    units = [
        _Unit.of(i, f"layer {i}", layers[i], dt, dequant) for i in range(n) if i not in resident
    ]
    head = None
    if not head_on_device:
        head = _Unit.of("lm_head", "the LM head", model.lm_head, dt, dequant)
        _assign(head.module, head.host_tensors(dt))  # off the device before the check
        emb = model.tok_embeddings  # forward reads embed_dense; a packed table only fed the head
        if isinstance(emb, QuantizedWeight) and emb.device.type != "cpu":
            model.tok_embeddings = emb.to("cpu")
    every = [*units, *([head] if head else [])]
    _check_memory(dev, every, len(resident))
    if path is None:
        src = _HostSource(every, dt, pin=pin)
    else:
        src = _GGUFSource(path, model.config, every, dt)
    model.layer_stream = LayerStream(model, units, head, src, embed_host)
    log.info(
        "streaming %d of %d layers%s from %s: %.1f MiB per forward, slots of %.1f MiB",
        len(units),
        n,
        " and the LM head" if head else "",
        src.describe(),
        model.layer_stream.bytes_per_forward() / 2**20,
        model.layer_stream.slot_bytes / 2**20,
    )
    return model


def load_host(name_or_path: str, *, quantize: str | None = None, group_size: int = 64):
    """-> (Transformer with its weights as loaded, on the CPU and not set up, Tokenizer, path):
    what `stream_model` takes."""
    from specdec.models.load import load_weights

    return load_weights(name_or_path, quantize=quantize, group_size=group_size)


def resolve_source(source: str, path: Path, device: str | torch.device) -> str | Path:
    """ "auto": the memory-mapped .gguf on CPU, host memory (pinned) on CUDA or for
    safetensors models; "mmap" needs a .gguf model."""
    if source not in SOURCES:
        raise SpecDecError(f"unknown stream source {source!r} (choose one of {', '.join(SOURCES)})")
    gguf = Path(path).suffix == ".gguf"
    if source == "mmap" and not gguf:
        raise SpecDecError(
            f"{path}: stream source 'mmap' needs a .gguf model; safetensors models stream "
            f"from host memory (source 'host')"
        )
    if source == "mmap" or (source == "auto" and gguf and torch.device(device).type == "cpu"):
        return Path(path)
    return "host"


def load_streamed(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    backend: str | None = None,
    quantize: str | None = None,
    group_size: int = 64,
    source: str = "auto",
    resident_layers: int | Iterable[int] = 0,
    embed_on_device: bool = True,
    head_on_device: bool = True,
):
    """`load_model` for a layer-streamed target -> (Transformer, Tokenizer).
    source: auto | host | mmap (see `resolve_source`)."""
    model, tok, path = load_host(name_or_path, quantize=quantize, group_size=group_size)
    stream_model(
        model,
        device,
        dtype=dtype,
        backend=backend,
        source=resolve_source(source, path, device),
        resident_layers=resident_layers,
        embed_on_device=embed_on_device,
        head_on_device=head_on_device,
    )
    return model, tok
