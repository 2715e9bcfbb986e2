"""Drafting from the target's own replies (datastore corpus `replies`): extracting replies
from chat rows, `build_datastore --corpus replies` on a tiny chat model (the stored replies
are the target's greedy replies, the store drafts them back), the shipped SmolLM2 store
(its header, no evaluation window inside, found by tokenizer) and greedy speculative
decoding with it token-identical to plain greedy; bad input refused."""

from __future__ import annotations

import json
import random
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from specdec.decode import datastore
from specdec.decode.datastore import (
    WINDOW,
    Datastore,
    DatastoreDrafter,
    hash_rows,
    reply_store,
    tokenizer_fingerprint,
    window_hashes,
)
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reply_docs_cut_each_row_after_its_header_and_at_its_stop_token():
    from specdec.build_datastore import reply_docs

    rng = random.Random(0)
    header, stops = [7, 8, 9], {3, 4}
    rows, want = [], []
    for i in range(40):
        prompt = [rng.randrange(10, 50) for _ in range(rng.randrange(0, 6))]
        reply = [rng.randrange(10, 50) for _ in range(rng.randrange(0, 8))]
        tail = [rng.randrange(0, 50) for _ in range(rng.randrange(0, 5))]
        kind = i % 4
        if kind == 0:  # no header: left out
            rows.append(prompt + reply)
            continue
        stop = [rng.choice(sorted(stops))] if kind != 3 else []
        # a header inside the reply stays in it: only the first one counts
        rows.append(prompt + header + reply + (header if kind == 2 else []) + stop + tail)
        got = reply + (header if kind == 2 else [])
        if kind == 3:  # no stop token: the row's end
            got = reply + tail
            cut = next((j for j, t in enumerate(got) if t in stops), len(got))
            got = got[:cut]
        if len(got) >= 2:
            want.append(got)
    assert reply_docs(rows, header, stops) == want
    assert reply_docs([[7, 8], [1, 7, 8, 9, 5]], header, stops) == []  # too short


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama with a ChatML template -> (dir, model, tokenizer)."""
    from specdec.models.load import load_model
    from tests.helpers import make_hf_model

    d = make_hf_model(tmp_path_factory.mktemp("replies") / "m", "llama", False, layers=2)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": CHATML}))
    model, tok = load_model(str(d))
    return d, model, tok


def test_build_replies_stores_the_targets_greedy_replies(chat_model, tmp_path, monkeypatch, capsys):
    """build_datastore --corpus replies: each stored document is the reply part of a row
    target_replies generated (itself tested against plain greedy in test_head), cut at the
    end of turn; the header names the target; the store then drafts the replies back, and
    `--draft datastore:DIR` stays lossless."""
    from specdec import build_datastore, train_head
    from specdec.decode.heads.head import matches
    from specdec.generate import main as generate_main

    d, model, tok = chat_model
    std = Path(sysconfig.get_paths()["stdlib"])
    files = {
        "doc": sorted((std / "email").glob("*.py")),
        "code": sorted((std / "json").glob("*.py")),
    }
    monkeypatch.setattr(train_head, "corpus_files", lambda: files)
    # the tiny tokenizer's 8-token windows are a few characters: the real evaluation texts
    # would drop most requests (the held-out check is tested on SmolLM2 below)
    monkeypatch.setattr(train_head, "heldout_windows", lambda t: ({(1,) * 8}, {"x": 1}))
    rows = []
    real = train_head.target_replies

    def spy(*a, **kw):
        for i, toks, rec in real(*a, **kw):
            rows.append(toks)
            yield i, toks, rec

    monkeypatch.setattr(train_head, "target_replies", spy)
    out = tmp_path / "store"
    build_datastore.main(
        ["--model", str(d), "--out", str(out), "--corpus", "replies", "--replies", "6",
         "--batch", "3", "--minutes", "2", "--seed", "3"]
    )  # fmt: skip
    assert "replies of" in capsys.readouterr().out
    store = Datastore.load(out)
    m = store.meta
    want = build_datastore.reply_docs(rows, train_head.assistant_header(tok), tok.stop_ids)
    assert len(rows) == 6 and 0 < m["replies"] == len(want)
    assert m["corpus"] == "replies" and m["model"] == str(d) and m["seed"] == 3
    assert m["tokenizer"] == tokenizer_fingerprint(tok) and matches(m["target"], model)
    assert m["reply_tokens"] == sum(map(len, want)) == m["tokens"] - len(want)
    body = np.asarray(store.tokens[: m["tokens"]])
    stored = np.split(body, np.flatnonzero(body == store.sep) + 1)[:-1]  # documents + SEP
    assert sorted(d.tolist() for d in stored) == sorted([*w, store.sep] for w in want)
    # the store proposes what followed a reply's opening tokens
    doc = max(want, key=len)
    n, conts = store.continuations(doc[:6], 12, 6, 2)
    assert n == 6 and doc[6:8] in conts.tolist()
    # used through the CLI: lossless, and the store drafts
    generate_main(
        ["--model", str(d), "--prompt", "hello there", "--max-new-tokens", "12", "--json",
         "--draft", f"datastore:{out}", "--k", "3"]
    )  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == generate(model, [res["prompt_ids"]], 12).tokens[0]


def _doc(rng: random.Random) -> str:
    words = ["return", "the", "sum", "of", "values", "list", "given", "number", "each", "item"]
    text = " ".join(rng.choice(words) for _ in range(rng.randrange(8, 16))).capitalize()
    text = text.ljust(40, ".")  # docstrings under 40 characters are left out ("short")
    if rng.random() < 0.5:  # a docstring over several lines, with an example
        text += f"\n\n    >>> f({rng.randrange(9)})\n    {rng.randrange(99)}\n    "
    return text


def test_function_prefixes_are_signature_and_docstring_dedented():
    """function_prefixes on a random module: every documented function with a body, methods
    dedented to the top level; docstring-only functions, tests, short docstrings and code
    on the docstring's line left out; source that does not parse gives none."""
    from specdec.build_datastore import function_prefixes

    rng = random.Random()
    src, want = ["import os\n"], []
    for i in range(rng.randrange(4, 9)):
        name = f"f{i}_{rng.randrange(10**6)}"
        args = ", ".join(f"a{j}" for j in range(rng.randrange(0, 4)))
        head = f'def {name}({args}):\n    """{_doc(rng)}"""\n'
        kind = rng.choice(["plain", "method", "only_doc", "test", "short", "same_line"])
        if kind == "plain":
            src.append(head + "    return 1\n")
            want.append(head)
        elif kind == "method":
            method = head.replace("(", "(self, ", 1) if args else head.replace("()", "(self)")
            src.append(f"class C{i}:\n" + textwrap.indent(method + "    pass\n", "    "))
            want.append(method)
        elif kind == "only_doc":
            src.append(head)
        elif kind == "test":
            src.append(head.replace(f"def {name}", f"def test_{name}") + "    pass\n")
        elif kind == "short":
            src.append(f'def {name}():\n    """Short."""\n    return 2\n')
        else:
            src.append(head.rstrip("\n") + "; x = 1\n    return x\n")
    text = "\n\n".join(src)
    got = function_prefixes(text, per_file=100)
    assert sorted(got) == sorted(want)
    if want:
        assert len(function_prefixes(text, per_file=1)) == 1
    assert function_prefixes(text + "\ndef broken(:\n") == []


def test_build_code_replies_stores_plain_text_completions(
    chat_model, tmp_path, monkeypatch, capsys
):
    """--requests code: the prompts are function prefixes encoded as plain text (no chat
    template, though the model has one), each stored document is the target's greedy
    continuation of one (== plain greedy decoding), cut at a stop token."""
    from specdec import build_datastore, train_head

    d, model, tok = chat_model
    rng = random.Random()
    files = []
    for f in range(3):  # short documented functions (the tiny tokenizer's tokens are short)
        path = tmp_path / f"m{f}.py"
        path.write_text(
            "".join(
                f'def g{f}{i}(x):\n    """Add {rng.randrange(99)} to the number x and return their sum."""\n'
                f"    return x + {i}\n\n"
                for i in range(3)
            )
        )
        files.append(path)
    monkeypatch.setattr(train_head, "corpus_files", lambda: {"doc": [], "code": files})
    monkeypatch.setattr(train_head, "heldout_windows", lambda t: ({(1,) * 8}, {"x": 1}))
    rows, real = [], train_head.target_replies

    def spy(target, tokenizer, requests, seq, *a, **kw):
        assert kw["chat"] is False
        for i, toks, rec in real(target, tokenizer, requests, seq, *a, **kw):
            rows.append((requests[i][0], seq, toks))
            yield i, toks, rec

    monkeypatch.setattr(train_head, "target_replies", spy)
    out = tmp_path / "code"
    build_datastore.main(
        ["--model", str(d), "--out", str(out), "--corpus", "replies", "--requests", "code",
         "--replies", "5", "--batch", "2", "--minutes", "2", "--dtype", "float32"]
    )  # fmt: skip
    capsys.readouterr()
    m = Datastore.load(out).meta
    assert len(rows) == 5 and m["requests"] == "code" and m["corpus"] == "replies"
    want = []
    for prefix, seq, row in rows:
        prompt = tok.encode(prefix)[-(seq // 2) :]
        assert row[: len(prompt)] == prompt  # plain text: no chat header before the prefix
        rest = row[len(prompt) :]
        end = next((j for j, t in enumerate(rest) if t in tok.stop_ids), len(rest))
        if end >= 2:
            want.append(rest[:end])
    assert m["replies"] == len(want) > 0 and m["reply_tokens"] == sum(map(len, want))
    prefix, seq, row = rows[0]  # the build's model in float32, as the fixture's
    prompt = tok.encode(prefix)[-(seq // 2) :]
    n = min(8, len(row) - len(prompt))
    assert generate(model, [prompt], n).tokens[0][:n] == row[len(prompt) : len(prompt) + n]


def test_build_replies_refuses_bad_input_before_loading(chat_model, tmp_path, capsys):
    from specdec import build_datastore
    from specdec.cli import user_errors
    from tests.helpers import one_error_line

    d = str(chat_model[0])
    cli = user_errors(build_datastore.main)
    base = ["--model", d, "--out", str(tmp_path / "bad"), "--corpus", "replies"]
    assert "--minutes" in one_error_line(capsys, cli, [*base, "--minutes", "0"])
    assert "--replies" in one_error_line(capsys, cli, [*base, "--replies", "1"])
    assert "--files" in one_error_line(capsys, cli, [*base, "--files", str(tmp_path)])
    code = ["--model", d, "--out", str(tmp_path / "bad"), "--requests", "code"]
    assert "--corpus replies" in one_error_line(capsys, cli, code)
    assert not (tmp_path / "bad").exists()


def test_no_shipped_store_for_a_tokenizer_is_one_clear_error(chat_model):
    _, model, tok = chat_model
    with pytest.raises(SpecDecError, match="--corpus replies"):
        DatastoreDrafter(target=model, target_tokenizer=tok, corpus="replies")
    with pytest.raises(SpecDecError, match="not built from files"):
        datastore.build_store(tok, "replies")


def test_a_store_of_another_targets_replies_warns(chat_model, tmp_path, caplog):
    _, model, tok = chat_model
    from specdec.decode.heads.head import fingerprint

    fp = {**fingerprint(model), "embed_checksum": 1.0}
    meta = {
        "tokenizer": tokenizer_fingerprint(tok),
        "corpus": "replies",
        "target": fp,
        "model": "x",
    }
    Datastore.from_documents([[5, 6, 7, 8]], tok.vocab_size, meta).save(tmp_path / "s")
    with caplog.at_level("WARNING"):
        DatastoreDrafter(target=model, target_tokenizer=tok, path=str(tmp_path / "s"))
    assert "not this target's" in caplog.text
    caplog.clear()
    meta["target"] = {**fp, "embed_checksum": "not a number"}  # malformed: warned, not a crash
    Datastore.from_documents([[5, 6, 7, 8]], tok.vocab_size, meta).save(tmp_path / "s")
    with caplog.at_level("WARNING"):
        DatastoreDrafter(target=model, target_tokenizer=tok, path=str(tmp_path / "s"))
    assert "not this target's" in caplog.text
    caplog.clear()
    meta["target"] = fingerprint(model)
    Datastore.from_documents([[5, 6, 7, 8]], tok.vocab_size, meta).save(tmp_path / "s")
    with caplog.at_level("WARNING"):
        DatastoreDrafter(target=model, target_tokenizer=tok, path=str(tmp_path / "s"))
    assert "not this target's" not in caplog.text


def test_shipped_smollm2_replies_hold_no_evaluation_window(smollm2):
    """The shipped store: found by SmolLM2's tokenizer, made by SmolLM2-135M (fingerprint),
    a header that adds up, and no 8-token window of an evaluation prompt anywhere in it."""
    from specdec.decode.heads.head import matches

    model, tok = smollm2
    store = reply_store(tok)
    m = store.meta
    assert m["corpus"] == "replies" and m["model"] == "smollm2-135m" and matches(m["target"], model)
    assert m["tokens"] == m["reply_tokens"] + m["replies"] and m["replies"] > 500
    assert_no_evaluation_window(store, tok)


def assert_no_evaluation_window(store: Datastore, tok) -> None:
    """No 8-token window of an evaluation text (specbench_mini, code_edit, HumanEval's
    prompts and solutions) anywhere in the store; the check finds one planted in a copy."""
    from specdec.train_head import heldout_windows

    windows, evalsets = heldout_windows(tok)
    assert len(windows) > 10_000 and set(evalsets) >= {"specbench_mini.jsonl", "code_edit.jsonl"}
    assert any(name.startswith("HumanEval") for name in evalsets)
    held = np.unique(hash_rows(np.array(sorted(windows), dtype=np.uint64)))
    body = np.asarray(store.tokens[: store.meta["tokens"]])
    assert not np.isin(window_hashes(body), held).any()
    some = np.array(sorted(windows)[len(windows) // 2], dtype=np.int64)
    planted = body.copy()
    planted[100 : 100 + WINDOW] = some
    assert np.isin(window_hashes(planted), held).any()


def test_greedy_speculative_with_the_shipped_replies_equals_plain_greedy(smollm2):
    """draft=replies on SmolLM2 (fp32): token-identical to plain greedy, with rounds drafted
    from the store."""
    model, tok = smollm2
    drafter = DatastoreDrafter(
        target=model, target_tokenizer=tok, corpus="replies", min_match=1, ds_n_min=1
    )
    prompts = [
        tok.encode_chat(p) for p in ("Give me three tips for sleeping well.", "What is 12 * 7?")
    ]
    spec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
    for ids in prompts:
        out = spec.generate([ids], 24)
        assert out.tokens[0] == generate(model, [ids], 24).tokens[0]
    assert drafter.sources["datastore"] > 0


def test_the_shipped_store_is_part_of_the_package():
    """pyproject's package data carries the shipped stores' files."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    for f in ("datastore.json", "tokens.npy", "suffixes.npy"):
        assert f"decode/stores/*/{f}" in text
    assert any(datastore.SHIPPED.glob("*/datastore.json"))
