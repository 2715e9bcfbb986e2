"""The cost model against Leviathan et al.'s Table 1 and its own limits."""

from __future__ import annotations

import pytest

from specdec.decode.cost_model import best_k, expected_tokens, predicted_speedup, streamed_step_s


@pytest.mark.parametrize("alpha,k,speedup", [(0.6, 2, 1.96), (0.8, 5, 3.69), (0.9, 10, 6.86)])
def test_leviathan_table_1(alpha, k, speedup):
    assert predicted_speedup(alpha, k, 0.0) == pytest.approx(speedup, abs=0.005)


def test_expected_tokens_limits():
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 8) == 9.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.8, 0, 0.3) == 1.0  # k = 0 is plain decoding


def test_best_k_grows_as_the_draft_gets_cheaper():
    ks = [best_k(0.8, c) for c in (0.5, 0.2, 0.05, 0.01, 0.001)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert best_k(0.3, 1.0) == 0  # a draft as slow as the target never pays
    assert best_k(0.9, 0.0, k_max=20) == 20  # free drafts: as many as allowed
    # a streamed 8B-class target: c ~ 0.02 at alpha 0.8 gives several-fold at k = 8
    assert predicted_speedup(0.8, 8, 0.02) > 3.5


def test_best_k_beats_the_bound_when_alpha_exceeds_c():
    for alpha, c in [(0.5, 0.1), (0.8, 0.3), (0.95, 0.05)]:
        k = best_k(alpha, c)
        assert predicted_speedup(alpha, k, c) >= (1 + alpha) / (1 + c)


def test_streamed_step():
    assert streamed_step_s(4e9, 50e9) == pytest.approx(0.08)
    assert streamed_step_s(4e9, 50e9, resident_s=0.002) == pytest.approx(0.082)
