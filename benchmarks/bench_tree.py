"""Chains vs token trees at equal verification width: mean accepted tokens per round.

    python -m benchmarks.bench_tree [--model smollm2-135m] [--max-new-tokens 48]
        [--widths 5,9,17] [--prompts 4] [--drafters layerskip,early_exit,ngram,head]

For each drafter (layer skip, early exit, n-gram, the shipped trained head where one
matches the model) and each width T (tokens in the target's
verification forward), greedy decoding through SpeculativeDecoder with chain rounds of
k = T - 1 drafts and with tree rounds (TreeSpec(topk, budget=T - 1), an EAGLE-2 tree or an
n-gram trie); reports mean accepted tokens per round (the bonus token included), the tree
/ chain ratio and the measured mean verification widths (a round's T is the widest
sequence's; rounds end early near max_new_tokens). Drafting cost differs (a tree round's
draft forwards score up to topk nodes per depth): this measures acceptance only.
"""

from __future__ import annotations

import argparse

from benchmarks.harness import environment, markdown_table, save_results
from specdec.decode.drafters import EarlyExitDrafter, LayerSkipDrafter, NgramDrafter
from specdec.decode.heads.drafter import HeadDrafter, find_head
from specdec.decode.schedules import ConstantSchedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree_round import TreeSpec
from specdec.errors import SpecDecError
from specdec.models.load import load_model

PROMPTS = [
    "The history of the printing press begins",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here are three tips for staying focused while studying:\n1.",
    "Translate to French: The weather is nice today, so we will walk to the market.",
]
# width T -> (depth, topk) of the tree with T - 1 nodes
TREES = {5: (4, 2), 9: (6, 3), 17: (8, 4)}


def mean_accepted(model, drafter, prompts, max_new, depth, tree) -> tuple[float, float]:
    """Greedy decoding through SpeculativeDecoder (a chain round when tree is None) ->
    (mean tokens emitted per round, mean verification width)."""
    dec = SpeculativeDecoder(
        model, drafter, "greedy", schedule=ConstantSchedule(depth), tree=tree, cuda_graphs=False
    )
    st = dec.generate(prompts, max_new).stats
    return st["mean_accepted_tokens"], st["mean_verify_width"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip", default="every2", help="layer skip: skip layers 1, 3, 5, ...")
    ap.add_argument("--exit-layer", type=int, default=15)
    ap.add_argument("--widths", default="5,9,17")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("--drafters", default="layerskip,early_exit,ngram,head")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    drafters = {
        f"layerskip-{args.skip}": lambda: LayerSkipDrafter(model, args.skip),
        f"early_exit-{args.exit_layer}": lambda: EarlyExitDrafter(model, args.exit_layer),
        "ngram": lambda: NgramDrafter(),
        "head": lambda: HeadDrafter(model),
    }
    wanted = args.drafters.split(",")
    drafters = {k: v for k, v in drafters.items() if k.split("-")[0] in wanted}
    if "head" in drafters:
        try:
            find_head(model)
        except SpecDecError as e:
            print(f"head: skipped ({e})")
            del drafters["head"]
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    records, n_new = [], args.max_new_tokens
    for name, make in drafters.items():
        for T in (int(w) for w in args.widths.split(",")):
            depth, topk = TREES[T]
            chain, chain_w = mean_accepted(model, make(), prompts, n_new, T - 1, None)
            spec = TreeSpec(topk, T - 1)
            tree, tree_w = mean_accepted(model, make(), prompts, n_new, depth, spec)
            records.append(
                dict(
                    drafter=name,
                    T=T,
                    depth=depth,
                    topk=topk,
                    chain=chain,
                    tree=tree,
                    ratio=tree / chain,
                    chain_width=chain_w,
                    tree_width=tree_w,
                )
            )
    save_results("tree", records, env=environment(model.device))
    cols = [
        ("drafter", "drafter", ""),
        ("T", "T", "d"),
        ("depth", "tree depth", "d"),
        ("topk", "topk", "d"),
        ("chain", "chain", ".2f"),
        ("tree", "tree", ".2f"),
        ("ratio", "tree / chain", ".2f"),
        ("chain_width", "chain mean T", ".1f"),
        ("tree_width", "tree mean T", ".1f"),
    ]
    print(markdown_table(records, cols))


if __name__ == "__main__":
    main()
