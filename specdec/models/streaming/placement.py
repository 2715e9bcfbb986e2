"""Placing a model for streaming: what stays on the device, what streams, from where.

`stream_model(model, device, ...)` puts what `Transformer.setup` would on the device (embedding,
final norm, LM head and the `resident_layers`) and keeps every other layer off it, in the
form it was loaded in, in a source (`sources.py`); `load_streamed` loads and places in one call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecDecError
from specdec.kernels.quant import QuantizedWeight
from specdec.kernels.utils import resolve_backend
from specdec.models import batch_invariant
from specdec.models.load import load_weights, parse_device, parse_dtype
from specdec.models.streaming.layout import Unit, assign
from specdec.models.streaming.memory import check_memory
from specdec.models.streaming.runtime import LayerStream
from specdec.models.streaming.sources import GGUFSource, HostSource
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer

log = logging.getLogger(__name__)

SOURCES = ("auto", "host", "mmap")


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
    dev = parse_device(device)
    dt = parse_dtype(dtype, dev)
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
    # streamed layers run kernels built per call, not the prepared (probed) ones
    if batch_invariant.resolve_setting() == "on":
        raise SpecDecError("batch_invariant=on does not cover layer streaming (--stream-target)")
    layers = model.layers
    model.layers = nn.ModuleList([layers[i] for i in sorted(resident)])
    try:
        with torch.inference_mode():
            model.setup(dt, dev, backend, batch_invariant_setting="off")
    except torch.cuda.OutOfMemoryError as e:
        raise SpecDecError(
            f"the resident parts (embedding, LM head, {len(resident)} layers) do not fit on "
            f"{dev}: {e}"
        ) from e
    finally:
        model.layers = layers
    model.eval()
    model.batch_invariant_reason = "off (layer streaming: streamed layers are not covered)"
    pin = dev.type == "cuda"
    embed_host = None
    if not embed_on_device:  # rows are gathered on the host; the device copy goes
        embed_host = model.embed_dense.to("cpu")
        embed_host = embed_host.pin_memory() if pin else embed_host
        model.embed_dense = None
        if isinstance(model.tok_embeddings, torch.Tensor):
            model.tok_embeddings = embed_host
    dequant = model.backend != "triton"
    kernels = dequant and dev.type == "cpu"
    units = [
        Unit.of(i, f"layer {i}", layers[i], dt, dequant, kernels)
        for i in range(n)
        if i not in resident
    ]
    head = None
    if not head_on_device:
        head = Unit.of("lm_head", "the LM head", model.lm_head, dt, dequant, kernels)
        assign(head.module, head.host_tensors(dt))  # off the device before the check
        emb = model.tok_embeddings  # forward reads embed_dense; a packed table only fed the head
        if isinstance(emb, QuantizedWeight) and emb.device.type != "cpu":
            model.tok_embeddings = emb.to("cpu")
    every = [*units, *([head] if head else [])]
    check_memory(dev, every, len(resident))
    if path is None:
        src = HostSource(every, dt, pin=pin)
    else:
        src = GGUFSource(path, model.config, every, dt)
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
) -> tuple[Transformer, Tokenizer]:
    """`load_model` for a layer-streamed target -> (Transformer, Tokenizer).
    source: auto | host | mmap (see `resolve_source`)."""
    model, tok, path = load_weights(name_or_path, quantize=quantize, group_size=group_size)
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
