"""Build a retrieval datastore (specdec.decode.datastore) for a target's tokenizer.

    python -m specdec.build_datastore --model qwen2.5-coder-0.5b --out DIR
        [--corpus code|doc|all] [--max-tokens N] [--files PATH ...] [--seed S]
    python -m specdec.build_datastore --model smollm2-135m --corpus replies --out DIR
        [--requests chat|code] [--minutes M] [--replies N] [--dtype auto] [--threads T]
        [--batch B] [--seed S]

Without --files the corpus is the running Python's source (`code`: .py files of the
standard library and site-packages), documentation (`doc`) or both, the files
`specdec.train_head` reads with the same exclusions, in a seeded random order until
--max-tokens. --files takes text files or folders of your own instead (every file under a
folder, sorted). Every 8-token window of an evaluation prompt (specbench_mini, code_edit,
HumanEval's prompts and canonical solutions) is masked either way. Only the tokenizer is
loaded, never the weights. Use the result with `--draft datastore:DIR` or
`draft=datastore draft.path=DIR`.

`--corpus replies` loads the target and stores its own greedy replies (up to 255 tokens
each, cut at its end of turn) to chat requests built as for the draft head's training data
(`specdec.train_head`: a package file's snippet with an instruction, or an open-ended
request written for specdec), batched, until --minutes or --replies; requests and replies
pass the same held-out check. `--requests code` asks a code model in HumanEval's style
instead: the prompt is a documented Python function's signature and docstring from the
installed packages' sources (parsed with `ast`, never imported; at most 96 tokens), encoded
as plain text without a chat template, and the reply is the target's greedy completion (up
to 192 tokens with its prompt, cut at a stop token). The header records the model, its
fingerprint, the request style, the dtype, the machine and the time taken.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
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
    p.add_argument("--seed", type=int, default=0, help="order of the corpus files / requests")
    g = p.add_argument_group("--corpus replies (the target's own replies)")
    g.add_argument("--minutes", type=float, default=20.0, help="generation budget")
    g.add_argument("--replies", type=int, default=4000, help="at most this many requests")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--batch", type=int, default=32, help="replies generated together")
    g.add_argument(
        "--requests",
        default="chat",
        choices=REQUESTS,
        help="chat: chat requests (instruction models); code: function signatures and "
        "docstrings completed as plain text (code models, HumanEval's style)",
    )
    return p


REQUESTS = ("chat", "code")
CODE_SEQ = 192  # code requests: prompt (signature + docstring) <= 96 tokens, then the reply
MAX_SOURCE_BYTES = 400_000  # larger source files are skipped by code_requests


def function_prefixes(text: str, per_file: int = 3) -> list[str]:
    """Up to `per_file` HumanEval-style prefixes of a Python source: a documented function's
    `def` line(s) and docstring, dedented to the top level (methods included), newline-ended.
    The source is parsed with `ast` (never imported or run); text that does not parse gives
    none. Functions whose body is only the docstring, and tests, are left out."""
    import ast
    import textwrap

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40 or len(node.body) < 2 or node.name.startswith("test"):
            continue
        first = node.body[0]
        if first.end_lineno is None or first.end_col_offset is None:
            continue
        head = lines[node.lineno - 1 : first.end_lineno]
        if not head or len(head[-1]) != first.end_col_offset:  # code after the docstring
            continue
        out.append(textwrap.dedent("\n".join(head)) + "\n")
        if len(out) == per_file:
            break
    return out


def code_requests(tokenizer, n: int, seed: int, max_tokens: int, windows: set) -> list:
    """n completion requests (prefix, source) from the Python files specdec.train_head reads
    (its exclusions: no HumanEval, no specdec), in a seeded random order; prefixes longer than
    max_tokens or holding an evaluation window are left out."""
    import random

    from specdec.train_head import corpus_files, distribution_of, has_window

    rng = random.Random(seed)
    files = corpus_files()["code"]
    rng.shuffle(files)
    out = []
    for f in files:
        if len(out) >= n:
            break
        try:
            if f.stat().st_size > MAX_SOURCE_BYTES:
                continue
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for prefix in function_prefixes(text):
            ids = tokenizer.encode(prefix)
            if len(ids) <= max_tokens and not has_window(ids, windows):
                out.append((prefix, distribution_of(f)))
    return out[:n]


def reply_docs(chunks, header: list[int], stop_ids) -> list[list[int]]:
    """The reply of each chat row (prompt + reply token ids): the tokens after the first
    assistant header, up to the first stop token; rows without a header or with a reply
    shorter than 2 tokens are left out."""
    n, out = len(header), []
    for row in chunks:
        row = [int(t) for t in row]
        at = next((i for i in range(len(row) - n + 1) if row[i : i + n] == header), None)
        if at is None:
            continue
        rep = row[at + n :]
        end = next((j for j, t in enumerate(rep) if t in stop_ids), len(rep))
        if end >= 2:
            out.append(rep[:end])
    return out


def build_replies(args) -> Datastore:
    """A store of the target's own greedy replies (see the module's docstring)."""
    import torch

    from specdec.decode.datastore import tokenizer_fingerprint
    from specdec.decode.heads.head import fingerprint
    from specdec.models.load import load_model
    from specdec.train_head import assistant_header, build_corpus, heldout_windows

    validation.integer(args.replies, "--replies", minimum=2)
    validation.integer(args.batch, "--batch", minimum=1)
    if not args.minutes > 0:
        raise SpecDecError(f"--minutes must be > 0, got {args.minutes}")
    if args.files:
        raise SpecDecError("--files and --corpus replies do not go together")
    if args.requests not in REQUESTS:
        raise SpecDecError(f"--requests must be one of {', '.join(REQUESTS)}")
    if args.threads is not None:
        validation.integer(args.threads, "--threads", minimum=1)
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # nothing is compared against plain decoding here: no batch invariance needed
    target, tok = load_model(args.model, dtype=args.dtype, device="cpu", batch_invariant="off")
    if args.requests == "chat" and not tok.chat_template:
        raise SpecDecError(
            f"{args.model}: the target has no chat template to ask it with (--requests code "
            "asks for plain-text completions)"
        )
    t0 = time.perf_counter()
    windows, evalsets = heldout_windows(tok)
    if args.requests == "code":
        docs, sources, dropped = code_replies(target, tok, args, windows, t0)
    else:
        # a row: the prompt (at most half) + the reply; generation runs on to the longest
        # prompt's row end, so a row and a half must fit in the target's context
        seq = min(256, (target.config.max_seq_len - 1) * 2 // 3)
        chunks, _, manifest, _ = build_corpus(
            tok,
            args.replies * seq,
            seq,
            args.seed,
            target=target,
            generated=1.0,
            batch=args.batch,
            deadline=t0 + 60 * args.minutes,
        )
        docs = reply_docs(chunks.tolist(), assistant_header(tok), tok.stop_ids)
        sources = manifest["chunks_by_source"]
        dropped = manifest["heldout_check"]["chunks_dropped"]
    meta = {
        "corpus": "replies",
        "requests": args.requests,
        "model": args.model,
        "target": fingerprint(target),
        "tokenizer": tokenizer_fingerprint(tok),
        "replies": len(docs),
        "reply_tokens": sum(map(len, docs)),
        "requests_dropped": dropped,
        "sources": sources,
        "dtype": str(target.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "seed": args.seed,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m specdec.build_datastore", *sys.argv[1:]]),
        "heldout_check": {"window_tokens": WINDOW, "eval_texts": evalsets},
    }
    return Datastore.from_documents(docs, tok.vocab_size, meta, windows)


def code_replies(target, tok, args, windows: set, t0: float):
    """--requests code: the target's plain-text completions of function prefixes, each cut at
    its first stop token -> (docs, requests per source, replies dropped by the held-out
    check)."""
    from collections import Counter

    from specdec.train_head import has_window, request_ids, target_replies

    seq = min(CODE_SEQ, (target.config.max_seq_len - 1) * 2 // 3)
    requests = code_requests(tok, args.replies, args.seed, seq // 2, windows)
    if not requests:
        raise SpecDecError("no documented Python functions found for --requests code")
    docs, used, dropped = [], Counter(), 0
    replies = target_replies(
        target, tok, requests, seq, args.batch, t0 + 60 * args.minutes, chat=False
    )
    for i, row, _ in replies:
        n = len(request_ids(tok, requests[i][0], seq, chat=False))
        rep = row[n:]
        end = next((j for j, t in enumerate(rep) if t in tok.stop_ids), len(rep))
        if end < 2:
            continue
        if has_window(rep[:end], windows):
            dropped += 1
            continue
        docs.append(rep[:end])
        used[requests[i][1]] += 1
    return docs, dict(used.most_common()), dropped


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
    if args.requests != "chat" and args.corpus != "replies":
        raise SpecDecError("--requests is for --corpus replies")
    if args.corpus == "replies":
        store = build_replies(args)
        if store.meta["replies"] == 0:
            raise SpecDecError("no replies were generated in the time given")
        store.save(args.out)
        return store
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
    what = (
        f"{m['replies']} replies of {args.model} in {m['minutes']} min"
        if m.get("corpus") == "replies"
        else f"{m['documents']} documents"
    )
    print(
        f"datastore {args.out}: {m['tokens']:,} tokens from {what}, "
        f"{m['masked_windows']} held-out windows masked"
        + (f", {m['build_s']:.0f} s" if "build_s" in m else "")
    )


if __name__ == "__main__":
    user_errors(main)()
