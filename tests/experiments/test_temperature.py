"""experiment=temperature: a tiny-model temperature sweep carries the distribution-level
acceptance alpha_dist into results.jsonl and summary.json, and the temperature figure
renders (from the sweep's runs through the plot dispatch, and from synthetic summaries)."""

from __future__ import annotations

import json

import pytest

from experiments.metrics import alpha_dist_metrics, predicted_speedup
from experiments.plot import plot_all, plot_temperature
from experiments.results import RESULTS, SUMMARY, read_jsonl, validate_summary
from experiments.run import run


def test_temperature_config_sweeps_lossless_sampling(compose_cfg):
    cfg = compose_cfg(["experiment=temperature"], hydra=True)
    params = cfg.hydra.sweeper.params
    assert params["accept"] == "speculative"
    assert [float(t) for t in params["gen.temperature"].split(",")] == [0.0, 0.3, 0.7, 1.0]
    assert set(params["draft"].split(",")) == {"ngram", "layerskip", "early_exit", "head"}
    assert cfg.spec.k == 4 and cfg.dataset.name == "specbench_mini"


def test_alpha_dist_by_hand():
    specs = [
        {  # rounds: 2 drafted (1 accepted: both examined), 3 drafted (all accepted)
            "accepted_per_round": [1, 3],
            "drafted_per_round": [2, 3],
            "alpha_dist_per_round": [0.9, 2.4],
            "alpha_dist_examined_per_round": [0.9, 2.4],
        },
        {  # 3 drafted, 0 accepted: only the first examined; a round without drafts
            "accepted_per_round": [0, 0],
            "drafted_per_round": [3, 0],
            "alpha_dist_per_round": [1.2, 0.0],
            "alpha_dist_examined_per_round": [0.3, 0.0],
        },
    ]
    out = alpha_dist_metrics(specs, k=3, c=0.1)
    assert out["alpha_dist"] == pytest.approx(4.5 / 8)
    assert out["alpha_dist_examined"] == pytest.approx(3.6 / 6)
    assert out["predicted_from_alpha_dist"]["speedup"] == pytest.approx(
        predicted_speedup(4.5 / 8, 3, 0.1)
    )
    assert alpha_dist_metrics(specs, k=3, c=None)["predicted_from_alpha_dist"] is None
    # rows without the statistic (tree rounds, older results): not measured
    bare = [{k: v for k, v in s.items() if not k.startswith("alpha")} for s in specs]
    assert alpha_dist_metrics(bare, k=3, c=0.1) == {
        "alpha_dist": None,
        "alpha_dist_examined": None,
        "predicted_from_alpha_dist": None,
    }


def test_tiny_temperature_sweep_reports_alpha_dist(
    compose_cfg, tiny_overrides, tiny_models, tmp_path
):
    sweep = tmp_path / "sweep"
    draft = ["draft=model", f"draft.model={tiny_models[1]}"]
    summaries = {}
    for kind, over in (("ngram", []), ("model", draft)):
        for t in (0.0, 0.8):
            cfg = compose_cfg(
                [*tiny_overrides, *over, "accept=speculative", f"gen.temperature={t}", "spec.k=3"]
            )
            d = sweep / f"{kind}-{t}"
            summaries[kind, t] = s = run(cfg, d)
            assert s == json.loads((d / SUMMARY).read_text())
            validate_summary(s)
            rows = read_jsonl(d / RESULTS)
            for r in rows:
                spec = r["spec"]
                assert len(spec["alpha_dist_per_round"]) == spec["rounds"]
                assert len(spec["alpha_dist_examined_per_round"]) == spec["rounds"]
                for a, e, n in zip(
                    spec["alpha_dist_per_round"],
                    spec["alpha_dist_examined_per_round"],
                    spec["drafted_per_round"],
                ):
                    assert 0.0 <= e <= a + 1e-6 <= n + 1e-6  # examined positions are a subset
            drafted = sum(sum(r["spec"]["drafted_per_round"]) for r in rows)
            total = sum(sum(r["spec"]["alpha_dist_per_round"]) for r in rows)
            assert s["alpha_dist"] == pytest.approx(total / drafted)
            assert 0.0 <= s["alpha_dist"] <= 1.0 and 0.0 <= s["alpha_dist_examined"] <= 1.0
            pred = s["predicted_from_alpha_dist"]
            assert pred["speedup"] > 0 and pred["mean_accepted_tokens"] >= 1.0
    for kind in ("ngram", "model"):
        greedy = summaries[kind, 0.0]
        # speculative sampling at temperature 0 is greedy verification: the target's output
        assert greedy["agreement"]["identical_outputs"] == 1.0
        # ... and acceptance is deterministic: examined drafts are accepted iff alpha_i = 1
        assert greedy["alpha_dist_examined"] == pytest.approx(greedy["alpha"], abs=1e-5)
    written = plot_all([sweep], tmp_path / "figs")
    assert {"temperature.png", "temperature.pdf"} <= {f.name for f in written}


def synthetic(kind: str, t: float, alpha: float, c: float) -> dict:
    k = 4
    return {
        "config": {
            "draft": {"kind": kind},
            "spec": {"k": k},
            "accept": {"rule": "speculative"},
            "gen": {"temperature": t},
        },
        "model": "tiny",
        "n_prompts": 3,
        "environment": {"hardware": "cpu", "device": "cpu"},
        "k": k,
        "alpha": alpha,
        "alpha_dist": alpha - 0.05,
        "alpha_dist_examined": alpha + 0.01,
        "c": c,
        "speedup": 1.2 * alpha + 0.3,
        "predicted_from_alpha_dist": {"speedup": 1.1 * alpha + 0.4, "mean_accepted_tokens": 2.0},
    }


def test_temperature_figure_from_synthetic_sweep(tmp_path):
    pts = [
        synthetic(kind, t, a - 0.2 * t, c)
        for kind, a, c in (("ngram", 0.6, 0.01), ("layerskip", 0.5, 0.5))
        for t in (0.0, 0.3, 0.7, 1.0)
    ]
    pts[-1]["alpha_dist"] = None  # a point without the statistic (tree rounds) is left out
    pts[-1]["alpha_dist_examined"] = None
    pts[-1]["predicted_from_alpha_dist"] = None
    written: list = []
    plot_temperature(pts, tmp_path, written)
    assert sorted(p.name for p in written) == ["temperature.pdf", "temperature.png"]
    assert all(p.stat().st_size > 1000 for p in written)
