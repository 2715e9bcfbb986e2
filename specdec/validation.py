"""Checks on user-given values shared by the CLI (specdec.generate) and the experiment runner:
each returns the value in its proper type or raises a SpecDecError naming the option, so a
bad value is one error line before any model loads."""

from __future__ import annotations

import math

from specdec.errors import SpecDecError

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


def _number(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def integer(v: object, name: str, *, minimum: int | None = None) -> int:
    """An int (not a bool, not a string: a mistyped Hydra override arrives as one) >= minimum."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise SpecDecError(f"{name} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise SpecDecError(f"{name} must be >= {minimum}, got {v}")
    return v


def finite(v: object, name: str) -> float:
    x = _number(v)
    if x is None or not math.isfinite(x):
        raise SpecDecError(f"{name} must be a finite number, got {v!r}")
    return x


def boolean(v: object, name: str) -> bool:
    if not isinstance(v, bool):
        raise SpecDecError(f"{name} must be true or false, got {v!r}")
    return v


def sampling(temperature: object, top_k: object, top_p: object, prefix: str = "--"):
    """-> SamplingParams; temperature finite >= 0, top_k integer >= 0, top_p in (0, 1]."""
    from specdec.decode.sampling import SamplingParams

    sep = "-" if prefix == "--" else "_"
    t = finite(temperature, f"{prefix}temperature")
    if t < 0:
        raise SpecDecError(f"{prefix}temperature must be >= 0, got {temperature!r}")
    k = integer(top_k, f"{prefix}top{sep}k", minimum=0)
    p = finite(top_p, f"{prefix}top{sep}p")
    if not 0.0 < p <= 1.0:
        raise SpecDecError(f"{prefix}top{sep}p must be in (0, 1], got {top_p!r}")
    return SamplingParams(t, k, p)


def seed(v: object, name: str = "--seed", count: int = 1) -> int:
    """A seed for torch.Generator; `count` consecutive seeds (seed, seed + 1, ...) are used."""
    s = integer(v, name, minimum=0)
    if s + count > SEED_LIMIT:
        raise SpecDecError(
            f"{name} must be below 2**64{f' - {count - 1}' if count > 1 else ''}, got {s}"
        )
    return s


def device(name: str) -> None:
    """`name` names a device this machine has (cpu, cpu:0, cuda, cuda:N with N < count)."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise SpecDecError(f"invalid device {name!r} ({e})") from e
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise SpecDecError(f"device {name!r}: there is one CPU device (cpu or cpu:0)")
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if dev.index >= n:
            raise SpecDecError(f"device {name!r}: this machine has {n} CUDA device(s)")


def text(s: str, name: str) -> str:
    """A prompt must be valid Unicode text: argv bytes that were not UTF-8 arrive as lone
    surrogates (Python's surrogateescape), as do JSON escapes such as \\udc80."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start : e.end]
        raise SpecDecError(
            f"{name} is not valid UTF-8 text (at character {e.start}: {bad!r})"
        ) from e
    return s
