"""Streamed-target benchmark: host-to-device bandwidth, streamed forwards, speculative vs plain.

    python -m benchmarks.bench_streamed            # Llama-3-8B-shaped int4 target, one GPU
    python -m benchmarks.bench_streamed --quick    # fewer tokens and k; on CPU a tiny smoke run
    python -m benchmarks.bench_streamed --out DIR  # results directory (default benchmarks/results;
                                                   # --quick saves only when --out is given)

1. Host-to-device bandwidth: pinned host -> device copies, 1 GiB and one layer at a time.
2. Target: Llama-3-8B shapes (benchmarks.harness.MODEL_SHAPES: 32 layers, dim 4096, 32 / 8
   heads, ffn 14336, vocab 128256), random int4 weights (group 128, codes built directly,
   not quantized; benchmarks.models.random_model), int4 LM head, bf16 embedding and
   activations, Triton kernels. Layers `exit_layer` and up stream from pinned host memory
   (specdec.models.streaming); the first `exit_layer` stay resident as the early-exit draft.
3. Streamed forwards (T = 1 and T = k + 1): streamed bytes / time, as a fraction of (1); the
   cost model's step time is streamed bytes / (1).
4. Plain greedy decoding vs speculative decoding with the resident early-exit draft, k in
   {2, 4, 8}, with controlled acceptance (benchmarks.models: the drafter runs the early-exit
   forwards, their real cost, and proposes the target's greedy continuation with each token
   kept with probability alpha, 0.8). Reported: measured alpha, tokens per round, speedup (tokens/s over plain, and
   decode-only), and the cost model's S(alpha, k, c) with c = draft step / target step.

Results: <out>/bench_streamed.json + .csv (one row per decoding run) and, merged, the
combined <out>/<date>-<gpu>.json under the key "streamed" (benchmarks.harness). A summary is
printed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import torch

from benchmarks.harness import (
    bench_parser,
    combined_results_path,
    environment,
    merge_results,
    results_dir,
    save_results,
    time_ms,
)
from benchmarks.models import controlled_drafter, decode_rate, random_model, shape
from specdec.decode.cost_model import best_k, expected_tokens, predicted_speedup
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.models.streaming import stream_model
from specdec.models.transformer import KVCache

log = logging.getLogger(__name__)


def time_s(fn, device: torch.device) -> float:
    """Median seconds of fn(): streamed forwards and host copies take tens of ms or more."""
    return time_ms(fn, device=device, warmup=1, repeats=5, budget_ms=(1, 400)) * 1e-3


# -- 1. host-to-device bandwidth --------------------------------------------------------------
def h2d_bandwidth(device: torch.device, nbytes: int, chunk: int) -> dict:
    """Bytes/s of pinned host -> device copies: one `nbytes` copy, and `nbytes` in copies of
    `chunk` bytes issued back to back on a side stream (how layers stream)."""
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    whole = time_s(lambda: dst.copy_(src, non_blocking=True), device)
    side = torch.cuda.Stream(device) if pin else None

    def chunks():
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for a in range(0, nbytes - chunk + 1, chunk):
                dst[a : a + chunk].copy_(src[a : a + chunk], non_blocking=True)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    n_chunked = (nbytes // chunk) * chunk
    chunked = time_s(chunks, device)
    return {
        "bytes": nbytes,
        "gbps": nbytes / whole / 1e9,
        "chunk_bytes": chunk,
        "chunked_gbps": n_chunked / chunked / 1e9,
        "pinned": pin,
    }


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = shape("llama-3-8b", cuda)
    exit_layer = cfg.n_layers // 4
    dtype = torch.bfloat16 if cuda else torch.float32
    ks = (4, 8) if args.quick else (2, 4, 8)
    max_new = 24 if args.quick else 64

    log.info("building %s on the host", cfg.name)
    t0 = time.perf_counter()
    model = random_model(cfg, "int4", device, on_host=True)
    stream_model(
        model,
        device,
        dtype=dtype,
        backend="triton" if cuda else "torch",
        source="host",
        resident_layers=exit_layer,
    )
    stream = model.layer_stream
    log.info("built and streamed in %.1f s", time.perf_counter() - t0)
    per_forward = stream.bytes_per_forward()
    layer_bytes = stream.units[exit_layer].nbytes

    bw = h2d_bandwidth(device, (1 << 30) if cuda else (64 << 20), layer_bytes)
    h2d = bw["gbps"] * 1e9
    print(
        f"host-to-device: {bw['gbps']:.1f} GB/s (1 copy), {bw['chunked_gbps']:.1f} GB/s "
        f"(copies of one layer, {layer_bytes / 2**20:.0f} MiB)"
    )

    # -- 3. streamed forwards
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist()
    cache = KVCache.for_model(model, 1, len(prompt) + max_new + 16)
    forwards = []
    pos = torch.full((1,), len(prompt), dtype=torch.long, device=device)  # after the prompt
    with torch.inference_mode():
        start = torch.zeros(1, dtype=torch.long, device=device)
        model(torch.tensor([prompt], device=device), cache, start)
        for T in (1, *(k + 1 for k in ks)):
            toks = torch.tensor([prompt[:T]], device=device)
            s = time_s(lambda toks=toks: model(toks, cache, pos), device)
            forwards.append(
                {
                    "T": T,
                    "ms": s * 1e3,
                    "gbps": per_forward / s / 1e9,
                    "fraction_of_h2d": per_forward / s / h2d,
                }
            )
        one = torch.tensor([prompt[:1]], device=device)
        draft_step = time_s(lambda: model(one, cache, pos, layers=range(exit_layer)), device)
    predicted_step = per_forward / h2d
    for f in forwards:
        print(
            f"streamed forward T={f['T']}: {f['ms']:.1f} ms, {f['gbps']:.1f} GB/s = "
            f"{100 * f['fraction_of_h2d']:.0f}% of host-to-device (cost model "
            f"{predicted_step * 1e3:.1f} ms)"
        )

    # -- 4. plain vs speculative
    with torch.inference_mode():  # compile every verification width up front (the last
        for T in range(2, max(ks) + 1):  # rounds of a run draft fewer tokens)
            model(torch.tensor([prompt[:T]], device=device), cache, pos)
    generate(model, [prompt], 4)  # warm-up (the prefill shape)
    plain = generate(model, [prompt], max_new)
    reference = plain.tokens[0]
    target_step = (plain.elapsed_s - plain.prefill_s) / max(1, plain.stats["target_forwards"] - 1)
    c = draft_step / target_step
    print(
        f"plain: {decode_rate(plain):.2f} tok/s decode, target step {target_step * 1e3:.1f} ms, "
        f"draft step {draft_step * 1e3:.2f} ms, c = {c:.4f}, "
        f"{plain.stats['bytes_streamed_per_token'] / 2**20:.0f} MiB streamed/token"
    )
    spec = []
    for k in ks:
        drafter = controlled_drafter(
            "early_exit", model, reference, len(prompt), args.alpha, exit_layer=exit_layer
        )
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
        dec.generate([prompt], k + 4)  # warm-up: a full round of k drafts
        res = dec.generate([prompt], max_new)
        st = res.stats
        rec = {
            "k": k,
            "alpha_target": args.alpha,
            "alpha": st["alpha"],
            "mean_accepted_tokens": st["mean_accepted_tokens"],
            "predicted_mean_accepted_tokens": expected_tokens(st["alpha"], k),
            "tokens_per_second": res.tokens_per_second,
            "speedup": res.tokens_per_second / plain.tokens_per_second,
            "decode_speedup": decode_rate(res) / decode_rate(plain),
            "predicted_speedup": predicted_speedup(st["alpha"], k, c),
            "bytes_streamed_per_token": st["bytes_streamed_per_token"],
            "identical_to_plain": res.tokens[0] == reference,
        }
        spec.append(rec)
        print(
            f"k={k}: alpha {rec['alpha']:.2f}, {rec['mean_accepted_tokens']:.2f} tokens/round "
            f"(model {rec['predicted_mean_accepted_tokens']:.2f}), speedup "
            f"{rec['speedup']:.2f}x ({rec['decode_speedup']:.2f}x decode-only), predicted "
            f"{rec['predicted_speedup']:.2f}x, "
            f"{rec['bytes_streamed_per_token'] / 2**20:.0f} MiB/token, "
            f"identical to plain: {rec['identical_to_plain']}"
        )
    return {
        "model": cfg.name,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "n_layers": cfg.n_layers,
        "resident_layers": exit_layer,
        "streamed_bytes_per_forward": per_forward,
        "h2d": bw,
        "forwards": forwards,
        "cost_model_step_ms": predicted_step * 1e3,
        "plain": {
            "tokens_per_second": plain.tokens_per_second,
            "decode_tokens_per_second": decode_rate(plain),
            "target_step_ms": target_step * 1e3,
            "bytes_streamed_per_token": plain.stats["bytes_streamed_per_token"],
        },
        "draft_step_ms": draft_step * 1e3,
        "c": c,
        "best_k": best_k(args.alpha, c),
        "speculative": spec,
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--alpha", type=float, default=0.8, help="controlled acceptance rate")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.quick:
            print("bench_streamed needs a CUDA GPU; use --quick for a CPU smoke run")
            return 0
        print("no CUDA device: CPU smoke run on a tiny model (timings are meaningless)")
    result = run(args)
    out = results_dir(args)
    if out is not None:
        device = torch.device("cuda" if cuda else "cpu")
        env = environment(device)
        rows = [{"decoding": "plain", **result["plain"]}]
        rows += [{"decoding": f"early_exit k={s['k']}", **s} for s in result["speculative"]]
        path = save_results("bench_streamed", rows, out=out, env=env)
        result["commit"] = env["commit"]
        combined = combined_results_path(out, device)
        merge_results(combined, {"gpu": env["device"], "date": env["date"], "streamed": result})
        print(f"wrote {path} and {combined}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
