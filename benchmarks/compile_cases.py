"""The cases `benchmarks.compile_check` compiles: each runs one launcher on meta tensors for a
real model shape (SmolLM2-135M, Qwen2.5-0.5B, Llama-3-8B), so the launch configuration is the
one the launcher itself picks. GEMV cases come from every registered weight format
(`specdec.kernels.utils.WEIGHT_FORMATS`): a new kernel file joins by registering its formats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from benchmarks.harness import MODEL_SHAPES
from specdec.models.config import ModelConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
META = torch.device("meta")


@dataclass(frozen=True)
class Case:
    """One launcher call: `run()` drives the launcher on meta tensors."""

    kernel: str  # gemv | attention | rollback | rejection | invariant
    label: str
    dtype: str
    run: Callable[[], object]
    fmt: str | None = None  # weight format (GEMV)
    bytes_per_weight: float | None = None  # GEMV: packed bytes (codes, scales...) per weight


# ---------------------------------------------------------------------------------------
# the cases: real model shapes through the real launchers


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every linear layer of a model."""
    hd = cfg.dim // cfg.n_heads
    return {
        "qkv": ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim),
        "o": (cfg.dim, cfg.n_heads * hd),
        "gate_up": (2 * cfg.ffn_dim, cfg.dim),
        "down": (cfg.dim, cfg.ffn_dim),
        "lm_head": (cfg.vocab_size, cfg.dim),
    }


def bytes_per_weight(w, n: int, k: int) -> float | None:
    """Packed bytes (codes, scales, ...) per weight of an n x k packed weight."""
    return w.nbytes() / (n * k) if hasattr(w, "nbytes") else None


def gemv_cases(models: list[str], quick: bool, formats: list[str] | None) -> Iterator[Case]:
    from specdec.kernels.utils import WEIGHT_FORMATS

    rows = [1, 16] if quick else list(range(1, 17)) + [64]  # 64: the prefill path
    dtypes = ["bf16"] if quick else list(DTYPES)
    for model in models:
        all_shapes = linear_shapes(MODEL_SHAPES[model])
        for i, fmt in enumerate(WEIGHT_FORMATS.values()):
            if formats and fmt.name not in formats:
                continue
            # layers whose in_features the format can hold (quick: the first of them)
            shapes = {lay: nk for lay, nk in all_shapes.items() if nk[1] % fmt.k_multiple == 0}
            if quick:
                shapes = dict(list(shapes.items())[:1])
            for layer, (n, k) in shapes.items():
                w = fmt.make_weight(n, k, META)
                bpw = bytes_per_weight(w, n, k)
                for dt in dtypes:
                    # quick: the formats take turns on the M = 1 and the tl.dot (M = 16) path
                    for m in [rows[i % 2]] if quick else rows:
                        x = torch.empty(m, k, dtype=DTYPES[dt], device=META)
                        bias = torch.empty(n, dtype=DTYPES[dt], device=META)

                        def run(fmt=fmt, x=x, w=w, bias=bias):
                            return fmt.linear(x, w, bias)

                        label = f"{model} {layer} {fmt.name} M={m}"
                        yield Case("gemv", label, dt, run, fmt.name, bpw)


def attention_cases(models: list[str], quick: bool) -> Iterator[Case]:
    from specdec.kernels.verify_attention import MAX_TREE_TOKENS, verify_attention

    widths = [5] if quick else [1, 2, 3, 5, 9, 17, 26, 33, 65]  # chains and trees
    lengths = [4096] if quick else [512, 4096, 32768]
    dtypes = ["bf16"] if quick else list(DTYPES)
    for model in models:
        cfg = MODEL_SHAPES[model]
        hd = cfg.dim // cfg.n_heads
        for dt in dtypes:
            for batch in [1] if quick else [1, 8]:
                for t in widths:
                    for L in lengths:
                        trees = [False, True] if 1 < t <= MAX_TREE_TOKENS and not quick else [False]
                        for tree in trees:
                            dtype = DTYPES[dt]
                            q = torch.empty(batch, t, cfg.n_heads, hd, dtype=dtype, device=META)
                            kv = torch.empty(
                                batch, cfg.n_kv_heads, L + t, hd, dtype=dtype, device=META
                            )
                            lens = torch.empty(batch, dtype=torch.int32, device=META)
                            mask = torch.empty(batch, t, dtype=torch.int64, device=META)

                            def run(q=q, kv=kv, lens=lens, mask=mask if tree else None):
                                return verify_attention(
                                    q, kv, kv, lens, tree_mask=mask, backend="triton"
                                )

                            kind = "tree" if tree else "chain"
                            label = f"{model} B={batch} T={t} L={L} {kind}"
                            yield Case("attention", label, dt, run)


def rollback_cases(models: list[str], quick: bool) -> Iterator[Case]:
    from specdec.kernels.kv_rollback import compact_kv

    for model in models:
        cfg = MODEL_SHAPES[model]
        hd = cfg.dim // cfg.n_heads
        for dt in ["bf16"] if quick else list(DTYPES):
            for a in [8] if quick else [1, 4, 8, 16, 64]:
                kv = torch.empty(
                    cfg.n_layers, 8, cfg.n_kv_heads, 4096, hd, dtype=DTYPES[dt], device=META
                )
                src = torch.empty(8, a, dtype=torch.int64, device=META)
                lens = torch.empty(8, dtype=torch.int64, device=META)

                def run(kv=kv, src=src, lens=lens):
                    return compact_kv(kv, kv, lens, src, lens, backend="triton")

                yield Case("rollback", f"{model} B=8 A={a}", dt, run)


def rejection_cases(models: list[str], quick: bool) -> Iterator[Case]:
    from specdec.kernels.rejection_sampling import rejection_sample_triton

    for model in models:
        vocab = MODEL_SHAPES[model].vocab_size
        for k in [4] if quick else [1, 4, 8, 16]:
            p = torch.empty(8, k + 1, vocab, device=META)
            q = torch.empty(8, k, vocab, device=META)
            drafts = torch.empty(8, k, dtype=torch.int64, device=META)
            u, race = torch.empty(8, k, device=META), torch.empty(8, vocab, device=META)
            variants = [("greedy", True, False), ("sampled", False, True)]
            if not quick:
                variants.append(("sampled q=None", False, False))
            for name, greedy, with_q in variants:

                def run(greedy=greedy, q=q if with_q else None, p=p, drafts=drafts, u=u, r=race):
                    return rejection_sample_triton(
                        drafts, p, q, greedy=greedy, uniforms=u, race_weights=r
                    )

                yield Case("rejection", f"{model} k={k} {name}", "fp32", run)


def invariant_cases(models: list[str], quick: bool) -> Iterator[Case]:
    """The launches of a batch-invariant forward (`specdec.models.batch_invariant`, Triton):
    attention with fixed splits, GEMV rows on the invariant plan ($SPECDEC_INVARIANT_GEMV,
    default "dot": 16-bit rows of every M through tl.dot tiles planned for 16 rows; M = 21:
    calls of 16 and 5), the per-row RMSNorm."""
    from specdec.kernels.rms_norm import rms_norm_rows
    from specdec.kernels.utils import WEIGHT_FORMATS, rows_as_one
    from specdec.kernels.verify_attention import verify_attention

    dtypes = ["bf16"] if quick else list(DTYPES)
    for model in models:
        cfg = MODEL_SHAPES[model]
        hd = cfg.dim // cfg.n_heads
        for dt in dtypes:
            dtype = DTYPES[dt]
            for t in [5] if quick else [1, 5, 9, 17]:
                q = torch.empty(1, t, cfg.n_heads, hd, dtype=dtype, device=META)
                kv = torch.empty(1, cfg.n_kv_heads, 4096 + t, hd, dtype=dtype, device=META)
                lens = torch.empty(1, dtype=torch.int32, device=META)

                def run(q=q, kv=kv, lens=lens):
                    return verify_attention(q, kv, kv, lens, backend="triton", invariant=True)

                yield Case("invariant", f"{model} attention B=1 T={t} L=4096", dt, run)
            n, k = linear_shapes(cfg)["down"]
            for name in ["int4-g128"] if quick else ["int4-g128", "q4_1", "q8_0"]:
                fmt = WEIGHT_FORMATS[name]
                w = fmt.make_weight(n, k, META)
                bpw = bytes_per_weight(w, n, k)
                for m in [1, 5] if quick else [1, 5, 16, 21]:
                    x = torch.empty(m, k, dtype=dtype, device=META)

                    def run(fmt=fmt, x=x, w=w):
                        with rows_as_one():
                            return fmt.linear(x, w, None)

                    label = f"{model} down {name} M={m} rows as one"
                    yield Case("invariant", label, dt, run, name, bpw)
            x = torch.empty(5, cfg.dim, dtype=torch.float32, device=META)
            w = torch.empty(cfg.dim, dtype=torch.float32, device=META)

            def run(x=x, w=w, dtype=dtype):
                return rms_norm_rows(x, w, 1e-5, dtype, backend="triton")

            yield Case("invariant", f"{model} rms_norm rows={cfg.dim}", dt, run)


CASES = {
    "gemv": gemv_cases,
    "attention": attention_cases,
    "rollback": rollback_cases,
    "rejection": rejection_cases,
    "invariant": invariant_cases,
}
