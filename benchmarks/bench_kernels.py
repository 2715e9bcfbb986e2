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
over Q4_1's on the same shape and M (ms_per_weight_byte_vs_q4_1; the goal is <= 1.2). The attention and
rejection-sampling kernels have their own benchmarks (bench_attention, bench_rejection).
"""

from __future__ import annotations

import logging
import os
import sys
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
from specdec.kernels.kquant_gemv import empty_kquant_weight  # noqa: E402
from specdec.kernels.quant import KQUANT_BLOCKS, QuantizedWeight  # noqa: E402
from specdec.kernels.quant_gemv import quant_linear  # noqa: E402
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
) -> list[dict]:
    device = torch.device(device)
    dt = torch.bfloat16
    records = []
    for case in cases:
        n, k = case.n, case.k
        dense_ms = {}
        q4_1_ms_per_byte = {}
        for fmt in case.formats:
            if fmt in KQUANT_BLOCKS and k % KQUANT_BLOCKS[fmt][1]:
                continue  # the super-blocks do not tile K (GGUF files fall back to q5_0 / q8_0)
            w = make_weight(fmt, n, k, device)
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
                rec = kernel_record(
                    f"quant_linear[{fmt}]", shape, ms, nbytes, copy_bw_gbps, baseline, baseline_ms
                )
                rec["dense_bf16_ms"] = dense_ms[m]
                # the kernel without the eager launch path (CUDA only)
                add_graph_time(
                    rec, lambda x=x, w=w: quant_linear(x, w, backend="triton"), nbytes, device
                )
                if fmt == "q4_1":
                    q4_1_ms_per_byte[m] = ms / w.nbytes()
                elif m in q4_1_ms_per_byte:  # the k-quant goal: <= 1.2
                    rec["ms_per_weight_byte_vs_q4_1"] = ms / w.nbytes() / q4_1_ms_per_byte[m]
                records.append(rec)
                log.info("%s %s: %.4f ms (%s %.4f ms)", fmt, shape, ms, baseline, baseline_ms)
    return records


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


def bench_gemv_quick(copy_bw_gbps: float) -> list[dict]:
    cases = [SMOLLM2[2], LLAMA3_8B[0], LLAMA3_8B[2]]
    return bench_gemv(copy_bw_gbps, cases + kquant_cases(cases[1:]), rows=(1, 4, 16))


def cpu_smoke(copy_bw_gbps: float) -> list[dict]:
    """Tiny shapes through Triton's interpreter: checks the plumbing, not performance."""
    cases = [
        GemvCase("tiny", "proj", 64, 256),
        GemvCase("tiny", "odd", 37, 96, ("q8_0",)),
        GemvCase("tiny", "kquant", 48, 256, ("q4_1", "q4_k", "q5_0")),
    ]
    return bench_gemv(copy_bw_gbps, cases, rows=(1, 4), device="cpu")


def main(argv: list[str] | None = None) -> int:
    return run_kernel_bench(
        "bench_kernels",
        __doc__,
        full=[bench_gemv_smollm2, bench_gemv_llama3_8b, bench_gemv_kquant],
        quick=[bench_gemv_quick],
        cpu=[cpu_smoke],
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main())
