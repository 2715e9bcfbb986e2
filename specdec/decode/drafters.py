"""Drafters: propose up to k tokens per sequence for the target to verify.

Each round the engine hands the drafter a `DraftRequest`: the per-sequence history
(prompt + emitted tokens; the last one is *pending*: emitted but not yet fed to the
target), how many drafts each sequence wants and what the k schedule decided for this
round (e.g. the confidence schedule's p_min). The drafter returns

    Draft(tokens [B, k] int64, probs [B, k, V] fp32 or None, n_draft [B] int64)

`probs` are the drafter's processed distributions q (None for drafters without a model:
acceptance rules treat q as one-hot). After verification the engine calls `commit` with
the number of accepted drafts per sequence: a drafter with state (a KV cache, a learned
acceptance estimate) rolls back or updates there; that feedback is the drafter's own.

- ModelDrafter ("model"): a separate draft model with its own KV cache (vocabulary must
  match), given as a Transformer or as a registered name / .gguf / HF directory. Built
  through `build_drafter` with the target's tokenizer, a draft model whose vocabulary
  differs becomes a CrossTokenizerDrafter ("cross_tokenizer", specdec.decode.cross_tokenizer:
  drafts text, re-encoded with the target's tokenizer).
- LayerSkipDrafter ("layerskip"): the target with some layers skipped.
- EarlyExitDrafter ("early_exit"): the target's first N layers, then the final norm and
  LM head. The two self-drafters share the target's KV cache by default: the committed
  prefix in it was computed by the full target (for early exit that is exactly what the
  draft would compute itself), the draft writes its guesses into slots after the prefix,
  and the verification forward overwrites them. With share_cache=False they keep their own.
- NgramDrafter ("ngram"): prompt lookup, no model.
- DatastoreDrafter ("datastore", specdec.decode.datastore): prompt lookup, else retrieval
  from a datastore of text that ships with the machine (REST).

A new drafter is one subclass registered with `@register_drafter("name")` (its
constructor's keyword arguments are its options; a parameter called `target` receives
the target model, one called `target_tokenizer` the target's tokenizer) plus a config
file in configs/draft/ naming the class.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.decode.output_cache import SEP, OutputCache, frequent_chain, frequent_prefixes
from specdec.decode.registry import Registry
from specdec.decode.rollback import rollback_lens
from specdec.decode.sampling import SamplingParams, logits_to_probs, sample
from specdec.errors import SpecDecError
from specdec.kernels.argmax import argmax
from specdec.models.cuda_graphs import graphs_for, resolve_cuda_graphs
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import KVCache, Transformer

log = logging.getLogger(__name__)


@dataclass
class DraftRequest:
    """What the engine asks of the drafter in one round."""

    history: list[list[int]]  # per sequence: committed tokens + the pending one
    k: torch.Tensor  # [B] int64: drafts wanted (0 for finished sequences)
    params: SamplingParams  # the decoding's sampling parameters
    generator: torch.Generator | None = None
    p_min: float = 0.0  # > 0: stop a sequence at its first guess less confident than this
    # for drafters with `target_features`: the target's hidden states at those layers for the
    # tokens it committed since the last request (the prompt, then pending + accepted drafts):
    # features[b, :n_features[b]]
    features: torch.Tensor | None = None  # [B, T, n_layers, dim] fp32
    n_features: torch.Tensor | None = None  # [B] int64


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, k] int64 (entries past n_draft are padding)
    probs: torch.Tensor | None  # [B, k, V] fp32, or None
    n_draft: torch.Tensor  # [B] int64, <= k
    forwards: int = 0  # drafter forward passes spent


def draft_chain(
    request: DraftRequest,
    vocab_size: int,
    logits: torch.Tensor,
    pick: Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]],
    advance: Callable[[torch.Tensor, int], torch.Tensor],
) -> Draft:
    """The autoregressive draft loop of the model drafters: up to request.k[b] guesses per
    sequence, stopping a sequence at its first guess less confident than request.p_min.

    logits [B, V'] score the first guess; pick(logits, greedy) -> (tokens [B], q [B, V] or
    None when greedy); advance(tokens, i) feeds guess i and returns the next logits. Greedy
    drafts skip the [B, k, V] distributions (the acceptance rules treat q=None as one-hot).
    `forwards` of the result counts the advance calls only.
    """
    k, params = request.k, request.params
    B, kmax, dev = k.shape[0], int(k.max()), logits.device
    tokens = torch.zeros(B, max(kmax, 1), dtype=torch.long, device=dev)
    probs = None if params.greedy else torch.zeros(B, max(kmax, 1), vocab_size, device=dev)
    n_draft = torch.zeros(B, dtype=torch.long, device=dev)
    going = k > 0
    steps = 0
    for i in range(kmax):
        tok, q = pick(logits, probs is None)
        if request.p_min > 0:  # stop a sequence at its first unsure guess
            going = going & (torch.softmax(logits.float(), -1).amax(-1) >= request.p_min)
        going = going & (i < k)
        if not bool(going.any()):
            break
        tokens[:, i] = tok
        if probs is not None:
            probs[:, i] = q
        n_draft += going.long()
        if i + 1 == kmax:
            break
        logits = advance(tok, i)
        steps += 1
    return Draft(tokens[:, :kmax], None if probs is None else probs[:, :kmax], n_draft, steps)


class Drafter(ABC):
    """Base class. `begin` is called once per batch after the target's prefill; `name` is
    set by `register_drafter`."""

    name = "drafter"
    # target layers whose hidden states the drafter reads (DraftRequest.features)
    target_features: tuple[int, ...] = ()
    # True: no token-tree form (TreeRound refuses it by name)
    chains_only = False
    # True: proposes from the token history alone (no model, no target features), so its
    # greedy rounds can be replayed on recorded outputs (experiments.replay)
    model_free = False

    def begin(
        self,
        target: Transformer,
        target_cache: KVCache,
        prompts: list[list[int]],
        max_len: int,
        cuda_graphs: bool | None = False,
    ) -> None:
        """cuda_graphs: the engine's option (specdec.models.cuda_graphs); with it on, the
        target's cache comes from the target's CudaGraphs."""
        self.target, self.target_cache = target, target_cache

    def warm_up(
        self,
        target: Transformer,
        target_cache: KVCache,
        max_len: int,
        cuda_graphs=None,
        max_k: int = 1,
    ) -> int:
        """Compile / capture the drafter's fixed-shape steps for batches of the target
        cache's size needing `max_len` slots, drafting up to `max_k` tokens a round
        (SpeculativeDecoder.warm_up) -> steps warmed."""
        return 0

    @abstractmethod
    def propose(self, request: DraftRequest) -> Draft:
        """Up to request.k[b] drafts for each sequence b."""

    def commit(self, n_accepted: torch.Tensor) -> None:
        """Called after verification with the accepted draft count per sequence [B]."""

    def finish(self, outputs: list[list[int]]) -> None:
        """Called once a batch's generation has ended, with each sequence's generated
        tokens: a drafter that learns across sequences (NgramDrafter's output cache) keeps
        them there. Not called for a generation cut short by an exception."""

    def reset(self) -> None:
        """Forget what `finish` taught (experiments.run calls it after its warm-up, so no
        timed sequence drafts from a warm-up's output)."""


DRAFTERS: Registry[type[Drafter]] = Registry("drafter")
register_drafter = DRAFTERS.register  # class decorator: @register_drafter("name")


def drafter_class(name: str) -> type[Drafter]:
    """The drafter registered as `name` ('-' and '_' are the same: early-exit)."""
    return DRAFTERS.lookup(name.replace("-", "_"))


def build_drafter(
    cls: type[Drafter],
    target: Transformer,
    target_tokenizer: Tokenizer | None = None,
    **options,
) -> Drafter:
    """cls(**options), with the target passed as `target=` and its tokenizer as
    `target_tokenizer=` where the constructor takes them. A separate draft model ("model")
    whose vocabulary differs from the target's becomes the cross-tokenizer drafter (that
    needs `target_tokenizer`). Unknown options are a SpecDecError naming the ones the
    drafter takes."""
    DRAFTERS.check_options(cls, options, hidden=("target", "target_tokenizer"))
    if cls is ModelDrafter:
        return model_drafter(target, target_tokenizer, **options)
    takes = inspect.signature(cls).parameters
    if "target" in takes:
        options["target"] = target
    if "target_tokenizer" in takes:
        options["target_tokenizer"] = target_tokenizer
    return cls(**options)


def make_drafter(
    name: str, target: Transformer, target_tokenizer: Tokenizer | None = None, **options
) -> Drafter:
    """The drafter registered as `name` for `target`. One bag of options serves every
    drafter (as the CLI's flags do): those the drafter's constructor does not take are
    left out; `build_drafter` is the strict form."""
    cls = drafter_class(name)
    takes = inspect.signature(cls).parameters
    options = {k: v for k, v in options.items() if k in takes}
    return build_drafter(cls, target, target_tokenizer, **options)


class ForwardDrafter(Drafter):
    """Drafts with a model forward per token (a separate model, or the target's layers)."""

    def __init__(
        self, model: Transformer, layers: Sequence[int] | None = None, share_cache: bool = False
    ):
        self.model = model
        self.layers = None if layers is None else list(layers)
        self.share_cache = share_cache
        # greedy chains replay as one graph when graphs are on (off: one replay per step,
        # for A/B measurements: benchmarks/bench_e2e.py)
        self.chain_graphs = True

    def begin(self, target, target_cache, prompts, max_len, cuda_graphs=False) -> None:
        super().begin(target, target_cache, prompts, max_len)
        use_graphs = resolve_cuda_graphs(self.model, cuda_graphs)
        self.graphs = graphs_for(self.model) if use_graphs else None
        if self.share_cache:
            if self.model is not target:
                raise SpecDecError(
                    "only self-drafters (layer skip, early exit) can share the target's cache"
                )
            self.cache = target_cache
        elif self.graphs is not None:
            self.cache = self.graphs.cache("draft", len(prompts), max_len)
        else:
            self.cache = KVCache.for_model(self.model, len(prompts), max_len)
        # entries of the drafter cache that hold committed history (shared: the target's)
        self.valid = torch.zeros(len(prompts), dtype=torch.long, device=self.model.device)

    # the caches as generate makes them (inference tensors: dynamo guards on that)
    @torch.inference_mode()
    def warm_up(self, target, target_cache, max_len, cuda_graphs=None, max_k=1) -> int:
        if not resolve_cuda_graphs(self.model, cuda_graphs):
            return 0
        graphs = graphs_for(self.model)
        if self.share_cache:
            cache = target_cache
        else:
            cache = graphs.cache("draft", target_cache.batch, max_len)
        # the one-token steps, and on a GPU the catch-up forwards of 2..max_k + 1 tokens
        widths = [1] if getattr(self.model, "cpu_compile", False) else range(1, max_k + 2)
        n = graphs.warm(cache, widths, layers=self.layers)
        if self.chain_graphs:  # the greedy chains of 2..max_k tokens (captured on CUDA only)
            n += graphs.warm_chains(cache, range(2, max_k + 1), layers=self.layers)
        return n

    def _captured_catch_up(self) -> bool:
        """Whether the round's first (catch-up) forward replays a CUDA graph: with graphs on
        and the model on a GPU, where an eager forward costs a launch per kernel (measured
        on an H200: 6-15 ms of a 18-32 ms round). Compiled CPU steps keep it eager (every T
        would be one more compiled graph); CPU models with graphs on run it uncaptured."""
        return self.graphs is not None and not getattr(self.model, "cpu_compile", False)

    def _forward(self, tokens, start, logits_index=None):
        return self.model(tokens, self.cache, start, layers=self.layers, logits_index=logits_index)

    def _step(self, tokens, start):
        """One token per sequence: replayed from a CUDA graph when they are on."""
        if self.graphs is None:
            return self._forward(tokens, start)
        return self.graphs.forward(tokens, self.cache, start, layers=self.layers)

    def propose(self, request: DraftRequest) -> Draft:
        history = request.history
        dev = self.model.device
        B = len(history)
        if self.share_cache:
            self.valid = self.target_cache.lens.clone()
        # catch up: feed every history token the drafter cache lacks (>= the pending one)
        # (a sequence the engine cut short at a stop token may hold fewer tokens than its
        # accepted drafts: at least the pending token is always re-fed)
        valid = [min(v, len(h) - 1) for h, v in zip(history, self.valid.tolist())]
        self.valid = torch.tensor(valid, dtype=torch.long, device=dev)
        n_new = [len(h) - v for h, v in zip(history, valid)]
        T = max(n_new)
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, h in enumerate(history):
            toks[b, : n_new[b]] = torch.tensor(h[valid[b] :], device=dev)
        n_new_t = torch.tensor(n_new, device=dev)
        kmax = int(request.k.max())
        # graphs for the per-round widths (1..k + 1); an own cache's first catch-up is the
        # whole prompt, a prefill: eager, as the target's is
        if self._captured_catch_up() and T <= kmax + 1:
            every = self.graphs.forward(toks, self.cache, self.valid, layers=self.layers)
            logits = every[torch.arange(B, device=dev), n_new_t - 1]  # [B, V]
        else:
            logits = self._forward(toks, self.valid, logits_index=n_new_t - 1)[:, 0]
        self.base = self.valid + n_new_t  # cache entries after the catch-up (history length)
        if self._chain_graph(request) and kmax >= 1:
            # greedy, no confidence cut: every sequence drafts exactly its k, and the k - 1
            # steps after the first guess replay as one graph (CudaGraphs.chain)
            first = logits.argmax(-1)
            tokens = self.graphs.chain(first, self.cache, self.base, kmax, layers=self.layers)
            draft = Draft(tokens.clone(), None, request.k.clone(), kmax - 1)
        else:
            draft = self._draft_steps(request, logits)
        # drafts fed back into the drafter cache (the last drafted token is never fed)
        self.fed = torch.clamp(draft.n_draft, max=draft.forwards)
        draft.forwards += 1  # the catch-up forward
        return draft

    def _chain_graph(self, request: DraftRequest) -> bool:
        """Whether this round's draft steps replay as one chain graph: graphs on, greedy
        decoding and no p_min cut (a sampled or cut chain runs step by step)."""
        return (
            self.graphs is not None
            and self.chain_graphs
            and request.params.greedy
            and request.p_min <= 0
        )

    def _draft_steps(self, request: DraftRequest, logits: torch.Tensor) -> Draft:
        params = request.params

        def pick(logits, greedy):
            if greedy:
                return argmax(logits), None
            q = logits_to_probs(logits, params)
            return sample(q, request.generator), q

        def advance(tok, i):
            return self._step(tok[:, None], self.base + i)[:, 0]

        return draft_chain(request, self.model.config.vocab_size, logits, pick, advance)

    def commit(self, n_accepted: torch.Tensor) -> None:
        if self.share_cache:
            return  # the target's verification rewrote the slots; its lens are the truth
        # accepted drafts that were fed are valid history; the rest is rolled back
        self.valid = rollback_lens(self.base, torch.minimum(n_accepted, self.fed))


@register_drafter("model")
class ModelDrafter(ForwardDrafter):
    """A separate draft model: a Transformer, or a registered name / .gguf / HF directory
    loaded with dtype / device / backend / quantize (default: the target's dtype and
    device). With `target` given the pairing is checked now (vocabulary, device, dtype)."""

    def __init__(
        self,
        model: Transformer | str,
        target: Transformer | None = None,
        *,
        dtype: str | None = None,
        device: str | None = None,
        backend: str | None = None,
        quantize: str | None = None,
    ):
        model = load_draft_model(model, target, dtype, device, backend, quantize)[0]
        if target is not None:
            check_compatible(target, model)
        super().__init__(model)


def model_drafter(
    target: Transformer,
    target_tokenizer: Tokenizer | None,
    model: Transformer | str,
    *,
    dtype: str | None = None,
    device: str | None = None,
    backend: str | None = None,
    quantize: str | None = None,
) -> Drafter:
    """A separate draft model for `target`: a ModelDrafter when the two share a vocabulary,
    else (with both tokenizers known) a CrossTokenizerDrafter."""
    from specdec.decode.cross_tokenizer import CrossTokenizerDrafter

    model, draft_tokenizer = load_draft_model(model, target, dtype, device, backend, quantize)
    if target_tokenizer is None or draft_tokenizer is None:
        return ModelDrafter(model, target)  # ids only: the vocabularies must match
    if same_vocabulary(target, model, target_tokenizer, draft_tokenizer):
        return ModelDrafter(model, target)
    log.info("draft vocabulary differs from the target's: cross-tokenizer drafting")
    return CrossTokenizerDrafter(model, target, target_tokenizer, tokenizer=draft_tokenizer)


def same_vocabulary(
    target: Transformer, draft: Transformer, target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer
) -> bool:
    """Same vocabulary size and the same token -> id map (added tokens included)."""
    return (
        draft.config.vocab_size == target.config.vocab_size
        and draft_tokenizer.backend.get_vocab(with_added_tokens=True)
        == target_tokenizer.backend.get_vocab(with_added_tokens=True)
    )


def load_draft_model(
    name: Transformer | str,
    target: Transformer | None,
    dtype: str | None,
    device: str | None,
    backend: str | None,
    quantize: str | None,
) -> tuple[Transformer, Tokenizer | None]:
    """A draft model by registered name / .gguf / HF directory (default: the target's dtype
    and device) -> (Transformer, Tokenizer); a Transformer given as it is -> (it, None),
    the load options then being an error."""
    from specdec.models.load import load_model

    if not isinstance(name, str):
        if (dtype, device, backend, quantize) != (None,) * 4:
            raise SpecDecError("dtype, device, backend and quantize apply to a draft model path")
        return name, None
    if not name:
        raise SpecDecError("a model drafter needs a draft model: a registered name, .gguf or dir")
    if target is not None:
        dtype = dtype or str(target.dtype).removeprefix("torch.")
        device = device or str(target.device)
    return load_model(
        name, dtype=dtype or "float32", device=device or "cpu", backend=backend, quantize=quantize
    )


def check_compatible(target: Transformer, draft: Transformer) -> None:
    """A separate draft model drafting target ids must share the target's vocabulary,
    device and dtype."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecDecError(
            f"vocabulary mismatch: draft model has {draft.config.vocab_size} tokens, "
            f"target has {target.config.vocab_size}; the drafter must share the target's "
            "tokenizer, or draft across tokenizers (give both tokenizers: draft by model "
            "name or path, or use the cross_tokenizer drafter)"
        )
    check_placement(target, draft)


def check_placement(target: Transformer, draft: Transformer) -> None:
    """A separate draft model must be on the target's device, in its dtype."""
    if draft.device != target.device:
        raise SpecDecError(f"draft model on {draft.device} but target on {target.device}")
    if draft.dtype != target.dtype:
        raise SpecDecError(f"draft model dtype {draft.dtype} != target dtype {target.dtype}")


@register_drafter("layerskip")
class LayerSkipDrafter(ForwardDrafter):
    """The target without the layers in `skip` (every2: layers 1, 3, 5, ...)."""

    def __init__(
        self, target: Transformer, skip: Sequence[int] | str = "every2", share_cache: bool = True
    ):
        n = target.config.n_layers
        skipped = parse_skip(skip, n)
        if not skipped:
            raise SpecDecError(
                f"layer-skip set {skip!r} skips no layer: the draft would be the target itself"
            )
        layers = [i for i in range(n) if i not in skipped]
        if not layers:
            raise SpecDecError(f"layer-skip set {skip!r} skips every layer of the {n}-layer target")
        super().__init__(target, layers, share_cache)


@register_drafter("early_exit")
class EarlyExitDrafter(ForwardDrafter):
    """The target's first `exit_layer` layers (default n_layers // 4), then its final norm
    and LM head."""

    def __init__(
        self, target: Transformer, exit_layer: int | None = None, share_cache: bool = True
    ):
        n = target.config.n_layers
        if exit_layer is None:
            exit_layer = max(1, n // 4)
        if not 1 <= exit_layer < n:
            raise SpecDecError(
                f"exit layer must be in [1, {n - 1}] for a {n}-layer target, got {exit_layer}"
            )
        super().__init__(target, range(exit_layer), share_cache)


def parse_skip(skip: Sequence[int] | str, n_layers: int) -> set[int]:
    """'every2' / 'every3' (skip layers 1, 3, 5, ... / 2, 5, ...), 'odd', '3,5,7' or a list."""
    if isinstance(skip, str):
        s = skip.strip().lower()
        if s.startswith("every"):
            try:
                step = int(s[5:])
            except ValueError as e:
                raise SpecDecError(f"bad skip pattern {skip!r}; use e.g. every2") from e
            if step < 2:
                raise SpecDecError(f"skip pattern {skip!r} needs a step >= 2")
            return {i for i in range(n_layers) if i % step == step - 1}
        try:
            skip = [int(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise SpecDecError(f"bad skip list {skip!r}; use e.g. '1,3,5' or every2") from e
    out = set(int(i) for i in skip)
    bad = [i for i in out if not 0 <= i < n_layers]
    if bad:
        raise SpecDecError(f"skip layers {sorted(bad)} out of range for a {n_layers}-layer model")
    return out


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n_max down to n_min) at their most recent
    earlier occurrence in the history and propose the tokens that followed it.

    reuse_outputs: also draft from the outputs of the sequences generated before this one
    (specdec.decode.output_cache, after SuffixDecoding): where prompt lookup's match is
    shorter than `min_match` tokens (by default: where it finds none), the cache's
    continuation of the history's longest suffix it holds (`outputs_n_max` down to
    `outputs_n_min` tokens), if that suffix is at least as long, token by token while at
    least `outputs_p_min` of its occurrences agree. `sources` counts the rounds each
    source drafted (history / outputs / none)."""

    model_free = True

    def __init__(
        self,
        n_max: int = 3,
        n_min: int = 1,
        reuse_outputs: bool = False,
        min_match: int = 1,
        outputs_n_max: int = 8,
        outputs_n_min: int = 2,
        outputs_p_min: float = 0.0,
        outputs_max_tokens: int = 65_536,
    ):
        if not 1 <= n_min <= n_max:
            raise SpecDecError(
                f"n-gram sizes need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}"
            )
        if min_match < 1:
            raise SpecDecError(f"{self.name}: min_match must be >= 1, got {min_match}")
        if not 0.0 <= outputs_p_min <= 1.0:
            raise SpecDecError(f"{self.name}: outputs_p_min must be in [0, 1], got {outputs_p_min}")
        self.n_max, self.n_min, self.min_match = n_max, n_min, min_match
        self.outputs_p_min = outputs_p_min
        self.outputs = (
            OutputCache(outputs_n_max, outputs_n_min, outputs_max_tokens) if reuse_outputs else None
        )
        self.sources = {"history": 0, "outputs": 0, "none": 0}

    def finish(self, outputs: list[list[int]]) -> None:
        if self.outputs is not None:
            for o in outputs:
                self.outputs.add(o)

    def reset(self) -> None:
        if self.outputs is not None:
            self.outputs.clear()
        self.sources = dict.fromkeys(self.sources, 0)

    @staticmethod
    def lookup(h: list[int], k: int, n_max: int, n_min: int) -> list[int]:
        return NgramDrafter.match(h, k, n_max, n_min)[1]

    @staticmethod
    def match(h: list[int], k: int, n_max: int, n_min: int) -> tuple[int, list[int]]:
        """-> (n, the k tokens after the last n-gram's most recent earlier occurrence), the
        longest n from n_max down to n_min that occurs; (0, []) when none does."""
        L = len(h)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = h[L - n :]
            for i in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if h[i : i + n] == suffix:
                    return n, h[i + n : i + n + k]
        return 0, []

    def _recall(self, h: list[int], k: int, n_local: int):
        """The output cache's continuations [m, k] of h's longest suffix it holds, when that
        suffix is at least n_local tokens long and the local match is shorter than
        min_match; else None."""
        if self.outputs is None or n_local >= self.min_match:
            return None
        n, conts = self.outputs.continuations(h, k)
        if not n or n < n_local or not (conts[:, 0] != SEP).any():  # nothing followed it
            return None
        return conts

    def _propose_one(self, h: list[int], k: int) -> tuple[str, list[int]]:
        """-> (source, proposal) for one sequence: the history's own match, else the
        output cache's chain (reuse_outputs)."""
        n, cont = self.match(h, k, self.n_max, self.n_min)
        conts = self._recall(h, k, n if cont else 0)
        if conts is not None:
            chain = frequent_chain(conts, SEP, self.outputs_p_min)
            if chain:
                return "outputs", chain
        return ("history", cont) if cont else ("none", [])

    def build_trees(self, history, depths, budget: int) -> list:
        """Token trees for TreeRound: per sequence the trie of `_tree_prefixes` where it
        has one, else prompt lookup's (specdec.decode.tree.build_ngram_trees)."""
        from specdec.decode.tree import _per_seq, build_ngram_trees

        out = []
        for h, d in zip(history, _per_seq(depths, len(history))):
            h = list(h)
            prefixes = self._tree_prefixes(h, d, budget) if d > 0 else None
            if prefixes is None:
                out += build_ngram_trees([h], [d], budget, self.n_max, self.n_min)
            else:
                out.append(trie_tree(h[-1], prefixes))
        return out

    def _tree_prefixes(self, h: list[int], d: int, budget: int) -> list[tuple[int, ...]] | None:
        """The `budget` most frequent prefixes of the output cache's continuations where it
        drafts for h (reuse_outputs), else None (prompt lookup's trie)."""
        n, cont = self.match(h, d, self.n_max, self.n_min)
        conts = self._recall(h, d, n if cont else 0)
        return None if conts is None else frequent_prefixes(conts, SEP, budget)

    def drafts(self, props: list[list[int]], ks: list[int], dev) -> Draft:
        """Proposals (one list per sequence) as a Draft without distributions."""
        kmax = max(1, max(ks))
        tokens = torch.zeros(len(props), kmax, dtype=torch.long, device=dev)
        for b, p in enumerate(props):
            if p:
                tokens[b, : len(p)] = torch.tensor(p, device=dev)
        n_draft = torch.tensor([len(p) for p in props], dtype=torch.long, device=dev)
        return Draft(tokens, None, n_draft, 0)

    def propose(self, request: DraftRequest) -> Draft:
        history, dev = request.history, request.k.device
        ks = request.k.tolist()
        props = []
        for h, kb in zip(history, ks):
            which, p = self._propose_one(h, kb) if kb > 0 else ("none", [])
            if kb > 0:
                self.sources[which] += 1
            props.append(p)
        return self.drafts(props, ks, dev)


def trie_tree(root: int, prefixes: list[tuple[int, ...]]):
    """A TokenTree rooted at the pending token `root` from a prefix-closed list of drafts
    (parents before children)."""
    from specdec.decode.tree import TokenTree

    node = {(): 0}
    tokens, parents = [root], [-1]
    for p in prefixes:
        node[p] = len(tokens)
        tokens.append(p[-1])
        parents.append(node[p[:-1]])
    return TokenTree(tokens, parents)


# drafters defined in their own packages register on import
from specdec.decode import cross_tokenizer as _cross_tokenizer  # noqa: E402, F401
from specdec.decode import datastore as _datastore  # noqa: E402, F401
from specdec.decode.heads import drafter as _head_drafter  # noqa: E402, F401
