"""The speculative decoding loop.

One round, for a batch of B sequences whose target cache holds the committed history
except the last emitted ("pending") token:

    1. the drafter proposes up to k tokens per sequence            (draft_s)
    2. ONE target forward over [pending, d_1 .. d_k] (T = k + 1)    (verify_s)
       returns p for every draft position and the bonus position
    3. the acceptance rule accepts a prefix n_b <= k per sequence and emits the
       recovered / bonus token; tokens emitted = d_1..d_n + [next]
    4. the target cache is rolled back logically (lens += n_b + 1: the slots after it
       hold rejected drafts and are overwritten next round); the drafter rolls back too.

`max_new_tokens` is never exceeded (k is clipped to the remaining budget) and a stop
token inside an accepted block ends the sequence there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from specdec.decode.acceptance import ACCEPTANCE_RULES, make_rule
from specdec.decode.drafters import Drafter
from specdec.decode.generation import GenerationResult, check_prompts, make_generator, prefill
from specdec.decode.rollback import rollback_lens
from specdec.decode.sampling import SamplingParams, logits_to_probs, next_token
from specdec.decode.schedules import ConstantSchedule, Schedule
from specdec.decode.stats import SpecStats
from specdec.errors import SpecDecError
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.transformer import KVCache, Transformer

LOSSY_RULES = ("threshold", "typical")


class SpeculativeDecoder:
    def __init__(
        self,
        target: Transformer,
        drafter: Drafter,
        accept: str = "greedy",
        accept_params: dict | None = None,
        schedule: Schedule | None = None,
        cuda_graphs: bool | None = None,
    ):
        """cuda_graphs: replay the verification and drafter steps from CUDA graphs (None: on
        for a model on CUDA; see specdec.models.cuda_graphs)."""
        if accept not in ACCEPTANCE_RULES:
            raise SpecDecError(
                f"unknown acceptance rule {accept!r} (choose one of {', '.join(ACCEPTANCE_RULES)})"
            )
        self.target = target
        self.drafter = drafter
        self.accept = accept
        self.accept_params = dict(accept_params or {})
        try:
            self.rule = make_rule(accept, **self.accept_params)
            if accept in LOSSY_RULES:  # validate the parameters now, not mid-run
                self.rule(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 2, 2), 0.5))
        except ValueError as e:
            raise SpecDecError(str(e)) from e
        self.schedule = schedule or ConstantSchedule(k=4)
        self.cuda_graphs = cuda_graphs
        draft_model = getattr(drafter, "model", None)
        if draft_model is not None and draft_model is not target:
            check_compatible(target, draft_model)

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
        if self.accept == "greedy":
            params = SamplingParams()  # greedy acceptance is defined on argmaxes
        max_len = check_prompts(target, prompts, max_new_tokens, slack=sched.max_k + 1)
        B, dev = len(prompts), target.device
        gen = make_generator(dev, seed)
        stats = SpecStats(B)
        graphs = graphs_for(target) if resolve_cuda_graphs(target, self.cuda_graphs) else None
        cache = (
            graphs.cache("target", B, max_len) if graphs else KVCache.for_model(target, B, max_len)
        )
        verify = graphs.forward if graphs else target
        self.cache = cache  # kept after the run for inspection (tests, debugging)
        stream = getattr(target, "layer_stream", None)  # layer-streamed target: count bytes
        streamed = stream.bytes_streamed if stream is not None else 0

        t0 = time.perf_counter()
        with self._timed(stats, "prefill"):
            logits = prefill(target, prompts, cache)
            pending = next_token(logits, params, gen)  # [B]
        stats.target_forwards += 1
        first = pending.tolist()
        out = [[t] for t in first]
        history = [list(p) + [t] for p, t in zip(prompts, first)]
        active = [not (t in stop_ids or max_new_tokens <= 1) for t in first]
        reasons = ["stop" if t in stop_ids else "length" for t in first]
        if on_tokens is not None:
            on_tokens([[t] for t in first])
        self.drafter.begin(target, cache, prompts, max_len, cuda_graphs=self.cuda_graphs)

        while any(active):
            k = sched.next_k()
            budget = [min(k, max_new_tokens - len(o) - 1) if a else 0 for o, a in zip(out, active)]
            k_t = torch.tensor(budget, dtype=torch.long, device=dev)
            with self._timed(stats, "draft"):
                draft = self.drafter.propose(history, k_t, params, gen, sched.p_min)
            stats.draft_forwards += draft.forwards
            n_draft = torch.minimum(draft.n_draft, k_t)
            T = int(n_draft.max()) + 1
            drafts = draft.tokens[:, : T - 1]
            with self._timed(stats, "verify"):
                tokens = torch.cat([pending[:, None], drafts], dim=1)  # [B, T]
                logits = verify(tokens, cache, cache.lens)  # [B, T, V]
                n_acc, nxt = self._accept(logits, drafts, draft, n_draft, params, gen, T)
            stats.target_forwards += 1

            act_t = torch.tensor(active, device=dev)
            cache.lens = rollback_lens(cache.lens, torch.where(act_t, n_acc + 1, 0))
            self.drafter.commit(n_acc)
            sched.update(n_acc[act_t], n_draft[act_t])

            n_acc_l, nxt_l, nd_l = n_acc.tolist(), nxt.tolist(), n_draft.tolist()
            drafts_l = drafts.tolist()
            new: list[list[int]] = [[] for _ in range(B)]
            for b in range(B):
                if not active[b]:
                    continue
                emitted = drafts_l[b][: n_acc_l[b]] + [nxt_l[b]]
                for t in emitted:
                    new[b].append(t)
                    if t in stop_ids:
                        active[b], reasons[b] = False, "stop"
                        break
                    if len(out[b]) + len(new[b]) >= max_new_tokens:
                        active[b] = False
                        break
                out[b].extend(new[b])
                history[b].extend(new[b])
                stats.record(b, nd_l[b], n_acc_l[b], len(new[b]))
            pending = nxt
            if on_tokens is not None:
                on_tokens(new)

        elapsed = time.perf_counter() - t0
        generated = sum(len(o) for o in out)
        summary = stats.summary(elapsed, generated)
        summary.update(
            drafter=self.drafter.name,
            accept=self.accept,
            schedule=sched.name,
            k=sched.k,
        )
        if stream is not None:
            summary.update(stream.stats(streamed, generated))
        return GenerationResult(
            [list(p) for p in prompts], out, reasons, elapsed, stats.time["prefill"], summary
        )

    def _accept(self, logits, drafts, draft, n_draft, params, gen, T):
        if self.accept in LOSSY_RULES:
            # lossy tests look at the model's distribution even when decoding greedily
            test_params = params if not params.greedy else SamplingParams(temperature=1.0)
            p = logits_to_probs(logits, test_params)
            res = self.rule(drafts, p, None, n_draft, gen)
            n_acc, nxt = res.n_accepted, res.next_token
            if params.greedy:  # the replacement token follows the decoding mode
                row = logits[torch.arange(logits.shape[0], device=logits.device), n_acc]
                nxt = row.argmax(-1)
            return n_acc, nxt
        p = logits_to_probs(logits, params)
        q = None if draft.probs is None else draft.probs[:, : T - 1]
        res = self.rule(drafts, p, q, n_draft, gen)
        return res.n_accepted, res.next_token


def check_compatible(target: Transformer, draft: Transformer) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecDecError(
            f"vocabulary mismatch: draft model has {draft.config.vocab_size} tokens, "
            f"target has {target.config.vocab_size}; the drafter must share the target's tokenizer"
        )
    if draft.device != target.device:
        raise SpecDecError(f"draft model on {draft.device} but target on {target.device}")
    if draft.dtype != target.dtype:
        raise SpecDecError(f"draft model dtype {draft.dtype} != target dtype {target.dtype}")
