"""Streamed-target benchmark: host-to-device bandwidth, streamed forwards, speculative vs plain.

    python -m experiments.bench_streamed            # Llama-3-8B-shaped int4 target, one GPU
    python -m experiments.bench_streamed --quick    # fewer tokens and k; on CPU a tiny smoke run
    python -m experiments.bench_streamed --out DIR  # results directory (default benchmarks/results;
                                                    # --quick saves only when --out is given)

1. Host-to-device bandwidth: pinned host -> device copies, 1 GiB and one layer at a time.
2. Target: Llama-3-8B shapes (32 layers, dim 4096, 32 / 8 heads, ffn 14336, vocab 128256),
   random int4 weights (group 128, codes built directly, not quantized), tied int4 LM head,
   bf16 activations, Triton kernels. Layers `exit_layer` and up stream from pinned host
   memory (specdec/models/streaming.py); the first `exit_layer` stay resident as the
   early-exit draft.
3. Streamed forwards (T = 1 and T = k + 1): streamed bytes / time, as a fraction of (1); the
   cost model's step time is streamed bytes / (1).
4. Plain greedy decoding vs speculative decoding with the resident early-exit draft, k in
   {2, 4, 8}. Random weights make the draft's own acceptance meaningless, so the drafter runs
   the early-exit forwards (their real cost) and proposes the target's greedy continuation
   with each token kept with probability alpha (0.8): acceptance is controlled, costs are
   measured. Reported: measured alpha, tokens per round, speedup (tokens/s over plain, and
   decode-only), and the cost model's S(alpha, k, c) with c = draft step / target step.

Results merge into <out>/<date>-<gpu>.json under the key "streamed" (written atomically,
other benchmarks' keys kept, see experiments/bench_kernels.py). A summary is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.decode.cost_model import best_k, expected_tokens, predicted_speedup
from specdec.decode.drafters import Draft, EarlyExitDrafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.kernels.quant import QuantizedWeight
from specdec.models.builder import build_model
from specdec.models.config import ModelConfig
from specdec.models.streaming import stream_model
from specdec.models.transformer import KVCache

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(
    arch="llama",
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    rope_theta=500000.0,
    max_seq_len=2048,
    tie_embeddings=True,
    name="llama3-8b-shape-int4-random",
)
TINY = dict(LLAMA3_8B, vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=256)
TINY["name"] = "tiny-int4-random"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_s(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of fn() (one untimed warm-up call)."""
    fn()
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


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


# -- 2. the target ----------------------------------------------------------------------------
def random_int4(n: int, k: int, gen_device: torch.device, group: int = 128) -> QuantizedWeight:
    """Random int4 codes with scales so that x @ W.T keeps x's scale (w = s (q - 8))."""
    s = (1.0 / (21.0 * k) ** 0.5) * (0.5 + torch.rand(n, k // group, device=gen_device))
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=gen_device)
    scales = s.half()
    mins = (-8.0 * scales.float()).half()
    return QuantizedWeight("int4", 4, group, (n, k), q.cpu(), scales.cpu(), mins.cpu())


def build_target(cfg: ModelConfig, gen_device: torch.device):
    """A Transformer of random int4 weights on the CPU, as a loader would return it."""
    d, kv = cfg.dim, cfg.kv_dim
    layers = []
    for _ in range(cfg.n_layers):
        layers.append(
            {
                "wq": random_int4(cfg.q_dim, d, gen_device),
                "wk": random_int4(kv, d, gen_device),
                "wv": random_int4(kv, d, gen_device),
                "wo": random_int4(d, cfg.q_dim, gen_device),
                "w_gate": random_int4(cfg.ffn_dim, d, gen_device),
                "w_up": random_int4(cfg.ffn_dim, d, gen_device),
                "w_down": random_int4(d, cfg.ffn_dim, gen_device),
                "attn_norm": torch.ones(d),
                "ffn_norm": torch.ones(d),
            }
        )
    embed = random_int4(cfg.vocab_size, d, gen_device)
    state = {"embed": embed, "norm": torch.ones(d), "lm_head": None, "layers": layers}
    return build_model(cfg, state)


# -- 4. the controlled-acceptance early-exit drafter ------------------------------------------
class ControlledEarlyExit(EarlyExitDrafter):
    """Runs the early-exit draft (its real cost) but proposes `reference` (the target's greedy
    continuation of the prompt), each token kept with probability alpha and otherwise
    replaced by another id: with greedy verification, drafts are accepted i.i.d. with alpha."""

    name = "early_exit_controlled"

    def __init__(self, target, exit_layer: int, reference: list[int], prompt_len: int, alpha):
        super().__init__(target, exit_layer)
        self.reference, self.prompt_len, self.alpha = reference, prompt_len, alpha
        self.rng = torch.Generator().manual_seed(0)

    def propose(self, request) -> Draft:
        draft = super().propose(request)
        # index of the next token in `reference`
        emitted = len(request.history[0]) - self.prompt_len
        n = draft.tokens.shape[1]
        ref = torch.tensor(
            [self.reference[min(emitted + i, len(self.reference) - 1)] for i in range(n)]
        )
        keep = torch.rand(n, generator=self.rng) < self.alpha
        vocab = self.model.config.vocab_size
        draft.tokens[0] = torch.where(keep, ref, (ref + 1) % vocab).to(draft.tokens.device)
        return draft


def decode_rate(res) -> float:
    """Tokens per second after the prefill (the first token comes with the prefill)."""
    return (res.num_generated - 1) / max(1e-9, res.elapsed_s - res.prefill_s)


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = ModelConfig(**(LLAMA3_8B if cuda else TINY))
    exit_layer = cfg.n_layers // 4
    dtype = torch.bfloat16 if cuda else torch.float32
    ks = (4, 8) if args.quick else (2, 4, 8)
    max_new = 24 if args.quick else 64

    log.info("building %s on the host", cfg.name)
    t0 = time.perf_counter()
    model = build_target(cfg, device)
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
        drafter = ControlledEarlyExit(model, exit_layer, reference, len(prompt), args.alpha)
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
    from experiments.bench_kernels import git_commit, gpu_name, slug, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and k (CPU: tiny)")
    parser.add_argument("--alpha", type=float, default=0.8, help="controlled acceptance rate")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        if not args.quick:
            print("bench_streamed needs a CUDA GPU; use --quick for a CPU smoke run")
            return 0
        print("no CUDA device: CPU smoke run on a tiny model (timings are meaningless)")
    result = run(args)
    out_dir = args.out if args.quick else (args.out or REPO / "benchmarks" / "results")
    if out_dir is not None:
        date = datetime.date.today().isoformat()
        path = Path(out_dir) / f"{date}-{slug(gpu_name())}.json"
        result["commit"] = git_commit()
        write_results(path, {"gpu": gpu_name(), "date": date, "streamed": result})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
