"""experiments.bench_e2e: the CPU smoke run goes through every section and writes results
that the README table is built from."""

from __future__ import annotations

import json

from experiments.bench_e2e import README_BEGIN, README_END, main, update_readme


def test_quick_run_writes_results_and_readme(tmp_path):
    assert main(["--quick", "--new-tokens", "6", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
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
    assert all(h["decode_tokens_per_second"] > 0 for h in e2e["hf"])

    readme = tmp_path / "README.md"
    readme.write_text("# specdec\n\nIntro.\n\n## Results\n\nKernels.\n\n## Tests\n")
    update_readme(readme, data)
    update_readme(readme, data)  # replaces its own section
    text = readme.read_text()
    assert text.startswith("# specdec\n\nIntro.\n\n## Results\n\n" + README_BEGIN)
    assert text.count(README_BEGIN) == text.count(README_END) == 1
    assert text.index(README_END) < text.index("Kernels.") < text.index("## Tests")
    assert "tiny-8b-like" in text and data["date"] in text
