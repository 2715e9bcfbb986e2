"""End-to-end speculative decoding against plain decoding and exact distributions."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.drafters import ModelDrafter, NgramDrafter, make_drafter
from specdec.decode.generation import generate
from specdec.decode.sampling import SamplingParams, logits_to_probs
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.models.load import load_model
from specdec.models.transformer import KVCache
from tests.helpers import chi2_pvalue, first_two_token_probs


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir("llama", False, layers=4)))


@pytest.fixture(scope="module")
def other_draft(tiny_dir):
    """A different random model with the same tokenizer: drafts mostly rejected."""
    return load_model(str(tiny_dir("llama", False, layers=2, seed=7)))[0]


@pytest.fixture(scope="module")
def same_draft(tiny_dir):
    """An identical copy of the target as a separate draft model: drafts mostly accepted."""
    return load_model(str(tiny_dir("llama", False, layers=4)))[0]


def _prompts(tok, n=3):
    texts = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]
    return [tok.encode(t) for t in texts[:n]]


def _drafter(kind, model, other_draft, same_draft):
    if kind == "model_other":
        return ModelDrafter(other_draft)
    if kind == "model_same":
        return ModelDrafter(same_draft)
    return make_drafter(kind, model, skip="every2", exit_layer=2)


DRAFTERS = ["ngram", "layerskip", "early_exit", "model_other", "model_same"]


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_plain_greedy(target, other_draft, same_draft, kind, k):
    model, tok = target
    prompts = _prompts(tok)
    ref = generate(model, prompts, 24)
    dec = SpeculativeDecoder(
        model,
        _drafter(kind, model, other_draft, same_draft),
        "greedy",
        schedule=make_schedule("constant", k),
    )
    for batch in (prompts[:1], prompts):  # B = 1 and B > 1 with different prompt lengths
        res = dec.generate(batch, 24)
        assert res.tokens == ref.tokens[: len(batch)]
        assert all(len(t) == 24 for t in res.tokens)
        for seq, toks in zip(st_seqs := res.stats["per_sequence"], res.tokens):
            # the first token comes from the prefill; each round emits accepted + 1 (or less
            # when the budget / a stop token cuts it)
            assert 1 + sum(seq["emitted_per_round"]) == len(toks)
            assert all(
                e <= a + 1 for e, a in zip(seq["emitted_per_round"], seq["accepted_per_round"])
            )
        assert len(st_seqs) == len(batch)
        st = res.stats
        assert st["target_forwards"] <= 1 + sum(s["rounds"] for s in st["per_sequence"])
        assert 0.0 <= st["acceptance_rate"] <= 1.0


@pytest.mark.parametrize("kind", ["model_same", "ngram", "layerskip"])
def test_stop_token_inside_draft_block_and_budget(target, other_draft, same_draft, kind):
    model, tok = target
    prompts = _prompts(tok)
    ref = generate(model, prompts, 30)
    # stop at the token plain decoding emits 6th in sequence 0 (its first occurrence there)
    stop = ref.tokens[0][5]
    ref_stop = generate(model, prompts, 30, stop_ids={stop})
    assert ref_stop.finish_reasons[0] == "stop"
    dec = SpeculativeDecoder(
        model,
        _drafter(kind, model, other_draft, same_draft),
        "greedy",
        schedule=make_schedule("constant", 8),
    )
    res = dec.generate(prompts, 30, stop_ids={stop})
    assert res.tokens == ref_stop.tokens
    assert res.finish_reasons == ref_stop.finish_reasons
    for n in (1, 2, 5, 9):  # budgets smaller than, equal to and just past k + 1
        r = dec.generate(prompts, n)
        assert [len(t) for t in r.tokens] == [n] * len(prompts)
        assert r.tokens == [t[:n] for t in ref.tokens]


def test_identical_draft_model_is_always_accepted(target, same_draft):
    model, tok = target
    dec = SpeculativeDecoder(
        model, ModelDrafter(same_draft), "greedy", schedule=make_schedule("constant", 4)
    )
    res = dec.generate(_prompts(tok), 21)
    st = res.stats
    assert st["acceptance_rate"] > 0.99
    assert st["mean_accepted_tokens"] > 4.0  # 4 drafts + bonus per full round
    assert st["per_position_acceptance"][:4] == pytest.approx([1.0] * 4, abs=0.02)


def _fresh_cache(model, tokens: list[int], layers=None):
    cache = KVCache.for_model(model, 1, len(tokens) + 1)
    with torch.inference_mode():
        model(torch.tensor([tokens]), cache, torch.zeros(1, dtype=torch.long), layers=layers)
    return cache


@pytest.mark.parametrize("share", [True, False])
def test_caches_after_rejections_equal_caches_of_accepted_tokens(target, other_draft, share):
    """Target and drafter caches (own or shared) hold exactly the accepted history."""
    model, tok = target
    prompts = _prompts(tok)
    drafters = [
        ModelDrafter(other_draft),
        make_drafter("early_exit", model, exit_layer=2, share_cache=share),
    ]
    for drafter in drafters:
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
        res = dec.generate(prompts, 17)
        assert res.stats["accepted"] < res.stats["drafted"]  # there were rejections
        for b, (p, out) in enumerate(zip(res.prompt_ids, res.tokens)):
            history = p + out
            L = int(dec.cache.lens[b])
            assert L == len(history) - 1  # everything but the pending last token
            ref = _fresh_cache(model, history[:L])
            torch.testing.assert_close(
                dec.cache.k[:, b, :, :L], ref.k[:, 0, :, :L], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                dec.cache.v[:, b, :, :L], ref.v[:, 0, :, :L], atol=1e-5, rtol=1e-5
            )
            if drafter.share_cache:
                continue
            V = int(drafter.valid[b])
            assert V >= len(history) - 1 - 1  # at most the pending token + one draft behind
            dm = drafter.model
            dref = _fresh_cache(dm, history[:V], layers=drafter.layers)
            n_l = range(dm.config.n_layers) if drafter.layers is None else drafter.layers
            for i in n_l:
                torch.testing.assert_close(
                    drafter.cache.k[i, b, :, :V], dref.k[i, 0, :, :V], atol=1e-5, rtol=1e-5
                )
                torch.testing.assert_close(
                    drafter.cache.v[i, b, :, :V], dref.v[i, 0, :, :V], atol=1e-5, rtol=1e-5
                )


def test_speculative_sampling_preserves_target_distribution(target):
    """Chi-square of the 1st and 2nd generated tokens (many sequences of one prompt, with a
    draft model whose q differs from p) against the target's exact distributions."""
    model, tok = target
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = tok.encode("The quick brown fox")
    N = 3000
    # early exit after 2 of 4 layers, own cache: q overlaps p by about half under top-k 6
    drafter = make_drafter("early_exit", model, exit_layer=2, share_cache=False)
    dec = SpeculativeDecoder(model, drafter, "speculative", schedule=make_schedule("constant", 3))
    res = dec.generate([prompt] * N, 4, params, seed=1234)  # token 2 is the first drafted
    assert 0.0 < res.stats["acceptance_rate"] < 1.0
    t1 = torch.tensor([t[0] for t in res.tokens])
    t2 = torch.tensor([t[1] for t in res.tokens])
    p1, p2 = first_two_token_probs(model, prompt, params)

    assert chi2_pvalue(t1, p1) > 1e-3
    assert chi2_pvalue(t2, p2) > 1e-3


def test_speculative_acceptance_matches_overlap_of_p_and_q(target, other_draft):
    """P(first draft accepted) = sum_x min(p(x), q(x)) at the prompt's next position."""
    model, tok = target
    params = SamplingParams(temperature=1.0)
    prompt = tok.encode("def add(a, b):\n    return")
    N = 3000
    dec = SpeculativeDecoder(
        model, ModelDrafter(other_draft), "speculative", schedule=make_schedule("constant", 1)
    )
    # after the first token is sampled, round 1 drafts position 2; condition on token 1
    res = dec.generate([prompt] * N, 3, params, seed=99)
    acc = torch.tensor([s["accepted_per_round"][0] for s in res.stats["per_sequence"]]).double()
    first = torch.tensor([t[0] for t in res.tokens])
    with torch.inference_mode():
        cand, counts = torch.unique(first, return_counts=True)
        seqs = torch.tensor([prompt + [int(c)] for c in cand])
        z = torch.zeros(len(cand), dtype=torch.long)
        p = logits_to_probs(model(seqs, KVCache.for_model(model, len(cand), 64), z)[:, -1], params)
        q = logits_to_probs(
            other_draft(seqs, KVCache.for_model(other_draft, len(cand), 64), z)[:, -1], params
        )
    overlap = torch.minimum(p, q).sum(-1).double()
    expected = (overlap * counts).sum() / N
    measured = acc.mean()
    sd = (expected * (1 - expected) / N) ** 0.5
    assert abs(measured - expected) < 4 * sd + 1e-3


def test_threshold_tiny_tau_accepts_everything(target, other_draft):
    model, tok = target
    dec = SpeculativeDecoder(
        model,
        ModelDrafter(other_draft),
        "threshold",
        {"tau": 1e-9},
        schedule=make_schedule("constant", 4),
    )
    res = dec.generate(_prompts(tok), 20)
    assert res.stats["acceptance_rate"] == 1.0
    dec1 = SpeculativeDecoder(
        model,
        ModelDrafter(other_draft),
        "threshold",
        {"tau": 1.0},
        schedule=make_schedule("constant", 4),
    )
    # tau = 1 accepts only the argmax: greedy-identical output
    assert dec1.generate(_prompts(tok), 20).tokens == generate(model, _prompts(tok), 20).tokens


def test_typical_acceptance_follows_its_formula_end_to_end(target, other_draft):
    model, tok = target
    eps, delta = 0.09, 0.3
    dec = SpeculativeDecoder(
        model,
        ModelDrafter(other_draft),
        "typical",
        {"epsilon": eps, "delta": delta},
        schedule=make_schedule("constant", 1),
    )
    prompt = _prompts(tok)[:1]
    res = dec.generate(prompt, 3)
    # round 1 drafted the other model's argmax after [prompt, t1]; check the decision
    t1 = res.tokens[0][0]
    seq = torch.tensor([prompt[0] + [t1]])
    with torch.inference_mode():
        p = torch.softmax(
            model(seq, KVCache.for_model(model, 1, 32), torch.zeros(1, dtype=torch.long))[0, -1], -1
        )
        d = int(
            other_draft(
                seq, KVCache.for_model(other_draft, 1, 32), torch.zeros(1, dtype=torch.long)
            )[0, -1].argmax()
        )
    H = -(p * torch.log(p.clamp_min(1e-30))).sum()
    accept = bool(p[d] > min(eps, delta * torch.exp(-H)))
    assert res.stats["per_sequence"][0]["accepted_per_round"][0] == int(accept)


def test_heuristic_schedule_grows_and_shrinks_k(target, same_draft, other_draft):
    model, tok = target
    sched = make_schedule("heuristic", 2, k_max=8)
    dec = SpeculativeDecoder(model, ModelDrafter(same_draft), "greedy", schedule=sched)
    res = dec.generate(_prompts(tok)[:1], 40)
    drafted = res.stats["per_sequence"][0]["drafted_per_round"]
    assert drafted[:4] == [2, 4, 6, 8]  # always accepted: +2 per round up to k_max
    sched = make_schedule("heuristic", 6, k_max=8)
    dec = SpeculativeDecoder(model, ModelDrafter(other_draft), "greedy", schedule=sched)
    res = dec.generate(_prompts(tok)[:1], 30)
    d = res.stats["per_sequence"][0]["drafted_per_round"]
    a = res.stats["per_sequence"][0]["accepted_per_round"]
    for i in range(len(d) - 1):
        if d[i + 1] < 30 and a[i] < d[i]:  # rejection -> k - 1 (unless clipped by budget)
            assert d[i + 1] <= max(d[i] - 1, 1)
    assert res.tokens == generate(model, _prompts(tok)[:1], 30).tokens


def test_confidence_schedule_stops_drafting_early(target, other_draft):
    model, tok = target
    dec = SpeculativeDecoder(
        model,
        ModelDrafter(other_draft),
        "greedy",
        schedule=make_schedule("confidence", 8, p_min=0.3),
    )
    res = dec.generate(_prompts(tok), 20)
    d = [x for s in res.stats["per_sequence"] for x in s["drafted_per_round"]]
    assert min(d) < 8  # some rounds stopped early
    assert res.tokens == generate(model, _prompts(tok), 20).tokens


def test_ngram_lookup_proposes_continuation_of_latest_match():
    h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert NgramDrafter.lookup(h, 3, 3, 1) == [7, 8, 5]  # most recent earlier [1, 2, 3]
    assert NgramDrafter.lookup([4, 5, 6], 2, 3, 1) == []
    assert NgramDrafter.lookup([5, 6, 1, 5], 4, 2, 1) == [6, 1, 5]


def test_bad_speculative_inputs_raise_clear_errors(target, tiny_dir):
    model, tok = target
    with pytest.raises(SpecDecError, match="k must be >= 1"):
        make_schedule("constant", 0)
    with pytest.raises(SpecDecError, match="tau"):
        SpeculativeDecoder(model, NgramDrafter(), "threshold", {"tau": 1.5})
    with pytest.raises(SpecDecError, match="n-gram"):
        NgramDrafter(n_max=1, n_min=2)
    with pytest.raises(SpecDecError, match="skips every layer"):
        make_drafter("layerskip", model, skip=list(range(model.config.n_layers)))
    with pytest.raises(SpecDecError, match="unknown acceptance rule"):
        SpeculativeDecoder(model, NgramDrafter(), "nope")
    other_vocab = load_model(str(tiny_dir("llama", False, layers=1, vocab_size=300)))[0]
    with pytest.raises(SpecDecError, match="vocabulary mismatch"):
        SpeculativeDecoder(model, ModelDrafter(other_vocab), "greedy")
    bf16 = load_model(str(tiny_dir("llama", False, layers=2, seed=7)), dtype="bfloat16")[0]
    with pytest.raises(SpecDecError, match="dtype"):
        SpeculativeDecoder(model, ModelDrafter(bf16), "greedy")
