"""Rejection-sampling kernels (Triton; interpreter on CPU) against the torch reference.

Both consume the same uniforms and race weights, so n_accepted and next_token must be
identical, not just close. Outputs are poisoned first so an unwritten slot shows up.
"""

import pytest
import torch

from specdec.errors import BackendError
from specdec.kernels import rejection_sampling as rs

POISON = -7


def make_case(B: int, k: int, V: int, seed: int):
    """Random p, q (softmax of randn over V), drafts from q, n_draft in 0..k, noise."""
    g = torch.Generator().manual_seed(seed)
    q_logits = torch.randn(B, k, V, generator=g)
    # p near q on the draft rows so acceptance runs vary in length; an unrelated bonus row
    p_logits = q_logits + torch.randn(B, k, V, generator=g)
    p_logits = torch.cat([p_logits, torch.randn(B, 1, V, generator=g)], 1)
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    drafts = torch.zeros(B, 0, dtype=torch.int64)
    if k:
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    n_draft = torch.randint(0, k + 1, (B,), generator=g)
    uniforms, race = rs.draw_acceptance_noise(B, k, V, "cpu", g)
    return drafts, p, q, n_draft, uniforms, race


def greedy_drafts(p: torch.Tensor, seed: int) -> torch.Tensor:
    """argmax of each draft row, with one random position per sequence corrupted (or none)."""
    g = torch.Generator().manual_seed(seed)
    B, k1, V = p.shape
    drafts = p[:, : k1 - 1].argmax(-1)
    bad = torch.randint(0, k1, (B,), generator=g)  # == k: no corruption
    for b in range(B):
        if bad[b] < k1 - 1:
            drafts[b, bad[b]] = (drafts[b, bad[b]] + 1) % V
    return drafts


def run_triton(*args, **kwargs) -> rs.AcceptResult:
    B = args[0].shape[0]
    out = rs.AcceptResult(torch.full((B,), POISON), torch.full((B,), POISON))
    res = rs.rejection_sample_triton(*args, out=out, **kwargs)
    assert res.n_accepted is out.n_accepted
    return res


def assert_same(got: rs.AcceptResult, want: rs.AcceptResult, n_draft: torch.Tensor) -> None:
    assert (got.n_accepted != POISON).all() and (got.next_token != POISON).all()
    assert torch.equal(got.n_accepted, want.n_accepted)
    assert torch.equal(got.next_token, want.next_token)
    assert (want.n_accepted <= n_draft).all()


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("V, block_v", [(37, 16), (1000, 256), (1000, None)])
@pytest.mark.parametrize("has_q", [True, False])
def test_stochastic_matches_reference(k, V, block_v, has_q):
    drafts, p, q, n_draft, u, race = make_case(6, k, V, seed=k * 1000 + V)
    q = q if has_q else None
    want = rs.rejection_sample_reference(
        drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race
    )
    got = run_triton(
        drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race, block_v=block_v
    )
    assert_same(got, want, n_draft)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("V, block_v", [(37, 16), (1000, 256)])
def test_greedy_matches_reference(k, V, block_v):
    _, p, _, n_draft, _, _ = make_case(6, k, V, seed=k + V)
    drafts = greedy_drafts(p, seed=k)
    want = rs.rejection_sample_reference(drafts, p, None, n_draft, greedy=True)
    got = run_triton(drafts, p, None, n_draft, greedy=True, block_v=block_v)
    assert_same(got, want, n_draft)
    assert want.n_accepted.sum() > 0  # the case exercises acceptance, not only rejection


def test_full_acceptance_takes_bonus_row():
    """p == q on the draft rows: every valid draft is accepted, next token from p[n_draft]."""
    drafts, p, q, n_draft, u, race = make_case(6, 4, 37, seed=3)
    p = torch.cat([q, p[:, -1:]], 1)
    want = rs.rejection_sample_reference(
        drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race
    )
    got = run_triton(drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race)
    assert_same(got, want, n_draft)
    assert torch.equal(got.n_accepted, n_draft)
    bonus = (p[torch.arange(6), n_draft] * race).argmax(-1)
    assert torch.equal(got.next_token, bonus)


def test_zero_residual_falls_back_to_p():
    """q = 2p: acceptance probability 1/2 and max(p - q, 0) == 0, so resample from p."""
    drafts, p, _, _, u, race = make_case(8, 2, 37, seed=5)
    q = 2 * p[:, :2]
    n_draft = torch.full((8,), 2)
    want = rs.rejection_sample_reference(
        drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race
    )
    got = run_triton(drafts, p, q, n_draft, greedy=False, uniforms=u, race_weights=race)
    assert_same(got, want, n_draft)
    rows = p[torch.arange(8), want.n_accepted]
    assert torch.equal(want.next_token, (rows * race).argmax(-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_no_drafts(greedy):
    """k = 0 is plain decoding: the next token comes from p[:, 0]."""
    _, p, _, _, u, race = make_case(3, 0, 37, seed=0)
    drafts = torch.zeros(3, 0, dtype=torch.int64)
    kwargs = {} if greedy else dict(uniforms=u, race_weights=race)
    want = rs.rejection_sample_reference(drafts, p, None, greedy=greedy, **kwargs)
    got = run_triton(drafts, p, None, greedy=greedy, **kwargs)
    assert_same(got, want, torch.zeros(3, dtype=torch.int64))
    expect = p[:, 0].argmax(-1) if greedy else (p[:, 0] * race).argmax(-1)
    assert torch.equal(want.next_token, expect)


@pytest.mark.parametrize("greedy", [True, False])
def test_public_entry_backends_agree(greedy):
    drafts, p, q, n_draft, _, _ = make_case(4, 3, 37, seed=11)
    results = [
        rs.rejection_sample(
            drafts,
            p,
            q,
            n_draft,
            greedy=greedy,
            generator=torch.Generator().manual_seed(0),
            backend=backend,
        )
        for backend in ("torch", "triton")
    ]
    assert_same(results[1], results[0], n_draft)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    drafts, p, q, *_ = make_case(2, 2, 37, seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        rs.rejection_sample(drafts, p, q, greedy=True, backend="triton")
    with pytest.raises(BackendError, match="unknown kernel backend"):
        rs.rejection_sample(drafts, p, q, greedy=True, backend="cuda")


def test_shape_errors():
    drafts, p, q, *_ = make_case(2, 3, 37, seed=0)
    with pytest.raises(ValueError, match="p must be"):
        rs.rejection_sample(drafts, p[:, :3], q, greedy=True, backend="torch")
    with pytest.raises(ValueError, match="q must be"):
        rs.rejection_sample(drafts, p, q[:, :2], greedy=False, backend="torch")
    with pytest.raises(ValueError, match="n_draft must be"):
        rs.rejection_sample(drafts, p, q, torch.tensor([1]), greedy=True, backend="torch")
    u, race = rs.draw_acceptance_noise(2, 2, 37, "cpu")
    with pytest.raises(ValueError, match="uniforms must be"):
        rs.rejection_sample_reference(drafts, p, q, greedy=False, uniforms=u, race_weights=race)
