"""Token trees: the draft structure, its flattening for one verification forward, builders.

A `TokenTree` holds one sequence's draft: node 0 is the root (the pending token: emitted,
not yet in the target's cache), node i > 0 has token tokens[i] and parent parents[i] < i.
Flattening a batch of trees for a cache whose sequence b holds L_b committed entries:

    tokens     [B, T]  node tokens (T = max nodes; padding rows hold token 0)
    positions  [B, T]  RoPE position L_b + depth(i)
    tree_mask  [B, T]  int64, bit j of row i set iff j is an ancestor of i or i itself
                       (padding rows see only themselves); T <= 64

so `model(tokens, cache, lens, positions=positions, tree_mask=tree_mask)` scores every
node in one forward, node i at cache slot L_b + i.

Builders (each returns one tree per sequence; `scorer` gives draft logits, see DraftScorer):
- `build_dynamic_trees`: EAGLE-2. Each depth expands the `topk` best nodes of the newest
  layer into their `topk` most likely children; at the end the `budget` nodes with the
  highest cumulative draft probability (product along the root path) are kept.
- `build_static_trees`: a fixed shape (Medusa / Sequoia) given as parent indices; the
  node of rank r among its siblings gets its parent's r-th most likely token, or, with
  `sample=True`, the r-th draw without replacement from the processed draft distribution
  (recorded in `TokenTree.q` for lossless acceptance).
- `build_ngram_trees`: the distinct continuations of the longest history suffix that
  occurs earlier, merged into a trie.

`ModelTreeDrafter` is the scorer for a separate draft model (own cache) or a self-draft on
a subset of the target's layers (the target's cache, or an own one): each call is ONE
forward over every tree node scored so far, masked so that each node sees the committed
history and its ancestors only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from specdec.decode.sampling import SamplingParams, logits_to_probs
from specdec.errors import SpecDecError
from specdec.kernels.kv_rollback import compact_kv
from specdec.kernels.verify_attention import MAX_TREE_TOKENS
from specdec.models.transformer import KVCache, Transformer

# scorer(frontiers) -> draft logits: frontiers[b] lists token paths from the root (root
# excluded; () is the root itself); the answer's entry b is [len(frontiers[b]), V]
DraftScorer = Callable[[list[list[tuple[int, ...]]]], list[torch.Tensor]]


@dataclass
class TokenTree:
    tokens: list[int]  # node 0 is the root
    parents: list[int]  # parents[0] == -1; parents[i] < i
    probs: list[float] | None = None  # draft probability of node i under its parent's q
    q: torch.Tensor | None = None  # [n, V]: the distribution node i's children were drawn from

    def __post_init__(self) -> None:
        if not self.tokens or len(self.parents) != len(self.tokens) or self.parents[0] != -1:
            raise ValueError("a token tree needs a root (parent -1) and one parent per node")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i > 0):
            raise ValueError(f"tree parents must precede their children, got {self.parents}")

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> TokenTree:
        """A chain draft as a tree: root -> drafts[0] -> drafts[1] -> ..."""
        return cls([root, *drafts], list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> list[int]:
        d = [0] * len(self)
        for i in range(1, len(self)):
            d[i] = d[self.parents[i]] + 1
        return d

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i]: node i's children in index (= sibling rank) order."""
        out: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self)):
            out[self.parents[i]].append(i)
        return out

    @property
    def depth(self) -> int:
        return max(self.depths)

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to i (the root excluded)."""
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def subtree(self, keep: Sequence[int]) -> TokenTree:
        """The nodes `keep` (root first, ancestor-closed, parents before children), renumbered
        in that order."""
        new = {old: j for j, old in enumerate(keep)}
        return TokenTree(
            [self.tokens[i] for i in keep],
            [-1] + [new[self.parents[i]] for i in keep[1:]],
            None if self.probs is None else [self.probs[i] for i in keep],
            None if self.q is None else self.q[list(keep)],
        )

    def truncated(self, max_depth: int) -> TokenTree:
        """The nodes at depth <= max_depth (the max_new_tokens budget)."""
        return self.subtree([i for i, d in enumerate(self.depths) if d <= max_depth])


@dataclass
class FlatTrees:
    tokens: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64
    tree_mask: torch.Tensor  # [B, T] int64 ancestor bits
    n_nodes: list[int]  # real nodes per sequence (the rest is padding)


def ancestor_bits(tree: TokenTree) -> list[int]:
    """Row masks as signed int64 values: bit j of row i iff j is i or one of its ancestors."""
    rows = [1]
    for i in range(1, len(tree)):
        rows.append(rows[tree.parents[i]] | (1 << i))
    return [r - (1 << 64) if r >= 1 << 63 else r for r in rows]


def flatten_trees(trees: Sequence[TokenTree], lens: torch.Tensor) -> FlatTrees:
    """One verification batch from per-sequence trees; lens [B] committed cache entries."""
    T = max(len(t) for t in trees)
    if T > MAX_TREE_TOKENS:
        raise ValueError(f"a flattened tree holds at most {MAX_TREE_TOKENS} nodes, got {T}")
    B = len(trees)
    tokens = torch.zeros(B, T, dtype=torch.long)
    depth = torch.zeros(B, T, dtype=torch.long)
    mask = (1 << torch.arange(T, dtype=torch.long))[None].repeat(B, 1)  # padding: self only
    for b, t in enumerate(trees):
        n = len(t)
        tokens[b, :n] = torch.tensor(t.tokens)
        depth[b, :n] = torch.tensor(t.depths)
        mask[b, :n] = torch.tensor(ancestor_bits(t))
    dev = lens.device
    positions = lens.to(torch.long)[:, None] + depth.to(dev)
    return FlatTrees(tokens.to(dev), positions, mask.to(dev), [len(t) for t in trees])


def _per_seq(x: int | Sequence[int], B: int) -> list[int]:
    return [int(x)] * B if isinstance(x, int) else [int(v) for v in x]


def build_dynamic_trees(
    roots: Sequence[int],
    scorer: DraftScorer,
    depth: int | Sequence[int],
    topk: int,
    budget: int,
) -> list[TokenTree]:
    """EAGLE-2 dynamic trees (module docstring): at most `budget` nodes besides the root,
    at most depth[b] deep. Probabilities are the draft's softmax at temperature 1."""
    if topk < 1 or budget < 1:
        raise ValueError(f"tree topk and budget must be >= 1, got {topk} and {budget}")
    B = len(roots)
    depths = _per_seq(depth, B)
    # every candidate node per sequence (topological order); value = log cumulative prob
    trees = [TokenTree([r], [-1], [1.0]) for r in roots]
    values = [[0.0] for _ in roots]
    paths: list[list[tuple[int, ...]]] = [[()] for _ in roots]
    frontier = [[0] if d > 0 else [] for d in depths]
    for d in range(1, max(depths, default=0) + 1):
        if not any(frontier):
            break
        scores = scorer([[paths[b][i] for i in frontier[b]] for b in range(B)])
        logp = torch.log_softmax(torch.cat([x.float() for x in scores]), -1)  # [R, V]
        top = torch.topk(logp, min(topk, logp.shape[-1]), -1)
        top_lp, top_tok = top.values.tolist(), top.indices.tolist()
        r = 0
        for b, t in enumerate(trees):
            layer = []
            for i in frontier[b]:
                for lp, tok in zip(top_lp[r], top_tok[r]):
                    layer.append(len(t.tokens))
                    t.tokens.append(tok)
                    t.parents.append(i)
                    t.probs.append(math.exp(lp))
                    values[b].append(values[b][i] + lp)
                    paths[b].append(paths[b][i] + (tok,))
                r += 1
            best = sorted(layer, key=lambda j: -values[b][j])[:topk]
            frontier[b] = sorted(best) if d < depths[b] else []
    out = []
    for t, v in zip(trees, values):
        t = TokenTree(t.tokens, t.parents, t.probs)  # recompute the cached depths
        # values never grow along a path and ties go to the shallower node: ancestor-closed
        best = sorted(range(1, len(t)), key=lambda j: (-v[j], t.depths[j], j))[:budget]
        out.append(t.subtree([0] + sorted(best, key=lambda j: (t.depths[j], j))))
    return out


def check_static_tree(parents: Sequence[int]) -> list[int]:
    """parents[i] is the parent of node i + 1 (0 = the root); returns it as a list."""
    parents = [int(p) for p in parents]
    if not parents or any(not 0 <= p <= i for i, p in enumerate(parents)):
        raise SpecDecError(
            "a static tree is a non-empty list whose entry i is the parent of node i + 1 "
            f"(0 = the root, a node listed before its children), got {parents}"
        )
    if len(parents) + 1 > MAX_TREE_TOKENS:
        raise SpecDecError(f"a static tree holds at most {MAX_TREE_TOKENS - 1} nodes")
    return parents


def read_static_tree(path: str | Path) -> list[int]:
    """A static tree from a JSON file holding the list of parent indices."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SpecDecError(f"cannot read static tree {path}: {e}") from e
    if not isinstance(data, list) or not all(isinstance(p, int) for p in data):
        raise SpecDecError(f"static tree {path}: expected a JSON list of parent indices")
    return check_static_tree(data)


def build_static_trees(
    roots: Sequence[int],
    scorer: DraftScorer,
    parents: Sequence[int],
    max_depth: int | Sequence[int] | None = None,
    *,
    sample: bool = False,
    params: SamplingParams = SamplingParams(temperature=1.0),
    generator: torch.Generator | None = None,
) -> list[TokenTree]:
    """The static shape `parents` (see check_static_tree) filled per sequence, cut at
    max_depth[b]. sample=False: rank-r child = the parent's r-th most likely token under
    the draft's softmax; sample=True: the r-th draw without replacement from the draft
    distribution processed with `params` (Gumbel top-k), stored in TokenTree.q. A node
    whose rank exceeds the distribution's support is dropped with its subtree."""
    shape = TokenTree([0] * (len(parents) + 1), [-1, *check_static_tree(parents)])
    B = len(roots)
    limit = _per_seq(shape.depth if max_depth is None else max_depth, B)
    tokens = [[r] + [0] * len(parents) for r in roots]
    probs = [[1.0] * len(shape) for _ in roots]
    qs: list[torch.Tensor | None] = [None] * B
    filled = [{0} for _ in roots]
    for d in range(min(shape.depth, max(limit))):
        inner = [i for i in range(len(shape)) if shape.depths[i] == d and shape.children[i]]
        frontier = [[i for i in inner if i in filled[b] and d < limit[b]] for b in range(B)]
        if not any(frontier):
            break
        paths = [
            [tuple(tokens[b][j] for j in shape.path(i)) for i in frontier[b]] for b in range(B)
        ]
        rows = torch.cat([x.float() for x in scorer(paths)])  # [R, V]: all frontier nodes
        if sample:
            q = logits_to_probs(rows, params)
            gumbel = -torch.empty_like(q).exponential_(generator=generator).log()
            score = torch.where(q > 0, q.log() + gumbel, float("-inf"))
        else:
            q = score = torch.softmax(rows, -1)
        width = max(len(shape.children[i]) for f in frontier for i in f)
        picks = torch.topk(score, min(width, q.shape[-1]), -1).indices  # [R, width]
        picked_q = q.gather(-1, picks).tolist()
        picks, support = picks.tolist(), (q > 0).sum(-1).tolist()
        r = 0
        for b in range(B):
            if sample and frontier[b]:
                if qs[b] is None:
                    qs[b] = torch.zeros(len(shape), q.shape[-1], device=q.device)
                qs[b][frontier[b]] = q[r : r + len(frontier[b])]
            for i in frontier[b]:
                kids = shape.children[i][: support[r]]
                for j, tok, qx in zip(kids, picks[r], picked_q[r]):
                    tokens[b][j], probs[b][j] = tok, qx
                    filled[b].add(j)
                r += 1
    trees = [TokenTree(tokens[b], shape.parents, probs[b], qs[b]) for b in range(B)]
    return [t if len(f) == len(t) else t.subtree(sorted(f)) for t, f in zip(trees, filled)]


def build_ngram_trees(
    history: Sequence[Sequence[int]],
    depth: int | Sequence[int],
    budget: int,
    n_max: int = 3,
    n_min: int = 1,
) -> list[TokenTree]:
    """Prompt lookup with several candidates: the longest suffix (n_max down to n_min
    tokens, the pending token included) that occurs earlier in the history; the distinct
    continuations (up to depth[b] tokens) of all its occurrences, most recent first,
    merged into a trie of at most `budget` nodes besides the root."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    out = []
    for h, k in zip(history, _per_seq(depth, len(history))):
        h = list(h)
        tree = TokenTree([h[-1]], [-1])
        node_of: dict[tuple[int, ...], int] = {(): 0}
        L = len(h)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = h[L - n :]
            starts = [i + n for i in range(L - n - 1, -1, -1) if h[i : i + n] == suffix]
            for s in starts if k > 0 else []:
                cont = tuple(h[s : s + k])
                for j in range(1, len(cont) + 1):
                    if cont[:j] not in node_of and len(tree) <= budget:
                        node_of[cont[:j]] = len(tree)
                        tree.tokens.append(cont[j - 1])
                        tree.parents.append(node_of[cont[: j - 1]])
            if starts:
                break
        out.append(TokenTree(tree.tokens, tree.parents))
    return out


def tree_slack(depth: int, topk: int, budget: int) -> int:
    """Cache slots past the committed history one tree round may write: the verification
    forward (budget + 1 nodes) and the drafter's scoring forwards (topk per depth)."""
    return max(budget, topk * depth) + 1


class ModelTreeDrafter:
    """Scores tree nodes with a draft model: a separate `Transformer` (own cache), or the
    target on a subset of its `layers` (layer skip / early exit) sharing the target's
    cache (share_cache=True) or keeping an own one.

    Per round: `start(history)` feeds the history tokens the drafter cache lacks (at least
    the pending root) and keeps the root's logits; each `score(frontiers)` call is one
    forward over every node scored so far this round, at slots base + j (base = history
    length), RoPE position base - 1 + depth, tree mask = ancestors. `commit(accepted)`
    moves the accepted nodes' entries to the slots after the history (own cache only: a
    shared cache is rewritten by the target's verification).
    """

    def __init__(
        self, model: Transformer, layers: Sequence[int] | None = None, share_cache: bool = False
    ):
        self.model = model
        self.layers = None if layers is None else list(layers)
        self.share_cache = share_cache
        self.forwards = 0

    def begin(self, target_cache: KVCache | None, batch: int, max_len: int) -> None:
        """Once per batch, after the target's prefill (max_len: include `tree_slack`)."""
        if self.share_cache:
            if target_cache is None:
                raise SpecDecError("a drafter sharing the target's cache needs that cache")
            self.cache = target_cache
        else:
            self.cache = KVCache.for_model(self.model, batch, max_len)
        self.valid = torch.zeros(batch, dtype=torch.long, device=self.model.device)

    def _forward(self, tokens, start, **kw) -> torch.Tensor:
        self.forwards += 1
        return self.model(tokens, self.cache, start, layers=self.layers, **kw)

    def start(self, history: Sequence[Sequence[int]]) -> None:
        dev = self.model.device
        if self.share_cache:
            self.valid = self.cache.lens.clone()
        valid = [min(v, len(h) - 1) for h, v in zip(history, self.valid.tolist())]
        n_new = [len(h) - v for h, v in zip(history, valid)]
        toks = torch.zeros(len(history), max(n_new), dtype=torch.long, device=dev)
        for b, h in enumerate(history):
            toks[b, : n_new[b]] = torch.tensor(h[valid[b] :], device=dev)
        start = torch.tensor(valid, dtype=torch.long, device=dev)
        n_new_t = torch.tensor(n_new, device=dev)
        self.root_logits = self._forward(toks, start, logits_index=n_new_t - 1)[:, 0]  # [B, V]
        self.base = start + n_new_t  # history length: the first tree node's slot
        self.fed: list[dict[tuple[int, ...], int]] = [{} for _ in history]

    def score(self, frontiers: list[list[tuple[int, ...]]]) -> list[torch.Tensor]:
        """DraftScorer over this round's trees (paths of draft tokens from the root)."""
        for b, paths in enumerate(frontiers):
            for path in paths:
                for j in range(1, len(path) + 1):
                    self.fed[b].setdefault(path[:j], len(self.fed[b]))
        T = max(len(f) for f in self.fed)
        if T == 0:
            return [self.root_logits[b, None].expand(len(f), -1) for b, f in enumerate(frontiers)]
        dev = self.model.device
        trees = []
        for fed in self.fed:
            nodes = list(fed)  # insertion order: parents first; index j sits at slot base + j
            trees.append(
                TokenTree(
                    [0] + [p[-1] for p in nodes], [-1] + [fed.get(p[:-1], -1) + 1 for p in nodes]
                )
            )
        flat = flatten_trees(trees, self.base - 1)
        # the root is already in the cache: drop its row and bit (row j = node j + 1)
        logits = self._forward(
            flat.tokens[:, 1:],
            self.base,
            positions=flat.positions[:, 1:],
            tree_mask=flat.tree_mask[:, 1:] >> 1,
        )
        out = []
        for b, paths in enumerate(frontiers):
            rows = [self.fed[b][p] + 1 if p else 0 for p in paths]
            full = torch.cat([self.root_logits[b, None], logits[b]], dim=0)
            out.append(full[torch.tensor(rows, dtype=torch.long, device=dev)])
        return out

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        """accepted[b]: the accepted draft tokens (root and next token excluded)."""
        if self.share_cache:
            return
        src = []
        for b, toks in enumerate(accepted):
            fed, row, base = self.fed[b], [], int(self.base[b])
            while len(row) < len(toks) and tuple(toks[: len(row) + 1]) in fed:
                row.append(base + fed[tuple(toks[: len(row) + 1])])
            src.append(row)
        n = torch.tensor([len(r) for r in src], dtype=torch.long, device=self.model.device)
        A = max(1, int(n.max()))
        src_pos = torch.zeros(len(src), A, dtype=torch.long, device=self.model.device)
        for b, r in enumerate(src):
            src_pos[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        compact_kv(self.cache.k, self.cache.v, self.base, src_pos, n, backend=self.model.backend)
        self.valid = self.base + n
