"""experiments/plot.py: series grouping, the lossy-acceptance figure from real tiny runs,
and the command line."""

from __future__ import annotations

import pytest

from experiments.plot import group_series, main, plot_all
from experiments.run import run


def fake(kind, k, **accept):
    return {
        "config": {
            "draft": {"kind": kind},
            "spec": {"k": k},
            "accept": {"rule": "greedy", **accept},
        }
    }


def test_series_are_named_by_what_differs():
    pts = [fake("ngram", 1), fake("ngram", 2), fake("layerskip", 1)]
    assert {k: len(v) for k, v in group_series(pts, ("spec.k",)).items()} == {
        "ngram": 2,
        "layerskip": 1,
    }
    pts = [fake("ngram", 2, rule="threshold", tau=t) for t in (0.1, 0.2)]
    pts += [fake("ngram", 2, rule="typical", tau=t) for t in (0.1, 0.2)]
    assert sorted(group_series(pts, ("accept.tau",))) == ["ngram threshold", "ngram typical"]
    assert sorted(group_series(pts, ())) == [
        "ngram threshold tau=0.1",
        "ngram threshold tau=0.2",
        "ngram typical tau=0.1",
        "ngram typical tau=0.2",
    ]


def test_threshold_figure_from_runs(compose_cfg, tiny_overrides, tmp_path):
    for rule in ("threshold", "typical"):
        for tau in (0.05, 0.5):
            key = {"threshold": "tau", "typical": "epsilon"}[rule]
            over = [*tiny_overrides, "draft=layerskip", f"accept={rule}", f"accept.{key}={tau}"]
            assert run(compose_cfg(over), tmp_path / "sweep" / f"{rule}-{tau}")["status"] == "ok"
    written = plot_all([tmp_path / "sweep"], tmp_path / "figs")
    names = sorted(f.name for f in written)
    assert names == sorted(
        ["per_category.png", "per_category.pdf", "threshold_tradeoff.png", "threshold_tradeoff.pdf"]
    )


def test_cli(compose_cfg, tiny_overrides, tmp_path, capsys):
    run(compose_cfg(tiny_overrides), tmp_path / "run")
    main([str(tmp_path / "run")])
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "run" / "plots" / "drafters.png") in printed  # one k: bars
    assert all(p.endswith(".png") for p in printed)

    (tmp_path / "empty").mkdir()
    for argv, msg in [
        ([str(tmp_path / "empty")], "no summary.json"),
        ([str(tmp_path / "missing")], "not a folder"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err

    run(compose_cfg([*tiny_overrides, "draft=none"]), tmp_path / "base")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "base")])
    assert "only draft=none" in capsys.readouterr().err
