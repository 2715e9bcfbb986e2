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
from pathlib import Path

import torch

from specdec.decode.drafters import Draft, Drafter, DraftRequest, draft_chain, register_drafter
from specdec.decode.heads.head import CONFIG, HeadCache, load_head, matches
from specdec.decode.sampling import logits_to_probs, sample
from specdec.errors import SpecDecError
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
    the target). `--draft head:DIR` on the command line sets `path`."""

    cli_arg = "path"

    def __init__(self, target: Transformer, path: str | None = None):
        self.path = Path(path) if path else find_head(target)
        self.head = load_head(self.path, target)
        self.target_features = self.head.cfg.feature_layers

    def begin(self, target, target_cache: KVCache, prompts, max_len, cuda_graphs=False) -> None:
        super().begin(target, target_cache, prompts, max_len)
        self.reset(len(prompts), max_len)

    def reset(self, batch: int, max_len: int) -> None:
        """An empty head cache for a new batch (a chain's `begin`, a tree round's)."""
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
        if features is not None:
            for b, n in enumerate(n_features.tolist()):
                if n:
                    new = features[b, :n]  # [n, n_layers, dim]
                    old = self.unfed[b]
                    self.unfed[b] = new if old is None else torch.cat([old, new])
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

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        head, k, params = self.head, request.k, request.params
        h, nxt = self.catch_up(
            request.history, request.features, request.n_features, extra=int(k.max())
        )

        def pick(logits, greedy):
            if greedy:
                return head.vocab_map[logits.argmax(-1)], None
            q = logits_to_probs(head.full_logits(h), params)
            return sample(q, request.generator), q

        def advance(tok, i):
            nonlocal h
            h = head.step(h[:, None], tok[:, None], self.cache, nxt + i)[:, 0]
            return head.logits(h)

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
