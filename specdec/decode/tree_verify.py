"""One tree verification round: target forward over the flattened trees, acceptance,
KV compaction of the accepted path.

    res = verify_tree(target, cache, trees, "greedy")      # trees[b]: TokenTree, root =
                                                            # the pending token
    1. ONE target forward over tokens [B, T] (T = max nodes) at slots cache.lens[b] + i,
       RoPE positions cache.lens[b] + depth, tree mask = ancestors (both backends; the
       Triton verification attention takes T <= 64)
    2. a tree rule (specdec.decode.tree_accept) picks the accepted path and next token
    3. compact_kv moves the accepted nodes' K/V (all layers) to the slots right after the
       root, cache.lens[b] += 1 + n_accepted[b] for active sequences (the next token is
       pending); a ModelTreeDrafter with its own cache is compacted the same way.
    4. with `hidden_layers` (a drafter reading the target's features: the trained head),
       the forward also returns the residual stream there, and the result carries the
       features of the committed tokens (root + accepted path) for the next round.

The cache needs `tree_slack` free slots past the longest history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.decode.sampling import SamplingParams, logits_to_probs
from specdec.decode.tree import ModelTreeDrafter, TokenTree, flatten_trees
from specdec.decode.tree_accept import TREE_RULES, TreeAcceptResult
from specdec.kernels.argmax import argmax
from specdec.kernels.kv_rollback import compact_kv
from specdec.models.transformer import KVCache, Transformer

if TYPE_CHECKING:
    from specdec.decode.heads.drafter import HeadTreeScorer

LOSSY_TREE_RULES = ("threshold", "typical")


@dataclass
class TreeVerifyResult:
    paths: list[list[int]]  # accepted node indices per sequence (root excluded)
    tokens: list[list[int]]  # emitted per sequence: accepted nodes' tokens + next token
    n_accepted: list[int]  # accepted draft nodes per sequence
    next_token: torch.Tensor  # [B] the new pending token
    offered_per_depth: list[int]  # [D]: active sequences whose tree reached depth d + 1
    accepted_per_depth: list[int]  # [D]: active sequences that accepted a node at depth d + 1
    # with hidden_layers: the target's features of the root and the accepted path, in path
    # order (rows past 1 + n_accepted[b] are padding)
    features: torch.Tensor | None = None  # [B, 1 + max n_accepted, n, dim]


def _accept(rule, trees, logits, params, generator, rule_params) -> TreeAcceptResult:
    fn = TREE_RULES[rule]
    if rule == "greedy":
        return fn(trees, logits)
    if rule in LOSSY_TREE_RULES:
        # lossy tests read the model's distribution even when decoding greedily
        test = params if not params.greedy else SamplingParams(temperature=1.0)
        res = fn(trees, logits_to_probs(logits, test), generator, **rule_params)
        if params.greedy:  # the next token follows the decoding mode
            B = len(trees)
            rows = torch.tensor([p[-1] if p else 0 for p in res.paths], device=logits.device)
            res.next_token = argmax(logits[torch.arange(B, device=logits.device), rows])
        return res
    return fn(trees, logits_to_probs(logits, params), generator, **rule_params)


@torch.inference_mode()
def verify_tree(
    target: Transformer,
    cache: KVCache,
    trees: Sequence[TokenTree],
    rule: str = "greedy",
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    *,
    active: Sequence[bool] | None = None,
    drafter: ModelTreeDrafter | HeadTreeScorer | None = None,
    rule_params: dict | None = None,
    hidden_layers: Sequence[int] | None = None,
) -> TreeVerifyResult:
    """One round (module docstring). Inactive sequences are scored but keep their cache
    length. `rule`: a name in TREE_RULES; `rule_params` its keyword parameters;
    `hidden_layers`: the target layers whose features the drafter reads."""
    if rule not in TREE_RULES:
        raise ValueError(f"unknown tree acceptance rule {rule!r}; choose one of {list(TREE_RULES)}")
    B, dev = len(trees), target.device
    active = [True] * B if active is None else list(active)
    flat = flatten_trees(trees, cache.lens)
    kw = {} if hidden_layers is None else {"hidden_layers": hidden_layers}
    out = target(
        flat.tokens, cache, cache.lens, positions=flat.positions, tree_mask=flat.tree_mask, **kw
    )
    logits, hidden = out if hidden_layers is not None else (out, None)  # [B, T, V]
    res = _accept(rule, trees, logits, params, generator, rule_params or {})
    paths = [p if a else [] for p, a in zip(res.paths, active)]
    n_acc = torch.tensor([len(p) for p in paths], dtype=torch.long, device=dev)
    src = torch.zeros(B, max(1, int(n_acc.max())), dtype=torch.long, device=dev)
    for b, p in enumerate(paths):
        if p:
            src[b, : len(p)] = torch.tensor(p, dtype=torch.long, device=dev)
    features = None
    if hidden is not None:  # [B, T, n, dim] -> the root's row, then the accepted nodes'
        rows = torch.cat([torch.zeros_like(src[:, :1]), src], dim=1)
        features = hidden[torch.arange(B, device=dev)[:, None], rows]
    src += cache.lens[:, None]
    act = torch.tensor(active, device=dev)
    # the root stays at slot lens[b]; its accepted descendants follow it
    compact_kv(cache.k, cache.v, cache.lens + 1, src, n_acc, backend=target.backend)
    cache.lens = torch.where(act, cache.lens + 1 + n_acc, cache.lens)
    tokens = [
        [t.tokens[i] for i in p] + [n] for t, p, n in zip(trees, paths, res.next_token.tolist())
    ]
    if drafter is not None:
        drafter.commit([tok[:-1] for tok in tokens])
    D = max(t.depth for t in trees)
    offered = [sum(a and t.depth > d for t, a in zip(trees, active)) for d in range(D)]
    accepted = [sum(len(p) > d for p in paths) for d in range(D)]
    return TreeVerifyResult(
        paths, tokens, n_acc.tolist(), res.next_token, offered, accepted, features
    )
