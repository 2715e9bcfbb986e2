"""Plain autoregressive generation (the baseline speculative decoding is measured against).

A batch of prompts of different lengths is right-padded and prefilled in one forward
(the causal rule hides the padding from every real query); each step then feeds one token
per sequence at its own position. Sequences that hit a stop token keep their slot but
their outputs are ignored; generation ends when all have stopped or `max_new_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.decode.sampling import SamplingParams, next_token
from specdec.errors import SpecDecError
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.transformer import KVCache, Transformer


@dataclass
class GenerationResult:
    prompt_ids: list[list[int]]
    tokens: list[list[int]]  # generated ids per sequence (a hit stop token is included)
    finish_reasons: list[str]  # "stop" | "length"
    elapsed_s: float  # prefill + decode wall time
    prefill_s: float
    stats: dict = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0


def check_prompts(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, slack: int = 0
):
    """Validate a batch and return the cache length it needs."""
    if not prompts:
        raise SpecDecError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise SpecDecError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise SpecDecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    V = model.config.vocab_size
    if any(t < 0 or t >= V for p in prompts for t in p):
        raise SpecDecError(f"prompt token id outside the vocabulary [0, {V})")
    need = max(len(p) for p in prompts) + max_new_tokens
    ctx = model.config.max_seq_len
    if need > ctx:
        raise SpecDecError(
            f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"= {need} exceeds the model's context length {ctx}"
        )
    return need + slack  # need <= ctx was checked above


def prefill(
    model: Transformer,
    prompts: list[list[int]],
    cache: KVCache,
    hidden_layers: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch prefill from slot 0; sets cache.lens; -> last-position logits [B, V]
    (with hidden_layers: and those layers' hidden states [B, T, n, dim], see Transformer)."""
    dev = model.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    T = int(lens.max())
    toks = torch.zeros(len(prompts), T, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = torch.tensor(p, device=dev)
    start = torch.zeros(len(prompts), dtype=torch.long, device=dev)
    out = model(toks, cache, start, logits_index=lens - 1, hidden_layers=hidden_layers)
    cache.lens.copy_(lens)
    if hidden_layers is None:
        return out[:, 0]
    return out[0][:, 0], out[1]


def make_generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# the caches as generate makes them (inference tensors: dynamo guards on that)
@torch.inference_mode()
def warm_up(
    model: Transformer,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    cuda_graphs: bool | None = None,
) -> int:
    """Compile (cpu_compile) or capture (CUDA graphs) the decode step that `generate` on
    `batch` prompts of up to `prompt_len` tokens will run, on a static cache sized for them
    -> the number of steps warmed (0 with the eager path)."""
    if not resolve_cuda_graphs(model, cuda_graphs):
        return 0
    max_len = check_prompts(model, [[0] * prompt_len] * batch, max_new_tokens)
    graphs = graphs_for(model)
    return graphs.warm(graphs.cache("target", batch, max_len), [1])


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    stop_ids: set[int] | frozenset[int] = frozenset(),
    seed: int | None = None,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    cuda_graphs: bool | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. `on_tokens` gets each step's new tokens
    per sequence (for streaming). `cuda_graphs`: replay the decode step from a CUDA graph
    (None: on for a model on CUDA; see specdec.models.cuda_graphs)."""
    max_len = check_prompts(model, prompts, max_new_tokens)
    B = len(prompts)
    gen = make_generator(model.device, seed)
    graphs = graphs_for(model) if resolve_cuda_graphs(model, cuda_graphs) else None
    cache = graphs.cache("target", B, max_len) if graphs else KVCache.for_model(model, B, max_len)
    step = graphs.forward if graphs else model
    out: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    active = [True] * B
    stream = getattr(model, "layer_stream", None)  # layer-streamed target: count bytes moved
    streamed = stream.bytes_streamed if stream is not None else 0
    t0 = time.perf_counter()
    logits = prefill(model, prompts, cache)
    cur = next_token(logits, params, gen)  # [B]
    t_prefill = time.perf_counter() - t0
    steps = 0
    while True:
        cur_list = cur.tolist()
        new = [[] for _ in range(B)]
        for b in range(B):
            if active[b]:
                out[b].append(cur_list[b])
                new[b].append(cur_list[b])
                if cur_list[b] in stop_ids:
                    active[b], reasons[b] = False, "stop"
                elif len(out[b]) >= max_new_tokens:
                    active[b] = False
        if on_tokens is not None:
            on_tokens(new)
        if not any(active):
            break
        logits = step(cur[:, None], cache, cache.lens)[:, 0]
        cache.lens += 1
        steps += 1
        cur = next_token(logits, params, gen)
    elapsed = time.perf_counter() - t0
    stats = {"target_forwards": steps + 1, "rounds": steps + 1}
    if stream is not None:
        stats.update(stream.stats(streamed, sum(len(o) for o in out)))
    return GenerationResult([list(p) for p in prompts], out, reasons, elapsed, t_prefill, stats)
