"""The double-buffered runtime of a streamed model (`Transformer.layer_stream`).

The device holds two layer slots. A forward walks its layers in order, and while layer j
runs from one slot, the next streamed layer (or the LM head) is copied into the other:

    CUDA  a worker thread issues each copy on a side stream; the copy into a slot waits for
          the event recorded after the last layer that read it, the layer waits for the
          copy's event. A source that is not `direct` (the GGUF file) is first assembled in a
          pinned staging buffer.
    CPU   the "device" is the CPU: the worker thread copies (or re-splits from the mapped
          file) into one slot while the main thread computes from the other.

On the torch backend a quantized layer is dequantized in its slot after the copy (the
resident model does that once at setup, so the outputs are identical); on the CPU the worker
instead builds each Linear's CPU kernel on the slot's weights as `Transformer.setup` builds it
once for a resident layer (`Linear.build_copy_kernel`: oneDNN's prepacked weight from a
dequantized copy, torch's packed codes from the slot itself), held until the layer has run. On the Triton backend the GEMV kernel reads the
packed slot. `bytes_streamed` counts the bytes of every unit
copied (tensor payload; each tensor also moves up to ALIGN - 1 bytes of padding).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from specdec.errors import SpecDecError
from specdec.models.cpu_linear import PACKED
from specdec.models.streaming.layout import Unit, assign, clone
from specdec.models.streaming.sources import GGUFSource, HostSource
from specdec.models.transformer import Linear, RMSNorm, Transformer

log = logging.getLogger(__name__)


class LayerStream:
    """Double-buffered layer streaming for one model (`Transformer.layer_stream`)."""

    def __init__(
        self,
        model: Transformer,
        units: list[Unit],
        head: Unit | None,
        source: HostSource | GGUFSource,
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
        every = [*units, *([head] if head else [])]
        self.slot_bytes = max((u.nbytes for u in every), default=0)
        self.slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        kernel = model.backend == "triton"
        self.runners: dict = {}
        self.dequant: dict = {}
        self.views: dict = {}
        self.kernels: dict = {}  # CPU, torch backend: the Linears that get a slot kernel
        for u in every:
            for s in range(2):
                r = clone(u.module)
                views = u.views(self.slots[s])
                assign(r, views)
                lins = [m for m in r.modules() if isinstance(m, Linear)]
                for m in lins:
                    m.use_kernel = kernel and m.qweight is not None
                for m in r.modules():  # what Transformer.setup sets on resident norms
                    if isinstance(m, RMSNorm):
                        m.out_dtype = model.dtype
                self.runners[u.key, s] = r
                self.dequant[u.key, s] = [m for m in lins if m.qweight is not None and not kernel]
                self.kernels[u.key, s] = [] if kernel or self.cuda else lins
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
        self._inflight: deque[tuple[Unit, int, Future]] = deque()

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
        for key in self.dequant:
            self._drop(key)

    def _submit(self, unit: Unit) -> None:
        s = self._next_slot
        self._next_slot ^= 1
        self.bytes_streamed += unit.payload
        self._inflight.append((unit, s, self._pool.submit(self._load, unit, s)))

    def _load(self, unit: Unit, s: int) -> None:
        """Worker thread: fill slot s with the unit."""
        with torch.inference_mode():
            if not self.cuda:
                self.source.fill(unit, self.slots[s], self.views[unit.key, s])
                self._build_kernels(unit, s)  # off the main thread as well
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

    def _acquire(self, unit: Unit, s: int, fut: Future) -> nn.Module:
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

    def _dequantize(self, unit: Unit, s: int) -> None:
        """Torch backend: the dense weights the runner's Linears compute with."""
        for m in self.dequant[unit.key, s]:
            m.dense = m.qweight.dequantize(self.dtype)

    def _build_kernels(self, unit: Unit, s: int) -> None:
        """CPU: each Linear's kernel on slot s's weights (the resident layer's kernel, so the
        outputs are identical: oneDNN on the unpacked weight rounds differently). As
        `Linear.prepare` does for a resident layer, a quantized weight is dequantized only
        for a kernel that reads dense weights, and that copy goes once the kernel holds its
        own; a packed kernel (int4pack, int8pack, ort) reads the slot's codes."""
        lins = self.kernels[unit.key, s]
        backends = [m.copy_backend(self.dtype) for m in lins]
        # every dense copy first, then the kernels: alternating the two took a SmolLM2 bf16
        # layer 1.3x as long (oneDNN's prepacking after each dequantization)
        for m, backend in zip(lins, backends):
            if m.qweight is not None and backend not in PACKED:
                m.dense = m.qweight.dequantize(self.dtype)
        for m, backend in zip(lins, backends):
            m.slot_kernel = m.build_copy_kernel(self.dtype, backend)
            if m.slot_kernel is not None and m.qweight is not None:
                m.dense = None

    def _drop(self, key: tuple) -> None:
        """The working copies of a unit's slot: dequantized weights and slot kernels."""
        for m in self.dequant[key]:
            m.dense = None
        for m in self.kernels[key]:
            m.slot_kernel = None

    def _release(self, unit: Unit, s: int) -> None:
        self._drop((unit.key, s))
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))
