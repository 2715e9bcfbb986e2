"""torch.compile / inductor (freezing + its CPP GEMM template) against the eager CPU backend.

    python -m benchmarks.bench_cpu_compile [--part linear forward] [--threads 2] [--m 1 5 9]
                                           [--t 1 5 9] [--rounds 15] [--context 64]

The CPU issue names inductor's public path (torch.compile with `freezing` and max-autotune's
CPP GEMM template, which prepacks each frozen weight into its own blocked layout and runs
generated micro-kernels) as a candidate CPU linear backend. This benchmark measures it on
SmolLM2-135M's real weights, in one process, against what `cpu_linear=dense` runs today:

    linear   a pool of the 30 layers' fused gate-up weights (3072 x 576 fp32, 212 MB, so they
             stream from DRAM): oneDNN prepacked (`CpuLinear("onednn")`) vs one compiled
             module holding the 30 frozen linears, per M; ms per pass, GB/s of weight bytes,
             compile seconds, max |error| against float64
    forward  the whole target forward of T tokens after a `--context`-token prefill: eager
             fp32 dense (the default) vs `torch.compile` of the graph-safe `static=True`
             forward (the cache sized to context + max T, so the static attention spans the
             same keys), one compiled graph per T; ms, ratio to T=1, compile seconds, max
             |logit difference| to eager

It compiles (a C++ compiler is needed) and takes minutes: the forward part 2-2.5 minutes
of compilation per T on 2 cores. Nothing here is used by the decoding code: it is the
measurement behind the inductor note in docs/results.md, "CPU backend: measurements". Writes
benchmarks/results/cpu_compile.json + .csv.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from benchmarks.harness import environment, markdown_table, save_results, time_ms
from specdec import validation
from specdec.cli import user_errors
from specdec.errors import SpecDecError
from specdec.models.cpu_compile import compiler_missing
from specdec.models.cpu_linear import CpuLinear, cpu_features
from specdec.models.load import load_weights
from specdec.models.transformer import KVCache

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "


def inductor_options() -> dict:
    """Inductor settings of the measured path: freeze weights, let max-autotune choose
    between its CPP GEMM template and aten per linear."""
    return {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
    }


def _once_ms(fn, *args) -> float:
    """Milliseconds of one call fn(*args): rounds interleave the systems call by call."""
    return time_ms(functools.partial(fn, *args), warmup=0, repeats=1)


def _all(linears, x):
    return [lin(x) for lin in linears]


class _Pool(torch.nn.Module):
    """The frozen linears of one pass: one compiled graph for all of them."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.ls = torch.nn.ModuleList()
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            self.ls.append(lin)

    def forward(self, x):
        return _all(self.ls, x)


@torch.no_grad()
def bench_linear(model, ms: list[int], rounds: int) -> list[dict]:
    ws = [blk.ffn.w_gate_up.qweight.dequantize(torch.float32) for blk in model.layers]
    nbytes = sum(w.numel() * 4 for w in ws)
    onednn = [
        CpuLinear("onednn", dense=w, qweight=None, bias=None, dtype=torch.float32) for w in ws
    ]
    pool = _Pool(ws).eval()
    out = []
    for m in ms:
        x = torch.randn(m, ws[0].shape[1])
        ref = [x.double() @ w.double().T for w in ws]
        torch._dynamo.reset()
        with torch._inductor.config.patch(inductor_options()):
            compiled = torch.compile(pool, dynamic=False)
            t0 = time.perf_counter()
            got = compiled(x)
            compile_s = time.perf_counter() - t0
        err_i = max((g.double() - r).abs().max().item() for g, r in zip(got, ref))
        err_o = max((lin(x).double() - r).abs().max().item() for lin, r in zip(onednn, ref))
        runs: dict[str, list[float]] = {"onednn": [], "inductor": []}
        for _ in range(rounds):  # interleaved: both see the same machine state
            runs["onednn"].append(_once_ms(_all, onednn, x))
            runs["inductor"].append(_once_ms(compiled, x))
        for name, err, cs in (("onednn", err_o, 0.0), ("inductor", err_i, compile_s)):
            t = statistics.median(runs[name])
            out.append(
                {
                    "part": "linear",
                    "backend": name,
                    "M": m,
                    "ms": t,
                    "gbps": nbytes / t / 1e6,
                    "compile_s": cs,
                    "max_err": err,
                }
            )
    return out


@torch.no_grad()
def bench_forward(eager, tok, ts: list[int], rounds: int, context: int) -> list[dict]:
    """eager: the loaded model (set up here as the dense default); a second copy is loaded
    for inductor."""
    eager.setup(torch.float32, "cpu", "torch", cpu_linear="dense")
    eager.eval()
    # inductor must see plain aten linears on constant weights to freeze and prepack them
    plain, _, _ = load_weights("smollm2-135m")
    plain.setup(torch.float32, "cpu", "torch", cpu_linear="mkl")
    plain.eval()
    ids = (tok.encode(PROMPT) * 16)[:context]
    max_len = context + max(ts)
    c_eager = KVCache.for_model(eager, 1, max_len)
    c_comp = KVCache.for_model(plain, 1, max_len)
    zero = torch.zeros(1, dtype=torch.long)
    eager(torch.tensor([ids]), c_eager, zero)
    plain(torch.tensor([ids]), c_comp, zero)
    start = torch.tensor([context])

    def step(tokens, start_pos):
        return plain(tokens, c_comp, start_pos, static=True)

    compiled, compile_s, diff = {}, {}, {}
    for t in ts:
        toks = torch.tensor([ids[:t]])
        torch._dynamo.reset()
        with torch._inductor.config.patch(inductor_options()):
            fn = torch.compile(step, dynamic=False)
            t0 = time.perf_counter()
            got = fn(toks, start)
            compile_s[t] = time.perf_counter() - t0
        diff[t] = (got - eager(toks, c_eager, start)).abs().max().item()
        compiled[t] = fn
    runs = {(s, t): [] for s in ("eager", "compiled") for t in ts}
    for _ in range(rounds):
        for t in ts:
            toks = torch.tensor([ids[:t]])
            runs[("eager", t)].append(_once_ms(eager, toks, c_eager, start))
            runs[("compiled", t)].append(_once_ms(compiled[t], toks, start))
    out = []
    for s in ("eager", "compiled"):
        t1 = statistics.median(runs[(s, min(ts))])
        for t in ts:
            ms = statistics.median(runs[(s, t)])
            out.append(
                {
                    "part": "forward",
                    "system": "eager fp32 dense (onednn)" if s == "eager" else "torch.compile",
                    "T": t,
                    "ms": ms,
                    "vs_T1": ms / t1,
                    "compile_s": compile_s[t] if s == "compiled" else 0.0,
                    "max_logit_diff": diff[t] if s == "compiled" else 0.0,
                }
            )
    return out


@user_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--part", nargs="+", default=["linear", "forward"], choices=["linear", "forward"]
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--t", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("m", "t"):
        for v in getattr(args, name):
            validation.integer(v, f"--{name}", minimum=1)
    for name in ("threads", "rounds", "context"):
        validation.integer(getattr(args, name), f"--{name}", minimum=1)
    why = compiler_missing()
    if why:
        raise SpecDecError(why)
    torch.set_num_threads(args.threads)
    model, tok, _ = load_weights("smollm2-135m")
    records = []
    if "linear" in args.part:
        recs = bench_linear(model, args.m, args.rounds)
        records += recs
        print(f"\n30 gate-up linears (3072 x 576 fp32, 212 MB), {args.threads} threads:")
        print(
            markdown_table(
                recs,
                [
                    ("backend", "backend", ""),
                    ("M", "M", ""),
                    ("ms", "ms", ".1f"),
                    ("gbps", "GB/s", ".1f"),
                    ("compile_s", "compile s", ".0f"),
                    ("max_err", "max err vs fp64", ".1e"),
                ],
            ),
            flush=True,
        )
    if "forward" in args.part:
        recs = bench_forward(model, tok, args.t, args.rounds, args.context)
        records += recs
        print(f"\ntarget forward of T tokens, context {args.context}, {args.threads} threads:")
        print(
            markdown_table(
                recs,
                [
                    ("system", "system", ""),
                    ("T", "T", ""),
                    ("ms", "ms", ".1f"),
                    ("vs_T1", "vs T=1", ".2f"),
                    ("compile_s", "compile s", ".0f"),
                    ("max_logit_diff", "max |logit diff| to eager", ".1e"),
                ],
            )
        )
    path = save_results(
        "cpu_compile",
        records,
        out=args.out,
        env=environment("cpu", cpu_features=cpu_features(), threads=args.threads),
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
