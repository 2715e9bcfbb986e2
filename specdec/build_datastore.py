"""Build a retrieval datastore (specdec.decode.datastore) for a target's tokenizer.

    python -m specdec.build_datastore --model qwen2.5-coder-0.5b --out DIR
        [--corpus code|doc|all] [--max-tokens N] [--files PATH ...] [--seed S]

Without --files the corpus is the running Python's source (`code`: .py files of the
standard library and site-packages), documentation (`doc`) or both, the files
`specdec.train_head` reads with the same exclusions, in a seeded random order until
--max-tokens. --files takes text files or folders of your own instead (every file under a
folder, sorted). Every 8-token window of an evaluation prompt (specbench_mini, code_edit,
HumanEval's prompts and canonical solutions) is masked either way. Only the tokenizer is
loaded, never the weights. Use the result with `--draft datastore:DIR` or
`draft=datastore draft.path=DIR`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specdec import validation
from specdec.cli import user_errors
from specdec.decode.datastore import CORPORA, WINDOW, Datastore, build_store, check_corpus
from specdec.errors import SpecDecError

log = logging.getLogger("specdec.build_datastore")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specdec.build_datastore", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="target: registered name, .gguf or HF dir")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument(
        "--corpus", default="code", help=f"one of {', '.join(CORPORA)} (without --files)"
    )
    p.add_argument("--files", nargs="+", default=None, help="text files or folders to use instead")
    p.add_argument("--max-tokens", type=int, default=16_000_000, help="store size in tokens")
    p.add_argument("--seed", type=int, default=0, help="order of the corpus files")
    return p


def own_texts(paths: list[str]):
    """(path, text) of the given files and of every file under the given folders."""
    for given in paths:
        p = Path(given).expanduser()
        if not p.exists():
            raise SpecDecError(f"--files: {p} does not exist")
        for f in sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]:
            try:
                yield str(f), f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError) as e:
                log.warning("skipping %s (%s)", f, type(e).__name__)


def run(args) -> Datastore:
    from specdec.models.load import load_tokenizer

    validation.integer(args.max_tokens, "--max-tokens", minimum=WINDOW)
    validation.seed(args.seed)
    check_corpus(args.corpus)
    tok = load_tokenizer(args.model)
    store = build_store(
        tok,
        args.corpus,
        args.max_tokens,
        args.seed,
        texts=own_texts(args.files) if args.files else None,
        meta={"files": args.files, "model": args.model},
    )
    if store.meta["tokens"] == 0:
        raise SpecDecError("no text found for the datastore")
    store.save(args.out)
    return store


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    store = run(args)
    m = store.meta
    print(
        f"datastore {args.out}: {m['tokens']:,} tokens from {m['documents']} documents, "
        f"{m['masked_windows']} held-out windows masked, {m['build_s']:.0f} s"
    )


if __name__ == "__main__":
    user_errors(main)()
