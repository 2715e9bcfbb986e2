"""Greedy tree decoding built from the tree components is token-identical to plain greedy
decoding, and every cache holds exactly the accepted tokens afterwards.

The decoding loop lives here (the engine integration comes later): prefill, then rounds of
draft trees -> verify_tree (one target forward, greedy acceptance, KV compaction) -> emit
the accepted tokens + the next one, cut at stop tokens and the max_new_tokens budget.
"""

from __future__ import annotations

import pytest
import torch

from specdec.decode.generation import check_prompts, generate, prefill
from specdec.decode.tree import (
    ModelTreeDrafter,
    build_dynamic_trees,
    build_ngram_trees,
    build_static_trees,
    tree_slack,
)
from specdec.decode.tree_verify import verify_tree
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

STATIC = [0, 0, 0, 1, 1, 2, 3, 4]  # 3 root children, depth 3


@torch.inference_mode()
def tree_generate(
    target, prompts, max_new, kind, drafter, depth, topk, budget, stop_ids=(), rule="greedy", **kw
):
    """-> (tokens per prompt, committed tokens per prompt, cache, accepted per round)."""
    max_len = check_prompts(target, prompts, max_new, slack=tree_slack(depth, topk, budget))
    B = len(prompts)
    cache = KVCache.for_model(target, B, max_len)
    pending = prefill(target, prompts, cache).argmax(-1).tolist()
    out = [[t] for t in pending]
    history = [list(p) + [t] for p, t in zip(prompts, pending)]
    committed = [list(p) for p in prompts]  # what the target cache must hold
    active = [t not in stop_ids and max_new > 1 for t in pending]
    if drafter is not None:
        drafter.begin(cache, B, max_len)
    accepted = []
    while any(active):
        depths = [min(depth, max_new - len(o) - 1) if a else 0 for o, a in zip(out, active)]
        roots = [h[-1] for h in history]
        if kind == "ngram":
            trees = build_ngram_trees(history, depths, budget)
        else:
            drafter.start(history)
            if kind == "static":
                trees = build_static_trees(roots, drafter.score, STATIC, depths)
            else:
                trees = build_dynamic_trees(roots, drafter.score, depths, topk, budget)
        assert all(len(t) - 1 <= max(budget, len(STATIC)) for t in trees)
        res = verify_tree(target, cache, trees, rule, active=active, drafter=drafter, **kw)
        for b in range(B):
            if not active[b]:
                continue
            committed[b] += [history[b][-1]] + res.tokens[b][:-1]
            accepted.append(res.n_accepted[b])
            for t in res.tokens[b]:
                out[b].append(t)
                history[b].append(t)
                if t in stop_ids or len(out[b]) >= max_new:
                    active[b] = False
                    break
    return out, committed, cache, accepted


def _fresh_cache(model, tokens, layers=None):
    cache = KVCache.for_model(model, 1, len(tokens) + 1)
    with torch.inference_mode():
        model(torch.tensor([tokens]), cache, torch.zeros(1, dtype=torch.long), layers=layers)
    return cache


def assert_cache_holds(cache, b, model, tokens, layers=None):
    L = len(tokens)
    ref = _fresh_cache(model, tokens, layers)
    for i in range(model.config.n_layers) if layers is None else layers:
        torch.testing.assert_close(cache.k[i, b, :, :L], ref.k[i, 0, :, :L], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache.v[i, b, :, :L], ref.v[i, 0, :, :L], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def models(tiny_dir):
    target, tok = load_model(str(tiny_dir("llama", False, layers=4)))
    other = load_model(str(tiny_dir("llama", False, layers=2, seed=7)))[0]
    same = load_model(str(tiny_dir("llama", False, layers=4)))[0]
    texts = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]
    return target, other, same, [tok.encode(t) for t in texts]


def make_drafter(kind, target, other, same):
    if kind == "model_other" or kind == "static":
        return ModelTreeDrafter(other)
    if kind == "model_same":
        return ModelTreeDrafter(same)
    if kind == "layerskip":
        return ModelTreeDrafter(target, [0, 2], share_cache=True)
    if kind == "early_exit":
        return ModelTreeDrafter(target, range(2), share_cache=False)
    return None


KINDS = ["ngram", "layerskip", "early_exit", "model_other", "model_same", "static"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth,topk,budget,B", [(2, 2, 3, 3), (4, 3, 10, 1), (3, 1, 3, 3)])
def test_greedy_tree_decoding_equals_plain_greedy(models, kind, depth, topk, budget, B):
    """B = 3: prompts of different lengths, so different trees per sequence."""
    target, other, same, prompts = models
    ref = generate(target, prompts, 14)
    for batch in [prompts[:B]]:
        drafter = make_drafter(kind, target, other, same)
        out, committed, cache, accepted = tree_generate(
            target, batch, 14, kind, drafter, depth, topk, budget
        )
        assert out == ref.tokens[: len(batch)]
        for b in range(len(batch)):
            assert int(cache.lens[b]) == len(committed[b])
            assert_cache_holds(cache, b, target, committed[b])
            if drafter is not None and not drafter.share_cache:
                V = int(drafter.valid[b])
                assert len(committed[b]) - 1 <= V <= len(committed[b]) + 1
                full = (committed[b] + out[b][len(committed[b]) - len(batch[b]) :])[:V]
                assert_cache_holds(drafter.cache, b, drafter.model, full, drafter.layers)
        if kind == "model_same":  # an identical draft model: mostly accepted
            assert sum(accepted) / len(accepted) >= 0.5 * min(depth, budget)
            if topk == 1:  # a chain of the target's own argmaxes: all accepted
                assert all(a == 3 for a in accepted[: -3 * len(batch)])


@pytest.mark.parametrize("kind", ["model_same", "layerskip", "ngram"])
def test_stop_tokens_and_budgets(models, kind):
    target, other, same, prompts = models
    ref = generate(target, prompts, 16)
    stop = ref.tokens[0][6]  # inside a block an identical draft accepts
    for max_new, stop_ids in [(7, frozenset()), (16, frozenset({stop})), (2, frozenset())]:
        want = generate(target, prompts, max_new, stop_ids=stop_ids).tokens
        drafter = make_drafter(kind, target, other, same)
        out, *_ = tree_generate(target, prompts, max_new, kind, drafter, 4, 2, 6, stop_ids)
        assert out == want


@pytest.mark.parametrize("rule,params", [("speculative", {}), ("threshold", {"tau": 1.0})])
def test_other_rules_under_greedy_decoding_are_greedy(models, rule, params):
    """With temperature 0 the lossless rule sees one-hot p, and the threshold rule at its
    strictest (tau = 1) passes only the argmax: both decode exactly as plain greedy."""
    target, other, same, prompts = models
    ref = generate(target, prompts, 10)
    drafter = make_drafter("model_same", target, other, same)
    out, committed, cache, _ = tree_generate(
        target, prompts, 10, "dynamic", drafter, 3, 2, 5, rule=rule, rule_params=params
    )
    assert out == ref.tokens
    assert_cache_holds(cache, 1, target, committed[1])


def test_qwen2_tree_decoding_equals_plain_greedy(tiny_dir):
    target, tok = load_model(str(tiny_dir("qwen2", True, layers=3)))
    prompts = [tok.encode("Speculative decoding drafts"), tok.encode("1 + 2 =")]
    ref = generate(target, prompts, 12)
    drafter = ModelTreeDrafter(target, [0, 2], share_cache=True)
    out, committed, cache, _ = tree_generate(target, prompts, 12, "dynamic", drafter, 3, 2, 5)
    assert out == ref.tokens
    for b in range(2):
        assert_cache_holds(cache, b, target, committed[b])


def test_triton_tree_verification_matches_torch(tiny_dir):
    """The tree forward through the Triton verification attention and compact_kv
    (interpreter on CPU) decodes as the torch backend does."""
    d = str(tiny_dir("llama", False, layers=4))
    ref_model, tok = load_model(d, backend="torch")
    tri_model, _ = load_model(d, backend="triton")
    prompts = [tok.encode("The quick brown fox"), tok.encode("def add(a, b):")]
    want = generate(ref_model, prompts, 6).tokens
    drafter = ModelTreeDrafter(tri_model, [0, 1], share_cache=False)
    out, committed, cache, _ = tree_generate(tri_model, prompts, 6, "dynamic", drafter, 2, 2, 4)
    assert out == want
    for b in range(2):
        assert_cache_holds(cache, b, ref_model, committed[b])
