"""Layer-streamed targets (specdec/models/streaming/) against the resident model.

On CPU the "device" is the CPU: every streamed layer is copied (from host memory, or re-split
from the memory-mapped GGUF) into one of two slots right before it runs, so the outputs must
be bit-identical to the resident model's. Also: bytes per forward, the statistics, a source
that disappears mid-run, the two-slot memory check, the CLI flag, the Triton path."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specdec.decode.drafters import ModelDrafter, make_drafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.kernels.quant import QuantizedWeight
from specdec.models.load import load_model, load_weights
from specdec.models.streaming import load_streamed, memory, resolve_source, stream_model
from specdec.models.streaming.layout import Unit
from specdec.models.streaming.sources import HostSource
from specdec.models.transformer import KVCache, Linear, RMSNorm
from tests.models.test_cpu_linear import needs_ort

TEXTS = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread (as configs/config.yaml): these small GEMVs gain nothing from more,
    and OpenMP barriers stall when the stream's worker thread or another process holds a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _packed_bytes(module) -> int:
    """Bytes of the weights a module's forward reads: packed planes of quantized Linears,
    dense weights, biases and norms."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            w = m.qweight
            n += w.nbytes() if w is not None else m.dense.numel() * m.dense.element_size()
            if m.bias is not None:
                n += m.bias.numel() * m.bias.element_size()
        elif isinstance(m, RMSNorm):
            n += m.weight.numel() * m.weight.element_size()
    return n


def _logits(model, seqs, layers=None):
    """Prefill 6 tokens, verify a 4-token block, then 2 single-token steps: all logits."""
    B = len(seqs)
    cache = KVCache.for_model(model, B, 32)
    start = torch.zeros(B, dtype=torch.long, device=model.device)
    outs = []
    with torch.inference_mode():
        for a, b in ((0, 6), (6, 10), (10, 11), (11, 12)):
            toks = torch.tensor([s[a:b] for s in seqs], device=model.device)
            outs.append(model(toks, cache, start + a, layers=layers))
    return torch.cat(outs, dim=1)


def _seqs(model, n=2):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (n, 12), generator=g).tolist()


@pytest.fixture(scope="module")
def gguf_copy(tiny_gguf, tmp_path_factory):
    """A private copy of a tiny GGUF (tests below truncate and delete theirs)."""
    root = tmp_path_factory.mktemp("stream")

    def make(arch="llama", qtype="Q4_1", name="model.gguf"):
        path = root / f"{arch}-{qtype}-{name}"
        shutil.copy(tiny_gguf(arch, qtype), path)
        return path

    return make


# -- identical outputs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch,qtype,source",
    [
        ("llama", "Q4_1", "mmap"),
        ("llama", "Q8_0", "mmap"),
        ("qwen2", "Q4_0", "mmap"),  # q/k/v biases
        ("llama", "F16", "mmap"),  # dense rows un-permuted by scatter
        ("llama", "BF16", "mmap"),
        ("llama", "Q4_1", "host"),
    ],
)
def test_streamed_gguf_logits_equal_resident(tiny_gguf, arch, qtype, source):
    path = tiny_gguf(arch, qtype)
    ref, _ = load_model(str(path))
    model, _ = load_streamed(str(path), source=source)
    stream = model.layer_stream
    assert stream.streamed_layers == list(range(model.config.n_layers))
    if source == "mmap":
        assert stream.source.path == path
        assert not any(stream.source.fallback.values())  # every layer tensor comes from the file
        assert all(b.attn_norm.weight.is_meta for b in model.layers)  # freed from memory
    seqs = _seqs(model)
    assert torch.equal(_logits(model, seqs), _logits(ref, seqs))
    assert torch.equal(_logits(model, seqs, layers=[0]), _logits(ref, seqs, layers=[0]))
    # one sequence: single-row GEMVs (oneDNN on an unpacked weight rounded these differently)
    one = _seqs(model, 1)
    assert torch.equal(_logits(model, one), _logits(ref, one))


@pytest.mark.parametrize("source", ["mmap", "host"])
@pytest.mark.parametrize("qtype", ["Q4_1", "F16"])
def test_streamed_bf16_logits_equal_resident(tiny_gguf, qtype, source):
    """In bf16 the streamed layers keep fp32 norm weights and hand the GEMVs bf16, as
    Transformer.setup does for resident layers (the first GPU run of bench_streamed failed:
    streamed norms were cast to bf16 and returned fp32)."""
    path = str(tiny_gguf("llama", qtype))
    ref, _ = load_model(path, dtype="bfloat16", batch_invariant="off")
    model, _ = load_streamed(path, dtype="bfloat16", source=source, resident_layers=1)
    assert model.layer_stream.streamed_layers == list(range(1, model.config.n_layers))
    for seqs in (_seqs(model), _seqs(model, 1)):
        want = _logits(ref, seqs)
        assert want.dtype == torch.float32 and torch.isfinite(want).all()
        assert torch.equal(_logits(model, seqs), want)


@pytest.mark.parametrize(
    "mode,dtype,qtype,backend",
    [
        ("native", "bfloat16", "Q4_1", "int4pack"),
        ("native", "bfloat16", "Q8_0", "int8pack"),
        pytest.param("ort", "float32", "Q4_1", "ort", marks=needs_ort),
    ],
)
def test_streamed_packed_logits_equal_resident_from_the_codes(
    tiny_gguf, mode, dtype, qtype, backend, monkeypatch
):
    """`cpu_linear=native` (bf16) and `ort`: each streamed Linear runs the resident layer's
    packed kernel built on its slot's codes, so the logits are the resident model's, and, as
    for a resident layer, no weight is dequantized for it: the worker dequantized every
    streamed weight and dropped the copy unread before 2026-12-07."""
    monkeypatch.setenv("SPECDEC_CPU_LINEAR", mode)
    path = str(tiny_gguf("llama", qtype))
    ref, _ = load_model(path, dtype=dtype, backend="torch", batch_invariant="off")
    assert all(v.startswith(backend) for v in ref.cpu_linear_report().values())
    model, _ = load_streamed(path, dtype=dtype, source="mmap")
    assert model.layer_stream.streamed_layers == list(range(model.config.n_layers))
    calls = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(
        QuantizedWeight, "dequantize", lambda w, *a, **k: calls.append(w.shape) or real(w, *a, **k)
    )
    lins = sum(isinstance(m, Linear) for m in model.layers[0].modules())
    for seqs in (_seqs(model), _seqs(model, 1)):
        calls.clear()
        got = _logits(model, seqs)  # 4 forwards, each streaming every layer once
        if qtype == "Q4_1":
            assert calls == []  # int4pack and ort read the slot's codes
        else:  # int8pack requantizes Q8_0's blocks per channel: one dequantization per build
            assert len(calls) == 4 * model.config.n_layers * lins
        want = _logits(ref, seqs)
        assert want.dtype == torch.float32 and torch.isfinite(want).all()
        assert torch.equal(got, want)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_streamed_safetensors_logits_equal_resident(tiny_dir, quantize):
    d = str(tiny_dir("qwen2", True))
    ref, _ = load_model(d, quantize=quantize, group_size=32)
    model, _ = load_streamed(d, quantize=quantize, group_size=32)  # auto: host memory
    assert isinstance(model.layer_stream.source, HostSource)
    seqs = _seqs(model)
    assert torch.equal(_logits(model, seqs), _logits(ref, seqs))


def test_streamed_greedy_generation_token_identical(tiny_dir, tiny_gguf):
    """Plain and speculative decoding (self-drafters, n-gram, a separate resident draft model)
    on a streamed target emit the resident target's greedy tokens."""
    path = str(tiny_gguf("llama", "Q8_0"))
    ref, tok = load_model(path)
    prompts = [tok.encode(t) for t in TEXTS]
    want = generate(ref, prompts, 20).tokens
    model, _ = load_streamed(path, resident_layers=1)  # the early-exit draft's layer stays
    assert generate(model, prompts, 20).tokens == want
    draft = load_model(path)[0]
    for kind, k in [("early_exit", 3), ("layerskip", 2), ("ngram", 4), ("model", 4)]:
        drafter = (
            ModelDrafter(draft) if kind == "model" else make_drafter(kind, model, exit_layer=1)
        )
        dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
        res = dec.generate(prompts, 20)
        assert res.tokens == want, kind
        assert res.stats["bytes_streamed"] > 0


def test_placement_embedding_on_host_and_streamed_head(tiny_gguf):
    path = str(tiny_gguf("llama", "Q4_1"))
    ref, tok = load_model(path)
    model, _ = load_streamed(path, embed_on_device=False, head_on_device=False, resident_layers=1)
    stream = model.layer_stream
    assert stream.embed_host is not None and model.embed_dense is None
    assert stream.head is not None and stream.streamed_layers == [1]
    seqs = _seqs(model)
    assert torch.equal(_logits(model, seqs), _logits(ref, seqs))
    prompts = [tok.encode(t) for t in TEXTS]
    assert generate(model, prompts, 12).tokens == generate(ref, prompts, 12).tokens


# -- bytes streamed ----------------------------------------------------------------------------
def test_bytes_streamed_per_forward_and_stats(tiny_gguf):
    path = str(tiny_gguf("llama", "Q4_1"))
    ref, tok = load_model(path)
    layer_bytes = [_packed_bytes(b) for b in ref.layers]
    head_bytes = ref.lm_head.qweight.nbytes()
    model, _ = load_streamed(path, resident_layers=[0], head_on_device=False)
    stream = model.layer_stream
    per_forward = sum(layer_bytes[1:]) + head_bytes
    assert stream.bytes_per_forward() == per_forward
    before = stream.bytes_streamed
    _logits(model, _seqs(model))  # four forwards
    assert stream.bytes_streamed - before == 4 * per_forward
    before = stream.bytes_streamed
    _logits(model, _seqs(model), layers=[0])  # a self-draft forward streams what it runs
    assert stream.bytes_streamed - before == 4 * head_bytes

    res = generate(model, [tok.encode(TEXTS[0])], 10)
    st = res.stats
    assert st["bytes_streamed"] == st["target_forwards"] * per_forward
    assert st["bytes_streamed_per_token"] == st["bytes_streamed"] / res.num_generated
    assert "bytes_streamed" not in generate(ref, [tok.encode(TEXTS[0])], 4).stats


def test_quantized_layers_stream_packed(tiny_dir):
    """An int4 layer streams its packed codes + scales + mins, not a dense copy."""
    d = str(tiny_dir("llama", False))
    dense, _ = load_streamed(d)
    int4, _ = load_streamed(d, quantize="int4", group_size=32)
    ratio = dense.layer_stream.bytes_per_forward() / int4.layer_stream.bytes_per_forward()
    assert 4.0 < ratio < 8.0  # fp32 -> 4 bits + fp16 scale and min per 32 weights


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: os.truncate(p, os.path.getsize(p) // 2), "truncated"),
        (os.remove, "disappeared"),
        (lambda p: os.replace(shutil.copy(p, str(p) + ".new"), p), "replaced or modified"),
    ],
)
def test_stream_source_damaged_mid_run(gguf_copy, damage, message):
    path = gguf_copy(name=message.split()[0] + ".gguf")
    model, _ = load_streamed(str(path), source="mmap")
    seqs = _seqs(model)
    _logits(model, seqs)
    damage(path)
    with pytest.raises(SpecDecError, match=message):
        _logits(model, seqs)


def test_stream_read_failure_is_a_user_error_and_recovers(tiny_gguf, monkeypatch):
    path = str(tiny_gguf("llama", "Q8_0"))
    ref, _ = load_model(path)
    model, _ = load_streamed(path, source="mmap")
    seqs = _seqs(model)
    fill = model.layer_stream.source.fill

    def broken(unit, flat, views):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(model.layer_stream.source, "fill", broken)
    with pytest.raises(SpecDecError, match=r"streaming layer 0 from .*Input/output error"):
        _logits(model, seqs)
    monkeypatch.setattr(model.layer_stream.source, "fill", fill)
    assert torch.equal(_logits(model, seqs), _logits(ref, seqs))


def test_memory_for_two_layers_is_checked(tiny_gguf, monkeypatch):
    path = str(tiny_gguf("llama", "Q4_1"))
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 4096)
    with pytest.raises(SpecDecError, match="two layer buffers"):
        load_streamed(path)
    model, _, _ = load_weights(path)
    with pytest.raises(SpecDecError, match="two layer buffers"):
        stream_model(model, "cpu", resident_layers=1)  # one streamed layer still needs two slots
    model, _, _ = load_weights(path)
    stream_model(model, "cpu", resident_layers=2)  # nothing streamed: nothing to check
    # on the CPU the slot kernels' prepacked weights count too: room for the two slots and
    # their dequantized weights alone is refused
    model, _, _ = load_weights(path)
    units = [Unit.of(i, "", b, torch.float32, True) for i, b in enumerate(model.layers)]
    bare = 2 * max(u.nbytes + u.dequant_bytes for u in units)
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: bare)
    with pytest.raises(SpecDecError, match="prepacked"):
        stream_model(model, "cpu")


def test_bad_stream_options(tiny_gguf, tiny_dir):
    path = tiny_gguf("llama", "Q4_1")
    with pytest.raises(SpecDecError, match="out of range"):
        load_streamed(str(path), resident_layers=5)
    with pytest.raises(SpecDecError, match=r"out of range"):
        load_streamed(str(path), resident_layers=[0, 9])
    with pytest.raises(SpecDecError, match="needs a .gguf"):
        resolve_source("mmap", tiny_dir("llama", False), "cpu")
    with pytest.raises(SpecDecError, match="unknown stream source"):
        resolve_source("disk", path, "cpu")
    assert resolve_source("auto", path, "cpu") == path
    assert resolve_source("auto", path, "cuda") == "host"
    model, _, _ = load_weights(str(path))
    with pytest.raises(SpecDecError, match="'host' or the model's .gguf"):
        stream_model(model, "cpu", source="weights.bin")
    with pytest.raises(SpecDecError, match="does not hold this model"):
        stream_model(model, "cpu", source=tiny_gguf("qwen2", "Q4_0"))
    model, _, _ = load_weights(str(path))
    stream_model(model, "cpu")
    with pytest.raises(SpecDecError, match="already streamed"):
        stream_model(model, "cpu")


# -- CLI, Triton, the real model -----------------------------------------------------------------
def test_cli_stream_target(tiny_gguf, capsys):
    from specdec.generate import main

    path = str(tiny_gguf("llama", "Q8_0"))
    base = ["--model", path, "--prompt", TEXTS[0], "--max-new-tokens", "12", "--json"]
    main(base)
    ref = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    main([*base, "--stream-target", "--draft", "early-exit", "--k", "3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == ref["tokens"]
    assert out["stats"]["bytes_streamed_per_token"] > 0 and out["stats"]["drafter"] == "early_exit"
    with pytest.raises(SystemExit):
        main([*base, "--stream-head"])
    assert "need --stream-target" in capsys.readouterr().err


def test_streamed_triton_backend_matches_resident(tiny_gguf):
    """The GEMV kernel reads the packed slot views (Triton's interpreter on CPU)."""
    path = str(tiny_gguf("llama", "Q4_1"))
    ref, _ = load_model(path, backend="triton")
    model, _ = load_streamed(path, backend="triton")
    runner = model.layer_stream.runners[0, 0]
    assert runner.attn.wqkv.use_kernel and runner.attn.wqkv.dense is None
    seqs = _seqs(model)
    torch.testing.assert_close(_logits(model, seqs), _logits(ref, seqs), rtol=0, atol=0)


def test_smollm2_streamed_from_mmap_token_identical(smollm2, smollm2_path):
    ref, tok = smollm2
    prompts = [tok.encode_chat("Name three primary colors.")]
    want = generate(ref, prompts, 24).tokens
    model, _ = load_streamed(str(smollm2_path), backend="torch", resident_layers=7)
    assert model.layer_stream.streamed_layers == list(range(7, 30))
    res = generate(model, prompts, 24)
    assert res.tokens == want
    assert res.stats["bytes_streamed"] == res.stats["target_forwards"] * sum(
        _packed_bytes(b) for b in ref.layers[7:]
    )
    dec = SpeculativeDecoder(
        model,
        make_drafter("early_exit", model, exit_layer=7),
        schedule=make_schedule("constant", 2),
    )
    spec = dec.generate(prompts, 24)
    assert spec.tokens == want
    # drafting from the resident layers streams nothing: fewer bytes per token than plain
    assert spec.stats["bytes_streamed_per_token"] < res.stats["bytes_streamed_per_token"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("source", ["host", "mmap"])
def test_streamed_cuda_token_identical(tiny_gguf, source):
    pytest.importorskip("gguf")  # the GPU image may lack it (this test writes a GGUF)
    path = str(tiny_gguf("llama", "Q4_1"))
    ref, tok = load_model(path, device="cuda")
    model, _ = load_streamed(path, device="cuda", source=source, resident_layers=1)
    assert model.layer_stream.slots[0].is_cuda
    prompts = [tok.encode(t) for t in TEXTS]
    want = generate(ref, prompts, 20).tokens
    assert generate(model, prompts, 20).tokens == want
    dec = SpeculativeDecoder(
        model,
        make_drafter("early_exit", model, exit_layer=1),
        schedule=make_schedule("constant", 4),
    )
    assert dec.generate(prompts, 20).tokens == want
