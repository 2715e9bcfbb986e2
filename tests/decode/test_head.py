"""The trained draft head: the target's hidden states, the head drafter (lossless, its
cache rolled back), training on a tiny model (acceptance rises above chance), the
held-out check, checkpoints and the CLI."""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import train_head
from specdec.cli.speculative_options import build_speculative
from specdec.decode.drafters import DRAFTERS, make_drafter
from specdec.decode.generation import generate
from specdec.decode.heads.drafter import HeadDrafter, NgramHeadDrafter
from specdec.decode.heads.head import DraftHead, HeadConfig, load_head, save_head
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.generate import build_parser
from specdec.models.load import load_model
from specdec.models.transformer import KVCache
from tests.helpers import assert_head_cache_is_fresh, make_hf_model, one_error_line


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops on a shared 2-core machine: one thread avoids OpenMP barrier stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smooth_target(tmp_path_factory):
    """A tiny random Llama whose layers add small updates to the residual stream (block
    weights x 0.2), as trained models' do: its predictions depend on the context but are
    learnable in seconds. (The widened random models of the other tests are chaotic.)"""
    d = make_hf_model(tmp_path_factory.mktemp("smooth") / "m", layers=2, seed=1)
    f = d / "model.safetensors"
    sd = {k: (v * 0.2 if "proj" in k else v) for k, v in load_file(str(f)).items()}
    save_file(sd, str(f), metadata={"format": "pt"})
    return load_model(str(d))


def _stdlib_files() -> dict[str, list[Path]]:
    """A small corpus: the standard library's email package as documentation, json as code."""
    std = Path(sysconfig.get_paths()["stdlib"])
    return {
        "doc": sorted((std / "email").glob("*.py")),
        "code": sorted((std / "json").glob("*.py")),
    }


def _fake_replies(rounds: list, reply: str = "Answer {i}."):
    """A stand-in for train_head.target_replies: records each round's requests in `rounds`
    and answers request i with `reply` (formatted with i) and an end of turn."""

    def fake(target, tokenizer, requests, seq_len, batch, deadline=None, layers=None):
        rounds.append(list(requests))
        for i, (msg, _) in enumerate(requests):
            ids = train_head.request_ids(tokenizer, msg, seq_len)
            seq = ids + tokenizer.encode(reply.format(i=i)) + [tokenizer.eos_id]
            yield i, (seq + [0] * seq_len)[: seq_len + 1], None

    return fake


@pytest.fixture(scope="module")
def head_data(smooth_target):
    """Training data on the smooth target -> (config, data, held, manifest)."""
    model, tok = smooth_target
    files = _stdlib_files()
    cfg = HeadConfig.for_target(model, None, 200)
    chunks, held, manifest, pre = train_head.build_corpus(
        tok, 12000, 48, 0, files, target=model, generated=0.5, layers=cfg.feature_layers
    )
    assert 0 < int(pre["has"].sum()) == manifest["reply_chunks"] < len(chunks)
    data = train_head.extract(model, chunks, cfg.feature_layers, 32, pre=pre)
    assert data.pop("kept").tolist() == list(range(len(chunks)))
    return cfg, data, held, manifest


def _train(model, head_data, out: Path, **kw):
    """A head trained on head_data for 200 steps (seconds) from a seeded init -> report."""
    cfg, data, held, _ = head_data
    torch.manual_seed(0)
    head = DraftHead(cfg, model.config)
    head.set_vocab(train_head.frequent_tokens(data["top_ids"][~held], cfg.vocab_size, 200))
    head.attach(model)
    res = train_head.train(
        head, data, held, out, steps=200, minutes=1, batch=16, lr=1e-2, unroll=2, seed=0,
        resume=False, **kw,
    )  # fmt: skip
    save_head(head, out)
    return res


@pytest.fixture(scope="module")
def trained(smooth_target, head_data, tmp_path_factory):
    """A head trained on the smooth target for 200 steps (seconds) -> (dir, report)."""
    out = tmp_path_factory.mktemp("head")
    return out, _train(smooth_target[0], head_data, out), head_data[3]


def test_reply_features_read_off_generation_equal_a_prefill(smooth_target):
    """target_replies records the features and top-8 of every position while it generates
    (prompt positions from the ragged prefill, reply positions from the decode steps); they
    must equal what `extract`'s batched prefill computes over the finished sequences, and
    the tokens must be the target's greedy continuation."""
    model, tok = smooth_target
    layers = HeadConfig.for_target(model).feature_layers
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    requests = [(" ".join(words[: 2 + 3 * i]), "test") for i in range(5)]
    seq_len = 40
    got = list(train_head.target_replies(model, tok, requests, seq_len, 2, layers=layers))
    assert sorted(i for i, _, _ in got) == list(range(5))
    chunks = torch.tensor([t for _, t, _ in got])
    ref = train_head.extract(model, chunks, layers, 5)
    for r, (i, toks, rec) in enumerate(got):
        ids = tok.encode_chat(requests[i][0]) if tok.chat_template else tok.encode(requests[i][0])
        ids = ids[-(seq_len // 2) :]  # a prompt keeps its last seq_len / 2 tokens
        n = len(ids)
        assert toks[:n] == ids
        assert toks[n:] == generate(model, [ids], seq_len + 1 - n).tokens[0]
        torch.testing.assert_close(
            rec["feats"].float(), ref["feats"][r].float(), atol=2e-3, rtol=2e-3
        )
        assert torch.equal(rec["top_ids"][:, 0], ref["top_ids"][r, :, 0])
        torch.testing.assert_close(
            rec["top_logp"].float(), ref["top_logp"][r].float(), atol=2e-2, rtol=2e-3
        )


def test_extract_keeps_precomputed_rows_and_stops_at_the_deadline(smooth_target):
    model, tok = smooth_target
    layers = HeadConfig.for_target(model).feature_layers
    chunks = torch.randint(0, model.config.vocab_size, (6, 17))
    full = train_head.extract(model, chunks, layers, 4)
    pre = {k: torch.full_like(full[k], 7) for k in ("feats", "top_ids", "top_logp")}
    pre["has"] = torch.tensor([False, True, False, False, True, False])
    merged = train_head.extract(model, chunks, layers, 3, pre=pre)
    assert merged.pop("kept").tolist() == list(range(6))
    for k in ("feats", "top_ids", "top_logp"):
        assert (merged[k][pre["has"]] == 7).all()  # taken as given, not recomputed
        torch.testing.assert_close(merged[k][~pre["has"]], full[k][~pre["has"]])
    late = train_head.extract(model, chunks, layers, 3, deadline=0.0, pre=pre)
    assert late["kept"].tolist() == [1, 4] and torch.equal(late["chunks"], chunks[[1, 4]])


def _prompts(tok):
    texts = ["the the the the", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 =", "Spec"]
    return [tok.encode(t) for t in texts]


def _untrained(model, directory: Path, vocab_top: int = 0) -> Path:
    torch.manual_seed(3)
    cfg = HeadConfig.for_target(model, None, vocab_top)
    head = DraftHead(cfg, model.config)
    head.set_vocab(torch.randperm(cfg.vocab_size)[: cfg.vocab_top].sort().values)
    save_head(head, directory)
    return directory


def _untrained_head_and_batch(model, seed: int):
    """A seeded untrained full-vocabulary head and a batch of 3 random chunks -> (head,
    batch for step_losses, vocabulary index)."""
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(model, None, 0)
    head = DraftHead(cfg, model.config).attach(model)
    chunks = torch.randint(0, model.config.vocab_size, (3, 13))
    data = train_head.extract(model, chunks, cfg.feature_layers, 3)
    data.pop("kept")
    return head, data, torch.arange(cfg.vocab_size)


def test_feature_loss_is_the_cosine_to_the_next_last_layer_state(
    smooth_target, tmp_path, monkeypatch
):
    """--feature-loss w adds w * mean(1 - cos(h_i, f_{i+1})) per unroll step, f the target's
    last feature layer after the next token (recomputed here in float64 from the head's own
    unrolled outputs); a feature-layer list not ending with the last layer is refused."""
    model, _ = smooth_target
    head, data, index = _untrained_head_and_batch(model, 5)
    with torch.no_grad():
        plain, _ = train_head.step_losses(head, data, index, 2)
        more, _ = train_head.step_losses(head, data, index, 2, feature_loss=0.5)
        outs = head.unroll(data["feats"].float(), data["chunks"], 2)
    f = data["feats"].double()[:, 1:, -1]
    for s, h in enumerate(outs):
        a, b = h.double()[:, s:-1], f[:, s:]
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        want = 0.5 * (1 - cos).mean()
        assert 0.05 < float(want)  # an untrained head is far from the target's state
        torch.testing.assert_close((more[s] - plain[s]).double(), want, rtol=1e-4, atol=1e-6)
    monkeypatch.setattr("specdec.models.load.load_model", lambda *a, **k: smooth_target)
    argv = ["--model", "tiny", "--out", str(tmp_path), "--feature-loss", "1"]
    with pytest.raises(SpecDecError, match="must end with"):
        train_head.run(train_head.build_parser().parse_args([*argv, "--feature-layers", "0"]))


def test_feature_noise_perturbs_the_inputs_by_their_rms_and_is_seeded(smooth_target):
    """--feature-noise s feeds the head f + s * rms(f) * N(0, 1) (drawn from the training
    generator: the same state gives the same loss) instead of f; the feature-loss targets
    stay clean (reconstructed here by unrolling on the noised features by hand)."""
    model, _ = smooth_target
    head, data, index = _untrained_head_and_batch(model, 6)
    g = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    with torch.no_grad():
        clean, _ = train_head.step_losses(head, data, index, 2)
        a, _ = train_head.step_losses(head, data, index, 2, None, 0.5, 0.3, g())
        b, _ = train_head.step_losses(head, data, index, 2, None, 0.5, 0.3, g())
        f = data["feats"].float()
        noise = torch.randn(f.shape, generator=g())
        noised = {**data, "feats": f + 0.3 * f.pow(2).mean(-1, keepdim=True).sqrt() * noise}
        by_hand, _ = train_head.step_losses(head, noised, index, 2)
        outs = head.unroll(noised["feats"], data["chunks"], 2)
    torch.testing.assert_close(a, b)
    assert (a - clean).abs().min() > 1e-4  # 0.3 of the RMS changes every step's loss
    nxt = f[:, 1:, -1]  # the clean next last-layer state is the feature-loss target
    for s, h in enumerate(outs):
        cos = torch.nn.functional.cosine_similarity(h[:, s:-1], nxt[:, s:], dim=-1)
        torch.testing.assert_close(a[s], by_hand[s] + 0.5 * (1 - cos).mean(), rtol=1e-4, atol=1e-5)


def test_hidden_layers_are_the_residual_stream_after_each_layer(tiny_dir):
    model, _ = load_model(str(tiny_dir("llama", False, layers=3)))
    B, T = 2, 7
    x = torch.randint(0, model.config.vocab_size, (B, T))
    start = torch.tensor([0, 3])
    cache = KVCache.for_model(model, B, 16)
    ref = model(x, cache, start)
    logits, hidden = model(x, cache, start, hidden_layers=(2, 0))
    assert hidden.shape == (B, T, 2, model.config.dim) and hidden.dtype == torch.float32
    torch.testing.assert_close(logits, ref)
    for j, i in enumerate((2, 0)):
        # the final norm + LM head of the stream after layer i = early exit after layer i
        exit_i = model(x, cache, start, layers=range(i + 1))
        torch.testing.assert_close(model.lm_head(model.norm(hidden[:, :, j])), exit_i)
    with pytest.raises(ValueError, match="hidden_layers"):
        model(x, cache, start, layers=[0], hidden_layers=(1,))


@pytest.mark.parametrize("vocab_top", [0, 64])
def test_untrained_head_drafter_is_lossless(tiny_dir, tmp_path, vocab_top):
    model, tok = load_model(str(tiny_dir("llama", False, layers=2)))
    prompts = _prompts(tok)
    ref = generate(model, prompts, 20).tokens
    path = _untrained(model, tmp_path / "h", vocab_top)
    for k in (1, 3):
        drafter = HeadDrafter(model, str(path))
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
        res = dec.generate(prompts, 20)
        assert res.tokens == ref
        assert res.stats["drafter"] == "head" and res.stats["drafted"] > 0
        _check_head_cache(model, drafter, prompts, res.tokens, k)


def _check_head_cache(model, drafter, prompts, outs, k):
    """After rejections, the head's cache holds what a fresh head fed only the committed
    tokens (with the target's features) computes: the rollback is exact."""
    head = drafter.head
    for b, (p, t) in enumerate(zip(prompts, outs)):
        full = torch.tensor([p + t])
        fed = drafter.fed[b]
        # at most one round behind the emitted tokens (the last round's features are unread)
        assert len(p) + len(t) - 1 - (k + 1) <= fed <= len(p) + len(t) - 1
        cache = KVCache.for_model(model, 1, full.shape[1])
        _, feats = model(
            full, cache, torch.zeros(1, dtype=torch.long), hidden_layers=head.cfg.feature_layers
        )
        assert_head_cache_is_fresh(drafter, b, feats, full)


def test_trained_head_acceptance_rises_well_above_chance(smooth_target, trained):
    model, tok = smooth_target
    out, res, _ = trained
    agree = res["heldout_top1_agreement_per_step"]
    chance = res["heldout_majority_baseline"]  # always guessing the most frequent token
    assert agree[0] > max(0.3, 2 * chance) and agree[1] > max(0.25, 2 * chance)
    losses = [r["loss"][0] for r in res["log"]]
    assert sum(losses[-20:]) < 0.7 * sum(losses[:20])
    prompts = _prompts(tok)
    ref = generate(model, prompts, 24).tokens
    alphas = {}
    for name, path in (("trained", out), ("untrained", _untrained(model, out / "untrained"))):
        dec = SpeculativeDecoder(
            model, HeadDrafter(model, str(path)), "greedy", schedule=make_schedule("constant", 3)
        )
        got = dec.generate(prompts, 24)
        assert got.tokens == ref  # lossless, trained or not
        alphas[name] = got.stats["alpha"]
    assert alphas["trained"] > max(0.2, alphas["untrained"] + 0.15), alphas


def test_bf16_autocast_training_runs_in_bf16_and_learns_as_fp32_does(
    smooth_target, head_data, trained, tmp_path, monkeypatch
):
    """--train-dtype bfloat16: the training forward's draft logits come out of bf16 matmuls
    (autocast), the evaluation's in fp32; from the same init and batches the head learns
    about as well as in fp32, and its losses differ from fp32's (it did run in bf16)."""
    model, _ = smooth_target
    seen = []
    logits = DraftHead.logits

    def spy(self, h):
        out = logits(self, h)
        seen.append((torch.is_grad_enabled(), out.dtype))
        return out

    monkeypatch.setattr(DraftHead, "logits", spy)
    res = _train(model, head_data, tmp_path, compute_dtype=torch.bfloat16)
    assert {d for g, d in seen if g} == {torch.bfloat16}  # training steps
    assert {d for g, d in seen if not g} == {torch.float32}  # held-out evaluation
    ref = trained[1]
    agree, ref_agree = (
        res["heldout_top1_agreement_per_step"],
        ref["heldout_top1_agreement_per_step"],
    )
    chance = res["heldout_majority_baseline"]
    assert agree[0] > max(0.3, 2 * chance) and agree[0] > ref_agree[0] - 0.05, (agree, ref_agree)
    first, ref_first = res["log"][0]["loss"][0], ref["log"][0]["loss"][0]
    assert first != ref_first and abs(first - ref_first) < 0.02 * ref_first


def test_validation_curve_is_held_out_agreement_and_leaves_training_alone(
    smooth_target, head_data, trained, tmp_path
):
    """--val-every: the held-out agreement of the first val_chunks held-out chunks before
    the first step, every N steps and after the last; it is the saved head's agreement on
    those chunks, rises as the head learns, and validating draws nothing from the training
    generator (the same batches, the same head as without it). The curve's last point and
    the held-out report are measured on the head rounded as it is saved (fp16): with the
    fp32 weights a near-tie flipped one of 235 tokens under torch 2.11."""
    model, _ = smooth_target
    _, data, held, _ = head_data
    res = _train(model, head_data, tmp_path, val_every=60, val_chunks=5)
    curve = res["heldout_curve"]
    assert [r["step"] for r in curve] == [0, 60, 120, 180, 200]
    assert res["heldout_curve_chunks"] == 5 and trained[1]["heldout_curve"] == []
    assert res["heldout_top1_agreement_per_step"] == trained[1]["heldout_top1_agreement_per_step"]
    assert [r["loss"] for r in res["log"]] == [r["loss"] for r in trained[1]["log"]]
    head = load_head(tmp_path, model)
    val = {k: v[held][:5] for k, v in data.items()}
    index = train_head.vocab_index(head)
    want = train_head.evaluate(head, val, index, 2, 16)
    assert curve[-1]["agree"] == pytest.approx(want, abs=1e-6)
    test = {k: v[held] for k, v in data.items()}  # the report's numbers are the saved head's too
    want = train_head.evaluate(head, test, index, 2, 16)
    assert res["heldout_top1_agreement_per_step"] == pytest.approx(want, abs=1e-6)
    mask = train_head.reply_mask(val["chunks"], [])
    want = train_head.evaluate(head, val, index, 2, 16, mask)
    assert curve[-1]["agree_replies"] == pytest.approx(want, abs=1e-6)
    assert curve[-1]["agree"][0] > curve[0]["agree"][0] + 0.2
    assert json.loads((tmp_path / "state.json").read_text())["val"] == curve  # resumable


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_head_is_lossless_and_catches_up_after_ngram_rounds(smooth_target, trained, k):
    """n-gram rounds leave the head's features unread; the next head round feeds them all:
    output equals plain greedy, and the head cache equals a fresh head's on the committed
    tokens (the rollback stays exact across rounds the head skipped). Each prompt alone
    (rounds without any head draft happen) and all four in one batch."""
    model, tok = smooth_target
    out, _, _ = trained
    prompts = _prompts(tok)
    ref = generate(model, prompts, 24).tokens
    skipped = 0
    for idx in ([0], [1], [2], [3], [0, 1, 2, 3]):
        batch = [prompts[i] for i in idx]
        drafter = make_drafter("ngram_head", model, path=str(out))
        assert isinstance(drafter, NgramHeadDrafter)
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
        res = dec.generate(batch, 24)
        assert res.tokens == [ref[i] for i in idx]
        assert res.stats["drafter"] == "ngram_head" and res.stats["drafted"] > 0
        skipped += drafter.skipped
        if len(idx) > 1:
            assert drafter.rounds["ngram"] > 0 and drafter.rounds["head"] > 0, drafter.rounds
        with torch.inference_mode():  # feed what the last n-gram rounds left unread
            drafter.catch_up([p + t for p, t in zip(batch, res.tokens)], None, None)
        for b, (p, t) in enumerate(zip(batch, res.tokens)):
            full = torch.tensor([p + t])
            assert len(p) + len(t) - 1 - (k + 1) <= drafter.fed[b] <= len(p) + len(t) - 1
            cache = KVCache.for_model(model, 1, full.shape[1])
            _, feats = model(
                full, cache, torch.zeros(1, dtype=torch.long), hidden_layers=drafter.target_features
            )
            assert_head_cache_is_fresh(drafter, b, feats, full)
    assert skipped > 0  # some rounds ran without the head


def test_ngram_head_picks_per_sequence_and_keeps_sampling_probs_valid(smooth_target, trained):
    """A batch where one sequence repeats itself (n-gram match) and the others do not:
    the repeating row gets the n-gram continuation with one-hot probabilities, the others
    the head's own draft (the same tokens and probabilities as draft=head), or nothing
    when min_match asks for more than the lookup found."""
    from specdec.decode.drafters import DraftRequest
    from specdec.decode.generation import prefill

    model, tok = smooth_target
    out, _, _ = trained
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rep = (torch.randperm(V - 3, generator=g)[:5] + 3).tolist()  # 5 distinct tokens
    other = (torch.randperm(V - 3, generator=g)[:6] + 3).tolist()  # no token repeats
    prompts = [rep + rep[:2], other]
    params = SamplingParams(temperature=0.8)

    def request(drafter, k):
        cache = KVCache.for_model(model, 2, 64)
        drafter.begin(model, cache, prompts, 64)
        _, feats = prefill(model, prompts, cache, hidden_layers=drafter.target_features)
        return DraftRequest(
            [list(p) for p in prompts],
            torch.full((2,), k),
            params,
            torch.Generator().manual_seed(0),
            features=feats,
            n_features=cache.lens.clone(),
        )

    hybrid = NgramHeadDrafter(model, str(out), p_min=0.0)
    d = hybrid.propose(request(hybrid, 3))
    assert d.n_draft.tolist() == [3, 3]
    assert d.tokens[0].tolist() == rep[2:5]  # the continuation of the earlier "rep[0:2]"
    assert torch.equal(d.probs[0], torch.nn.functional.one_hot(d.tokens[0], V).float())
    plain = HeadDrafter(model, str(out))
    ref = plain.propose(request(plain, 3))
    torch.testing.assert_close(d.probs[1], ref.probs[1])
    assert hybrid.rounds == {"ngram": 1, "head": 1}
    strict = NgramHeadDrafter(model, str(out), min_match=5, p_min=0.0)  # lookup finds <= 4
    d = strict.propose(request(strict, 4))
    assert strict.rounds == {"ngram": 0, "head": 2} and d.n_draft.tolist() == [4, 4]
    torch.testing.assert_close(d.probs.sum(-1), torch.ones(2, 4))
    # p_min cuts the head's chain (not the n-gram's): a prefix of the uncut chain
    drafts = {}
    for name, p_min, schedule_p_min in (
        ("full", 0.0, 0.0),
        ("cut", 0.9, 0.0),
        ("loose", 0.9, 0.05),
    ):
        drafter = NgramHeadDrafter(model, str(out), p_min=p_min)
        drafts[name] = drafter.propose(replace(request(drafter, 6), p_min=schedule_p_min))
    full, cut = drafts["full"], drafts["cut"]
    assert cut.n_draft[0] == full.n_draft[0] == 5  # rep[2:5] + rep[0:2]: the history ends
    n = int(cut.n_draft[1])
    assert n < int(full.n_draft[1]) == 6
    assert torch.equal(cut.tokens[1, :n], full.tokens[1, :n])
    assert int(drafts["loose"].n_draft[1]) > n  # a schedule's p_min wins over the drafter's


def test_ngram_head_backoff_skips_a_failing_head_and_stays_lossless(smooth_target, tmp_path):
    """An untrained head is almost never accepted: with backoff it is asked in far fewer
    rounds (1, 2, 4, ... skipped after each failure), the output is unchanged."""
    model, tok = smooth_target
    prompts = _prompts(tok)[1:]  # the text without an immediate repetition
    ref = generate(model, prompts, 32).tokens
    path = _untrained(model, tmp_path / "h")
    asked = {}
    for backoff in (0, 8):
        drafter = NgramHeadDrafter(model, str(path), p_min=0.0, backoff=backoff)
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 3))
        assert dec.generate(prompts, 32).tokens == ref
        asked[backoff] = drafter.rounds["head"]
    assert 0 < asked[8] < 0.6 * asked[0], asked
    with pytest.raises(SpecDecError, match="backoff must be >= 0"):
        NgramHeadDrafter(model, str(path), backoff=-1)


def test_ngram_head_refuses_trees_and_bad_min_match(smooth_target, trained):
    from specdec.decode.tree_round import make_tree_spec

    model, _ = smooth_target
    out, _, _ = trained
    with pytest.raises(SpecDecError, match="min_match must be >= 1"):
        NgramHeadDrafter(model, str(out), min_match=0)
    drafter = NgramHeadDrafter(model, str(out))
    with pytest.raises(SpecDecError, match="chains only"):
        SpeculativeDecoder(
            model, drafter, "greedy", schedule=make_schedule("constant", 3),
            tree=make_tree_spec(topk=2, budget=4),
        )  # fmt: skip
    args = build_parser().parse_args(["--prompt", "x", "--draft", f"ngram-head:{out}"])
    assert isinstance(build_speculative(args, model).drafter, NgramHeadDrafter)


def test_head_drafts_sample_within_its_vocabulary(smooth_target, trained):
    model, tok = smooth_target
    out, _, _ = trained
    drafter = HeadDrafter(model, str(out))
    dec = SpeculativeDecoder(model, drafter, "speculative", schedule=make_schedule("constant", 3))
    res = dec.generate(_prompts(tok), 16, SamplingParams(temperature=0.8), seed=0)
    assert all(len(t) == 16 for t in res.tokens) and res.stats["drafted"] > 0
    vocab = set(drafter.head.vocab_map.tolist())
    from specdec.decode.drafters import DraftRequest

    drafter.begin(model, dec.cache, _prompts(tok), 64)
    cache = KVCache.for_model(model, 4, 64)
    from specdec.decode.generation import prefill

    prompts = _prompts(tok)
    _, feats = prefill(model, prompts, cache, hidden_layers=drafter.target_features)
    req = DraftRequest(
        [p + [1] for p in prompts],
        torch.full((4,), 3),
        SamplingParams(temperature=0.8),
        torch.Generator().manual_seed(0),
        features=feats,
        n_features=cache.lens.clone(),
    )
    draft = drafter.propose(req)
    assert set(draft.tokens.flatten().tolist()) <= vocab
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4, 3))
    off = torch.ones(model.config.vocab_size, dtype=torch.bool)
    off[drafter.head.vocab_map] = False
    assert float(draft.probs[..., off].abs().max()) == 0.0


def test_training_text_holds_out_the_evaluation_prompts(smooth_target, trained):
    model, tok = smooth_target
    _, _, manifest = trained
    check = manifest["heldout_check"]
    assert check["window_tokens"] == 8 and check["eval_windows"] > 1000
    assert {"specbench_mini.jsonl", "code_edit.jsonl"} <= set(check["eval_texts"])
    # a file quoting an evaluation prompt is dropped, the others are kept
    row = json.loads(Path("experiments/data/specbench_mini.jsonl").read_text().splitlines()[3])
    prompt = row["messages"][0]["content"]
    windows, _ = train_head.heldout_windows(tok)
    ids = tok.backend.encode("Some words first. " + prompt, add_special_tokens=False).ids
    assert train_head.has_window(ids, windows)
    names = [p.name.lower() for ps in train_head.corpus_files().values() for p in ps]
    assert not any("humaneval" in n or "human_eval" in n for n in names)


def test_head_checkpoint_round_trip_and_wrong_target(smooth_target, trained, tiny_dir):
    model, _ = smooth_target
    out, _, _ = trained
    head = load_head(out, model)
    state = load_file(str(out / "head.safetensors"))
    assert state["wqkv.weight"].dtype == torch.float16 and state["vocab_map"].dtype == torch.int32
    torch.testing.assert_close(head.wqkv.weight, state["wqkv.weight"].float())
    other, _ = load_model(str(tiny_dir("llama", False, layers=2)))
    with pytest.raises(SpecDecError, match="different target"):
        load_head(out, other)
    with pytest.raises(SpecDecError, match="no trained head"):
        load_head(out / "nope", model)
    with pytest.raises(SpecDecError, match="no shipped draft head"):
        make_drafter("head", other)


def test_head_from_cli_and_config(smooth_target, trained):
    from omegaconf import OmegaConf

    from experiments.components import make_drafter as from_config

    model, _ = smooth_target
    out, _, _ = trained
    assert DRAFTERS["head"] is HeadDrafter
    args = build_parser().parse_args(["--prompt", "x", "--draft", f"head:{out}", "--k", "3"])
    dec = build_speculative(args, model)
    assert isinstance(dec.drafter, HeadDrafter) and dec.drafter.path == out
    cfg = OmegaConf.load("configs/draft/head.yaml")
    cfg.path = str(out)
    assert isinstance(from_config(cfg, model), HeadDrafter)
    args = build_parser().parse_args(["--prompt", "x", "--draft", "ngram:3"])
    with pytest.raises(SpecDecError, match="no NAME:VALUE"):
        build_speculative(args, model)


def test_train_head_cli_resumes(smooth_target, tmp_path, monkeypatch):
    """The command end to end on the tiny target: files written, --resume continues."""
    model, tok = smooth_target
    monkeypatch.setattr(
        train_head, "corpus_files", lambda: {"doc": [], "code": _stdlib_files()["code"]}
    )
    monkeypatch.setattr("specdec.models.load.load_model", lambda *a, **k: (model, tok))
    out = tmp_path / "run"
    common = ["--model", "tiny", "--out", str(out), "--tokens", "3000", "--seq-len", "32"]
    common += ["--batch", "8", "--generated", "0", "--threads", "1"]
    train_head.main([*common, "--steps", "6"])
    for name in ("head.safetensors", "head.json", "loss.png", "report.json", "data.safetensors"):
        assert (out / name).is_file(), name
    assert json.loads((out / "state.json").read_text())["step"] == 6
    train_head.main([*common, "--steps", "9", "--resume"])
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 9 and len(report["heldout_top1_agreement_per_step"]) == 3


@pytest.mark.parametrize("held", [[False] * 5, [True] * 3, []])
def test_a_split_without_training_or_held_out_chunks_is_one_clear_error(held):
    """A data pass cut short (tiny --minutes) can keep no held-out chunk, or nothing else:
    a SpecDecError naming the counts, not a traceback from the report's statistics."""
    with pytest.raises(SpecDecError, match=rf"kept {len(held)} chunks, .* held out"):
        train_head.check_split(torch.tensor(held, dtype=torch.bool))
    train_head.check_split(torch.tensor([False, True, False]))  # both sides: fine


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--generated", "1.5"], "--generated must be in"),
        (["--data-share", "0"], "--data-share must be in"),
        (["--minutes", "-3"], "--minutes must be > 0"),
        (["--eval-minutes", "5", "--minutes", "4"], "--eval-minutes must be in"),
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--feature-loss", "-0.5"], "--feature-loss must be >= 0"),
        (["--feature-noise", "-0.1"], "--feature-noise must be >= 0"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["--val-every", "-1"], "--val-every must be >= 0"),
        (["--val-chunks", "0"], "--val-chunks must be >= 1"),
        (["--derived", "1"], "--derived must be in"),
        (["--self-prompts", "1.5"], "--self-prompts must be in"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--vocab-top", "-1"], "--vocab-top must be >= 0"),
        (["--dtype", "fp8"], "invalid dtype 'fp8'"),
        (["--train-dtype", "float16"], "--train-dtype must be float32, bfloat16 or auto"),
        (["--train-dtype", "fp8"], "--train-dtype must be float32, bfloat16 or auto"),
    ],
)
def test_train_head_refuses_absurd_values_before_loading(
    argv, message, tmp_path, monkeypatch, capsys
):
    """One error line and exit 2, before the target loads and before DIR is made."""
    from specdec.cli import user_errors

    def no_model(*a, **k):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr("specdec.models.load.load_model", no_model)
    line = one_error_line(
        capsys, user_errors(train_head.main), ["--out", str(tmp_path / "run"), *argv]
    )
    assert line.startswith(f"error: {message}"), line
    assert not (tmp_path / "run").exists()


def test_shipped_head_is_found_for_smollm2_and_lossless(smollm2):
    model, tok = smollm2
    drafter = make_drafter("head", model)
    assert drafter.path == Path("specdec/decode/heads/smollm2-135m").resolve()
    prompt = [tok.encode_chat("Name three colors.")]
    ref = generate(model, prompt, 12).tokens
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
    assert dec.generate(prompt, 12).tokens == ref


def test_reply_mask_leaves_out_the_chat_template(smollm2):
    """Held-out agreement on replies: positions before an assistant reply's first token
    (system prompt, user turn, header: the same in every chat) are not counted."""
    _, tok = smollm2
    header = train_head.assistant_header(tok)
    assert tok.decode(header) == "<|im_start|>assistant\n"
    text = "How do I sort a list?\n\n" + "Use sorted(xs) or xs.sort(); both are stable. " * 8
    ids = train_head.as_chat(tok, text)
    first_reply = next(
        i + len(header) for i in range(len(ids)) if ids[i : i + len(header)] == header
    )
    n = first_reply + 20
    plain = tok.encode("Plain text without any template, " * 40)[:n]
    chunks = torch.tensor([ids[:n], plain])
    mask = train_head.reply_mask(chunks, header)
    assert mask.shape == (2, n - 1)
    # position i predicts token i + 2: counted from the one that predicts the first reply token
    assert not mask[0, : first_reply - 1].any() and mask[0, first_reply - 1 :].all()
    assert mask[1].all()
    assert train_head.reply_mask(chunks, []).all()


def test_open_prompts_are_open_ended_and_seeded():
    import random

    a = train_head.open_prompts(random.Random(1), 30)
    assert a == train_head.open_prompts(random.Random(1), 30)
    assert len(a) == 30 and len(set(a)) > 20
    assert sum("step by step" in m or "reasoning" in m or "Explain." in m for m in a) >= 4


def test_draft_lm_head_on_cpu_matches_a_float64_reference(smooth_target, trained):
    """Drafting on CPU runs the draft LM head through the CPU linear policy (oneDNN
    prepacked where it runs); its logits match float64 math on the same rows, and training
    (grad enabled) keeps the differentiable F.linear."""
    model, _ = smooth_target
    out, _, _ = trained
    head = HeadDrafter(model, str(out)).head
    h = torch.randn(3, 5, head.cfg.dim)
    w, eps = head.final_norm
    x = h.double()
    ref = (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    ) @ head.lm_weight.double().T
    with torch.inference_mode():
        got = head.logits(h)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    from specdec.models.cpu_linear import cpu_features

    assert (head.lm_kernel is not None) == bool(cpu_features()["mkldnn"])
    hg = h.clone().requires_grad_(True)
    head.logits(hg).sum().backward()
    assert hg.grad is not None and torch.isfinite(hg.grad).all()


def _first_round(n: int) -> list[tuple]:
    """First-round replies as build_corpus records them: (message, reply text, ended, is
    held, is open-ended); replies to snippet requests (not open-ended) and unfinished ones."""
    out = []
    for i in range(n):
        text = f"Reply {i} says that item {i} matters. It has {i + 2} parts. " * (1 + i % 4)
        out.append(
            (f"Question {i} about topic {i}?", text.strip(), i % 5 != 4, i % 7 == 0, i % 3 != 2)
        )
    return out


def test_derived_requests_quote_first_round_replies():
    """The second round's requests: a third summaries of a reply, a third answers from 2-3
    numbered replies (the question is one of theirs), a third two-turn chats; only replies
    to open-ended requests, only finished ones for sources and chats; a request made from a
    held-out reply is held out; seeded."""
    import random

    first = _first_round(40)
    by_msg = {r[0]: r for r in first}
    got = train_head.derived_requests(random.Random(3), first, 30)
    assert got == train_head.derived_requests(random.Random(3), first, 30)
    assert len(got) == 30
    kinds = Counter()
    for msg, held in got:
        if isinstance(msg, list):  # follow-up: the reply as the first assistant turn
            kinds["chat"] += 1
            user, reply, follow = msg
            src = by_msg[user["content"]]
            assert src[2] and src[4] and held == src[3]
            assert src[1].startswith(reply["content"]) and reply["role"] == "assistant"
            assert follow["content"] in train_head.FOLLOW_UPS
        elif "[1] " in msg:
            kinds["sources"] += 1
            cited = [r for r in first if r[4] and r[2] and r[1][:30] in msg]
            assert 2 <= len(cited) <= 3
            asked = [r for r in cited if msg.rstrip().endswith(r[0])]
            assert len(asked) == 1 and held == asked[0][3]
        else:
            kinds["summary"] += 1
            src = [r for r in first if r[4] and r[1][:60] in msg]
            assert len(src) == 1 and held == src[0][3] and len(src[0][1]) >= 200
    assert kinds == {"chat": 10, "sources": 10, "summary": 10}
    assert train_head.derived_requests(random.Random(0), [], 5) == []


def test_reply_text_and_a_conversation_as_a_request(smollm2):
    _, tok = smollm2
    chat = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Make it shorter."},
    ]
    ids = train_head.request_ids(tok, chat, 10**6)
    text = tok.decode(ids)
    assert text.index("Name a fruit.") < text.index("An apple.") < text.index("Make it shorter.")
    assert ids[-len(train_head.assistant_header(tok)) :] == train_head.assistant_header(tok)
    assert len(train_head.request_ids(tok, chat, 20)) == 10  # its last seq_len / 2 tokens
    eos = tok.eos_id
    seq = train_head.request_ids(tok, "Hi?", 256) + tok.encode("Hello there.") + [eos] + [5] * 9
    assert train_head.reply_text(tok, "Hi?", seq, 256) == ("Hello there.", True)
    cut = train_head.request_ids(tok, "Hi?", 256) + tok.encode("Hello there, how")
    assert train_head.reply_text(tok, "Hi?", cut, 256) == ("Hello there, how", False)


def test_build_corpus_adds_a_second_round_made_from_the_first(smollm2, monkeypatch):
    """With `derived`, build_corpus asks the target a second round of requests made from
    its first-round replies (counted under their own source), each whole within half a
    chunk; without, one round."""
    _, tok = smollm2
    seq_len, rounds = 256, []

    reply = ("Answer {i}: the topic is useful. It helps people every day. " * 4).strip()
    monkeypatch.setattr(train_head, "target_replies", _fake_replies(rounds, reply))
    files = _stdlib_files()
    chunks, held, manifest, _ = train_head.build_corpus(
        tok, 60 * seq_len, seq_len, 0, files, target=object(), generated=0.8, derived=0.3
    )
    assert len(rounds) == 2
    first, second = rounds
    n_gen = len(first) + len(second)
    assert len(second) == int(n_gen * 0.3) > 5
    firsts = [f"Answer {i}: the topic is useful" for i in range(len(first))]
    for msg, _ in second:
        text = json.dumps(msg)
        assert any(a in text for a in firsts)
        assert len(train_head.request_ids(tok, msg, 10**6)) <= seq_len // 2
    assert manifest["chunks_by_source"][f"{train_head.DERIVED_SOURCE} (target reply)"] == len(
        second
    )
    rounds.clear()
    train_head.build_corpus(tok, 60 * seq_len, seq_len, 0, files, target=object(), generated=0.8)
    assert len(rounds) == 1


def test_self_requests_are_user_messages_the_target_writes(smollm2):
    """--self-prompts: the chat template up to a user turn's text, then the target writes
    the message (sampled, seeded); distinct finished messages of >= 16 characters."""
    model, tok = smollm2
    prefix = train_head.user_prefix(tok)
    assert tok.encode_chat("Name a fruit.")[: len(prefix)] == prefix
    assert tok.decode(prefix).endswith("user\n") and "Name a fruit" not in tok.decode(prefix)
    got = train_head.self_requests(model, tok, 3, seed=5, batch=3, max_tokens=40)
    assert got == train_head.self_requests(model, tok, 3, seed=5, batch=3, max_tokens=40)
    assert got != train_head.self_requests(model, tok, 3, seed=6, batch=3, max_tokens=40)
    assert 1 <= len(got) <= 3 and len(set(got)) == len(got)
    for msg in got:
        assert len(msg) >= 16 and "<|im" not in msg and msg == msg.strip()


def test_self_requests_need_a_chat_template(smooth_target, monkeypatch):
    model, tok = smooth_target
    monkeypatch.setattr(tok, "chat_template", None)
    assert train_head.user_prefix(tok) == []
    with pytest.raises(SpecDecError, match="--self-prompts needs a chat template"):
        train_head.self_requests(model, tok, 2, seed=0)


def test_build_corpus_asks_a_share_of_self_written_requests(smollm2, monkeypatch):
    """With `self_prompts`, that share of the first round's requests are the target's own
    messages, spread through the others (a deadline keeps every kind), counted under their
    own source, with examples in the manifest."""
    _, tok = smollm2
    seq_len, rounds = 256, []

    def fake_self(target, tokenizer, n, seed, batch=32, max_tokens=96, deadline=None):
        assert 16 <= max_tokens <= min(64, seq_len // 2 - len(train_head.user_prefix(tokenizer)))
        return [f"Self-written request number {j} about item {j}?" for j in range(n)]

    monkeypatch.setattr(train_head, "target_replies", _fake_replies(rounds))
    monkeypatch.setattr(train_head, "self_requests", fake_self)
    files = _stdlib_files()
    _, _, manifest, _ = train_head.build_corpus(
        tok, 80 * seq_len, seq_len, 0, files, target=object(), generated=0.8, self_prompts=0.5
    )
    (first,) = rounds
    mine = [i for i, (_, src) in enumerate(first) if src == train_head.SELF_SOURCE]
    assert len(mine) == int(len(first) * 0.5) > 10
    assert mine[0] < len(first) // 4 and mine[-1] > 3 * len(first) // 4  # spread
    by_source = manifest["chunks_by_source"]
    assert by_source[f"{train_head.SELF_SOURCE} (target reply)"] == len(mine)
    info = manifest["self_prompts"]
    assert info["asked"] == info["written"] == len(mine) and len(info["examples"]) == 8
    replies = sum(n for k, n in by_source.items() if "(target reply)" in k)
    assert len(first) - manifest["heldout_check"]["chunks_dropped"] <= replies <= len(first)
    with pytest.raises(SpecDecError, match="--seq-len 64 leaves .* tokens for a request"):
        train_head.build_corpus(
            tok, 80 * 64, 64, 0, files, target=object(), generated=0.8, self_prompts=0.5
        )
