"""The kernel benchmarks' CPU smoke paths (Triton interpreter, tiny shapes): records, the
results files and the combined file they merge into."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from benchmarks import bench_attention, bench_kernels, bench_rejection

if torch.cuda.is_available():
    pytest.skip("the GPU run is the real benchmark", allow_module_level=True)


@pytest.mark.parametrize(
    "module, kernels",
    [
        (
            bench_kernels,
            {f"quant_linear[{f}]" for f in ("int4", "q4_1", "q8_0", "q4_k", "q5_0")},
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
        if r["kernel"] in ("quant_linear[q4_k]", "quant_linear[q5_0]"):  # next to Q4_1's
            assert r["ms_per_weight_byte_vs_q4_1"] > 0
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
