"""Retrieval drafting (after REST, He et al. 2024): continuations looked up in a datastore
of text that ships with the machine, for the rounds where prompt lookup finds nothing.

A `Datastore` is the target tokenizer's ids of a corpus (documents separated by SEP = the
vocabulary size, an id no token has) and its suffix array sorted by the first `depth`
tokens of every suffix. For a context (the history's last n tokens) the suffixes that start
with it form one contiguous range, found by binary search (log2 N probes, each a slice of
n ids), and inside that range they are sorted by what follows: an evenly strided sample of
at most `samples` of them gives the continuations' frequencies.

    store = Datastore.build(tokenizer, texts)      # or Datastore.load(DIR) / .save(DIR)
    n, conts = store.continuations(context, n_max=8, n_min=2, k=4)
    store.chain(conts, p_min)  /  store.trie(conts, budget)

The `datastore` drafter (`--draft datastore[:DIR]`, `draft=datastore`) takes prompt
lookup's proposal when the history's own match is at least `min_match` tokens long (the
local context wins), else the datastore's. Its default store is built once per tokenizer
from the source files of the running Python (`corpus=code`: the standard library and
site-packages, the files `specdec.train_head` reads, with the same exclusions) into
$SPECDEC_CACHE/datastores/, every 8-token window of an evaluation prompt masked out;
`python -m specdec.build_datastore` builds one into a directory of your choice.
Drafts carry no distribution (q is one-hot, as for n-gram lookup), so every acceptance
rule stays lossless.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specdec.decode.output_cache import SEP, frequent_chain, frequent_prefixes
from specdec.errors import SpecDecError

log = logging.getLogger(__name__)

FORMAT = "specdec-datastore-1"
TOKENS, INDEX, META = "tokens.npy", "suffixes.npy", "datastore.json"
MAX_K = 64  # longest continuation (the tokens array ends in DEPTH + MAX_K separators)
DEPTH = 12  # suffixes are sorted by their first DEPTH tokens (longer matches are cut there)
MAX_FILE_BYTES = 1 << 20  # corpus files larger than this are left out
WINDOW = 8  # n-gram size of the held-out check (specdec.train_head.WINDOW)


def _key_columns(tokens: np.ndarray, vocab: int, depth: int) -> list[np.ndarray]:
    """The sort keys of every suffix's first `depth` tokens, packed big-endian into int64
    columns (first column first): comparing the columns in order compares the tokens."""
    bits = int(vocab).bit_length()  # SEP = vocab fits
    per = 63 // bits
    n = len(tokens) - depth
    wide = tokens.astype(np.int64)
    cols = []
    for c0 in range(0, depth, per):
        col = np.zeros(n, dtype=np.int64)
        for j in range(c0, min(c0 + per, depth)):
            col <<= bits
            col |= wide[j : j + n]
        col <<= bits * (c0 + per - min(c0 + per, depth))  # a short last column keeps its order
        cols.append(col)
    return cols


_MUL = np.uint64(1_000_003)


def hash_rows(rows: np.ndarray) -> np.ndarray:
    """Polynomial hash (mod 2^64) of each row of rows [m, w] -> [m] uint64."""
    h = np.zeros(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(rows.shape[1]):
            h = h * _MUL + rows[:, j].astype(np.uint64) + np.uint64(1)
    return h


def window_hashes(ids: np.ndarray, w: int = WINDOW) -> np.ndarray:
    """hash_rows of every w-token window of ids: [len(ids) - w + 1] uint64."""
    if len(ids) < w:
        return np.zeros(0, dtype=np.uint64)
    return hash_rows(np.lib.stride_tricks.sliding_window_view(ids, w))


class _Suffix:
    """The suffix array as a sequence of n-token tuples, for `bisect`."""

    def __init__(self, tokens: np.ndarray, index: np.ndarray, n: int):
        self.tokens, self.index, self.n = tokens, index, n

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[int, ...]:
        p = int(self.index[i])
        return tuple(self.tokens[p : p + self.n].tolist())


class Datastore:
    def __init__(self, tokens: np.ndarray, index: np.ndarray, meta: dict):
        self.tokens, self.index, self.meta = tokens, index, meta
        self.vocab = int(meta["vocab_size"])
        self.sep = self.vocab
        self.depth = int(meta["depth"])

    def __len__(self) -> int:
        return len(self.index)

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_documents(
        cls,
        docs: Sequence[Sequence[int]],
        vocab_size: int,
        meta: dict | None = None,
        heldout: set[tuple[int, ...]] | None = None,
    ) -> Datastore:
        """Documents of token ids (each < vocab_size) -> a store over all of them, every
        occurrence of a `heldout` window masked."""
        sep = vocab_size
        parts = []
        for d in docs:
            a = np.asarray(d, dtype=np.int64)
            if len(a) and (a.min() < 0 or a.max() >= vocab_size):
                raise SpecDecError(f"datastore documents hold ids outside [0, {vocab_size})")
            parts += [a.astype(np.int32), np.array([sep], dtype=np.int32)]
        body = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        n = len(body)
        if n + DEPTH + MAX_K >= 2**31:  # positions are int32
            raise SpecDecError(f"a datastore holds fewer than 2^31 tokens, got {n:,}")
        masked = 0
        if heldout and n >= WINDOW:
            rows = np.array(sorted(heldout), dtype=np.uint64)  # [m, WINDOW]
            held = np.unique(hash_rows(rows))
            hits = np.flatnonzero(np.isin(window_hashes(body), held))
            masked = len(hits)
            cover = np.zeros(n + 1, dtype=np.int32)
            np.add.at(cover, hits, 1)
            np.add.at(cover, hits + WINDOW, -1)
            body[np.cumsum(cover[:n]) > 0] = sep
        tokens = np.concatenate([body, np.full(DEPTH + MAX_K, sep, dtype=np.int32)])
        cols = _key_columns(tokens, vocab_size, DEPTH)
        # np.lexsort sorts by the last key first
        index = np.lexsort([c[:n] for c in reversed(cols)]).astype(np.int32)
        # a suffix starting at a separator is never a match: drop those
        index = index[tokens[index] != sep]
        m = {"format": FORMAT, "vocab_size": vocab_size, "depth": DEPTH, "tokens": int(n)}
        m.update(meta or {})
        m["masked_windows"] = masked
        return cls(tokens, index, m)

    @classmethod
    def build(
        cls,
        tokenizer,
        texts: Iterable[tuple[str, str]],
        max_tokens: int,
        heldout: set[tuple[int, ...]] | None = None,
        meta: dict | None = None,
    ) -> Datastore:
        """texts: (name, text) pairs, encoded with the tokenizer (no special tokens) until
        max_tokens. Every occurrence of a WINDOW-token window in `heldout` is masked (its
        tokens become SEP, so the store can neither match nor propose it)."""
        docs: list[np.ndarray] = []
        total = 0
        batch: list[str] = []

        def flush() -> None:
            nonlocal total
            for e in tokenizer.backend.encode_batch(batch, add_special_tokens=False):
                if total < max_tokens and len(e.ids) >= 2:
                    docs.append(np.asarray(e.ids[: max_tokens - total], dtype=np.int32))
                    total += len(docs[-1]) + 1
            batch.clear()

        for _, text in texts:
            batch.append(text)
            if len(batch) == 64:
                flush()
                if total >= max_tokens:
                    break
        if batch and total < max_tokens:
            flush()
        m = {"documents": len(docs), **(meta or {})}
        return cls.from_documents(docs, tokenizer.vocab_size, m, heldout)

    # -- files ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """tokens.npy + suffixes.npy + datastore.json, written into a temporary folder and
        renamed into place (a reader never sees half a store)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            np.save(tmp / TOKENS, self.tokens, allow_pickle=False)
            np.save(tmp / INDEX, self.index, allow_pickle=False)
            (tmp / META).write_text(json.dumps(self.meta, indent=1))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, directory: str | Path) -> Datastore:
        """A saved store, every field checked (shapes, dtypes, id and position ranges); the
        arrays are memory-mapped."""
        directory = Path(directory)
        for f in (META, TOKENS, INDEX):
            if not (directory / f).is_file():
                raise SpecDecError(f"{directory}: not a datastore (no {f})")
        try:
            meta = json.loads((directory / META).read_text())
            tokens = np.load(directory / TOKENS, mmap_mode="r", allow_pickle=False)
            index = np.load(directory / INDEX, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, UnicodeDecodeError) as e:
            raise SpecDecError(f"{directory}: unreadable datastore ({e})") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SpecDecError(f"{directory}: not a {FORMAT} datastore")
        vocab, depth, n = meta.get("vocab_size"), meta.get("depth"), meta.get("tokens")
        if not all(isinstance(x, int) and x > 0 for x in (vocab, depth, n)) or depth != DEPTH:
            raise SpecDecError(f"{directory}: bad datastore header {meta}")
        if tokens.dtype != np.int32 or tokens.ndim != 1 or len(tokens) != n + DEPTH + MAX_K:
            raise SpecDecError(f"{directory}: {TOKENS} does not match the header")
        if index.dtype != np.int32 or index.ndim != 1 or len(index) > n:
            raise SpecDecError(f"{directory}: {INDEX} does not match the header")
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > vocab):
            raise SpecDecError(f"{directory}: token ids outside [0, {vocab}]")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= n):
            raise SpecDecError(f"{directory}: suffix positions outside [0, {n})")
        return cls(tokens, index, meta)

    # -- lookup -----------------------------------------------------------------------------
    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """The range [lo, hi) of suffixes that start with `context` (len <= depth)."""
        ctx = tuple(int(t) for t in context)
        seq = _Suffix(self.tokens, self.index, len(ctx))
        lo = bisect.bisect_left(seq, ctx)
        hi = bisect.bisect_right(seq, ctx, lo=lo)
        return lo, hi

    def continuations(
        self, history: Sequence[int], n_max: int, n_min: int, k: int, samples: int = 256
    ) -> tuple[int, np.ndarray]:
        """The longest suffix of history (n_max down to n_min tokens, at most depth) that
        occurs in the store -> (n, continuations [m, k] int32 of up to `samples` of its
        occurrences, evenly strided over the sorted range; SEP past a document's end).
        (0, empty) when none matches."""
        if not 1 <= k <= MAX_K:
            raise SpecDecError(f"datastore continuations take 1 <= k <= {MAX_K}, got {k}")
        for n in range(min(n_max, self.depth, len(history)), n_min - 1, -1):
            lo, hi = self.match(history[len(history) - n :])
            if hi > lo:
                m = min(samples, hi - lo)
                pick = lo + (np.arange(m, dtype=np.int64) * (hi - lo)) // m
                starts = self.index[pick].astype(np.int64) + n
                conts = self.tokens[starts[:, None] + np.arange(k)]
                return n, np.asarray(conts)
        return 0, np.zeros((0, k), dtype=np.int32)

    def chain(self, conts: np.ndarray, p_min: float) -> list[int]:
        """The most frequent continuation, token by token, while the share of occurrences
        that follow it stays >= p_min."""
        return frequent_chain(conts, self.sep, p_min)

    def trie(self, conts: np.ndarray, budget: int) -> list[tuple[int, ...]]:
        """The `budget` most frequent distinct prefixes of the continuations (SEP-free),
        shorter first among equals: a prefix-closed set, parents before children."""
        return frequent_prefixes(conts, self.sep, budget)


# -- the default store: the running Python's source files, once per tokenizer ---------------
def tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()[:16]


def corpus_texts(corpus: str, seed: int = 0) -> Iterable[tuple[str, str]]:
    """(path, text) of the corpus files (specdec.train_head.corpus_files: 'code' = .py,
    'doc' = documentation, 'all' = both) in a seeded random order."""
    import random

    from specdec.train_head import corpus_files

    files = corpus_files()
    kinds = {"code": ["code"], "doc": ["doc"], "all": ["code", "doc"]}[corpus]
    paths = sorted(p for k in kinds for p in files[k])
    random.Random(seed).shuffle(paths)
    for p in paths:
        try:
            if p.stat().st_size > MAX_FILE_BYTES:  # generated tables, vendored bundles
                continue
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield str(p), text


CORPORA = ("code", "doc", "all")


def check_corpus(corpus: str) -> None:
    if corpus not in CORPORA:
        raise SpecDecError(
            f"unknown datastore corpus {corpus!r} (choose one of {', '.join(CORPORA)})"
        )


def build_store(
    tokenizer,
    corpus: str = "code",
    max_tokens: int = 16_000_000,
    seed: int = 0,
    texts: Iterable[tuple[str, str]] | None = None,
    meta: dict | None = None,
) -> Datastore:
    """A store for this tokenizer of the corpus files (or of `texts`, (name, text) pairs,
    instead), the windows of the evaluation prompts (specdec.train_head.heldout_windows)
    masked; `meta` is added to the store's header."""
    from specdec.train_head import heldout_windows

    check_corpus(corpus)
    t0 = time.perf_counter()
    windows, evalsets = heldout_windows(tokenizer)
    store = Datastore.build(
        tokenizer,
        corpus_texts(corpus, seed) if texts is None else texts,
        max_tokens,
        heldout=windows,
        meta={
            "corpus": corpus if texts is None else "files",
            "max_tokens": max_tokens,
            "seed": seed,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "heldout_check": {"window_tokens": WINDOW, "eval_texts": evalsets},
            **(meta or {}),
        },
    )
    store.meta["build_s"] = round(time.perf_counter() - t0, 1)
    return store


def default_store(tokenizer, corpus: str = "code", max_tokens: int = 16_000_000) -> Datastore:
    """The cached default store for this tokenizer and corpus, built on first use."""
    from specdec.models.registry import cache_dir

    check_corpus(corpus)
    d = cache_dir() / "datastores" / f"{tokenizer_fingerprint(tokenizer)}-{corpus}-{max_tokens}"
    if (d / META).is_file():
        return Datastore.load(d)
    log.warning(
        "building the %s datastore for this tokenizer into %s (once; about a minute)", corpus, d
    )
    store = build_store(tokenizer, corpus, max_tokens)
    store.save(d)
    log.info(
        "datastore: %d tokens from %d files (%d held-out windows masked) in %.0f s",
        store.meta["tokens"],
        store.meta["documents"],
        store.meta["masked_windows"],
        store.meta["build_s"],
    )
    return Datastore.load(d)


# -- the drafter ----------------------------------------------------------------------------
from specdec.decode.drafters import (  # noqa: E402
    NgramDrafter,
    register_drafter,
)


@register_drafter("datastore")
class DatastoreDrafter(NgramDrafter):
    """Prompt lookup when the history's own match is at least `min_match` tokens (local
    context wins), else (reuse_outputs) the run's earlier outputs as NgramDrafter drafts
    from them, else the datastore's continuation of the history's longest suffix that
    it holds (`ds_n_max` down to `ds_n_min` tokens), token by token while at least `p_min`
    of the sampled occurrences follow it; else prompt lookup's shorter match, if any.
    Token trees: the history's trie, or the output cache's / datastore's `budget` most
    frequent prefixes.

    path: a directory written by `python -m specdec.build_datastore` (its tokenizer must be
    the target's); None: the default store of `corpus` for the target's tokenizer, built
    once into $SPECDEC_CACHE/datastores/."""

    cli_arg = "path"

    def __init__(
        self,
        target=None,
        target_tokenizer=None,
        path: str | None = None,
        corpus: str = "code",
        max_tokens: int = 16_000_000,
        n_max: int = 3,
        n_min: int = 1,
        min_match: int = 2,
        ds_n_max: int = DEPTH,
        ds_n_min: int = 2,
        p_min: float = 0.2,
        samples: int = 256,
        reuse_outputs: bool = False,
        outputs_n_max: int = 8,
        outputs_n_min: int = 2,
        outputs_p_min: float = 0.0,
        outputs_max_tokens: int = 65_536,
    ):
        super().__init__(
            n_max,
            n_min,
            reuse_outputs,
            min_match,
            outputs_n_max,
            outputs_n_min,
            outputs_p_min,
            outputs_max_tokens,
        )
        if not 1 <= ds_n_min <= ds_n_max <= DEPTH:
            raise SpecDecError(
                f"datastore: need 1 <= ds_n_min <= ds_n_max <= {DEPTH}, "
                f"got ds_n_min={ds_n_min}, ds_n_max={ds_n_max}"
            )
        if not 0.0 <= p_min <= 1.0:
            raise SpecDecError(f"datastore: p_min must be in [0, 1], got {p_min}")
        if samples < 1:
            raise SpecDecError(f"datastore: samples must be >= 1, got {samples}")
        if max_tokens < 1:
            raise SpecDecError(f"datastore: max_tokens must be >= 1, got {max_tokens}")
        check_corpus(corpus)
        if path is None and target_tokenizer is None:
            raise SpecDecError("datastore: give a store directory (path) or the target's tokenizer")
        if path is not None:
            self.store = Datastore.load(path)
            made_for = self.store.meta.get("tokenizer")  # absent: a store of raw ids
            if target_tokenizer is not None and made_for is not None:
                want = tokenizer_fingerprint(target_tokenizer)
                if made_for != want:
                    raise SpecDecError(
                        f"datastore {path} was built for another tokenizer "
                        f"({made_for}, the target's is {want})"
                    )
        else:
            self.store = default_store(target_tokenizer, corpus, max_tokens)
        if target_tokenizer is not None and self.store.vocab != target_tokenizer.vocab_size:
            raise SpecDecError(
                f"datastore vocabulary {self.store.vocab} != the target tokenizer's "
                f"{target_tokenizer.vocab_size}"
            )
        if target is not None and self.store.vocab > target.config.vocab_size:
            raise SpecDecError(
                f"datastore vocabulary {self.store.vocab} > the target's {target.config.vocab_size}"
            )
        self.ds_n_max, self.ds_n_min = ds_n_max, ds_n_min
        self.p_min, self.samples = p_min, samples
        self.sources = {"history": 0, "outputs": 0, "datastore": 0, "none": 0}

    def _source(self, h: list[int], k: int) -> tuple[str, list[int] | np.ndarray]:
        """-> ("history", prompt lookup's proposal) when its match is at least min_match
        tokens, else ("outputs", the output cache's continuations [m, k]) where it has a
        match at least as long (reuse_outputs), else ("datastore", the store's
        continuations [m, k]) when the store holds a suffix, else ("history", the shorter
        match's proposal) or ("none", [])."""
        n, cont = self.match(h, k, self.n_max, self.n_min)
        if n >= self.min_match and cont:
            return "history", cont
        conts = self._recall(h, k, n if cont else 0)
        if conts is not None:
            return "outputs", conts
        nd, conts = self.store.continuations(h, self.ds_n_max, self.ds_n_min, k, self.samples)
        if nd and len(conts):
            return "datastore", conts
        return ("history", cont) if cont else ("none", [])

    def _propose_one(self, h: list[int], k: int) -> tuple[str, list[int]]:
        """-> (source, proposal) for one sequence (`_source`; a chain from the output cache
        or the datastore, "none" when the chain is empty)."""
        which, got = self._source(h, min(k, MAX_K))
        if which == "outputs":
            got = frequent_chain(got, SEP, self.outputs_p_min)
        elif which == "datastore":
            got = self.store.chain(got, self.p_min)
        else:
            return which, list(got)
        return (which, got) if got else ("none", [])

    def _tree_prefixes(self, h: list[int], d: int, budget: int) -> list[tuple[int, ...]] | None:
        which, conts = self._source(h, min(d, MAX_K))
        if which == "outputs":
            return frequent_prefixes(conts, SEP, budget)
        if which == "datastore":
            return self.store.trie(conts, budget)
        return None
