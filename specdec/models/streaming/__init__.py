"""Layer-streamed targets: run a model whose layers do not fit on the device.

    model, tok = load_streamed("big.gguf", device="cuda", dtype="bfloat16", resident_layers=8)
    generate(model, prompts, 64).stats["bytes_streamed_per_token"]

`stream_model(model, device, ...)` puts what `Transformer.setup` would on the device
(embedding, final norm, LM head and the `resident_layers`) and keeps every other layer off it,
in the form it was loaded in: a 4-bit layer moves its packed codes + scales, 4x fewer bytes
than bf16. Where the layers live off the device (`source`):

    "host"        one contiguous buffer per layer in host memory, pinned on CUDA
    <path.gguf>   memory-mapped from the GGUF file the model was loaded from

The package's parts:

    layout.py     a layer (or the LM head) as one flat, aligned byte buffer
    sources.py    host memory and the memory-mapped GGUF file
    runtime.py    LayerStream: two device slots, the copy of layer j + 1 overlapping layer j
    memory.py     free device memory and the two-slot check
    placement.py  stream_model / load_streamed / resolve_source: what stays, what streams

A memory-mapped source is checked before every forward: a file deleted, replaced or
truncated under the running model raises SpecDecError. (Reading past the end of a truncated
mapping would kill the process with SIGBUS, so the size check comes first; a truncation
racing a forward is not caught.) Device memory for the two slots is checked up front.

The forward hook is `Transformer.layer_stream`; do not call `setup` on a streamed model.
"""

from specdec.models.streaming.placement import (
    SOURCES,
    load_streamed,
    resolve_source,
    stream_model,
)
from specdec.models.streaming.runtime import LayerStream

__all__ = ["SOURCES", "LayerStream", "load_streamed", "resolve_source", "stream_model"]
