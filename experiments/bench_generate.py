"""Plain greedy decoding: specdec vs HF transformers, same weights, same dtype, one process.

    python -m experiments.bench_generate [--model smollm2-135m] [--dtypes bfloat16 float32]
                                         [--new-tokens 64] [--repeats 5] [--device cpu]

Both load the same GGUF (HF dequantizes it; specdec's torch backend runs a dequantized
copy on CPU, the quantized GEMV kernels on CUDA). Each repeat generates exactly
--new-tokens tokens greedily (EOS ignored) after a short prompt; tokens/s counts prefill +
decode wall time. Prints medians and the specdec/HF ratio; --out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPT = "The history of the printing press begins in"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_specdec(path: Path, dtype: str, device: str, n_new: int, repeats: int):
    from specdec.decode.generation import generate
    from specdec.models.load import load_model

    model, tok = load_model(str(path), dtype=dtype, device=device)
    ids = tok.encode(PROMPT)
    generate(model, [ids], 8)  # warm-up
    rates, toks = [], None
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        res = generate(model, [ids], n_new)
        _sync(device)
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
    kw = dict(
        do_sample=False,
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        attention_mask=torch.ones_like(x),
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(x, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        rates, toks = [], None
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            out = model.generate(x, **kw)
            _sync(device)
            n = out.shape[1] - x.shape[1]
            rates.append(n / (time.perf_counter() - t))
            toks = out[0, x.shape[1] :].tolist()
    return statistics.median(rates), toks


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write rows as JSON here")
    args = ap.parse_args(argv)
    from specdec.models.registry import resolve_model_path

    path = resolve_model_path(args.model)
    if path.suffix != ".gguf":
        raise SystemExit("bench_generate compares against HF's GGUF loader: give a .gguf model")
    rows = []
    for dt in args.dtypes:
        ours, our_toks, ids = bench_specdec(path, dt, args.device, args.new_tokens, args.repeats)
        hf, hf_toks = bench_hf(path, dt, args.device, args.new_tokens, args.repeats, ids)
        same = sum(a == b for a, b in zip(our_toks, hf_toks))
        rows.append(
            {
                "dtype": dt,
                "specdec_tok_s": ours,
                "hf_tok_s": hf,
                "ratio": ours / hf,
                "same_tokens": f"{same}/{len(hf_toks)}",
            }
        )
    print(
        f"\nplain greedy decode, {args.model}, {args.new_tokens} new tokens, "
        f"median of {args.repeats}, {machine()}"
    )
    print("| dtype | specdec tok/s | HF transformers tok/s | ratio | identical tokens |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['specdec_tok_s']:.1f} | {r['hf_tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['same_tokens']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
