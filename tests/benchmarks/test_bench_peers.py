"""bench_peers' specdec side on the embedded SmolLM2: drafters named by their experiment
configs, every speculative row token-identical to its own plain row, rounds counted; a bad
drafter name is one error line before any model is loaded."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import bench_peers


def test_draft_config_composes_like_the_experiment():
    cfg = bench_peers.draft_config("replies")
    # replies.yaml inherits datastore.yaml and overrides four keys
    assert (cfg.kind, cfg.corpus, cfg.min_match, cfg.ds_n_min) == ("datastore", "replies", 1, 1)
    assert cfg.reuse_outputs is True and cfg.ds_n_max == 12
    assert bench_peers.draft_label(cfg, 4) == "datastore(replies)+outputs k=4"
    assert bench_peers.draft_label(bench_peers.draft_config("ngram"), 6).startswith("ngram")


def test_unknown_drafter_is_one_error_before_loading(monkeypatch, capsys):
    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the drafter names were checked")

    monkeypatch.setattr("specdec.models.registry.resolve_model_path", no_load)
    with pytest.raises(SystemExit) as e:
        bench_peers.main(["--draft", "ngram", "nope", "--skip-hf", "--skip-llama"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --draft 'nope': no configs/draft/nope.yaml")
    assert "replies" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        bench_peers.main(["--k", "0", "--skip-hf", "--skip-llama"])
    assert "--k must be >= 1" in capsys.readouterr().err
    # a malformed mode: one error line before anything loads
    with pytest.raises(SystemExit) as e:
        bench_peers.main(["--specdec", "bfloat16:native+foo", "--skip-hf", "--skip-llama"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert (
        err
        == "error: mode 'bfloat16:native+foo': expected dtype:cpu_linear[:auto|on|off][+compile]"
    )


def test_specdec_rows_match_own_plain(smollm2_path, tmp_path, capsys):
    n = random.randint(10, 16)
    bench_peers.main(
        [
            *("--model", str(smollm2_path), "--prompts", "2", "--new-tokens", str(n)),
            *("--specdec", "float32:dense", "--draft", "replies", "ngram", "--k", "3"),
            *("--skip-hf", "--skip-llama", "--out", str(tmp_path)),
        ]
    )
    records = json.loads((tmp_path / "peers.json").read_text())["records"]
    methods = [r["method"] for r in records]
    assert methods == ["plain", "datastore(replies)+outputs k=3", "ngram+outputs k=3"]
    for r in records:
        assert r["system"] == "specdec float32:dense"
        assert r["tokens"] == 2 * n  # EOS ignored: every prompt gives exactly n tokens
        assert r["identical_to_own_plain"] is True
    assert records[0]["tokens_per_round"] is None  # plain decoding has no rounds
    for r in records[1:]:
        # at least one token per round, at most k + 1
        assert 1.0 <= r["tokens_per_round"] <= 4.0
    # the reply store drafts in rounds where prompt lookup has nothing: more tokens per round
    assert records[1]["tokens_per_round"] > records[2]["tokens_per_round"]
    assert "| tokens/round |" in capsys.readouterr().out
