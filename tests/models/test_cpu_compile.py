"""Compiled decode / verification steps on CPU (specdec.models.cpu_compile): greedy output
equal to the eager path's, every step compiled without a graph break, clear errors."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.models import cpu_compile
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

needs_compiler = pytest.mark.skipif(
    cpu_compile.compiler_missing() is not None, reason="torch.compile needs a C++ compiler"
)


def _prompts(tok):
    texts = ["The quick brown fox", "def add(a, b):\n    return"]
    return [tok.encode(t) for t in texts]


@needs_compiler
@pytest.mark.slow
def test_compiled_steps_match_eager(tiny_dir):
    """Plain greedy and greedy speculative decoding (layer-skip drafter: a layer subset, and
    verifications of k + 1 tokens) with compiled steps produce the eager path's tokens, and
    each compiled step is one graph (no graph break: the linears are opaque ops)."""
    from torch._dynamo.utils import counters

    model, tok = load_model(str(tiny_dir("llama", False, layers=4)), cpu_compile="on")
    assert model.cpu_compile and resolve_cuda_graphs(model, None)
    prompts = _prompts(tok)
    model.cpu_compile = False  # the reference: the eager forward
    ref = generate(model, prompts, 12, cuda_graphs=False).tokens
    spec_ref = SpeculativeDecoder(
        model,
        make_drafter("layerskip", model, skip="every2"),
        schedule=make_schedule("constant", 3),
    ).generate(prompts, 12)
    assert spec_ref.tokens == ref
    model.cpu_compile = True
    counters.clear()
    assert generate(model, prompts, 12).tokens == ref
    dec = SpeculativeDecoder(
        model,
        make_drafter("layerskip", model, skip="every2"),
        schedule=make_schedule("constant", 3),
    )
    assert dec.generate(prompts, 12).tokens == ref
    assert graphs_for(model)._compiled is not None
    assert counters["stats"]["unique_graphs"] >= 3  # decode, verify (T = 4), drafter layers
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_settings_and_errors(monkeypatch):
    assert cpu_compile.resolve_setting(None) == "off"
    assert cpu_compile.resolve_setting(True) == "on"
    assert cpu_compile.resolve_setting(False) == "off"
    monkeypatch.setenv(cpu_compile.ENV, "on")
    assert cpu_compile.resolve_setting(None) == "on"
    with pytest.raises(SpecDecError, match="invalid cpu_compile setting 'fast'"):
        cpu_compile.resolve_setting("fast")
    with pytest.raises(SpecDecError, match="torch backend on CPU"):
        cpu_compile.check_available(torch.device("cuda"), "triton")
    with pytest.raises(SpecDecError, match="torch backend on CPU"):
        cpu_compile.check_available(torch.device("cpu"), "triton")
    monkeypatch.setattr(cpu_compile, "compiler_missing", lambda: "no g++ here")
    with pytest.raises(SpecDecError, match="cpu_compile=on: no g.. here"):
        cpu_compile.check_available(torch.device("cpu"), "torch")


def test_setup_refuses_without_compiler(tiny_dir, monkeypatch):
    """No silent fallback: asked for compiled steps where they cannot run, setup says why."""
    monkeypatch.setattr(cpu_compile, "compiler_missing", lambda: "no C++ compiler found")
    with pytest.raises(SpecDecError, match="no C.. compiler found"):
        load_model(str(tiny_dir("llama", False)), cpu_compile="on")


def test_resolve_with_compiled_steps():
    model = SimpleNamespace(device=torch.device("cpu"), layer_stream=None, cpu_compile=True)
    assert resolve_cuda_graphs(model, None) is True
    assert resolve_cuda_graphs(model, True) is True
    with pytest.raises(SpecDecError, match="cuda_graphs=off"):
        resolve_cuda_graphs(model, False)
    model.layer_stream = object()
    with pytest.raises(SpecDecError, match="layer-streamed"):
        resolve_cuda_graphs(model, None)


def test_compiled_steps_turn_batch_invariance_off(tiny_dir):
    """Compiled steps run the graph-safe forward: the model says batch invariance is off (in
    bf16 too, where auto turns it on) and refuses an explicit `on`."""
    model, _ = load_model(str(tiny_dir("llama", False)), dtype="bfloat16", cpu_compile="on")
    assert not model.batch_invariant and "cpu_compile" in model.batch_invariant_reason
    eager, _ = load_model(str(tiny_dir("llama", False)), dtype="bfloat16")
    # what auto gives without compiled steps (unless a kernel here fails its probe)
    assert eager.batch_invariant or "not possible" in eager.batch_invariant_reason
    with pytest.raises(SpecDecError, match="batch_invariant=on cannot be combined"):
        load_model(str(tiny_dir("llama", False)), cpu_compile="on", batch_invariant="on")


def test_compiled_cache_sizes(tiny_dir):
    """Compiled steps' static caches hold the next power of two >= 64 slots (each size is a
    graph of its own) and are reused while a request fits."""
    model, _ = load_model(str(tiny_dir("llama", False)), cpu_compile="on")
    graphs = graphs_for(model)
    assert graphs.cache("target", 1, 10).max_len == 64
    c = graphs.cache("target", 1, 64)
    assert c.max_len == 64 and graphs.cache("target", 1, 50) is c
    assert graphs.cache("target", 1, 65).max_len == 128
    assert graphs.cache("target", 1, 300).max_len == 512


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("qtype, kernel", [("Q4_1", "int4pack"), ("Q8_0", "int8pack")])
def test_compiled_native_step_matches_eager(tiny_gguf, qtype, kernel):
    """bf16 `native` mode: the packed kernels run as opaque ops inside the compiled step (no
    graph break), and at T = 1 and T = 4 on random tokens after a prefill its logits are as
    close to the float32 reference (the same GGUF dequantized, eager) as the eager bf16
    graph-safe forward's are: within twice the eager bf16 error."""
    from torch._dynamo.utils import counters

    from specdec.decode.generation import prefill
    from specdec.models.transformer import KVCache

    path = str(tiny_gguf("llama", qtype))
    model, _ = load_model(path, dtype="bfloat16", cpu_linear="native", cpu_compile="on")
    assert any(kernel in why for why in model.cpu_linear_report().values())
    ref_model, _ = load_model(path, dtype="float32")
    graphs = graphs_for(model)
    cache = graphs.cache("target", 1, 40)
    ref_cache = KVCache.for_model(ref_model, 1, 40)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=g).tolist()
    counters.clear()
    with torch.inference_mode():
        prefill(model, [prompt], cache)
        prefill(ref_model, [prompt], ref_cache)
        for T in (1, 4):
            toks = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
            ref = ref_model(toks, ref_cache, ref_cache.lens)
            eager = model(toks, cache, cache.lens, static=True).clone()
            got = graphs.forward(toks, cache, cache.lens)
            assert got.shape == ref.shape == (1, T, model.config.vocab_size)
            eager_err = (eager - ref).abs().max().item()
            got_err = (got - ref).abs().max().item()
            assert eager_err < 0.1 * ref.abs().max().item()  # bf16 rounding, not garbage
            assert got_err <= 2 * eager_err, (got_err, eager_err)
            cache.lens += T
            ref_cache.lens += T
    assert counters["stats"]["unique_graphs"] >= 2
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_compiler
@pytest.mark.slow
def test_warm_up_leaves_nothing_to_compile(tiny_dir):
    """After `warm_up` (the runner's, before timing) plain and speculative generations of
    prompts up to the warmed length compile nothing: every width a round meets (1..k + 1:
    the token budget cuts the last round short), the drafter's layer subset and the cache
    size are ready, and the output is still the eager path's."""
    from torch._dynamo.utils import counters

    from specdec.decode.generation import warm_up

    # 3 layers: no other test compiles steps of this shape (dynamo shares compiled graphs
    # between models of one shape, which would hide a missing warm-up)
    model, tok = load_model(str(tiny_dir("llama", False, layers=3)), cpu_compile="on")
    prompts = _prompts(tok)
    n_new, longest = 10, max(len(p) for p in prompts)
    model.cpu_compile = False
    ref = generate(model, prompts, n_new, cuda_graphs=False).tokens
    model.cpu_compile = True
    dec = SpeculativeDecoder(
        model,
        make_drafter("layerskip", model, skip="every2"),
        schedule=make_schedule("constant", 3),
    )
    counters.clear()
    # verification widths 1..4 and the drafter's step; the decode step is width 1, warmed
    assert dec.warm_up(2, longest, n_new) == 5
    assert warm_up(model, 2, longest, n_new) == 0
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 5
    cache = graphs_for(model).caches["target"]
    assert generate(model, prompts, n_new).tokens == ref
    res = dec.generate(prompts, n_new)
    assert res.tokens == ref
    assert graphs_for(model).caches["target"] is cache  # the warmed cache served both
    assert counters["stats"]["unique_graphs"] == compiled, "a timed generation compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    # a new cache size is warmed anew; the eager path has nothing to warm
    assert warm_up(model, 2, 100, n_new) == 1
    model.cpu_compile = False
    assert warm_up(model, 2, longest, n_new) == 0
    assert dec.warm_up(2, longest, n_new) == 0


@needs_compiler
@pytest.mark.slow
def test_compiled_step_writes_the_cache_in_place(tiny_dir):
    """The compiled step writes its KV entries into the static cache in place: no float
    buffer of the cache's length is allocated (functionalizing a write through a per-layer
    view copied every layer's cache twice and the whole cache back at the end: a SmolLM2
    step grew from 50 to 60 ms between 64 and 256 slots), and the cache holds the entries
    the eager forward writes."""
    from torch._inductor.utils import run_and_get_code

    model, tok = load_model(str(tiny_dir("llama", False, layers=2)), cpu_compile="on")
    graphs = graphs_for(model)
    slots = 256  # a length no other dimension of the tiny model has
    with torch.inference_mode():
        cache = graphs.cache("target", 2, slots)
        assert cache.max_len == slots
        ref = KVCache.for_model(model, 2, slots)
        for c in (cache, ref):
            c.k.normal_(generator=torch.Generator().manual_seed(1))
            c.v.normal_(generator=torch.Generator().manual_seed(2))
        start = torch.tensor([5, 70])
        tokens = torch.randint(0, model.config.vocab_size, (2, 3))
        out, code = run_and_get_code(graphs.forward, tokens, cache, start)
        model.cpu_compile = False
        eager = model(tokens, ref, start, static=True)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.k, ref.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, ref.v, rtol=1e-5, atol=1e-5)
    allocs = re.findall(r"empty_strided_cpu\(\(([^)]*)\)[^\n]*torch\.(float\w*|bfloat16)", code[0])
    assert allocs, "the generated code's allocations were not found"
    # a copy of a layer's keys or values has the slots and the head dim (the attention
    # mask, [B, 1, T, slots], has no head dim)
    dims = [[int(d) for d in a[0].replace(" ", "").split(",") if d] for a in allocs]
    copies = [d for d in dims if slots in d and model.config.head_dim in d]
    assert not copies, f"KV-cache copies in the compiled step: {copies}"


@needs_compiler
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("onnxruntime") is None, reason="needs onnxruntime"
)
@pytest.mark.parametrize("breaks", [True, False])
def test_compiled_step_with_graph_breaks_reads_its_own_writes(tiny_gguf, monkeypatch, breaks):
    """ONNX Runtime linears (cpu_linear=ort; Qwen2.5-Coder's Q5_0 / Q6_K parts under native)
    run inside the compiled step as an opaque op (`cpu_compile.ort_linear`): no graph break.
    They used to break the graph between the QKV projection and the KV write, and the
    attention must still read the entries just written when something does (views taken
    before the write, in an earlier graph, read stale ones: the compiled Qwen2.5-Coder
    step's argmax was 149269 against the eager 308): breaks=True puts a graph break before
    every linear."""
    from torch._dynamo.utils import counters

    from specdec.models.cpu_linear import CpuLinear

    torch._dynamo.reset()  # code objects that broke in another test may skip their breaks
    if breaks:
        call = CpuLinear._call

        def broken(self, x):
            torch._dynamo.graph_break()
            return call(self, x)

        monkeypatch.setattr(CpuLinear, "_call", broken)
    model, _ = load_model(str(tiny_gguf("llama", "Q8_0")), cpu_linear="ort", cpu_compile="on")
    report = model.cpu_linear_report()
    assert report and all(why.startswith("ort:") for why in report.values()), report
    graphs = graphs_for(model)
    counters.clear()
    with torch.inference_mode():
        cache = graphs.cache("target", 1, 64)
        ref = KVCache.for_model(model, 1, 64)
        for c in (cache, ref):
            c.k.normal_(generator=torch.Generator().manual_seed(3))
            c.v.normal_(generator=torch.Generator().manual_seed(4))
        start = torch.tensor([9])
        tokens = torch.randint(0, model.config.vocab_size, (1, 2))
        out = graphs.forward(tokens, cache, start).clone()
        model.cpu_compile = False
        eager = model(tokens, ref, start, static=True)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.k, ref.k, rtol=1e-5, atol=1e-5)
    assert bool(counters["graph_break"]) == breaks, dict(counters["graph_break"])
    assert bool(counters["graph_break"]) == breaks, dict(counters["graph_break"])


@needs_compiler
@pytest.mark.parametrize("dtype, sdpa", [("bfloat16", False), ("float32", True)])
def test_compiled_step_attention_path(tiny_dir, dtype, sdpa):
    """Compiled 16-bit steps attend with float32 GEMMs (`_small_attention`: SDPA's bf16
    flash kernel made a SmolLM2 step at batch 1 take 37.4 against 29.2 ms on AVX2), float32
    steps keep SDPA (no gain measured). Over 8 caches of random entries at random
    positions the compiled step's logits are as close to a float32 eager reference as the
    eager graph-safe forward's in the same dtype are: bf16, mean |error| within 1.5x the
    eager one's (one draw's max error is noise: their ratio ranged 0.5-2.0 over 80 draws,
    the 8-draw mean-error ratio 0.87-1.17); float32 within 1e-4 of the eager logits."""
    from torch._inductor.utils import run_and_get_code

    path = str(tiny_dir("llama", False, layers=2))
    model, _ = load_model(path, dtype=dtype, cpu_compile="on")
    ref_model, _ = load_model(path)
    graphs = graphs_for(model)
    errs = {"compiled": 0.0, "eager": 0.0}
    with torch.inference_mode():
        cache = graphs.cache("target", 1, 64)
        caches = [KVCache.for_model(m, 1, 64) for m in (model, ref_model)]
        g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
        for draw in range(8):
            k, v = torch.randn(cache.k.shape, generator=g), torch.randn(cache.v.shape, generator=g)
            for c in (cache, *caches):
                c.k.copy_(k)
                c.v.copy_(v)
            start = torch.randint(1, 60, (1,), generator=g)
            tokens = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)
            model.cpu_compile = True
            if draw == 0:
                out, code = run_and_get_code(graphs.forward, tokens, cache, start)
                assert ("scaled_dot_product" in code[0]) == sdpa
            else:
                out = graphs.forward(tokens, cache, start)
            model.cpu_compile = False
            eager = model(tokens, caches[0], start, static=True)
            ref = ref_model(tokens, caches[1], start, static=True)
            if dtype == "float32":
                torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
            errs["compiled"] += (out - ref).abs().mean().item()
            errs["eager"] += (eager - ref).abs().mean().item()
    if dtype == "bfloat16":
        assert errs["compiled"] <= 1.5 * errs["eager"], errs
