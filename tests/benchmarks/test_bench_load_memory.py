"""benchmarks.bench_load_memory: one process per system, the ratios against HF transformers."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench_load_memory as blm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_quick_run_measures_each_system_in_its_own_process(smollm2_path, tmp_path, capsys):
    blm.main(["--models", str(smollm2_path), "--modes", "bfloat16:dense", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    recs = json.loads((tmp_path / "bench_load_memory.json").read_text())["records"]
    assert [r["system"] for r in recs] == ["specdec bfloat16:dense", "hf bfloat16"]
    ours, hf = recs
    for r in recs:  # the ready model holds at least its bf16 weights (SmolLM2: 135M x 2 bytes)
        assert r["peak_mib"] >= r["load_peak_mib"] > 0
        assert r["peak_mib"] >= r["anon_mib"] > 250
    assert ours["peak_vs_hf"] == pytest.approx(ours["peak_mib"] / hf["peak_mib"])
    assert "| specdec bfloat16:dense |" in out


def test_a_failed_child_is_one_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        blm.main(["--models", str(tmp_path / "missing.gguf"), "--no-hf"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err
