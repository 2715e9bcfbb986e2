"""Chains vs token trees at equal verification width: mean accepted tokens per round.

    python -m benchmarks.bench_tree [--model smollm2-135m] [--max-new-tokens 48]
        [--widths 5,9,17] [--prompts 4] [--drafters layerskip,early_exit]

For each self-drafter (layer skip, early exit) and each width T (tokens in the target's
verification forward), greedy decoding with a chain of T - 1 drafts (EAGLE-2 builder with
topk 1) and with an EAGLE-2 tree of T - 1 nodes; reports mean accepted tokens per round
(the bonus token included) and the tree / chain ratio. Drafting cost differs (a tree
round's draft forwards score up to topk nodes per depth): this measures acceptance only.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import environment, markdown_table, save_results
from specdec.decode.generation import check_prompts, prefill
from specdec.decode.tree import ModelTreeDrafter, build_dynamic_trees, tree_slack
from specdec.decode.tree_verify import verify_tree
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

PROMPTS = [
    "The history of the printing press begins",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here are three tips for staying focused while studying:\n1.",
    "Translate to French: The weather is nice today, so we will walk to the market.",
]
# width T -> (depth, topk) of the tree with T - 1 nodes
TREES = {5: (4, 2), 9: (6, 3), 17: (8, 4)}


@torch.inference_mode()
def mean_accepted(model, drafter, prompts, max_new, depth, topk, budget) -> float:
    """Greedy rounds until every sequence has max_new tokens: mean emitted per round."""
    max_len = check_prompts(model, prompts, max_new, slack=tree_slack(depth, topk, budget))
    B = len(prompts)
    cache = KVCache.for_model(model, B, max_len)
    pending = prefill(model, prompts, cache).argmax(-1).tolist()
    history = [list(p) + [t] for p, t in zip(prompts, pending)]
    done = [1] * B
    drafter.begin(cache, B, max_len)
    rounds = emitted = 0
    while min(done) < max_new:
        active = [d < max_new for d in done]
        depths = [min(depth, max_new - d - 1) if a else 0 for d, a in zip(done, active)]
        drafter.start(history)
        roots = [h[-1] for h in history]
        trees = build_dynamic_trees(roots, drafter.score, depths, topk, budget)
        res = verify_tree(model, cache, trees, "greedy", active=active, drafter=drafter)
        for b in range(B):
            if active[b]:
                history[b] += res.tokens[b]
                done[b] += len(res.tokens[b])
                rounds += 1
                emitted += len(res.tokens[b])
    return emitted / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip", default="every2", help="layer skip: skip layers 1, 3, 5, ...")
    ap.add_argument("--exit-layer", type=int, default=15)
    ap.add_argument("--widths", default="5,9,17")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("--drafters", default="layerskip,early_exit")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    n = model.config.n_layers
    step = int(args.skip.removeprefix("every"))
    drafters = {
        f"layerskip-{args.skip}": lambda: ModelTreeDrafter(
            model, [i for i in range(n) if i % step != step - 1], share_cache=True
        ),
        f"early_exit-{args.exit_layer}": lambda: ModelTreeDrafter(
            model, range(args.exit_layer), share_cache=True
        ),
    }
    wanted = args.drafters.split(",")
    drafters = {k: v for k, v in drafters.items() if k.split("-")[0] in wanted}
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    records = []
    for name, make in drafters.items():
        for T in (int(w) for w in args.widths.split(",")):
            depth, topk = TREES[T]
            chain = mean_accepted(model, make(), prompts, args.max_new_tokens, T - 1, 1, T - 1)
            tree = mean_accepted(model, make(), prompts, args.max_new_tokens, depth, topk, T - 1)
            records.append(
                dict(
                    drafter=name,
                    T=T,
                    depth=depth,
                    topk=topk,
                    chain=chain,
                    tree=tree,
                    ratio=tree / chain,
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
    ]
    print(markdown_table(records, cols))


if __name__ == "__main__":
    main()
