"""benchmarks.bench_cpu_compile without a C++ compiler or with an out-of-range option: one
error line, exit 2, nothing written (the measurement itself compiles for minutes and is not run in the suite)."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from benchmarks import bench_cpu_compile
from tests.helpers import one_error_line


def test_missing_compiler_is_one_error_line(tmp_path, capsys):
    with inductor_config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}):
        line = one_error_line(capsys, bench_cpu_compile.main, ["--out", str(tmp_path / "out")])
    assert "C++ compiler" in line and "no-such-g++" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, name",
    [(["--m", "1", "0"], "--m"), (["--t", "-1"], "--t"), (["--rounds", "0"], "--rounds"),
     (["--threads", "0"], "--threads"), (["--context", "0"], "--context")],
)  # fmt: skip
def test_out_of_range_options_are_one_error_line(tmp_path, capsys, argv, name):
    line = one_error_line(capsys, bench_cpu_compile.main, [*argv, "--out", str(tmp_path / "o")])
    assert name in line
    assert not (tmp_path / "o").exists()


def test_a_compiler_is_found_here():
    assert bench_cpu_compile.compiler_missing() is None  # the suite's machines have g++
