"""GGUF 5-bit and k-quant formats (quant.py): planes split from random blocks dequantize
exactly as `gguf.quants.dequantize`; row selection / concatenation keep every plane; the
GGUF loader keeps them packed and names the tensor and type of an unsupported one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import KQUANT_BLOCKS, from_gguf_kquant

gguf = pytest.importorskip("gguf")

# byte offsets of the fp16 fields of each block (random bytes there could be inf/nan)
FP16_FIELDS = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
FORMATS = sorted(KQUANT_BLOCKS)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/G * block_bytes]: random codes and sub-scales, random finite fp16 scales."""
    rng = np.random.default_rng(seed)
    bb, g = KQUANT_BLOCKS[fmt]
    blocks = rng.integers(0, 256, size=(n, k // g, bb), dtype=np.uint8)
    for off in FP16_FIELDS[fmt]:
        half = rng.uniform(-0.05, 0.05, size=(n, k // g)).astype(np.float16)
        blocks[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // g, 2)
    return blocks.reshape(n, -1)


def gguf_type(fmt: str):
    return getattr(gguf.GGMLQuantizationType, fmt.upper())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, blocks", [(1, 1), (7, 3), (33, 5)])
def test_dequantize_equals_gguf(fmt, n, blocks):
    k = blocks * KQUANT_BLOCKS[fmt][1]
    raw = random_blocks(fmt, n, k, seed=n * 100 + blocks)
    w = from_gguf_kquant(raw, fmt, (n, k))
    ref = gguf.quants.dequantize(raw, gguf_type(fmt)).reshape(n, k)
    got = w.dequantize(torch.float32).numpy()
    np.testing.assert_array_equal(got, ref)
    assert w.nbytes() == raw.nbytes  # kept packed: the planes hold exactly the block bytes


CLASSIC = {"q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32)}  # bytes, weights per block


@pytest.mark.parametrize("fmt", [*FORMATS, *CLASSIC])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_in_row_steps_equals_gguf(monkeypatch, fmt, dtype):
    """A weight larger than one step (DEQUANT_STEP, here 4 rows) is dequantized in row
    ranges into one buffer: the same numbers as gguf's dequantization of the whole tensor
    (rounded once to `dtype`), 13 rows in steps of 4, 4, 4, 1."""
    from specdec.kernels import quant

    n, k = 13, 2 * (KQUANT_BLOCKS.get(fmt) or CLASSIC[fmt])[1]
    if fmt in CLASSIC:
        bb, g = CLASSIC[fmt]
        rng = np.random.default_rng(7)
        raw = rng.integers(0, 256, size=(n, k // g, bb), dtype=np.uint8)
        for off in (0, 2) if fmt == "q4_1" else (0,):
            half = rng.uniform(-0.05, 0.05, size=(n, k // g)).astype(np.float16)
            raw[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // g, 2)
        raw = raw.reshape(n, -1)
        w = quant.from_gguf_blocks(raw, fmt, (n, k))
    else:
        raw = random_blocks(fmt, n, k, seed=13)
        w = from_gguf_kquant(raw, fmt, (n, k))
    monkeypatch.setitem(quant.DEQUANT_STEP, "cpu", 4 * k)
    assert w.row_steps() == [(0, 4), (4, 8), (8, 12), (12, 13)]
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf_type(fmt)).reshape(n, k))
    got = w.dequantize(dtype)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, ref.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_select_and_cat_rows_keep_every_plane(fmt):
    g = KQUANT_BLOCKS[fmt][1]
    a = from_gguf_kquant(random_blocks(fmt, 6, 2 * g, 1), fmt, (6, 2 * g))
    b = from_gguf_kquant(random_blocks(fmt, 3, 2 * g, 2), fmt, (3, 2 * g))
    dense = torch.cat([a.dequantize(), b.dequantize()])
    both = type(a).cat_rows([a, b])
    torch.testing.assert_close(both.dequantize(), dense, rtol=0, atol=0)
    idx = torch.tensor([8, 0, 5, 5, 2])
    torch.testing.assert_close(both.select_rows(idx).dequantize(), dense[idx], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_row_length_is_rejected(fmt):
    g = KQUANT_BLOCKS[fmt][1]
    with pytest.raises(ValueError, match="multiple of"):
        from_gguf_kquant(np.zeros((2, KQUANT_BLOCKS[fmt][0]), np.uint8), fmt, (2, g + 16))


def _gguf_with(path, tensors: dict[str, tuple[np.ndarray, object]]):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qt) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_keeps_kquant_tensors_packed(tmp_path, fmt):
    from specdec.models.gguf_loader import gguf_tensor

    n, k = 5, 2 * KQUANT_BLOCKS[fmt][1]
    raw = random_blocks(fmt, n, k, 3)
    reader = _gguf_with(tmp_path / "t.gguf", {"w": (raw, gguf_type(fmt))})
    w = gguf_tensor(reader.tensors[0], tmp_path / "t.gguf")
    assert (w.fmt, w.shape) == (fmt, (n, k))
    ref = gguf.quants.dequantize(raw, gguf_type(fmt)).reshape(n, k)
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)


def test_unsupported_type_names_the_tensor_and_type(tmp_path):
    from specdec.models.gguf_loader import gguf_tensor

    raw = np.random.default_rng(0).integers(0, 256, size=(4, 84), dtype=np.uint8)  # Q2_K
    reader = _gguf_with(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (raw, gguf_type("q2_k"))})
    with pytest.raises(SpecDecError, match=r"tensor blk\.0\.ffn_up\.weight .*type Q2_K") as e:
        gguf_tensor(reader.tensors[0], tmp_path / "t.gguf")
    assert "\n" not in str(e.value)
