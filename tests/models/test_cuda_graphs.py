"""The graph-safe forward (`static=True`) against the eager one, and CUDA graphs against
uncaptured decoding: on CPU the static path and the CudaGraphs plumbing (uncaptured there),
on a GPU the captured graphs themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.decode.drafters import ModelDrafter, make_drafter
from specdec.decode.generation import generate, prefill
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.load import load_model
from specdec.models.transformer import KVCache

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _steps(model, prompts, Ts, static, layers=None, garbage=False):
    """Prefill (eager), then forwards of T = Ts[0], Ts[1], ... tokens per sequence at each
    sequence's own length: (concatenated logits, cache)."""
    B = len(prompts)
    cache = KVCache.for_model(model, B, 48)
    if garbage:  # stale entries past the lengths must never be seen
        cache.k.normal_()
        cache.v.normal_()
    g = torch.Generator().manual_seed(1)
    outs = []
    with torch.inference_mode():
        prefill(model, prompts, cache)
        for T in Ts:
            toks = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
            toks = toks.to(model.device)
            outs.append(model(toks, cache, cache.lens, layers=layers, static=static))
            cache.lens += T
    return torch.cat(outs, 1), cache


def _committed(cache):
    """KV entries below each sequence's length."""
    return [(cache.k[:, b, :, :n], cache.v[:, b, :, :n]) for b, n in enumerate(cache.lens)]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("B", [1, 3])
def test_static_forward_matches_eager(tiny_dir, arch, tie, B):
    model, _ = load_model(str(tiny_dir(arch, tie)), backend="torch")
    prompts = [[5, 6, 7, 8, 9, 10, 11][: 7 - 2 * b] for b in range(B)]  # lengths 7, 5, 3
    Ts = [1, 4, 1, 9, 1]  # decode and verification of k = 3 and k = 8 drafts
    ref, ref_cache = _steps(model, prompts, Ts, static=False)
    out, cache = _steps(model, prompts, Ts, static=True, garbage=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for (k, v), (rk, rv) in zip(_committed(cache), _committed(ref_cache)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def test_static_forward_layer_subset(tiny_dir):
    model, _ = load_model(str(tiny_dir("llama", False, layers=4)), backend="torch")
    prompts = [[3, 4, 5, 6], [7, 8]]
    ref, _ = _steps(model, prompts, [1, 3, 1], static=False, layers=[0, 2])
    out, _ = _steps(model, prompts, [1, 3, 1], static=True, layers=[0, 2], garbage=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_static_forward_triton_is_exact(tiny_dir):
    """On the Triton backend both paths run the same kernels: bitwise equal logits."""
    model, _ = load_model(str(tiny_dir("llama", False)), quantize="int4", backend="triton")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ref, _ = _steps(model, prompts, [1, 4], static=False)
    out, _ = _steps(model, prompts, [1, 4], static=True)
    assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def tiny4(tiny_dir):
    return load_model(str(tiny_dir("llama", False, layers=4)))


def _prompts(tok):
    texts = ["The quick brown fox", "def add(a, b):\n    return", "1 + 2 = 3, 10 * 7 ="]
    return [tok.encode(t) for t in texts]


def _drafters(model, draft_model):
    return {
        "layerskip": make_drafter("layerskip", model, skip="every2"),
        "early_exit": make_drafter("early_exit", model, exit_layer=2),
        "early_exit_own_cache": make_drafter("early_exit", model, exit_layer=2, share_cache=False),
        "model": ModelDrafter(draft_model),
    }


def _check_graphs_match_uncaptured(
    model, tok, draft_model, kinds, ks, n_new, batches, spec_ref="plain"
):
    """Greedy tokens with cuda_graphs on == with them off. Speculative decoding with graphs
    is compared to plain greedy decoding without them (spec_ref="plain": the lossless claim
    too) or to the same speculative decoder without them (spec_ref="uncaptured": graphs
    alone, for bf16 on a GPU, whose verification rows (tl.dot) round differently from
    decode rows, so near-ties can flip between speculative and plain decoding)."""
    prompts = _prompts(tok)

    def speculative(kind, k, batch, graphs):
        drafter = _drafters(model, draft_model)[kind]
        schedule = make_schedule("constant", k)
        dec = SpeculativeDecoder(model, drafter, schedule=schedule, cuda_graphs=graphs)
        return dec.generate(batch, n_new).tokens

    for B in batches:  # B > 1: prompts of different lengths
        batch = prompts[:B]
        ref = generate(model, batch, n_new, cuda_graphs=False).tokens
        assert generate(model, batch, n_new, cuda_graphs=True).tokens == ref
        for kind in kinds:
            for k in ks:
                want = ref if spec_ref == "plain" else speculative(kind, k, batch, False)
                assert speculative(kind, k, batch, True) == want, (kind, k, B)


def test_graph_plumbing_on_cpu(tiny4, tiny_dir):
    """cuda_graphs=True on CPU runs the static path through CudaGraphs (uncaptured)."""
    model, tok = tiny4
    draft, _ = load_model(str(tiny_dir("llama", False, layers=2, seed=7)))
    kinds = ["layerskip", "early_exit_own_cache", "model"]
    _check_graphs_match_uncaptured(model, tok, draft, kinds, ks=(3,), n_new=16, batches=(3,))
    graphs = graphs_for(model)
    assert set(graphs.caches) == {"target", "draft"}
    assert graphs.captures == 0  # no capture off CUDA
    assert "draft" in graphs_for(draft).caches


def test_static_caches_are_reused_and_replaced(tiny4):
    model, tok = tiny4
    graphs = graphs_for(model)
    graphs.drop()
    prompts = _prompts(tok)
    generate(model, prompts[:1], 8, cuda_graphs=True)
    first = graphs.caches["target"]
    assert first.max_len % 256 == 0 and first.batch == 1
    generate(model, prompts[:1], 12, cuda_graphs=True)
    assert graphs.caches["target"] is first  # same batch, fits: reused
    generate(model, prompts, 8, cuda_graphs=True)
    assert graphs.caches["target"] is not first and graphs.caches["target"].batch == 3
    with pytest.raises(ValueError, match="CudaGraphs.cache"):
        graphs.forward(torch.zeros(1, 1, dtype=torch.long), first, first.lens)


def test_resolve_cuda_graphs():
    cpu = SimpleNamespace(device=torch.device("cpu"), layer_stream=None)
    cuda = SimpleNamespace(device=torch.device("cuda"), layer_stream=None)
    streamed = SimpleNamespace(device=torch.device("cuda"), layer_stream=object())
    assert resolve_cuda_graphs(cpu, None) is False
    assert resolve_cuda_graphs(cuda, None) is True
    assert resolve_cuda_graphs(cpu, True) is True
    assert resolve_cuda_graphs(streamed, None) is False
    assert resolve_cuda_graphs(cuda, False) is False
    with pytest.raises(SpecDecError, match="layer-streamed"):
        resolve_cuda_graphs(streamed, True)


# -- GPU: captured graphs ------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_captured_matches_uncaptured_tiny(tiny_dir, dtype):
    """int4 GEMV + verify_attention, every drafter, B = 1 and 3: speculative decoding with
    graphs equals plain greedy decoding without them. fp32: every row takes the broadcast
    path. bf16: batch-invariant mode (auto) plans every row as one; the first H200 run,
    2026-12-04, before the mode, found bf16 speculative != plain greedy at token 22 of 32
    on this random model (verification rows through tl.dot), so without it the test only
    compares captured with uncaptured speculative decoding."""
    kw = dict(quantize="int4", group_size=32, dtype=dtype, device="cuda")
    model, tok = load_model(str(tiny_dir("llama", False, layers=4)), **kw)
    draft, _ = load_model(str(tiny_dir("llama", False, layers=2, seed=7)), **kw)
    assert model.backend == "triton"
    kinds = ["layerskip", "early_exit", "early_exit_own_cache", "model"]
    spec_ref = "plain" if dtype == "float32" or model.batch_invariant else "uncaptured"
    _check_graphs_match_uncaptured(
        model, tok, draft, kinds, ks=(2, 8), n_new=32, batches=(1, 3), spec_ref=spec_ref
    )
    assert graphs_for(model).captures > 0 and graphs_for(draft).captures > 0
    # the self-drafters' greedy chains replayed as chain graphs (CudaGraphs.chain)
    assert graphs_for(model).chains and graphs_for(draft).chains


@pytest.mark.gpu
@gpu
def test_captured_matches_uncaptured_smollm2_shape():
    """A random model of SmolLM2-135M's shape (30 layers, GQA 9/3, head dim 64, Q4_1 + tied
    Q8_0 head). Its greedy output is nearly constant, so real drafters are always accepted:
    at B = 1 the bench's controlled drafters (alpha 0.6) force rejections and rollbacks."""
    from benchmarks.harness import MODEL_SHAPES
    from benchmarks.models import controlled_drafter, random_model

    model = random_model(MODEL_SHAPES["smollm2-135m"], "q4_1", torch.device("cuda"), seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    ref = generate(model, prompts[:1], 48, cuda_graphs=False).tokens
    assert generate(model, prompts[:1], 48, cuda_graphs=True).tokens == ref
    for kind in ("layerskip", "early_exit"):
        for k in (2, 4, 8):
            drafter = controlled_drafter(kind, model, ref[0], len(prompts[0]), 0.6)
            dec = SpeculativeDecoder(model, drafter, schedule=make_schedule("constant", k))
            res = dec.generate(prompts[:1], 48)
            assert res.tokens == ref and res.stats["alpha"] < 0.9, (kind, k)
    ref = generate(model, prompts, 48, cuda_graphs=False).tokens
    assert generate(model, prompts, 48, cuda_graphs=True).tokens == ref
    for kind, kw in [("layerskip", {"skip": "every2"}), ("early_exit", {"exit_layer": 8})]:
        dec = SpeculativeDecoder(
            model, make_drafter(kind, model, **kw), schedule=make_schedule("constant", 4)
        )
        assert dec.generate(prompts, 48).tokens == ref, kind


@pytest.mark.gpu
@gpu
def test_graph_replay_is_faster_than_eager():
    """Sanity of the point of it all: a captured SmolLM2-shape decode step beats eager."""
    from benchmarks.harness import MODEL_SHAPES
    from benchmarks.models import random_model, step_ms

    model = random_model(MODEL_SHAPES["smollm2-135m"], "q4_1", torch.device("cuda"), seed=0)
    eager = step_ms(model, T=1, graphs=False)
    captured = step_ms(model, T=1, graphs=True)
    assert captured < eager


def test_drafter_catch_up_goes_through_graphs(tiny4, monkeypatch):
    """A model drafter's first forward of a round (the pending token and any accepted draft
    it has not fed yet: T >= 1) runs through CudaGraphs when graphs are on, like its
    one-token steps; eager, it cost 6-15 ms of an 18-32 ms round on an H200. On CPU the
    graph path runs uncaptured: the tokens must still equal plain greedy decoding's."""
    from specdec.models.cuda_graphs import CudaGraphs

    model, tok = tiny4
    calls = []
    forward = CudaGraphs.forward

    def spy(self, tokens, cache, start_pos, *, layers=None):
        role = next(r for r, c in self.caches.items() if c is cache)
        calls.append((role, tokens.shape[1], layers))
        return forward(self, tokens, cache, start_pos, layers=layers)

    monkeypatch.setattr(CudaGraphs, "forward", spy)
    prompts = _prompts(tok)
    ref = generate(model, prompts, 24, cuda_graphs=False).tokens
    for kind in ("layerskip", "early_exit_own_cache"):
        calls.clear()
        drafter = _drafters(model, None)[kind]
        eager = []

        def counted(*a, drafter=drafter, eager=eager, **kw):
            eager.append(a[0].shape[1])
            return type(drafter)._forward(drafter, *a, **kw)

        drafter._forward = counted
        dec = SpeculativeDecoder(
            model, drafter, schedule=make_schedule("constant", 3), cuda_graphs=True
        )
        assert dec.generate(prompts, 24).tokens == ref, kind
        widths = {T for _, T, layers in calls if layers is not None}
        if kind == "layerskip":
            # the target's cache holds every committed token: catch-up T = 1, all captured
            assert eager == [] and widths == {1}
        else:
            # an own cache: its prompt prefill stays eager, then it lags by the accepted
            # drafts it was not fed (T = 2)
            assert eager == [max(len(p) for p in prompts) + 1]  # + the pending token
            assert 2 in widths and widths <= {1, 2, 3, 4}
    # warm-up captures the catch-up widths too (uncaptured on CPU: counted, not captured)
    graphs_for(model).drop()
    dec = SpeculativeDecoder(
        model,
        _drafters(model, None)["early_exit_own_cache"],
        schedule=make_schedule("constant", 3),
        cuda_graphs=True,
    )
    assert dec.warm_up(3, 8, 8) == 4 + 4  # target T = 1..4, draft T = 1..4
    # (on CUDA also the chains of 2 and 3 tokens: CudaGraphs.warm_chains, nothing off CUDA)


def test_chain_equals_steps(tiny4):
    """CudaGraphs.chain (uncaptured on CPU) = k - 1 one-token forwards, each fed the
    previous argmax: the same tokens, and the same KV entries written at base .. base + k - 2.
    B = 3 at different positions; the layer subset of an early-exit drafter."""
    model, _ = tiny4
    graphs = graphs_for(model)
    graphs.drop()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    V, k, layers = model.config.vocab_size, 5, [0, 1]
    caches = [graphs.cache("draft", 3, 64)]
    caches.append(KVCache.for_model(model, 3, caches[0].max_len))
    for c in caches[:1]:  # the same random history in both
        c.k.copy_(torch.randn(c.k.shape, generator=g))
        c.v.copy_(torch.randn(c.v.shape, generator=g))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    base = torch.tensor([7, 3, 12])
    first = torch.randint(0, V, (3,), generator=g)
    with torch.inference_mode():
        got = graphs.chain(first, caches[0], base, k, layers=layers).clone()
        want, tok = [first], first
        for i in range(k - 1):
            logits = model(tok[:, None], caches[1], base + i, layers=layers)[:, 0]
            tok = logits.argmax(-1)
            want.append(tok)
    assert torch.equal(got, torch.stack(want, 1))
    for b in range(3):
        n = int(base[b]) + k - 1  # every slot up to the last fed token
        torch.testing.assert_close(caches[0].k[:, b, :, :n], caches[1].k[:, b, :, :n])
        torch.testing.assert_close(caches[0].v[:, b, :, :n], caches[1].v[:, b, :, :n])
    assert torch.equal(graphs.chain(first, caches[0], base, 1), first[:, None])  # no step
    with pytest.raises(ValueError, match="k >= 1"):
        graphs.chain(first, caches[0], base, 0)
    with pytest.raises(ValueError, match="CudaGraphs.chain needs a cache"):
        graphs.chain(first, caches[1], base, 2)


def test_greedy_rounds_use_the_chain(tiny4, monkeypatch):
    """With graphs on, a greedy round of a model drafter is one catch-up forward + one chain
    (no per-step forwards); sampling and a p_min cut run step by step. Tokens equal either
    way (greedy: plain greedy's; sampled: the same seed's with chains off)."""
    from specdec.decode.sampling import SamplingParams
    from specdec.models.cuda_graphs import CudaGraphs

    model, tok = tiny4
    calls = []
    chain, forward = CudaGraphs.chain, CudaGraphs.forward

    def spy_chain(self, first, cache, base, k, *, layers=None):
        calls.append(("chain", k))
        return chain(self, first, cache, base, k, layers=layers)

    def spy_forward(self, tokens, cache, start_pos, *, layers=None):
        if layers is not None:
            calls.append(("forward", tokens.shape[1]))
        return forward(self, tokens, cache, start_pos, layers=layers)

    rounds = []
    run_round = SpeculativeDecoder.run_round

    def spy_round(self, state, k, stats):
        rounds.append(int(k.max()))
        return run_round(self, state, k, stats)

    monkeypatch.setattr(SpeculativeDecoder, "run_round", spy_round)
    monkeypatch.setattr(CudaGraphs, "chain", spy_chain)
    monkeypatch.setattr(CudaGraphs, "forward", spy_forward)
    prompts = _prompts(tok)
    ref = generate(model, prompts, 20, cuda_graphs=False).tokens

    def run(kind, chains, accept="greedy", **kw):
        drafter = _drafters(model, None)[kind]
        drafter.chain_graphs = chains
        sched = make_schedule("constant", 4)
        dec = SpeculativeDecoder(model, drafter, accept, schedule=sched, cuda_graphs=True)
        calls.clear()
        rounds.clear()
        return dec.generate(prompts, 20, **kw)

    for kind in ("layerskip", "early_exit_own_cache"):
        res = run(kind, True)
        assert res.tokens == ref, kind
        # every round: one catch-up forward, then one chain of the round's k; the chain runs
        # steps except in the last rounds, where the token budget leaves k = 1
        n_forward = sum(c == "forward" for c, _ in calls)
        chains = [k for c, k in calls if c == "chain"]
        n_chain = sum(k > 1 for k in chains)
        eager = kind == "early_exit_own_cache"  # its first catch-up is the prompt: eager
        assert n_forward == len(rounds) - eager, kind
        assert chains == [k for k in rounds if k >= 1], kind
        assert len(rounds) - 2 <= n_chain < len(rounds), kind
        assert {k for k in chains if k > 1} <= {2, 3, 4}
        assert run(kind, False).tokens == ref
        assert not any(c == "chain" for c, _ in calls)
    sampled = dict(accept="speculative", params=SamplingParams(temperature=0.8), seed=3)
    a = run("layerskip", True, **sampled)
    assert not any(c == "chain" for c, _ in calls)  # sampled: step by step
    assert a.tokens == run("layerskip", False, **sampled).tokens
