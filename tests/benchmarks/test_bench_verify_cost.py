"""benchmarks.bench_verify_cost: the tree shape it times, and a short run with trees."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_verify_cost as bvc


def test_binary_tree_mask_and_depths():
    mask, depths = bvc.binary_tree(7)
    parents = [-1, 0, 0, 1, 1, 2, 2]
    for i in range(7):  # ancestors by walking the parents
        want, p = {i}, parents[i]
        while p >= 0:
            want.add(p)
            p = parents[p]
        assert {j for j in range(7) if int(mask[0, i]) >> j & 1} == want
        assert depths[0, i] == len(want) - 1


def test_run_with_trees_writes_rows(smollm2_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bvc, "available", lambda name: None)
    monkeypatch.setattr(bvc, "cpu_mode_model", _from_path(smollm2_path, bvc.cpu_mode_model))
    bvc.main(
        "--models smollm2-135m --modes bfloat16:dense --threads 1 --t 1 3 --trees 3 "
        f"--rounds 1 --context 20 --no-numerics --out {tmp_path}".split()
    )
    out = capsys.readouterr().out
    assert "tree 3" in out and "T=3" in out
    (path,) = tmp_path.glob("verify_cost*.json")
    rows = json.loads(path.read_text())["records"]
    tree = [r for r in rows if r.get("T") == "tree 3"]
    assert len(tree) == 1 and tree[0]["tree"] and tree[0]["ms"] > 0
    assert torch.isfinite(torch.tensor(tree[0]["vs_T1"]))


def _from_path(path, real):
    return lambda name, spec: real(path, spec)


@pytest.mark.parametrize("bad", ["--trees 0", "--t 0 1", "--threads -1", "--rounds 0"])
def test_bad_counts_are_one_error_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bvc.main(bad.split())
    assert e.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mode, why",
    [
        ("float32:bogus", "cpu_linear must be one of"),
        ("float32", "expected dtype:cpu_linear"),
        ("bfloat16:dense:maybe", "batch invariance must be auto, on or off"),
    ],
)
def test_bad_mode_is_one_error_line_before_loading(mode, why, monkeypatch, capsys):
    monkeypatch.setattr(bvc, "cpu_mode_model", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        bvc.main(["--modes", mode, "--no-numerics"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: mode {mode!r}: {why}"), err
