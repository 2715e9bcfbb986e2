"""benchmarks/compile_check.py --quick: every kernel configuration the launchers pick for
SmolLM2 shapes compiles for sm_90 without a GPU, with no spills and 16-byte weight loads
(k-quant formats included; their high-bit planes allow 4 (q5_0, q5_1) or 8 (q5_k) bytes).

The full check over all model shapes, formats and widths is a documented command, not a
test: `python -m benchmarks.compile_check --arch sm_80 sm_90`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("triton.backends.nvidia")


def compile_check(*args: str, timeout: int = 600, **env_extra: str):
    """`python -m benchmarks.compile_check *args` in a subprocess (compiling, not interpreting)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quick_compile_check(tmp_path):
    run = compile_check("--quick", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "compile_check.json").read_text())["records"]
    kernels = {r["kernel"] for r in rows}
    assert {"_quant_gemv_kernel", "_verify_attention_kernel", "_compact_kv_kernel"} <= kernels
    assert {"_greedy_accept_kernel", "_stochastic_accept_kernel"} <= kernels
    for r in rows:
        assert "error" not in r, r
        assert r["registers"] > 0 and 0 < r["occupancy"] <= 1
    gemv = [r for r in rows if r["kernel"] == "_quant_gemv_kernel"]
    assert {r["config"].split()[0] for r in gemv} == {"BITS=4", "BITS=8"}
    assert all(r["bulk_load_bytes"] == 16 for r in gemv), [
        (r["example"], r["bulk_load_bytes"]) for r in gemv
    ]
    # the k-quant / 5-bit formats join through their WeightFormat registration, each on the
    # first SmolLM2 layer it can hold (q4_k, q5_k, q6_k: the 1536-wide down projection)
    kquant = {r["example"].split()[2]: r for r in rows if r["kernel"] == "_kquant_gemv_kernel"}
    assert set(kquant) == {"q5_0", "q5_1", "q4_k", "q5_k", "q6_k"}
    assert kquant["q4_k"]["example"].startswith("smollm2-135m down")
    for fmt, i in [("q5_0", 0), ("q5_1", 1), ("q4_k", 2), ("q5_k", 3), ("q6_k", 4)]:
        assert f"FMT={i}" in kquant[fmt]["config"].split(), kquant[fmt]["config"]
    for fmt, r in kquant.items():
        want = {"q5_0": 4, "q5_1": 4, "q5_k": 8}.get(fmt, 16)  # the high-bit planes' widths
        assert r["bulk_load_bytes"] >= want, (fmt, r["bulk_load_bytes"])
    # the "halves" k-quant tiles decode low and high nibbles as two tiles with their scales
    # laid out like the codes (kquant_gemv._kquant_tile): 72-104 registers for 16-bit rows
    # under triton 3.9, as Q4_1's tensor-core tiles (80-96). The element-order tile took
    # 128-168 (triton moved the whole fp32 tile through shared memory to match a 3-D scale
    # load's layout); it stays the default only where it is smaller under the installed
    # triton (kquant_gemv.default_layouts)
    halves = [
        r
        for r in rows
        if r["kernel"] == "_kquant_gemv_kernel"
        and r["dtype"] != "fp32"
        and "HALVES=True" in r["config"].split()
    ]
    assert {r["example"].split()[2] for r in halves} >= {"q4_k", "q5_k"}, halves
    for r in halves:
        assert r["registers"] <= 104, (r["example"], r["config"], r["registers"])
    assert "distinct configurations" in run.stdout


def test_bad_arch_is_a_usage_error():
    run = compile_check("--arch", "sm_12", timeout=120)
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_compile_check_with_a_tuned_table(tmp_path):
    """--device compiles the configurations a tuned GEMV table gives that device (here 2
    warps and 2 stages for every Q4_1 layout and SmolLM2 shape): they must compile as
    cleanly as the heuristic's."""
    entries = [
        {"format": "4b-g32-min", "n": n, "k": k, "path": path, "block_n": 16, "block_k": 128,
         "split_k": 2, "num_warps": 2, "num_stages": 2}
        for n in (192, 576, 960, 1536, 3072, 49152)
        for k in (576, 1536)
        for path in ("m1", "dot")
    ]  # fmt: skip
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": 1, "device": "Example GPU", "entries": entries}))
    cmd = ["--quick", "--kernel", "gemv", "--formats", "q4_1", "q8_0", "--device", "Example GPU"]
    run = compile_check(*cmd, "--out", str(tmp_path), SPECDEC_GEMV_TUNING=str(table))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "compile_check.json").read_text())["records"]
    q4_1 = [r for r in rows if " q4_1 " in r["example"]]
    q8_0 = [r for r in rows if " q8_0 " in r["example"]]
    assert q4_1 and q8_0
    assert all(r["num_warps"] == 2 and r["num_stages"] == 2 for r in q4_1), q4_1
    assert all(r["num_warps"] == 4 for r in q8_0)  # no entry for its layout: the heuristic
    assert all(not r["problems"] and r["spill_bytes"] == 0 for r in rows), rows
