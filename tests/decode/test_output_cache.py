"""Drafting from the run's earlier outputs (specdec.decode.output_cache, the n-gram and
datastore drafters' `reuse_outputs`): the index against brute-force search over random
outputs, eviction of the oldest, the source order (the history's match wins), and in the
engine: greedy output token-identical to plain greedy (chains, trees, batches) while the
cache does draft, a sequence decoded again drafted from its first answer, and sampling
keeping the target's distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.decode.drafters import DraftRequest, NgramDrafter, make_drafter
from specdec.decode.generation import generate
from specdec.decode.output_cache import SEP, OutputCache, frequent_chain
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree_round import TreeSpec
from specdec.errors import SpecDecError
from tests.decode import test_tree_decode
from tests.helpers import chi2_pvalue, first_two_token_probs

models = test_tree_decode.models  # (target, other, same, prompts): tiny models


def brute_continuations(docs, history, k, n_max, n_min):
    """The longest suffix of history (n_max..n_min) that ends inside a document and the k
    tokens after each of its occurrences (SEP past the document's end), oldest first."""
    for n in range(min(n_max, len(history)), n_min - 1, -1):
        ctx = list(history[len(history) - n :])
        rows = []
        for d in docs:
            for i in range(len(d) - n + 1):
                if d[i : i + n] == ctx:
                    after = d[i + n : i + n + k]
                    rows.append(after + [SEP] * (k - len(after)))
        if rows:
            return n, rows
    return 0, []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_continuations_match_brute_force(seed):
    rng = random.Random(seed)
    V = rng.choice([3, 5, 40])  # small vocabularies: many repeats
    docs = [[rng.randrange(V) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    n_max, n_min = rng.choice([(8, 2), (4, 1), (3, 3)])
    cache = OutputCache(n_max, n_min, samples=10_000)
    for d in docs:
        cache.add(d)
    assert len(cache) == sum(map(len, docs)) and cache.outputs == len(docs)
    for _ in range(60):
        h = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        k = rng.randrange(1, 7)
        n, conts = cache.continuations(h, k)
        want_n, want = brute_continuations(docs, h, k, n_max, n_min)
        assert n == want_n
        assert conts.tolist() == want  # every occurrence, oldest first


def test_samples_keep_the_most_recent_and_old_outputs_are_dropped():
    cache = OutputCache(n_max=2, n_min=2, max_tokens=12, samples=2)
    for tail in ([1], [2], [3]):
        cache.add([7, 8] + tail)
    n, conts = cache.continuations([5, 7, 8], 2)
    assert n == 2 and conts.tolist() == [[2, SEP], [3, SEP]]  # the 2 most recent
    cache.add([7, 8, 4, 4, 4, 4, 4])  # 16 tokens > 12: the oldest two go
    assert cache.outputs == 2 and len(cache) == 10
    cache.samples = 10
    assert cache.continuations([7, 8], 1)[1].tolist() == [[3], [4]]
    cache.clear()
    assert len(cache) == 0 and cache.continuations([7, 8], 3)[0] == 0
    big = OutputCache(max_tokens=4)
    big.add(list(range(10)))  # an output longer than the cache keeps its last tokens
    assert len(big) == 4 and big.continuations([6, 7], 2)[1].tolist() == [[8, 9]]


def test_chain_takes_the_majority_while_p_min_holds():
    conts = np.array([[3, 4, 5]] * 5 + [[3, 4, 6]] * 4 + [[2, 1, 1]] * 3)
    assert frequent_chain(conts, SEP, 0.0) == [3, 4, 5]
    assert frequent_chain(conts, SEP, 0.5) == [3, 4]  # 9/12, 9/12, then 5/12
    assert frequent_chain(np.array([[3, SEP, 1]] * 4), SEP, 0.0) == [3]  # an output's end


def test_bad_options_are_refused():
    with pytest.raises(SpecDecError, match="n_min"):
        OutputCache(n_max=2, n_min=3)
    with pytest.raises(SpecDecError, match="max_tokens"):
        OutputCache(max_tokens=0)
    with pytest.raises(SpecDecError, match="min_match"):
        NgramDrafter(reuse_outputs=True, min_match=0)
    with pytest.raises(SpecDecError, match="outputs_p_min"):
        NgramDrafter(reuse_outputs=True, outputs_p_min=1.5)
    with pytest.raises(SpecDecError, match="token ids"):
        OutputCache().add([1, -3])


def test_history_match_wins_then_the_cache_then_nothing():
    d = NgramDrafter(reuse_outputs=True, min_match=2)
    d.finish([[1, 2, 3, 9, 9, 9], [40, 41]])
    req = lambda *hs: DraftRequest(list(hs), torch.tensor([3] * len(hs)), SamplingParams())  # noqa: E731
    assert d.propose(req([5, 2, 3, 4, 4, 2, 3])).tokens[0].tolist() == [4, 4, 2]  # history
    got = d.propose(req([5, 6, 2, 3], [7, 40, 41], [7, 8, 7]))
    assert got.tokens[0].tolist() == [9, 9, 9]  # the cache: (2, 3) in an earlier output
    assert got.n_draft.tolist() == [3, 0, 2]  # (40, 41) ended its output: nothing follows
    assert got.tokens[2, :2].tolist() == [8, 7]  # the history's 1-token match
    assert d.sources == {"history": 2, "outputs": 1, "none": 1}
    trees = d.build_trees([[5, 6, 2, 3], [5, 2, 3, 4, 4, 2, 3]], [3, 3], 8)
    assert trees[0].tokens == [3, 9, 9, 9] and trees[0].parents == [-1, 0, 1, 2]
    assert trees[1].tokens[1:] == [4, 4, 2]
    d.reset()
    assert d.propose(req([5, 6, 2, 3])).n_draft.tolist() == [0]
    assert d.sources == {"history": 0, "outputs": 0, "none": 1}
    off = NgramDrafter()  # reuse_outputs off: finish keeps nothing
    off.finish([[1, 2, 3, 9, 9, 9]])
    assert off.propose(req([5, 6, 2, 3])).n_draft.tolist() == [0]


@pytest.mark.parametrize("kind", ["ngram", "datastore"])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_plain_and_a_repeat_is_drafted_from_its_first_answer(
    models, tmp_path, kind, k
):
    target, _, _, prompts = models
    opts = dict(reuse_outputs=True, min_match=3)  # a 3-token history match wins
    if kind == "datastore":  # an empty corpus: every retrieval draft is the cache's
        from specdec.decode.datastore import Datastore

        Datastore.from_documents([[1, 2]], target.config.vocab_size).save(tmp_path / "ds")
        opts.update(path=str(tmp_path / "ds"), ds_n_min=2)
    drafter = make_drafter(kind, target, **opts)
    dec = SpeculativeDecoder(target, drafter, "greedy", schedule=make_schedule("constant", k))
    ref = generate(target, prompts, 24).tokens
    first = [dec.generate([p], 24) for p in prompts]  # the cache fills, prompt by prompt
    assert [r.tokens[0] for r in first] == ref
    again = dec.generate(prompts, 24)  # a batch of the same prompts: their answers are held
    assert again.tokens == ref
    src = again.stats["draft_sources"]
    assert src["outputs"] > 0, src
    assert again.stats["rounds"] < sum(r.stats["rounds"] for r in first)
    assert again.stats["acceptance_rate"] > 0.7
    drafter.reset()
    assert dec.generate(prompts[:1], 24).stats["draft_sources"]["outputs"] == 0


def test_trees_from_the_cache_equal_plain_greedy(models):
    target, _, _, prompts = models
    ref = generate(target, prompts, 16).tokens
    drafter = make_drafter("ngram", target, reuse_outputs=True, outputs_n_min=1)
    dec = SpeculativeDecoder(
        target, drafter, "greedy", schedule=make_schedule("constant", 3), tree=TreeSpec(2, 6)
    )
    for p, want in zip(prompts, ref):  # the cache fills with other prompts' answers
        assert dec.generate([p], 16).tokens == [want]
    res = dec.generate(prompts, 16)
    assert res.tokens == ref
    assert res.stats["draft_sources"] is None  # counted for chains only
    assert max(res.stats["tree_nodes_per_round"]) > 2


def test_sampling_from_the_cache_keeps_the_target_distribution(models):
    target, _, _, prompts = models
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = prompts[0]
    p1, p2 = first_two_token_probs(target, prompt, params)
    likely = torch.nonzero(p1 > 0).flatten().tolist()
    drafter = NgramDrafter(reuse_outputs=True, outputs_n_min=1, min_match=8)
    # earlier outputs continue each likely first token with a likely second one, some twice
    drafter.finish([[a, b] for a in likely for b in likely[:2]])
    dec = SpeculativeDecoder(target, drafter, "speculative", schedule=make_schedule("constant", 2))
    res = dec.generate([prompt] * 1500, 3, params, seed=5)
    assert 0.0 < res.stats["acceptance_rate"] < 1.0
    assert res.stats["draft_sources"]["outputs"] > 0
    assert chi2_pvalue(torch.tensor([t[1] for t in res.tokens]), p2) > 1e-3
