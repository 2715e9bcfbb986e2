"""Acceptance rules (torch backend): lossless rules keep the target distribution, lossy
rules follow their formulas.

Statistical tests use a synthetic round where the target rows do not depend on the
prefix: p[j] is the target distribution of the j-th emitted token whatever came before,
so among sequences that accepted at least j drafts, emitted token j must follow p[j]
(j = k is the bonus token). Seeds are fixed; the chi-square p-value threshold is 1e-3.
"""

import pytest
import torch
from scipy.stats import chisquare

from specdec.decode.acceptance import RULES, make_rule
from specdec.kernels.utils import set_backend

N_SAMPLES = 20_000


@pytest.fixture(autouse=True)
def torch_backend():
    set_backend("torch")
    yield
    set_backend(None)


def synthetic_round(k: int, V: int, seed: int, n: int = N_SAMPLES):
    """One [k+1, V] target and [k, V] draft distribution shared by n sequences; drafts ~ q
    (q a noisy copy of p, so later positions are reached often enough to test)."""
    g = torch.Generator().manual_seed(seed)
    p_logits = 1.5 * torch.randn(k + 1, V, generator=g)
    q_logits = p_logits[:k] + torch.randn(k, V, generator=g)
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    drafts = torch.stack(
        [torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1
    )
    return p, q, drafts, g


def emitted_at(j: int, drafts: torch.Tensor, res) -> torch.Tensor:
    """Token j emitted this round, for the sequences that emitted one (n_accepted >= j)."""
    draft_j = drafts[:, min(j, drafts.shape[1] - 1)]  # j == k: always the bonus token
    tok = torch.where(res.n_accepted > j, draft_j, res.next_token)
    return tok[res.n_accepted >= j]


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    assert counts.sum() >= 500, "too few samples for a meaningful test"
    pvalue = chisquare(counts.numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3, f"emitted tokens do not follow p (p-value {pvalue:.2e})"


@pytest.mark.parametrize("use_q", [True, False])
@pytest.mark.parametrize("k, n_valid", [(1, None), (3, None), (3, 1)])
def test_speculative_is_lossless(use_q, k, n_valid):
    V = 7
    p, q, drafts, g = synthetic_round(k, V, seed=10 * k + (n_valid or 0))
    n = drafts.shape[0]
    n_draft = None if n_valid is None else torch.full((n,), n_valid)
    rule = make_rule("speculative")
    res = rule(drafts, p.expand(n, -1, -1), q.expand(n, -1, -1) if use_q else None, n_draft, g)
    last = k if n_valid is None else n_valid  # the bonus position
    assert (res.n_accepted <= last).all()
    for j in range(last + 1):
        assert_follows(emitted_at(j, drafts, res), p[j])


@pytest.mark.parametrize("use_q", [True, False])
def test_speculative_acceptance_rate(use_q):
    """P(first draft accepted) = sum_x min(p, q) with q; E_{x~q}[p(x)] without q."""
    V = 6
    p, q, drafts, g = synthetic_round(2, V, seed=3)
    n = drafts.shape[0]
    res = make_rule("speculative")(
        drafts, p.expand(n, -1, -1), q.expand(n, -1, -1) if use_q else None, None, g
    )
    alpha = torch.minimum(p[0], q[0]).sum() if use_q else (p[0] * q[0]).sum()
    measured = (res.n_accepted >= 1).double().mean()
    sigma = (alpha * (1 - alpha) / n).sqrt()
    assert abs(measured - alpha) < 4 * sigma, (measured.item(), alpha.item())


def one_hot(idx: torch.Tensor, V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, V).float()


def greedy_case(B: int, k: int, V: int, seed: int):
    """Soft p; drafts equal to the argmax with one random position corrupted (or none)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=g), -1)
    drafts = p[:, :k].argmax(-1)
    bad = torch.randint(0, k + 1, (B,), generator=g)
    rows = torch.arange(B)[bad < k]
    drafts[rows, bad[bad < k]] = (drafts[rows, bad[bad < k]] + 1) % V
    n_draft = torch.randint(0, k + 1, (B,), generator=g)
    return p, drafts, n_draft, g


def test_greedy_matches_loop():
    p, drafts, n_draft, _ = greedy_case(64, 4, 11, seed=0)
    res = make_rule("greedy")(drafts, p, None, n_draft)
    for b in range(64):
        n = 0
        while n < n_draft[b] and drafts[b, n] == p[b, n].argmax():
            n += 1
        assert res.n_accepted[b] == n
        assert res.next_token[b] == p[b, n].argmax()


def test_speculative_with_greedy_target_equals_greedy():
    p, drafts, n_draft, g = greedy_case(64, 4, 11, seed=1)
    p = one_hot(p.argmax(-1), 11)
    q = torch.softmax(torch.randn(64, 4, 11, generator=g), -1)
    want = make_rule("greedy")(drafts, p, q, n_draft)
    for draft_probs in (q, None):
        got = make_rule("speculative")(drafts, p, draft_probs, n_draft, g)
        assert torch.equal(got.n_accepted, want.n_accepted)
        assert torch.equal(got.next_token, want.next_token)


def test_threshold_extremes():
    p, drafts, n_draft, g = greedy_case(64, 4, 11, seed=2)
    drafts = torch.randint(0, 11, drafts.shape, generator=g)
    everything = make_rule("threshold", tau=1e-9)(drafts, p, None, n_draft, g)
    assert torch.equal(everything.n_accepted, n_draft)
    only_argmax = make_rule("threshold", tau=1.0)(drafts, p, None, n_draft, g)
    greedy = make_rule("greedy")(drafts, p, None, n_draft)
    assert torch.equal(only_argmax.n_accepted, greedy.n_accepted)
    # the next token is drawn from p at the row after the accepted prefix
    hot = one_hot(p.argmax(-1), 11)
    res = make_rule("threshold", tau=0.5)(drafts, hot, None, n_draft, g)
    assert torch.equal(res.next_token, hot[torch.arange(64), res.n_accepted].argmax(-1))


def test_threshold_formula():
    p, drafts, n_draft, g = greedy_case(256, 4, 11, seed=3)
    drafts = torch.randint(0, 11, drafts.shape, generator=g)
    tau = 0.4
    res = make_rule("threshold", tau=tau)(drafts, p, None, n_draft, g)
    for b in range(256):
        n = 0
        while n < n_draft[b] and p[b, n, drafts[b, n]] >= tau * p[b, n].max():
            n += 1
        assert res.n_accepted[b] == n
    assert 0 < res.n_accepted.sum() < n_draft.sum()


@pytest.mark.parametrize("tau", [0.0, -0.5, 1.5])
def test_threshold_rejects_bad_tau(tau):
    p, drafts, _, _ = greedy_case(2, 2, 5, seed=0)
    with pytest.raises(ValueError, match="tau in \\(0, 1\\]"):
        make_rule("threshold", tau=tau)(drafts, p, None)


def test_typical_formula():
    """Medusa's rule computed directly, on targets from peaked to flat."""
    g = torch.Generator().manual_seed(4)
    B, k, V = 512, 4, 11
    temps = torch.rand(B, k + 1, 1, generator=g) * 4 + 0.1
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g) / temps, -1)
    drafts = torch.multinomial(p[:, :k].reshape(-1, V), 1, generator=g).view(B, k)
    n_draft = torch.randint(0, k + 1, (B,), generator=g)
    eps, delta = 0.09, 0.3
    res = make_rule("typical", epsilon=eps, delta=delta)(drafts, p, None, n_draft, g)
    default = make_rule("typical")(drafts, p, None, n_draft, g)
    assert torch.equal(res.n_accepted, default.n_accepted)
    for b in range(B):
        n = 0
        while n < n_draft[b]:
            row = p[b, n].double()
            entropy = -(row * row.log()).sum()
            if not row[drafts[b, n]] > min(eps, delta * torch.exp(-entropy).item()):
                break
            n += 1
        assert res.n_accepted[b] == n
    assert 0 < res.n_accepted.sum() < n_draft.sum()


def test_typical_with_greedy_target_is_greedy():
    p, drafts, n_draft, g = greedy_case(64, 4, 11, seed=5)
    hot = one_hot(p.argmax(-1), 11)
    res = make_rule("typical")(drafts, hot, None, n_draft, g)
    want = make_rule("greedy")(drafts, hot, None, n_draft)
    assert torch.equal(res.n_accepted, want.n_accepted)
    assert torch.equal(res.next_token, want.next_token)


def test_typical_rejects_bad_params():
    p, drafts, _, _ = greedy_case(2, 2, 5, seed=0)
    with pytest.raises(ValueError, match="epsilon"):
        make_rule("typical", epsilon=0.0)(drafts, p, None)
    with pytest.raises(ValueError, match="delta"):
        make_rule("typical", delta=-1.0)(drafts, p, None)


def test_registry_and_make_rule_errors():
    assert {"greedy", "speculative", "threshold", "typical"} <= set(RULES)
    with pytest.raises(ValueError, match="unknown acceptance rule"):
        make_rule("nope")
    with pytest.raises(ValueError, match="no parameter"):
        make_rule("speculative", tau=0.5)
