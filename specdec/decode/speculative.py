"""The speculative decoding engine: rounds, and the bookkeeping around them.

One round (`SpeculativeDecoder.run_round`), for a batch of B sequences whose target cache
holds the committed history except the last emitted ("pending") token:

    1. the drafter proposes up to k tokens per sequence            (draft_s)
    2. ONE target forward over [pending, d_1 .. d_k] (T = k + 1)    (verify_s)
       returns p for every draft position and the bonus position
    3. the acceptance rule accepts a prefix n_b <= k per sequence and emits the
       recovered / bonus token; tokens emitted = d_1..d_n + [next]
    4. the target cache is rolled back logically (lens += n_b + 1: the slots after it
       hold rejected drafts and are overwritten next round); the drafter rolls back too.

It returns a `RoundResult`, which also carries the distribution-level acceptance of every
drafted position, alpha_i = sum_x min(p_i(x), q_i(x)) (`draft_alpha`). `generate` owns
everything else: the prefill, how many tokens each sequence may still draft, emission (a
stop token inside an accepted block ends the sequence there; `max_new_tokens` is never
exceeded), the k schedule and the statistics.
A tree round (`tree=TreeSpec(...)`, specdec.decode.tree_round) drafts a token tree per
sequence instead and returns the same result: everything else is shared (alpha_i is
recorded for chain rounds only: a tree's children are tried in turn against residual
distributions, so no single overlap per position describes them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.decode.acceptance import AcceptanceRule, make_rule
from specdec.decode.drafters import Drafter, DraftRequest, check_compatible
from specdec.decode.generation import GenerationResult, check_prompts, make_generator, prefill
from specdec.decode.rollback import rollback_lens
from specdec.decode.sampling import SamplingParams, logits_to_probs, next_token
from specdec.decode.schedules import ConstantSchedule, Schedule
from specdec.decode.stats import SpecStats
from specdec.decode.tree_round import TreeRound, TreeSpec
from specdec.kernels.argmax import argmax
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.transformer import KVCache, Transformer


@dataclass
class DecodeState:
    """A batch in flight: what a round reads and the bookkeeping updates."""

    cache: KVCache  # the target's; lens = committed tokens per sequence
    verify: Callable[..., torch.Tensor]  # the target forward (or its CUDA-graph replay)
    history: list[list[int]]  # per sequence: prompt + emitted tokens (the last is pending)
    pending: torch.Tensor  # [B] int64: the last emitted token, not yet in the cache
    active: list[bool]  # sequences still generating
    params: SamplingParams
    generator: torch.Generator | None
    # the drafter's `target_features` of the tokens committed since its last request
    features: torch.Tensor | None = None  # [B, T, n, dim]
    n_features: torch.Tensor | None = None  # [B]


@dataclass
class RoundResult:
    """One verified round: sequence b emits draft_tokens[b, :n_accepted[b]], then
    next_token[b] (before stop tokens and the token budget are applied)."""

    draft_tokens: torch.Tensor  # [B, T - 1] int64, the verified drafts
    n_draft: torch.Tensor  # [B] int64: valid drafts
    n_accepted: torch.Tensor  # [B] int64: accepted drafts, <= n_draft
    next_token: torch.Tensor  # [B] int64: the recovered / bonus token
    # sum_x min(p_i(x), q_i(x)) per drafted position, 0 past n_draft (`draft_alpha`);
    # None for tree rounds
    alpha: torch.Tensor | None = None  # [B, T - 1] fp32


class SpeculativeDecoder:
    def __init__(
        self,
        target: Transformer,
        drafter: Drafter,
        accept: str | AcceptanceRule = "greedy",
        accept_params: dict | None = None,
        schedule: Schedule | None = None,
        cuda_graphs: bool | None = None,
        tree: TreeSpec | None = None,
    ):
        """accept: a rule, or a registered rule's name built with `accept_params`.
        cuda_graphs: replay the verification and drafter steps from CUDA graphs (None: on
        for a model on CUDA; see specdec.models.cuda_graphs).
        tree: draft token trees (the schedule's k is their depth) instead of chains."""
        if isinstance(accept, AcceptanceRule):
            if accept_params:
                raise ValueError("accept_params go with a rule name, not a built rule")
            self.rule = accept
        else:
            self.rule = make_rule(accept, **(accept_params or {}))
        self.target = target
        self.drafter = drafter
        self.schedule = schedule or ConstantSchedule(k=4)
        self.cuda_graphs = cuda_graphs
        draft_model = getattr(drafter, "model", None)
        if draft_model is not None and draft_model is not target:
            check_compatible(target, draft_model)
        self.tree = None if tree is None else TreeRound(tree, target, drafter, self.rule)

    def _max_len(self, prompts, max_new_tokens) -> int:
        sched = self.schedule
        slack = sched.max_k + 1 if self.tree is None else self.tree.spec.slack(sched.max_k)
        return check_prompts(self.target, prompts, max_new_tokens, slack=slack)

    # the caches as generate makes them (inference tensors: dynamo guards on that)
    @torch.inference_mode()
    def warm_up(self, batch: int, prompt_len: int, max_new_tokens: int) -> int:
        """Compile (cpu_compile) or capture (CUDA graphs) every fixed-shape step that
        `generate` on `batch` prompts of up to `prompt_len` tokens will run: verifications of
        1..max_k + 1 tokens (a round drafts fewer near the token budget or when the drafter
        has fewer), and the drafter's one-token step -> the number of steps warmed (0 with
        the eager path). The static caches are sized for such prompts, so later batches up to
        that size reuse them and their steps. Trees, and drafters reading the target's
        features, verify with the eager forward: nothing to warm there."""
        target = self.target
        if not resolve_cuda_graphs(target, self.cuda_graphs):
            return 0
        max_len = self._max_len([[0] * prompt_len] * batch, max_new_tokens)
        graphs = graphs_for(target)
        cache = graphs.cache("target", batch, max_len)
        if self.tree is not None:
            return 0
        n = 0
        if not self.drafter.target_features:
            n += graphs.warm(cache, range(1, self.schedule.max_k + 2))
        return n + self.drafter.warm_up(
            target, cache, max_len, cuda_graphs=self.cuda_graphs, max_k=self.schedule.max_k
        )

    @contextmanager
    def _timed(self, stats: SpecStats, key: str):
        sync = self.target.device.type == "cuda"
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        yield
        if sync:
            torch.cuda.synchronize()
        stats.time[key] += time.perf_counter() - t

    def run_round(self, state: DecodeState, k: torch.Tensor, stats: SpecStats) -> RoundResult:
        """Draft -> verify -> accept -> roll back, for up to k[b] drafts per sequence [B]."""
        if self.tree is not None:
            return self.tree.run(state, k, stats, self._timed)
        request = DraftRequest(
            state.history,
            k,
            state.params,
            state.generator,
            p_min=self.schedule.p_min,
            features=state.features,
            n_features=state.n_features,
        )
        with self._timed(stats, "draft"):
            draft = self.drafter.propose(request)
        stats.draft_forwards += draft.forwards
        n_draft = torch.minimum(draft.n_draft, k)
        T = int(n_draft.max()) + 1
        drafts = draft.tokens[:, : T - 1]
        q = None if draft.probs is None else draft.probs[:, : T - 1]
        cache = state.cache
        with self._timed(stats, "verify"):
            tokens = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, T]
            feats = self.drafter.target_features
            if feats:
                logits, state.features = state.verify(
                    tokens, cache, cache.lens, hidden_layers=feats
                )
            else:
                logits = state.verify(tokens, cache, cache.lens)  # [B, T, V]
            n_acc, nxt, alpha = self._accept(logits, drafts, q, n_draft, state)
        stats.target_forwards += 1
        stats.record_verify(T)
        active = torch.tensor(state.active, device=n_acc.device)
        committed = torch.where(active, n_acc + 1, 0)
        cache.lens = rollback_lens(cache.lens, committed)
        if feats:
            state.n_features = committed
        self.drafter.commit(n_acc)
        return RoundResult(drafts, n_draft, n_acc, nxt, alpha)

    def _accept(self, logits, drafts, q, n_draft, state: DecodeState):
        rule, params = self.rule, state.params
        test_params = params
        if rule.lossy and params.greedy:
            # lossy tests look at the model's distribution even when decoding greedily
            test_params = SamplingParams(temperature=1.0)
        p = logits_to_probs(logits, test_params)
        alpha = draft_alpha(p, drafts, q, n_draft)
        res = rule(drafts, p, q if rule.uses_draft_probs else None, n_draft, state.generator)
        nxt = res.next_token
        if rule.lossy and params.greedy:  # the replacement token follows the decoding mode
            row = logits[torch.arange(logits.shape[0], device=logits.device), res.n_accepted]
            nxt = argmax(row)
        return res.n_accepted, nxt, alpha

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop_ids: set[int] | frozenset[int] = frozenset(),
        seed: int | None = None,
        on_tokens: Callable[[list[list[int]]], None] | None = None,
    ) -> GenerationResult:
        target, sched = self.target, self.schedule
        sched.current = sched.k
        if self.rule.greedy_only:
            params = SamplingParams()
        max_len = self._max_len(prompts, max_new_tokens)
        B, dev = len(prompts), target.device
        gen = make_generator(dev, seed)
        stats = SpecStats(B)
        graphs = graphs_for(target) if resolve_cuda_graphs(target, self.cuda_graphs) else None
        cache = (
            graphs.cache("target", B, max_len) if graphs else KVCache.for_model(target, B, max_len)
        )
        self.cache = cache  # kept after the run for inspection (tests, debugging)
        stream = getattr(target, "layer_stream", None)  # layer-streamed target: count bytes
        streamed = stream.bytes_streamed if stream is not None else 0

        feats = self.drafter.target_features
        t0 = time.perf_counter()
        with self._timed(stats, "prefill"):
            features = n_features = None
            if feats:
                logits, features = prefill(target, prompts, cache, hidden_layers=feats)
                n_features = cache.lens.clone()
            else:
                logits = prefill(target, prompts, cache)
            pending = next_token(logits, params, gen)  # [B]
        stats.target_forwards += 1
        first = pending.tolist()
        out = [[t] for t in first]
        state = DecodeState(
            cache,
            # CUDA graphs replay the logits-only forward: a drafter reading the target's
            # features verifies with the eager forward
            graphs.forward if graphs and not feats else target,
            [list(p) + [t] for p, t in zip(prompts, first)],
            pending,
            [not (t in stop_ids or max_new_tokens <= 1) for t in first],
            params,
            gen,
            features,
            n_features,
        )
        reasons = ["stop" if t in stop_ids else "length" for t in first]
        if on_tokens is not None:
            on_tokens([[t] for t in first])
        # rounds per draft source (prompt lookup / output cache / datastore) of the
        # drafters that count them, chains only
        sources0 = dict(getattr(self.drafter, "sources", None) or {})
        if self.tree is None:
            self.drafter.begin(target, cache, prompts, max_len, cuda_graphs=self.cuda_graphs)
        else:
            self.tree.begin(cache, B, max_len)

        while any(state.active):
            k = sched.next_k()
            budget = [
                min(k, max_new_tokens - len(o) - 1) if a else 0 for o, a in zip(out, state.active)
            ]
            k_t = torch.tensor(budget, dtype=torch.long, device=dev)
            act_t = torch.tensor(state.active, device=dev)
            res = self.run_round(state, k_t, stats)
            sched.update(res.n_accepted[act_t], res.n_draft[act_t])
            new = emit(state, res, out, reasons, stats, max_new_tokens, stop_ids)
            if on_tokens is not None:
                on_tokens(new)

        # drafters that learn across sequences index the outputs (timed: it is their work)
        self.drafter.finish([list(o) for o in out])
        elapsed = time.perf_counter() - t0
        generated = sum(len(o) for o in out)
        summary = stats.summary(elapsed, generated)
        summary.update(
            drafter=self.drafter.name,
            accept=self.rule.name,
            schedule=sched.name,
            k=sched.k,
            tree=None if self.tree is None else self.tree.spec.describe(),
            draft_sources=None
            if self.tree is not None or not sources0
            else {w: n - sources0.get(w, 0) for w, n in self.drafter.sources.items()},
        )
        if stream is not None:
            summary.update(stream.stats(streamed, generated))
        return GenerationResult(
            [list(p) for p in prompts], out, reasons, elapsed, stats.time["prefill"], summary
        )


def draft_alpha(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, n_draft: torch.Tensor
) -> torch.Tensor:
    """The distribution-level acceptance of each drafted position:
    alpha_i = sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i) -> [B, k] fp32, 0 past n_draft.

    p [B, >= k, V]: the target's probabilities as the rule sees them (after temperature /
    top-k / top-p; one-hot on the argmax when decoding greedily, except for the lossy
    rules, which test on the temperature-1 distribution then); drafts [B, k];
    q [B, k, V] the drafter's processed distributions, or None for a drafter without them
    (q one-hot on the draft: alpha_i = p_i(x_i)). Under lossless speculative sampling the
    draft at position i, once examined (every earlier draft accepted), is accepted with
    probability exactly alpha_i (Leviathan et al. 2023). Reads p and q only: no randomness.
    """
    k = drafts.shape[1]
    pd = p[:, :k]  # [B, k, V]
    if q is None:
        x = drafts.clamp(0, pd.shape[-1] - 1)  # padding past n_draft may hold any id
        alpha = pd.gather(-1, x[..., None]).squeeze(-1)
    else:
        alpha = torch.minimum(pd, q.to(pd.dtype)).sum(-1)
    valid = torch.arange(k, device=alpha.device) < n_draft.to(alpha.device)[:, None]
    return torch.where(valid, alpha, 0.0)


def emit(
    state: DecodeState,
    res: RoundResult,
    out: list[list[int]],
    reasons: list[str],
    stats: SpecStats,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int],
) -> list[list[int]]:
    """Append each active sequence's tokens of the round to `out` and its history, cut at
    a stop token or the budget; record the round in `stats` -> the tokens appended."""
    n_acc, nxt, n_draft = res.n_accepted.tolist(), res.next_token.tolist(), res.n_draft.tolist()
    drafts = res.draft_tokens.tolist()
    alpha = None if res.alpha is None else res.alpha.tolist()
    new: list[list[int]] = [[] for _ in out]
    for b, seq in enumerate(out):
        if not state.active[b]:
            continue
        for t in drafts[b][: n_acc[b]] + [nxt[b]]:
            new[b].append(t)
            if t in stop_ids:
                state.active[b], reasons[b] = False, "stop"
                break
            if len(seq) + len(new[b]) >= max_new_tokens:
                state.active[b] = False
                break
        seq.extend(new[b])
        state.history[b].extend(new[b])
        a = None if alpha is None else alpha[b][: n_draft[b]]
        stats.record(b, n_draft[b], n_acc[b], len(new[b]), a)
    state.pending = res.next_token
    return new
