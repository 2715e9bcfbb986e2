"""Measured launch configurations of the quantized GEMV (`quant_gemv`), per GPU model.

`quant_gemv.tiled_gemv_config` picks tiles and split-K from the shapes alone (4 warps, 3
stages). What is fastest also depends on the chip (SM count, L2, memory latency), so
`python -m benchmarks.tune_gemv` times candidates on the GPU for given weight shapes and
writes a table that `quant_gemv.gemv_config` consults before its heuristic:

    specdec/kernels/configs/gemv-<device>.json   tables shipped with specdec, <device> from
                                                 torch.cuda.get_device_name (lower case, runs
                                                 of other characters -> '-'), e.g. nvidia-h200
    SPECDEC_GEMV_TUNING=/path/table.json         this table instead (for every device)
    SPECDEC_GEMV_TUNING=off                      the heuristic only

An entry is keyed by the weight layout (bits, group size, mins), N, K and the row path:
"m1" (the broadcast path on CUDA cores: one activation row, and fp32 rows of any M, which
are planned as one row) or "dot" (2..16 fp16/bf16 rows, tensor cores; every M, M = 1
included, inside `utils.rows_as_one` with its default "dot" path). Shapes and paths
without an entry keep the heuristic. A table that is not valid (unknown fields, values that
are not powers of two, a tile smaller than the format's group) is an error, not a silent
fallback. Tuned tiles change the order of the fp32 sums, not what is summed.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecDecError

ENV = "SPECDEC_GEMV_TUNING"
CONFIG_DIR = Path(__file__).parent / "configs"
PATHS = ("m1", "dot")
TABLE_VERSION = 1
_FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
_KEY_FIELDS = ("format", "n", "k", "path")
_INFO_FIELDS = ("ms", "heuristic_ms", "gbps")  # measurements kept for the record


def format_key(bits: int, group_size: int, has_mins: bool) -> str:
    """The weight layout as the kernel sees it, e.g. '4b-g128-min' (int4), '8b-g32' (Q8_0)."""
    return f"{bits}b-g{group_size}{'-min' if has_mins else ''}"


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class TunedGemv:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def _power_of_two(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def parse_table(data, source: str) -> dict[tuple[str, int, int, str], TunedGemv]:
    """Validate a table's JSON (as `benchmarks.tune_gemv` writes it) -> {key: TunedGemv}."""

    def bad(msg: str) -> SpecDecError:
        return SpecDecError(f"GEMV tuning table {source}: {msg}")

    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
        raise bad(f"not a version-{TABLE_VERSION} table (a JSON object with 'entries')")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise bad("'entries' must be a list")
    out: dict[tuple[str, int, int, str], TunedGemv] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"entry {i} is not an object")
        unknown = set(e) - set(_FIELDS) - set(_KEY_FIELDS) - set(_INFO_FIELDS)
        missing = (set(_FIELDS) | set(_KEY_FIELDS)) - set(e)
        if unknown or missing:
            raise bad(f"entry {i}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        fmt, n, k, path = (e[f] for f in _KEY_FIELDS)
        if not isinstance(fmt, str) or not re.fullmatch(r"(4|8)b-g\d+(-min)?", fmt):
            raise bad(f"entry {i}: format {fmt!r} is not like '4b-g32-min' or '8b-g32'")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, k)):
            raise bad(f"entry {i}: n and k must be positive integers")
        if path not in PATHS:
            raise bad(f"entry {i}: path {path!r} is not one of {PATHS}")
        for f in ("block_n", "block_k", "num_warps"):
            if not _power_of_two(e[f]) or e[f] > 1024:
                raise bad(f"entry {i}: {f}={e[f]!r} must be a power of two <= 1024")
        for f in ("split_k", "num_stages"):
            v = e[f]
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise bad(f"entry {i}: {f}={v!r} must be an integer in 1..64")
        group = int(fmt.split("-g")[1].split("-")[0])
        if e["block_k"] < 32 or (fmt.startswith("4b") and e["block_k"] < group):
            raise bad(f"entry {i}: block_k={e['block_k']} is below the format's tile minimum")
        key = (fmt, n, k, path)
        if key in out:
            raise bad(f"entry {i} repeats {key}")
        out[key] = TunedGemv(*(e[f] for f in _FIELDS))
    return out


@functools.cache
def _load(path: str) -> dict[tuple[str, int, int, str], TunedGemv]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SpecDecError(f"GEMV tuning table {path}: cannot read it ({err})") from err
    return parse_table(data, path)


def table_path(device_name: str) -> Path | None:
    """The table for a device: $SPECDEC_GEMV_TUNING (None if 'off'), else the shipped one.
    Resolved once per (setting, device): every eager GEMV launch asks."""
    return _table_path(os.environ.get(ENV, "").strip(), device_name, CONFIG_DIR)


@functools.cache
def _table_path(setting: str, device_name: str, config_dir: Path) -> Path | None:
    if setting.lower() == "off":
        return None
    if setting:
        path = Path(setting)
        if not path.is_file():
            raise SpecDecError(f"{ENV}={setting}: no such file (a table path, or 'off')")
        return path
    if not device_name:
        return None
    shipped = config_dir / f"gemv-{device_slug(device_name)}.json"
    return shipped if shipped.is_file() else None


def lookup(
    device_name: str, bits: int, group_size: int, has_mins: bool, n: int, k: int, path: str
) -> TunedGemv | None:
    """The tuned configuration for this weight and row path on `device_name`, if any."""
    table = table_path(device_name)
    if table is None:
        return None
    return _load(str(table)).get((format_key(bits, group_size, has_mins), n, k, path))


def clear_cache() -> None:
    """Forget loaded tables and resolved paths (after writing one, or in tests)."""
    _load.cache_clear()
    _table_path.cache_clear()
