"""The tree round of the speculative engine: draft a token tree per sequence, verify it in
one target forward, accept a root path.

    SpeculativeDecoder(target, drafter, rule, tree=TreeSpec(topk=2, budget=8))

replaces the chain round by `TreeRound.run`, which returns the same `RoundResult`: the
accepted path's tokens as the "drafts", its length as n_accepted and the tree's depth as
n_draft, so emission, stop tokens, max_new_tokens, the k schedule and the statistics are
the chain's. The schedule's k is the tree depth. Trees by drafter:

- a drafter with a model (ModelDrafter, LayerSkipDrafter, EarlyExitDrafter): scored by a
  `ModelTreeDrafter` over the same model / layers / cache sharing. Dynamic EAGLE-2 trees
  (`build_dynamic_trees`: topk children of the topk best nodes per depth, the `budget`
  most probable nodes kept), or, with `static_parents`, that fixed shape
  (`build_static_trees`; under sampling its children are drawn without replacement from
  the drafter's processed distribution q, which the lossless rule uses)
- HeadDrafter (the trained head): scored by a `HeadTreeScorer` (specdec.decode.heads.
  drafter) with the same builders; the verification forward also returns the target's
  features of the accepted path, handed to the head next round as in the chain round
- NgramDrafter: a trie of the distinct continuations of the matched suffix
  (`build_ngram_trees`, at most `budget` nodes); DatastoreDrafter, a subclass: that trie
  when the history's match is long enough, else the datastore's most frequent
  continuations (`NgramDrafter.build_trees`)

Acceptance is the tree rule of the chain rule's name (specdec.decode.tree_accept) with the
same parameters; greedy and speculative are lossless. The tree forward runs eagerly (no
CUDA-graph replay: its width and mask change every round), and the confidence schedule's
p_min does not cut trees (the budget does).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.decode.acceptance import AcceptanceRule
from specdec.decode.drafters import Drafter, ForwardDrafter, NgramDrafter
from specdec.decode.heads.drafter import HeadDrafter, HeadTreeScorer
from specdec.decode.tree import (
    ModelTreeDrafter,
    TokenTree,
    build_dynamic_trees,
    build_static_trees,
    check_static_tree,
    read_static_tree,
    tree_slack,
)
from specdec.decode.tree_accept import TREE_RULES
from specdec.decode.tree_verify import verify_tree
from specdec.errors import SpecDecError
from specdec.kernels.verify_attention import MAX_TREE_TOKENS
from specdec.models.transformer import KVCache, Transformer

if TYPE_CHECKING:
    from specdec.decode.speculative import DecodeState, RoundResult
    from specdec.decode.stats import SpecStats


@dataclass(frozen=True)
class TreeSpec:
    """topk: children per expanded node; budget: tree nodes besides the root (the
    verification width is at most budget + 1); static_parents: a fixed shape instead of
    the dynamic tree (entry i = parent of node i + 1, 0 = the root; see check_static_tree)."""

    topk: int = 2
    budget: int = 8
    static_parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.topk < 1 or self.budget < 1:
            raise SpecDecError(
                f"tree topk and budget must be >= 1, got topk={self.topk}, budget={self.budget}"
            )
        if self.budget + 1 > MAX_TREE_TOKENS:
            raise SpecDecError(f"tree budget must be <= {MAX_TREE_TOKENS - 1}, got {self.budget}")
        if self.static_parents is not None:
            object.__setattr__(
                self, "static_parents", tuple(check_static_tree(self.static_parents))
            )

    def slack(self, depth: int) -> int:
        """Cache slots past the history one round of depth `depth` may write."""
        nodes = self.budget if self.static_parents is None else len(self.static_parents)
        return tree_slack(depth, self.topk, nodes)

    def describe(self) -> dict:
        return {
            "topk": self.topk,
            "budget": self.budget,
            "static": None if self.static_parents is None else list(self.static_parents),
        }


def make_tree_spec(
    topk: int | None = None, budget: int | None = None, static: str | list[int] | None = None
) -> TreeSpec | None:
    """The config / CLI form: None (chains) without topk and static; `static` is a JSON
    file of parent indices or the list itself; budget defaults to the static tree's nodes
    (else 8), topk to 2."""
    if topk is None and static is None:
        return None
    if isinstance(static, str):
        static = read_static_tree(static)
    if budget is None:
        budget = 8 if static is None else len(static)
    parents = None if static is None else tuple(int(p) for p in static)
    return TreeSpec(2 if topk is None else int(topk), int(budget), parents)


class TreeRound:
    """One tree round per call of `run`, for the engine's drafter and rule."""

    def __init__(self, spec: TreeSpec, target: Transformer, drafter: Drafter, rule: AcceptanceRule):
        if rule.name not in TREE_RULES:
            raise SpecDecError(
                f"acceptance rule {rule.name!r} has no tree form; choose one of {list(TREE_RULES)}"
            )
        if drafter.chains_only:
            raise SpecDecError(
                f"drafter {drafter.name!r} drafts chains only; for token trees use "
                "draft=head or draft=ngram"
            )
        if isinstance(drafter, NgramDrafter):
            if spec.static_parents is not None:
                raise SpecDecError("a static tree needs a drafter with a model, not n-gram lookup")
            self.scorer = None
        elif isinstance(drafter, ForwardDrafter):
            self.scorer = ModelTreeDrafter(drafter.model, drafter.layers, drafter.share_cache)
        elif isinstance(drafter, HeadDrafter):
            self.scorer = HeadTreeScorer(drafter)
        else:
            raise SpecDecError(
                f"drafter {drafter.name!r} cannot draft token trees "
                "(tree drafters: n-gram, layer skip, early exit, a separate draft model, head)"
            )
        self.spec, self.target, self.drafter, self.rule = spec, target, drafter, rule

    def begin(self, target_cache: KVCache, batch: int, max_len: int) -> None:
        if self.scorer is not None:
            self.scorer.forwards = 0
            self.scorer.begin(target_cache, batch, max_len)

    def build(self, state: DecodeState, depths: list[int]) -> list[TokenTree]:
        spec, roots = self.spec, [h[-1] for h in state.history]
        if self.scorer is None:
            return self.drafter.build_trees(state.history, depths, spec.budget)
        if isinstance(self.scorer, HeadTreeScorer):
            self.scorer.start(state.history, state.features, state.n_features)
        else:
            self.scorer.start(state.history)
        if spec.static_parents is None:
            return build_dynamic_trees(roots, self.scorer.score, depths, spec.topk, spec.budget)
        params = state.params
        return build_static_trees(
            roots,
            self.scorer.score,
            spec.static_parents,
            depths,
            sample=not params.greedy,
            params=params,
            generator=state.generator,
        )

    def run(
        self,
        state: DecodeState,
        k: torch.Tensor,
        stats: SpecStats,
        timed: Callable[[SpecStats, str], AbstractContextManager],
    ) -> RoundResult:
        """Build -> verify_tree -> RoundResult, for trees at most k[b] deep; timed(stats,
        key) is the engine's timer."""
        from specdec.decode.speculative import RoundResult

        with timed(stats, "draft"):
            forwards = 0 if self.scorer is None else self.scorer.forwards
            trees = self.build(state, k.tolist())
            if self.scorer is not None:
                stats.draft_forwards += self.scorer.forwards - forwards
        with timed(stats, "verify"):
            res = verify_tree(
                self.target,
                state.cache,
                trees,
                self.rule.name,
                state.params,
                state.generator,
                active=state.active,
                drafter=self.scorer,
                rule_params=self.rule.params(),
                hidden_layers=self.drafter.target_features or None,
            )
        stats.target_forwards += 1
        dev = k.device
        if res.features is not None:  # the committed tokens' features, as the chain round
            state.features = res.features
            act = torch.tensor(state.active, device=dev)
            state.n_features = torch.where(act, 1 + torch.tensor(res.n_accepted, device=dev), 0)
        B = len(trees)
        drafts = torch.zeros(B, max(1, max(res.n_accepted)), dtype=torch.long, device=dev)
        for b, toks in enumerate(res.tokens):
            if len(toks) > 1:
                drafts[b, : len(toks) - 1] = torch.tensor(toks[:-1], device=dev)
        stats.record_verify(max(len(t) for t in trees))
        stats.record_tree([len(t) - 1 for t, a in zip(trees, state.active) if a])
        depth = torch.tensor([t.depth for t in trees], dtype=torch.long, device=dev)
        n_acc = torch.tensor(res.n_accepted, dtype=torch.long, device=dev)
        return RoundResult(drafts, depth, n_acc, res.next_token.to(dev))
