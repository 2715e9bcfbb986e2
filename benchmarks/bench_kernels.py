"""GPU kernel benchmark: the quantized GEMV (`quant_linear`) on the real models' projections.

    python -m benchmarks.bench_kernels            # full run, about a minute on one GPU
    python -m benchmarks.bench_kernels --quick    # a few shapes; on CPU a tiny interpreter smoke
    python -m benchmarks.bench_kernels --out DIR  # results directory (default benchmarks/results;
                                                  # --quick saves only when --out is given)

Sections: SmolLM2-135M and Llama-3-8B projection shapes (from benchmarks.harness.MODEL_SHAPES:
q/o, k/v, gate/up, down, LM head) at M in {1, 2, 4, 8, 16}, bf16 activations, formats q4_1 /
int4 (group 128) / q8_0 (a tied LM head: q8_0 only, as SmolLM2's GGUF ships it). The baseline
is torch's own quantized kernel where one exists (int4: torch._weight_int4pack_mm; q8_0:
torch._weight_int8pack_mm, per-channel int8), else F.linear on the dequantized bf16 weight;
every record also carries that dense time as dense_bf16_ms. GB/s counts the bytes that must
move: packed weights + scales (+ mins) + activations + outputs. `ms` times eager calls
(do_bench), launch path included: on an H200 every shape under ~10 MB measured 0.05-0.15 ms
whatever the format, i.e. the host's launch cost; on CUDA each GEMV row also carries
graph_ms / graph_gbps, the same call replayed 20 times from a CUDA graph (the kernel's own
time, as a captured decode step pays it; small weights stay in L2 there). The k-quant
section runs q4_1 / q5_0 / q4_k / q5_k / q6_k on the SmolLM2, Qwen2.5-0.5B and Llama-3-8B
shapes (k-quants only where 256 divides K) and records each format's time per weight byte
over Q4_1's on the same shape and M (ms_per_weight_byte_vs_q4_1, from the graph replays
where there are any; the goal is <= 1.2) and prints a per-format summary;
`python -m benchmarks.bench_kernels --kquant-summary FILE.json` prints it for a results file
(a bench_kernels.json or a combined one). Each k-quant record names the tile layout
kquant_gemv chose ("layout"); a last section times the same rows in the other layout
(kernel "quant_linear[fmt,layout]"), the A/B that settles kquant_gemv.DEFAULT_LAYOUT.
The attention and rejection-sampling kernels have their own benchmarks (bench_attention,
bench_rejection).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the CPU smoke run needs the interpreter before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import (  # noqa: E402
    MODEL_SHAPES,
    add_graph_time,
    kernel_record,
    run_kernel_bench,
)
from benchmarks.harness import time_ms as _time_ms  # noqa: E402
from benchmarks.models import random_weight  # noqa: E402
from specdec.kernels.kquant_gemv import (  # noqa: E402
    LAYOUTS,
    empty_kquant_weight,
    kquant_gemv_config,
    layout_for,
    tile_layout,
)
from specdec.kernels.quant import KQUANT_BLOCKS, QuantizedWeight  # noqa: E402
from specdec.kernels.quant_gemv import quant_linear  # noqa: E402
from specdec.kernels.utils import target_of  # noqa: E402
from specdec.models.config import ModelConfig  # noqa: E402

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16)
FORMATS = ("q4_1", "int4", "q8_0")
# the k-quant section: Q4_1 first, the reference of the k-quants' time per weight byte
KQUANT_FORMATS = ("q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
# largest |code * sub-scale| per unit of d, to scale random k-quant weights like random_weight
KQUANT_PEAK = {"q5_0": 16, "q5_1": 32, "q4_k": 63 * 15, "q5_k": 63 * 31, "q6_k": 128 * 32}
time_ms = partial(_time_ms, warmup=1, repeats=3, budget_ms=(5, 20))


@dataclass(frozen=True)
class GemvCase:
    model: str
    layer: str
    n: int  # out_features
    k: int  # in_features
    formats: tuple[str, ...] = FORMATS


def gemv_cases(name: str, cfg: ModelConfig) -> list[GemvCase]:
    """The distinct projection shapes of one model (q/o share one when q_dim == dim)."""
    d = cfg.dim
    head_formats = ("q8_0",) if cfg.tie_embeddings else FORMATS
    return [
        GemvCase(name, "q_proj/o_proj", cfg.q_dim, d),
        GemvCase(name, "k_proj/v_proj", cfg.kv_dim, d),
        GemvCase(name, "gate/up_proj", cfg.ffn_dim, d),
        GemvCase(name, "down_proj", d, cfg.ffn_dim),
        GemvCase(name, "lm_head", cfg.vocab_size, d, head_formats),
    ]


SMOLLM2 = gemv_cases("smollm2-135m", MODEL_SHAPES["smollm2-135m"])
LLAMA3_8B = gemv_cases("llama-3-8b", MODEL_SHAPES["llama-3-8b"])


def random_kquant_weight(fmt: str, n: int, k: int, device: torch.device) -> QuantizedWeight:
    """Random codes and sub-scales in `fmt`'s planes, d (and min) scaled so that x @ W.T keeps
    x's scale roughly (only time and agreement with the dequantized weight are used)."""
    w = empty_kquant_weight(fmt, n, k, device)
    for plane in (w.qweight, w.qhigh, w.sub):
        if plane is not None:
            plane.view(torch.uint8).copy_(torch.randint(0, 256, plane.shape, device=device))
    d = (0.5 + torch.rand(w.scales.shape, device=device)) / (KQUANT_PEAK[fmt] * k**0.5)
    w.scales.copy_(d)
    if w.mins is not None:
        w.mins.copy_(d * (8 if fmt == "q5_1" else 1))
    return w


def make_weight(fmt: str, n: int, k: int, device: torch.device) -> QuantizedWeight:
    if fmt in KQUANT_BLOCKS:
        return random_kquant_weight(fmt, n, k, device)
    return random_weight(fmt, n, k, device)


def torch_quant_baseline(fmt: str, w: QuantizedWeight, x: torch.Tensor):
    """(name, fn(x)) of torch's own quantized matmul for this format, or None where it cannot
    run. Its weights are random in torch's packing: only the time is used."""
    n, k = w.shape
    try:
        if fmt == "int4":
            inner = 8 if k % 256 == 0 else 4 if k % 128 == 0 else 2
            packed = torch._convert_weight_to_int4pack(w.qweight, inner)
            sz = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device=x.device)
            fn = lambda x: torch._weight_int4pack_mm(x, packed, 128, sz)
            name = "torch._weight_int4pack_mm"
        elif fmt == "q8_0":
            w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=x.device)
            s8 = torch.rand(n, dtype=torch.bfloat16, device=x.device)
            fn = lambda x: torch._weight_int8pack_mm(x, w8, s8)
            name = "torch._weight_int8pack_mm (per-channel)"
        else:
            return None
        fn(x)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError) as e:
        reason = str(e).split(". ")[0] or type(e).__name__
        log.info("no torch quantized baseline for %s %s: %s", fmt, tuple(w.shape), reason)
        return None
    return name, fn


def bench_gemv(
    copy_bw_gbps: float,
    cases: list[GemvCase],
    *,
    rows: tuple[int, ...] = ROWS,
    device: torch.device | str = "cuda",
    other_layout: bool = False,
) -> list[dict]:
    """Records of quant_linear on every case x format x M. k-quant records carry the tile
    layout kquant_gemv chose ("layout"); with other_layout=True only the k-quant formats run,
    each row in the layout kquant_gemv would not choose (kernel "quant_linear[fmt,layout]"),
    the A/B that settles DEFAULT_LAYOUT on a GPU."""
    device = torch.device(device)
    dt = torch.bfloat16
    records = []
    for case in cases:
        n, k = case.n, case.k
        dense_ms = {}
        for fmt in case.formats:
            if fmt in KQUANT_BLOCKS and k % KQUANT_BLOCKS[fmt][1]:
                continue  # the super-blocks do not tile K (GGUF files fall back to q5_0 / q8_0)
            if other_layout and fmt not in KQUANT_BLOCKS:
                continue
            w = make_weight(fmt, n, k, device)
            w_dense = w.dequantize(dt)  # [N, K]
            quant = torch_quant_baseline(fmt, w, torch.randn(1, k, device=device, dtype=dt))
            for m in rows:
                name, layout = f"quant_linear[{fmt}]", None
                if fmt in KQUANT_BLOCKS:
                    layout = layout_for(
                        fmt, kquant_gemv_config(m, w, dt, target_of(device)).use_dot
                    )
                    if other_layout:
                        layout = next(t for t in LAYOUTS if t != layout)
                        name = f"quant_linear[{fmt},{layout}]"
                with tile_layout(layout) if other_layout else nullcontext():
                    rec = gemv_record(fmt, case, m, w, w_dense, quant, dense_ms, copy_bw_gbps, name)
                if layout is not None:
                    rec["layout"] = layout
                records.append(rec)
    return annotate_vs_q4_1(records)


def gemv_record(fmt, case, m, w, w_dense, quant, dense_ms, copy_bw_gbps, name) -> dict:
    """One GEMV row: agreement with the dense weight, eager and graph-replay times, the
    baseline's time (torch's quantized kernel where one exists, else the dense F.linear)."""
    n, k = case.n, case.k
    dt = w_dense.dtype
    device = w_dense.device
    x = torch.randn(m, k, device=device, dtype=dt)
    y = quant_linear(x, w, backend="triton")
    ref = F.linear(x, w_dense).float()
    err = (y.float() - ref).abs().max().item()
    if not err <= 2e-2 * ref.abs().max().item():
        log.warning("%s %s M=%d differs from dense by %.3g", name, case.layer, m, err)
    ms = time_ms(lambda: quant_linear(x, w, backend="triton"))
    if m not in dense_ms:
        dense_ms[m] = time_ms(lambda: F.linear(x, w_dense))
    baseline, baseline_ms = "F.linear bf16 (dequantized)", dense_ms[m]
    if quant is not None:
        baseline, baseline_ms = quant[0], time_ms(lambda: quant[1](x))
    nbytes = w.nbytes() + (m * k + m * n) * x.element_size()
    shape = f"{case.model} {case.layer} M={m} N={n} K={k} bf16"
    rec = kernel_record(name, shape, ms, nbytes, copy_bw_gbps, baseline, baseline_ms)
    rec["dense_bf16_ms"] = dense_ms[m]
    # the kernel without the eager launch path (CUDA only)
    add_graph_time(rec, lambda: quant_linear(x, w, backend="triton"), nbytes, device)
    rec["weight_bytes"] = w.nbytes()
    log.info("%s %s: %.4f ms (%s %.4f ms)", name, shape, ms, baseline, baseline_ms)
    return rec


def fmt_of(rec: dict) -> str:
    """The weight format of a GEMV record: quant_linear[q4_k] or quant_linear[q4_k,halves]."""
    return rec["kernel"].removeprefix("quant_linear[").removesuffix("]").split(",")[0]


def weight_bytes(rec: dict) -> int:
    """Packed weight + scale bytes of a GEMV record (recorded since 2026-12-06; older records:
    from the format's block size and the shape's N and K)."""
    if "weight_bytes" in rec:
        return rec["weight_bytes"]
    n, k = (int(rec["shape"].split(f" {x}=")[1].split()[0]) for x in ("N", "K"))
    block_bytes, block = KQUANT_BLOCKS.get(fmt_of(rec), (20, 32))  # q4_1: 16 B codes + d + m
    return n * k // block * block_bytes


def annotate_vs_q4_1(records: list[dict]) -> list[dict]:
    """Set the k-quant goal's ratio on every 5-bit / k-quant record that has a Q4_1 record of
    the same shape and M: ms_per_weight_byte_vs_q4_1 = (its time / its weight bytes) over
    Q4_1's, from the kernels' own times (graph_ms, CUDA-graph replay) where both have them,
    else from eager calls; eager_ms_per_weight_byte_vs_q4_1 always (on an H200 eager calls of
    weights under ~10 MB measure the host's launch path, 0.05-0.15 ms whatever the format,
    so the eager ratio of a small shape says little); vs_q4_1_timing names the source."""
    q4_1 = {r["shape"]: r for r in records if r["kernel"] == "quant_linear[q4_1]"}
    for r in records:
        ref = q4_1.get(r["shape"])
        if fmt_of(r) not in KQUANT_BLOCKS or ref is None:
            continue
        scale = weight_bytes(ref) / weight_bytes(r)
        r["eager_ms_per_weight_byte_vs_q4_1"] = r["ms"] / ref["ms"] * scale
        field, timing = (
            ("graph_ms", "graph") if "graph_ms" in r and "graph_ms" in ref else ("ms", "eager")
        )
        r["ms_per_weight_byte_vs_q4_1"] = r[field] / ref[field] * scale
        r["vs_q4_1_timing"] = timing
    return records


def kquant_summary(records: list[dict], goal: float = 1.2) -> list[dict]:
    """Per format, row path (M = 1: the broadcast path; M = 2..16: tensor cores in bf16) and
    tile layout (records since 2026-12-06 carry both kquant_gemv layouts): how many shapes
    meet ms_per_weight_byte_vs_q4_1 <= goal, the median and the worst."""
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    fresh = [{k: v for k, v in r.items() if "vs_q4_1" not in k} for r in records]
    for r in annotate_vs_q4_1(fresh):
        if "ms_per_weight_byte_vs_q4_1" not in r:
            continue
        m = int(r["shape"].split(" M=")[1].split()[0])
        layout = r.get("layout", "")  # "" for records before the A/B (2026-12-06)
        if layout and "," not in r["kernel"]:
            layout += " (default)"
        key = (fmt_of(r), "M=1" if m == 1 else "M>1", layout, r["vs_q4_1_timing"])
        groups.setdefault(key, []).append(r["ms_per_weight_byte_vs_q4_1"])
    return [
        {
            "format": f,
            "rows": rows,
            "layout": layout,
            "timing": timing,
            "met": sum(v <= goal for v in vals),
            "points": len(vals),
            "median": statistics.median(vals),
            "worst": max(vals),
        }
        for (f, rows, layout, timing), vals in sorted(groups.items())
    ]


def print_kquant_summary(records: list[dict], goal: float = 1.2) -> None:
    rows = kquant_summary(records, goal)
    if not rows:
        return
    print(f"k-quant time per weight byte over Q4_1's (goal <= {goal}):")
    print("| format | rows | tile layout | timing | met | median | worst |")
    print("|---|---|---|---|---|---|---|")
    for s in rows:
        print(
            f"| {s['format']} | {s['rows']} | {s['layout'] or '-'} | {s['timing']} "
            f"| {s['met']} / {s['points']} "
            f"| {s['median']:.2f} | {s['worst']:.2f} |"
        )


def bench_gemv_smollm2(copy_bw_gbps: float) -> list[dict]:
    return bench_gemv(copy_bw_gbps, SMOLLM2)


def bench_gemv_llama3_8b(copy_bw_gbps: float) -> list[dict]:
    return bench_gemv(copy_bw_gbps, LLAMA3_8B)


def kquant_cases(cases: list[GemvCase]) -> list[GemvCase]:
    return [replace(c, formats=KQUANT_FORMATS) for c in cases]


KQUANT = kquant_cases(
    SMOLLM2 + gemv_cases("qwen2.5-0.5b", MODEL_SHAPES["qwen2.5-0.5b"]) + LLAMA3_8B
)


def bench_gemv_kquant(copy_bw_gbps: float) -> list[dict]:
    """The k-quant / 5-bit formats next to Q4_1 on the same shapes (records carry
    ms_per_weight_byte_vs_q4_1)."""
    return bench_gemv(copy_bw_gbps, KQUANT)


def bench_gemv_kquant_layouts(copy_bw_gbps: float) -> list[dict]:
    """The same k-quant rows in the tile layout kquant_gemv does not choose (its own section,
    after the others: a timeout loses only this A/B)."""
    return bench_gemv(copy_bw_gbps, KQUANT, other_layout=True)


def bench_gemv_quick(copy_bw_gbps: float) -> list[dict]:
    cases = [SMOLLM2[2], LLAMA3_8B[0], LLAMA3_8B[2]]
    cases += kquant_cases(cases[1:])
    records = bench_gemv(copy_bw_gbps, cases, rows=(1, 4, 16))
    return records + bench_gemv(copy_bw_gbps, cases, rows=(1, 4, 16), other_layout=True)


def cpu_smoke(copy_bw_gbps: float) -> list[dict]:
    """Tiny shapes through Triton's interpreter: checks the plumbing, not performance."""
    cases = [
        GemvCase("tiny", "proj", 64, 256),
        GemvCase("tiny", "odd", 37, 96, ("q8_0",)),
        GemvCase("tiny", "kquant", 48, 256, ("q4_1", "q4_k", "q5_0")),
    ]
    records = bench_gemv(copy_bw_gbps, cases, rows=(1, 4), device="cpu")
    return records + bench_gemv(copy_bw_gbps, cases, rows=(1, 4), device="cpu", other_layout=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--kquant-summary"]:  # a results file's k-quant goal table, no GPU needed
        if len(argv) != 2:
            print("usage: python -m benchmarks.bench_kernels --kquant-summary RESULTS.json")
            return 2
        try:
            data = json.loads(open(argv[1]).read())
        except (OSError, ValueError) as e:
            print(f"cannot read {argv[1]}: {e}")
            return 2
        recs = data.get("records") or data.get("kernels", {}).get("bench_kernels", [])
        if not kquant_summary(recs):
            print(f"{argv[1]}: no k-quant records next to Q4_1 ones")
            return 2
        print_kquant_summary(recs)
        return 0
    seen: list[dict] = []

    def with_summary(section):  # annotate every record so far, print the k-quant summary
        def run(copy_bw_gbps: float) -> list[dict]:
            records = section(copy_bw_gbps)
            seen.extend(records)
            annotate_vs_q4_1(seen)  # in place: a later section's rows next to earlier Q4_1's
            print_kquant_summary(seen)
            return records

        run.__name__ = section.__name__
        return run

    return run_kernel_bench(
        "bench_kernels",
        __doc__,
        full=[
            bench_gemv_smollm2,
            bench_gemv_llama3_8b,
            with_summary(bench_gemv_kquant),
            with_summary(bench_gemv_kquant_layouts),
        ],
        quick=[with_summary(bench_gemv_quick)],
        cpu=[with_summary(cpu_smoke)],
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
