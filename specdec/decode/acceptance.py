"""Acceptance rules: given one round's drafts, which prefix to keep and what comes next.

Every rule has one signature,

    rule(draft_tokens, p, q, n_draft=None, generator=None, **params) -> AcceptResult

with draft_tokens [B, k] int64, p [B, k+1, V] target probabilities (after
`logits_to_probs`; row k is the bonus position), q [B, k, V] draft probabilities or None
(a drafter without probabilities, e.g. n-gram), n_draft [B] valid drafts per sequence
(default k). Sequence b emits draft_tokens[b, :n_accepted[b]] then next_token[b].

    greedy       lossless for greedy decoding: accept while draft == argmax p
    speculative  lossless: min(1, p/q) acceptance, residual resampling, bonus token
    threshold    lossy: accept if p(x) >= tau * max p
    typical      lossy (Medusa): accept if p(x) > min(epsilon, delta * exp(-H(p)))

The lossy rules sample the next token from p at the first rejected position (or the
bonus row). A new rule is one function registered in ACCEPTANCE_RULES plus a config
naming it; `make_rule(name, **params)` binds the config's parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from specdec.decode.sampling import sample
from specdec.kernels.rejection_sampling import AcceptResult, rejection_sample

AcceptanceRule = Callable[..., AcceptResult]
ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {}


def register_rule(name: str) -> Callable[[AcceptanceRule], AcceptanceRule]:
    def register(fn: AcceptanceRule) -> AcceptanceRule:
        ACCEPTANCE_RULES[name] = fn
        return fn

    return register


def make_rule(name: str, **params) -> AcceptanceRule:
    """The rule called `name` with its parameters bound (unknown names raise ValueError)."""
    if name not in ACCEPTANCE_RULES:
        known = ", ".join(sorted(ACCEPTANCE_RULES))
        raise ValueError(f"unknown acceptance rule {name!r}; choose one of {known}")
    fn = ACCEPTANCE_RULES[name]
    allowed = [n for n, a in inspect.signature(fn).parameters.items() if a.kind is a.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"acceptance rule {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(allowed) or 'none'}"
        )
    return functools.partial(fn, **params)


@register_rule("greedy")
def accept_greedy(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None = None,
    n_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Accept while draft == argmax p; next = argmax p at the first mismatch / bonus row."""
    return rejection_sample(draft_tokens, p, q, n_draft, greedy=True)


@register_rule("speculative")
def accept_speculative(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None = None,
    n_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Speculative sampling (Leviathan et al. 2023): the output is distributed as p."""
    return rejection_sample(draft_tokens, p, q, n_draft, greedy=False, generator=generator)


def _accept_prefix(
    ok: torch.Tensor, p: torch.Tensor, n_draft: torch.Tensor | None, generator
) -> AcceptResult:
    """Accept the leading run of `ok` [B, k] among valid drafts; next token ~ p at that row."""
    B, k = ok.shape
    if n_draft is not None:
        ok = ok & (torch.arange(k, device=ok.device) < n_draft.to(ok.device)[:, None])
    n_accepted = ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    rows = p[torch.arange(B, device=p.device), n_accepted]  # [B, V]
    return AcceptResult(n_accepted, sample(rows, generator))


def _draft_probs(p: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """p[b, i, draft_tokens[b, i]] for i < k: [B, k] (padding tokens are clamped)."""
    k, V = draft_tokens.shape[1], p.shape[-1]
    x = draft_tokens.clamp(0, V - 1)
    return p[:, :k].gather(-1, x[..., None]).squeeze(-1)


@register_rule("threshold")
def accept_threshold(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None = None,
    n_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    tau: float = 0.3,
) -> AcceptResult:
    """Lossy: accept x if p(x) >= tau * max p (tau = 1: only the argmax, tau -> 0: all)."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"threshold acceptance needs tau in (0, 1], got {tau}")
    k = draft_tokens.shape[1]
    ok = _draft_probs(p, draft_tokens) >= tau * p[:, :k].amax(dim=-1)
    return _accept_prefix(ok, p, n_draft, generator)


@register_rule("typical")
def accept_typical(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None = None,
    n_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> AcceptResult:
    """Lossy typical acceptance (Medusa, Cai et al. 2024): accept x if
    p(x) > min(epsilon, delta * exp(-H(p))), H the natural-log entropy of p.

    Defaults are Medusa's: posterior_threshold (epsilon) = 0.09 and posterior_alpha
    (delta) = 0.3 = sqrt(epsilon). H is exact here (0 log 0 = 0); Medusa's code uses
    log(p + 1e-5). With a one-hot (greedy) p this accepts only the argmax.
    """
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"typical acceptance needs epsilon in (0, 1], got {epsilon}")
    if delta <= 0.0:
        raise ValueError(f"typical acceptance needs delta > 0, got {delta}")
    k = draft_tokens.shape[1]
    pk = p[:, :k].float()
    entropy = -torch.special.xlogy(pk, pk).sum(dim=-1)  # [B, k]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    ok = _draft_probs(p, draft_tokens) > threshold
    return _accept_prefix(ok, p, n_draft, generator)
