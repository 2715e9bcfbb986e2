"""The models on the Triton kernels (interpreter on CPU) give the torch path's logits:
every Linear through the quantized GEMV, decode/verification attention through
verify_attention."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.generation import generate
from specdec.models.load import load_model
from specdec.models.transformer import KVCache


def _run(model, seqs, steps, layers=None):
    """Prefill each sequence's first part, then feed the rest as a k+1 = 4-token block and
    then one token at a time: all logits concatenated."""
    B = len(seqs)
    cache = KVCache.for_model(model, B, 64)
    outs = []
    with torch.inference_mode():
        start = torch.zeros(B, dtype=torch.long)
        toks = torch.tensor([s[:6] for s in seqs])
        outs.append(model(toks, cache, start, layers=layers))
        start = start + 6
        outs.append(model(torch.tensor([s[6:10] for s in seqs]), cache, start, layers=layers))
        start = start + 4
        for i in range(steps):
            outs.append(
                model(torch.tensor([s[10 + i : 11 + i] for s in seqs]), cache, start, layers=layers)
            )
            start = start + 1
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    "arch,quant", [("llama", None), ("qwen2", None), ("llama", "int4"), ("qwen2", "int8")]
)
def test_tiny_models_triton_matches_torch(tiny_dir, arch, quant):
    d = tiny_dir(arch, False)
    ref_model, _ = load_model(str(d), quantize=quant, backend="torch", group_size=32)
    tri_model, _ = load_model(str(d), quantize=quant, backend="triton", group_size=32)
    assert tri_model.backend == "triton"
    if quant:
        assert all(m.use_kernel for m in tri_model.modules() if type(m).__name__ == "Linear")
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, ref_model.config.vocab_size, (2, 14), generator=g).tolist()
    a = _run(ref_model, seqs, 3)
    b = _run(tri_model, seqs, 3)
    torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_tiny_gguf_q4_triton_matches_torch_in_generation(tiny_gguf):
    path = tiny_gguf("llama", "Q4_1")
    ref_model, tok = load_model(str(path), backend="torch")
    tri_model, _ = load_model(str(path), backend="triton")
    prompts = [tok.encode("The quick brown fox"), tok.encode("def add(a, b):")]
    assert generate(tri_model, prompts, 6).tokens == generate(ref_model, prompts, 6).tokens


def test_smollm2_first_layers_triton_matches_torch(smollm2_path):
    """Three of SmolLM2's 30 layers plus the Q8_0 tied LM head (49152 x 576) on Triton."""
    ref_model, tok = load_model(str(smollm2_path), backend="torch")
    tri_model, _ = load_model(str(smollm2_path), backend="triton")
    ids = tok.encode("Speculative decoding verifies k drafted tokens in one pass.")[:11]
    seqs = [ids + [0] * (11 - len(ids))]
    a = _run(ref_model, seqs, 0, layers=[0, 1, 2])
    b = _run(tri_model, seqs, 0, layers=[0, 1, 2])
    torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)
