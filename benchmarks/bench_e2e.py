"""End-to-end decode benchmark: plain and speculative decoding on random quantized models.

    python -m benchmarks.bench_e2e            # one GPU, about 2-3 minutes
    python -m benchmarks.bench_e2e --quick    # fewer runs; on CPU tiny shapes through every
                                               # section (timings meaningless)
    python -m benchmarks.bench_e2e --out DIR  # results directory (default benchmarks/results;
                                               # --quick saves only when --out is given)
    python -m benchmarks.bench_e2e --doc benchmarks/results/<date>-<gpu>.json
                                               # (re)write docs/gpu.md's table from a result
                                               # file (--readme: the old name)

Models (benchmarks.models.random_model: random weights built directly on the device, nothing
downloaded; shapes from benchmarks.harness.MODEL_SHAPES):

- Llama-3-8B shape: 32 layers, dim 4096, 32 / 8 heads, ffn 14336, vocab 128256; int4 weights
  (group 128, scale + min per group) for every projection and the LM head, bf16 embedding.
- SmolLM2-135M shape (its GGUF cannot travel to the GPU box): 30 layers, dim 576, 9 / 3
  heads, ffn 1536, vocab 49152; Q4_1 projections and a tied Q8_0 embedding / LM head, as in
  the embedded SmolLM2-135M-Instruct.Q4_1.gguf.

Scales are set so that a projection keeps its input's scale.
bf16 activations, Triton kernels, batch 1, greedy. Sections:

1. Copy bandwidth (bytes read + written per second by a device-to-device copy).
2. Step times at a 128-token context, as CUDA graph replays (triton do_bench medians):
   decode (T = 1), verification (T = k + 1), the drafters' one-token steps, and the eager
   (uncaptured) decode step. verify/decode ratios.
3. Plain greedy decoding: decode tokens/s (after the prefill), bytes/token (packed weights
   the step reads + the KV cache at the mean context) and the fraction of copy bandwidth
   that makes.
4. Speculative decoding with a layer-skip (every second layer) and an early-exit (first
   quarter of the layers) draft, k in {2, 4, 8}, with controlled acceptance
   (benchmarks.models: each draft token is the target's own with probability alpha, default
   0.8): every cost is real, and the output must still equal plain decoding (checked).
5. SmolLM2 shape: plain and speculative (layer skip, k = 4), CUDA graphs on and off.
6. HF transformers, same shapes in bf16 with random weights on the device: plain greedy
   decode tokens/s (`generate`, dynamic cache, default attention), the side-by-side baseline.

Results: <out>/bench_e2e.json + .csv (one row per plain / speculative / HF run), and merged
into the combined <out>/<date>-<gpu>.json under "e2e", with the 8B-shape plain decode rate
also at the top level as "e2e_decode_tokens_per_second"; benchmarks/report.py prints the
tables. Sections that would overrun --budget-s seconds are skipped and say so.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import (
    REPO,
    bench_parser,
    combined_results_path,
    copy_bandwidth_gbps,
    environment,
    merge_results,
    results_dir,
    save_results,
    sync,
)
from benchmarks.models import (
    controlled_drafter,
    decode_rate,
    draft_layers,
    hf_generate_s,
    hf_random_model,
    median_run,
    random_model,
    shape,
    step_ms,
)
from benchmarks.report import e2e_tables, headline, load_results, update_readme
from specdec.cli import user_errors
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.kernels.utils import INVARIANT_GEMV_ENV, invariant_gemv_path
from specdec.models.config import ModelConfig
from specdec.models.cuda_graphs import graphs_for
from specdec.models.transformer import Transformer

# the markdown file whose end-to-end tables `--doc` rewrites
GPU_DOC = REPO / "docs" / "gpu.md"

log = logging.getLogger(__name__)

CONTEXT = 128  # tokens in the cache when step times are measured
PROMPT_LEN = 32
KINDS = ("layerskip", "early_exit")


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def bytes_per_token(model: Transformer, context: float) -> dict:
    c = model.config
    weights = model.num_parameters_bytes()
    kv = 2 * c.n_layers * c.kv_dim * context * torch.finfo(model.dtype).bits // 8
    return {"weight_bytes": weights, "kv_bytes": int(kv), "bytes_per_token": int(weights + kv)}


def step_times(model: Transformer, ks: tuple[int, ...], kinds: tuple[str, ...]) -> dict:
    decode = step_ms(model, 1, context=CONTEXT)
    out = {
        "context": CONTEXT,
        "decode_ms": decode,
        "decode_eager_ms": step_ms(model, 1, graphs=False, context=CONTEXT),
        "verify": [],
        "draft_step_ms": {},
    }
    for k in ks:
        ms = step_ms(model, k + 1, context=CONTEXT)
        out["verify"].append({"k": k, "T": k + 1, "ms": ms, "ratio_to_decode": ms / decode})
    for kind in kinds:
        layers = draft_layers(kind, model.config.n_layers)
        out["draft_step_ms"][kind] = step_ms(model, 1, layers=layers, context=CONTEXT)
    return out


def plain_decode(model, prompt, n_new, repeats, cuda_graphs, copy_bw) -> dict:
    generate(model, [prompt], n_new, cuda_graphs=cuda_graphs)  # warm-up: compiles, captures
    res, rates = median_run(
        lambda: generate(model, [prompt], n_new, cuda_graphs=cuda_graphs), repeats
    )
    rate = decode_rate(res)
    b = bytes_per_token(model, len(prompt) + n_new / 2)
    gbps = b["bytes_per_token"] * rate / 1e9
    return {
        "cuda_graphs": cuda_graphs,
        "batch_invariant": model.batch_invariant,
        "invariant_gemv": invariant_gemv_path() if model.batch_invariant else None,
        "new_tokens": n_new,
        "decode_tokens_per_second": rate,
        "decode_rates": rates,
        "tokens_per_second": res.tokens_per_second,
        **b,
        "gbps": gbps,
        "fraction_of_copy_bandwidth": gbps / copy_bw,
        "tokens": res.tokens[0],
    }


def speculative(
    model, prompt, reference, kind, k, alpha, repeats, cuda_graphs, chain_graphs=True
) -> dict:
    n_new = len(reference)
    drafter = controlled_drafter(kind, model, reference, len(prompt), alpha)
    drafter.chain_graphs = chain_graphs
    sched = make_schedule("constant", k)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=sched, cuda_graphs=cuda_graphs)
    dec.generate([prompt], n_new)  # warm-up: the same run, so every graph it needs is captured
    res, rates = median_run(lambda: dec.generate([prompt], n_new), repeats)
    st = res.stats
    return {
        "drafter": kind,
        "k": k,
        "cuda_graphs": cuda_graphs,
        "chain_graphs": chain_graphs,
        "batch_invariant": model.batch_invariant,
        "invariant_gemv": invariant_gemv_path() if model.batch_invariant else None,
        "alpha_target": alpha,
        "alpha": st["alpha"],
        "mean_accepted_tokens": st["mean_accepted_tokens"],
        "decode_tokens_per_second": decode_rate(res),
        "decode_rates": rates,
        "tokens_per_second": res.tokens_per_second,
        "time_s": st["time_s"],  # prefill / draft / verify / other (synchronised)
        "rounds": st["rounds"],  # batch 1: the rounds of the timed run
        "identical_to_plain": res.tokens[0] == reference,
    }


def invariant_ab(model, variant, out, prompt, reference, args, copy_bw, add) -> None:
    """Plain decoding and early exit k = 4 with batch invariance "off", or on with its GEMV
    rows on the "broadcast" path, appended to out (graphs captured in another mode are
    dropped before and after)."""
    saved = os.environ.get(INVARIANT_GEMV_ENV)
    if variant == "off":
        model.batch_invariant = False
    else:
        os.environ[INVARIANT_GEMV_ENV] = variant
    graphs_for(model).drop()
    try:
        plain = plain_decode(model, prompt, args.new_tokens, args.repeats, True, copy_bw)
        plain["identical_to_plain"] = plain["tokens"] == reference
        out["plain"].append(plain)
        add(
            speculative(
                model, prompt, plain["tokens"], "early_exit", 4, args.alpha, args.repeats, True
            )
        )
    finally:
        model.batch_invariant = True
        if saved is None:
            os.environ.pop(INVARIANT_GEMV_ENV, None)
        else:
            os.environ[INVARIANT_GEMV_ENV] = saved
        graphs_for(model).drop()


def bench_model(cfg, fmt, device, args, copy_bw, budget, *, ks, graph_modes, kinds) -> dict:
    t0 = time.perf_counter()
    model = random_model(cfg, fmt, device)
    sync(device)
    log.info("%s: built in %.1f s", cfg.name, time.perf_counter() - t0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    out = {
        "model": cfg.name,
        "format": fmt,
        "dtype": str(model.dtype).removeprefix("torch."),
        "backend": model.backend,
        "n_layers": cfg.n_layers,
        "early_exit_layers": len(draft_layers("early_exit", cfg.n_layers)),
        "steps": step_times(model, ks, kinds),
        "plain": [],
        "speculative": [],
    }
    for graphs in graph_modes:
        out["plain"].append(
            plain_decode(model, prompt, args.new_tokens, args.repeats, graphs, copy_bw)
        )
    reference = out["plain"][0]["tokens"]

    def add(rec: dict) -> None:
        # a speculative run, with its speedup over plain decoding with graphs on, in the same
        # batch-invariance mode
        base = next(
            p
            for p in out["plain"]
            if p["cuda_graphs"] == out["plain"][0]["cuda_graphs"]
            and p["batch_invariant"] == rec["batch_invariant"]
            and p.get("invariant_gemv") == rec.get("invariant_gemv")
        )
        rec["speedup"] = rec["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        out["speculative"].append(rec)

    for graphs in graph_modes:
        for kind in kinds:
            for k in ks:
                if budget.left() < 10:
                    log.warning("budget spent: skipping %s speculative k=%d", cfg.name, k)
                    out.setdefault("skipped", []).append(f"speculative {kind} k={k}")
                    continue
                add(
                    speculative(model, prompt, reference, kind, k, args.alpha, args.repeats, graphs)
                )
    # A/B: the greedy draft chain as one graph (CudaGraphs.chain) against a replay per step
    # (off CUDA both run uncaptured: the CPU smoke run only checks the plumbing)
    if True in graph_modes and 4 in ks and "early_exit" in kinds:
        for kind in kinds:
            if budget.left() < 10:
                out.setdefault("skipped", []).append(f"speculative {kind} k=4 chain off")
                continue
            add(
                speculative(
                    model, prompt, reference, kind, 4, args.alpha, args.repeats, True, False
                )
            )
    # A/B: batch invariance (on by default for bf16 on the Triton backend: verification rows
    # compute the decode step's bits, through one GEMV plan for every M and fixed attention
    # splits) against the kernels' fastest launches, and its GEMV on the broadcast path
    # instead of tl.dot ($SPECDEC_INVARIANT_GEMV), plain and early exit k = 4 each
    if model.batch_invariant and True in graph_modes and 4 in ks and "early_exit" in kinds:
        for variant in ("off", "broadcast"):
            if budget.left() < 20:
                out.setdefault("skipped", []).append(f"batch invariance {variant} (A/B)")
                continue
            invariant_ab(model, variant, out, prompt, reference, args, copy_bw, add)
    for p in out["plain"]:
        p.pop("tokens")
    graphs_for(model).drop()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_hf(cfg: ModelConfig, device: torch.device, n_new: int, repeats: int) -> dict:
    """HF's model of the same shape with random weights on the device: greedy decode rate
    from generate(n_new) - generate(1)."""
    import transformers

    t0 = time.perf_counter()
    model = hf_random_model(cfg, device)
    sync(device)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=gen).to(device)
    hf_generate_s(model, x, 4)  # warm-up
    one = statistics.median(hf_generate_s(model, x, 1)[0] for _ in range(repeats))
    full = statistics.median(hf_generate_s(model, x, n_new)[0] for _ in range(repeats))
    return {
        "model": cfg.name,
        "impl": f"transformers {transformers.__version__} {type(model).__name__}.generate",
        "dtype": str(model.dtype).removeprefix("torch."),
        "new_tokens": n_new,
        "decode_tokens_per_second": (n_new - 1) / max(1e-9, full - one),
        "build_s": build_s,
    }


def _section(result: dict, key: str, name: str, fn, *args, **kwargs) -> None:
    """Append fn(*args, **kwargs) to result[key]; a failure is recorded and the run goes on."""
    try:
        result[key].append(fn(*args, **kwargs))
    except Exception as e:  # one broken section must not lose the others' numbers
        log.exception("%s on %s failed", key, name)
        result[key].append({"model": name, "error": f"{type(e).__name__}: {e}"[:500]})
    gc.collect()  # a model and its CudaGraphs reference each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args, device: torch.device, save=lambda result: None) -> dict:
    """Every section in turn; `save(result)` after each (a timeout keeps what was measured)."""
    cuda = device.type == "cuda"
    budget = Budget(args.budget_s)
    big, small = shape("llama-3-8b", cuda), shape("smollm2-135m", cuda)
    copy_bw = copy_bandwidth_gbps(device)
    print(f"copy bandwidth: {copy_bw:.0f} GB/s (read + write)")
    result = {
        "gpu": environment(device)["device"],
        "torch": torch.__version__,
        "copy_bandwidth_gbps": copy_bw,
        "context_for_steps": CONTEXT,
        "prompt_tokens": PROMPT_LEN,
        "alpha_target": args.alpha,
        "models": [],
        "hf": [],
    }
    big_ks = (4,) if args.quick else (2, 4, 8)
    sections = [
        (big, "int4", big_ks, (True,), KINDS),
        (small, "q4_1", (4,), (True, False) if cuda else (True,), ("layerskip",)),
    ]
    for cfg, fmt, ks, graph_modes, kinds in sections:
        _section(
            result,
            "models",
            cfg.name,
            bench_model,
            cfg,
            fmt,
            device,
            args,
            copy_bw,
            budget,
            ks=ks,
            graph_modes=graph_modes,
            kinds=kinds,
        )
        save(result)
        log.info("%.0f s of the budget left after %s", budget.left(), cfg.name)
    for cfg, n_new, need_s in ((small, args.new_tokens, 15), (big, 32, 45)):
        if args.quick and cuda and cfg is big:
            continue
        if budget.left() < need_s:
            log.warning("budget: skipping the HF baseline on %s", cfg.name)
            result["hf"].append({"model": cfg.name, "skipped": "time budget"})
            continue
        _section(result, "hf", cfg.name, bench_hf, cfg, device, n_new, args.repeats)
        save(result)
    return result


def flat_rows(e2e: dict) -> list[dict]:
    """One row per measured run (plain, speculative, HF) for the CSV."""
    rows = []
    for m in e2e["models"]:
        head = {k: m.get(k) for k in ("model", "format", "dtype", "backend")}
        if "error" in m:
            rows.append({"section": "error", **head, "error": m["error"]})
            continue
        rows += [{"section": "plain", **head, **p} for p in m["plain"]]
        rows += [{"section": "speculative", **head, **s} for s in m["speculative"]]
    rows += [{"section": "hf", **h} for h in e2e["hf"]]
    return rows


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    parser.add_argument("--alpha", type=float, default=0.8, help="controlled acceptance rate")
    parser.add_argument("--budget-s", type=float, default=170.0, help="skip sections past this")
    parser.add_argument(
        "--doc", "--readme", dest="doc", type=Path, default=None, help="results JSON -> docs/gpu.md"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.doc is not None:
        update_readme(GPU_DOC, load_results(args.doc))
        print(f"updated {GPU_DOC} from {args.doc}")
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench_e2e needs a CUDA GPU; use --quick for a CPU smoke run")
        return 0
    if not cuda:
        print("no CUDA device: CPU smoke run on tiny shapes (timings are meaningless)")
    args.new_tokens = args.new_tokens or (16 if not cuda else 64 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    device = torch.device("cuda" if cuda else "cpu")
    out = results_dir(args)
    env = environment(device)

    def save(e2e: dict) -> None:
        if out is None:
            return
        save_results("bench_e2e", flat_rows(e2e), out=out, env=env)
        update = {
            "gpu": env["device"],
            "date": env["date"],
            "e2e": {**e2e, "commit": env["commit"]},
        }
        rate = headline(e2e)
        if rate is not None:
            update["e2e_decode_tokens_per_second"] = rate
        merge_results(combined_results_path(out, device), update)

    e2e = run(args, device, save)
    save(e2e)
    print(e2e_tables(e2e))
    big = e2e["models"][0]
    if "error" not in big:
        verify9 = [v["ratio_to_decode"] for v in big["steps"]["verify"] if v["T"] == 9]
        print(
            f"{big['model']} plain decode: {headline(e2e):.1f} tok/s (goal >= 400 on an H200)"
            + (f"; verify T=9 / decode: {verify9[0]:.2f}x (goal <= 1.3x)" if verify9 else "")
        )
    if out is not None:
        print(f"wrote {out / 'bench_e2e.json'} and {combined_results_path(out, device)}")
    failed = [r["model"] for r in e2e["models"] + e2e["hf"] if "error" in r]
    if failed:
        print(f"sections failed: {', '.join(failed)} (errors in the results file)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
