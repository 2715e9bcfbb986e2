"""The `head` drafter: a trained draft head (specdec.decode.heads.head) run k steps per round.

Each round the engine hands over the target's features of the tokens it committed since
the last request (the prompt after prefill, then pending + accepted drafts after each
verification). The drafter first *catches up*: one head forward over those positions,
reading the target's features, writes them into the head's KV cache; its last output
gives the first draft. Each further draft feeds the head's own output back (one position
per step). `fed` is the head cache's committed length per sequence: draft positions are
written after it and overwritten next round, the same logical rollback as the target's
cache (accepted drafts are recomputed from the target's true features).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.decode.drafters import (
    Draft,
    Drafter,
    DraftRequest,
    NgramDrafter,
    draft_chain,
    register_drafter,
)
from specdec.decode.heads.head import CONFIG, HeadCache, load_head, matches
from specdec.decode.sampling import logits_to_probs, sample
from specdec.decode.schedules import check_p_min
from specdec.errors import SpecDecError
from specdec.kernels.argmax import argmax
from specdec.models.transformer import KVCache, Transformer

# heads shipped with the package: one folder per target (head.json + head.safetensors)
SHIPPED = Path(__file__).parent


def find_head(target: Transformer) -> Path:
    """The shipped head trained for `target` (matched by fingerprint)."""
    for cfg_file in sorted(SHIPPED.glob(f"*/{CONFIG}")):
        fp = json.loads(cfg_file.read_text())["config"].get("target", {})
        if matches(fp, target):
            return cfg_file.parent
    raise SpecDecError(
        "no shipped draft head matches this target; train one with "
        "`python -m specdec.train_head --model <target> --out DIR` and use --draft head:DIR"
    )


@register_drafter("head")
class HeadDrafter(Drafter):
    """A trained EAGLE-style head (`path`: its directory; default: the shipped head for
    the target). `--draft head:DIR` on the command line sets `path`. `p_min` > 0 stops a
    sequence's chain at its first guess whose head probability is below it (as the
    confidence schedule does for every drafter; a schedule's p_min, when set, wins)."""

    cli_arg = "path"

    def __init__(self, target: Transformer, path: str | None = None, p_min: float = 0.0):
        check_p_min(p_min)
        self.p_min = float(p_min)
        self.path = Path(path) if path else find_head(target)
        self.head = load_head(self.path, target)
        self.target_features = self.head.cfg.feature_layers

    def begin(self, target, target_cache: KVCache, prompts, max_len, cuda_graphs=False) -> None:
        super().begin(target, target_cache, prompts, max_len)
        self.new_cache(len(prompts), max_len)

    def new_cache(self, batch: int, max_len: int) -> None:
        """An empty head cache for a new batch (a chain's `begin`, a tree round's). (Not
        `reset`: that is the engine's hook for forgetting what earlier outputs taught,
        which experiments.run calls without arguments after its warm-up; a head learns
        nothing across sequences, so it keeps Drafter's no-op.)"""
        self.cache = HeadCache(self.head.cfg, batch, max_len, self.head.lm_weight.device)
        self.fed = [0] * batch  # token positions 1..fed are in the head cache (slots 0..fed-1)
        self.unfed: list[torch.Tensor | None] = [None] * batch  # target features not yet fed

    def catch_up(
        self,
        history: list[list[int]],
        features: torch.Tensor | None,
        n_features: torch.Tensor | None,
        extra: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over the committed positions the head cache lacks, reading the
        target's features (features [B, T, n, dim], n_features [B] valid rows: those of the
        tokens committed since the last call) -> (h [B, dim]: the head's output at the last
        committed position, which scores the first draft; nxt [B]: the slot of the first
        draft's own position). The cache is grown to hold `extra` slots past nxt."""
        head = self.head
        B, dev = len(history), self.cache.k.device
        self.stash(features, n_features)
        # catch up: position fed+1+i reads feature fed+i and token history[fed+1+i]
        m = [
            0 if u is None else max(0, min(len(u), len(h) - 1 - f))
            for u, h, f in zip(self.unfed, history, self.fed)
        ]
        T = max(1, max(m))
        start = torch.tensor(self.fed, dtype=torch.long, device=dev)
        self._ensure(int(start.max()) + T + extra)
        cfg = head.cfg
        feats = torch.zeros(B, T, len(cfg.feature_layers), cfg.dim, device=dev)
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, (mb, f) in enumerate(zip(m, self.fed)):
            if mb:
                feats[b, :mb] = self.unfed[b][:mb]
                toks[b, :mb] = torch.tensor(history[b][f + 1 : f + 1 + mb], device=dev)
        m_t = torch.tensor(m, dtype=torch.long, device=dev)
        h = head.step(head.fuse_features(feats), toks, self.cache, start)  # [B, T, dim]
        h = h[torch.arange(B, device=dev), (m_t - 1).clamp(min=0)]  # [B, dim]
        self.fed = [f + mb for f, mb in zip(self.fed, m)]
        self.unfed = [None] * B
        return h, start + m_t

    def stash(self, features: torch.Tensor | None, n_features: torch.Tensor | None) -> None:
        """Keep the target's features of newly committed tokens until the next catch-up
        (several rounds' worth when rounds pass without a head draft)."""
        if features is None:
            return
        for b, n in enumerate(n_features.tolist()):
            if n:
                new = features[b, :n]  # [n, n_layers, dim]
                old = self.unfed[b]
                self.unfed[b] = new if old is None else torch.cat([old, new])

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        head, k, params = self.head, request.k, request.params
        h, nxt = self.catch_up(
            request.history, request.features, request.n_features, extra=int(k.max())
        )

        def pick(logits, greedy):
            if greedy:
                return head.vocab_map[argmax(logits)], None
            q = logits_to_probs(head.full_logits(h), params)
            return sample(q, request.generator), q

        def advance(tok, i):
            nonlocal h
            h = head.step(h[:, None], tok[:, None], self.cache, nxt + i)[:, 0]
            return head.logits(h)

        if not request.p_min and self.p_min:
            request = replace(request, p_min=self.p_min)
        draft = draft_chain(request, head.cfg.vocab_size, head.logits(h), pick, advance)
        draft.forwards += 1  # the catch-up step
        return draft

    def _ensure(self, slots: int) -> None:
        """Grow the head cache to hold `slots` entries (rows past `fed` may run ahead)."""
        have = self.cache.k.shape[2]
        if slots <= have:
            return
        old = self.cache
        self.cache = HeadCache(self.head.cfg, old.k.shape[0], max(slots, 2 * have), old.k.device)
        self.cache.k[:, :, :have] = old.k
        self.cache.v[:, :, :have] = old.v


@register_drafter("ngram_head")
class NgramHeadDrafter(HeadDrafter):
    """Prompt lookup first, the trained head where it finds nothing: per sequence and round,
    the n-gram drafter's proposal when it has at least `min_match` tokens, else the head's
    chain, cut at its first guess below `p_min` (default 0.5; README "Trained draft heads").
    n-gram drafts are free and right for long stretches of copied text; the head drafts
    elsewhere. `backoff` > 0: after a head round that got nothing accepted, a sequence
    skips the head for 1, 2, 4, ... (at most `backoff`) rounds of no-n-gram text (plain
    one-token rounds), and a head round with an accepted draft resets it; on text the head
    cannot predict (translation) it stops paying its cost every round. The head is not run
    in rounds where no sequence wants it: the target's features of those rounds wait in
    `unfed` and the next head round catches up on all of them in one forward. Chains only
    (token trees: draft=head or draft=ngram)."""

    cli_arg = "path"
    chains_only = True

    def __init__(
        self,
        target: Transformer,
        path: str | None = None,
        n_max: int = 3,
        n_min: int = 1,
        min_match: int = 1,
        p_min: float = 0.5,
        backoff: int = 0,
    ):
        if min_match < 1:
            raise SpecDecError(f"ngram_head: min_match must be >= 1, got {min_match}")
        if backoff < 0:
            raise SpecDecError(f"ngram_head: backoff must be >= 0, got {backoff}")
        self.backoff = int(backoff)
        self.ngram = NgramDrafter(n_max, n_min)
        self.min_match = int(min_match)
        super().__init__(target, path, p_min)

    def begin(self, target, target_cache: KVCache, prompts, max_len, cuda_graphs=False) -> None:
        super().begin(target, target_cache, prompts, max_len, cuda_graphs)
        self.rounds = {"ngram": 0, "head": 0}  # sequence-rounds drafted by each, this batch
        self.skipped = 0  # rounds without a head forward (no sequence wanted the head)
        B = len(prompts)
        self.wait = [0] * B  # head rounds still to skip, per sequence (backoff)
        self.fails = [0] * B  # head rounds in a row with nothing accepted
        self.asked = [False] * B  # whether the head drafted this round

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        ng = self.ngram.propose(request)  # prompt lookup for every sequence (free)
        by_ngram = ng.n_draft >= self.min_match  # [B]
        need = []
        for b, (kb, use) in enumerate(zip(request.k.tolist(), by_ngram.tolist())):
            want = kb > 0 and not use
            if want and self.wait[b] > 0:  # backing off: a plain round for this sequence
                self.wait[b] -= 1
                want = False
            need.append(want)
        self.asked = need
        self.rounds["ngram"] += int(by_ngram.sum())
        self.rounds["head"] += sum(need)
        tokens = torch.where(by_ngram[:, None], ng.tokens, 0)
        n_draft = torch.where(by_ngram, ng.n_draft, 0)
        if not any(need):
            self.stash(request.features, request.n_features)
            self.skipped += 1
            return Draft(tokens, None, n_draft, 0)
        mask = torch.tensor(need, device=tokens.device)
        hd = super().propose(replace(request, k=torch.where(mask, request.k, 0)))
        pad = tokens.shape[1] - hd.tokens.shape[1]
        tokens = torch.where(mask[:, None], F.pad(hd.tokens, (0, pad)), tokens)
        n_draft = torch.where(mask, hd.n_draft, n_draft)
        probs = None
        if hd.probs is not None:  # sampling: n-gram rows are one-hot on their drafts
            valid = torch.arange(tokens.shape[1], device=tokens.device) < n_draft[:, None]
            one_hot = F.one_hot(tokens, hd.probs.shape[-1]).float() * valid[..., None]
            probs = torch.where(mask[:, None, None], F.pad(hd.probs, (0, 0, 0, pad)), one_hot)
        return Draft(tokens, probs, n_draft, hd.forwards)

    def commit(self, n_accepted: torch.Tensor) -> None:
        if not self.backoff:
            return
        for b, n in enumerate(n_accepted.tolist()):
            if not self.asked[b]:
                continue
            if n > 0:
                self.fails[b] = 0
            else:
                self.fails[b] += 1
                self.wait[b] = min(2 ** (self.fails[b] - 1), self.backoff)


class HeadTreeScorer:
    """Scores token-tree nodes with a `HeadDrafter`'s head (the protocol of
    specdec.decode.tree.ModelTreeDrafter, for `TreeRound`).

    Per round: `start(history, features, n_features)` catches the head cache up on the
    target's features of the newly committed tokens (the root's output h scores depth 1);
    `score(frontiers)` feeds the frontier nodes not fed yet, one `DraftHead.tree_step` per
    depth: a node at depth d reads (its parent's h, its token) at RoPE position nxt + d - 1
    (nxt: the first draft's slot, as in the chain), its K/V at slot nxt + j (j: the order it
    was fed in this round), attending to the committed head cache and its ancestors only.
    Logits are over the full vocabulary (-inf off the head's vocab_map). `commit` keeps
    nothing of the tree: the accepted path is re-fed next round with the target's true
    features (the chain drafter's logical rollback).
    """

    def __init__(self, drafter: HeadDrafter):
        self.drafter, self.head = drafter, drafter.head
        self.target_features = drafter.target_features
        self.forwards = 0

    def begin(self, target_cache: KVCache | None, batch: int, max_len: int) -> None:
        """Once per batch, after the target's prefill."""
        self.drafter.new_cache(batch, max_len)

    @torch.inference_mode()
    def start(
        self,
        history: list[list[int]],
        features: torch.Tensor | None,
        n_features: torch.Tensor | None,
    ) -> None:
        h, self.base = self.drafter.catch_up(history, features, n_features)
        self.forwards += 1
        self.root_logits = self.head.full_logits(h)  # [B, V]
        self.root_h = h  # [B, dim]
        # per sequence: path -> j (slot base + j), and the head's output h_j [dim]
        self.nodes: list[dict[tuple[int, ...], int]] = [{} for _ in history]
        self.h: list[list[torch.Tensor]] = [[] for _ in history]

    @torch.inference_mode()
    def score(self, frontiers: list[list[tuple[int, ...]]]) -> list[torch.Tensor]:
        """DraftScorer over this round's trees (paths of draft tokens from the root)."""
        deepest = max((len(p) for paths in frontiers for p in paths), default=0)
        for d in range(1, deepest + 1):
            level = [
                list(dict.fromkeys(p[:d] for p in paths if len(p) >= d and p[:d] not in nodes))
                for paths, nodes in zip(frontiers, self.nodes)
            ]
            if any(level):
                self._feed(level, d)
        out = []
        for b, paths in enumerate(frontiers):
            rows = [self.root_logits[b] if not p else None for p in paths]
            fed = [i for i, p in enumerate(paths) if p]
            if fed:
                h = torch.stack([self.h[b][self.nodes[b][paths[i]]] for i in fed])
                for i, row in zip(fed, self.head.full_logits(h)):
                    rows[i] = row
            out.append(torch.stack(rows) if rows else self.root_logits[:0])  # [len(paths), V]
        return out

    def _feed(self, level: list[list[tuple[int, ...]]], d: int) -> None:
        """One tree_step over the new nodes at depth d (level[b]; parents already fed)."""
        head, dev = self.head, self.root_h.device
        B, T = len(level), max(len(x) for x in level)
        base = self.base.tolist()
        first = [len(n) for n in self.nodes]
        # row i of sequence b at slot base + first + i (padding rows too: no real node is
        # there yet, and a later one overwrites it)
        slots = [[base[b] + first[b] + i for i in range(T)] for b in range(B)]
        L = max(max(s) for s in slots) + 1
        self.drafter._ensure(L)
        visible = torch.zeros(B, T, L, dtype=torch.bool)
        g = self.root_h[:, None].repeat(1, T, 1)  # [B, T, dim]; depth 1 reads the root's h
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, paths in enumerate(level):
            for i, p in enumerate(paths):
                self.nodes[b][p] = first[b] + i
                tokens[b, i] = p[-1]
                visible[b, i, : base[b]] = True
                for j in range(1, d):
                    visible[b, i, base[b] + self.nodes[b][p[:j]]] = True
                if d > 1:
                    g[b, i] = self.h[b][self.nodes[b][p[:-1]]]
            for i in range(T):
                visible[b, i, slots[b][i]] = True
        positions = self.base[:, None].expand(B, T) + (d - 1)  # [B, T]
        h = head.tree_step(
            g,
            tokens.to(dev),
            self.drafter.cache,
            torch.tensor(slots, dtype=torch.long, device=dev),
            positions,
            visible.to(dev),
        )  # [B, T, dim]
        self.forwards += 1
        for b, paths in enumerate(level):
            self.h[b].extend(h[b, : len(paths)])

    def commit(self, accepted: list[list[int]]) -> None:
        """accepted[b]: the accepted draft tokens. Nothing to keep: the committed length
        grows in the next `start`, from the target's features of the accepted path."""
