"""Backend dispatch and launch helpers shared by the kernel files.

Each kernel has a Triton implementation and a plain-torch reference with the same
semantics. `resolve_backend(device)` picks one:

    SPECDEC_BACKEND=auto   (default) Triton on CUDA, torch reference elsewhere
    SPECDEC_BACKEND=torch  torch reference everywhere
    SPECDEC_BACKEND=triton Triton everywhere; on CPU this is Triton's interpreter and
                           needs TRITON_INTERPRET=1 in the environment

`set_backend(name)` overrides the environment for this process (config option).
Asking for Triton where it cannot run raises BackendError: there is no silent fallback.
"""

from __future__ import annotations

import functools
import os

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
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if not triton_interpret():
            raise BackendError(
                "Triton backend requested on CPU: Triton runs on CPU only in its interpreter; "
                "set TRITON_INTERPRET=1 (slow) or use SPECDEC_BACKEND=torch"
            )
        return
    raise BackendError(f"Triton backend cannot run on device type {device.type!r}")


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


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (4 elsewhere: keeps interpreter grids small)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
