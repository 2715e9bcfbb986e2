"""Retrieval drafting (specdec.decode.datastore): the suffix index against brute-force
search, the chain and trie choices, held-out masking, the files (round trip, every bad
field refused), and the drafter: greedy output token-identical to plain greedy (chains and
trees), sampling keeping the target's distribution, bad options refused."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from specdec.decode.datastore import (
    DEPTH,
    Datastore,
    DatastoreDrafter,
    tokenizer_fingerprint,
    window_hashes,
)
from specdec.decode.drafters import DraftRequest, make_drafter
from specdec.decode.generation import generate
from specdec.decode.sampling import SamplingParams
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.decode.tree_round import TreeSpec
from specdec.errors import SpecDecError
from tests.decode import test_tree_decode
from tests.helpers import chi2_pvalue, first_two_token_probs

models = test_tree_decode.models  # (target, other, same, prompts): tiny models


def occurrences(docs, ctx):
    """Brute force: (doc, start) of every occurrence of ctx inside one document."""
    n = len(ctx)
    return [
        (d, i)
        for d, doc in enumerate(docs)
        for i in range(len(doc) - n + 1)
        if doc[i : i + n] == ctx
    ]


@pytest.mark.parametrize("vocab", [7, 50_000])  # one key column / four columns of 3 tokens
def test_suffix_ranges_match_brute_force(vocab):
    rng = random.Random(vocab)
    small = min(vocab, 9)  # repeats: contexts occur many times
    docs = [[rng.randrange(small) for _ in range(rng.randrange(2, 60))] for _ in range(40)]
    docs[3][5:5] = [vocab - 1] * 3  # the largest id sorts below the separator
    store = Datastore.from_documents(docs, vocab)
    sep = store.sep

    def upto_sep(c):  # what follows a document's end is the next document
        return c[: c.index(sep) + 1] if sep in c else c

    toks = store.tokens
    keys = [tuple(toks[p : p + DEPTH].tolist()) for p in store.index]
    assert keys == sorted(keys)  # sorted by the first DEPTH tokens, ids < SEP
    assert len(store) == sum(len(d) for d in docs)  # every non-separator start, once
    for _ in range(60):
        d = docs[rng.randrange(len(docs))]
        n = rng.randrange(1, min(6, len(d)) + 1)
        i = rng.randrange(len(d) - n + 1)
        ctx = d[i : i + n] if rng.random() < 0.8 else [rng.randrange(small) for _ in range(n)]
        lo, hi = store.match(ctx)
        want = occurrences(docs, ctx)
        assert hi - lo == len(want), ctx
        k = 3
        got = sorted(
            upto_sep(store.tokens[int(p) + n : int(p) + n + k].tolist()) for p in store.index[lo:hi]
        )
        ref = sorted(upto_sep((docs[a][b + n : b + n + k] + [sep] * k)[:k]) for a, b in want)
        assert got == ref


def test_continuations_take_the_longest_suffix_and_sample_evenly():
    docs = [[1, 2, 3, 4, 5]] * 6 + [[9, 2, 3, 7, 8]] * 300 + [[0, 0, 2, 3, 6]]
    store = Datastore.from_documents(docs, 10)
    n, conts = store.continuations([5, 1, 2, 3], n_max=4, n_min=1, k=2)
    assert n == 3 and conts.tolist() == [[4, 5]] * 6  # [1, 2, 3] beats [2, 3]
    n, conts = store.continuations([4, 4, 2, 3], n_max=4, n_min=2, k=3, samples=32)
    assert n == 2 and len(conts) == 32  # 307 occurrences of [2, 3], 32 sampled evenly
    share = {tuple(r): c for r, c in zip(*np.unique(conts, axis=0, return_counts=True))}
    assert share[(7, 8, store.sep)] >= 30  # 300 / 307 of the range
    n, conts = store.continuations([4, 4], n_max=2, n_min=1, k=1)  # [4, 4] absent, [4] not
    assert n == 1 and conts.tolist() == [[5]] * 6
    n, conts = store.continuations([8, 8, 8], n_max=3, n_min=2, k=2)
    assert n == 0 and conts.shape == (0, 2)
    with pytest.raises(SpecDecError, match="k <= 64"):
        store.continuations([1], 1, 1, 65)


def test_chain_follows_the_majority_while_p_min_holds_and_trie_is_prefix_closed():
    sep = 10
    conts = np.array([[3, 4, 5]] * 5 + [[3, 4, 6]] * 4 + [[3, 7, sep]] * 1 + [[8, 8, 8]] * 2)
    store = Datastore.from_documents([[1]], 10)
    assert store.chain(conts, 0.3) == [3, 4, 5]  # 9/12, 9/12, 5/12
    assert store.chain(conts, 0.5) == [3, 4]
    assert store.chain(conts, 0.9) == []
    assert store.chain(np.array([[3, sep, 1]] * 4), 0.1) == [3]  # stops at a document's end
    trie = store.trie(conts, 5)
    # counts: (3) 10, (3 4) 9, (3 4 5) 5, (3 4 6) 4, (8) 2 = (8 8) = (8 8 8), (3 7) 1
    assert trie == [(3,), (8,), (3, 4), (3, 4, 5), (3, 4, 6)]
    assert all(p[:-1] in trie or len(p) == 1 for p in trie)
    assert all(sep not in p for p in store.trie(conts, 50))


def test_ids_outside_the_vocabulary_are_refused():
    for bad in ([[1, 2, 10]], [[-1, 2]]):  # 10 would read as the separator
        with pytest.raises(SpecDecError, match="outside"):
            Datastore.from_documents(bad, 10)


def test_heldout_windows_are_masked():
    rng = random.Random(3)
    secret = [rng.randrange(100) for _ in range(8)]
    docs = [[rng.randrange(100) for _ in range(30)] + secret + [5, 6] for _ in range(3)]
    store = Datastore.from_documents(docs, 100, heldout={tuple(secret)})
    assert store.meta["masked_windows"] == 3
    empty = lambda r: r[0] == r[1]  # noqa: E731
    assert empty(store.match(secret)) and empty(store.match(secret[:4]))
    lo, hi = store.match(docs[0][:10])
    assert hi - lo == 1  # the rest of the document stays
    plain = Datastore.from_documents(docs, 100)
    lo, hi = plain.match(secret)
    assert hi - lo == 3
    h = window_hashes(np.array(docs[0]))
    assert len(h) == len(docs[0]) - 7 and len(set(h.tolist())) == len(h)


def test_build_with_a_real_tokenizer_and_heldout(smollm2):
    _, tok = smollm2
    texts = [("a.py", "def add(a, b):\n    return a + b\n" * 3), ("b.md", "Hello world. " * 20)]
    held = tok.backend.encode(
        "Hello world. Hello world. Hello world.", add_special_tokens=False
    ).ids
    store = Datastore.build(tok, texts, max_tokens=10_000, heldout={tuple(held[:8])})
    assert store.meta["documents"] == 2 and store.meta["masked_windows"] > 0
    ids = tok.backend.encode("def add(a, b):\n    return", add_special_tokens=False).ids
    n, conts = store.continuations(ids, 12, 2, 3)
    assert n == len(ids) and tok.decode(store.chain(conts, 0.5)) == " a + b"
    lo, hi = store.match(held[:8])
    assert lo == hi
    capped = Datastore.build(tok, texts, max_tokens=10)
    assert capped.meta["tokens"] <= 11


def test_save_load_round_trip_and_bad_files(tmp_path):
    rng = np.random.default_rng(0)
    store = Datastore.from_documents([rng.integers(0, 40, 50).tolist() for _ in range(5)], 40)
    store.save(tmp_path / "ds")
    back = Datastore.load(tmp_path / "ds")
    assert np.array_equal(back.tokens, store.tokens) and np.array_equal(back.index, store.index)
    assert back.meta == store.meta
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left

    def broken(name, edit):
        d = tmp_path / name
        store.save(d)
        edit(d)
        with pytest.raises(SpecDecError) as e:
            Datastore.load(d)
        assert "\n" not in str(e.value)
        return str(e.value)

    def meta(d, **kw):
        m = json.loads((d / "datastore.json").read_text())
        m.update(kw)
        (d / "datastore.json").write_text(json.dumps(m))

    assert "not a datastore" in broken("a", lambda d: (d / "suffixes.npy").unlink())
    assert "header" in broken("b", lambda d: meta(d, depth=3))
    assert "specdec-datastore" in broken("c", lambda d: meta(d, format="x"))
    assert "outside" in broken("d", lambda d: meta(d, vocab_size=5))
    assert "does not match" in broken("e", lambda d: meta(d, tokens=10))

    def bad_index(d):
        idx = np.load(d / "suffixes.npy")
        idx[0] = 10**6
        np.save(d / "suffixes.npy", idx)

    assert "positions outside" in broken("f", bad_index)
    assert "unreadable" in broken("g", lambda d: (d / "tokens.npy").write_bytes(b"\x93NUMPY junk"))
    obj = np.array([{"a": 1}], dtype=object)
    assert "unreadable" in broken("h", lambda d: np.save(d / "tokens.npy", obj, allow_pickle=True))


def _store_for(target, prompts, tmp_path):
    """A store holding the target's own greedy continuation of each test prompt for its
    first 10 tokens (drafts that are right), its continuations of the prompts' first halves
    and random documents (drafts that are wrong)."""
    V = target.config.vocab_size
    rng = random.Random(0)
    heads = [p[: max(2, len(p) // 2)] for p in prompts]
    docs = [p + o for p, o in zip(prompts, generate(target, prompts, 10).tokens)]
    docs += [p + o for p, o in zip(heads, generate(target, heads, 24).tokens)]
    docs += [[rng.randrange(V) for _ in range(40)] for _ in range(20)]
    Datastore.from_documents(docs, V).save(tmp_path / "ds")
    return str(tmp_path / "ds")


@pytest.mark.parametrize("k", [1, 3])
def test_datastore_drafter_greedy_equals_plain_greedy(models, tmp_path, k):
    target, _, _, prompts = models
    path = _store_for(target, prompts, tmp_path)
    ref = generate(target, prompts, 20).tokens
    for batch in ([0], [1], [0, 1, 2]):
        drafter = make_drafter("datastore", target, path=path, min_match=3, ds_n_min=1, p_min=0.0)
        assert isinstance(drafter, DatastoreDrafter)
        dec = SpeculativeDecoder(target, drafter, "greedy", schedule=make_schedule("constant", k))
        res = dec.generate([prompts[i] for i in batch], 20)
        assert res.tokens == [ref[i] for i in batch]
        assert drafter.sources["datastore"] > 0 and res.stats["drafted"] > 0
    assert res.stats["accepted"] > 0


def test_datastore_drafter_prefers_a_long_history_match(models, tmp_path):
    target, _, _, _ = models
    Datastore.from_documents([[1, 2, 3, 9, 9, 9]] * 4, target.config.vocab_size).save(
        tmp_path / "d"
    )
    d = DatastoreDrafter(target=target, path=str(tmp_path / "d"), min_match=2, p_min=0.5)
    req = lambda h: DraftRequest([h], torch.tensor([3]), SamplingParams())  # noqa: E731
    assert d.propose(req([5, 2, 3, 4, 4, 2, 3])).tokens[0].tolist() == [4, 4, 2]  # history
    assert d.propose(req([5, 6, 2, 3])).tokens[0].tolist() == [9, 9, 9]  # datastore
    one = d.propose(req([7, 8, 7]))  # datastore has nothing: history's 1-token match
    assert one.n_draft.item() == 2 and one.tokens[0, :2].tolist() == [8, 7]
    assert d.sources == {"history": 2, "outputs": 0, "datastore": 1, "none": 0}
    trees = d.build_trees([[5, 6, 2, 3], [5, 2, 3, 4, 4, 2, 3]], [3, 3], 8)
    assert trees[0].tokens == [3, 9, 9, 9] and trees[0].parents == [-1, 0, 1, 2]
    assert trees[1].tokens[1:] == [4, 4, 2]


def test_datastore_trees_equal_plain_greedy(models, tmp_path):
    target, _, _, prompts = models
    path = _store_for(target, prompts, tmp_path)
    ref = generate(target, prompts, 16).tokens
    drafter = make_drafter("datastore", target, path=path, min_match=3, ds_n_min=1)
    dec = SpeculativeDecoder(
        target, drafter, "greedy", schedule=make_schedule("constant", 3), tree=TreeSpec(2, 6)
    )
    res = dec.generate(prompts, 16)
    assert res.tokens == ref
    assert max(res.stats["tree_nodes_per_round"]) > 2  # branching tries were verified


def test_datastore_sampling_keeps_the_target_distribution(models, tmp_path):
    target, _, _, prompts = models
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = prompts[0]
    V = target.config.vocab_size
    # the store continues the prompt with each of the target's likely tokens, some twice
    p1, p2 = first_two_token_probs(target, prompt, params)
    likely = torch.nonzero(p1 > 0).flatten().tolist()
    docs = [prompt[-3:] + [a, b] for a in likely for b in likely[:2]]
    Datastore.from_documents(docs, V).save(tmp_path / "ds")
    drafter = make_drafter("datastore", target, path=str(tmp_path / "ds"), min_match=8, p_min=0.0)
    dec = SpeculativeDecoder(target, drafter, "speculative", schedule=make_schedule("constant", 2))
    res = dec.generate([prompt] * 1500, 3, params, seed=5)
    assert 0.0 < res.stats["acceptance_rate"] < 1.0
    assert chi2_pvalue(torch.tensor([t[1] for t in res.tokens]), p2) > 1e-3


def test_datastore_drafter_refuses_bad_options(models, tmp_path, smollm2):
    target = models[0]
    path = _store_for(target, models[3], tmp_path)
    for bad, msg in [
        (dict(ds_n_min=0), "ds_n_min"),
        (dict(ds_n_max=13), "ds_n_max"),
        (dict(min_match=0), "min_match"),
        (dict(p_min=1.5), "p_min"),
        (dict(samples=0), "samples"),
        (dict(corpus="books"), "corpus"),
    ]:
        with pytest.raises(SpecDecError, match=msg):
            DatastoreDrafter(target=target, path=path, **bad)
    with pytest.raises(SpecDecError, match="path"):
        DatastoreDrafter(target=target)
    with pytest.raises(SpecDecError, match="not a datastore"):
        DatastoreDrafter(target=target, path=str(tmp_path))
    smol, tok = smollm2
    with pytest.raises(SpecDecError, match="target tokenizer's 49152"):  # raw ids, 320 of them
        DatastoreDrafter(target=smol, target_tokenizer=tok, path=path)
    Datastore.from_documents([[1, 2]], 49152, meta={"tokenizer": "0" * 16}).save(tmp_path / "o")
    with pytest.raises(SpecDecError, match="another tokenizer"):
        DatastoreDrafter(target=smol, target_tokenizer=tok, path=str(tmp_path / "o"))
    big = Datastore.from_documents([[1, 2]], target.config.vocab_size + 5)
    big.save(tmp_path / "big")
    with pytest.raises(SpecDecError, match="vocabulary"):
        DatastoreDrafter(target=target, path=str(tmp_path / "big"))


def test_build_cli_and_draft_flag(tiny_dir, tmp_path, capsys):
    """build_datastore on a tiny HF model's tokenizer with --files, then
    `--draft datastore:DIR` in the generate CLI: lossless, and the store is used."""
    from specdec import build_datastore
    from specdec.cli import user_errors
    from specdec.generate import main as generate_main
    from specdec.models.load import load_model
    from tests.helpers import one_error_line

    d = str(tiny_dir("llama", False, layers=4))
    target, tok = load_model(d)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(text)
    (tmp_path / "texts" / "b.txt").write_text("Another text that is here. " * 5)
    out = tmp_path / "ds"
    build_datastore.main(["--model", d, "--out", str(out), "--files", str(tmp_path / "texts")])
    assert "2 documents" in capsys.readouterr().out
    store = Datastore.load(out)
    assert store.meta["tokenizer"] == tokenizer_fingerprint(tok) and store.meta["corpus"] == "files"
    generate_main(
        ["--model", d, "--prompt", "The quick brown", "--max-new-tokens", "8", "--json",
         "--draft", f"datastore:{out}", "--k", "3"]
    )  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == generate(target, [res["prompt_ids"]], 8).tokens[0]
    assert res["stats"]["drafter"] == "datastore" and res["stats"]["drafted"] > 0
    base = ["--model", d, "--out", str(tmp_path / "bad")]
    cli = user_errors(build_datastore.main)
    assert "--max-tokens" in one_error_line(capsys, cli, [*base, "--max-tokens", "0"])
    assert "does not exist" in one_error_line(
        capsys, cli, [*base, "--files", str(tmp_path / "nope")]
    )
    assert "corpus" in one_error_line(capsys, cli, [*base, "--corpus", "books"])
    assert not (tmp_path / "bad").exists()


def test_default_store_is_built_once_into_the_cache(smollm2, tmp_path, monkeypatch):
    """default_store on a small stand-in corpus: built into $SPECDEC_CACHE/datastores on
    first use (held-out windows masked), loaded from there afterwards."""
    import sysconfig
    from pathlib import Path

    from specdec import train_head
    from specdec.decode import datastore

    _, tok = smollm2
    std = Path(sysconfig.get_paths()["stdlib"])
    files = {"code": sorted((std / "json").glob("*.py")), "doc": []}
    secret = tok.backend.encode(files["code"][0].read_text(), add_special_tokens=False).ids[40:48]
    monkeypatch.setattr(train_head, "corpus_files", lambda: files)
    monkeypatch.setattr(train_head, "heldout_windows", lambda t: ({tuple(secret)}, {"x": 1}))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    store = datastore.default_store(tok, "code", 50_000)
    [d] = (tmp_path / "datastores").iterdir()
    assert d.name == f"{tokenizer_fingerprint(tok)}-code-50000"
    assert store.meta["documents"] == len(files["code"]) and store.meta["masked_windows"] >= 1
    assert store.meta["tokenizer"] == tokenizer_fingerprint(tok)
    lo, hi = store.match(secret)
    assert lo == hi
    monkeypatch.setattr(Datastore, "build", None)  # a second call must not build again
    again = datastore.default_store(tok, "code", 50_000)
    assert np.array_equal(again.index, store.index)
    drafter = DatastoreDrafter(target_tokenizer=tok, max_tokens=50_000)
    assert len(drafter.store) == len(store)
