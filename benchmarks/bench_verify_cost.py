"""What a verification forward of T tokens costs in one-token decode steps, per mode.

    python -m benchmarks.bench_verify_cost [--models smollm2-135m qwen2.5-coder-0.5b]
        [--modes float32:mkl float32:dense bfloat16:mkl bfloat16:native] [--threads 1 2]
        [--t 1 2 3 5 9 17] [--trees 7 11] [--rounds 5] [--context 64]

For each model, mode (dtype : CPU linear mode of `specdec.models.cpu_linear`) and thread
count, in one process: prefill a `--context`-token prompt, then time the target forward of T
new tokens at that position (the cache is rolled back after each call, as a rejected draft
is), rounds interleaving the T values; prints ms and the ratio to T = 1. `--trees N`
adds token-tree verifications of N rows (row 0 the root, row i's parent (i - 1) // 2: a
binary tree, as a topk-2 tree of budget N - 1 at its widest), timed in the same rounds;
compare them with the chain of the same width (`--t N`). Then, per mode,
its numerics against the float32 MKL reference (today's path, HF parity): max |logit error|
over a prefill and the greedy agreement of a 32-token continuation on 3 prompts.
A model that is not registered in this checkout or not in the cache is skipped with a
message (nothing is downloaded). Writes benchmarks/results/verify_cost.json + .csv.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.harness import (
    cpu_mode_model,
    environment,
    markdown_table,
    parse_mode_spec,
    save_results,
    time_ms,
)
from specdec.cli import user_errors
from specdec.decode.generation import generate
from specdec.models.cpu_linear import cpu_features
from specdec.models.registry import MULTIPART_MODELS, REGISTRY, cache_dir
from specdec.models.transformer import KVCache

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Translate to French: The weather is nice today and we are going to the",
]


def available(name: str) -> str | None:
    """None when the model can be loaded without a download, else why it is skipped."""
    if name not in REGISTRY and name not in MULTIPART_MODELS:
        return f"{name}: not registered in this checkout"
    if not any((cache_dir() / name).glob("*.gguf")):
        return f"{name}: not in the cache {cache_dir() / name} (run specdec.generate once)"
    return None


def binary_tree(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tree_mask [1, n] int64: bit j of row i set when row j is i's ancestor or i
    itself, depths [1, n]) of the tree whose row i > 0 has parent (i - 1) // 2."""
    bits, depths = [], []
    for i in range(n):
        m, d, p = 1 << i, 0, i
        while p > 0:
            p = (p - 1) // 2
            m, d = m | 1 << p, d + 1
        bits.append(m)
        depths.append(d)
    return torch.tensor([bits]), torch.tensor([depths])


@torch.inference_mode()
def verify_costs(model, tok, ts, rounds, context, threads, trees=()) -> dict:
    """-> median ms per forward: {T: ms} for chains of T tokens, {"tree N": ms} for trees."""
    torch.set_num_threads(threads)
    ids = (tok.encode(" ".join(PROMPTS)) * 8)[:context]
    cache = KVCache.for_model(model, 1, context + max([*ts, *trees]) + 1)
    model(torch.tensor([ids]), cache, torch.zeros(1, dtype=torch.long))
    start = torch.tensor([context])
    calls = {t: (lambda x=torch.tensor([ids[:t]]): model(x, cache, start)) for t in ts}
    for n in trees:
        mask, depths = binary_tree(n)
        x = torch.tensor([ids[:n]])
        calls[f"tree {n}"] = lambda x=x, m=mask, d=depths: model(
            x, cache, start, positions=start[:, None] + d, tree_mask=m
        )
    runs: dict = {t: [] for t in calls}
    for r in range(rounds + 1):  # round 0: warm-up
        for t, call in calls.items():
            ms = time_ms(call, warmup=0, repeats=1)
            if r:
                runs[t].append(ms)
    return {t: statistics.median(v) for t, v in runs.items()}


@torch.inference_mode()
def numerics(model, ref_model, tok) -> dict:
    ids = [tok.encode(p) for p in PROMPTS]
    err = 0.0
    for p in ids:
        c1 = KVCache.for_model(model, 1, len(p))
        c2 = KVCache.for_model(ref_model, 1, len(p))
        z = torch.zeros(1, dtype=torch.long)
        a = model(torch.tensor([p]), c1, z)
        b = ref_model(torch.tensor([p]), c2, z)
        err = max(err, (a - b).abs().max().item())
    got = generate(model, ids, 32).tokens
    ref = generate(ref_model, ids, 32).tokens
    same = sum(x == y for g, r in zip(got, ref) for x, y in zip(g, r))
    prefix = []
    for g, r in zip(got, ref):
        n = next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(r))
        prefix.append(n)
    return {
        "max_logit_err": err,
        "greedy_agreement": same / sum(len(r) for r in ref),
        "identical_prefix": sum(prefix) / sum(len(r) for r in ref),
    }


@user_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["float32:mkl", "float32:dense", "bfloat16:mkl", "bfloat16:native", "float32:ort"],
        help="dtype:cpu_linear mode[:batch_invariant auto|on|off]",
    )
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--t", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--trees", type=int, nargs="*", default=[], help="tree verifications of N rows")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--no-numerics", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("t", "trees", "threads"):
        if any(x < 1 for x in getattr(args, name)):
            ap.error(f"--{name} values must be at least 1, got {getattr(args, name)}")
    if args.rounds < 1 or args.context < 1:
        ap.error(f"--rounds and --context must be at least 1, got {args.rounds}, {args.context}")
    for spec in args.modes:  # a malformed mode: one error line before any model loads
        parse_mode_spec(spec)
    records, numrows = [], []
    for name in args.models:
        why = available(name)
        if why:
            print(f"skipped {why}")
            continue
        ref_model = None if args.no_numerics else cpu_mode_model(name, "float32:mkl:off")[0]
        for spec in args.modes:
            dtype, mode = spec.split(":")[:2]
            if mode == "ort" and not cpu_features()["onnxruntime"]:
                print(f"skipped {spec}: onnxruntime not installed (pip install 'specdec[cpu-ort]')")
                continue
            model, tok = cpu_mode_model(name, spec)
            picked = model.cpu_linear_report()
            picked["batch invariance"] = model.batch_invariant_reason
            print(f"{name} {spec}: " + "; ".join(f"{k} -> {v}" for k, v in picked.items()))
            for th in args.threads:
                ms = verify_costs(model, tok, args.t, args.rounds, args.context, th, args.trees)
                for t in ms:
                    records.append(
                        {
                            "model": name,
                            "dtype": dtype,
                            "mode": mode,
                            "invariant": "on" if model.batch_invariant else "off",
                            "threads": th,
                            "T": t,
                            "ms": ms[t],
                            "vs_T1": ms[t] / ms[min(args.t)],
                            "tree": isinstance(t, str),
                        }
                    )
            if ref_model is not None:
                torch.set_num_threads(max(args.threads))
                numrows.append(
                    {
                        "model": name,
                        "dtype": dtype,
                        "mode": mode,
                        "invariant": "on" if model.batch_invariant else "off",
                        **numerics(model, ref_model, tok),
                    }
                )
            del model
    if records:
        rows = {}
        for r in records:
            key = (r["model"], r["dtype"], r["mode"], r["invariant"], r["threads"])
            row = rows.setdefault(
                key, dict(zip(("model", "dtype", "mode", "invariant", "threads"), key))
            )
            row[r["T"] if r["tree"] else f"T{r['T']}"] = r["vs_T1"]
            if r["T"] == min(args.t):
                row["T1_ms"] = r["ms"]
        cols = [
            ("model", "model", ""),
            ("dtype", "dtype", ""),
            ("mode", "cpu linear", ""),
            ("invariant", "batch-inv.", ""),
            ("threads", "thr", ""),
            ("T1_ms", "T=1 ms", ".1f"),
        ]
        cols += [(f"T{t}", f"T={t}", ".2f") for t in args.t if t != min(args.t)]
        cols += [(f"tree {n}", f"tree {n}", ".2f") for n in args.trees]
        print("\ntarget forward of T tokens / one decode step (T=1), same process:")
        print(markdown_table(list(rows.values()), cols))
    if numrows:
        print("\nnumerics vs the float32 MKL reference (3 prompts, 32 greedy tokens):")
        print(
            markdown_table(
                numrows,
                [
                    ("model", "model", ""),
                    ("dtype", "dtype", ""),
                    ("mode", "cpu linear", ""),
                    ("invariant", "batch-inv.", ""),
                    ("max_logit_err", "max |logit err|", ".2e"),
                    ("greedy_agreement", "greedy agreement", ".3f"),
                    ("identical_prefix", "identical prefix", ".3f"),
                ],
            )
        )
    path = save_results(
        "verify_cost",
        records + [dict(kind="numerics", **n) for n in numrows],
        out=args.out,
        env=environment("cpu", cpu_features=cpu_features()),
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
