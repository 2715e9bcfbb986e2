"""benchmarks.bench_streamed end to end on a tiny model (CPU: plumbing, not timings)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.bench_streamed import main


def test_bench_streamed_cpu_smoke(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the GPU run is the real benchmark")
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("2*.json")
    res = json.loads(path.read_text())["streamed"]
    assert res["streamed_bytes_per_forward"] == res["plain"]["bytes_streamed_per_token"] > 0
    assert [r["k"] for r in res["speculative"]] == [4, 8]
    assert all(r["identical_to_plain"] for r in res["speculative"])
    rows = json.loads((tmp_path / "bench_streamed.json").read_text())["records"]
    assert [r["decoding"] for r in rows] == ["plain", "early_exit k=4", "early_exit k=8"]
