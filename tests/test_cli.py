"""`python -m specdec.generate` end to end: JSON output, streaming text, and one clear
error line with a non-zero exit for every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-m", "specdec.generate", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


@pytest.fixture(scope="module")
def gguf_model(tiny_gguf):
    return str(tiny_gguf("llama", "Q8_0"))


def test_json_output_plain(gguf_model):
    proc = run_cli(
        "--model", gguf_model, "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("prompt_ids", "tokens", "text", "tokens_per_second"):
        assert key in obj
    assert len(obj["tokens"]) == 12 or obj["finish_reason"] == "stop"
    assert obj["tokens_per_second"] > 0


def test_json_output_speculative_matches_plain(gguf_model):
    base = ["--model", gguf_model, "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--json"]
    plain = json.loads(run_cli(*base).stdout.strip().splitlines()[-1])
    proc = run_cli(*base, "--draft", "ngram", "--k", "3")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"]
    for key in ("acceptance_rate", "mean_accepted_tokens", "per_position_acceptance"):
        assert key in spec["stats"]
    assert spec["tokens_per_second"] > 0
    # the graph-capturable static forward (without capture on CPU) gives the same tokens
    static = run_cli(*base, "--draft", "early-exit", "--exit-layer", "1", "--cuda-graphs", "on")
    assert static.returncode == 0, static.stderr
    assert json.loads(static.stdout.strip().splitlines()[-1])["tokens"] == plain["tokens"]


def test_streams_text_and_prints_summary(gguf_model):
    proc = run_cli(
        "--model",
        gguf_model,
        "--prompt",
        "The quick",
        "--max-new-tokens",
        "8",
        "--draft",
        "early-exit",
        "--exit-layer",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr and "acceptance" in proc.stderr


def test_chat_and_batch(gguf_model):
    proc = run_cli(
        "--model",
        gguf_model,
        "--prompt",
        "hi",
        "--prompt",
        "a longer second prompt",
        "--max-new-tokens",
        "5",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(obj["tokens"]) == 2 and all(len(t) == 5 for t in obj["tokens"])


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--model", "no-such-model"], ["unknown model"]),
        (["--model", "/nonexistent/model.gguf"], ["not found"]),
        (["--dtype", "float64"], ["invalid dtype"]),
        (["--device", "tpu"], ["device"]),
        (["--prompt", ""], ["empty prompt"]),
        (["--max-new-tokens", "100000"], ["context length"]),
        (["--max-new-tokens", "0"], ["max_new_tokens"]),
        (["--draft", "ngram", "--k", "0"], ["k must be >= 1"]),
        (["--draft", "ngram", "--accept", "threshold", "--threshold", "1.5"], ["threshold"]),
        (["--draft", "ngram", "--ngram-min", "3", "--ngram-max", "1"], ["n-gram"]),
        (["--draft", "layerskip", "--skip", "0,1"], ["skips every layer"]),
        (["--draft", "early-exit", "--exit-layer", "9"], ["exit layer"]),
        (["--draft", "ngram", "--accept", "nope"], ["unknown acceptance rule"]),
        (["--draft", "ngram", "--schedule", "nope"], ["unknown schedule"]),
        (["--temperature", "-1"], ["temperature"]),
    ],
)
def test_bad_options_give_one_clear_error(gguf_model, args, needles):
    base = ["--model", gguf_model, "--prompt", "hello", "--max-new-tokens", "4"]
    assert_user_error(run_cli(*base, *args), *needles)


def test_cuda_requested_without_cuda(gguf_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert_user_error(run_cli("--model", gguf_model, "--prompt", "x", "--device", "cuda"), "CUDA")


def test_triton_backend_on_cpu_without_interpreter_is_an_error(gguf_model):
    proc = run_cli(
        "--model", gguf_model, "--prompt", "x", "--backend", "triton", "--max-new-tokens", "2"
    )
    assert_user_error(proc, "TRITON_INTERPRET")


def test_bad_files(tmp_path, tiny_dir, tiny_gguf):
    from tests.helpers import write_gguf

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(os.urandom(4096))
    assert_user_error(run_cli("--model", str(corrupt), "--prompt", "x"), "GGUF")
    good = Path(tiny_gguf("llama", "Q8_0")).read_bytes()
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(good[: len(good) // 2])
    assert_user_error(run_cli("--model", str(trunc), "--prompt", "x"), "truncated.gguf")
    mxfp4 = write_gguf(tiny_dir("llama", False), tmp_path / "mxfp4.gguf", "MXFP4")
    assert_user_error(run_cli("--model", str(mxfp4), "--prompt", "x"), "unsupported type MXFP4")
    arch = write_gguf(tiny_dir("llama", False), tmp_path / "gpt2.gguf", "Q8_0", arch="gpt2")
    assert_user_error(run_cli("--model", str(arch), "--prompt", "x"), "unsupported architecture")
    # a draft model of another vocabulary is drafted across tokenizers (test_cross_tokenizer);
    # a corrupt draft model file is one error line
    assert_user_error(
        run_cli(
            "--model", str(tiny_gguf("llama", "Q8_0")), "--prompt", "x", "--draft", str(corrupt)
        ),
        "GGUF",
    )
    notdir = tmp_path / "empty_dir"
    notdir.mkdir()
    assert_user_error(run_cli("--model", str(notdir), "--prompt", "x"), "config.json")
