"""Acceptance rules: given one round's drafts, which prefix to keep and what comes next.

A rule is an object built once with its parameters (validated then, never mid-run) and
called every round:

    rule(draft_tokens, p, q=None, n_draft=None, generator=None) -> AcceptResult

with draft_tokens [B, k] int64, p [B, k+1, V] target probabilities (after
`logits_to_probs`; row k is the bonus position), q [B, k, V] draft probabilities or None
(a drafter without probabilities, e.g. n-gram: q is then one-hot), n_draft [B] valid
drafts per sequence (default k). Sequence b emits draft_tokens[b, :n_accepted[b]] then
next_token[b].

    greedy       lossless for greedy decoding: accept while draft == argmax p
    speculative  lossless: min(1, p/q) acceptance, residual resampling, bonus token
    threshold    lossy: accept if p(x) >= tau * max p
    typical      lossy (Medusa): accept if p(x) > min(epsilon, delta * exp(-H(p)))

Rules declare what the engine needs to know about them as class attributes:

    lossy             the output is not distributed as the target's. The engine tests such
                      rules on the target's temperature-1 distribution when decoding greedily
                      and takes the replacement token from the decoding mode.
    uses_draft_probs  the rule reads q (otherwise the engine passes None).
    greedy_only       defined on argmaxes: decoding is greedy whatever the sampling says.

A new rule is one registered subclass (`@register_rule("name")`) plus a config file
naming it; `make_rule(name, **params)` builds it from its name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from specdec.decode.registry import Registry
from specdec.decode.sampling import sample
from specdec.errors import SpecDecError
from specdec.kernels.rejection_sampling import AcceptResult, rejection_sample


class AcceptanceError(SpecDecError, ValueError):
    """An unknown acceptance rule or a bad parameter of one."""


class AcceptanceRule(ABC):
    """Base class of the registered rules; `name` is set by `register_rule`."""

    name: ClassVar[str] = ""
    lossy: ClassVar[bool] = False
    uses_draft_probs: ClassVar[bool] = False
    greedy_only: ClassVar[bool] = False

    @abstractmethod
    def __call__(
        self,
        draft_tokens: torch.Tensor,
        p: torch.Tensor,
        q: torch.Tensor | None = None,
        n_draft: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> AcceptResult:
        """draft_tokens [B, k], p [B, k+1, V], q [B, k, V] or None, n_draft [B] or None."""

    def params(self) -> dict:
        """The parameters the rule was built with (for summaries and repr)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


RULES: Registry[type[AcceptanceRule]] = Registry("acceptance rule", AcceptanceError)
register_rule = RULES.register  # class decorator: @register_rule("name")


def make_rule(name: str, **params) -> AcceptanceRule:
    """The rule registered as `name`, built with `params` (AcceptanceError if unknown)."""
    cls = RULES.lookup(name)
    RULES.check_options(cls, params)
    return cls(**params)


def check_probability(rule: str, key: str, value: float) -> float:
    """value as a float in (0, 1] (nan and infinities included in what is refused)."""
    v = float(value)
    if not 0.0 < v <= 1.0:  # nan fails every comparison
        raise AcceptanceError(f"{rule} acceptance needs {key} in (0, 1], got {value}")
    return v


@register_rule("greedy")
class GreedyAcceptance(AcceptanceRule):
    """Accept while draft == argmax p; next = argmax p at the first mismatch / bonus row."""

    greedy_only = True

    def __call__(self, draft_tokens, p, q=None, n_draft=None, generator=None):
        return rejection_sample(draft_tokens, p, q, n_draft, greedy=True)


@register_rule("speculative")
class SpeculativeAcceptance(AcceptanceRule):
    """Speculative sampling (Leviathan et al. 2023): the output is distributed as p."""

    uses_draft_probs = True

    def __call__(self, draft_tokens, p, q=None, n_draft=None, generator=None):
        return rejection_sample(draft_tokens, p, q, n_draft, greedy=False, generator=generator)


class PrefixAcceptance(AcceptanceRule):
    """Lossy rules that test each draft on its own: accept the leading run of `accepts`
    among the valid drafts; the next token is sampled from p at the row after it."""

    lossy = True

    @abstractmethod
    def accepts(self, draft_p: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """draft_p [B, k] = p(draft), p [B, k, V] the draft rows -> [B, k] bool."""

    def __call__(self, draft_tokens, p, q=None, n_draft=None, generator=None):
        B, k = draft_tokens.shape
        V = p.shape[-1]
        x = draft_tokens.clamp(0, V - 1)  # padding past n_draft may hold any id
        draft_p = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        ok = self.accepts(draft_p, p[:, :k])
        if n_draft is not None:
            ok = ok & (torch.arange(k, device=ok.device) < n_draft.to(ok.device)[:, None])
        n_accepted = ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
        rows = p[torch.arange(B, device=p.device), n_accepted]  # [B, V]
        return AcceptResult(n_accepted, sample(rows, generator))


@register_rule("threshold")
class ThresholdAcceptance(PrefixAcceptance):
    """Lossy: accept x if p(x) >= tau * max p (tau = 1: only the argmax, tau -> 0: all)."""

    def __init__(self, tau: float = 0.3):
        self.tau = check_probability("threshold", "tau", tau)

    def params(self) -> dict:
        return {"tau": self.tau}

    def accepts(self, draft_p, p):
        return draft_p >= self.tau * p.amax(dim=-1)


@register_rule("typical")
class TypicalAcceptance(PrefixAcceptance):
    """Lossy typical acceptance (Medusa, Cai et al. 2024): accept x if
    p(x) > min(epsilon, delta * exp(-H(p))), H the natural-log entropy of p.

    Defaults are Medusa's: posterior_threshold (epsilon) = 0.09 and posterior_alpha
    (delta) = 0.3; delta=None means sqrt(epsilon), Medusa's pairing of the two. H is exact
    here (0 log 0 = 0); Medusa's code uses log(p + 1e-5). With a one-hot (greedy) p this
    accepts only the argmax.
    """

    def __init__(self, epsilon: float = 0.09, delta: float | None = None):
        self.epsilon = check_probability("typical", "epsilon", epsilon)
        self.delta = math.sqrt(self.epsilon) if delta is None else float(delta)
        if not self.delta > 0.0:  # nan included
            raise AcceptanceError(f"typical acceptance needs delta > 0, got {delta}")

    def params(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta}

    def accepts(self, draft_p, p):
        pk = p.float()
        entropy = -torch.special.xlogy(pk, pk).sum(dim=-1)  # [B, k]
        return draft_p > torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
