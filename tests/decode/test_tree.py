"""Token trees: flattening (masks, positions, padding) against hand-built examples, the
three builders, and the tree-masked draft forward against plain forwards."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.tree import (
    ModelTreeDrafter,
    TokenTree,
    ancestor_bits,
    build_dynamic_trees,
    build_ngram_trees,
    build_static_trees,
    check_static_tree,
    flatten_trees,
    read_static_tree,
)
from specdec.errors import SpecDecError
from specdec.models.load import load_model
from specdec.models.transformer import KVCache


def test_flatten_hand_built_batch():
    #      7            root
    #    /   \
    #   3     4         depth 1
    #  / \    |
    # 9   1   5         depth 2
    a = TokenTree([7, 3, 4, 9, 1, 5], [-1, 0, 0, 1, 1, 2])
    b = TokenTree.chain(2, [6, 8])
    flat = flatten_trees([a, b], torch.tensor([10, 4]))
    assert flat.tokens.tolist() == [[7, 3, 4, 9, 1, 5], [2, 6, 8, 0, 0, 0]]
    assert flat.positions.tolist() == [[10, 11, 11, 12, 12, 12], [4, 5, 6, 4, 4, 4]]
    want_a = [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    want_b = [0b1, 0b11, 0b111, 0b1000, 0b10000, 0b100000]  # padding sees only itself
    assert flat.tree_mask.tolist() == [want_a, want_b]
    assert flat.tree_mask.dtype == torch.int64
    assert flat.n_nodes == [6, 3]
    assert a.children == [[1, 2], [3, 4], [5], [], [], []]
    assert a.depths == [0, 1, 1, 2, 2, 2] and a.depth == 2 and a.path(4) == [1, 4]


def test_mask_bit_63_of_a_64_node_chain():
    t = TokenTree.chain(1, list(range(63)))
    bits = ancestor_bits(t)
    assert bits[63] == -1  # all 64 bits: the int64 sign bit included
    flat = flatten_trees([t], torch.tensor([0]))
    j = torch.arange(64)
    seen = (flat.tree_mask[0, :, None] >> j) & 1  # [T, T]
    assert torch.equal(seen.bool(), torch.ones(64, 64).tril().bool())
    with pytest.raises(ValueError, match="at most 64"):
        flatten_trees([TokenTree.chain(1, list(range(64)))], torch.tensor([0]))


def test_tree_validation_and_truncation():
    with pytest.raises(ValueError):
        TokenTree([1, 2], [-1, 1])
    t = TokenTree([7, 3, 4, 9, 1, 5], [-1, 0, 0, 1, 1, 2], [1.0, 0.5, 0.3, 0.2, 0.1, 0.9])
    cut = t.truncated(1)
    assert cut.tokens == [7, 3, 4] and cut.parents == [-1, 0, 0] and cut.probs == [1.0, 0.5, 0.3]


def table_scorer(table: torch.Tensor, roots):
    """Draft logits that depend on the last token of the path only (a bigram table)."""

    def score(frontiers):
        return [
            torch.stack([table[path[-1] if path else roots[b]] for path in f])
            if f
            else torch.zeros(0, table.shape[1])
            for b, f in enumerate(frontiers)
        ]

    return score


def test_dynamic_tree_is_eagle2_selection():
    g = torch.Generator().manual_seed(0)
    V = 9
    table = 2 * torch.randn(V, V, generator=g)
    logp = torch.log_softmax(table, -1)
    roots = [1, 4]
    depth, topk, budget = 3, 3, 7
    trees = build_dynamic_trees(roots, table_scorer(table, roots), [depth, 2], topk, budget)
    for b, t in enumerate(trees):
        assert len(t) - 1 == budget and t.depth <= [depth, 2][b]
        # reference: every layer keeps the topk best nodes, each expanded into topk children
        layer, cands = [(0.0, (roots[b],))], []
        for _ in range([depth, 2][b]):
            new = []
            for v, path in layer:
                top = torch.topk(logp[path[-1]], topk)
                new += [
                    (v + lp, path + (x,))
                    for lp, x in zip(top.values.tolist(), top.indices.tolist())
                ]
            cands += new
            layer = sorted(new, key=lambda c: -c[0])[:topk]
        best = sorted(cands, key=lambda c: (-c[0], len(c[1])))[:budget]
        got = {tuple(t.tokens[j] for j in [0] + t.path(i)) for i in range(1, len(t))}
        assert got == {c[1] for c in best}
        for i in range(1, len(t)):
            par = t.tokens[t.parents[i]]
            assert t.probs[i] == pytest.approx(float(logp[par, t.tokens[i]].exp()), rel=1e-5)
    chain = build_dynamic_trees([1], table_scorer(table, [1]), 4, 1, 10)[0]
    assert chain.parents == [-1, 0, 1, 2, 3]  # topk 1 is the greedy chain
    for i in range(1, 5):
        assert chain.tokens[i] == int(table[chain.tokens[i - 1]].argmax())


def test_static_tree_ranks_and_sampling():
    g = torch.Generator().manual_seed(1)
    V = 6
    table = torch.randn(V, V, generator=g)
    parents = [0, 0, 0, 1, 1, 2]  # 3 root children; 2 under the first, 1 under the second
    t = build_static_trees([2], table_scorer(table, [2]), parents)[0]
    order0 = torch.argsort(table[2], descending=True).tolist()
    assert t.tokens[1:4] == order0[:3]
    assert t.tokens[4:6] == torch.argsort(table[order0[0]], descending=True).tolist()[:2]
    assert t.tokens[6] == int(table[order0[1]].argmax())
    assert t.q is None
    cut = build_static_trees([2, 3], table_scorer(table, [2, 3]), parents, [1, 0])
    assert len(cut[0]) == 4 and len(cut[1]) == 1
    # sampled: siblings distinct, q recorded; rank 0 follows q (first draw)
    s = build_static_trees(
        [2] * 4000, table_scorer(table, [2] * 4000), parents, sample=True, generator=g
    )
    q = torch.softmax(table[2], -1)
    assert all(len(set(x.tokens[1:4])) == 3 for x in s)
    assert torch.allclose(s[0].q[0], q)
    freq = torch.bincount(torch.tensor([x.tokens[1] for x in s]), minlength=V) / 4000
    assert torch.allclose(freq, q, atol=0.03)


def test_static_tree_files(tmp_path):
    assert check_static_tree([0, 0, 1]) == [0, 0, 1]
    with pytest.raises(SpecDecError):
        check_static_tree([0, 2])  # node 2's parent is itself
    f = tmp_path / "tree.json"
    f.write_text("[0, 0, 1, 1]")
    assert read_static_tree(f) == [0, 0, 1, 1]
    f.write_text('{"a": 1}')
    with pytest.raises(SpecDecError, match="JSON list"):
        read_static_tree(f)


def test_ngram_trie_of_distinct_continuations():
    h = [5, 1, 2, 9, 1, 2, 3, 4, 1, 2, 3, 7, 8, 1, 2]
    t = build_ngram_trees([h], depth=3, budget=10, n_max=2)[0]
    # suffix (1, 2) occurs at 1, 4, 8 (most recent first): continuations 3 7 8 / 3 4 1 / 9 1 2
    paths = {tuple(t.tokens[j] for j in t.path(i)) for i in range(len(t)) if not t.children[i]}
    assert t.tokens[0] == 2
    assert paths == {(3, 7, 8), (3, 4, 1), (9, 1, 2)}
    assert len(t) == 1 + 8  # the shared 3 is one node
    small = build_ngram_trees([h], depth=3, budget=4, n_max=2)[0]
    assert len(small) == 5 and small.tokens[1:4] == [3, 7, 8]
    assert len(build_ngram_trees([[1, 2, 3]], depth=3, budget=4)[0]) == 1  # no match


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir("llama", False, layers=4)))[0]


def _draft_reference(model, seq, n_full, layers):
    """Last logits of a draft over seq whose first n_full tokens were computed by the
    full model (a self-drafter on the target's cache)."""
    cache = KVCache.for_model(model, 1, 40)
    zero = torch.zeros(1, dtype=torch.long)
    if n_full:
        model(torch.tensor([seq[:n_full]]), cache, zero)
    return model(torch.tensor([seq[n_full:]]), cache, zero + n_full, layers=layers)[0, -1]


@pytest.mark.parametrize("layers,share", [(None, False), ([0, 2, 3], True), ([0, 1], False)])
def test_tree_scorer_matches_plain_forwards(tiny, layers, share):
    """Every node's draft logits from the tree-masked forward equal a fresh forward over
    history + the node's root path (own cache, or the target's with a full-model prefix)."""
    model = tiny
    histories = [[3, 17, 42, 5, 9], [8, 1, 2]]
    cache = KVCache.for_model(model, 2, 40)
    if share:  # the target's cache holds the committed prefix (history minus pending)
        for b, h in enumerate(histories):
            one = KVCache.for_model(model, 1, 40)
            model(torch.tensor([h[:-1]]), one, torch.zeros(1, dtype=torch.long))
            cache.k[:, b], cache.v[:, b] = one.k[:, 0], one.v[:, 0]
        cache.lens = torch.tensor([len(h) - 1 for h in histories])
    drafter = ModelTreeDrafter(model, layers, share_cache=share)
    drafter.begin(cache, 2, 40)
    seen = []

    def scorer(frontiers):
        out = drafter.score(frontiers)
        seen.append((frontiers, out))
        return out

    with torch.inference_mode():
        drafter.start(histories)
        trees = build_dynamic_trees([h[-1] for h in histories], scorer, [3, 2], 2, 6)
        assert len(seen) == 3 and all(len(t) == 7 for t in trees)
        for frontiers, out in seen:
            for b, paths in enumerate(frontiers):
                for path, row in zip(paths, out[b]):
                    seq = histories[b] + list(path)
                    ref = _draft_reference(
                        model, seq, len(histories[b]) - 1 if share else 0, layers
                    )
                    torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)
