"""Acceptance on token trees: which root path to keep and what comes after it.

Every rule has one signature,

    rule(trees, p, generator=None, **params) -> TreeAcceptResult

with trees[b] a `TokenTree` and p [B, T, V] the target's processed probabilities at every
flattened node (row i: the distribution of the token after node i; rows past the tree
are padding). Sequence b emits the tokens of the nodes paths[b] then next_token[b].

    greedy       accept the child whose token is argmax p at each node; next = that argmax
    speculative  lossless (SpecInfer; Miao et al. 2023): at a node with residual target r
                 (initially p) try the children in order: accept child x with probability
                 min(1, r(x) / q(x)), else r <- norm(max(0, r - q)) and, for children drawn
                 without replacement, q <- q without x, renormalised. If every child fails,
                 next ~ r. q is TokenTree.q[node] when the children were drawn from it
                 (build_static_trees(sample=True)); otherwise the children are deterministic
                 candidates (top-k, n-gram) and q is one-hot on each: accept with
                 probability r(x), else r <- r without x. Either way the emitted tokens
                 follow p exactly.
    threshold    lossy: a child passes if p(x) >= tau * max p
    typical      lossy (Medusa): a child passes if p(x) > min(epsilon, delta * exp(-H(p)))
                 The lossy rules keep the deepest root path of passing nodes (ties: the
                 larger product of target probabilities) and sample next from p there.

The walk is sequential per sequence (host loop over the accepted path): trees are small.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.decode.sampling import sample
from specdec.decode.tree import TokenTree
from specdec.kernels.argmax import argmax


@dataclass
class TreeAcceptResult:
    paths: list[list[int]]  # accepted node indices per sequence, root excluded, root-first
    next_token: torch.Tensor  # [B] int64

    @property
    def n_accepted(self) -> list[int]:
        return [len(p) for p in self.paths]

    def emitted(self, trees: Sequence[TokenTree]) -> list[list[int]]:
        """Per sequence: the accepted nodes' tokens, then the next token."""
        nxt = self.next_token.tolist()
        return [[t.tokens[i] for i in path] + [n] for t, path, n in zip(trees, self.paths, nxt)]


TreeRule = Callable[..., TreeAcceptResult]
TREE_RULES: dict[str, TreeRule] = {}


def register_tree_rule(name: str) -> Callable[[TreeRule], TreeRule]:
    def register(fn: TreeRule) -> TreeRule:
        TREE_RULES[name] = fn
        return fn

    return register


@register_tree_rule("greedy")
def accept_tree_greedy(
    trees: Sequence[TokenTree], p: torch.Tensor, generator: torch.Generator | None = None
) -> TreeAcceptResult:
    """The longest root path whose tokens equal argmax p at each step (p may be logits)."""
    best = argmax(p).tolist()  # [B, T]: one host sync
    paths, nxt = [], []
    for b, t in enumerate(trees):
        node, path = 0, []
        while True:
            hit = [c for c in t.children[node] if t.tokens[c] == best[b][node]]
            if not hit:
                break
            node = hit[0]
            path.append(node)
        paths.append(path)
        nxt.append(best[b][node])
    return TreeAcceptResult(paths, torch.tensor(nxt, dtype=torch.long, device=p.device))


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target's distribution given a rejection: norm(max(0, r - q))."""
    res = torch.clamp(r - q, min=0.0)
    total = res.sum()
    # total == 0 only if r == q, where the child was accepted with probability 1
    return res / total if total > 0 else r


def _without(q: torch.Tensor, x: int) -> torch.Tensor:
    """The distribution of the next draw without replacement after x was drawn from q."""
    q = q.clone()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


@register_tree_rule("speculative")
def accept_tree_speculative(
    trees: Sequence[TokenTree], p: torch.Tensor, generator: torch.Generator | None = None
) -> TreeAcceptResult:
    """Recursive rejection sampling over siblings (module docstring): lossless."""
    paths, nxt = [], []
    for b, t in enumerate(trees):
        node, path = 0, []
        while True:
            r = p[b, node].double()
            q = None if t.q is None else t.q[node].to(r)
            moved = False
            for c in t.children[node]:
                x = t.tokens[c]
                qx = 1.0 if q is None else float(q[x])
                if _uniform(generator, p.device) * qx < float(r[x]):
                    node, moved = c, True
                    break
                if q is None:  # norm(max(0, r - onehot(x))) = r without x
                    r = _without(r, x)
                else:
                    r = _residual(r, q)
                    q = _without(q, x)
            if not moved:
                break
            path.append(node)
        paths.append(path)
        nxt.append(int(sample(r.float(), generator)))
    return TreeAcceptResult(paths, torch.tensor(nxt, dtype=torch.long, device=p.device))


def _accept_passing(
    trees: Sequence[TokenTree],
    p: torch.Tensor,
    passes: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeAcceptResult:
    """passes [B, T, V] bool: the deepest root path of passing nodes (ties: the larger
    product of p along it); next ~ p at its end."""
    ok, lp = passes.tolist(), p.clamp_min(1e-30).log().tolist()
    paths, rows = [], []
    for b, t in enumerate(trees):
        score = [(0, 0.0)] + [(-1, -math.inf)] * (len(t) - 1)  # (depth, log prob) if reached
        for i in range(1, len(t)):
            par = t.parents[i]
            if score[par][0] >= 0 and ok[b][par][t.tokens[i]]:
                score[i] = (score[par][0] + 1, score[par][1] + lp[b][par][t.tokens[i]])
        end = max(range(len(t)), key=lambda i: (score[i], -i))
        paths.append(t.path(end))
        rows.append(end)
    B = len(trees)
    nxt = sample(
        p[torch.arange(B, device=p.device), torch.tensor(rows, device=p.device)], generator
    )
    return TreeAcceptResult(paths, nxt)


@register_tree_rule("threshold")
def accept_tree_threshold(
    trees: Sequence[TokenTree],
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    tau: float = 0.3,
) -> TreeAcceptResult:
    """Lossy: a child x of node i passes if p_i(x) >= tau * max p_i."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"threshold acceptance needs tau in (0, 1], got {tau}")
    return _accept_passing(trees, p, p >= tau * p.amax(-1, keepdim=True), generator)


@register_tree_rule("typical")
def accept_tree_typical(
    trees: Sequence[TokenTree],
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> TreeAcceptResult:
    """Lossy typical acceptance (Medusa): x passes if p(x) > min(epsilon, delta exp(-H(p)))."""
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"typical acceptance needs epsilon in (0, 1], got {epsilon}")
    if delta <= 0.0:
        raise ValueError(f"typical acceptance needs delta > 0, got {delta}")
    entropy = -torch.special.xlogy(p, p).sum(-1, keepdim=True)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    return _accept_passing(trees, p, p > threshold, generator)
