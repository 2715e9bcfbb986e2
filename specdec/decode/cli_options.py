"""Speculative-decoding options of `python -m specdec.generate` and the drafter factory
shared with the experiment runner."""

from __future__ import annotations

import argparse

from specdec.errors import SpecDecError


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--draft",
        default="none",
        help="none | layerskip | early-exit | ngram | <model name/path> (separate draft model)",
    )
    g.add_argument(
        "--k", type=int, default=4, help="tokens drafted per round (k_max for heuristic)"
    )
    g.add_argument("--accept", default="greedy", help="greedy | speculative | threshold | typical")
    g.add_argument(
        "--threshold", type=float, default=0.1, help="tau of threshold acceptance, in (0, 1]"
    )
    g.add_argument(
        "--typical-epsilon", type=float, default=None, help="epsilon of typical acceptance"
    )
    g.add_argument("--typical-delta", type=float, default=None, help="delta of typical acceptance")
    g.add_argument("--schedule", default="constant", help="constant | heuristic | confidence")
    g.add_argument("--k-max", type=int, default=0, help="upper bound for the heuristic schedule")
    g.add_argument("--p-min", type=float, default=0.5, help="confidence schedule: stop below this")
    g.add_argument("--skip", default="every2", help="layer skip set: every2 | every3 | '1,3,5'")
    g.add_argument("--exit-layer", type=int, default=None, help="early exit after this many layers")
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument(
        "--own-draft-cache",
        action="store_true",
        help="self-drafters keep their own KV cache instead of sharing the target's",
    )


def make_drafter(
    kind: str,
    target,
    *,
    skip="every2",
    exit_layer: int | None = None,
    ngram_max: int = 3,
    ngram_min: int = 1,
    share_cache: bool = True,
    draft_model=None,
):
    """kind: layerskip | early_exit (early-exit) | ngram | model (needs draft_model)."""
    from specdec.decode.drafters import (
        EarlyExitDrafter,
        LayerSkipDrafter,
        ModelDrafter,
        NgramDrafter,
    )

    kind = kind.replace("-", "_")
    if kind == "layerskip":
        return LayerSkipDrafter(target, skip, share_cache=share_cache)
    if kind == "early_exit":
        if exit_layer is None:
            exit_layer = max(1, target.config.n_layers // 4)
        return EarlyExitDrafter(target, exit_layer, share_cache=share_cache)
    if kind == "ngram":
        return NgramDrafter(ngram_max, ngram_min)
    if kind == "model":
        if draft_model is None:
            raise SpecDecError("a model drafter needs a draft model")
        return ModelDrafter(draft_model)
    raise SpecDecError(f"unknown drafter {kind!r}")


def accept_params(rule: str, threshold: float, epsilon=None, delta=None) -> dict:
    if rule == "threshold":
        if not 0.0 < threshold <= 1.0:
            raise SpecDecError(f"threshold must be in (0, 1], got {threshold}")
        return {"tau": threshold}
    if rule == "typical":
        return {k: v for k, v in (("epsilon", epsilon), ("delta", delta)) if v is not None}
    return {}


def build_speculative(args, model, tok):
    """-> SpeculativeDecoder, or None for --draft none."""
    if args.draft == "none":
        return None
    from specdec.decode.schedules import make_schedule
    from specdec.decode.speculative import SpeculativeDecoder
    from specdec.models.load import load_model

    if args.k < 1:
        raise SpecDecError(f"--k must be >= 1, got {args.k}")
    draft_model = None
    kind = args.draft
    if kind.replace("-", "_") not in ("layerskip", "early_exit", "ngram"):
        draft_model, draft_tok = load_model(kind, dtype=args.dtype, device=args.device)
        if (
            draft_tok.vocab_size != tok.vocab_size
            or draft_model.config.vocab_size != model.config.vocab_size
        ):
            raise SpecDecError(
                f"vocabulary mismatch: draft {kind!r} has {draft_model.config.vocab_size} tokens, "
                f"target has {model.config.vocab_size}"
            )
        kind = "model"
    drafter = make_drafter(
        kind,
        model,
        skip=args.skip,
        exit_layer=args.exit_layer,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        share_cache=not args.own_draft_cache,
        draft_model=draft_model,
    )
    schedule = make_schedule(args.schedule, args.k, args.k_max, args.p_min)
    params = accept_params(args.accept, args.threshold, args.typical_epsilon, args.typical_delta)
    return SpeculativeDecoder(
        model, drafter, args.accept, params, schedule, cuda_graphs=cuda_graphs_option(args)
    )


def cuda_graphs_option(args) -> bool | None:
    """--cuda-graphs auto|on|off -> None (on for CUDA models) | True | False."""
    return {"auto": None, "on": True, "off": False}[getattr(args, "cuda_graphs", "auto")]
