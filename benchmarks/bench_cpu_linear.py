"""CPU linear backends side by side on a model's real weights (SmolLM2-135M by default).

    python -m benchmarks.bench_cpu_linear [--model smollm2-135m] [--threads 1 2]
                                          [--m 1 2 5 9 17] [--rounds 5]
                                          [--shapes qkv o gate_up down lm_head] [--quick]

`--model qwen2.5-coder-0.5b` times Qwen2.5-Coder's Q5_0 / Q6_K / Q4_K / Q8_0 tensors (and its
mixed-format q/k/v fusions) the same way: ort runs them from their codes; int4pack / int8pack
run a requantization of them (their speed, not the file's numbers); dense runs them
dequantized.

For every weight shape of the model (fused qkv 960x576, o 576x576, fused gate-up 3072x576,
down 576x1536, LM head 49152x576), every backend of `specdec.models.cpu_linear`, M rows in
{1, 2, 5, 9, 17} and 1 / 2 threads it times one pass over a pool of distinct weights (the
30 layers' own weights, cloned until the pool holds >= 96 MB in each backend's format, so the
weights stream from DRAM like in a real forward instead of sitting in the 32 MB L3). Rounds
interleave the backends, so ratios come from the same machine state. Prints ms per weight,
GB/s of weight bytes and the ratio to M=1 of the same backend, then the error of each
format -> backend mapping against fp32 math on the same dequantized weights. The rows
"int4pack bf16, one call" / "int8pack bf16, one call" time torch's kernel called once per M
rows, without the row chunks that balance the threads (`packed_row_chunks` in
specdec.models.cpu_linear): the side-by-side check of that choice.
Writes benchmarks/results/cpu_linear.json + .csv.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.harness import environment, markdown_table, save_results, time_ms
from specdec.cli import user_errors
from specdec.kernels.quant import QuantizedWeight, pack_int4, quantize_int4, quantize_int8
from specdec.models.cpu_linear import INT4PACK_FORMATS, CpuLinear, cpu_features, dense_choice
from specdec.models.load import load_weights
from specdec.models.ort_linear import ort_unsupported

POOL_BYTES = 96 << 20

# (name, backend, activation dtype)
BACKENDS = [
    ("mkl fp32", "mkl", torch.float32),
    ("onednn fp32", "onednn", torch.float32),
    ("mkl bf16", "mkl", torch.bfloat16),
    ("onednn bf16", "onednn", torch.bfloat16),  # only where oneDNN has bf16 (dense policy)
    ("int8pack fp32", "int8pack", torch.float32),
    ("int8pack bf16", "int8pack", torch.bfloat16),
    ("int4pack fp32", "int4pack", torch.float32),
    ("int4pack bf16", "int4pack", torch.bfloat16),
    # torch's kernel in one call per M rows, without specdec's thread-balancing row chunks
    ("int8pack bf16, one call", "int8pack", torch.bfloat16),
    ("int4pack bf16, one call", "int4pack", torch.bfloat16),
    ("ort fp32 (int8 act)", "ort", torch.float32),  # only when onnxruntime is installed
]


def quantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """GGUF Q8_0 from a dense [N, K] weight: per 32 weights d = max|w| / 127, q = round(w/d)."""
    n, k = w.shape
    b = w.float().view(n, k // 32, 32)
    d = (b.abs().amax(dim=2) / 127.0).clamp_min(1e-12).half()
    q = torch.round(b / d.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight("q8_0", 8, 32, (n, k), q, d)


def quantize_q4_0(w: torch.Tensor) -> QuantizedWeight:
    """GGUF Q4_0 from a dense [N, K] weight: per 32 weights d = max|w| / 7, q = round(w/d) + 8."""
    n, k = w.shape
    b = w.float().view(n, k // 32, 32)
    d = (b.abs().amax(dim=2) / 7.0).clamp_min(1e-12).half()
    q = (torch.round(b / d.float()[..., None]) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight("q4_0", 4, 32, (n, k), pack_int4(q, 32), d)


def model_weights(name: str = "smollm2-135m") -> tuple[dict[str, list], dict[str, int]]:
    """({shape: the model's quantized weights of that shape}, {shape: calls per forward}).
    A fused weight whose parts have different formats (Qwen2.5-Coder's Q5_0 q/k with a Q8_0
    v) is its list of parts: only ort runs it from the codes; the other backends get its
    dequantization (dense) or its requantization (int4pack / int8pack)."""
    model, _, _ = load_weights(name)
    out = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for blk in model.layers:
        for shape, lin in (
            ("qkv", blk.attn.wqkv),
            ("o", blk.attn.wo),
            ("gate_up", blk.ffn.w_gate_up),
            ("down", blk.ffn.w_down),
        ):
            out[shape].append(lin.qweight if lin.qweight is not None else lin.parts)
    out["lm_head"] = [model.lm_head.qweight]
    counts = {shape: len(ws) for shape, ws in out.items()}
    return out, counts


def _fmt(w) -> str:
    return "/".join(p.fmt for p in w) if isinstance(w, list) else w.fmt


def _dequantize(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(w, list):
        return torch.cat([p.dequantize(dtype) for p in w])
    return w.dequantize(dtype)


class OneCall:
    """A packed CpuLinear called as torch's kernel in one call, whatever M: the reference
    for `packed_row_chunks`, which splits M rows so both threads get the same work."""

    def __init__(self, lin: CpuLinear):
        self.lin, self.out_features = lin, lin.out_features

    def nbytes(self) -> int:
        return self.lin.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.lin
        if lin.backend == "int4pack":
            x = torch.nn.functional.pad(x, (0, lin.k_pad)) if lin.k_pad else x
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.w, lin.group, lin.sz)
        return torch.ops.aten._weight_int8pack_mm(x, lin.w, lin.s)


def build_pool(
    weights: list[QuantizedWeight], backend: str, dtype: torch.dtype, one_call: bool = False
) -> list:
    """CpuLinear objects over the model's weights, rebuilt (fresh memory) until the pool holds
    >= POOL_BYTES (`one_call`: wrapped in `OneCall`)."""
    srcs = []
    for w in weights:
        if backend == "int4pack" and (isinstance(w, list) or w.fmt not in INT4PACK_FORMATS):
            w = quantize_int4(_dequantize(w), 32)
        if backend == "int8pack" and (isinstance(w, list) or w.bits != 8):
            w = quantize_q8_0(_dequantize(w))
        srcs.append(w)
    pool: list[CpuLinear] = []
    while not pool or len(pool) * pool[0].nbytes() < POOL_BYTES:
        for w in srcs:
            dense = _dequantize(w, dtype) if backend in ("mkl", "onednn") else None
            q = None if dense is not None and isinstance(w, list) else w
            lin = CpuLinear(backend, dense=dense, qweight=q, bias=None, dtype=dtype)
            pool.append(OneCall(lin) if one_call else lin)
    return pool


def mapping_errors(weights: dict[str, list[QuantizedWeight]]) -> list[dict]:
    """Per source format: max |y - y_ref| / max |y_ref| of each packed backend vs fp32 math on
    the same dequantized weight (gate_up of layer 0 and the LM head), M = 5."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in ("gate_up", "lm_head"):
        w0 = next((w for w in weights[shape] if not isinstance(w, list)), None)
        if w0 is None:
            continue
        dense = w0.dequantize()
        x = torch.randn(5, dense.shape[1], generator=g)
        srcs = {} if w0.fmt in ("q4_1", "q8_0") else {f"{w0.fmt} (the file's)": w0}
        srcs |= {
            "q4_1": w0 if w0.fmt == "q4_1" else quantize_int4(dense, 32),
            "q4_0": quantize_q4_0(dense),
            "int4 (g64)": quantize_int4(dense, 64),
            "q8_0": w0 if w0.fmt == "q8_0" else quantize_q8_0(dense),
            "int8 (per channel)": quantize_int8(dense),
        }
        for fmt, q in srcs.items():
            ref = x.double() @ q.dequantize().double().T
            if ort_unsupported(q, torch.float32) is None:
                y = CpuLinear("ort", dense=None, qweight=q, bias=None, dtype=torch.float32)(x)
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                rows.append({"shape": shape, "format": fmt, "backend": "ort fp32", "rel_err": err})
            backend = "int4pack" if q.fmt in INT4PACK_FORMATS else "int8pack"
            for dt in (torch.float32, torch.bfloat16):
                lin = CpuLinear(backend, dense=None, qweight=q, bias=None, dtype=dt)
                y = lin(x.to(dt)).double()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                rows.append(
                    {
                        "shape": shape,
                        "format": fmt,
                        "backend": f"{backend} {str(dt)[6:]}",
                        "rel_err": err,
                    }
                )
            yb = (x.bfloat16() @ q.dequantize(torch.bfloat16).T).double()
            rows.append(
                {
                    "shape": shape,
                    "format": fmt,
                    "backend": "mkl bf16 (dequantized)",
                    "rel_err": ((yb - ref).abs().max() / ref.abs().max()).item(),
                }
            )
    return rows


@user_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a registered GGUF model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    ap.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    ap.add_argument("--backends", nargs="+", default=[b[0] for b in BACKENDS])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="gate_up and lm_head, M 1 5 9, 3 rounds")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.m, args.rounds = ["gate_up", "lm_head"], [1, 5, 9], 3
    feats = cpu_features()
    print(f"CPU features: {feats}")
    backends = [b for b in BACKENDS if b[0] in args.backends]
    if dense_choice(torch.bfloat16).backend != "onednn" and "onednn bf16" in args.backends:
        print(f"onednn bf16: skipped ({dense_choice(torch.bfloat16).reason})")
        backends = [b for b in backends if b[0] != "onednn bf16"]
    if not feats["onnxruntime"] and any(be == "ort" for _, be, _ in backends):
        print("ort: onnxruntime not installed (pip install 'specdec[cpu-ort]'): skipped")
        backends = [b for b in backends if b[1] != "ort"]
    torch.set_grad_enabled(False)
    weights, counts = model_weights(args.model)
    records = []
    for shape in args.shapes:
        pools = {
            name: build_pool(weights[shape], be, dt, one_call=name.endswith("one call"))
            for name, be, dt in backends
        }
        w0 = weights[shape][0]
        K = (w0[0] if isinstance(w0, list) else w0).in_features
        for threads in args.threads:
            torch.set_num_threads(threads)  # ort: each weight builds its session for this
            # thread count on first use, inside the untimed warm-up round
            for M in args.m:
                xs = {dt: torch.randn(M, K).to(dt) for dt in (torch.float32, torch.bfloat16)}
                runs: dict[str, list[float]] = {name: [] for name, _, _ in backends}
                for _ in range(args.rounds + 1):  # first round: warm-up
                    for name, _, dt in backends:
                        pool, x = pools[name], xs[dt]
                        runs[name].append(
                            time_ms(lambda p=pool, x=x: [lin(x) for lin in p], warmup=0, repeats=1)
                            / len(pool)
                        )
                for name, _, _ in backends:
                    ms = statistics.median(runs[name][1:])
                    nbytes = pools[name][0].nbytes()
                    records.append(
                        {
                            "shape": shape,
                            "N": pools[name][0].out_features,
                            "K": K,
                            "backend": name,
                            "formats": ", ".join(sorted({_fmt(w) for w in weights[shape]})),
                            "threads": threads,
                            "M": M,
                            "ms": ms,
                            "GB_s": nbytes / ms / 1e6,
                            "weight_MB": nbytes / 1e6,
                        }
                    )
        del pools
    for r in records:
        base = next(
            q
            for q in records
            if (q["shape"], q["backend"], q["threads"], q["M"])
            == (r["shape"], r["backend"], r["threads"], min(args.m))
        )
        r["vs_M1"] = r["ms"] / base["ms"]
    print(
        markdown_table(
            records,
            [
                ("shape", "shape", ""),
                ("backend", "backend", ""),
                ("formats", "file formats", ""),
                ("threads", "thr", ""),
                ("M", "M", ""),
                ("ms", "ms", ".3f"),
                ("GB_s", "GB/s", ".1f"),
                ("vs_M1", "vs M=1", ".2f"),
                ("weight_MB", "MB", ".2f"),
            ],
        )
    )
    # per (backend, threads, M): one forward's worth of linears (every layer + LM head)
    summary = []
    if set(counts) <= set(args.shapes):
        for name, _, _ in backends:
            for threads in args.threads:
                for M in args.m:
                    ms = sum(
                        counts[r["shape"]] * r["ms"]
                        for r in records
                        if (r["backend"], r["threads"], r["M"]) == (name, threads, M)
                    )
                    summary.append({"backend": name, "threads": threads, "M": M, "step_ms": ms})
        for s in summary:
            s1 = next(
                q
                for q in summary
                if (q["backend"], q["threads"], q["M"]) == (s["backend"], s["threads"], min(args.m))
            )
            s["vs_M1"] = s["step_ms"] / s1["step_ms"]
        n = counts["qkv"]
        print(f"\nall linears of one forward ({n} x qkv/o/gate_up/down + LM head):")
        print(
            markdown_table(
                summary,
                [
                    ("backend", "backend", ""),
                    ("threads", "thr", ""),
                    ("M", "M", ""),
                    ("step_ms", "ms", ".2f"),
                    ("vs_M1", "vs M=1", ".2f"),
                ],
            )
        )
    errs = mapping_errors(weights)
    print("\nmapping error vs fp32 math on the same dequantized weight (max abs / max |y|, M=5):")
    print(
        markdown_table(
            errs,
            [
                ("shape", "shape", ""),
                ("format", "format", ""),
                ("backend", "backend", ""),
                ("rel_err", "rel err", ".2e"),
            ],
        )
    )
    path = save_results(
        "cpu_linear",
        records
        + [dict(kind="step", **s) for s in summary]
        + [dict(kind="mapping_error", **e) for e in errs],
        out=args.out,
        env=environment("cpu", cpu_features=feats),
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
