"""Speculative-decoding options of `python -m specdec.generate`.

Drafters and acceptance rules come from their registries (specdec.decode.drafters.DRAFTERS,
specdec.decode.acceptance.RULES): a new one is usable here without editing this module,
its parameters given as --draft-opt / --accept-opt KEY=VALUE. The named flags (--skip,
--exit-layer, --ngram-max, --threshold, ...) are shorthands for the built-in ones' options.
"""

from __future__ import annotations

import argparse

import yaml

from specdec.errors import SpecDecError

# named flag (argparse dest) -> drafter option; passed to every drafter that takes it
DRAFTER_FLAGS = {
    "skip": "skip",
    "exit_layer": "exit_layer",
    "ngram_max": "n_max",
    "ngram_min": "n_min",
}
# rule -> {named flag: rule parameter}
RULE_FLAGS = {
    "threshold": {"threshold": "tau"},
    "typical": {"typical_epsilon": "epsilon", "typical_delta": "delta"},
}


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    from specdec.decode.acceptance import RULES
    from specdec.decode.drafters import DRAFTERS

    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--draft",
        default="none",
        help=f"none | {' | '.join(n for n in DRAFTERS if n != 'model')} | head:DIR | "
        "<model name/path> (separate draft model)",
    )
    g.add_argument(
        "--k",
        type=int,
        default=4,
        help="tokens drafted per round, a tree's depth (k_max for heuristic)",
    )
    g.add_argument("--accept", default="greedy", help=" | ".join(RULES))
    g.add_argument(
        "--threshold", type=float, default=0.1, help="tau of threshold acceptance, in (0, 1]"
    )
    g.add_argument(
        "--typical-epsilon", type=float, default=None, help="epsilon of typical acceptance"
    )
    g.add_argument(
        "--typical-delta", type=float, default=0.3, help="delta of typical acceptance (0.3)"
    )
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
    g.add_argument(
        "--tree-topk", type=int, default=None, help="token trees: children per expanded node"
    )
    g.add_argument(
        "--tree-budget", type=int, default=None, help="token trees: draft nodes per round"
    )
    g.add_argument(
        "--tree-static",
        default=None,
        metavar="FILE",
        help="token trees of a fixed shape: a JSON list of parent indices (0 = the root)",
    )
    g.add_argument(
        "--draft-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the drafter's constructor (repeatable; VALUE is YAML)",
    )
    g.add_argument(
        "--accept-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of the acceptance rule (repeatable; VALUE is YAML)",
    )


def parse_options(pairs: list[str], flag: str) -> dict:
    """['key=value', ...] -> {key: YAML value}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecDecError(f"{flag} takes KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise SpecDecError(f"{flag} {pair!r}: the value is not valid YAML") from e
    return out


def build_drafter(args, model, tokenizer=None):
    """--draft NAME (registered) or a model name / path -> the drafter for `model` (whose
    tokenizer a draft model with another vocabulary drafts text for)."""
    import inspect

    from specdec.decode.drafters import DRAFTERS, ModelDrafter, build_drafter

    extra = parse_options(args.draft_opt, "--draft-opt")
    # NAME:VALUE sets the option a drafter names as its `cli_arg` (--draft head:DIR)
    name, sep, value = args.draft.partition(":")
    cls = DRAFTERS.get(name.replace("-", "_"))
    if cls is not None and sep and not getattr(cls, "cli_arg", None):
        raise SpecDecError(f"drafter {name!r} takes no NAME:VALUE argument")
    if cls is None or cls is ModelDrafter:  # a separate draft model, by name or path
        options = {"model": args.draft, "dtype": args.dtype, "device": args.device}
        return build_drafter(ModelDrafter, model, tokenizer, **{**options, **extra})
    takes = inspect.signature(cls).parameters
    options = {opt: getattr(args, flag) for flag, opt in DRAFTER_FLAGS.items() if opt in takes}
    if sep:
        options[cls.cli_arg] = value
    if "share_cache" in takes:
        options["share_cache"] = not args.own_draft_cache
    return build_drafter(cls, model, tokenizer, **{**options, **extra})


def build_rule(args):
    """--accept NAME with its flags and --accept-opt -> the acceptance rule."""
    from specdec.decode.acceptance import make_rule

    flags = RULE_FLAGS.get(args.accept, {})
    params = {p: getattr(args, f) for f, p in flags.items() if getattr(args, f) is not None}
    params.update(parse_options(args.accept_opt, "--accept-opt"))
    return make_rule(args.accept, **params)


def build_speculative(args, model, tokenizer=None):
    """-> SpeculativeDecoder, or None for --draft none; `tokenizer` is the target's."""
    if args.draft == "none":
        return None
    from specdec.decode.schedules import make_schedule
    from specdec.decode.speculative import SpeculativeDecoder

    if args.k < 1:
        raise SpecDecError(f"--k must be >= 1, got {args.k}")
    drafter = build_drafter(args, model, tokenizer)
    schedule = make_schedule(args.schedule, args.k, args.k_max, args.p_min)
    rule = build_rule(args)
    return SpeculativeDecoder(
        model,
        drafter,
        rule,
        schedule=schedule,
        cuda_graphs=cuda_graphs_option(args),
        tree=build_tree(args),
    )


def build_tree(args):
    """--tree-topk / --tree-budget / --tree-static -> TreeSpec, or None (chains); the
    depth is --k."""
    from specdec.decode.tree_round import make_tree_spec

    if args.tree_topk is None and args.tree_static is None:
        if args.tree_budget is not None:
            raise SpecDecError("--tree-budget needs --tree-topk or --tree-static")
        return None
    return make_tree_spec(args.tree_topk, args.tree_budget, args.tree_static)


def cuda_graphs_option(args) -> bool | None:
    """--cuda-graphs auto|on|off -> None (on for CUDA models) | True | False."""
    return {"auto": None, "on": True, "off": False}[getattr(args, "cuda_graphs", "auto")]
