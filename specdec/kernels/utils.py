"""Backend dispatch and launch helpers shared by the kernel files.

Each kernel has a Triton implementation and a plain-torch reference with the same
semantics. `resolve_backend(device)` picks one:

    SPECDEC_BACKEND=auto   (default) Triton on CUDA, torch reference elsewhere
    SPECDEC_BACKEND=torch  torch reference everywhere
    SPECDEC_BACKEND=triton Triton everywhere; on CPU this is Triton's interpreter and
                           needs TRITON_INTERPRET=1 in the environment

`set_backend(name)` overrides the environment for this process (config option), and
`pick_backend(backend, device)` is what every public kernel function calls with its own
`backend=` argument. Asking for Triton where it cannot run raises BackendError: there is no
silent fallback.

Launchers hand their kernel, grid, arguments and launch options to `launch`. Inside
`recording(target)` nothing runs: `launch` appends a `Launch` record instead, and
`num_sms` answers for the target GPU, so `benchmarks/compile_check.py` drives the real
launchers with meta tensors and compiles exactly what they would launch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.errors import BackendError

BACKENDS = ("auto", "torch", "triton")
_override: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend for this process (None restores the environment's choice)."""
    global _override
    if name is not None and name not in BACKENDS:
        raise BackendError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _override = name


def requested_backend() -> str:
    name = _override or os.environ.get("SPECDEC_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise BackendError(
            f"SPECDEC_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}"
        )
    return name


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton(device: torch.device) -> None:
    """Raise BackendError unless Triton kernels can launch on `device`."""
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is a dependency
        raise BackendError(f"Triton backend requested but triton is not importable: {e}") from e
    if device.type == "cuda" or (device.type == "meta" and _recording is not None):
        return
    if device.type == "cpu":
        if not triton_interpret():
            raise BackendError(
                "Triton backend requested on CPU: Triton runs on CPU only in its interpreter; "
                "set TRITON_INTERPRET=1 (slow) or use SPECDEC_BACKEND=torch"
            )
        return
    raise BackendError(f"Triton backend cannot run on device type {device.type!r}")


def pick_backend(backend: str | None, device: torch.device | str) -> str:
    """'triton' or 'torch' for a public kernel function's `backend=` argument: None or
    'auto' follow `resolve_backend`, 'triton' is checked to be runnable on `device`."""
    if backend is None or backend == "auto":
        return resolve_backend(device)
    if backend == "triton":
        check_triton(torch.device(device))
        return backend
    if backend == "torch":
        return backend
    raise BackendError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def resolve_backend(device: torch.device | str) -> str:
    """'triton' or 'torch' for tensors on `device`, following the rules above."""
    device = torch.device(device)
    name = requested_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        check_triton(device)
    return name


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def launchable(kernel):
    """`kernel` (a `@triton.jit` function), checked against the current TRITON_INTERPRET.

    Triton decides compiled vs interpreted when it is imported (its own `tl` helpers such as
    `tl.zeros` are `@jit` functions too), so a kernel cannot be switched afterwards. Setting
    TRITON_INTERPRET=1 after `triton` was imported would fail deep inside the launch; this
    raises BackendError saying what to do instead.
    """
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernel, InterpretedFunction)
    if interpreted != triton_interpret():
        raise BackendError(
            f"triton was imported with TRITON_INTERPRET={'1' if interpreted else '0'} but it is "
            f"now {os.environ.get('TRITON_INTERPRET', 'unset')}; set TRITON_INTERPRET before "
            "anything imports triton (tests/conftest.py does this for the test suite)"
        )
    return kernel


@dataclass(frozen=True)
class Target:
    """What the launch heuristics need to know about the machine a kernel will run on."""

    num_sms: int
    interpreter: bool  # Triton's CPU interpreter: large tiles, no bf16 tl.dot
    device: str = ""  # the CUDA device's name (tuned GEMV tables are per device); "" if none


def target_of(device: torch.device) -> Target:
    """The target GPU while recording, else the device the tensors are on."""
    if _recording is not None:
        return Target(_recording.num_sms, interpreter=False, device=_recording.device)
    if device.type != "cuda":
        return Target(num_sms(device), interpreter=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return Target(_cuda_sm_count(index), interpreter=False, device=_cuda_name(index))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (4 elsewhere: keeps interpreter grids small)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher chose it: `kernel[grid](*args, **constexprs, **options)`."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple  # runtime arguments in the kernel's order (tensors, ints, floats)
    constexprs: dict[str, Any]
    options: dict[str, int]  # num_warps, num_stages


@dataclass
class _Recorder:
    num_sms: int
    device: str = ""
    launches: list[Launch] = field(default_factory=list)


_recording: _Recorder | None = None


@contextlib.contextmanager
def recording(num_sms: int, device: str = "") -> Iterator[list[Launch]]:
    """Record launches instead of running them, as if on a GPU with `num_sms` SMs (named
    `device`: its tuned GEMV table applies)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("recording() does not nest")
    _recording = _Recorder(num_sms, device)
    try:
        yield _recording.launches
    finally:
        _recording = None


def launch(
    kernel, grid: tuple[int, ...], *args, num_warps: int = 4, num_stages: int = 3, **constexprs
) -> None:
    """Launch `kernel` (checked by `launchable`), or record it inside `recording()`."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if _recording is not None:
        _recording.launches.append(Launch(kernel, tuple(grid), args, constexprs, options))
        return
    launchable(kernel)[tuple(grid)](*args, **constexprs, **options)


@dataclass(frozen=True)
class WeightFormat:
    """A packed weight format a GEMV kernel file supports; `benchmarks/compile_check.py`
    compiles every registered format, so a new kernel file joins the check by calling
    `register_weight_format` at import time."""

    name: str  # e.g. "q4_0", "int4-g64"
    make_weight: Callable[[int, int, torch.device], Any]  # (out, in, device) -> weight
    linear: Callable[..., torch.Tensor]  # (x [..., K], weight, bias) -> y on the Triton path
    packed_args: tuple[str, ...] = ("qweight_ptr",)  # kernel arguments holding packed codes
    min_load_bytes: int = 16  # widest global load the layout allows for the packed codes
    k_multiple: int = 1  # in_features must be a multiple of this (GGUF k-quants: 256)


WEIGHT_FORMATS: dict[str, WeightFormat] = {}


def register_weight_format(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is registered twice")
    WEIGHT_FORMATS[fmt.name] = fmt
    return fmt


# set by rows_as_one(): every row computed as a one-row call computes it. A module global,
# not a ContextVar: torch.compile traces a global's read (and guards on its value), while a
# ContextVar breaks the graph at every linear layer
_ROWS_AS_ONE = False


@contextlib.contextmanager
def rows_as_one(on: bool = True):
    """Within the block, linear calls of any M compute each row exactly as a one-row call
    (the quantized GEMV plans every M alike, see `invariant_gemv_path`, and runs M > 16 as
    calls of 16; a dense weight's GEMM runs one row at a time). Batch-invariant
    verification on the Triton backend needs it (`specdec.models.batch_invariant`)."""
    global _ROWS_AS_ONE
    saved, _ROWS_AS_ONE = _ROWS_AS_ONE, on
    try:
        yield
    finally:
        _ROWS_AS_ONE = saved


def rows_are_one() -> bool:
    """Whether the calling code runs inside rows_as_one()."""
    return _ROWS_AS_ONE


INVARIANT_GEMV_ENV = "SPECDEC_INVARIANT_GEMV"
INVARIANT_GEMV_PATHS = ("dot", "broadcast")


def invariant_gemv_path() -> str:
    """How rows_as_one() computes fp16 / bf16 GEMV rows on a GPU ($SPECDEC_INVARIANT_GEMV):
    "dot" (default): every M, M = 1 included, through tl.dot's 16-row tensor-core tiles
    planned for 16 rows, so a decode row and a verification row take the same tile (a
    tensor core computes each output row on its own); "broadcast": every row on the
    CUDA-core broadcast path planned for one row (exact fp32 sums, but M rows cost M
    passes of multiply-adds over each weight tile). float32 rows always take the broadcast
    path, and so does Triton's interpreter, whose tl.dot is numpy's BLAS."""
    value = os.environ.get(INVARIANT_GEMV_ENV, "dot")
    if value not in INVARIANT_GEMV_PATHS:
        raise BackendError(
            f"{INVARIANT_GEMV_ENV}={value!r}: choose one of {', '.join(INVARIANT_GEMV_PATHS)}"
        )
    return value
