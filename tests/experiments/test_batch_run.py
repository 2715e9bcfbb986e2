"""Batch-size runs (gen.batch_size) of experiments/run.py on the tiny models: the rows and
summary of a batched run against sums over its own rows, batch 1 as before, greedy
outputs unchanged by batching, one error line for a bad batch size."""

from __future__ import annotations

import json
import statistics

import pytest

from experiments.results import (
    RESULTS,
    SCHEMA_VERSION,
    SUMMARY,
    read_run,
)
from experiments.run import check_config, run, summary_table
from specdec.errors import SpecDecError


def test_batched_run_sums_its_batches(compose_cfg, tiny_overrides, tmp_path):
    # 4 prompts of different lengths in batches of 3: one full batch, one of 1 (kept)
    s = run(compose_cfg([*tiny_overrides, "gen.batch_size=3", "spec.k=2"]), tmp_path)
    rows, on_disk = read_run(tmp_path)
    assert on_disk == json.loads(json.dumps(s)) and s["schema_version"] == SCHEMA_VERSION == 2
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["batch"] for r in rows] == [{"index": 0, "size": 3}] * 3 + [{"index": 1, "size": 1}]
    assert len({len(r["prompt_ids"]) for r in rows[:3]}) > 1  # different lengths together
    b = s["batch"]
    assert b["batch_size"] == 3 and b["n_batches"] == 2 and b["sizes"] == [3, 1]
    groups = [rows[:3], rows[3:]]
    for part, key in (("baseline", "baseline"), ("spec", "speculative")):
        elapsed = []
        for g, tps in zip(groups, b[key]["tokens_per_second"]):
            assert len({json.dumps(r[part]["elapsed_s"]) for r in g}) == 1  # the batch's time
            e, prefill = g[0][part]["elapsed_s"], g[0][part]["prefill_s"]
            elapsed.append(e)
            assert tps == pytest.approx(sum(len(r[part]["tokens"]) for r in g) / e)
            for r in g:
                assert prefill <= r[part]["latency_s"] <= e
            # the batch ends right after its slowest sequence's last token
            assert max(r[part]["latency_s"] for r in g) == pytest.approx(e, rel=0.05, abs=0.01)
        tokens = sum(len(r[part]["tokens"]) for r in rows)
        top = s[key]
        assert top["elapsed_s"] == pytest.approx(sum(elapsed))
        assert top["tokens_per_second"] == pytest.approx(tokens / sum(elapsed))
        lat = [r[part]["latency_s"] for r in rows]
        assert b[key]["latency_s"] == pytest.approx(
            {"mean": statistics.fmean(lat), "median": statistics.median(lat), "max": max(lat)}
        )
    spec = s["speculative"]
    assert s["speedup"] == pytest.approx(
        spec["tokens_per_second"] / s["baseline"]["tokens_per_second"]
    )
    # lockstep rounds: the batch verifies until its slowest sequence is done
    for g in groups:
        assert g[0]["spec"]["target_forwards"] - 1 == max(r["spec"]["rounds"] for r in g)
    assert spec["batched_rounds"] == sum(g[0]["spec"]["target_forwards"] - 1 for g in groups)
    assert spec["rounds"] == sum(r["spec"]["rounds"] for r in rows) > spec["batched_rounds"]
    assert s["verify_step_s"] == pytest.approx(spec["time_s"]["verify"] / spec["batched_rounds"])
    steps = sum(g[0]["baseline"]["target_forwards"] - 1 for g in groups)
    base = s["baseline"]
    assert s["target_step_s"] == pytest.approx((base["elapsed_s"] - base["prefill_s"]) / steps)
    pred = s["predicted"]
    assert pred["batch_speedup"] > 0 and pred["speedup_v"] == pytest.approx(
        pred["mean_accepted_tokens"] / (2 * s["c"] + s["verify_ratio"])
    )
    # per category, each sequence is charged its batch's time / its batch's size
    cats = s["per_category"]
    assert sum(c["n"] for c in cats.values()) == 4
    charged = sum(
        sum(len(r["baseline"]["tokens"]) for r in rows if r["category"] == cat)
        / c["baseline_tokens_per_second"]
        for cat, c in cats.items()
    )
    assert charged == pytest.approx(base["elapsed_s"])
    assert s["agreement"]["identical_outputs"] == 1.0  # greedy: lossless at any batch size
    assert "2 batches of 1/3" in summary_table(s)


def test_batch_one_is_the_per_prompt_run(compose_cfg, tiny_overrides, tmp_path):
    s = run(compose_cfg([*tiny_overrides, "spec.k=2"]), tmp_path)
    rows, _ = read_run(tmp_path)
    assert [r["batch"] for r in rows] == [{"index": i, "size": 1} for i in range(4)]
    assert s["batch"]["sizes"] == [1] * 4
    spec = s["speculative"]
    assert spec["batched_rounds"] == spec["rounds"]  # every round is one sequence's
    assert s["baseline"]["elapsed_s"] == pytest.approx(
        sum(r["baseline"]["elapsed_s"] for r in rows)
    )
    assert s["verify_step_s"] == pytest.approx(spec["time_s"]["verify"] / spec["rounds"])
    for r in rows:
        assert r["spec"]["latency_s"] == pytest.approx(r["spec"]["elapsed_s"], rel=0.05, abs=0.01)


def test_greedy_outputs_do_not_depend_on_the_batch(compose_cfg, tiny_overrides, tmp_path):
    """Speculative decoding of all 4 prompts in one batch (layer-skip drafts: the
    sequences accept different prefixes in the same round) gives each prompt the tokens of
    its plain batch-1 decoding."""
    longer = [*tiny_overrides, "gen.max_new_tokens=12", "gen.ignore_eos=true"]
    alone = run(compose_cfg([*longer, "draft=none"]), tmp_path / "b1")
    assert alone["speculative"] is None
    run(compose_cfg([*longer, "gen.batch_size=4", "draft=layerskip", "spec.k=3"]), tmp_path / "b4")
    plain, _ = read_run(tmp_path / "b1")
    batched, _ = read_run(tmp_path / "b4")
    assert {r["batch"]["size"] for r in batched} == {4}
    accepted = [r["spec"]["accepted_per_round"] for r in batched]
    assert len({json.dumps(a) for a in accepted}) > 1  # the sequences did differ per round
    assert sum(map(sum, accepted)) > 0
    for p, q in zip(plain, batched):
        assert len(p["baseline"]["tokens"]) == 12
        assert q["spec"]["tokens"] == p["baseline"]["tokens"], q["id"]
        assert q["baseline"]["tokens"] == p["baseline"]["tokens"], q["id"]


@pytest.mark.parametrize("value,msg", [(0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1")])
def test_bad_batch_size_is_one_error(compose_cfg, tiny_overrides, value, msg):
    cfg = compose_cfg([*tiny_overrides, f"gen.batch_size={value}"])
    with pytest.raises(SpecDecError, match=f"gen.batch_size {msg}"):
        check_config(cfg)


def test_bad_batch_size_on_the_command_line(run_cli, tiny_overrides, tmp_path):
    p = run_cli(*tiny_overrides, "gen.batch_size=abc", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2
    assert (
        p.stderr.strip().splitlines()[-1] == "error: gen.batch_size must be an integer, got 'abc'"
    )
    failed = json.loads((tmp_path / SUMMARY).read_text())  # the point says why, no results
    assert failed["status"] == "failed" and "gen.batch_size" in failed["error"]
    assert not (tmp_path / RESULTS).exists()
