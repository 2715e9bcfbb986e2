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

from specdec.kernels.quant import KQUANT_BLOCKS

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
    # the K loop's instructions per KB of packed weight, recomputed from the row's config and
    # the GGUF block sizes (not the weight objects the check reads them from); an 8-bit byte
    # decodes into one weight, a 4-bit byte into two, so q8_0 costs less per byte than q4_1
    block_bytes = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), **KQUANT_BLOCKS}
    per_kb = {}
    for r in gemv + list(kquant.values()):
        fmt = r["example"].split()[2]
        c = dict(kv.split("=") for kv in r["config"].split())
        k_tile = (
            int(c["BLOCK_K"]) if "BLOCK_K" in c else int(c["TILE_GROUPS"]) * int(c["TILE_GROUP"])
        )
        assert r["loop_instructions"] > 100, (r["example"], r["loop_instructions"])
        if fmt in block_bytes:
            nbytes, block = block_bytes[fmt]
            kb = int(c["BLOCK_N"]) * k_tile * nbytes / block / 1024
            want = r["loop_instructions"] * r["num_warps"] / kb
            assert r["loop_instructions_per_kb"] == pytest.approx(want, abs=0.1), r
            per_kb[fmt] = r["loop_instructions_per_kb"]
    assert set(per_kb) >= {"q4_1", "q8_0", "q4_k", "q6_k"}, per_kb
    assert per_kb["q8_0"] < per_kb["q4_1"], per_kb
    assert "distinct configurations" in run.stdout


LISTING = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
.L_x_2:
        /*0030*/                   FFMA R8, R4, R5, R8 ;
        /*0040*/                   VIADD R9, R9, 0x1 ;
        /*0050*/              @!P1 BRA `(.L_x_2) ;
        /*0060*/                   ISETP.GE.AND P0, PT, R28, R39, PT ;
        /*0070*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0080*/                   STG.E.U16 desc[UR8][R4.64], R7 ;
        /*0090*/                   EXIT ;
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3);
        /*00b0*/                   NOP;
"""


def test_largest_loop_of_a_sass_listing():
    """The largest span from a label to a branch back to it (an outer loop holding an inner
    one: 6 instructions); forward branches and the trap after EXIT (a branch to itself) are
    no loops."""
    from benchmarks.compile_check import largest_loop

    assert largest_loop(LISTING) == 6
    inner_only = LISTING.replace("@!P0 BRA `(.L_x_1)", "@!P0 BRA `(.L_x_0)")
    assert largest_loop(inner_only) == 3
    straight = "\n".join(line for line in LISTING.splitlines() if "(.L_x_1)" not in line
                          and "(.L_x_2)" not in line)  # fmt: skip
    assert largest_loop(straight) is None


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


@pytest.mark.parametrize("layout", ["halves", "elements"])
def test_compile_check_in_one_kquant_layout(tmp_path, layout):
    """--kquant-layout compiles every k-quant tile in that layout, whatever the installed
    triton's defaults (kquant_gemv.DEFAULT_LAYOUT) pick per format and row path."""
    cmd = ["--quick", "--kernel", "gemv", "--formats", "q5_0", "q4_k", "q5_k", "q6_k"]
    run = compile_check(*cmd, "--kquant-layout", layout, "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "compile_check.json").read_text())["records"]
    tiles = [r for r in rows if r["kernel"] == "_kquant_gemv_kernel"]
    assert {r["example"].split()[2] for r in tiles} == {"q5_0", "q4_k", "q5_k", "q6_k"}
    want = f"HALVES={layout == 'halves'}"
    assert all(want in r["config"].split() for r in tiles), [r["config"] for r in tiles]
