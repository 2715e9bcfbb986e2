"""The kernel benchmarks' CPU smoke paths (Triton interpreter, tiny shapes): records, the
results files and the combined file they merge into."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from benchmarks import bench_attention, bench_kernels, bench_rejection
from benchmarks.harness import REPO
from specdec.kernels.kquant_gemv import LAYOUTS, layout_for


def _other_layout(fmt: str) -> str:
    (other,) = set(LAYOUTS) - {layout_for(fmt, use_dot=False)}
    return other


if torch.cuda.is_available():
    pytest.skip("the GPU run is the real benchmark", allow_module_level=True)


@pytest.mark.parametrize(
    "module, kernels",
    [
        (
            bench_kernels,
            {f"quant_linear[{f}]" for f in ("int4", "q4_1", "q8_0", "q4_k", "q5_0")}
            # the last section times the layout the default did not pick (CPU: broadcast rows)
            | {f"quant_linear[{f},{_other_layout(f)}]" for f in ("q4_k", "q5_0")},
        ),
        (bench_attention, {"verify_attention", "compact_kv"}),
        (bench_rejection, {"rejection_sample[greedy]", "rejection_sample[stochastic]"}),
    ],
)
def test_quick_cpu_run_writes_records(module, kernels, tmp_path):
    name = module.__name__.rsplit(".", 1)[1]
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    records = saved["records"]
    assert {r["kernel"] for r in records} == kernels
    assert saved["environment"]["copy_bandwidth_gbps"] > 0
    for r in records:
        assert r["ms"] > 0 and r["baseline_ms"] > 0 and r["gbps"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ms"])
        if bench_kernels.fmt_of(r) in ("q4_k", "q5_0"):  # next to Q4_1's, both layouts
            assert r["ms_per_weight_byte_vs_q4_1"] > 0
            assert r["vs_q4_1_timing"] == "eager"  # no CUDA graphs on CPU
    with open(tmp_path / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["shape"] for r in rows] == [r["shape"] for r in records]
    (combined,) = tmp_path.glob("2*.json")
    assert json.loads(combined.read_text())["kernels"] == {name: records}


def test_rejection_records_match_the_reference_and_count_rows_read(tmp_path):
    assert bench_rejection.main(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "bench_rejection.json").read_text())["records"]
    assert all(r["matches_reference"] for r in records)
    for r in records:
        B, k, V = (int(r["shape"].split(f" {x}=")[1].split()[0]) for x in ("B", "k", "V"))
        rows = r["gbps"] * 1e9 * r["ms"] * 1e-3 / (4 * V)
        if "greedy" in r["kernel"]:  # n_accepted + 1 rows per sequence
            assert rows == pytest.approx(B * (r["mean_accepted"] + 1))
        else:  # 2 or 3 rows per sequence
            assert 2 * B - 1e-6 <= rows <= 3 * B + 1e-6


def _gemv_rec(fmt, m, ms, graph_ms=None, n=64, k=512):
    rec = {"kernel": f"quant_linear[{fmt}]", "shape": f"tiny proj M={m} N={n} K={k} bf16"}
    rec["ms"] = ms
    if graph_ms is not None:
        rec["graph_ms"] = graph_ms
    return rec


def test_kquant_ratio_is_per_weight_byte_and_prefers_graph_times():
    """q4_k moves 144 B per 256 weights, Q4_1 160 B: equal times are 160/144 per byte; the
    graph replay (the kernel's own time) is used where both records have one."""
    recs = [
        _gemv_rec("q4_1", 1, ms=0.10, graph_ms=0.010),
        _gemv_rec("q4_k", 1, ms=0.10, graph_ms=0.012),
        _gemv_rec("q4_1", 4, ms=0.10),
        _gemv_rec("q6_k", 4, ms=0.05),
        _gemv_rec("q5_0", 8, ms=0.05),  # no Q4_1 record of this M: no ratio
    ]
    out = bench_kernels.annotate_vs_q4_1(recs)
    assert out[1]["vs_q4_1_timing"] == "graph"
    assert out[1]["ms_per_weight_byte_vs_q4_1"] == pytest.approx(1.2 * 160 / 144)
    assert out[1]["eager_ms_per_weight_byte_vs_q4_1"] == pytest.approx(160 / 144)
    assert out[3]["vs_q4_1_timing"] == "eager"
    assert out[3]["ms_per_weight_byte_vs_q4_1"] == pytest.approx(0.5 * 160 / 210)
    assert "ms_per_weight_byte_vs_q4_1" not in out[4] and "vs_q4_1" not in str(out[0])
    summary = bench_kernels.kquant_summary(recs, goal=1.2)
    assert [(s["format"], s["rows"], s["met"], s["points"]) for s in summary] == [
        ("q4_k", "M=1", 0, 1),
        ("q6_k", "M>1", 1, 1),
    ]


def test_kquant_summary_of_the_committed_h200_run(capsys):
    """The first H200 run's records (2026-12-04) predate weight_bytes and the graph-timed
    ratio: the summary recomputes both from the shapes and graph_ms."""
    path = REPO / "benchmarks/results/2026-12-04-nvidia-h200.json"
    assert bench_kernels.main(["--kquant-summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| q4_k | M>1 | - | graph |" in out and "| q5_0 | M=1 | - | graph |" in out
    records = json.loads(path.read_text())["kernels"]["bench_kernels"]
    by = {(s["format"], s["rows"]): s for s in bench_kernels.kquant_summary(records)}
    assert by[("q5_0", "M>1")]["points"] == 60 and by[("q4_k", "M=1")]["points"] == 7


def test_kquant_summary_bad_file_is_one_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert bench_kernels.main(["--kquant-summary", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().out
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"records": []}))
    assert bench_kernels.main(["--kquant-summary", str(empty)]) == 2
    assert bench_kernels.main(["--kquant-summary"]) == 2
