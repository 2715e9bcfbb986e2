"""Static decoding cost against measured time, per k-quant GEMV point a GPU run timed.

For each bench_kernels record of a k-quant format (and its Q4_1 record of the same shape
and M) in MEASURED.json, this replays the launch on meta tensors exactly as the run
planned it (`--device` picks the tuned GEMV table it used), compiles it for sm_90 and reads
the K loop's warp instructions per KB of packed weight (compile_check's
loop_instructions_per_kb). It prints, per format and row path, the loop cost over Q4_1's
at the same shape and M next to the measured time per weight byte over Q4_1's (CUDA-graph
replays), and the Pearson / Spearman correlation of the two per row path.

    PYTHONPATH=. python benchmarks/results/2026-12-07-kquant-loop-instructions/correlate.py \
        benchmarks/results/2026-12-04-nvidia-h200.json --device "NVIDIA H200" \
        [--model llama-3-8b] [--out loop.json]

Run it in a tree holding the kernels that were timed (for the 2026-12-04 run: a worktree
of f97eed1 with this commit's benchmarks/ copied over it) to correlate, or in today's tree
to see what the same points cost now. A proxy, not a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.compile_cases import bytes_per_weight
from benchmarks.compile_check import (
    ARCHS,
    compile_job,
    import_kernel_modules,
    job_for,
    loop_instructions_per_kb,
)
from specdec.kernels.quant import KQUANT_BLOCKS

META = torch.device("meta")


def fmt_of(rec: dict) -> str:
    return rec["kernel"].removeprefix("quant_linear[").removesuffix("]").split(",")[0]


def measured_vs_q4_1(records: list[dict]) -> list[tuple[dict, float]]:
    """(record, its CUDA-graph time per packed weight byte over Q4_1's at the same shape and
    M) for every k-quant / 5-bit record with both replays (bench_kernels.annotate_vs_q4_1,
    restated here so that the script runs against older trees)."""
    q4_1 = {r["shape"]: r for r in records if r["kernel"] == "quant_linear[q4_1]"}
    out = []
    for r in records:
        ref = q4_1.get(r["shape"])
        if fmt_of(r) not in KQUANT_BLOCKS or ref is None:
            continue
        if "graph_ms" not in r or "graph_ms" not in ref:
            continue
        (nb, block), (nb1, block1) = KQUANT_BLOCKS[fmt_of(r)], (20, 32)
        out.append((r, r["graph_ms"] / ref["graph_ms"] * (nb1 / block1) / (nb / block)))
    return out


def shape_of(rec: dict) -> tuple[int, int, int, str]:
    words = rec["shape"].split()
    field = {w.split("=")[0]: int(w.split("=")[1]) for w in words if "=" in w}
    return field["M"], field["N"], field["K"], words[-1]


def jobs_for(fmt_name: str, m: int, n: int, k: int, dtype: str, device: str):
    """The GEMV launch(es) of one point as planned on `device`, and bytes per weight."""
    from specdec.kernels.utils import WEIGHT_FORMATS, recording

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    fmt = WEIGHT_FORMATS[fmt_name]
    w = fmt.make_weight(n, k, META)
    x = torch.empty(m, k, dtype=dt, device=META)
    with recording(ARCHS["sm_90"]["sms"], device) as launches:
        fmt.linear(x, w, None)
    jobs = [job_for(launch, "sm_90") for launch in launches]
    return [j for j in jobs if "gemv" in j.kernel], bytes_per_weight(w, n, k)


def mean_ranks(v: list[float]) -> list[float]:
    """Ranks of v, tied values sharing their mean rank (shapes that compile to one
    configuration tie on the loop cost)."""
    order = sorted(range(len(v)), key=v.__getitem__)
    r = [0.0] * len(v)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            r[i] = (start + end) / 2
        start = end + 1
    return r


def correlation(a: list[float], b: list[float]) -> float:
    """Pearson's r; nan under 3 points (Spearman's: of mean_ranks)."""
    return statistics.correlation(a, b) if len(a) >= 3 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("measured", type=Path)
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--out", type=Path)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("error: this script compiles for a GPU: unset TRITON_INTERPRET")
    import_kernel_modules()

    try:
        records = json.loads(args.measured.read_text())["kernels"]["bench_kernels"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.measured}: no bench_kernels records ({e!r})", file=sys.stderr)
        return 2
    records = [r for r in records if r["shape"].startswith(args.model)]
    records = [r for r in records if "," not in r["kernel"]]  # the default layout's rows
    measured = measured_vs_q4_1(records)
    points = sorted({(fmt_of(r), *shape_of(r)) for r, _ in measured})
    points += sorted({("q4_1", *pt[1:]) for pt in points})
    planned = {pt: jobs_for(*pt, args.device) for pt in points}
    uniq = {j.key(): j for jobs, _ in planned.values() for j in jobs}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        compiled = dict(zip(uniq, pool.map(compile_job, uniq.values())))

    def cost(pt):
        jobs, bpw = planned[pt]
        if len(jobs) != 1:
            return None, None
        row = compiled[jobs[0].key()]
        row = {**row, "num_warps": jobs[0].options["num_warps"]}
        return loop_instructions_per_kb(row, jobs[0].constexprs, bpw), row

    out = []
    for r, ratio in measured:
        pt = (fmt_of(r), *shape_of(r))
        mine, row = cost(pt)
        ref, _ = cost(("q4_1", *pt[1:]))
        if mine is None or ref is None:
            print(f"skipped {r['kernel']} {r['shape']}: not one GEMV launch", file=sys.stderr)
            continue
        out.append(
            {
                "format": pt[0],
                "shape": r["shape"],
                "path": "M=1" if pt[1] == 1 else "M>1",
                "registers": row["registers"],
                "loop_instructions": row["loop_instructions"],
                "loop_per_kb": mine,
                "loop_vs_q4_1": round(mine / ref, 3),
                "measured_vs_q4_1": round(ratio, 3),
            }
        )
    print("| format | rows | points | loop cost vs Q4_1 (median) | measured vs Q4_1 (median) |")
    print("|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[dict]] = {}
    for o in out:
        groups.setdefault((o["format"], o["path"]), []).append(o)
    for (fmt, path), g in sorted(groups.items()):
        lo = statistics.median(o["loop_vs_q4_1"] for o in g)
        me = statistics.median(o["measured_vs_q4_1"] for o in g)
        print(f"| {fmt} | {path} | {len(g)} | {lo:.2f} | {me:.2f} |")
    for path in ("M=1", "M>1"):
        g = [o for o in out if o["path"] == path]
        a, b = [o["loop_vs_q4_1"] for o in g], [o["measured_vs_q4_1"] for o in g]
        print(
            f"{path}: {len(g)} points, Pearson {correlation(a, b):.2f}, "
            f"Spearman {correlation(mean_ranks(a), mean_ranks(b)):.2f}"
        )
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"device": args.device, "points": out}, indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
