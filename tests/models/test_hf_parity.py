"""Logits and greedy continuations against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from specdec.decode.generation import generate
from specdec.models.load import load_model
from specdec.models.transformer import KVCache
from tests.helpers import hf_greedy_tokens

PROMPTS = {
    "prose": "The history of the printing press begins in",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "arithmetic": "Question: what is 17 + 25? Answer:",
}


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache.for_model(model, 1, len(ids) + 4)
    with torch.inference_mode():
        return model(torch.tensor([ids]), cache, torch.zeros(1, dtype=torch.long))[0]


@pytest.mark.parametrize("text", [*PROMPTS.values(), "<|im_start|>user\nHi there<|im_end|>\n"])
def test_tokenizer_matches_hf(smollm2, hf_smollm2, text):
    _, tok = smollm2
    _, htok = hf_smollm2
    assert tok.encode(text) == htok(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == text


def test_unicode_and_digits_tokenize_like_hf(smollm2, hf_smollm2):
    text = "Prix: 1234,56 € — naïve café ☕ 😀 \t tabs\n\nnew paragraph"
    assert smollm2[1].encode(text) == hf_smollm2[1](text)["input_ids"]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_smollm2_logits_match_hf(smollm2, hf_smollm2, name):
    model, tok = smollm2
    hf, _ = hf_smollm2
    ids = tok.encode(PROMPTS[name])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    out = _logits(model, ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("name", list(PROMPTS))
def test_smollm2_greedy_matches_hf_generate(smollm2, hf_smollm2, name):
    model, tok = smollm2
    hf, _ = hf_smollm2
    ids = tok.encode(PROMPTS[name])
    ref = hf_greedy_tokens(hf, ids, 32, tok.eos_id, tok.eos_id)
    res = generate(model, [ids], 32, stop_ids=tok.stop_ids)
    assert res.tokens[0] == ref
    assert len(ref) == 32 or ref[-1] == tok.eos_id


def _hf_logits(hf_dir, ids_batch, lens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids, n in zip(ids_batch, lens):
            out.append(hf(torch.tensor([ids[:n]])).logits[0])
    return out


@pytest.mark.parametrize(
    "arch,tie", [("qwen2", False), ("llama", False), ("llama", True), ("qwen2", True)]
)
def test_tiny_safetensors_batch_prefill_and_decode_match_hf(tiny_dir, arch, tie):
    """Batch of prompts with different lengths: right-padded prefill, then decode steps
    at per-sequence cache positions, against HF run on each full sequence."""
    d = tiny_dir(arch, tie)
    model, tok = load_model(str(d))
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    full = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 8, 11)]
    prompt_lens = [7, 3, 6]
    refs = _hf_logits(d, full, [len(f) for f in full])
    B = len(full)
    cache = KVCache.for_model(model, B, 32)
    T = max(prompt_lens)
    toks = torch.zeros(B, T, dtype=torch.long)
    for b, (f, n) in enumerate(zip(full, prompt_lens)):
        toks[b, :n] = torch.tensor(f[:n])
    with torch.inference_mode():
        out = model(toks, cache, torch.zeros(B, dtype=torch.long))
        for b, n in enumerate(prompt_lens):
            assert (out[b, :n] - refs[b][:n]).abs().max() < 1e-4
        cache.lens = torch.tensor(prompt_lens)
        # two decode steps (one token per sequence at its own position), then a 2-token step
        for _ in range(2):
            nxt = torch.tensor([[f[int(cache.lens[b])]] for b, f in enumerate(full)])
            out = model(nxt, cache, cache.lens)
            for b in range(B):
                assert (out[b, 0] - refs[b][int(cache.lens[b])]).abs().max() < 1e-4
            cache.lens += 1
        nxt = torch.tensor(
            [f[int(cache.lens[b]) : int(cache.lens[b]) + 2] for b, f in enumerate(full)]
        )
        out = model(nxt, cache, cache.lens)
        for b in range(B):
            L = int(cache.lens[b])
            assert (out[b] - refs[b][L : L + 2]).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_tiny_gguf_matches_hf(tiny_gguf, arch, qtype):
    transformers = pytest.importorskip("transformers")
    path = tiny_gguf(arch, qtype)
    model, tok = load_model(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = tok.encode("The quick brown fox jumps over def add(a, b)")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (_logits(model, ids) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantize_on_load_matches_hf_with_the_same_rounded_weights(tiny_dir, quant):
    """Quantized model vs HF whose linear weights were replaced by our dequantized ones."""
    from transformers import AutoModelForCausalLM

    from specdec.kernels.quant import quantize_int4, quantize_int8

    d = tiny_dir("qwen2", False)
    model, tok = load_model(str(d), quantize=quant, group_size=32)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    q = quantize_int8 if quant == "int8" else (lambda w: quantize_int4(w, 32))
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(q(mod.weight).dequantize())
    ids = tok.encode("Speculative decoding drafts tokens")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert all(m.qweight is not None for m in model.modules() if type(m).__name__ == "Linear")
    assert (_logits(model, ids) - ref).abs().max() < 1e-3


def test_sharded_safetensors_with_index(tiny_dir, tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json loads identically."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_dir("llama", False)
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: sd[n].contiguous() for n in part}, str(dst / fn), metadata={"format": "pt"})
        wm.update({n: fn for n in part})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm})
    )
    a, tok = load_model(str(src))
    b, _ = load_model(str(dst))
    ids = tok.encode("quick brown fox")
    assert torch.equal(_logits(a, ids), _logits(b, ids))


# -- GPU: the embedded model through the Triton kernels ------------------------------------
def _cached_smollm2():
    """The embedded model's file if the cache holds it; skip otherwise (a GPU machine has no
    network: `make gpu-model-parts` here, `gpu_check.sh` joins the parts there)."""
    from specdec.models.registry import REGISTRY, cache_file, verify_cached

    m = REGISTRY["smollm2-135m"]
    path = cache_file(m)
    if not verify_cached(path, m.sha256):
        pytest.skip(f"the embedded model is not in the cache ({path})")
    return path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_on_gpu_matches_hf(request):
    """SmolLM2-135M's Q4_1 GGUF on the GPU (Triton GEMV and attention, float32, CUDA graphs)
    against HF transformers on the CPU, same weights: logits of each prompt within 2e-3,
    greedy continuations of 32 tokens equal to HF's generate."""
    path = _cached_smollm2()
    hf, _ = request.getfixturevalue("hf_smollm2")
    model, tok = load_model(str(path), dtype="float32", device="cuda", backend="triton")
    assert model.backend == "triton"
    for name, text in PROMPTS.items():
        ids = tok.encode(text)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
            cache = KVCache.for_model(model, 1, len(ids) + 4)
            start = torch.zeros(1, dtype=torch.long, device="cuda")
            out = model(torch.tensor([ids], device="cuda"), cache, start)[0].cpu()
        assert (out - ref).abs().max().item() < 2e-3, name
        want = hf_greedy_tokens(hf, ids, 32, tok.eos_id, tok.eos_id)
        got = generate(model, [ids], 32, stop_ids=tok.stop_ids, cuda_graphs=True).tokens[0]
        assert got == want, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_bf16_gpu_graphs_match_uncaptured():
    """The embedded model in bf16 on the GPU: plain and n-gram speculative greedy decoding
    give the same tokens with CUDA graphs as without (what graphs must guarantee; bf16
    speculative vs plain can differ on the GPU, docs/gpu.md)."""
    from specdec.decode.drafters import make_drafter
    from specdec.decode.schedules import make_schedule
    from specdec.decode.speculative import SpeculativeDecoder

    path = _cached_smollm2()
    model, tok = load_model(str(path), dtype="bfloat16", device="cuda", backend="triton")
    prompts = [tok.encode(t) for t in PROMPTS.values()]
    plain = generate(model, prompts, 40, cuda_graphs=False).tokens
    assert generate(model, prompts, 40, cuda_graphs=True).tokens == plain

    def speculative(graphs):
        drafter = make_drafter("ngram", model)
        sched = make_schedule("constant", 4)
        dec = SpeculativeDecoder(model, drafter, schedule=sched, cuda_graphs=graphs)
        return dec.generate(prompts, 40).tokens

    assert speculative(True) == speculative(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_bf16_gpu_speculative_equals_plain():
    """bf16 on the GPU in batch-invariant mode (auto: on in bf16 on the Triton backend):
    greedy speculative decoding, n-gram (batched prompts of other lengths and each alone)
    and layer skip, gives plain greedy's tokens, CUDA graphs on. Without the mode the
    fourth H200 call's main job kept 5 of 12 outputs (docs/gpu.md)."""
    from specdec.decode.drafters import make_drafter
    from specdec.decode.schedules import make_schedule
    from specdec.decode.speculative import SpeculativeDecoder

    path = _cached_smollm2()
    model, tok = load_model(str(path), dtype="bfloat16", device="cuda", backend="triton")
    assert model.batch_invariant, model.batch_invariant_reason
    prompts = [tok.encode(t) for t in PROMPTS.values()]

    def speculative(kind, k, batch):
        drafter = make_drafter(kind, model, skip="every2")
        dec = SpeculativeDecoder(model, drafter, schedule=make_schedule("constant", k))
        return dec.generate(batch, 48).tokens

    assert speculative("ngram", 4, prompts) == generate(model, prompts, 48).tokens
    for p in prompts:
        alone = generate(model, [p], 48).tokens
        assert speculative("ngram", 6, [p]) == alone
        assert speculative("layerskip", 3, [p]) == alone
