"""experiments.head_agreement: a head's teacher-forced agreement with the target on an
experiment point's recorded greedy outputs, against a brute-force reference (the head
over each prefix alone, the target's greedy tokens), per category; bad input refused."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import head_agreement
from specdec.decode.generation import generate
from specdec.decode.heads.head import DraftHead, HeadConfig, load_head, save_head
from specdec.models.load import load_model
from tests.experiments.conftest import PROMPTS
from tests.helpers import one_error_line


def _point(compose_cfg, tiny_overrides, tmp_path, extra=()):
    from experiments.run import run

    cfg = compose_cfg([*tiny_overrides, "spec.k=3", "gen.max_new_tokens=10", *extra])
    out = tmp_path / "point"
    run(cfg, out)
    return out


def test_agreement_equals_the_head_over_each_prefix(compose_cfg, tiny_overrides, tmp_path, capsys):
    target = next(o for o in tiny_overrides if o.startswith("target.model="))
    model, _ = load_model(target.split("=", 1)[1], dtype="float32")
    point = _point(compose_cfg, tiny_overrides, tmp_path)
    rows = [json.loads(x) for x in (point / "results.jsonl").read_text().splitlines()]
    # a random head whose draft vocabulary is the few tokens the target wrote: it agrees
    # often enough that a misaligned position or mask shows
    vocab = sorted({t for r in rows for t in r["baseline"]["tokens"]})
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(model, None, len(vocab)), model.config)
    head.set_vocab(torch.tensor(vocab))
    head.attach(model)
    save_head(head, tmp_path / "myhead")
    head = load_head(tmp_path / "myhead", model).float()
    want: dict[str, list[int]] = {}
    layers = head.cfg.feature_layers
    for r in rows:
        seq = r["prompt_ids"] + r["baseline"]["tokens"]
        P = len(r["prompt_ids"])
        nxt = seq + generate(model, [seq], 1).tokens[0]  # the target's token after the last
        feats = head_agreement.target_pass(model, seq, layers)["feats"].float()
        hits = []
        for i in range(P - 2, len(seq) - 1):  # head slot i predicts token i + 2
            with torch.no_grad():
                h = head.unroll(feats[:, : i + 1], torch.tensor([seq[: i + 2]]), 1)[0]
            guess = int(head.vocab_map[head.logits(h[0, -1]).argmax()])
            hits.append(guess == nxt[i + 2])
        for cat in (r["category"], "all"):
            want.setdefault(cat, []).extend(hits)
    head_agreement.main([str(point), "--head", str(tmp_path / "myhead"), "--positions", "2"])
    out = capsys.readouterr().out
    got = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("myhead ")}
    assert set(got) == set(want) == {p["category"] for p in PROMPTS} | {"all"}
    for cat, hits in want.items():
        assert int(got[cat][2]) == len(hits)
        assert float(got[cat][3]) == pytest.approx(sum(hits) / len(hits), abs=1e-3)
    assert 0 < sum(want["all"]) < len(want["all"])  # hits and misses: the comparison can fail


def test_head_agreement_refuses_what_it_cannot_measure(
    compose_cfg, tiny_overrides, tmp_path, capsys
):
    cli = head_agreement.user_errors(head_agreement.main)
    point = _point(
        compose_cfg, tiny_overrides, tmp_path, extra=["gen.temperature=0.8", "accept=speculative"]
    )
    capsys.readouterr()
    assert "greedy run" in one_error_line(capsys, cli, [str(point), "--head", str(tmp_path)])
    assert "not a readable experiment point" in one_error_line(
        capsys, cli, [str(tmp_path / "none"), "--head", str(tmp_path)]
    )
    summary = json.loads((point / "summary.json").read_text())
    summary["config"]["gen"]["temperature"] = 0.0
    (point / "summary.json").write_text(json.dumps(summary))
    assert "not a head directory" in one_error_line(
        capsys, cli, [str(point), "--head", str(tmp_path)]
    )
    assert "--positions" in one_error_line(
        capsys, cli, [str(point), "--head", str(tmp_path), "--positions", "0"]
    )
