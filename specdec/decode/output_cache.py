"""Drafting from the run's own earlier outputs (after SuffixDecoding, Oliaro et al. 2025).

Prompt lookup only finds text the current sequence already holds. A model answering many
prompts repeats itself across them too: phrasings, list scaffolding, code idioms. An
`OutputCache` keeps the tokens the target generated for earlier sequences (outputs only,
not prompts: a prompt's text is the user's, not the model's) and, for a history, finds
the longest suffix of it (n_max down to n_min tokens) that ended somewhere in those
outputs; the continuations after its most recent `samples` occurrences give a chain (the
most frequent next token, position by position, while at least `p_min` of the
occurrences agree) or a trie (the `budget` most frequent prefixes) for token trees.

    cache = OutputCache(n_max=8, n_min=2)
    cache.add(generated_tokens)                    # Drafter.finish, once per sequence
    n, conts = cache.continuations(history, k)     # conts [m, k] int64, SEP past an end
    frequent_chain(conts, SEP, p_min)  /  frequent_prefixes(conts, SEP, budget)

Drafts carry no distribution (q one-hot, as for n-gram lookup), so every acceptance rule
stays lossless. What a sequence can draw on depends on what ran before it: results depend
on the order of the prompts, the first one has nothing to draw on, and an experiment that
decodes the same prompt twice (a warm-up on a dataset prompt) must `clear()` in between or
the second run reads its own answer (experiments.run clears after its warm-up).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from specdec.errors import SpecDecError

SEP = -1  # past the end of an output: no token has this id


def frequent_chain(conts: np.ndarray, sep: int, p_min: float) -> list[int]:
    """The most frequent continuation of rows conts [m, k], token by token, while the share
    of all m rows that follow it stays >= p_min; it stops at `sep` (past a document's end).
    Ties go to the smaller id."""
    out: list[int] = []
    rows = conts
    m = len(conts)
    for j in range(conts.shape[1] if conts.ndim == 2 else 0):
        if not len(rows):
            break
        vals, counts = np.unique(rows[:, j], return_counts=True)
        best = int(counts.argmax())
        tok = int(vals[best])
        if tok == sep or counts[best] < p_min * m:
            break
        out.append(tok)
        rows = rows[rows[:, j] == tok]
    return out


def frequent_prefixes(conts: np.ndarray, sep: int, budget: int) -> list[tuple[int, ...]]:
    """The `budget` most frequent distinct prefixes of the rows of conts (sep-free), shorter
    first among equals: a prefix-closed set, parents before children."""
    counts: dict[tuple[int, ...], int] = {}
    for row in conts.tolist():
        for j, t in enumerate(row):
            if t == sep:
                break
            p = tuple(row[: j + 1])
            counts[p] = counts.get(p, 0) + 1
    best = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    return sorted(best, key=lambda p: (len(p), p))


class OutputCache:
    """An n-gram index over earlier outputs. Every position of every output is indexed by
    the n tokens ending there, for n in [n_min, n_max]; the oldest outputs are dropped once
    more than `max_tokens` are held."""

    def __init__(self, n_max: int = 8, n_min: int = 2, max_tokens: int = 65_536, samples: int = 64):
        if not 1 <= n_min <= n_max:
            raise SpecDecError(
                "output cache: need 1 <= n_min <= n_max (drafter options outputs_n_min, "
                f"outputs_n_max), got n_min={n_min}, n_max={n_max}"
            )
        if max_tokens < 1:
            raise SpecDecError(
                f"output cache: max_tokens (drafter option outputs_max_tokens) must be >= 1, "
                f"got {max_tokens}"
            )
        if samples < 1:
            raise SpecDecError(f"output cache: samples must be >= 1, got {samples}")
        self.n_max, self.n_min, self.max_tokens, self.samples = n_max, n_min, max_tokens, samples
        self.clear()

    def clear(self) -> None:
        self._docs: deque[list[int]] = deque()
        self._held = 0
        self._tokens: list[int] = []  # the held outputs, each followed by SEP
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it

    def __len__(self) -> int:
        """Tokens held."""
        return self._held

    @property
    def outputs(self) -> int:
        return len(self._docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished output (the generated tokens of one sequence)."""
        doc = [int(t) for t in tokens]
        if any(t < 0 for t in doc):
            raise SpecDecError("output cache: token ids must be >= 0")
        if not doc:
            return
        doc = doc[-self.max_tokens :]
        self._docs.append(doc)
        self._held += len(doc)
        if self._held > self.max_tokens:  # drop the oldest, rebuild the index
            while self._held > self.max_tokens:
                self._held -= len(self._docs.popleft())
            docs = list(self._docs)
            self._tokens, self._index = [], {}
            for d in docs:
                self._append(d)
        else:
            self._append(doc)

    def _append(self, doc: list[int]) -> None:
        base = len(self._tokens)
        self._tokens.extend(doc)
        self._tokens.append(SEP)
        index = self._index
        for i in range(len(doc)):
            for n in range(self.n_min, min(self.n_max, i + 1) + 1):
                index.setdefault(tuple(doc[i + 1 - n : i + 1]), []).append(base + i + 1)

    def continuations(self, history: Sequence[int], k: int) -> tuple[int, np.ndarray]:
        """The longest suffix of history (n_max down to n_min tokens) that occurs in the
        held outputs -> (n, the k tokens after each of its `samples` most recent
        occurrences [m, k] int64, SEP past an output's end); (0, empty) when none does."""
        if k < 1:
            return 0, np.zeros((0, max(k, 0)), dtype=np.int64)
        L = len(history)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            ps = self._index.get(tuple(int(t) for t in history[L - n :]))
            if ps:
                ps = ps[-self.samples :]
                toks = self._tokens
                conts = np.full((len(ps), k), SEP, dtype=np.int64)
                for r, p in enumerate(ps):
                    for j in range(k):
                        t = toks[p + j] if p + j < len(toks) else SEP
                        if t == SEP:
                            break
                        conts[r, j] = t
                return n, conts
        return 0, np.zeros((0, k), dtype=np.int64)
