"""benchmarks.harness and benchmarks.report: results files, merging, the printed report,
and benchmarks/gpu_check.sh's dry run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import harness, report
from specdec.errors import SpecDecError

REPO = Path(__file__).resolve().parents[2]


def test_save_results_writes_json_and_csv_with_the_union_of_columns(tmp_path):
    records = [{"a": 1, "b": [1, 2]}, {"a": 2, "c": "x"}]
    path = harness.save_results("t", records, out=tmp_path, env={"device": "d"})
    assert json.loads(path.read_text()) == {"environment": {"device": "d"}, "records": records}
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"a": "1", "b": "[1, 2]", "c": ""}, {"a": "2", "b": "", "c": "x"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "t.json"]  # no temp files
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_merge_results_keeps_other_benchmarks_keys(tmp_path):
    path = tmp_path / "combined.json"
    harness.merge_results(path, {"gpu": "g", "kernels": {"a": [1]}, "e2e": {"x": 1}})
    harness.merge_results(path, {"kernels": {"b": [2]}, "e2e": {"y": 2}, "gpu": "h"})
    harness.merge_results(path, {"kernels": {"a": [3]}})
    assert json.loads(path.read_text()) == {
        "gpu": "h",
        "kernels": {"a": [3], "b": [2]},
        "e2e": {"x": 1, "y": 2},
    }


def test_kernel_record_and_table():
    r = harness.kernel_record("k", "s", 2.0, 4_000_000, 4.0, "base", 3.0)
    assert r["gbps"] == pytest.approx(2.0) and r["fraction_of_copy_bandwidth"] == 0.5
    assert r["speedup"] == 1.5
    graphed = {**r, "graph_ms": 0.5, "graph_gbps": 8.0}  # GEMV rows timed in a CUDA graph
    table = harness.markdown_table([r, {**r, "baseline_ms": None, "speedup": None}, graphed],
                                   harness.KERNEL_COLUMNS)  # fmt: skip
    lines = table.splitlines()
    assert lines[0].endswith("| speedup | graph ms | graph GB/s |")
    assert lines[2] == "| k | s | 2.0000 | 2 | 50% | base | 3.0000 | 1.50 | - | - |"
    assert lines[3].endswith("| base | - | - | - | - |")
    assert lines[4].endswith("| 3.0000 | 1.50 | 0.5000 | 8 |")
    # graph timing is CUDA-only: on CPU the record is left as it is and fn never runs
    calls = []
    assert harness.add_graph_time(dict(r), lambda: calls.append(1), 10, "cpu") == r
    assert calls == []


def test_report_of_a_missing_file_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / "missing.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read results file") and err.count("\n") == 1


def test_gpu_check_dry_run(tmp_path):
    """DRY_RUN=1 on CPU: the step runner, timeouts, results files and the report step."""
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "RESULTS_DIR": str(tmp_path),
        "STEPS": "bench_rejection report",
        "PYTHON": sys.executable,
    }
    out = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== bench_rejection: ok" in out.stdout and "== report: ok" in out.stdout
    assert "== tests" not in out.stdout  # not in STEPS
    assert "| rejection_sample[greedy] | greedy B=3 k=4 V=1000 fp32 |" in out.stdout
    (combined,) = tmp_path.glob("2*.json")
    assert set(json.loads(combined.read_text())["kernels"]) == {"bench_rejection"}
    assert (tmp_path / "bench_rejection.csv").exists()
    assert list(tmp_path.glob("*-gpu-check.log"))


def test_git_commit_names_the_code(monkeypatch, tmp_path):
    """The commit results record: $SPECDEC_COMMIT when set; else HEAD, "+dirty" when a
    tracked file differs from it (a copied tree with a stale .git says so)."""
    monkeypatch.setenv("SPECDEC_COMMIT", "f97eed1")
    assert harness.git_commit() == "f97eed1"
    monkeypatch.delenv("SPECDEC_COMMIT")
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    (repo / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(harness, "REPO", repo)
    head = harness.git_commit()
    assert len(head) >= 7 and "+" not in head
    (repo / "b.txt").write_text("untracked files do not count\n")
    assert harness.git_commit() == head
    (repo / "a.txt").write_text("two\n")
    assert harness.git_commit() == head + "+dirty"
    monkeypatch.setattr(harness, "REPO", tmp_path / "nowhere")
    assert harness.git_commit() == "unknown"


def test_cpu_mode_model_parses_the_compile_suffix(tiny_gguf):
    """ "dtype:cpu_linear[:inv][+compile]": +compile sets up compiled steps (the caller warms
    them), no suffix leaves them off, any other suffix or a fourth field is refused."""
    path = tiny_gguf("llama", "Q8_0")
    model, _ = harness.cpu_mode_model(path, "float32:dense:off+compile")
    assert model.cpu_compile and model.dtype == torch.float32
    model, _ = harness.cpu_mode_model(path, "float32:dense")
    assert not model.cpu_compile
    for bad in (
        "float32:dense+graphs",
        "float32:dense:off:on",
        "float32",
        "float32:x",
        "a:dense:maybe",
    ):
        with pytest.raises(SpecDecError, match="mode"):
            harness.cpu_mode_model(path, bad)


def test_bench_peers_compiles_every_step_before_timing(tiny_gguf, monkeypatch):
    """A +compile mode warms the plain decode step and each speculative decoder's steps for
    the longest prompt before any system is timed; an eager mode warms nothing."""
    from benchmarks import bench_peers
    from specdec.decode import generation, speculative

    calls = []
    monkeypatch.setattr(generation, "warm_up", lambda m, b, n, new: calls.append(("plain", n)) or 0)
    monkeypatch.setattr(
        speculative.SpeculativeDecoder,
        "warm_up",
        lambda self, b, n, new: calls.append(("spec", n)) or 0,
    )
    cfg = bench_peers.draft_config("ngram")
    path = str(tiny_gguf("llama", "Q8_0"))
    systems = bench_peers.specdec_systems(path, "float32:dense+compile", [cfg], 2, 8, 37)
    assert calls == [("plain", 37), ("spec", 37)] and len(systems) == 2
