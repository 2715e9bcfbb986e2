"""Token trees for the trained-head drafter: greedy tree decoding is token-identical to
plain greedy, a tree node's head logits are those of the chain fed the same path (mask,
positions, feature hand-off), the head cache after partial acceptance is what a fresh head
fed the committed tokens computes, tree sampling keeps the target's distribution, and the
CLI builds it."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.decode.generation import generate, prefill
from specdec.decode.heads.drafter import HeadDrafter, HeadTreeScorer
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree import TokenTree
from specdec.decode.tree_round import TreeSpec
from specdec.decode.tree_verify import verify_tree
from specdec.models.load import load_model
from specdec.models.transformer import KVCache
from tests.decode import test_head
from tests.helpers import assert_head_cache_is_fresh, chi2_pvalue, first_two_token_probs

one_thread = test_head.one_thread  # the fixtures: one torch thread, the smooth tiny target
smooth_target = test_head.smooth_target  # and a head trained on it (seconds)
head_data = test_head.head_data
trained = test_head.trained
STATIC = (0, 0, 1, 1, 2)  # 2 root children, depth 3


def _decoder(model, path, depth, spec, rule="greedy"):
    drafter = HeadDrafter(model, str(path))
    return SpeculativeDecoder(
        model, drafter, rule, schedule=make_schedule("constant", depth), tree=spec
    )


@pytest.mark.parametrize(
    "depth,topk,budget,B,static",
    [(3, 2, 6, 2, None), (4, 3, 10, 1, None), (2, 1, 2, 3, None), (3, 1, 5, 2, STATIC)],
)
def test_greedy_head_trees_equal_plain_greedy(
    smooth_target, trained, depth, topk, budget, B, static
):
    """B > 1: prompts of different lengths. The head cache afterwards holds exactly what a
    fresh head fed the committed tokens with the target's features computes."""
    model, tok = smooth_target
    prompts = test_head._prompts(tok)[:B]
    ref = generate(model, prompts, 20).tokens
    spec = TreeSpec(topk, budget, static)
    dec = _decoder(model, trained[0], depth, spec)
    res = dec.generate(prompts, 20)
    assert res.tokens == ref
    s = res.stats
    assert s["drafter"] == "head" and s["tree"] == spec.describe()
    assert max(s["tree_nodes_per_round"]) <= (budget if static is None else len(static))
    per_round = [a for q in s["per_sequence"] for a in q["accepted_per_round"]]
    assert max(per_round) >= 1 and s["mean_accepted_tokens"] > 1.2  # the trained head helps
    assert min(per_round) < depth  # and rounds with rejections happened
    test_head._check_head_cache(model, dec.drafter, prompts, res.tokens, depth)


@pytest.mark.parametrize("max_new,stop_at", [(7, None), (16, 6), (2, None)])
def test_head_trees_stop_tokens_and_budgets(smooth_target, trained, max_new, stop_at):
    model, tok = smooth_target
    prompts = test_head._prompts(tok)[:3]
    stop_ids = frozenset()
    if stop_at is not None:
        stop_ids = frozenset({generate(model, prompts[:1], 16).tokens[0][stop_at]})
    want = generate(model, prompts, max_new, stop_ids=stop_ids)
    got = _decoder(model, trained[0], 4, TreeSpec(2, 6)).generate(
        prompts, max_new, stop_ids=stop_ids
    )
    assert (got.tokens, got.finish_reasons) == (want.tokens, want.finish_reasons)


def test_untrained_head_with_small_vocabulary_is_lossless(tiny_dir, tmp_path):
    """vocab_top < vocab: the scorer's full-vocabulary logits are -inf off the head's rows."""
    model, tok = load_model(str(tiny_dir("llama", False, layers=2)))
    path = test_head._untrained(model, tmp_path / "h", vocab_top=64)
    prompts = test_head._prompts(tok)[:2]
    ref = generate(model, prompts, 12).tokens
    for spec in (TreeSpec(2, 6), TreeSpec(1, 5, STATIC)):
        assert _decoder(model, path, 3, spec).generate(prompts, 12).tokens == ref


def _round_start(model, path, prompts, max_len=64):
    """Prefill + a scorer caught up on the prompts -> (cache, history, feats, scorer)."""
    drafter = HeadDrafter(model, str(path))
    cache = KVCache.for_model(model, len(prompts), max_len)
    logits, feats = prefill(model, prompts, cache, hidden_layers=drafter.target_features)
    history = [p + [t] for p, t in zip(prompts, logits.argmax(-1).tolist())]
    scorer = HeadTreeScorer(drafter)
    scorer.begin(cache, len(prompts), max_len)
    scorer.start(history, feats, cache.lens.clone())
    return cache, history, feats, scorer


def _chain_logits(model, path, history, feats, lens, tokens):
    """The chain drafter fed draft paths tokens [B, n] (its catch-up, then one head step
    per draft at slot nxt + i) -> full-vocabulary logits [B, n + 1, V] after each prefix."""
    drafter = HeadDrafter(model, str(path))
    drafter.new_cache(len(history), 64)
    head = drafter.head
    h, nxt = drafter.catch_up(history, feats, lens, extra=tokens.shape[1])
    out = [head.full_logits(h)]
    for i in range(tokens.shape[1]):
        h = head.step(h[:, None], tokens[:, i, None], drafter.cache, nxt + i)[:, 0]
        out.append(head.full_logits(h))
    return torch.stack(out, 1)


@torch.inference_mode()
def test_tree_node_logits_equal_the_chain_fed_that_path(smooth_target, trained):
    """Paths A = (a, b, c), W = (a, w) (A's sibling at depth 2) and X = (x, y, z) scored
    depth by depth in one tree: each node's logits are the chain's for its path."""
    model, tok = smooth_target
    out = trained[0]
    prompts = test_head._prompts(tok)[:2]  # different lengths
    cache, history, feats, scorer = _round_start(model, out, prompts)
    vocab = scorer.head.vocab_map
    g = torch.Generator().manual_seed(0)
    A, W, X = (vocab[torch.randint(len(vocab), (2, 3), generator=g)] for _ in range(3))
    W = torch.cat([A[:, :1], W[:, :1]], 1)
    paths = [{n: tuple(t[b].tolist()) for n, t in zip("AWX", (A, W, X))} for b in range(2)]
    got = [{} for _ in range(2)]
    frontiers = [
        [[()] for _ in range(2)],
        [[p["A"][:1], p["X"][:1]] for p in paths],
        [[p["A"][:2], p["W"], p["X"][:2]] for p in paths],
        [[p["A"], p["X"]] for p in paths],
    ]
    for frontier in frontiers:
        for b, (fs, rows) in enumerate(zip(frontier, scorer.score(frontier))):
            assert rows.shape == (len(fs), model.config.vocab_size)
            got[b].update(zip(fs, rows))
    assert scorer.forwards == 1 + 3  # the catch-up, then one step per depth
    lens = cache.lens.clone()
    for name, toks in zip("AWX", (A, W, X)):
        ref = _chain_logits(model, out, history, feats, lens, toks)
        for b in range(2):
            for d in range(toks.shape[1] + 1):
                torch.testing.assert_close(
                    got[b][paths[b][name][:d]], ref[b, d], atol=1e-5, rtol=1e-5
                )
    assert torch.isinf(ref).any() and not torch.isinf(ref[:, :, vocab]).any()  # vocab_top < V


def _fresh_features(model, layers, seq):
    cache = KVCache.for_model(model, 1, len(seq))
    _, hidden = model(
        torch.tensor([seq]), cache, torch.zeros(1, dtype=torch.long), hidden_layers=layers
    )
    return hidden[0]  # [T, n, dim]


@torch.inference_mode()
def test_partial_acceptance_hands_the_accepted_features_to_the_head(smooth_target, trained):
    """Trees built so that greedy verification accepts 2 nodes of sequence 0 and none of
    sequence 1: verify_tree returns the target's features of root + accepted path, and the
    next start leaves the head cache as a fresh head fed the committed tokens has it."""
    model, tok = smooth_target
    prompts = test_head._prompts(tok)[:2]
    cache, history, _, scorer = _round_start(model, trained[0], prompts)
    layers = scorer.target_features
    cont = generate(model, prompts, 4).tokens  # [pending, t1, t2, t3] per sequence
    V = model.config.vocab_size
    t1, t2, t3 = cont[0][1:4]
    wrong = [(t + 1) % V for t in (t1, t2, t3)]
    trees = [
        TokenTree([history[0][-1], t1, wrong[0], t2, wrong[2]], [-1, 0, 0, 1, 3]),
        TokenTree([history[1][-1], (cont[1][1] + 1) % V], [-1, 0]),
    ]
    scorer.score([[(t1,), (t1, t2)], [()]])  # the inner nodes, as the builders feed them
    lens = cache.lens.clone()
    res = verify_tree(model, cache, trees, "greedy", drafter=scorer, hidden_layers=layers)
    assert res.n_accepted == [2, 0] and res.features.shape[1] == 3
    for b, n in enumerate(res.n_accepted):
        seq = history[b] + res.tokens[b][:-1]
        full = _fresh_features(model, layers, seq)  # [T, n, dim]
        L = int(lens[b])
        torch.testing.assert_close(res.features[b, : 1 + n], full[L : L + 1 + n])
        history[b] = history[b] + res.tokens[b]
    scorer.start(history, res.features, torch.tensor(res.n_accepted) + 1)
    drafter, head = scorer.drafter, scorer.head
    for b, seq in enumerate(history):
        fed = drafter.fed[b]
        assert fed == len(seq) - 1
        full = _fresh_features(model, layers, seq)
        h = assert_head_cache_is_fresh(drafter, b, full[None], torch.tensor([seq]))
        torch.testing.assert_close(
            scorer.root_logits[b], head.full_logits(h[0, -1]), atol=1e-5, rtol=1e-4
        )


def test_head_tree_sampling_preserves_target_distribution(smooth_target, trained):
    """Chi-square of the 2nd generated token (the first one drafted) of many sequences of
    one prompt, through dynamic (deterministic candidates) and static (drawn without
    replacement from the head's q) trees."""
    model, tok = smooth_target
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = test_head._prompts(tok)[2]
    N = 1200
    p1, p2 = first_two_token_probs(model, prompt, params)
    for spec in [TreeSpec(2, 4), TreeSpec(2, 5, STATIC)]:
        dec = _decoder(model, trained[0], 2, spec, rule="speculative")
        res = dec.generate([prompt] * N, 3, params, seed=7)
        assert 0.0 < res.stats["acceptance_rate"] < 1.0
        assert chi2_pvalue(torch.tensor([t[1] for t in res.tokens]), p2) > 1e-3


def test_cli_head_tree(tiny_dir, tmp_path, capsys):
    from specdec.generate import main

    d = tiny_dir("llama", False, layers=4)
    model, _ = load_model(str(d))
    path = test_head._untrained(model, tmp_path / "h", vocab_top=128)
    base = ["--model", str(d), "--prompt", "The quick brown fox", "--max-new-tokens", "8"]
    main([*base, "--json", "--draft", f"head:{path}", "--k", "3"]
         + ["--tree-topk", "2", "--tree-budget", "6"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == generate(model, [out["prompt_ids"]], 8).tokens[0]
    s = out["stats"]
    assert s["drafter"] == "head" and s["tree"] == {"topk": 2, "budget": 6, "static": None}
    assert s["drafted"] > 0 and "acceptance_per_depth" in s
