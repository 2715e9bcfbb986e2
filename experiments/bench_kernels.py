"""GPU kernel benchmarks: quantized GEMV, plus the sections of experiments/bench_attention.py.

    python -m experiments.bench_kernels            # full run, ~3 minutes on one GPU
    python -m experiments.bench_kernels --quick    # a few shapes; on CPU a tiny interpreter smoke
    python -m experiments.bench_kernels --out DIR  # results directory (default benchmarks/results;
                                                   # --quick saves only when --out is given)

First measures device-to-device copy bandwidth (bytes read + written by a torch copy), then
runs every section: a function f(copy_bw_gbps) -> list of records
{kernel, shape, ms, gbps, fraction_of_copy_bandwidth, baseline, baseline_ms}. Times are
medians of triton.testing.do_bench. GB/s counts the bytes that must move: packed weights +
scales (+ mins) + activations + outputs.

GEMV sections: SmolLM2-135M and Llama-3-8B projection shapes at M in {1, 2, 4, 8, 16}, bf16
activations, formats q4_1 / int4 (group 128) / q8_0 (LM heads: q8_0 for SmolLM2). The
baseline is torch's own quantized kernel where one exists (int4: torch._weight_int4pack_mm;
q8_0: torch._weight_int8pack_mm, per-channel int8), else F.linear on the dequantized bf16
weight; every GEMV record also carries that dense time as dense_bf16_ms.

Results go to <out>/<date>-<gpu>.json as {gpu, date, commit, copy_bandwidth_gbps, records};
an existing file is loaded and these keys updated (other benchmarks add their own keys),
then written atomically. A Markdown table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.bench_common import record, time_ms

if not torch.cuda.is_available():  # the CPU smoke run needs the interpreter before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.kernels.quant import QuantizedWeight  # noqa: E402
from specdec.kernels.quant_gemv import quant_linear  # noqa: E402
from specdec.kernels.utils import cdiv  # noqa: E402

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8, 16)
FORMATS = ("q4_1", "int4-g128", "q8_0")


@dataclass(frozen=True)
class GemvCase:
    model: str
    layer: str
    n: int  # out_features
    k: int  # in_features
    formats: tuple[str, ...] = FORMATS


SMOLLM2_135M = [
    GemvCase("smollm2-135m", "q_proj/o_proj", 576, 576),
    GemvCase("smollm2-135m", "k_proj/v_proj", 192, 576),
    GemvCase("smollm2-135m", "gate/up_proj", 1536, 576),
    GemvCase("smollm2-135m", "down_proj", 576, 1536),
    GemvCase("smollm2-135m", "lm_head", 49152, 576, ("q8_0",)),
]
LLAMA3_8B = [
    GemvCase("llama3-8b", "q_proj/o_proj", 4096, 4096),
    GemvCase("llama3-8b", "gate/up_proj", 14336, 4096),
    GemvCase("llama3-8b", "down_proj", 4096, 14336),
    GemvCase("llama3-8b", "lm_head", 128256, 4096),
]


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def random_weight(fmt: str, n: int, k: int, device: torch.device) -> QuantizedWeight:
    """Random codes and scales in the QuantizedWeight layout (timing only)."""
    bits, group, has_mins, name = {
        "q8_0": (8, 32, False, "q8_0"),
        "q4_0": (4, 32, False, "q4_0"),
        "q4_1": (4, 32, True, "q4_1"),
        "int4-g128": (4, 128, True, "int4"),
        "int8": (8, k, False, "int8"),
    }[fmt]
    k_pad = cdiv(k, group) * group
    if bits == 8:
        q = torch.randint(-127, 128, (n, k_pad), dtype=torch.int8, device=device)
    else:
        q = torch.randint(0, 256, (n, k_pad // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k_pad // group, device=device) * 0.01 + 1e-3).half()
    mins = -8 * scales if has_mins else None
    return QuantizedWeight(name, bits, group, (n, k), q, scales, mins)


def torch_quant_baseline(fmt: str, w: QuantizedWeight, x: torch.Tensor):
    """(name, fn(x)) of torch's own quantized matmul for this format, or None where it cannot
    run. Its weights are random in torch's packing: only the time is used."""
    n, k = w.shape
    try:
        if fmt == "int4-g128":
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
) -> list[dict]:
    device = torch.device(device)
    dt = torch.bfloat16
    records = []
    for case in cases:
        n, k = case.n, case.k
        dense_ms = {}
        for fmt in case.formats:
            w = random_weight(fmt, n, k, device)
            w_dense = w.dequantize(dt)  # [N, K]
            quant = torch_quant_baseline(fmt, w, torch.randn(1, k, device=device, dtype=dt))
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=dt)
                y = quant_linear(x, w, backend="triton")
                ref = F.linear(x, w_dense).float()
                err = (y.float() - ref).abs().max().item()
                if not err <= 2e-2 * ref.abs().max().item():
                    log.warning("%s %s M=%d differs from dense by %.3g", fmt, case.layer, m, err)
                ms = time_ms(lambda x=x, w=w: quant_linear(x, w, backend="triton"))
                if m not in dense_ms:
                    dense_ms[m] = time_ms(lambda x=x, w=w_dense: F.linear(x, w))
                baseline, baseline_ms = "F.linear bf16 (dequantized)", dense_ms[m]
                if quant is not None:
                    baseline, baseline_ms = quant[0], time_ms(lambda x=x, fn=quant[1]: fn(x))
                nbytes = w.nbytes() + (m * k + m * n) * x.element_size()
                shape = f"{case.model} {case.layer} M={m} N={n} K={k} bf16"
                rec = record(
                    f"quant_linear[{fmt}]", shape, ms, nbytes, copy_bw_gbps, baseline, baseline_ms
                )
                rec["dense_bf16_ms"] = dense_ms[m]
                records.append(rec)
                log.info("%s %s: %.4f ms (%s %.4f ms)", fmt, shape, ms, baseline, baseline_ms)
    return records


def bench_gemv_smollm2(copy_bw_gbps: float) -> list[dict]:
    return bench_gemv(copy_bw_gbps, SMOLLM2_135M)


def bench_gemv_llama3_8b(copy_bw_gbps: float) -> list[dict]:
    return bench_gemv(copy_bw_gbps, LLAMA3_8B)


def bench_gemv_quick(copy_bw_gbps: float) -> list[dict]:
    cases = [SMOLLM2_135M[2], LLAMA3_8B[0], LLAMA3_8B[1]]
    return bench_gemv(copy_bw_gbps, cases, rows=(1, 4, 16))


SECTIONS: list[Callable[[float], list[dict]]] = [bench_gemv_smollm2, bench_gemv_llama3_8b]


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def write_results(path: Path, update: dict) -> dict:
    """Load `path` if it exists, update its keys, write it back atomically."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(update)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return data


def markdown_table(records: list[dict]) -> str:
    lines = [
        "| kernel | shape | ms | GB/s | % copy BW | baseline | baseline ms | speedup |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in records:
        base_ms = r.get("baseline_ms")
        base = f"{base_ms:.4f} | {base_ms / r['ms']:.2f}x" if base_ms else "- | -"
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
            f"{100 * r['fraction_of_copy_bandwidth']:.0f}% | {r.get('baseline') or '-'} | {base} |"
        )
    return "\n".join(lines)


def attention_sections() -> list[Callable[[float], list[dict]]]:
    try:
        from experiments.bench_attention import SECTIONS as sections
    except ImportError as e:
        print(f"attention benchmark section missing (experiments.bench_attention: {e})")
        return []
    return list(sections)


def cpu_smoke(copy_bw_gbps: float) -> list[dict]:
    """Tiny shapes through Triton's interpreter: checks the plumbing, not performance."""
    cases = [GemvCase("tiny", "proj", 64, 256), GemvCase("tiny", "odd", 37, 96, ("q8_0",))]
    return bench_gemv(copy_bw_gbps, cases, rows=(1, 4), device="cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes (CPU: tiny smoke)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if torch.cuda.is_available():
        device = torch.device("cuda")
        if args.quick:
            print("--quick: a few GEMV shapes, no attention sections, results saved only to --out")
            sections = [bench_gemv_quick]
            out_dir = args.out
        else:
            sections = SECTIONS + attention_sections()
            out_dir = args.out or REPO / "benchmarks" / "results"
    elif args.quick:
        # the kernels run in Triton's interpreter; results are written only where --out says
        device = torch.device("cpu")
        sections = [cpu_smoke]
        out_dir = args.out
        print("no CUDA device: CPU smoke run in Triton's interpreter (timings are meaningless)")
    else:
        print("bench_kernels needs a CUDA GPU; use --quick for a CPU smoke run")
        return 0

    copy_bw = copy_bandwidth_gbps(device, (1 << 30) if device.type == "cuda" else (32 << 20))
    print(f"copy bandwidth: {copy_bw:.0f} GB/s (read + write)")
    records = []
    for section in sections:
        log.info("section %s", getattr(section, "__name__", section))
        records += section(copy_bw)
    print(markdown_table(records))

    if out_dir is not None:
        date = datetime.date.today().isoformat()
        path = Path(out_dir) / f"{date}-{slug(gpu_name())}.json"
        update = {
            "gpu": gpu_name(),
            "date": date,
            "commit": git_commit(),
            "copy_bandwidth_gbps": copy_bw,
            "records": records,
        }
        write_results(path, update)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
