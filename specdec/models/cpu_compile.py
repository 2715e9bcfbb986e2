"""Compiled decode and verification steps on CPU (torch.compile / inductor, opt-in).

On a 2-core CPU a decode step of SmolLM2-135M spends a third to a half of its time outside
the linears: about 20 small torch ops per layer (RMSNorm, RoPE, the cache writes, attention,
SwiGLU, residual adds), each paying eager dispatch. With `cpu_compile: on` the decoding loops
run their fixed-shape steps (the decode step T = 1, verifications of T = k + 1 tokens, a
self-drafter's layer subset) through `torch.compile` of the graph-safe forward
(`Transformer.forward(..., static=True)`, the path CUDA graphs capture), one compiled graph
per (T, cache size, layers): inductor fuses everything around the linears into C++ kernels,
while the linears stay the CPU backend's own kernels (`specdec.models.cpu_linear`), called
as opaque ops. Prefill stays eager (its T is the prompt's length).

Cost and limits, measured on a 2-core AVX2 EPYC (README "Compiled steps on CPU"):
- compilation: 80-120 s per graph on a cold inductor cache, 13-20 s warm (inductor caches
  compiled code on disk, in $TORCHINDUCTOR_CACHE_DIR or /tmp); a speculative run compiles
  one graph per verification width it meets (1..k+1 with drafters that draft fewer tokens
  in some rounds) and per static cache size;
- the static forward attends over the whole static cache (the next power of two >= 64
  slots, `specdec.models.cuda_graphs`), masked;
- batch invariance (specdec.models.batch_invariant) needs the eager forward's host-side
  positions, so compiled steps run without it: in bf16 a verification row may differ from
  the decode step in the last bits, and greedy speculative output can leave plain greedy
  output at a near-tie (the summary's agreement says so); float32 keeps the eager path's
  numbers to ~1e-5.
- needs a C++ compiler (inductor's CPU backend); without one `on` is an error;
- linears on ONNX Runtime (cpu_linear=ort, Q5_0 / Q6_K under native) run as an opaque op
  (`ort_linear`) like the packed kernels: before, each was a graph break.

The setting: `Transformer.setup(cpu_compile=...)`, config `cpu_compile`, CLI
`--cpu-compile`, $SPECDEC_CPU_COMPILE; off | on (default off).
"""

from __future__ import annotations

import functools

import torch

from specdec.errors import SpecDecError
from specdec.models.cpu_linear import EagerKernels
from specdec.models.ort_linear import OrtLinear
from specdec.models.settings import ProcessSetting

SETTINGS = ("off", "on")
ENV = "SPECDEC_CPU_COMPILE"
# one compiled graph per (T, cache size, layers); a speculative run meets a handful. Past
# the limit dynamo would silently run the step eagerly: raise it and make hitting it an error
RECOMPILE_LIMIT = 64

_SETTING = ProcessSetting("cpu_compile setting", ENV, SETTINGS, "off")
# force the setting for this process (None restores $SPECDEC_CPU_COMPILE); resolve one
set_setting = _SETTING.force
resolve_setting = _SETTING.resolve


def compiler_missing() -> str | None:
    """None when inductor finds a C++ compiler, else the one-line reason."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # inductor raises its own types; the message is what matters
        return f"torch.compile's CPU backend needs a C++ compiler (g++ or clang++): {e}"
    return None


def check_available(device: torch.device, backend: str) -> None:
    """Raise the one-line reason when compiled CPU steps cannot run for a model on `device`
    and `backend` (a layer-streamed model is refused where its steps would run:
    `specdec.models.cuda_graphs.resolve_cuda_graphs`; `setup` never sees one)."""
    if device.type != "cpu" or backend != "torch":
        raise SpecDecError(
            f"cpu_compile=on applies to the torch backend on CPU (this model: {backend} on "
            f"{device.type}; on CUDA the steps are CUDA graphs already)"
        )
    why = compiler_missing()
    if why:
        raise SpecDecError(f"cpu_compile=on: {why}")


@functools.cache
def configure_dynamo() -> None:
    """Raise dynamo's recompile limit and make reaching it an error instead of a silent
    fall back to eager (once per process)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


@torch.library.custom_op("specdec::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's prepacked linear as an opaque op: inductor lowers `mkldnn._linear_pointwise`
    only for frozen (constant) weights, and these are inputs of the compiled step."""
    return EagerKernels.onednn_linear(x, w, bias)


@onednn_linear.register_fake
def _(x, w, bias):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("specdec::int4pack_mm", mutates_args=())
def int4pack_mm(x: torch.Tensor, w: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """torch's int4 weight-only kernel as an opaque op: inductor's own lowering of
    `_weight_int4pack_mm_for_cpu` measured 1.5x slower than the eager kernel here."""
    return EagerKernels.int4pack_mm(x, w, group, sz)


@int4pack_mm.register_fake
def _(x, w, group, sz):
    return x.new_empty(x.shape[0], sz.shape[1])


@torch.library.custom_op("specdec::ort_linear", mutates_args=())
def ort_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """ONNX Runtime's MatMulNBits (the OrtLinear of `handle`, x [M, K] fp32 -> [M, N] fp32)
    as an opaque op: called directly it is numpy inside the graph, a graph break per linear
    (Qwen2.5-Coder's Q5_0 / Q6_K parts under native: compiled steps lost to eager ones)."""
    return OrtLinear.by_handle(handle)(x)


@ort_linear.register_fake
def _(x, handle):
    n = OrtLinear.by_handle(handle).out_features
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


@torch.library.custom_op("specdec::int8pack_mm", mutates_args=())
def int8pack_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """torch's int8 weight-only kernel as an opaque op (like `int4pack_mm`)."""
    return EagerKernels.int8pack_mm(x, w, s)


@int8pack_mm.register_fake
def _(x, w, s):
    return x.new_empty(x.shape[0], w.shape[0])
