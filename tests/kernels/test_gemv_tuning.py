"""Tuned GEMV tables (specdec/kernels/gemv_tuning.py): validation, lookup through
`gemv_config` for a named device, precedence, and tuned configurations computing the same
product as the float64 reference in the interpreter."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.errors import SpecDecError  # noqa: E402
from specdec.kernels import (
    gemv_tuning,  # noqa: E402
    utils,  # noqa: E402
)
from specdec.kernels import quant_gemv as qg  # noqa: E402
from tests.kernels.test_quant_gemv import (  # noqa: E402
    assert_matches,
    inputs,
    make_weight,
    reference64,
    run_gemv,
)

DEVICE_NAME = "Example GPU 9000"
FAKE = utils.Target(num_sms=132, interpreter=False, device=DEVICE_NAME)


def entry(fmt="4b-g32-min", n=45, k=320, path="m1", **kw):
    e = dict(format=fmt, n=n, k=k, path=path, block_n=16, block_k=64, split_k=3)
    e.update(num_warps=2, num_stages=1, ms=0.01, heuristic_ms=0.02, gbps=100.0)
    e.update(kw)
    return e


def write_table(tmp_path, entries, monkeypatch=None, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"version": 1, "device": DEVICE_NAME, "entries": entries}))
    if monkeypatch is not None:
        monkeypatch.setenv(gemv_tuning.ENV, str(path))
    gemv_tuning.clear_cache()
    return path


@pytest.fixture(autouse=True)
def _fresh_cache():
    gemv_tuning.clear_cache()
    yield
    gemv_tuning.clear_cache()


def test_format_key_and_slug():
    assert gemv_tuning.format_key(4, 128, True) == "4b-g128-min"
    assert gemv_tuning.format_key(8, 32, False) == "8b-g32"
    assert gemv_tuning.device_slug("NVIDIA H200") == "nvidia-h200"
    assert gemv_tuning.device_slug(" NVIDIA GeForce RTX 4090 ") == "nvidia-geforce-rtx-4090"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"block_n": 24}, "block_n=24 must be a power of two"),
        ({"num_warps": 0}, "num_warps=0 must be a power of two"),
        ({"split_k": 0}, "split_k=0 must be an integer in 1..64"),
        ({"num_stages": "3"}, "num_stages='3' must be an integer"),
        ({"block_k": 16}, "below the format's tile minimum"),
        ({"format": "4b-g128-min", "block_k": 64}, "below the format's tile minimum"),
        ({"format": "q4_1"}, "format 'q4_1' is not like"),
        ({"path": "m2"}, "path 'm2' is not one of"),
        ({"n": -5}, "n and k must be positive integers"),
        ({"n": True}, "n and k must be positive integers"),
        ({"speed": 3}, "unknown fields ['speed']"),
    ],
)
def test_bad_entries_are_refused(change, message):
    e = entry(**change)
    with pytest.raises(SpecDecError, match="GEMV tuning table t.json") as err:
        gemv_tuning.parse_table({"version": 1, "entries": [e]}, "t.json")
    assert message in str(err.value)


def test_bad_tables_are_refused(tmp_path, monkeypatch):
    with pytest.raises(SpecDecError, match="version-1"):
        gemv_tuning.parse_table({"entries": []}, "t")
    with pytest.raises(SpecDecError, match="missing \\['block_n'\\]"):
        e = entry()
        del e["block_n"]
        gemv_tuning.parse_table({"version": 1, "entries": [e]}, "t")
    with pytest.raises(SpecDecError, match="repeats"):
        gemv_tuning.parse_table({"version": 1, "entries": [entry(), entry()]}, "t")
    w = make_weight("q4_1", 45, 320)
    # a broken file named by the variable is an error at the first launch, not ignored
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(gemv_tuning.ENV, str(bad))
    with pytest.raises(SpecDecError, match="cannot read it"):
        qg.gemv_config(1, w, torch.float32, FAKE)
    monkeypatch.setenv(gemv_tuning.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(SpecDecError, match="no such file"):
        qg.gemv_config(1, w, torch.float32, FAKE)


def test_lookup_precedence(tmp_path, monkeypatch):
    w = make_weight("q4_1", 45, 320)  # 4-bit, group 32, mins
    heuristic = qg.gemv_config(1, w, torch.float32, FAKE)
    write_table(tmp_path, [entry(), entry(path="dot", block_n=64, split_k=2)], monkeypatch)
    cfg = qg.gemv_config(1, w, torch.float32, FAKE)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages) == (
        16,
        64,
        3,
        2,
        1,
    )
    assert cfg.k_per_split % cfg.block_k == 0 and cfg.grid == (3, 3)
    dot = qg.gemv_config(5, w, torch.float16, FAKE)
    assert dot.use_dot and (dot.block_n, dot.split_k) == (64, 2)
    # fp32 rows > 1 take the broadcast path and its one-row entry (planned as one row)
    assert qg.gemv_config(5, w, torch.float32, FAKE) == replace(cfg, block_m=8)
    # keyword arguments win over the table
    assert qg.gemv_config(1, w, torch.float32, FAKE, block_n=32).block_n == 32
    # other shapes, formats, devices and the interpreter keep the heuristic
    other = make_weight("q4_0", 45, 320)  # no mins: another format key
    assert qg.gemv_config(1, other, torch.float32, FAKE) == qg.gemv_config(
        1, other, torch.float32, utils.Target(132, False)
    )
    assert qg.gemv_config(1, w, torch.float32, utils.Target(4, True, DEVICE_NAME)) != cfg
    monkeypatch.setenv(gemv_tuning.ENV, "off")
    assert qg.gemv_config(1, w, torch.float32, FAKE) == heuristic


def test_shipped_table_is_found_by_device_name(tmp_path, monkeypatch):
    monkeypatch.delenv(gemv_tuning.ENV, raising=False)
    monkeypatch.setattr(gemv_tuning, "CONFIG_DIR", tmp_path)
    write_table(tmp_path, [entry()], name="gemv-example-gpu-9000.json")
    w = make_weight("q4_1", 45, 320)
    assert qg.gemv_config(1, w, torch.float32, FAKE).block_n == 16
    other = utils.Target(132, False, "Other GPU")  # no table of its own: the heuristic
    assert qg.gemv_config(1, w, torch.float32, other) == qg.gemv_config(
        1, w, torch.float32, utils.Target(132, False)
    )
    # recording for a named device (compile_check) applies its table too
    with utils.recording(132, DEVICE_NAME):
        assert utils.target_of(torch.device("cpu")) == FAKE


@pytest.mark.parametrize(
    "fmt,key,m,dtype",
    [
        ("q4_1", "4b-g32-min", 1, torch.float32),
        ("q4_1", "4b-g32-min", 1, torch.bfloat16),
        ("q8_0", "8b-g32", 1, torch.float32),
        ("int4-g64", "4b-g64-min", 1, torch.float32),
        ("q4_1", "4b-g32-min", 5, torch.float16),  # tl.dot
        ("q8_0", "8b-g32", 16, torch.float16),
    ],
)
def test_tuned_configs_compute_the_product(tmp_path, monkeypatch, fmt, key, m, dtype):
    """Tiles, split-K and pipeline settings as a table may give them, in the interpreter
    against float64: uneven split-K, partial N tiles, a K tile of 2 groups."""
    n, k = 45, 320
    w = make_weight(fmt, n, k, seed=21)
    path = "dot" if m > 1 else "m1"
    for bn, bk, split in [(16, 128, 2), (32, 64, 3), (64, 64, 5)]:
        if key == "4b-g64-min" and bk < 64:
            continue
        tuned = entry(key, n, k, path, block_n=bn, block_k=bk, split_k=split)
        write_table(tmp_path, [tuned], monkeypatch)
        cfg = qg.gemv_config(m, w, dtype, FAKE)
        assert (cfg.block_n, cfg.block_k) == (bn, bk)
        assert cfg.split_k == utils.cdiv(
            utils.cdiv(w.k_padded, bk), utils.cdiv(utils.cdiv(w.k_padded, bk), split)
        )
        x, bias = inputs(m, k, n, dtype, True, seed=22)
        assert_matches(run_gemv(x, w, bias, cfg), reference64(x, w, bias), dtype)


def test_table_written_by_the_tuner_loads(tmp_path):
    """`benchmarks.tune_gemv --quick` writes a table `gemv_config` can read."""
    from benchmarks import tune_gemv

    out = tmp_path / "gemv.json"
    assert tune_gemv.main(["--quick", "--table", str(out), "--no-ab"]) == 0
    data = json.loads(out.read_text())
    gemv_tuning.parse_table(data, str(out))
    runs = json.loads((tmp_path / "gemv-runs.json").read_text())
    assert {r["path"] for r in runs["results"]} == {"m1", "dot"}
    assert all(r["output_matches"] for r in runs["results"])
    # kept entries are exactly the faster-by-3% ones
    assert len(data["entries"]) == sum(r["kept"] for r in runs["results"])
    # the whole-model A/B runs against it (a tiny model on CPU) and restores the setting
    rows = tune_gemv.ab(out, repeats=1)
    assert [r["step"] for r in rows][:2] == ["decode T=1", "verify T=5"]
    assert all(r["heuristic_ms"] > 0 and r["tuned_ms"] > 0 for r in rows)
    assert gemv_tuning.ENV not in os.environ


def test_shipped_tables_are_valid():
    for path in sorted(gemv_tuning.CONFIG_DIR.glob("gemv-*.json")):
        table = gemv_tuning.parse_table(json.loads(path.read_text()), str(path))
        assert table, f"{path} has no entries"
        data = json.loads(path.read_text())
        assert gemv_tuning.device_slug(data["device"]) in path.name
        bad = copy.deepcopy(data)
        bad["entries"][0]["block_n"] = 3
        with pytest.raises(SpecDecError):
            gemv_tuning.parse_table(bad, str(path))


def test_fp32_rows_take_the_one_row_entry(tmp_path, monkeypatch):
    """fp32 rows of any M run the broadcast path and take its "m1" entry, so that a
    verification row computes the bits of a decode step (before, M > 1 broadcast rows
    looked up no entry and kept the heuristic while M = 1 took the tuned tiles: greedy
    speculative decoding in fp32 could leave plain greedy on a tuned GPU). Bit equality of
    each row with a one-row call, in the interpreter with the GPU's plan."""
    n, k = 45, 320
    w = make_weight("q4_1", n, k, seed=int(torch.randint(0, 2**31, ())))
    write_table(tmp_path, [entry(block_n=16, block_k=64, split_k=3)], monkeypatch)
    one = qg.gemv_config(1, w, torch.float32, FAKE)
    assert (one.block_n, one.block_k, one.num_warps, one.num_stages) == (16, 64, 2, 1)
    for m in (2, 5, 16):
        cfg = qg.gemv_config(m, w, torch.float32, FAKE)
        assert not cfg.use_dot
        assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.k_per_split, cfg.num_warps) == (
            one.block_n,
            one.block_k,
            one.split_k,
            one.k_per_split,
            one.num_warps,
        ), m
    # 16-bit rows of M > 1 take the tensor-core path: its own entries only
    assert qg.gemv_config(5, w, torch.float16, FAKE).use_dot
    x, bias = inputs(5, k, n, torch.float32, True, seed=int(torch.randint(0, 2**31, ())))
    out = run_gemv(x, w, bias, qg.gemv_config(5, w, torch.float32, FAKE))
    assert_matches(out, reference64(x, w, bias), torch.float32)
    for r in range(5):
        assert torch.equal(out[r : r + 1], run_gemv(x[r : r + 1], w, bias, one)), r


def test_tuner_merges_into_an_existing_table(tmp_path, capsys):
    """`--merge OLD` keeps OLD's entries for the shapes and paths the run did not tune and
    takes the run's own where both have one; a table for another device is refused. The
    A/B runs on another shape and format too."""
    from benchmarks import tune_gemv
    from benchmarks.harness import environment

    device = environment(torch.device("cpu"))["device"]
    other = entry("4b-g32-min", n=64, k=512, path="m1")  # a shape --quick does not tune
    same = entry("4b-g32-min", n=48, k=256, path="m1")  # --quick's q4_1 one-row case
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 1, "device": device, "entries": [other, same]}))
    out = tmp_path / "merged.json"
    args = ["--quick", "--formats", "q4_1", "--table", str(out), "--merge", str(old), "--no-ab"]
    assert tune_gemv.main(args) == 0
    merged = json.loads(out.read_text())
    gemv_tuning.parse_table(merged, str(out))
    keys = [(e["format"], e["n"], e["k"], e["path"]) for e in merged["entries"]]
    assert len(keys) == len(set(keys))
    assert ("4b-g32-min", 64, 512, "m1") in keys  # kept from the old table
    runs = json.loads((tmp_path / "merged-runs.json").read_text())["results"]
    m1 = next(r for r in runs if r["path"] == "m1")
    assert (m1["n"], m1["k"]) == (48, 256)
    # the old entry for the tuned key stays only where the run kept nothing for it
    assert len(keys) == 1 + sum(r["kept"] for r in runs) + (0 if m1["kept"] else 1)
    # a table to merge that is for another device, not a table, or missing: one error line
    # and exit 2 before any tuning, the output table left as it was
    before = out.read_text()
    capsys.readouterr()
    for content, message in [
        (json.dumps({"version": 1, "device": "Another GPU", "entries": [other]}), "Another GPU"),
        ("{not json", "cannot read the table to merge"),
        (json.dumps({"version": 1, "device": device, "entries": [{"format": "x"}]}), "old.json"),
        (None, "cannot read the table to merge"),
    ]:
        if content is None:
            old.unlink()
        else:
            old.write_text(content)
        assert tune_gemv.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert out.read_text() == before
    rows = tune_gemv.ab(out, repeats=1, shape_name="smollm2-135m", fmt="q4_1")
    assert [r["step"] for r in rows][:1] == ["decode T=1"] and all(r["tuned_ms"] > 0 for r in rows)
