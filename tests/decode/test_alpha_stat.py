"""The engine's distribution-level acceptance alpha_i = sum_x min(p_i(x), q_i(x)): against a
float64 reference recomputed from fresh target / drafter forwards, against the empirical
acceptance (lossless speculative sampling accepts an examined draft with probability
alpha_i), and outputs unchanged by computing it."""

from __future__ import annotations

import pytest
import torch

import specdec.decode.speculative as speculative
from specdec.decode.drafters import ModelDrafter, NgramDrafter
from specdec.decode.sampling import SamplingParams, logits_to_probs
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

TEXTS = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir("llama", False, layers=2)), backend="torch")


@pytest.fixture(scope="module")
def draft_model(tiny_dir):
    """Another random model with the target's tokenizer: p and q overlap partly."""
    return load_model(str(tiny_dir("llama", False, layers=1, seed=3)), backend="torch")[0]


def spy_rounds(dec: SpeculativeDecoder) -> list[tuple[list[list[int]], object]]:
    """Wrap dec.run_round: record (history before the round, its RoundResult) per round."""
    rounds, run_round = [], dec.run_round

    def spy(state, k, stats):
        before = [list(h) for h in state.history]
        res = run_round(state, k, stats)
        rounds.append((before, res))
        return res

    dec.run_round = spy
    return rounds


def next_probs(model, seqs: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """The processed next-token distribution after each sequence: one fresh forward over the
    sequences padded on the right (causal: the padding is never seen) -> [N, V] float64."""
    n, width = len(seqs), max(map(len, seqs))
    toks = torch.zeros(n, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = torch.tensor(s)
    last = torch.tensor([len(s) - 1 for s in seqs])
    with torch.inference_mode():
        cache = KVCache.for_model(model, n, width)
        logits = model(toks, cache, torch.zeros(n, dtype=torch.long))[torch.arange(n), last]
    return logits_to_probs(logits.double(), params).double()


def reference_alpha(rounds, target, draft, params: SamplingParams):
    """(engine alpha_i, float64 reference) over every drafted position of every round;
    draft None: the drafter has no probabilities (q one-hot on the draft)."""
    engine, seqs, drafted = [], [], []
    for history, res in rounds:
        n_draft = res.n_draft.tolist()
        for b, h in enumerate(history):
            toks = res.draft_tokens[b].tolist()
            for i in range(n_draft[b]):
                engine.append(float(res.alpha[b, i]))
                seqs.append(h + toks[:i])
                drafted.append(toks[i])
            assert (res.alpha[b, n_draft[b] :] == 0).all()  # nothing past n_draft
    assert len(engine) >= 10
    p = next_probs(target, seqs, params)
    x = torch.tensor(drafted)
    if draft is None:
        ref = p[torch.arange(len(x)), x]
    else:
        ref = torch.minimum(p, next_probs(draft, seqs, params)).sum(-1)
    return torch.tensor(engine, dtype=torch.float64), ref


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_alpha_equals_float64_overlap_of_p_and_q(target, draft_model, kind):
    model, tok = target
    params = SamplingParams(temperature=0.7, top_k=40)
    drafter = ModelDrafter(draft_model) if kind == "model" else NgramDrafter(n_max=2, n_min=1)
    dec = SpeculativeDecoder(model, drafter, "speculative", schedule=make_schedule("constant", 3))
    rounds = spy_rounds(dec)
    prompts = [tok.encode(t) * (1 if kind == "model" else 3) for t in TEXTS]
    res = dec.generate(prompts, 24, params, seed=5)
    engine, ref = reference_alpha(rounds, model, draft_model if kind == "model" else None, params)
    assert torch.allclose(engine, ref, atol=2e-5, rtol=0)
    assert 0.02 < float(ref.mean()) < 0.98  # p and q differ: the overlap is not trivial
    # the summary's means are the per-position values' means
    st = res.stats
    assert st["alpha_dist"] == pytest.approx(float(engine.mean()), abs=1e-5)
    examined = [
        float(r.alpha[b, : min(a + 1, d)].sum())
        for _, r in rounds
        for b, (a, d) in enumerate(zip(r.n_accepted.tolist(), r.n_draft.tolist()))
    ]
    seen = sum(
        min(a + 1, d) for _, r in rounds for a, d in zip(r.n_accepted.tolist(), r.n_draft.tolist())
    )
    assert st["alpha_dist_examined"] == pytest.approx(sum(examined) / seen, abs=1e-5)
    per_seq = st["per_sequence"]
    assert [len(s["alpha_dist_per_round"]) for s in per_seq] == [s["rounds"] for s in per_seq]


def test_greedy_alpha_is_argmax_agreement(target, draft_model):
    """Greedy: p one-hot on the argmax, greedy drafts: alpha_i = 1[x_i = argmax p_i], and
    the greedy rule accepts exactly the leading run of ones."""
    model, tok = target
    dec = SpeculativeDecoder(
        model, ModelDrafter(draft_model), "greedy", schedule=make_schedule("constant", 4)
    )
    rounds = spy_rounds(dec)
    dec.generate([tok.encode(t) for t in TEXTS], 20)
    engine, ref = reference_alpha(rounds, model, draft_model, SamplingParams())
    assert set(engine.tolist()) <= {0.0, 1.0}
    assert torch.equal(engine, ref)
    assert 0 < engine.sum() < len(engine)
    for _, r in rounds:
        for b, (a, d) in enumerate(zip(r.n_accepted.tolist(), r.n_draft.tolist())):
            ones = r.alpha[b, :d].tolist() + [0.0]
            assert a == ones.index(0.0)


def test_empirical_acceptance_matches_alpha(target, draft_model):
    """Lossless speculative sampling: an examined draft is accepted with probability
    alpha_i given the past, so sum(accepted - alpha_i) over examined positions is a
    martingale: z-tests for the first draft of each round and for all examined drafts."""
    model, tok = target
    params = SamplingParams(temperature=1.0)
    dec = SpeculativeDecoder(
        model, ModelDrafter(draft_model), "speculative", schedule=make_schedule("constant", 3)
    )
    rounds = spy_rounds(dec)
    prompts = [tok.encode(t) for t in TEXTS] * 16  # 48 sequences
    dec.generate(prompts, 24, params, seed=11)
    first_acc, first_alpha, acc, alpha = [], [], [], []
    for _, r in rounds:
        for b, (a, d) in enumerate(zip(r.n_accepted.tolist(), r.n_draft.tolist())):
            if d == 0:
                continue
            first_acc.append(float(a >= 1))
            first_alpha.append(float(r.alpha[b, 0]))
            for i in range(min(a + 1, d)):
                acc.append(float(i < a))
                alpha.append(float(r.alpha[b, i]))

    def z(observed, expected):
        e = torch.tensor(expected, dtype=torch.float64)
        sd = (e * (1 - e)).sum().sqrt()
        return float((torch.tensor(observed, dtype=torch.float64) - e).sum() / sd)

    assert len(first_acc) > 300
    assert abs(z(first_acc, first_alpha)) < 4
    assert abs(z(acc, alpha)) < 4
    assert 0.1 < sum(first_alpha) / len(first_alpha) < 0.9  # neither always nor never


def test_outputs_unchanged_by_the_statistic(target, draft_model, monkeypatch):
    """Computing alpha_i consumes no randomness and changes nothing else: outputs, per-round
    statistics and the generator's final state equal those of the engine without it."""
    model, tok = target
    params = SamplingParams(temperature=0.8, top_p=0.9)
    prompts = [tok.encode(t) for t in TEXTS]
    runs, gens = [], []

    def keep_generator(device, seed, make=speculative.make_generator):
        gens.append(make(device, seed))
        return gens[-1]

    monkeypatch.setattr(speculative, "make_generator", keep_generator)
    for off in (False, True):
        if off:
            monkeypatch.setattr(speculative, "draft_alpha", lambda *a: None)
        dec = SpeculativeDecoder(
            model, ModelDrafter(draft_model), "speculative", schedule=make_schedule("constant", 3)
        )
        res = dec.generate(prompts, 20, params, seed=3)
        seqs = [
            {k: v for k, v in s.items() if not k.startswith("alpha_dist")}
            for s in res.stats["per_sequence"]
        ]
        runs.append((res.tokens, seqs, gens[-1].get_state(), res.stats["alpha_dist"]))
    (tok_on, seq_on, state_on, alpha_on), (tok_off, seq_off, state_off, alpha_off) = runs
    assert tok_on == tok_off and seq_on == seq_off
    assert torch.equal(state_on, state_off)
    assert alpha_on is not None and alpha_off is None
