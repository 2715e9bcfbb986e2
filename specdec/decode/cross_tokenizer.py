"""Cross-tokenizer drafting (HF transformers: universal assisted generation): a draft model
whose vocabulary differs from the target's proposes *text*.

Each round, for every sequence:

    1. the target's committed history (prompt + emitted tokens, the pending one included)
       is decoded to text; the draft model's own token sequence is brought in sync with
       that text: the longest prefix of what the draft cache holds whose text is a prefix
       of the committed text is kept less a few tokens (tokenizers merge across a
       boundary), the rest of the text is re-encoded with the draft tokenizer, the cache
       is rolled back (logically) to the common prefix and the new tokens are fed;
    2. the draft model drafts k + lookahead + holdback tokens (greedy, or sampled when the
       decoding samples), decoded to text; the draft cache stops `holdback` tokens short of
       the committed text, so the draft first re-drafts its end (a word the target has only
       begun, " dra", is read whole: " drafts"), and a draft that does not reproduce that
       end proposes nothing;
    3. the target's last few committed tokens are decoded, the draft text appended, and the
       whole re-encoded with the target's tokenizer; where that encoding has a token
       boundary exactly at the end of the committed text, the tokens after it (less the
       last, which may still merge with what follows) are the proposal, at most k.
       Nothing aligns: no drafts this round.

The proposals go out without probabilities (Draft.probs None): the acceptance rules treat
them as one-hot, which the speculative-sampling rule verifies with the target's
probabilities alone (accept x with probability p(x), else sample p without x), so both
greedy and sampled decoding keep the target's output distribution exactly. Drafted and
accepted counts are target tokens; Draft.forwards counts draft-model forwards. `commit`
trusts nothing: the next round re-syncs from the committed text.

Text is compared, never ids, so any two tokenizers work; decoding must be concatenative
(byte-level BPE is) for the draft cache to be reused across rounds, otherwise the sync
re-encodes more (slower, still exact). A committed text that ends inside a multi-byte
character (a token holding part of its UTF-8 bytes) gets no drafts until it completes.
"""

from __future__ import annotations

import torch

from specdec.decode.drafters import (
    Draft,
    Drafter,
    DraftRequest,
    check_placement,
    draft_chain,
    load_draft_model,
    register_drafter,
)
from specdec.decode.sampling import logits_to_probs, sample
from specdec.errors import SpecDecError
from specdec.kernels.argmax import argmax
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import KVCache, Transformer

INCOMPLETE = "\ufffd"  # what decoding shows for the bytes of an unfinished character
SYNC_BACKOFF = 2  # draft tokens re-encoded before the first point where the texts differ
TARGET_CONTEXT = 3  # committed target tokens re-encoded with the draft text


def committed_text(tok: Tokenizer, ids: list[int]) -> str:
    """The text of a token history (a leading BOS the tokenizer adds itself left out)."""
    if tok.add_bos and ids and ids[0] == tok.bos_id:
        ids = ids[1:]
    return tok.decode(ids)


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.backend.encode(text, add_special_tokens=False).ids if text else []


def sync_tokens(
    tok: Tokenizer, ids: list[int], text: str, backoff: int = SYNC_BACKOFF
) -> list[int]:
    """A token sequence for `text` that keeps as much of `ids` as is safe: the longest
    prefix of `ids` whose text is a prefix of `text`, less `backoff` tokens (the tokens
    before a difference may merge differently with what follows), then the rest of the
    text encoded by `tok`."""
    i = len(ids)
    while i > 0 and not text.startswith(tok.decode(ids[:i])):
        i -= 1
    i = max(0, i - backoff)
    head = tok.decode(ids[:i])
    while i > 0 and head.endswith(INCOMPLETE):  # never cut inside a character
        i -= 1
        head = tok.decode(ids[:i])
    return ids[:i] + _encode(tok, text[len(head) :])


def target_proposal(
    tok: Tokenizer,
    history: list[int],
    text: str,
    draft_text: str,
    k: int,
    context: int = TARGET_CONTEXT,
) -> list[int]:
    """Up to k target tokens continuing `history` (whose text is `text`) with `draft_text`:
    the last `context` history tokens' text plus the draft text re-encoded by `tok`, the
    tokens after its boundary at the end of the committed text, less the last one (it may
    still merge with what follows). [] where no boundary lines up."""
    if k <= 0 or not draft_text or text.endswith(INCOMPLETE):
        return []
    m = min(context, len(history))
    tail = tok.decode(history[-m:])
    while tail.startswith(INCOMPLETE) and m < len(history):  # start on a whole character
        m += 1
        tail = tok.decode(history[-m:])
    if not text.endswith(tail):
        return []
    ids = _encode(tok, tail + draft_text)
    j = 0
    while j < len(ids) and len(tok.decode(ids[:j])) < len(tail):
        j += 1
    if tok.decode(ids[:j]) != tail:
        return []
    return ids[j : len(ids) - 1][:k]


def _clean(text: str) -> str:
    """Draft text up to its first unfinished or invalid character."""
    cut = text.find(INCOMPLETE)
    return text if cut < 0 else text[:cut]


@register_drafter("cross_tokenizer")
class CrossTokenizerDrafter(Drafter):
    """A draft model with its own tokenizer proposing text for the target (module doc).
    model: a Transformer (then `tokenizer` is its tokenizer) or a registered name / .gguf /
    HF directory loaded with dtype / device / backend / quantize (default: the target's).
    lookahead: draft tokens beyond k per round (the last target token is dropped).
    holdback: draft tokens of the committed text the draft re-drafts each round (a word
    the target has only begun is read whole); 0: draft right after the committed text."""

    def __init__(
        self,
        model: Transformer | str,
        target: Transformer | None = None,
        target_tokenizer: Tokenizer | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        lookahead: int = 2,
        holdback: int = 1,
        dtype: str | None = None,
        device: str | None = None,
        backend: str | None = None,
        quantize: str | None = None,
    ):
        if target_tokenizer is None:
            raise SpecDecError("cross-tokenizer drafting needs the target's tokenizer")
        if isinstance(model, str) and tokenizer is not None:
            raise SpecDecError("a draft model given by name brings its own tokenizer")
        model, loaded = load_draft_model(model, target, dtype, device, backend, quantize)
        tokenizer = tokenizer or loaded
        if tokenizer is None:
            raise SpecDecError("cross-tokenizer drafting needs the draft model's tokenizer")
        if lookahead < 0 or holdback < 0:
            raise SpecDecError(
                f"lookahead and holdback must be >= 0, got {lookahead} and {holdback}"
            )
        if target is not None:
            check_placement(target, model)
        # not `self.model`: the engine pairs a drafter's `model` with the target's vocabulary
        self.draft_model, self.tokenizer = model, tokenizer
        self.target_tokenizer = target_tokenizer
        self.lookahead, self.holdback = lookahead, holdback
        bos = tokenizer.bos_id
        self.prefix = [bos] if tokenizer.add_bos and bos is not None else []

    def begin(self, target, target_cache, prompts, max_len, cuda_graphs=False) -> None:
        super().begin(target, target_cache, prompts, max_len)
        cap = min(2 * max_len + len(self.prefix), self.draft_model.config.max_seq_len)
        self.cache = KVCache.for_model(self.draft_model, len(prompts), cap)
        # per sequence: the draft tokens whose KV entries the cache holds (after the prefix)
        self.ids: list[list[int]] = [[] for _ in prompts]

    def _reserve(self, n: int) -> None:
        """Grow the draft cache to hold n entries per sequence (its lens are kept)."""
        if n <= self.cache.max_len:
            return
        limit = self.draft_model.config.max_seq_len
        if n > limit:
            raise SpecDecError(
                f"the draft sequence needs {n} positions; the draft model's context is {limit}"
            )
        old = self.cache
        new = KVCache.for_model(self.draft_model, old.batch, min(max(n, 2 * old.max_len), limit))
        new.k[:, :, :, : old.max_len] = old.k
        new.v[:, :, :, : old.max_len] = old.v
        new.lens = old.lens
        self.cache = new

    def propose(self, request: DraftRequest) -> Draft:
        tok, ttok, dev = self.tokenizer, self.target_tokenizer, self.draft_model.device
        history, ks = request.history, request.k.tolist()
        B, P = len(history), len(self.prefix)
        texts = [committed_text(ttok, h) for h in history]
        # 1. sync the draft sequence with the committed text (up to its last whole character);
        # a drafting sequence leaves its last `holdback` draft tokens for the draft to
        # re-draft: a word cut short in the committed text is read whole, not as a piece
        drafting, feeds, starts, held = [], [], [], []
        for b, text in enumerate(texts):
            old, synced = self.ids[b], text.rstrip(INCOMPLETE)
            new = sync_tokens(tok, old, synced)
            go = ks[b] > 0 and not text.endswith(INCOMPLETE)
            if go and self.holdback:
                cut = max(len(new) - self.holdback, 0 if P else 1)
                if synced.startswith(tok.decode(new[:cut])):
                    new = new[:cut]
            held.append(synced[len(tok.decode(new)) :])
            keep = 0
            while keep < min(len(old), len(new)) and old[keep] == new[keep]:
                keep += 1
            full = self.prefix + new
            start = min(P + keep, len(full) - 1)  # re-feed >= 1 token: its logits draft
            drafting.append(go and start >= 0)
            if start < 0:  # nothing to condition on yet: a placeholder row, no drafts
                start, full = 0, [0]
            feeds.append(full[start:])
            starts.append(start)
            self.ids[b] = new
        T = max(len(f) for f in feeds)
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, f in enumerate(feeds):
            toks[b, : len(f)] = torch.tensor(f, device=dev)
        n_new = torch.tensor([len(f) for f in feeds], device=dev)
        start_t = torch.tensor(starts, dtype=torch.long, device=dev)
        base = start_t + n_new  # [B] entries after the catch-up
        extra = self.lookahead + self.holdback
        n_tok = [kb + extra if d else 0 for kb, d in zip(ks, drafting)]
        self._reserve(max(max(starts) + T, int(base.max()) + max(n_tok)))
        logits = self.draft_model(toks, self.cache, start_t, logits_index=n_new - 1)[:, 0]

        # 2. draft in the draft vocabulary
        params = request.params

        def pick(logits, greedy):
            if greedy:
                return argmax(logits), None
            q = logits_to_probs(logits, params)
            return sample(q, request.generator), q

        def advance(t, i):
            return self.draft_model(t[:, None], self.cache, base + i)[:, 0]

        sub = DraftRequest(
            history,
            torch.tensor(n_tok, dtype=torch.long, device=dev),
            params,
            request.generator,
            p_min=request.p_min,
        )
        draft = draft_chain(sub, self.draft_model.config.vocab_size, logits, pick, advance)
        fed = torch.clamp(draft.n_draft, max=draft.forwards).tolist()
        drafted = draft.tokens.tolist()

        # 3. re-encode with the target's tokenizer at the last committed boundary
        props = []
        for b in range(B):
            d = drafted[b][: int(draft.n_draft[b])] if drafting[b] else []
            self.ids[b] = self.ids[b] + d[: fed[b]]  # fed drafts are in the cache
            for i, t in enumerate(d):
                if t in tok.stop_ids:
                    d = d[:i]
                    break
            text = _clean(tok.decode(d)) if d else ""
            if not text.startswith(held[b]):  # the draft reads the held-back text otherwise
                props.append([])
                continue
            text = text[len(held[b]) :]
            props.append(target_proposal(ttok, history[b], texts[b], text, ks[b]))
        self.cache.lens = torch.tensor([P + len(i) for i in self.ids], device=dev)
        kmax = max(1, max(ks))
        tokens = torch.zeros(B, kmax, dtype=torch.long, device=request.k.device)
        for b, p in enumerate(props):
            if p:
                tokens[b, : len(p)] = torch.tensor(p, device=tokens.device)
        n_draft = torch.tensor([len(p) for p in props], dtype=torch.long, device=tokens.device)
        return Draft(tokens, None, n_draft, draft.forwards + 1)  # + the catch-up forward
