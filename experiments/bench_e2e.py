"""End-to-end decode benchmark: plain and speculative decoding on random quantized models.

    python -m experiments.bench_e2e            # one GPU, about 2-3 minutes
    python -m experiments.bench_e2e --quick    # fewer runs; on CPU tiny shapes through every
                                               # section (timings meaningless)
    python -m experiments.bench_e2e --out DIR  # results directory (default benchmarks/results;
                                               # --quick saves only when --out is given)
    python -m experiments.bench_e2e --readme benchmarks/results/<date>-<gpu>.json
                                               # (re)write README.md's table from a result file

Models (random weights built directly on the device, nothing downloaded):

- Llama-3-8B shape: 32 layers, dim 4096, 32 / 8 heads, ffn 14336, vocab 128256; int4 weights
  (group 128, scale + min per group) for every projection and the LM head, bf16 embedding.
- SmolLM2-135M shape (its GGUF cannot travel to the GPU box): 30 layers, dim 576, 9 / 3
  heads, ffn 1536, vocab 49152; Q4_1 projections and a tied Q8_0 embedding / LM head, as in
  the embedded SmolLM2-135M-Instruct.Q4_1.gguf.

Scales are set so that a projection keeps its input's scale (bench_streamed does the same).
bf16 activations, Triton kernels, batch 1, greedy. Sections:

1. Copy bandwidth (bytes read + written per second by a device-to-device copy).
2. Step times at a 128-token context, as CUDA graph replays (triton do_bench medians):
   decode (T = 1), verification (T = k + 1), the drafters' one-token steps, and the eager
   (uncaptured) decode step. verify/decode ratios.
3. Plain greedy decoding: decode tokens/s (after the prefill), bytes/token (packed weights
   the step reads + the KV cache at the mean context) and the fraction of copy bandwidth
   that makes.
4. Speculative decoding with a layer-skip (every second layer) and an early-exit (first
   quarter of the layers) draft, k in {2, 4, 8}. Random weights make a draft's own guesses
   meaningless, so each drafter runs its real forwards but proposes the target's greedy
   continuation, each token kept with probability alpha (default 0.8) and otherwise
   replaced: acceptance is controlled, every cost is real, and the output must still equal
   plain decoding (checked).
5. SmolLM2 shape: plain and speculative (layer skip, k = 4), CUDA graphs on and off.
6. HF transformers, same shapes in bf16 with random weights on the device: plain greedy
   decode tokens/s (`generate`, dynamic cache, default attention), the side-by-side baseline.

Results merge into <out>/<date>-<gpu>.json (see experiments/bench_kernels.py) under "e2e",
with the 8B-shape plain decode rate also at the top level as "e2e_decode_tokens_per_second".
Sections that would overrun --budget-s seconds are skipped and say so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.bench_common import time_ms
from experiments.bench_kernels import copy_bandwidth_gbps, git_commit, gpu_name, slug, write_results
from specdec.decode.drafters import Draft, EarlyExitDrafter, LayerSkipDrafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.kernels.quant import QuantizedWeight
from specdec.kernels.utils import cdiv
from specdec.models.builder import build_model
from specdec.models.config import ModelConfig
from specdec.models.cuda_graphs import graphs_for
from specdec.models.transformer import Transformer

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
README_BEGIN = "<!-- bench_e2e:begin -->"
README_END = "<!-- bench_e2e:end -->"

LLAMA3_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    rope_theta=500000.0,
    max_seq_len=2048,
    name="llama3-8b-shape",
)
SMOLLM2_135M = ModelConfig(
    arch="llama",
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    ffn_dim=1536,
    rope_theta=100000.0,
    max_seq_len=2048,
    tie_embeddings=True,
    name="smollm2-135m-shape",
)
# --quick on CPU: the same code paths on tiny shapes
TINY_8B = ModelConfig("llama", 512, 128, 4, 4, 2, 256, max_seq_len=512, name="tiny-8b-like")
TINY_SMOL = ModelConfig(
    "llama", 384, 64, 4, 4, 2, 128, max_seq_len=512, tie_embeddings=True, name="tiny-smol-like"
)

# (bits, group, has mins, QuantizedWeight.fmt)
FORMATS = {
    "int4": (4, 128, True, "int4"),
    "q4_1": (4, 32, True, "q4_1"),
    "q8_0": (8, 32, False, "q8_0"),
}
CONTEXT = 128  # tokens in the cache when step times are measured
PROMPT_LEN = 32


# -- models ---------------------------------------------------------------------------------
def random_weight(fmt: str, n: int, k: int, device: torch.device, gen: torch.Generator):
    """Random codes in the QuantizedWeight layout, scaled so that x @ W.T keeps x's scale."""
    bits, group, has_mins, name = FORMATS[fmt]
    k_pad = cdiv(k, group) * group
    jitter = 0.5 + torch.rand(n, k_pad // group, device=device, generator=gen)
    if bits == 8:  # w = d q, q uniform in [-127, 127]: E[q^2] ~ 127^2 / 3
        q = torch.randint(-127, 128, (n, k_pad), dtype=torch.int8, device=device, generator=gen)
        scales = (jitter / (5376.0 * k) ** 0.5).half()
        return QuantizedWeight(name, bits, group, (n, k), q, scales, None)
    # w = d q + m with m = -8 d: E[(q - 8)^2] = 21.5 for q uniform in [0, 15]
    q = torch.randint(0, 256, (n, k_pad // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = (jitter / (21.5 * k) ** 0.5).half()
    mins = (-8.0 * scales.float()).half() if has_mins else None
    return QuantizedWeight(name, bits, group, (n, k), q, scales, mins)


def random_model(
    cfg: ModelConfig,
    fmt: str,
    device: torch.device,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> Transformer:
    """A Transformer of shape `cfg` with random `fmt` projections, set up on `device`
    (bf16 + Triton on CUDA, fp32 + torch elsewhere unless given). A tied embedding / LM
    head is Q8_0; an untied model gets a bf16 embedding and an `fmt` LM head."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    d, kv = cfg.dim, cfg.kv_dim

    def w(n: int, k: int, f: str = fmt) -> QuantizedWeight:
        return random_weight(f, n, k, device, gen)

    ones = torch.ones(d, device=device)
    layers = [
        {
            "wq": w(cfg.q_dim, d),
            "wk": w(kv, d),
            "wv": w(kv, d),
            "wo": w(d, cfg.q_dim),
            "w_gate": w(cfg.ffn_dim, d),
            "w_up": w(cfg.ffn_dim, d),
            "w_down": w(d, cfg.ffn_dim),
            "attn_norm": ones,
            "ffn_norm": ones,
        }
        for _ in range(cfg.n_layers)
    ]
    if cfg.tie_embeddings:
        embed, head = w(cfg.vocab_size, d, "q8_0"), None
    else:
        embed = torch.randn(cfg.vocab_size, d, device=device, dtype=dtype, generator=gen)
        head = w(cfg.vocab_size, d)
    state = {"embed": embed, "norm": ones, "lm_head": head, "layers": layers}
    with torch.inference_mode():
        model = build_model(cfg, state).setup(dtype, device, backend)
    return model.eval()


# -- timing helpers -------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(
    model: Transformer,
    T: int = 1,
    *,
    graphs: bool = True,
    layers: list[int] | None = None,
    context: int = CONTEXT,
) -> float:
    """Median ms of one forward of T tokens (batch 1) at `context` cached tokens, replayed
    from a CUDA graph (graphs=True) or eager."""
    dev = model.device
    g = graphs_for(model)
    cache = g.cache("bench", 1, context + 16)
    gen = torch.Generator(device=dev).manual_seed(T)
    with torch.inference_mode():
        prompt = torch.randint(0, model.config.vocab_size, (1, context), device=dev, generator=gen)
        model(prompt, cache, torch.zeros(1, dtype=torch.long, device=dev))
        toks = torch.randint(0, model.config.vocab_size, (1, T), device=dev, generator=gen)
        start = torch.full((1,), context, dtype=torch.long, device=dev)
        if graphs:
            fn = lambda: g.forward(toks, cache, start, layers=layers)
        else:
            fn = lambda: model(toks, cache, start, layers=layers)
        return time_ms(fn)


def decode_rate(res) -> float:
    """Tokens per second after the prefill (the first token comes with the prefill)."""
    return (res.num_generated - 1) / max(1e-9, res.elapsed_s - res.prefill_s)


def median_run(fn, repeats: int):
    """(result of the median-rate run, all decode rates) over `repeats` runs of fn()."""
    runs = [fn() for _ in range(repeats)]
    rates = [decode_rate(r) for r in runs]
    return runs[rates.index(sorted(rates)[len(rates) // 2])], rates


# -- the controlled-acceptance drafters -------------------------------------------------------
class _Controlled:
    """Mixin over a model drafter: runs its forwards (their real cost), then proposes
    `reference` (the target's greedy continuation of the prompt), each token kept with
    probability alpha and otherwise replaced by another id. With greedy verification the
    drafts are then accepted i.i.d. with probability alpha. Batch 1."""

    def control(self, reference: list[int], prompt_len: int, alpha: float):
        self.reference, self.prompt_len, self.alpha = reference, prompt_len, alpha
        self.name = f"{self.name}_controlled"
        return self

    def begin(self, *args, **kwargs):
        super().begin(*args, **kwargs)
        self.rng = torch.Generator().manual_seed(0)  # every run proposes the same drafts

    def propose(self, request) -> Draft:
        draft = super().propose(request)
        # index of the next token in `reference`
        emitted = len(request.history[0]) - self.prompt_len
        n = draft.tokens.shape[1]
        last = len(self.reference) - 1
        ref = torch.tensor([self.reference[min(emitted + i, last)] for i in range(n)])
        keep = torch.rand(n, generator=self.rng) < self.alpha
        vocab = self.model.config.vocab_size
        draft.tokens[0] = torch.where(keep, ref, (ref + 1) % vocab).to(draft.tokens.device)
        return draft


class ControlledLayerSkip(_Controlled, LayerSkipDrafter):
    pass


class ControlledEarlyExit(_Controlled, EarlyExitDrafter):
    pass


def drafter_for(kind: str, model: Transformer):
    n = model.config.n_layers
    if kind == "layerskip":
        return ControlledLayerSkip(model, "every2")
    return ControlledEarlyExit(model, max(1, n // 4))


# -- sections -------------------------------------------------------------------------------
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


def step_times(model: Transformer, ks: tuple[int, ...], drafter_layers: dict) -> dict:
    decode = step_ms(model, 1)
    out = {
        "context": CONTEXT,
        "decode_ms": decode,
        "decode_eager_ms": step_ms(model, 1, graphs=False),
        "verify": [],
        "draft_step_ms": {},
    }
    for k in ks:
        ms = step_ms(model, k + 1)
        out["verify"].append({"k": k, "T": k + 1, "ms": ms, "ratio_to_decode": ms / decode})
    for name, layers in drafter_layers.items():
        out["draft_step_ms"][name] = step_ms(model, 1, layers=layers)
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
        "new_tokens": n_new,
        "decode_tokens_per_second": rate,
        "decode_rates": rates,
        "tokens_per_second": res.tokens_per_second,
        **b,
        "gbps": gbps,
        "fraction_of_copy_bandwidth": gbps / copy_bw,
        "tokens": res.tokens[0],
    }


def speculative(model, prompt, reference, kind, k, alpha, repeats, cuda_graphs) -> dict:
    n_new = len(reference)
    drafter = drafter_for(kind, model).control(reference, len(prompt), alpha)
    sched = make_schedule("constant", k)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=sched, cuda_graphs=cuda_graphs)
    dec.generate([prompt], n_new)  # warm-up: the same run, so every graph it needs is captured
    res, rates = median_run(lambda: dec.generate([prompt], n_new), repeats)
    st = res.stats
    return {
        "drafter": kind,
        "k": k,
        "cuda_graphs": cuda_graphs,
        "alpha_target": alpha,
        "alpha": st["alpha"],
        "mean_accepted_tokens": st["mean_accepted_tokens"],
        "decode_tokens_per_second": decode_rate(res),
        "decode_rates": rates,
        "tokens_per_second": res.tokens_per_second,
        "time_s": st["time_s"],  # prefill / draft / verify / other (synchronised)
        "identical_to_plain": res.tokens[0] == reference,
    }


def bench_model(cfg, fmt, device, args, copy_bw, budget, *, ks, graph_modes, kinds) -> dict:
    t0 = time.perf_counter()
    model = random_model(cfg, fmt, device)
    sync(device)
    log.info("%s: built in %.1f s", cfg.name, time.perf_counter() - t0)
    n = cfg.n_layers
    drafter_layers = {
        "layerskip": [i for i in range(n) if i % 2 == 0],
        "early_exit": list(range(max(1, n // 4))),
    }
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    out = {
        "model": cfg.name,
        "format": fmt,
        "dtype": str(model.dtype).removeprefix("torch."),
        "backend": model.backend,
        "n_layers": n,
        "early_exit_layers": len(drafter_layers["early_exit"]),
        "steps": step_times(model, ks, {k: drafter_layers[k] for k in kinds}),
        "plain": [],
        "speculative": [],
    }
    for graphs in graph_modes:
        out["plain"].append(
            plain_decode(model, prompt, args.new_tokens, args.repeats, graphs, copy_bw)
        )
    reference = out["plain"][0]["tokens"]
    for graphs in graph_modes:
        for kind in kinds:
            for k in ks:
                if budget.left() < 10:
                    log.warning("budget spent: skipping %s speculative k=%d", cfg.name, k)
                    out.setdefault("skipped", []).append(f"speculative {kind} k={k}")
                    continue
                rec = speculative(
                    model, prompt, reference, kind, k, args.alpha, args.repeats, graphs
                )
                rec["speedup"] = (
                    rec["decode_tokens_per_second"] / out["plain"][0]["decode_tokens_per_second"]
                )
                out["speculative"].append(rec)
    for p in out["plain"]:
        p.pop("tokens")
    graphs_for(model).drop()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_hf(cfg: ModelConfig, device: torch.device, n_new: int, repeats: int) -> dict:
    """HF LlamaForCausalLM of the same shape, bf16 (fp32 on CPU), random weights on the device:
    greedy decode rate from generate(n_new) - generate(1)."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    sync(device)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=gen).to(device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)

    def run(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        assert out.shape[1] == x.shape[1] + n
        return time.perf_counter() - t

    with torch.inference_mode():
        run(4)  # warm-up
        one = statistics.median(run(1) for _ in range(repeats))
        full = statistics.median(run(n_new) for _ in range(repeats))
    return {
        "model": cfg.name,
        "impl": f"transformers {transformers.__version__} LlamaForCausalLM.generate",
        "dtype": str(dtype).removeprefix("torch."),
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
    big, small = (LLAMA3_8B, SMOLLM2_135M) if cuda else (TINY_8B, TINY_SMOL)
    copy_bw = copy_bandwidth_gbps(device, (1 << 30) if cuda else (32 << 20))
    print(f"copy bandwidth: {copy_bw:.0f} GB/s (read + write)")
    result = {
        "gpu": gpu_name(),
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
        (big, "int4", big_ks, (True,), ("layerskip", "early_exit")),
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


# -- report -----------------------------------------------------------------------------------
def markdown_tables(e2e: dict) -> str:
    """Decode rates and step times as Markdown."""
    hf = {h["model"]: h for h in e2e.get("hf", [])}
    models = [m for m in e2e["models"] if "error" not in m]
    lines = [
        "| model | weights | decoding | CUDA graphs | tok/s | speedup | alpha | tokens/round "
        "| bytes/token | % copy BW |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        w = f"{m['format']} / {m['dtype']}"
        base = m["plain"][0]["decode_tokens_per_second"]
        for p in m["plain"]:
            lines.append(
                f"| {m['model']} | {w} | plain | {'on' if p['cuda_graphs'] else 'off'} | "
                f"{p['decode_tokens_per_second']:.1f} | {p['decode_tokens_per_second'] / base:.2f}x"
                f" | - | 1.00 | {p['bytes_per_token'] / 2**20:.0f} MiB | "
                f"{100 * p['fraction_of_copy_bandwidth']:.0f}% |"
            )
        for s in m["speculative"]:
            lines.append(
                f"| {m['model']} | {w} | {s['drafter']} k={s['k']} | "
                f"{'on' if s['cuda_graphs'] else 'off'} | {s['decode_tokens_per_second']:.1f} | "
                f"{s['decode_tokens_per_second'] / base:.2f}x | {s['alpha']:.2f} | "
                f"{s['mean_accepted_tokens']:.2f} | - | - |"
            )
        h = hf.get(m["model"])
        if h and "decode_tokens_per_second" in h:
            lines.append(
                f"| {m['model']} | HF {h['dtype']} | plain (transformers) | off | "
                f"{h['decode_tokens_per_second']:.1f} | "
                f"{h['decode_tokens_per_second'] / base:.2f}x | - | 1.00 | - | - |"
            )
    lines += [
        "",
        "| model | decode step ms (graph) | decode step ms (eager) | verify ms (T) | "
        "verify / decode | draft step ms |",
        "|---|---:|---:|---|---|---|",
    ]
    for m in models:
        st = m["steps"]
        ver = ", ".join(f"{v['ms']:.3f} ({v['T']})" for v in st["verify"])
        ratio = ", ".join(f"{v['ratio_to_decode']:.2f}x (T={v['T']})" for v in st["verify"])
        drafts = ", ".join(f"{k} {v:.3f}" for k, v in st["draft_step_ms"].items())
        lines.append(
            f"| {m['model']} | {st['decode_ms']:.3f} | {st['decode_eager_ms']:.3f} | {ver} | "
            f"{ratio} | {drafts} |"
        )
    return "\n".join(lines)


def readme_section(data: dict) -> str:
    e2e = data["e2e"]
    return "\n".join(
        [
            README_BEGIN,
            f"End-to-end decode, batch 1, greedy, random-weight models "
            f"(`python -m experiments.bench_e2e`): {data.get('gpu', e2e['gpu'])}, "
            f"{data.get('date', '?')}, commit {e2e.get('commit', '?')}. "
            f"Copy bandwidth {e2e['copy_bandwidth_gbps']:.0f} GB/s; speculative rows use "
            f"controlled acceptance (alpha target {e2e['alpha_target']}); speedups are over "
            "plain decoding with CUDA graphs.",
            "",
            markdown_tables(e2e),
            README_END,
        ]
    )


def update_readme(readme: Path, data: dict) -> None:
    """Replace the marked section of `readme` with the results' tables; without markers,
    insert it at the top of a "## Results" section, or append one."""
    text = readme.read_text() if readme.exists() else ""
    section = readme_section(data)
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + section + rest.split(README_END, 1)[1]
    elif "\n## Results\n" in text:
        head, rest = text.split("\n## Results\n", 1)
        text = f"{head}\n## Results\n\n{section}\n{rest}"
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "")
        text += "## Results\n\n" + section + "\n"
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs (CPU: tiny shapes)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    parser.add_argument("--alpha", type=float, default=0.8, help="controlled acceptance rate")
    parser.add_argument("--budget-s", type=float, default=170.0, help="skip sections past this")
    parser.add_argument("--readme", type=Path, default=None, help="results JSON -> README.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.readme is not None:
        update_readme(REPO / "README.md", json.loads(args.readme.read_text()))
        print(f"updated {REPO / 'README.md'} from {args.readme}")
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

    date = datetime.date.today().isoformat()
    out_dir = args.out if args.quick else (args.out or REPO / "benchmarks" / "results")
    path = None if out_dir is None else Path(out_dir) / f"{date}-{slug(gpu_name())}.json"
    commit = git_commit()

    def save(e2e: dict) -> None:
        if path is not None:
            update = {"gpu": gpu_name(), "date": date, "e2e": {**e2e, "commit": commit}}
            rate = headline(e2e)
            if rate is not None:
                update["e2e_decode_tokens_per_second"] = rate
            write_results(path, update)

    e2e = run(args, device, save)
    save(e2e)
    print(markdown_tables(e2e))
    big = e2e["models"][0]
    if "error" not in big:
        verify9 = [v["ratio_to_decode"] for v in big["steps"]["verify"] if v["T"] == 9]
        print(
            f"{big['model']} plain decode: {headline(e2e):.1f} tok/s (goal >= 400 on an H200)"
            + (f"; verify T=9 / decode: {verify9[0]:.2f}x (goal <= 1.3x)" if verify9 else "")
        )
    if path is not None:
        print(f"wrote {path}")
    failed = [r["model"] for r in e2e["models"] + e2e["hf"] if "error" in r]
    if failed:
        print(f"sections failed: {', '.join(failed)} (errors in the results file)")
    return 1 if failed else 0


def headline(e2e: dict) -> float | None:
    """The first model's (8B shape) plain decode rate with CUDA graphs, when measured."""
    models = e2e["models"]
    if not models or "error" in models[0] or not models[0]["plain"]:
        return None
    return models[0]["plain"][0]["decode_tokens_per_second"]


if __name__ == "__main__":
    sys.exit(main())
