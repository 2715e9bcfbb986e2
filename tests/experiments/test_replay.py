"""experiments.replay: a model-free drafter's greedy rounds replayed on recorded outputs
are the engine's rounds (same counts, prompt by prompt), and the CLI reads experiment
points and refuses what it cannot replay."""

from __future__ import annotations

import json

import pytest

from experiments import replay
from specdec.decode.datastore import Datastore
from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.models.load import load_model
from tests.experiments.conftest import PROMPTS
from tests.helpers import one_error_line


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    d = tiny_dir("llama", False, layers=4)
    model, tok = load_model(str(d))
    texts = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]
    return d, model, [tok.encode(t) for t in texts]


@pytest.mark.parametrize("kind", ["ngram", "datastore"])
@pytest.mark.parametrize("k,max_new", [(3, 20), (5, 9)])
def test_replay_counts_equal_the_engines(tiny, tmp_path, kind, k, max_new):
    _, model, prompts = tiny
    opts = {}
    if kind == "datastore":  # the target's own continuations of the prompts' first halves
        heads = [p[: max(2, len(p) // 2)] for p in prompts]
        docs = [h + o for h, o in zip(heads, generate(model, heads, 24).tokens)]
        Datastore.from_documents(docs, model.config.vocab_size).save(tmp_path / "ds")
        opts = dict(path=str(tmp_path / "ds"), min_match=3, ds_n_min=1, p_min=0.0)
    for p in prompts:
        ref = generate(model, [p], max_new).tokens[0]
        dec = SpeculativeDecoder(
            model,
            make_drafter(kind, model, **opts),
            "greedy",
            schedule=make_schedule("constant", k),
        )
        s = dec.generate([p], max_new).stats
        got = replay.replay(
            make_drafter(kind, model, **opts), [{"prompt_ids": p, "tokens": ref}], k, max_new
        )
        want = {key: s[key] for key in ("rounds", "drafted", "accepted")}
        assert {key: got[key] for key in want} == want
        assert got["emitted"] == len(ref) - 1 and len(got["widths"]) == got["rounds"]


@pytest.mark.parametrize("kind", ["ngram", "datastore"])
def test_replay_of_the_output_cache_follows_the_prompts_order(tiny, tmp_path, kind):
    """With reuse_outputs the drafter learns across sequences: one drafter over the prompts
    in turn (each twice, so the cache drafts) counts the engine's rounds."""
    _, model, prompts = tiny
    opts = dict(reuse_outputs=True, min_match=3, outputs_n_min=1)
    if kind == "datastore":
        Datastore.from_documents([[1, 2]], model.config.vocab_size).save(tmp_path / "ds")
        opts.update(path=str(tmp_path / "ds"))
    seqs = prompts + prompts
    refs = [generate(model, [p], 12).tokens[0] for p in seqs]
    dec = SpeculativeDecoder(
        model, make_drafter(kind, model, **opts), "greedy", schedule=make_schedule("constant", 3)
    )
    want = {"rounds": 0, "drafted": 0, "accepted": 0}
    for p in seqs:
        s = dec.generate([p], 12).stats
        want = {key: want[key] + s[key] for key in want}
        outputs = s["draft_sources"]["outputs"]
    assert outputs > 0  # the repeats drew on the cache
    rows = [{"prompt_ids": p, "tokens": r} for p, r in zip(seqs, refs)]
    got = replay.replay(make_drafter(kind, model, **opts), rows, 3, 12)
    assert {key: got[key] for key in want} == want


def _point(compose_cfg, tiny_overrides, tmp_path, accept="greedy", extra=()):
    from experiments.run import run

    cfg = compose_cfg([*tiny_overrides, "draft=ngram", "spec.k=3", f"accept={accept}", *extra])
    out = tmp_path / f"point-{accept}"
    run(cfg, out)
    return out


def test_replay_starts_from_the_runs_drafter_options(compose_cfg, tiny_overrides, tmp_path, capsys):
    """A run whose output cache drafted: replaying its own drafter without --draft-opt
    uses the run's options (its tokens per round), --draft-opt overrides them."""
    twice = tmp_path / "twice.jsonl"  # every prompt again: its first answer is in the cache
    twice.write_text(
        "".join(json.dumps({**p, "id": p["id"] + str(i)}) + "\n" for i in (1, 2) for p in PROMPTS)
    )
    extra = [f"dataset.path={twice}", "gen.max_new_tokens=12", "draft.reuse_outputs=true",
             "draft.min_match=4"]  # fmt: skip
    point = _point(compose_cfg, tiny_overrides, tmp_path, extra=extra)
    summary = json.loads((point / "summary.json").read_text())
    assert summary["draft_sources"]["outputs"] > 0

    def tokens_per_round(*opts):
        replay.main([str(point), "--draft", "ngram", "--k", "3", *opts])
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("ngram")][0]
        return float(line.split()[4])

    assert tokens_per_round() == pytest.approx(summary["mean_accepted_tokens"], abs=1e-3)
    alone = tokens_per_round("--draft-opt", "reuse_outputs=false")
    assert alone != pytest.approx(summary["mean_accepted_tokens"], abs=1e-3)


def test_replay_cli_on_an_experiment_point(compose_cfg, tiny_overrides, tmp_path, capsys):
    point = _point(compose_cfg, tiny_overrides, tmp_path)
    summary = json.loads((point / "summary.json").read_text())
    replay.main([str(point), "--draft", "ngram", "--k", "3,1"])
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("ngram")}
    # k = 3 is the run's own setting: the replay's tokens per round are the engine's
    assert float(rows["3"][4]) == pytest.approx(summary["mean_accepted_tokens"], abs=1e-3)
    assert float(rows["1"][3]) <= 1.0 and rows["1"][2] == str(len(PROMPTS))
    cli = replay.user_errors(replay.main)
    assert "needs a model" in one_error_line(capsys, cli, [str(point), "--draft", "layerskip"])
    assert "--k" in one_error_line(capsys, cli, [str(point), "--k", "0"])
    assert "not a readable experiment point" in one_error_line(capsys, cli, [str(tmp_path / "no")])
    (point / "summary.json").write_text("{")
    assert "not a readable experiment point" in one_error_line(capsys, cli, [str(point)])
    sampled = _point(compose_cfg, tiny_overrides, tmp_path, accept="speculative")
    capsys.readouterr()  # the run's progress bars
    assert "greedy" in one_error_line(capsys, cli, [str(sampled)])


def test_replay_cli_loads_a_local_targets_tokenizer(compose_cfg, tiny_overrides, tmp_path, capsys):
    """A drafter that takes the target's tokenizer (the datastore) replays a run of a local
    model directory: the tokenizer comes from the run's target path, not its display name."""
    point = _point(compose_cfg, tiny_overrides, tmp_path)
    target = next(o for o in tiny_overrides if o.startswith("target.model=")).split("=", 1)[1]
    model, _ = load_model(target)
    Datastore.from_documents([[1, 2, 3, 4]], model.config.vocab_size).save(tmp_path / "ds")
    capsys.readouterr()
    replay.main([str(point), "--draft", "datastore", "--draft-opt", f"path={tmp_path / 'ds'}"])
    out = capsys.readouterr().out
    assert any(line.startswith("datastore ") for line in out.splitlines())
