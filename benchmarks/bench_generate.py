"""Plain greedy decoding: specdec vs HF transformers, same weights, same dtype, one process.

    python -m benchmarks.bench_generate [--model smollm2-135m] [--dtypes bfloat16 float32]
                                        [--modes float32:ort ...] [--new-tokens 64]
                                        [--repeats 5] [--device cpu]

Both load the same GGUF (HF dequantizes it; specdec's torch backend runs a dequantized
copy on CPU, the quantized GEMV kernels on CUDA). Each repeat generates exactly
--new-tokens tokens greedily (EOS ignored) after a short prompt; tokens/s counts prefill +
decode wall time. All systems are loaded first and timed round-robin, one generation each
per round (--repeats rounds), so that a noisy machine's slow minutes hit every system alike.
Prints median tok/s, and the medians of the per-round ratios: specdec/HF in the same dtype
and specdec/HF bfloat16 (the CPU issue's baseline); --out DIR writes the rows as
DIR/bench_generate.json + .csv (benchmarks.harness.save_results). A row is a dtype, or
dtype:cpu_linear mode (`--modes`, e.g. float32:ort; `specdec.models.cpu_linear`); the
default adds float32:ort when onnxruntime is installed. A mode ending in `+compile` (e.g.
bfloat16:native+compile, float32:dense+compile) runs the decode step compiled
(`specdec.models.cpu_compile`); its compilation happens in the warm-up, before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import environment, markdown_table, save_results, sync
from benchmarks.models import hf_generate_s, hf_gguf_model
from specdec.cli import user_errors
from specdec.errors import SpecDecError

PROMPT = "The history of the printing press begins in"
COLUMNS = [
    ("dtype", "dtype", ""),
    ("specdec_tok_s", "specdec tok/s", ".1f"),
    ("hf_tok_s", "HF transformers tok/s", ".1f"),
    ("ratio", "ratio", ".2f"),
    ("vs_hf_bf16", "vs HF bf16", ".2f"),
    ("same_tokens", "identical tokens", ""),
]


def load_specdec(path: Path, dtype: str, device: str, mode: str | None, n_warm: int = 8):
    """-> a `run(n_new) -> (seconds, tokens)` for specdec's plain greedy decoding, warm."""
    from specdec.decode.generation import generate
    from specdec.models.load import load_model

    mode, plus, extra = (mode or "").partition("+")
    if plus and extra != "compile":
        raise SpecDecError(f"mode suffix +{extra}: the only one is +compile")
    model, tok = load_model(
        str(path),
        dtype=dtype,
        device=device,
        cpu_linear=mode or None,
        cpu_compile="on" if plus else None,
    )
    ids = tok.encode(PROMPT)

    def run(n_new: int) -> tuple[float, list[int]]:
        sync(device)
        t = time.perf_counter()
        res = generate(model, [ids], n_new)
        sync(device)
        return time.perf_counter() - t, res.tokens[0]

    # warm-up; compiled steps compile here, for the cache size the timed runs use
    run(n_warm)
    return run, ids


def load_hf(path: Path, dtype: str, device: str, ids: list[int]):
    """-> a `run(n_new) -> (seconds, tokens)` for HF transformers' greedy generate, warm."""
    model = hf_gguf_model(path, dtype, device)
    x = torch.tensor([ids], device=device)
    hf_generate_s(model, x, 8)  # warm-up
    return lambda n_new: hf_generate_s(model, x, n_new)


def interleaved(systems: dict, n_new: int, repeats: int) -> dict:
    """Time every system once per round, round after round, so that a slow minute of a noisy
    machine hits all of them: {name: (per-round tok/s, last tokens)}."""
    out = {name: ([], None) for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            seconds, toks = run(n_new)
            out[name][0].append(len(toks) / seconds)
            out[name] = (out[name][0], toks)
    return out


@user_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--modes", nargs="*", default=None, help="extra dtype:cpu_linear rows")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    args = ap.parse_args(argv)
    from specdec.models.registry import resolve_model_path

    path = resolve_model_path(args.model)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if path.suffix != ".gguf":
        raise SpecDecError("bench_generate compares against HF's GGUF loader: give a .gguf model")
    from specdec.models.cpu_linear import cpu_features

    modes = args.modes
    if modes is None:
        modes = ["float32:ort"] if cpu_features()["onnxruntime"] and args.device == "cpu" else []
    entries = [(dt, None) for dt in args.dtypes] + [tuple(m.split(":", 1)) for m in modes]
    systems, ids = {}, None
    for dt, mode in entries:
        n_warm = args.new_tokens if mode and mode.endswith("+compile") else 8
        systems[("specdec", dt, mode)], ids = load_specdec(path, dt, args.device, mode, n_warm)
    for dt in dict.fromkeys(dt for dt, _ in entries):
        systems[("hf", dt, None)] = load_hf(path, dt, args.device, ids)
    runs = interleaved(systems, args.new_tokens, args.repeats)
    med = lambda xs: statistics.median(xs)
    rows = []
    for dt, mode in entries:
        ours, our_toks = runs[("specdec", dt, mode)]
        hf, hf_toks = runs[("hf", dt, None)]
        same = sum(a == b for a, b in zip(our_toks, hf_toks))
        row = {
            "dtype": dt if mode is None else f"{dt} ({mode})",
            "specdec_tok_s": med(ours),
            "hf_tok_s": med(hf),
            # the median of the rounds' ratios: each round's runs share the machine's state
            "ratio": med([a / b for a, b in zip(ours, hf)]),
            "same_tokens": f"{same}/{len(hf_toks)}",
            "rounds_tok_s": [round(r, 2) for r in ours],
        }
        if ("hf", "bfloat16", None) in runs:
            bf = runs[("hf", "bfloat16", None)][0]
            row["vs_hf_bf16"] = med([a / b for a, b in zip(ours, bf)])
        rows.append(row)
    env = environment(args.device)
    print(
        f"\nplain greedy decode, {args.model}, {args.new_tokens} new tokens, "
        f"median of {args.repeats} interleaved rounds, {env['device']}, torch {env['torch']}, "
        f"{env['torch_threads']} threads"
    )
    print(markdown_table(rows, COLUMNS))
    if args.out is not None:
        print(f"wrote {save_results('bench_generate', rows, out=args.out, env=env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
