"""experiment=streamed composes, and a streamed target runs through the runner with the
resident target's tokens and the bytes it streamed per token in summary.json."""

from __future__ import annotations

import json

from experiments.results import RESULTS, SUMMARY, read_jsonl, validate_row, validate_summary
from experiments.run import run


def test_streamed_experiment_composes(compose_cfg):
    cfg = compose_cfg(["experiment=streamed"])
    assert cfg.target.stream is True
    assert cfg.target.resident_layers == cfg.draft.exit_layer == 7
    assert cfg.draft.kind == "early_exit"


def test_streamed_target_through_the_runner(compose_cfg, tiny_overrides, tmp_path):
    base = [*tiny_overrides, "draft=early_exit", "draft.exit_layer=1", "spec.k=2"]
    resident = run(compose_cfg(base), tmp_path / "resident")
    streamed = run(
        compose_cfg([*base, "target.stream=true", "target.resident_layers=1"]),
        tmp_path / "streamed",
    )
    rows_r = read_jsonl(tmp_path / "resident" / RESULTS)
    rows_s = read_jsonl(tmp_path / "streamed" / RESULTS)
    for r in rows_s:
        validate_row(r)
    validate_summary(json.loads((tmp_path / "streamed" / SUMMARY).read_text()))
    assert [r["spec"]["tokens"] for r in rows_s] == [r["spec"]["tokens"] for r in rows_r]
    assert [r["baseline"]["tokens"] for r in rows_s] == [r["baseline"]["tokens"] for r in rows_r]
    per_tok = streamed["bytes_streamed_per_token"]
    assert per_tok["baseline"] > 0 and per_tok["speculative"] > 0
    assert resident["bytes_streamed_per_token"] == {"baseline": None, "speculative": None}
    assert all(r["spec"]["bytes_streamed"] > 0 for r in rows_s)
