"""Plain greedy decoding: specdec vs HF transformers, same weights, same dtype, one process.

    python -m benchmarks.bench_generate [--model smollm2-135m] [--dtypes bfloat16 float32]
                                        [--modes float32:ort ...] [--new-tokens 64]
                                        [--repeats 5] [--device cpu]

Both load the same GGUF (HF dequantizes it; specdec's torch backend runs a dequantized
copy on CPU, the quantized GEMV kernels on CUDA). Each repeat generates exactly
--new-tokens tokens greedily (EOS ignored) after a short prompt; tokens/s counts prefill +
decode wall time. Prints medians, the specdec/HF ratio in the same dtype and the ratio to
HF's bfloat16 rate (the CPU issue's baseline); --out DIR writes the rows as
DIR/bench_generate.json + .csv (benchmarks.harness.save_results). A row is a dtype, or
dtype:cpu_linear mode (`--modes`, e.g. float32:ort; `specdec.models.cpu_linear`); the
default adds float32:ort when onnxruntime is installed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import environment, markdown_table, save_results, sync
from benchmarks.models import hf_generate_s
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


def bench_specdec(
    path: Path, dtype: str, device: str, n_new: int, repeats: int, mode: str | None = None
):
    from specdec.decode.generation import generate
    from specdec.models.load import load_model

    model, tok = load_model(str(path), dtype=dtype, device=device, cpu_linear=mode)
    ids = tok.encode(PROMPT)
    generate(model, [ids], 8)  # warm-up
    rates, toks = [], None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        res = generate(model, [ids], n_new)
        sync(device)
        rates.append(len(res.tokens[0]) / (time.perf_counter() - t))
        toks = res.tokens[0]
    return statistics.median(rates), toks, ids


def bench_hf(path: Path, dtype: str, device: str, n_new: int, repeats: int, ids: list[int]):
    import transformers

    kw = {}
    if hasattr(transformers, "GgufConfig"):  # newer HF keeps GGUF blocks packed by default:
        # compare against its dense model (the usual HF baseline) on the same dequantized weights
        kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype), **kw
        )
        .to(device)
        .eval()
    )
    x = torch.tensor([ids], device=device)
    hf_generate_s(model, x, 8)  # warm-up
    runs = [hf_generate_s(model, x, n_new) for _ in range(repeats)]
    return statistics.median(n_new / seconds for seconds, _ in runs), runs[-1][1]


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
    rows, hf_runs = [], {}
    for dt, mode in entries:
        ours, our_toks, ids = bench_specdec(
            path, dt, args.device, args.new_tokens, args.repeats, mode
        )
        if dt not in hf_runs:
            hf_runs[dt] = bench_hf(path, dt, args.device, args.new_tokens, args.repeats, ids)
        hf, hf_toks = hf_runs[dt]
        same = sum(a == b for a, b in zip(our_toks, hf_toks))
        rows.append(
            {
                "dtype": dt if mode is None else f"{dt} ({mode})",
                "specdec_tok_s": ours,
                "hf_tok_s": hf,
                "ratio": ours / hf,
                "same_tokens": f"{same}/{len(hf_toks)}",
            }
        )
    if "bfloat16" in hf_runs:
        for r in rows:
            r["vs_hf_bf16"] = r["specdec_tok_s"] / hf_runs["bfloat16"][0]
    env = environment(args.device)
    print(
        f"\nplain greedy decode, {args.model}, {args.new_tokens} new tokens, "
        f"median of {args.repeats}, {env['device']}, torch {env['torch']}, "
        f"{env['torch_threads']} threads"
    )
    print(markdown_table(rows, COLUMNS))
    if args.out is not None:
        print(f"wrote {save_results('bench_generate', rows, out=args.out, env=env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
