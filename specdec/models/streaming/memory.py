"""Memory checks for a streamed model: what is still free on the device, and whether two
layer slots (plus their dequantized weights and CPU slot kernels on the torch backend) fit."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.models.streaming.layout import Unit


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


def check_memory(device: torch.device, units: list[Unit], n_resident: int) -> None:
    if not units:
        return
    slot = max(u.nbytes for u in units)
    work = max(u.dequant_bytes + u.kernel_bytes for u in units)
    need = 2 * (slot + work)
    free = device_free_bytes(device)
    if free is None or free >= need:
        return
    extra = f" (+ {work / 2**20:.1f} MiB dequantized or prepacked, torch backend)" if work else ""
    raise SpecDecError(
        f"not enough {device} memory to stream this model: two layer buffers of "
        f"{slot / 2**20:.1f} MiB{extra} need {need / 2**30:.2f} GiB but {free / 2**30:.2f} GiB "
        f"is free after the embedding, LM head and {n_resident} resident layers; keep fewer "
        f"layers resident, stream the LM head (head_on_device=False) or use a smaller dtype"
    )
