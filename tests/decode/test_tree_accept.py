"""Tree acceptance rules. The lossless rule is tested on its output distribution: a
synthetic bigram target P and draft Q on a tiny vocabulary, trees of a fixed shape filled
from Q (deterministic ranks, or drawn without replacement), and the first emitted token
and the first pair (a second round where a round emits one token) compared by chi-square
with their exact probabilities P[r, a] and P[r, a] P[a, b]. The same test must fail for a
wrong rule. The p-value threshold is 1e-3, seeds are fixed."""

from __future__ import annotations

import pytest
import torch

import specdec.decode.tree_accept as tree_accept
from specdec.decode.tree import TokenTree, build_static_trees
from specdec.decode.tree_accept import TREE_RULES
from tests.helpers import chi2_pvalue

V = 5
SHAPE = [0, 0, 0, 1, 1, 2, 4]  # 3 root children, 2 + 1 grandchildren, one node at depth 3


def bigrams(seed: int):
    g = torch.Generator().manual_seed(seed)
    p_logits = 1.2 * torch.randn(V, V, generator=g)
    q_logits = p_logits + 1.5 * torch.randn(V, V, generator=g)
    return torch.softmax(p_logits, -1), q_logits, g


def one_round(roots, P, q_logits, sample, g, rule="speculative"):
    """Trees from the draft table at these roots, target rows P[node token]; -> emitted."""

    def scorer(frontiers):
        return [
            torch.stack([q_logits[path[-1] if path else roots[b]] for path in f])
            for b, f in enumerate(frontiers)
        ]

    trees = build_static_trees(roots, scorer, SHAPE, sample=sample, generator=g)
    p = torch.stack([P[torch.tensor(t.tokens)] for t in trees])  # [N, T, V]
    return TREE_RULES[rule](trees, p, g).emitted(trees)


def first_two(P, q_logits, sample, g, n, root=0):
    out = one_round([root] * n, P, q_logits, sample, g)
    short = [i for i, e in enumerate(out) if len(e) == 1]
    if short:
        more = one_round([out[i][0] for i in short], P, q_logits, sample, g)
        for i, e in zip(short, more):
            out[i] = out[i] + e
    return torch.tensor([e[0] for e in out]), torch.tensor([e[1] for e in out])


def pvalues(P, t1, t2, root=0):
    pair = (P[root][:, None] * P).flatten()  # P[r, a] P[a, b] at index a * V + b
    return chi2_pvalue(t1, P[root]), chi2_pvalue(t1 * V + t2, pair)


@pytest.mark.parametrize("sample", [False, True])
def test_tree_speculative_emits_the_target_distribution(sample):
    P, q_logits, g = bigrams(seed=3 + sample)
    t1, t2 = first_two(P, q_logits, sample, g, n=4000)
    p_first, p_pair = pvalues(P, t1, t2)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def _no_residual(r, q):
    return r


def _with_replacement(q, x):
    return q


@pytest.mark.parametrize(
    "helper,wrong,sample",
    [("_residual", _no_residual, True), ("_without", _with_replacement, True)],
)
def test_wrong_tree_rule_fails_the_chi_square(monkeypatch, helper, wrong, sample):
    """Forgetting the residual update, or treating draws without replacement as i.i.d.,
    biases the output: the distribution test above must see it."""
    monkeypatch.setattr(tree_accept, helper, wrong)
    P, q_logits, g = bigrams(seed=3 + sample)
    t1, t2 = first_two(P, q_logits, sample, g, n=1500)
    assert min(pvalues(P, t1, t2)) < 1e-3


def random_trees(n: int, seed: int):
    """Trees of the static shape filled with random distinct sibling tokens; soft p."""
    g = torch.Generator().manual_seed(seed)

    def scorer(frontiers):
        return [torch.randn(len(f), V, generator=g) for f in frontiers]

    trees = build_static_trees([0] * n, scorer, SHAPE)
    p = torch.softmax(3 * torch.randn(n, len(SHAPE) + 1, V, generator=g), -1)
    return trees, p, g


def passing_nodes(t: TokenTree, ok) -> list[int]:
    """Brute force: nodes whose whole root path passes ok(parent, token)."""
    return [i for i in range(len(t)) if all(ok(t.parents[j], t.tokens[j]) for j in t.path(i))]


def test_tree_greedy_is_the_longest_argmax_path():
    trees, p, _ = random_trees(300, seed=0)
    res = TREE_RULES["greedy"](trees, p)
    assert 0 < sum(res.n_accepted) and max(res.n_accepted) == 3
    for b, t in enumerate(trees):
        best = p[b].argmax(-1)
        good = passing_nodes(t, lambda par, tok, best=best: tok == int(best[par]))
        end = max(good, key=lambda i: t.depths[i])
        assert res.paths[b] == t.path(end)
        assert int(res.next_token[b]) == int(best[end])


def test_tree_speculative_with_greedy_target_is_greedy():
    trees, p, g = random_trees(300, seed=1)
    hot = torch.nn.functional.one_hot(p.argmax(-1), V).float()
    for t in trees[:100]:  # some trees carry draft distributions, some do not
        t.q = torch.softmax(torch.randn(len(t), V, generator=g), -1)
    want = TREE_RULES["greedy"](trees, hot)
    got = TREE_RULES["speculative"](trees, hot, g)
    assert got.paths == want.paths and torch.equal(got.next_token, want.next_token)


@pytest.mark.parametrize("rule,params", [("threshold", {"tau": 0.3}), ("typical", {})])
def test_lossy_tree_rules_keep_the_deepest_passing_path(rule, params):
    trees, p, g = random_trees(300, seed=2)
    res = TREE_RULES[rule](trees, p, g, **params)
    for b, t in enumerate(trees):
        row = p[b].double()
        if rule == "threshold":
            limit = 0.3 * row.max(-1).values
        else:
            entropy = -(row * row.log()).sum(-1)
            limit = torch.clamp(0.3 * torch.exp(-entropy), max=0.09)
        good = passing_nodes(
            t, lambda par, tok, row=row, limit=limit: bool(row[par, tok] >= limit[par])
        )
        assert len(res.paths[b]) == max(t.depths[i] for i in good)
        assert not res.paths[b] or t.path(res.paths[b][-1]) == res.paths[b]
    assert 0 < sum(res.n_accepted) < sum(t.depth for t in trees)
    with pytest.raises(ValueError):
        TREE_RULES[rule](trees, p, g, **({"tau": 0.0} if rule == "threshold" else {"delta": -1}))
