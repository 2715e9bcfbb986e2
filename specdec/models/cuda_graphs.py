"""CUDA graphs of the decode, verification and drafter steps.

A decode step launches a few hundred small kernels (about a dozen per layer); at batch 1
their launch cost is comparable to the work. `CudaGraphs` captures the host-sync-free
forward `model(tokens, cache, start_pos, layers=..., static=True)` once per (cache, T,
layers) and replays it:

    graphs = graphs_for(model)                          # one per model, kept on it
    cache = graphs.cache("target", batch, max_len)      # static KV cache, reused across calls
    logits = graphs.forward(tokens, cache, start_pos)   # [B, T, V]; captured on first use

- Static inputs: each graph owns a tokens [B, T] and a start_pos [B] buffer; a call copies
  into them (device to device, no sync) and replays. The per-sequence lengths stay device
  tensors throughout.
- Static KV cache: a graph holds its cache's addresses, so caches come from `cache(role, ...)`
  and live as long as their graphs. Asked for a batch size the role's cache does not have,
  or for more slots, the cache is replaced and its graphs dropped; lengths are rounded up to
  256 slots so that calls of similar lengths share one cache (attention skips unused slots;
  compiled CPU steps, which attend over every slot, take the next power of two >= 64).
- Outputs: the returned logits are the graph's static output, valid until that graph
  replays again (the decoding loops consume them before the next step).
- One graph per T: decode (T = 1), verification (T = k + 1; a round that drafts fewer tokens
  has its own T, so the captured path computes exactly what the uncaptured one does), the
  self-drafter's one-token step (its layer subset).
- Capture: one eager run of the static forward on a side stream first (Triton compiles its
  kernels there; the run writes the same KV entries the replay writes), then the capture and
  a replay. Each graph has its own memory pool, so graphs never overwrite each other's outputs.
- Greedy draft chains: `chain(first, cache, base, k, layers=...)` replays the k - 1 one-token
  steps of a greedy draft chain (step, argmax, feed the argmax back) as one graph, so a
  self-drafter's round is a catch-up replay plus one chain replay instead of k - 1 replays
  with a few eager ops and a host sync between each (measured on an H200: about 1 ms of a
  13.5 ms early-exit round on the Llama-3-8B shape went to those). One graph per (cache, k,
  layers).
- Warm-up: `warm(cache, widths, layers=...)` compiles / captures a set of step widths up
  front (the experiment runner's warm-up does, so its timed generations hold no compilation).
- Off CUDA there are no graphs: `forward` runs the static forward uncaptured, which keeps the
  plumbing testable on CPU.

`resolve_cuda_graphs(model, option)` turns the `cuda_graphs` option of the decoding loops
into a bool: None means on for a model on CUDA (and off for a layer-streamed one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError
from specdec.kernels.utils import cdiv
from specdec.models.transformer import KVCache, Transformer

CACHE_ROUND = 256  # static caches hold a multiple of this many slots
# compiled CPU steps (cpu_compile) attend over every slot of the static cache, masked (a
# SmolLM2 fp32 step: 53.2 / 53.2 / 54.3 ms over 64 / 128 / 256 slots, 2-core EPYC, once the
# KV writes stayed in place). Every cache size is a graph of its own (a minute or two of
# compilation per T), so their caches hold the next power of two >= 64 slots: never more
# than twice the slots needed, and a run whose prompts grow meets a few sizes (rounding to
# 64 compiled anew every 64 tokens); the runner's warm-up sizes them for the longest prompt
CPU_COMPILE_MIN_SLOTS = 64


def resolve_cuda_graphs(model: Transformer, option: bool | None) -> bool:
    """The `cuda_graphs` option for `model`: None = on iff the model is on CUDA and not
    layer-streamed, or on CPU with compiled steps (`cpu_compile`, which compiles the steps
    this class would capture); True on a CPU model runs the static (capturable) path
    uncaptured."""
    streamed = getattr(model, "layer_stream", None) is not None
    if getattr(model, "cpu_compile", False):
        if streamed:
            raise SpecDecError("cpu_compile=on cannot compile a layer-streamed model")
        if option is False:
            raise SpecDecError(
                "cpu_compile=on compiles the static decode steps, which cuda_graphs=off "
                "turns off: drop one of the two"
            )
        return True
    if option is None:
        return model.device.type == "cuda" and not streamed
    if option and streamed:
        raise SpecDecError(
            "CUDA graphs cannot capture a layer-streamed model (its layers are copied in "
            "every step); run it with cuda_graphs off"
        )
    return bool(option)


def graphs_for(model: Transformer) -> CudaGraphs:
    """The model's CudaGraphs (created on first use and kept on the model)."""
    graphs = getattr(model, "_cuda_graphs", None)
    if graphs is None:
        graphs = CudaGraphs(model)
        model._cuda_graphs = graphs
    return graphs


def _key(role: str, n: int, layers: Sequence[int] | None) -> tuple:
    """A graph's key: the cache's role, its width T (or chain length k), the layer subset."""
    return role, n, None if layers is None else tuple(layers)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B, T] static input
    start_pos: torch.Tensor  # [B] static input
    logits: torch.Tensor  # [B, T, V] static output


@dataclass
class _Chain:
    graph: torch.cuda.CUDAGraph
    first: torch.Tensor  # [B] static input: the chain's first token
    base: torch.Tensor  # [B] static input: the cache slot the first token goes to
    tokens: torch.Tensor  # [B, k] static output: first, then the k - 1 greedy guesses


class CudaGraphs:
    """Static KV caches of one model (by role) and the graphs captured on them."""

    def __init__(self, model: Transformer):
        self.model = model
        self.caches: dict[str, KVCache] = {}
        self.graphs: dict[tuple[str, int, tuple[int, ...] | None], _Graph] = {}
        self.chains: dict[tuple[str, int, tuple[int, ...] | None], _Chain] = {}
        self.captures = 0  # graphs captured so far
        self.warmed: set[tuple[str, int, tuple[int, ...] | None]] = set()  # by `warm`
        self._compiled = None  # CPU: the compiled static forward (cpu_compile)

    def cache(self, role: str, batch: int, max_len: int) -> KVCache:
        """The role's static cache ("target", "draft"), reused when it has `batch` sequences
        and at least `max_len` slots; else a new one (the old one's graphs are dropped)."""
        cache = self.caches.get(role)
        if cache is None or cache.batch != batch or cache.max_len < max_len:
            self.drop(role)
            if getattr(self.model, "cpu_compile", False):
                slots = max(CPU_COMPILE_MIN_SLOTS, 1 << (max_len - 1).bit_length())
            else:
                slots = cdiv(max_len, CACHE_ROUND) * CACHE_ROUND
            cache = self.caches[role] = KVCache.for_model(self.model, batch, slots)
        return cache

    def drop(self, role: str | None = None) -> None:
        """Free a role's cache and graphs (every role's when None)."""
        for r in [role] if role is not None else list(self.caches):
            self.caches.pop(r, None)
            for key in [k for k in self.graphs if k[0] == r]:
                del self.graphs[key]
            for key in [k for k in self.chains if k[0] == r]:
                del self.chains[key]
            self.warmed = {k for k in self.warmed if k[0] != r}

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        start_pos: torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`model(tokens, cache, start_pos, layers=layers)` from a CUDA graph -> logits
        [B, T, V] fp32 (the graph's output buffer). start_pos + T must fit the cache."""
        role = self._role(cache, "forward")
        if tokens.shape[0] != cache.batch or start_pos.shape != (cache.batch,):
            raise ValueError(
                f"tokens {tuple(tokens.shape)} / start_pos {tuple(start_pos.shape)} do not "
                f"match the cache's batch of {cache.batch}"
            )
        if self.model.device.type != "cuda":
            return self._static_step(layers)(tokens, cache, start_pos)
        key = _key(role, tokens.shape[1], layers)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(tokens, cache, start_pos, layers)
        else:
            g.tokens.copy_(tokens)
            g.start_pos.copy_(start_pos)
        g.graph.replay()
        return g.logits

    @torch.inference_mode()
    def chain(
        self,
        first: torch.Tensor,
        cache: KVCache,
        base: torch.Tensor,
        k: int,
        *,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """A greedy draft chain of k tokens from `first` [B] (the guess the round's first
        forward made): feed it at cache slot base [B], take the argmax, feed that at base + 1,
        ... -> tokens [B, k] (first, then k - 1 argmaxes; the graph's output buffer, valid
        until this chain replays again; for k = 1, which runs no step, `first` itself). Writes the KV entries of slots base .. base + k - 2,
        as k - 1 calls of `forward` on one token would, and computes exactly what they do
        followed by `argmax(-1)` (the same static forward; captured on CUDA as one graph)."""
        role = self._role(cache, "chain")
        B = cache.batch
        if first.shape != (B,) or base.shape != (B,):
            raise ValueError(
                f"first {tuple(first.shape)} / base {tuple(base.shape)} do not match the "
                f"cache's batch of {B}"
            )
        if k < 1:
            raise ValueError(f"a draft chain has k >= 1 tokens, got {k}")
        if k == 1:
            return first[:, None]
        if self.model.device.type != "cuda":
            return self._chain_steps(first, cache, base, k, self._static_step(layers))
        key = _key(role, k, layers)
        c = self.chains.get(key)
        if c is None:
            c = self.chains[key] = self._capture_chain(first, cache, base, k, layers)
        else:
            c.first.copy_(first)
            c.base.copy_(base)
        c.graph.replay()
        return c.tokens

    def _role(self, cache: KVCache, what: str) -> str:
        role = next((r for r, c in self.caches.items() if c is cache), None)
        if role is None:
            raise ValueError(f"CudaGraphs.{what} needs a cache made by CudaGraphs.cache()")
        return role

    def _static_step(self, layers):
        """(tokens, cache, start_pos) -> logits: the static forward over `layers`, compiled
        under cpu_compile (what `forward` runs off CUDA, and what its graphs capture)."""
        if getattr(self.model, "cpu_compile", False):
            step = self._compiled_step()
            return lambda tok, cache, pos: step(tok, cache, pos, layers)
        return lambda tok, cache, pos: self.model(tok, cache, pos, layers=layers, static=True)

    @staticmethod
    def _chain_steps(first, cache, base, k, step) -> torch.Tensor:
        out = torch.empty(first.shape[0], k, dtype=torch.long, device=first.device)
        out[:, 0] = first
        tok = first
        for i in range(1, k):
            tok = step(tok[:, None], cache, base + (i - 1))[:, 0].argmax(-1)
            out[:, i] = tok
        return out

    def _capture_chain(self, first, cache, base, k, layers) -> _Chain:
        static_first, static_base = first.clone(), base.clone()
        step = self._static_step(layers)

        def run():
            return self._chain_steps(static_first, cache, static_base, k, step)

        graph, tokens = self._record(run, first.device)
        return _Chain(graph, static_first, static_base, tokens)

    @torch.inference_mode()
    def warm_chains(
        self, cache: KVCache, ks: Sequence[int], *, layers: Sequence[int] | None = None
    ) -> int:
        """Capture the greedy draft chains of each length in `ks` (>= 2; a chain of 1 token
        runs no step) on `cache` now -> the number newly warmed. Like `warm`, they write
        KV entries from slot 0 that the next prefill overwrites. Nothing to do off CUDA."""
        role = self._role(cache, "warm_chains")
        if self.model.device.type != "cuda":
            return 0
        B = cache.batch
        n = 0
        for k in sorted(set(ks)):
            if k < 2:
                continue
            if k - 1 > cache.max_len:
                raise ValueError(f"chain of {k} outside the cache's {cache.max_len} slots")
            if _key(role, k, layers) in self.chains:
                continue
            base = torch.zeros(B, dtype=torch.long, device=cache.lens.device)
            first = torch.randint(0, self.model.config.vocab_size, (B,), device=base.device)
            self.chain(first, cache, base, k, layers=layers)
            n += 1
        return n

    @torch.inference_mode()
    def warm(
        self, cache: KVCache, widths: Sequence[int], *, layers: Sequence[int] | None = None
    ) -> int:
        """Compile (cpu_compile) or capture (CUDA) the step of each width T in `widths` on
        `cache` now, so that a timed generation does not pay for it -> the number of steps
        newly warmed (a width already warmed on this cache is skipped). The steps write
        random tokens' KV entries from slot 0; they are never read: the next prefill
        overwrites them and sets the cache's lengths."""
        role = self._role(cache, "warm")
        B = cache.batch
        start = torch.zeros(B, dtype=torch.long, device=cache.lens.device)
        V = self.model.config.vocab_size
        n = 0
        for T in sorted(set(widths)):
            if not 1 <= T <= cache.max_len:
                raise ValueError(f"step width {T} outside 1..{cache.max_len} (the cache)")
            key = _key(role, T, layers)
            if key in self.warmed:
                continue
            tokens = torch.randint(0, V, (B, T), device=start.device)
            self.forward(tokens, cache, start, layers=layers)
            self.warmed.add(key)
            n += 1
        return n

    def _compiled_step(self):
        """torch.compile of the static forward (specdec.models.cpu_compile): dynamo keeps
        one graph per (T, cache size, layers) under this one callable."""
        if self._compiled is None:
            from specdec.models.cpu_compile import configure_dynamo

            configure_dynamo()
            model = self.model

            def step(tokens, cache, start_pos, layers):
                return model(tokens, cache, start_pos, layers=layers, static=True)

            self._compiled = torch.compile(step, dynamic=False)
        return self._compiled

    def _capture(self, tokens, cache, start_pos, layers) -> _Graph:
        static_tokens, static_start = tokens.clone(), start_pos.clone()
        step = self._static_step(layers)

        def run():
            return step(static_tokens, cache, static_start)

        graph, logits = self._record(run, tokens.device)
        return _Graph(graph, static_tokens, static_start, logits)

    def _record(self, run, device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run `run` once eagerly on a side stream (Triton compiles there), then capture it
        -> (graph, its output tensor). The caller replays the graph to compute."""
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        self.captures += 1
        return graph, out
