"""Fixtures for the experiment runner tests: tiny target / draft models sharing a tokenizer,
a tiny prompt file, and Hydra's compose API over configs/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.helpers import make_hf_model

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    {"id": "a", "category": "summarization", "prompt": "The quick brown fox jumps."},
    {"id": "b", "category": "qa", "prompt": "1 + 2 = 3, 10 * 7 = 70"},
    {"id": "c", "category": "summarization", "prompt": "def add(a, b): return a + b"},
    {"id": "d", "category": "qa", "prompt": "Speculative decoding drafts tokens."},
]


def drafter_overrides(name: str, model, tok, draft_dir, directory: Path) -> list[str]:
    """What draft=<name> needs on the tiny target (files under `directory`): the draft
    model, an untrained head of its shape (the shipped one is SmolLM2's), a store in its
    tokenizer (the shipped reply stores are SmolLM2's and Qwen's)."""
    import torch

    from specdec.decode.datastore import Datastore, tokenizer_fingerprint
    from specdec.decode.heads.head import DraftHead, HeadConfig, save_head

    if name in ("model", "smollm2_135m", "cross_tokenizer"):
        return [f"draft.model={draft_dir}"]
    if name in ("head", "ngram_head"):
        torch.manual_seed(0)
        save_head(DraftHead(HeadConfig.for_target(model), model.config), directory / "head")
        return [f"draft.path={directory / 'head'}"]
    if name in ("datastore", "replies"):
        store = Datastore.build(
            tok, [("t", "The quick brown fox jumps. 1 + 2 = 3, 10 * 7 = 70 " * 9)], 1000,
            meta={"tokenizer": tokenizer_fingerprint(tok)},
        )  # fmt: skip
        store.save(directory / "ds")
        return [f"draft.path={directory / 'ds'}"]
    return []


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(target dir, draft dir): random 2- and 1-layer Llamas with the same tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    target = make_hf_model(root / "target", "llama", False, layers=2, seed=0)
    draft = make_hf_model(root / "draft", "llama", False, layers=1, seed=1)
    assert (target / "tokenizer.json").read_text() == (draft / "tokenizer.json").read_text()
    return target, draft


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_models, tmp_path_factory):
    """The tiny target with a ChatML template in its tokenizer_config.json."""
    import shutil

    d = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_models[0], d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": CHATML}))
    return d


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def tiny_overrides(tiny_models, prompt_file):
    """Overrides that shrink the default config to the tiny models and prompt file."""
    target, _ = tiny_models
    return [
        "draft=ngram",  # the default drafter's reply store is SmolLM2's (a test may override)
        "target=local",
        f"target.model={target}",
        "dataset=file",
        f"dataset.path={prompt_file}",
        "gen.max_new_tokens=6",
        "gen.warmup=false",
        "dtype=float32",  # the default `auto` depends on the CPU: tests stay machine-independent
    ]


@pytest.fixture
def compose_cfg():
    """compose_cfg(overrides, hydra=False) -> the composed config (Hydra's compose API)."""

    def make(overrides=(), hydra: bool = False):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose("config", overrides=list(overrides), return_hydra_config=hydra)

    return make


@pytest.fixture
def run_cli():
    """run_cli(*args) -> CompletedProcess of `python -m experiments.run args` in the repo."""

    def run(*args, module: str = "experiments.run", timeout: int = 300):
        env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
        return subprocess.run(
            [sys.executable, "-m", module, *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    return run
