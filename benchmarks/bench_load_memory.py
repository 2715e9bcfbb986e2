"""Memory and time of loading a model on CPU: specdec per CPU linear mode against HF
transformers on the same GGUF.

    python -m benchmarks.bench_load_memory [--models qwen2.5-coder-0.5b]
                                           [--modes bfloat16:dense bfloat16:native]
                                           [--hf-dtype bfloat16] [--no-hf] [--quick]

Each system loads in a fresh process (`python -m benchmarks.bench_load_memory --child`), so
one's freed memory cannot lower another's numbers. Reported per process, from
/proc/self/status: the peak resident memory of the load (VmHWM; it includes the GGUF's
file-backed pages read through the memory map) and of the whole load + setup, the
anonymous memory the ready model holds (RssAnon: weights, kernels' copies, heap), and the
wall time. The ratios are against HF transformers' model of the same file
(`benchmarks.models.hf_gguf_model`: dequantized to --hf-dtype), the usual dense baseline.
Linux only (reads /proc). --out DIR writes DIR/bench_load_memory.json + .csv.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.harness import bench_parser, environment, markdown_table, results_dir, save_results
from specdec.cli import user_errors
from specdec.errors import SpecDecError

COLUMNS = [
    ("model", "model", ""),
    ("system", "system", ""),
    ("load_peak_mib", "load peak MiB", ".0f"),
    ("peak_mib", "load + setup peak MiB", ".0f"),
    ("anon_mib", "ready: anon MiB", ".0f"),
    ("peak_vs_hf", "peak / HF", ".2f"),
    ("anon_vs_hf", "anon / HF", ".2f"),
    ("wall_s", "wall s", ".1f"),
]


def status_mib() -> dict[str, float]:
    """VmHWM and RssAnon of this process in MiB."""
    out = {}
    for line in open("/proc/self/status").read().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon"):
            out[key] = int(value.split()[0]) / 1024
    return out


def child(model: str, system: str) -> dict:
    """Load `model` as `system` ("specdec <dtype:mode>" or "hf <dtype>") in this process."""
    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    kind, spec = system.split(" ", 1)
    if kind == "hf":
        from benchmarks.models import hf_gguf_model
        from specdec.models.registry import resolve_model_path

        hf_gguf_model(resolve_model_path(model), spec)
        load = status_mib()
    else:
        from benchmarks.harness import setup_cpu_mode
        from specdec.models.load import load_weights

        m, _, _ = load_weights(model)
        load = status_mib()
        setup_cpu_mode(m, spec)
    end = status_mib()
    return {
        "model": model,
        "system": system,
        "load_peak_mib": load["VmHWM"],
        "peak_mib": end["VmHWM"],
        "anon_mib": end["RssAnon"],
        "wall_s": time.perf_counter() - t0,
    }


def run_child(model: str, system: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_load_memory", "--child", model, system]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
        raise SpecDecError(f"loading {model} as {system} failed: {tail}")
    return json.loads(lines[-1])


@user_errors
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(argv[1], argv[2])))
        return
    ap = bench_parser(__doc__)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"])
    ap.add_argument("--modes", nargs="+", default=["bfloat16:dense", "bfloat16:native"])
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--no-hf", action="store_true", help="specdec only (no ratios)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.modes = ["smollm2-135m"], ["bfloat16:dense"]
    records = []
    for model in args.models:
        hf = None if args.no_hf else run_child(model, f"hf {args.hf_dtype}")
        rows = [run_child(model, f"specdec {m}") for m in args.modes]
        for r in rows:
            if hf is not None:
                r["peak_vs_hf"] = r["peak_mib"] / hf["peak_mib"]
                r["anon_vs_hf"] = r["anon_mib"] / hf["anon_mib"]
        records += [*rows, *([hf] if hf else [])]
    env = environment()
    print(f"\nloading on CPU, one process per row, {env.get('cpu', '')}, torch {env.get('torch')}")
    print(markdown_table(records, COLUMNS))
    out = results_dir(args)
    if out is not None:
        print("wrote", save_results("bench_load_memory", records, out=out, env=env))


if __name__ == "__main__":
    main()
