"""One benchmark harness: device sync and timing, the environment record, the model shapes
and atomic JSON + CSV results; `run_kernel_bench` drives the kernel benchmarks.

    from benchmarks.harness import MODEL_SHAPES, environment, save_results, time_ms

    ms = time_ms(lambda: model(tokens, cache, pos))   # median ms; do_bench on CUDA
    save_results("cpu_linear", rows)                 # benchmarks/results/<name>.json + .csv

Timing on CUDA uses `triton.testing.do_bench` (median over a time budget); on CPU the
median of `repeats` wall-clock calls after `warmup` calls. Quote medians and ratios from one
process: machines are noisy.

GPU runs also merge into one combined file per machine and day,
benchmarks/results/<date>-<gpu>.json (`merge_results`), which benchmarks/gpu_check.sh
collects and benchmarks/report.py turns into docs/gpu.md's tables. Random-weight models,
drafters and baselines live in benchmarks/models.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.models.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# One definition per real model shape (random-weight benchmarks build models of these).
MODEL_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        rope_theta=100000.0,
        max_seq_len=2048,
        tie_embeddings=True,
        name="smollm2-135m-shape",
    ),
    "qwen2.5-0.5b": ModelConfig(
        arch="qwen2",
        vocab_size=151936,
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        ffn_dim=4864,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        max_seq_len=32768,
        tie_embeddings=False,  # Qwen2.5-Coder-0.5B's GGUF ships a separate output.weight
        qkv_bias=True,
        name="qwen2.5-0.5b-shape",
    ),
    "llama-3-8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
        name="llama3-8b-shape",
    ),
}


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object],
    *,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    budget_ms: tuple[int, int] = (25, 100),
) -> float:
    """Median milliseconds per call of `fn`.

    CUDA (device given as cuda, or None with CUDA present): triton's do_bench with
    `budget_ms` = (warmup, rep) milliseconds. CPU: `warmup` untimed calls, then the median
    of `repeats` timed calls.
    """
    dev = torch.device(device) if device is not None else None
    on_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if on_cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=budget_ms[0], rep=budget_ms[1], return_mode="median"))
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def graph_ms(fn: Callable[[], object], *, launches: int = 20, replays: int = 5) -> float:
    """CUDA: median ms per call of `fn` replayed from a CUDA graph of `launches` calls, the
    GPU's time without the host's launch cost (what a captured decode step pays; `time_ms`
    includes it, and for kernels of a few microseconds measures little else). Inputs small
    enough for L2 stay there across the calls: for them this is a lower bound."""
    fn()  # compiled, allocator warm
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    del graph
    return statistics.median(times)


def add_graph_time(rec: dict, fn: Callable[[], object], nbytes: int, device) -> dict:
    """On CUDA: rec["graph_ms"] / rec["graph_gbps"] from `graph_ms(fn)`, or rec["graph_error"]
    when fn cannot be captured (a host sync inside, say): recorded, not hidden. CPU: as is."""
    if torch.device(device).type != "cuda":
        return rec
    try:
        ms = graph_ms(fn)
    except RuntimeError as e:
        rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.synchronize()
        return rec
    rec["graph_ms"] = ms
    rec["graph_gbps"] = nbytes / (ms * 1e-3) / 1e9
    return rec


def git_commit() -> str:
    """The commit a result was measured on: $SPECDEC_COMMIT when set (a copied working tree
    can carry a stale .git: the GPU machine's reported a commit older than the code it
    ran), else `git rev-parse`, with "+dirty" when tracked files differ from it."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_name() -> str:
    from specdec.models.cpu_linear import isa_note

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name + isa_note()


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return cpu_name()


def environment(device: torch.device | str | None = None, **extra) -> dict:
    """What a result was measured on: device, CPU, versions, commit, threads, date."""
    import triton

    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": device_name(device),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
    }
    env.update(extra)
    return env


def parse_mode_spec(spec: str) -> tuple[str, str, str | None, bool]:
    """ "dtype:cpu_linear[:batch_invariant][+compile]" -> (dtype, cpu_linear, batch_invariant
    or None, compiled); a malformed spec is a SpecDecError (one error line, before loading)."""
    from specdec.models.cpu_linear import MODES

    base, plus, extra = spec.partition("+")
    fields = base.split(":")
    if (plus and extra != "compile") or not 2 <= len(fields) <= 3:
        raise SpecDecError(f"mode {spec!r}: expected dtype:cpu_linear[:auto|on|off][+compile]")
    if fields[1] not in MODES:
        raise SpecDecError(f"mode {spec!r}: cpu_linear must be one of {', '.join(MODES)}")
    if len(fields) == 3 and fields[2] not in ("auto", "on", "off"):
        raise SpecDecError(f"mode {spec!r}: batch invariance must be auto, on or off")
    return fields[0], fields[1], fields[2] if len(fields) == 3 else None, bool(plus)


def cpu_mode_model(path, spec: str):
    """A model set up on CPU for a mode spec "dtype:cpu_linear[:batch_invariant][+compile]"
    (e.g. "bfloat16:dense", "bfloat16:dense:off", "bfloat16:native+compile";
    specdec.models.cpu_linear, specdec.models.batch_invariant, and compiled steps:
    specdec.models.cpu_compile, which the caller warms before timing) -> (model, tokenizer)."""
    from specdec.models.load import load_weights

    model, tok, _ = load_weights(str(path))
    return setup_cpu_mode(model, spec), tok


def setup_cpu_mode(model, spec: str):
    """`model` (as loaded, not set up) set up on CPU for a mode spec (`cpu_mode_model`)."""
    from specdec.models.load import parse_dtype

    dtype, mode, inv, compiled = parse_mode_spec(spec)
    with torch.inference_mode():
        model.setup(
            parse_dtype(dtype),
            "cpu",
            "torch",
            cpu_linear=mode,
            batch_invariant_setting=inv,
            cpu_compile="on" if compiled else None,
        )
    return model.eval()


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary file next to `path`, then rename it into place (a reader
    never sees half a file). The file gets the usual permissions (0666 minus the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_results(
    name: str,
    records: list[dict],
    *,
    out: Path | str | None = None,
    env: dict | None = None,
) -> Path:
    """Write `records` (flat dicts) as `<out>/<name>.json` ({"environment", "records"}) and
    `<out>/<name>.csv` (one row per record, columns = union of keys), both atomically.
    `out` defaults to benchmarks/results/. Returns the JSON path."""
    out_dir = Path(out) if out is not None else RESULTS_DIR
    env = env if env is not None else environment()
    path = out_dir / f"{name}.json"
    atomic_write(path, json.dumps({"environment": env, "records": records}, indent=1) + "\n")
    columns: list[str] = []
    for r in records:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    for r in records:
        writer.writerow(
            {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()}
        )
    atomic_write(out_dir / f"{name}.csv", buf.getvalue())
    return path


def markdown_table(records: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec) -> a GitHub markdown table; missing values '-'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for r in records:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge_results(path: Path | str, update: dict) -> dict:
    """Load the combined results file `path` if it exists, merge `update` into it (a dict
    value merges one level deep, so benchmarks can share a key such as "kernels") and write
    it back atomically. Returns the merged data."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    atomic_write(path, json.dumps(data, indent=1) + "\n")
    return data


def combined_results_path(out: Path | str, device: torch.device | str | None = None) -> Path:
    """<out>/<date>-<device slug>.json: the file every GPU benchmark of a day merges into."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return Path(out) / f"{date}-{slug(device_name(device))}.json"


def copy_bandwidth_gbps(device: torch.device | str, nbytes: int | None = None) -> float:
    """Device-to-device copy: bytes read + written per second (1 GiB on CUDA, 32 MiB else)."""
    device = torch.device(device)
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (32 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device, budget_ms=(5, 20))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def kernel_record(
    kernel: str,
    shape: str,
    ms: float,
    nbytes: int,
    copy_bw_gbps: float,
    baseline: str | None,
    baseline_ms: float | None,
) -> dict:
    """One kernel benchmark row: time, effective GB/s for the bytes the kernel must move at
    least, its fraction of the measured copy bandwidth, and the baseline's time."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": kernel,
        "shape": shape,
        "ms": ms,
        "gbps": gbps,
        "fraction_of_copy_bandwidth": gbps / copy_bw_gbps,
        "baseline": baseline,
        "baseline_ms": baseline_ms,
        "speedup": baseline_ms / ms if baseline_ms else None,
    }


KERNEL_COLUMNS = [
    ("kernel", "kernel", ""),
    ("shape", "shape", ""),
    ("ms", "ms", ".4f"),
    ("gbps", "GB/s", ".0f"),
    ("fraction_of_copy_bandwidth", "of copy BW", ".0%"),
    ("baseline", "baseline", ""),
    ("baseline_ms", "baseline ms", ".4f"),
    ("speedup", "speedup", ".2f"),
    ("graph_ms", "graph ms", ".4f"),  # GEMV rows on CUDA: replayed from a graph
    ("graph_gbps", "graph GB/s", ".0f"),
]

Section = Callable[[float], list[dict]]  # f(copy_bw_gbps) -> kernel records


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --quick and --out."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few points (CPU: tiny smoke)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    return parser


def results_dir(args: argparse.Namespace) -> Path | None:
    """Where a run saves: --out; a full run defaults to benchmarks/results/, a --quick run
    saves nothing without --out."""
    return args.out if args.quick else (args.out or RESULTS_DIR)


def run_kernel_bench(
    name: str,
    doc: str,
    *,
    full: Sequence[Section],
    quick: Sequence[Section],
    cpu: Sequence[Section],
    argv: list[str] | None = None,
) -> int:
    """The driver of a kernel benchmark (`python -m benchmarks.<name>`): on CUDA the `full`
    sections (`quick` with --quick), on CPU with --quick the `cpu` sections through Triton's
    interpreter (plumbing, not performance). Measures copy bandwidth, runs the sections,
    prints a table, writes <out>/<name>.json + .csv and merges the records into the combined
    file under "kernels"/<name>."""
    import logging

    args = bench_parser(doc).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print(f"{name} needs a CUDA GPU; use --quick for a CPU smoke run")
        return 0
    if not cuda:
        print("no CUDA device: CPU smoke run in Triton's interpreter (timings are meaningless)")
    device = torch.device("cuda" if cuda else "cpu")
    sections = (quick if args.quick else full) if cuda else cpu
    copy_bw = copy_bandwidth_gbps(device)
    print(f"copy bandwidth: {copy_bw:.0f} GB/s (read + write)")
    out = results_dir(args)
    env = environment(device, copy_bandwidth_gbps=copy_bw)
    combined = None if out is None else combined_results_path(out, device)

    def save(records: list[dict]) -> None:  # after every section: a timeout keeps the rest
        if out is None:
            return
        save_results(name, records, out=out, env=env)
        update = {"gpu": env["device"], "date": env["date"], "environment": env}
        update |= {"copy_bandwidth_gbps": copy_bw, "kernels": {name: records}}
        merge_results(combined, update)

    records: list[dict] = []
    for section in sections:
        logging.getLogger(__name__).info("section %s", section.__name__)
        records += section(copy_bw)
        save(records)
    print(markdown_table(records, KERNEL_COLUMNS))
    if out is not None:
        path = out / f"{name}.json"
        print(f"wrote {path} and {combined}")
    return 0
