"""The chunked CPU argmax (specdec.kernels.argmax) against numpy's argmax of the values in
float64: the first maximal index of every row, ties, infinities and NaN included, on
fresh random rows of vocabulary sizes that do and do not divide into whole chunks."""

import numpy as np
import pytest
import torch

from specdec.kernels import argmax as am


def reference(x: torch.Tensor) -> torch.Tensor:
    """numpy's argmax (first maximal index; NaN counts as the maximum, as in torch)."""
    a = x.detach().double().numpy()
    out = np.empty(a.shape[:-1], dtype=np.int64)
    flat, rows = out.reshape(-1), a.reshape(-1, a.shape[-1])
    for i, r in enumerate(rows):
        nan = np.flatnonzero(np.isnan(r))
        flat[i] = nan[0] if nan.size else int(np.argmax(r))
    return torch.from_numpy(out)


def check(x: torch.Tensor) -> None:
    got = am.argmax(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
    assert torch.equal(got, reference(x))


VOCABS = [4 * am.CHUNK, 49152, 151936, 5 * am.CHUNK + 1, 9 * am.CHUNK - 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("V", VOCABS)
def test_random_rows(dtype, V):
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(3, 5, V, generator=g) * 4).to(dtype)
    check(x)
    check(x[:, -1])  # a row per sequence: not contiguous across rows
    check(x[0])


@pytest.mark.parametrize("V", VOCABS)
def test_ties_pick_the_first(V):
    """Equal maxima in several chunks, inside one chunk, in the short last chunk only, at
    the last index: the first one wins."""
    g = torch.Generator().manual_seed(V + 1)
    x = torch.randn(8, V, generator=g)
    top = float(x.max()) + 1.0
    spots = [
        [V - 1],  # only the last index
        [V - 2, V - 1],  # the last chunk (short when V is no multiple of CHUNK)
        [3 * am.CHUNK + 7, am.CHUNK + 5, 2 * am.CHUNK],  # three chunks
        [am.CHUNK - 1, am.CHUNK],  # either side of a chunk boundary
        [17, 18, 19],  # one chunk
        [0, V - 1],
    ]
    for r, s in enumerate(spots):
        x[r, s] = top
    x[6] = float("-inf")  # no finite value: index 0
    x[7, int(torch.randint(V, (1,), generator=g))] = float("inf")
    check(x)
    check(x.to(torch.bfloat16))


def test_bf16_logits_have_ties_and_agree():
    """bfloat16 keeps 8 significant bits: over 151,936 values the maximum is often tied."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 151936, generator=g) * 2).to(torch.bfloat16)
    tied = (x == x.amax(-1, keepdim=True)).sum(-1)
    assert (tied > 1).any()  # the case under test occurs
    check(x)


def test_nan_rows_take_torchs_answer():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6 * am.CHUNK, generator=g)
    x[1, 5000] = float("nan")
    x[2, [100, 3000]] = float("nan")
    check(x)


def test_short_rows_integers_and_empty_batches():
    g = torch.Generator().manual_seed(5)
    check(torch.randn(4, 1000, generator=g))  # below 4 chunks: torch's argmax
    ints = torch.randint(0, 2**40, (3, 8 * am.CHUNK), generator=g)
    assert torch.equal(am.argmax(ints), ints.argmax(-1))  # not floating point: torch's
    assert am.argmax(torch.randn(0, 8 * am.CHUNK)).shape == (0,)
