"""Batch invariance on the Triton backend (specdec.models.batch_invariant, TRITON_MODE), run
in Triton's interpreter on a tiny random Llama with int4 weights: the setting, a T-token
verification forward's logits and KV entries bit for bit equal to T one-token decode steps
(two sequences at different lengths), and greedy speculative output equal to plain greedy
in bfloat16. The same checks at real shapes on a GPU: tests/models/test_hf_parity.py."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate, prefill
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.models import batch_invariant as bi
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

# head dim 64, 3 query heads per KV head: a verification's rows sit at other places of the
# attention kernel's 16-row tile than a decode step's row (where the interpreter's tl.dot,
# numpy's BLAS, sums differently: without the mode float32 rows differ in the last bits)
SHAPE = dict(layers=2, heads=3, kv_heads=1, hidden=192, ffn=256)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    return load_model(
        str(tiny_dir("llama", False, **SHAPE)), dtype="bfloat16", quantize="int4", backend="triton"
    )


def _invariant_fp32(tiny_dir):
    bi.set_setting("on")  # auto leaves float32 off (reset after each test by conftest)
    return load_model(
        str(tiny_dir("llama", False, **SHAPE)), dtype="float32", quantize="int4", backend="triton"
    )


def test_setting_on_the_triton_backend(tiny_dir, tiny_bf16):
    model, _ = tiny_bf16
    assert model.batch_invariant and "Triton" in model.batch_invariant_reason
    path = str(tiny_dir("llama", False))
    fp32, _ = load_model(path, dtype="float32", quantize="int4", backend="triton")
    assert not fp32.batch_invariant and "float32" in fp32.batch_invariant_reason
    bi.set_setting("on")
    forced, _ = load_model(path, dtype="float32", quantize="int4", backend="triton")
    assert forced.batch_invariant
    # torch's own kernels on a GPU have no such mode: asking for it is an error there
    with pytest.raises(SpecDecError, match="torch backend on CPU or the Triton backend"):
        bi.choose("on", torch.bfloat16, on_cpu_torch=False, int8_activations=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verification_rows_equal_decode_steps(tiny_dir, tiny_bf16, dtype):
    model, _ = tiny_bf16 if dtype == "bfloat16" else _invariant_fp32(tiny_dir)
    assert model.batch_invariant
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (11, 6)]
    T = 5
    new = torch.randint(0, V, (2, T), generator=g)
    with torch.inference_mode():
        ver = KVCache.for_model(model, 2, 40)
        prefill(model, prompts, ver)
        start = ver.lens.clone()
        logits = model(new, ver, start)  # one verification forward
        dec = KVCache.for_model(model, 2, 24)  # plain decoding's cache: another length
        prefill(model, prompts, dec)
        steps = []
        for t in range(T):
            steps.append(model(new[:, t : t + 1], dec, start + t))
        steps = torch.cat(steps, 1)
    assert torch.equal(logits, steps)
    for b, n in enumerate(len(p) + T for p in prompts):
        assert torch.equal(ver.k[:, b, :, :n], dec.k[:, b, :, :n])
        assert torch.equal(ver.v[:, b, :, :n], dec.v[:, b, :, :n])


@pytest.mark.parametrize("kind, k", [("ngram", 4), ("layerskip", 3)])
def test_bf16_greedy_speculative_equals_plain(tiny_bf16, kind, k):
    model, tok = tiny_bf16
    prompts = [tok.encode(t) for t in ("the cat sat on the mat, the cat", "1 2 3 1 2 3 1 2")]
    plain = generate(model, prompts, 20).tokens
    dec = SpeculativeDecoder(
        model,
        make_drafter(kind, model, skip="every2"),
        "greedy",
        schedule=make_schedule("constant", k),
    )
    res = dec.generate(prompts, 20)
    assert res.tokens == plain
    assert sum(s["drafted"] for s in res.stats["per_sequence"]) > 0  # verified drafts
