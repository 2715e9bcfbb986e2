"""benchmarks.bench_e2e: the CPU smoke run goes through every section and writes results
that the README table is built from."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from benchmarks.bench_e2e import main
from benchmarks.report import README_BEGIN, README_END, update_readme


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark")
def test_quick_run_writes_results_and_readme(tmp_path):
    assert main(["--quick", "--new-tokens", "6", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("2*.json")  # the combined <date>-<device>.json
    data = json.loads(path.read_text())
    assert data["e2e_decode_tokens_per_second"] > 0
    e2e = data["e2e"]
    assert [m["model"] for m in e2e["models"]] == ["tiny-8b-like", "tiny-smol-like"]
    for m in e2e["models"]:
        assert "error" not in m
        assert m["plain"][0]["bytes_per_token"] > m["plain"][0]["weight_bytes"] > 0
        assert m["steps"]["verify"] and m["steps"]["draft_step_ms"]
        assert m["speculative"] and all(s["identical_to_plain"] for s in m["speculative"])
    assert {s["drafter"] for s in e2e["models"][0]["speculative"]} == {"layerskip", "early_exit"}
    # the A/B of the draft chain graph: each drafter at k = 4 with the chain off too
    ab = [(s["drafter"], s["k"]) for s in e2e["models"][0]["speculative"] if not s["chain_graphs"]]
    assert sorted(ab) == [("early_exit", 4), ("layerskip", 4)]
    assert all(h["decode_tokens_per_second"] > 0 for h in e2e["hf"])

    with open(tmp_path / "bench_e2e.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["section"] for r in rows] == ["plain"] + ["speculative"] * 4 + [
        "plain", "speculative", "hf", "hf"]  # fmt: skip
    assert json.loads((tmp_path / "bench_e2e.json").read_text())["environment"]["commit"]

    readme = tmp_path / "README.md"
    readme.write_text("# specdec\n\nIntro.\n\n## Results\n\nKernels.\n\n## Tests\n")
    update_readme(readme, data)
    update_readme(readme, data)  # replaces its own section
    text = readme.read_text()
    assert text.startswith("# specdec\n\nIntro.\n\n## Results\n\n" + README_BEGIN)
    assert text.count(README_BEGIN) == text.count(README_END) == 1
    assert text.index(README_END) < text.index("Kernels.") < text.index("## Tests")
    assert "tiny-8b-like" in text and data["date"] in text
    # where each round's time went: a row per speculative run (CUDA graphs on: on CPU the
    # static path runs them uncaptured), from the recorded rounds
    assert all(s["rounds"] >= 1 for m in e2e["models"] for s in m["speculative"])
    phase_rows = [line for line in text.splitlines() if "k=" in line and line.count("|") == 9]
    assert len(phase_rows) == sum(len(m["speculative"]) for m in e2e["models"])
    assert "| ms / round |" in text and "~" not in "".join(phase_rows)


def test_readme_from_a_bad_file_is_a_user_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(["--readme", str(bad)])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: cannot read results file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark")
def test_batch_invariance_ab(tmp_path):
    """With the mode on (the default for bf16 on the Triton backend; forced here, on the CPU
    smoke run's fp32 models) the 8B-shape model also runs plain and early exit k = 4 with it
    off and with its GEMV on the broadcast path, each speedup over plain decoding in its
    own mode, and the report labels the rows."""
    from benchmarks.report import e2e_tables
    from specdec.models import batch_invariant

    batch_invariant.set_setting("on")
    assert main(["--quick", "--new-tokens", "6", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("2*.json")
    m = json.loads(path.read_text())["e2e"]["models"][0]
    modes = [(p["batch_invariant"], p["invariant_gemv"]) for p in m["plain"]]
    assert modes == [(True, "dot"), (False, None), (True, "broadcast")]
    assert all(p["identical_to_plain"] for p in m["plain"][1:])  # tiny fp32 model
    for plain in m["plain"][1:]:
        (spec,) = [
            s
            for s in m["speculative"]
            if (s["batch_invariant"], s["invariant_gemv"])
            == (plain["batch_invariant"], plain["invariant_gemv"])
        ]
        assert (spec["drafter"], spec["k"]) == ("early_exit", 4) and spec["identical_to_plain"]
        rate = plain["decode_tokens_per_second"]
        assert spec["speedup"] == pytest.approx(spec["decode_tokens_per_second"] / rate)
    table = e2e_tables({"models": [m], "hf": []})
    # plain, speculative, its round phases
    assert table.count("invariance off") == table.count("invariance broadcast") == 3
    assert "SPECDEC_INVARIANT_GEMV" not in os.environ  # restored
