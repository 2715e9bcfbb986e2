"""experiment=pairings: every configs/pairing/ file is swept and composes to its target,
drafter and tree; the pairing figure from synthetic summaries and from a tiny real run."""

from __future__ import annotations

import experiments.plot as plot
from experiments.plot import plot_all, plot_pairings
from experiments.run import run
from tests.experiments.conftest import CONFIGS

DATASETS = {"humaneval", "specbench_mini"}


def test_the_sweep_lists_every_pairing_on_both_datasets(compose_cfg):
    params = compose_cfg(["experiment=pairings"], hydra=True).hydra.sweeper.params
    names = params.pairing.split(",")
    assert sorted(names) == sorted(p.stem for p in (CONFIGS / "pairing").glob("*.yaml"))
    assert set(params.dataset.split(",")) == DATASETS
    got = {}
    for name in names:
        cfg = compose_cfg(["experiment=pairings", f"pairing={name}"])
        assert cfg.pairing == name and cfg.gen.reuse_baseline
        tree = (cfg.tree.topk, cfg.tree.budget) if cfg.tree.topk is not None else None
        got[name] = (cfg.target.model, cfg.draft.kind, cfg.draft.get("model"), tree)
    qwen = {v[1:] for v in got.values() if v[0] == "qwen2.5-coder-0.5b"}
    assert ("model", "smollm2-135m", None) in qwen  # the cross-tokenizer pairing
    for target in ("qwen2.5-coder-0.5b", "smollm2-135m"):
        kinds = {v[1] for v in got.values() if v[0] == target}
        assert {"ngram", "layerskip", "early_exit"} <= kinds
        assert any(v[3] for v in got.values() if v[0] == target)  # a tree pairing
    assert {"head", "ngram_head"} <= {v[1] for v in got.values() if v[0] == "smollm2-135m"}


def _summary(pairing, dataset, acc, tokens, speedup):
    cfg = {"pairing": pairing, "dataset": {"name": dataset}}
    if dataset == "humaneval":
        cfg["dataset"] = {"_target_": "experiments.humaneval.load_humaneval"}
    return {
        "config": cfg,
        "acceptance_rate": acc,
        "mean_accepted_tokens": tokens,
        "speedup": speedup,
        "model": "m",
        "n_prompts": 3,
        "environment": {"hardware": "cpu", "device": "cpu"},
    }


def test_pairing_figure_from_synthetic_summaries(tmp_path, monkeypatch):
    spec = [
        _summary("qwen_smollm2", "humaneval", 0.5, 2.0, 1.1),
        _summary("qwen_smollm2", "specbench_mini", 0.4, 1.8, 0.9),
        _summary("qwen_ngram", "humaneval", 0.3, 1.5, None),  # a speedup not measured
    ]
    figs = []
    real_save = plot._save
    monkeypatch.setattr(plot, "_save", lambda fig, *a: (figs.append(fig), real_save(fig, *a)))
    written = []
    plot_pairings(spec, tmp_path, written)
    assert sorted(p.name for p in written) == ["pairings.pdf", "pairings.png"]
    acc, tok, speed = figs[0].axes
    heights = lambda ax: sorted(round(b.get_height(), 3) for b in ax.patches)  # noqa: E731
    assert heights(acc) == [0.3, 0.4, 0.5]
    assert heights(tok) == [1.5, 1.8, 2.0]
    assert heights(speed) == [0.9, 1.1]
    assert [t.get_text() for t in acc.get_xticklabels()] == ["qwen_ngram", "qwen_smollm2"]
    assert sorted(t.get_text() for t in acc.get_legend().get_texts()) == sorted(DATASETS)


def test_pairing_figure_from_a_tiny_run(compose_cfg, tiny_overrides, tmp_path):
    over = ["experiment=pairings", "pairing=smollm2_ngram", *tiny_overrides, "dataset.limit=2"]
    summary = run(compose_cfg(over), tmp_path / "sweep" / "p")
    assert summary["status"] == "ok" and summary["config"]["pairing"] == "smollm2_ngram"
    written = plot_all([tmp_path / "sweep"], tmp_path / "figs")
    assert tmp_path / "figs" / "pairings.png" in written
