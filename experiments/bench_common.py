"""Timing and result records shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], warmup: int = 5, rep: int = 20) -> float:
    """Median milliseconds per call: triton's do_bench on CUDA (warmup / rep in ms), a wall
    clock over three calls elsewhere (CPU smoke runs)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def record(kernel, shape, ms, nbytes, copy_bw_gbps, baseline, baseline_ms) -> dict:
    """One benchmark row: time, effective GB/s for the bytes the kernel must move at least,
    its fraction of the measured copy bandwidth, and the baseline's time."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": kernel,
        "shape": shape,
        "ms": ms,
        "gbps": gbps,
        "fraction_of_copy_bandwidth": gbps / copy_bw_gbps,
        "baseline": baseline,
        "baseline_ms": baseline_ms,
    }
