"""What the end-to-end benchmarks run: random quantized models of the real shapes, the
controlled-acceptance drafters, decode-rate timing and the HF transformers baseline.

Random weights make a draft's own guesses meaningless, so the controlled drafters run their
real forwards (their real cost) but propose the target's greedy continuation, each token
kept with probability alpha and otherwise replaced: with greedy verification the drafts are
accepted i.i.d. with probability alpha, every cost is real, and the output must still equal
plain decoding.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness import MODEL_SHAPES, sync, time_ms
from specdec.decode.drafters import Draft, EarlyExitDrafter, LayerSkipDrafter
from specdec.kernels.quant import QuantizedWeight
from specdec.kernels.utils import cdiv
from specdec.models.builder import build_model
from specdec.models.config import ModelConfig
from specdec.models.cuda_graphs import graphs_for
from specdec.models.transformer import Transformer

# name -> (bits, group, has mins, QuantizedWeight.fmt); group None = one group per row
QUANT_FORMATS: dict[str, tuple[int, int | None, bool, str]] = {
    "q8_0": (8, 32, False, "q8_0"),
    "q4_0": (4, 32, False, "q4_0"),
    "q4_1": (4, 32, True, "q4_1"),
    "int4": (4, 128, True, "int4"),
    "int8": (8, None, False, "int8"),
}

# CPU smoke runs: the same code paths as MODEL_SHAPES' models, on tiny shapes
TINY_SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        "llama", 512, 128, 4, 4, 2, 256, max_seq_len=512, name="tiny-8b-like"
    ),
    "smollm2-135m": ModelConfig(
        "llama", 384, 64, 4, 4, 2, 128, max_seq_len=512, tie_embeddings=True, name="tiny-smol-like"
    ),
}


def shape(name: str, cuda: bool) -> ModelConfig:
    """MODEL_SHAPES[name] on CUDA, its tiny counterpart elsewhere."""
    return MODEL_SHAPES[name] if cuda else TINY_SHAPES[name]


# -- random quantized models ------------------------------------------------------------------
def random_weight(
    fmt: str, n: int, k: int, device: torch.device | str, gen: torch.Generator | None = None
) -> QuantizedWeight:
    """Random codes [n, k] in the QuantizedWeight layout, scaled so that x @ W.T keeps x's
    scale (jittered per group)."""
    bits, group, has_mins, name = QUANT_FORMATS[fmt]
    group = group or k
    k_pad = cdiv(k, group) * group
    jitter = 0.5 + torch.rand(n, k_pad // group, device=device, generator=gen)
    if bits == 8:  # w = d q, q uniform in [-127, 127]: E[q^2] ~ 127^2 / 3
        q = torch.randint(-127, 128, (n, k_pad), dtype=torch.int8, device=device, generator=gen)
        scales = (jitter / (5376.0 * k) ** 0.5).half()
        return QuantizedWeight(name, bits, group, (n, k), q, scales, None)
    # w = d q + m with m = -8 d (or w = d (q - 8)): E[(q - 8)^2] = 21.5 for q uniform in [0, 15]
    q = torch.randint(0, 256, (n, k_pad // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = (jitter / (21.5 * k) ** 0.5).half()
    mins = (-8.0 * scales.float()).half() if has_mins else None
    return QuantizedWeight(name, bits, group, (n, k), q, scales, mins)


def random_model(
    cfg: ModelConfig,
    fmt: str,
    device: torch.device | str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    on_host: bool = False,
) -> Transformer:
    """A Transformer of shape `cfg` with random `fmt` projections, drawn on `device`. Tied
    embedding / LM head: Q8_0; untied: a `dtype` embedding and an `fmt` LM head. Set up on
    `device` (bf16 + Triton on CUDA, fp32 + torch elsewhere unless given), or with
    on_host=True left on the CPU as a loader returns it (for streaming)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    d, kv = cfg.dim, cfg.kv_dim
    home = torch.device("cpu") if on_host else device

    def w(n: int, k: int, f: str = fmt) -> QuantizedWeight:
        return random_weight(f, n, k, device, gen).to(home)

    ones = torch.ones(d, device=home)
    projections = {
        "wq": (cfg.q_dim, d),
        "wk": (kv, d),
        "wv": (kv, d),
        "wo": (d, cfg.q_dim),
        "w_gate": (cfg.ffn_dim, d),
        "w_up": (cfg.ffn_dim, d),
        "w_down": (d, cfg.ffn_dim),
    }
    layers = [
        {**{name: w(*nk) for name, nk in projections.items()}, "attn_norm": ones, "ffn_norm": ones}
        for _ in range(cfg.n_layers)
    ]
    if cfg.qkv_bias:
        for layer in layers:
            for name, n in (("bq", cfg.q_dim), ("bk", kv), ("bv", kv)):
                layer[name] = 0.1 * torch.randn(n, device=device, generator=gen).to(home)
    if cfg.tie_embeddings:
        embed, head = w(cfg.vocab_size, d, "q8_0"), None
    else:
        embed = torch.randn(cfg.vocab_size, d, device=device, dtype=dtype, generator=gen).to(home)
        head = w(cfg.vocab_size, d)
    state = {"embed": embed, "norm": ones, "lm_head": head, "layers": layers}
    with torch.inference_mode():
        model = build_model(cfg, state)
        if on_host:
            return model.eval()
        model.setup(dtype, device, backend)
    return model.eval()


# -- timing -----------------------------------------------------------------------------------
def step_ms(
    model: Transformer,
    T: int = 1,
    *,
    graphs: bool = True,
    layers: list[int] | None = None,
    context: int = 128,
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
        return time_ms(fn, device=dev, warmup=1, repeats=3, budget_ms=(5, 20))


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
    """Mixin over a model drafter: runs its forwards, then proposes `reference` (the target's
    greedy continuation of the prompt), each token kept with probability alpha and otherwise
    replaced by another id. Every run proposes the same drafts. Batch 1."""

    def control(self, reference: list[int], prompt_len: int, alpha: float):
        self.reference, self.prompt_len, self.alpha = reference, prompt_len, alpha
        self.name = f"{self.name}_controlled"
        return self

    def begin(self, *args, **kwargs):
        super().begin(*args, **kwargs)
        self.rng = torch.Generator().manual_seed(0)

    def propose(self, request) -> Draft:
        draft = super().propose(request)
        emitted = len(request.history[0]) - self.prompt_len  # next token's index in `reference`
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


def draft_layers(kind: str, n_layers: int, exit_layer: int | None = None) -> list[int]:
    """The layers a layer-skip (every second layer) or early-exit (first quarter) draft runs."""
    if kind == "layerskip":
        return [i for i in range(n_layers) if i % 2 == 0]
    return list(range(exit_layer or max(1, n_layers // 4)))


def controlled_drafter(
    kind: str,
    model: Transformer,
    reference: list[int],
    prompt_len: int,
    alpha: float,
    *,
    exit_layer: int | None = None,
):
    """A controlled layer-skip ("layerskip": every second layer) or early-exit drafter (the
    first `exit_layer` layers, default a quarter)."""
    if kind == "layerskip":
        drafter = ControlledLayerSkip(model, "every2")
    else:
        drafter = ControlledEarlyExit(
            model, len(draft_layers(kind, model.config.n_layers, exit_layer))
        )
    return drafter.control(reference, prompt_len, alpha)


# -- the HF transformers baseline -------------------------------------------------------------
def hf_random_model(cfg: ModelConfig, device: torch.device | str):
    """HF's Llama / Qwen2 model of shape `cfg` with random weights, built on `device` in bf16
    (fp32 on CPU)."""
    import transformers

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[cfg.arch]
    hf_cfg = config_cls(
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
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_cls(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)


def hf_gguf_model(path, dtype: str, device: str = "cpu"):
    """HF transformers' model of a GGUF file, the usual dense HF baseline: newer transformers
    keep GGUF blocks packed by default (computing in fp32 and casting every matmul's input
    and output in bf16); this asks for the dequantized weights, in `dtype`."""
    import transformers

    kw = {}
    if hasattr(transformers, "GgufConfig"):
        kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype), **kw
    )
    return model.to(device).eval()


def hf_generate_s(model, x: torch.Tensor, n_new: int) -> tuple[float, list[int]]:
    """(seconds, new tokens) of one greedy HF `generate` of exactly n_new tokens after x [1, T]
    (EOS ignored), device-synchronised."""
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)
    with torch.inference_mode():
        sync(x.device)
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        sync(x.device)
        seconds = time.perf_counter() - t0
    if out.shape[1] != x.shape[1] + n_new:
        raise RuntimeError(f"HF generate made {out.shape[1] - x.shape[1]} tokens, not {n_new}")
    return seconds, out[0, x.shape[1] :].tolist()
