"""Prompt sets for the experiment runner: JSONL files with one example per line.

Each line is an object with a `category` (default "default"), an optional `id`, and the
prompt as one of
    messages  a chat: [{"role": "user" | "assistant" | "system", "content": str}, ...]
    prompt    a user message (str)
    turns     Spec-Bench's question.jsonl format: a list of user messages; only the first
              is used (later turns need the model's own answer to the earlier ones)

`experiments/data/specbench_mini.jsonl` holds prompts written for this project in
Spec-Bench's six categories (MT-bench multi-turn with the first answer included,
translation, summarization, question answering, math reasoning, RAG), 8 per category.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from specdec import validation
from specdec.errors import SpecDecError

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = {
    "specbench_mini": DATA_DIR / "specbench_mini.jsonl",
    "code_edit": DATA_DIR / "code_edit.jsonl",
}
ROLES = ("system", "user", "assistant")

# Spec-Bench's category names -> readable labels (others are shown as they are)
CATEGORY_LABELS = {
    "mt_bench": "multi-turn",
    "translation": "translation",
    "summarization": "summarization",
    "qa": "QA",
    "math_reasoning": "math",
    "rag": "RAG",
}


@dataclass(frozen=True)
class Example:
    id: str
    category: str
    messages: tuple[dict, ...]  # chat messages; the last one is the user's


@dataclass
class Dataset:
    name: str
    examples: list[Example]
    chat: str | bool = "auto"  # auto: the model's chat template where it has one

    def __len__(self) -> int:
        return len(self.examples)

    def uses_chat(self, tokenizer) -> bool:
        if self.chat == "auto":
            return bool(tokenizer.chat_template)
        if self.chat and not tokenizer.chat_template:
            raise SpecDecError(
                "dataset.chat=true but the model has no chat template; use dataset.chat=auto"
            )
        return bool(self.chat)

    def encode(self, tokenizer) -> list[list[int]]:
        """Token ids per example: chat-formatted with the model's template, or the
        messages' contents joined by blank lines."""
        chat = self.uses_chat(tokenizer)
        out = []
        for ex in self.examples:
            if chat:
                text = tokenizer.apply_chat_template(list(ex.messages))
                ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
            else:
                ids = tokenizer.encode("\n\n".join(m["content"] for m in ex.messages))
            if not ids:
                raise SpecDecError(f"example {ex.id!r} encodes to no tokens")
            out.append(ids)
        return out


def resolve_path(path: str | None, name: str) -> Path:
    if path is None:
        if name not in BUILTIN:
            raise SpecDecError(f"dataset {name!r} has no built-in file; set dataset.path")
        return BUILTIN[name]
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecDecError(f"dataset file {str(p)!r} not found")
    return p


def parse_example(obj, where: str, index: int) -> Example:
    if not isinstance(obj, dict):
        raise SpecDecError(f"{where}: expected a JSON object per line")
    category = str(obj.get("category", "default"))
    ex_id = str(obj.get("id", obj.get("question_id", index)))
    if "messages" in obj:
        messages = obj["messages"]
        ok = isinstance(messages, list) and messages
        ok = ok and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise SpecDecError(
                f"{where}: 'messages' must be a non-empty list of "
                '{"role": "system"|"user"|"assistant", "content": str}'
            )
        if messages[-1]["role"] != "user":
            raise SpecDecError(f"{where}: the last message must be the user's")
    elif isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
    elif isinstance(obj.get("turns"), list) and obj["turns"]:
        messages = [{"role": "user", "content": str(obj["turns"][0])}]
    else:
        raise SpecDecError(f"{where}: needs 'messages', 'prompt' or 'turns'")
    for m in messages:
        validation.text(m["content"], f"{where}: the prompt")
    if not any(m["content"].strip() for m in messages):
        raise SpecDecError(f"{where}: empty prompt")
    return Example(ex_id, category, tuple(dict(m) for m in messages))


def read_jsonl(path: Path) -> list[Example]:
    examples = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecDecError(
                    f"{where}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)"
                ) from e
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecDecError(f"{where}: not valid JSON ({e.msg})") from e
            examples.append(parse_example(obj, where, len(examples)))
    if not examples:
        raise SpecDecError(f"{path}: no examples")
    return examples


def interleave(examples: list[Example]) -> list[Example]:
    """Round-robin over categories (in order of first appearance), so that any prefix
    covers every category as evenly as possible."""
    by_cat: dict[str, list[Example]] = {}
    for ex in examples:
        by_cat.setdefault(ex.category, []).append(ex)
    out = []
    for i in range(max(len(v) for v in by_cat.values())):
        out.extend(v[i] for v in by_cat.values() if i < len(v))
    return out


def load_dataset(
    name: str = "specbench_mini",
    path: str | None = None,
    limit: int | None = None,
    categories: list[str] | None = None,
    chat: str | bool = "auto",
) -> Dataset:
    """Examples of a JSONL file, filtered to `categories`, interleaved across categories
    and cut to `limit` (None or 0: all)."""
    if chat not in ("auto", True, False):
        raise SpecDecError(f"dataset.chat must be auto, true or false, got {chat!r}")
    examples = read_jsonl(resolve_path(path, name))
    if categories:
        known = {ex.category for ex in examples}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise SpecDecError(
                f"unknown categories {unknown} in dataset {name!r} (has: {', '.join(sorted(known))})"
            )
        examples = [ex for ex in examples if ex.category in set(categories)]
    examples = interleave(examples)
    if limit is not None:
        limit = validation.integer(limit, "dataset.limit", minimum=0)
    if limit:
        examples = examples[:limit]
    return Dataset(name, examples, chat)
