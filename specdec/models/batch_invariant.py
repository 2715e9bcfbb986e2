"""Batch-invariant forwards (CPU torch backend; the Triton backend at the end): a query
row's result depends only on its own cache slot and the keys it sees, never on how many
rows share the forward.

Greedy speculative decoding is lossless only if row t of a T-token verification computes
the logits a one-token decode step at that slot computes. SDPA and BLAS pick kernels and
blockings by shape, so the two differ in the last bits. In float32 a flipped argmax is
rare; in bfloat16 every layer rounds its output to 8 significant bits, the last-bit
differences become visible, and 7 of `make run`'s 12 greedy outputs left plain greedy
(SmolLM2, 2026-12-02). In batch-invariant mode:

- **attention** (`InvariantAttention`): a row at position p reads the first
  L = ceil((p + 1) / BUCKET) * BUCKET slots of its sequence's cache, those after p masked
  (-inf before the softmax: exact zero probabilities), so the shapes of its computation
  depend on p alone. Rows of one sequence whose L agree share two batched GEMMs (scores
  q k^T over D, output p v over L) and a softmax, in float32 (the KV cache is kept in
  float32 in this mode, so nothing is converted per layer; the output is rounded once to
  the model's dtype). Whether a row's result depends on how many rows share those calls is
  probed once per (L, shape) with random rows (`probe`): where only a call of a single row
  differs (AMD Zen 4: MKL's batched GEMM takes another kernel at 3 rows), a lone row is
  computed as two (a copy of it); where more differ, each group is padded to ROWS rows, so
  the shapes never change;
- **token trees**: a tree row at depth d sits at position start + d and must compute what a
  decode step there computes over the committed slots, then its ancestors' slots, itself
  last. Its scores come from one GEMM over the cache as it is, stacked with the sequence's
  other tree rows; they are gathered into decode order for the softmax and the
  probabilities scattered back (zero at the other nodes' slots) for one GEMM with the
  values (`_attend_tree`): no key is copied. Where a tree's nodes sit past its rows' bucket
  the keys are copied into decode order instead (`_attend_gathered`). The probe checks
  both against decode steps; where it fails, tree rows keep the masked SDPA path and are
  lossless up to rounding only;
- **linear layers** (`CpuLinear.make_invariant`): the same kind of probe per weight shape;
  a single row is computed as two where the M = 1 kernel differs (oneDNN's fp32 GEMV),
  calls run in blocks of the largest row count that agrees, and a machine whose kernels
  differ below 8 rows gets an error (asked for) or the mode off with the reason (auto);
- elementwise ops, RMSNorm and RoPE are per row already.

On the Triton backend (`TRITON_MODE`, set up in `Transformer.forward` for forwards of up to
64 tokens) the kernels take launches that depend on nothing a row does not: one GEMV plan
for every M (`specdec.kernels.utils.rows_as_one`), attention with 16-row tiles and
fixed 256-key splits (`attention_splits.invariant_attention_config`) and a per-row RMSNorm
kernel (`specdec.kernels.rms_norm`); the KV cache stays in the model's dtype. Chains only:
token-tree rows read their ancestors where the tree put them.

`tests/models/test_batch_invariant.py` checks verification rows (chains and trees) against
decode steps bit for bit and greedy speculative output against plain greedy in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError
from specdec.models.settings import ProcessSetting

BUCKET = 64  # key slots are read in whole buckets: L depends only on the row's slot
ROWS = 16  # rows per group; groups are padded to ROWS where the probe says rows interact

SETTINGS = ("auto", "on", "off")
# the mode on the Triton backend (Transformer.forward): one GEMV plan for every M
# (kernels.utils.rows_as_one), fixed-split attention (attention_splits.
# invariant_attention_config), a per-row RMSNorm kernel (kernels.rms_norm); token-tree rows
# read their ancestors where the tree put them and are not covered
TRITON_MODE = (
    "Triton kernels with one GEMV plan for every M, fixed attention splits, row norms; chains only"
)
ENV = "SPECDEC_BATCH_INVARIANT"
_probed: dict[tuple, tuple[int, bool]] = {}  # (L, Hkv, G, D) -> (fewest rows, trees exact)


def bucket_len(slot: int) -> int:
    """Key slots a query row at cache `slot` reads (its own slot included, the rest masked)."""
    return (slot // BUCKET + 1) * BUCKET


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
    """q [H, R, D] fp32 (scaled), k / v [H, L, D] fp32, bias [R, L] or [H, R, L] ->
    [H, R, D]. H is a KV head (rows stacked), or a (row, KV head) pair (a tree row's keys)."""
    return torch.bmm(torch.softmax(torch.baddbmm(bias, q, k.transpose(1, 2)), dim=-1), v)


def _attend_tree(q, k, v, idx: torch.Tensor, bias: torch.Tensor, zero: torch.Tensor):
    """Tree rows over the keys a decode step at their positions reads, without copying them:
    q [H, n * G, D] fp32 (scaled; n rows of G heads), k / v [H, L, D] the sequence's cache
    as it is (the tree's nodes in flattened order), idx [n, L] each row's keys in decode
    order (the committed slots, its ancestors' slots, itself; then any slots, masked),
    bias [n, L] in that order (0 / -inf), zero [n * G, La] zeros -> [H, n * G, D]. The
    cache read, La >= L slots, reaches the tree's last node.

    The scores of every slot come from one GEMM over the cache; each row's are gathered
    into decode order (the softmax a decode step computes, on the same numbers), and its
    probabilities scattered back to the slots, zero at the other nodes', for one GEMM with
    the values: the same products in the same order, with zeros between them. Equal to
    `_attend` on gathered keys bit for bit only where the GEMMs' results do not depend on a
    score's column or a zero's place in the sum: `probe` checks that."""
    H, R, _ = q.shape
    n, L = idx.shape
    La = k.shape[1]  # >= L: a tree's nodes may sit past the bucket of its rows' positions
    s = torch.baddbmm(zero, q, k.transpose(1, 2)).view(H, n, R // n, La)
    ix = idx[None, :, None, :].expand(H, n, R // n, L)
    p = torch.softmax(s.gather(-1, ix) + bias[None, :, None, :], dim=-1)
    back = torch.zeros(H, n, R // n, La).scatter_add_(-1, ix, p)
    return torch.bmm(back.view(H, R, La), v)


def _attend_gathered(q, k, v, idx: torch.Tensor, bias: torch.Tensor, copies: int):
    """`_attend_tree`'s arguments (idx may reach past L) -> the same, computed over keys
    copied into each row's decode order: one GEMM per (KV head, row), its G query heads
    repeated `copies` times as a decode step's row is padded. For tree rows whose nodes sit
    past their bucket, where a longer reduction would sum in another order."""
    H, R, D = q.shape
    n, L = idx.shape
    G = R // n
    kr, vr = (x.index_select(1, idx.flatten()).view(H * n, L, D) for x in (k, v))
    qr = q.reshape(H * n, G, D).repeat(1, copies, 1)
    o = _attend(qr, kr, vr, bias[None, :, None].expand(H, -1, copies * G, -1).reshape(H * n, -1, L))
    return o[:, :G].reshape(H, R, D)


def probe(L: int, hkv: int, group: int, d: int) -> tuple[int, bool]:
    """-> (rows, trees) at this key length, probed once per shape with random rows.

    `rows`: the fewest query positions (of `group` heads each) a call may hold. Every row
    of calls of 1, 2, 3, 5 and 8 rows, at several offsets, is compared bit for bit with the
    same row in one call of ROWS rows: 1 where all agree; 2 where only single rows differ
    (a GEMM with a handful of rows takes another kernel: AMD Zen 4, MKL's fp32 batched GEMM
    at 3 rows); else ROWS (every call padded to ROWS rows, so the shapes never change).
    `trees`: whether tree rows computed on the cache as it is (`_attend_tree`) equal decode
    steps over their own keys (else tree rows keep the masked SDPA path); never where rows
    is ROWS."""
    key = (L, hkv, group, d)
    if key not in _probed:
        g = torch.Generator().manual_seed(L)
        q = torch.randn(hkv, ROWS * group, d, generator=g)
        k, v = torch.randn(2, hkv, L, d, generator=g)
        bias = torch.zeros(ROWS * group, L)
        bias[:, L // 2 :] = float("-inf")
        stacked = _attend(q, k, v, bias)

        def agree(n: int) -> bool:  # every row of n-row calls at these offsets
            offsets = range(ROWS) if n == 1 else sorted({0, 1, n, ROWS - n})
            for a in (a for a in offsets if a + n <= ROWS):
                rows_ = slice(a * group, (a + n) * group)
                if not torch.equal(_attend(q[:, rows_], k, v, bias[rows_]), stacked[:, rows_]):
                    return False
            return True

        many = all(agree(n) for n in (2, 3, 5, 8))
        rows = ROWS if not many else 1 if agree(1) else 2
        trees = rows < ROWS and all(
            _tree_agrees(L, hkv, group, d, n, rows, late) for n in (1, 2, 5) for late in (0, 1)
        )
        _probed[key] = (rows, trees)
    return _probed[key]


def _tree_agrees(L: int, hkv: int, group: int, d: int, n: int, fewest: int, late: bool) -> bool:
    """n tree rows (`_attend_gathered`, and `_attend_tree` unless `late`; padded to `fewest`
    rows) equal decode steps over their own keys (in decode order, each row padded to
    `fewest` as a decode step is). Rows of depth < 6 sit in L's bucket; with `late` the
    tree's 12 slots start 8 before its end, so ancestors sit past L."""
    g = torch.Generator().manual_seed(L * 31 + n * 2 + late)
    m = max(n, fewest)
    done = L - 8 if late else L - BUCKET + 5  # the committed slots
    new = list(range(done, done + 12))  # the tree's slots
    La = bucket_len(new[-1])
    q = torch.randn(hkv, m * group, d, generator=g) * d**-0.5
    k, v = torch.randn(2, hkv, La, d, generator=g)
    idx, bias = torch.zeros(m, L, dtype=torch.long), torch.full((m, L), float("-inf"))
    decode = []
    for r in range(m):
        pick = torch.randperm(len(new), generator=g)[: 1 + r % 6]
        mine = list(range(done)) + sorted(new[i] for i in pick.tolist())
        idx[r, : len(mine)] = torch.tensor(mine)  # the masked rest: slot 0, as in the forward
        bias[r, : len(mine)] = 0
        one = q[:, r * group : (r + 1) * group].repeat(1, fewest, 1)
        mask = bias[r].expand(fewest * group, -1)
        seen = set(mine)
        rest = [x for x in range(La) if x not in seen][: L - len(mine)]  # later slots
        keys = torch.tensor(mine + rest)
        decode.append(_attend(one, k[:, keys], v[:, keys], mask)[:, :group])
    want = torch.cat(decode, 1)[:, : n * group]
    if not torch.equal(_attend_gathered(q, k, v, idx, bias, fewest)[:, : n * group], want):
        return False
    if late:  # the forward gathers such rows' keys
        return True
    return torch.equal(
        _attend_tree(q, k, v, idx, bias, torch.zeros(m * group, La))[:, : n * group], want
    )


def tree_paths(tree_mask: torch.Tensor, T: int) -> list[list[list[int]]]:
    """int64 [B, T] ancestor bits (bit j of row i: i sees new token j, itself included) ->
    per sequence, each row's ancestors' row indices, root first, the row itself last. A row's
    ancestors come before it in the flattened tree, one per depth."""
    bits = ((tree_mask[:, :, None] >> torch.arange(T, device=tree_mask.device)) & 1).bool()
    paths = []
    for seq in bits.tolist():
        anc = [[j for j in range(T) if row[j]] for row in seq]
        for i, a in enumerate(anc):
            if a[-1] != i or [len(anc[j]) for j in a] != list(range(1, len(a) + 1)):
                raise ValueError("tree rows must follow their ancestors, one per depth")
        paths.append(anc)
    return paths


@dataclass
class _Chains:
    """Rows of one or more sequences that read the same L slots, computed in one call:
    n rows per sequence (padded), each sequence's keys its own batch entries."""

    L: int
    n: int  # rows per sequence in the calls (ROWS where the probe says rows interact)
    seqs: slice  # a run of consecutive sequences (their caches are a view)
    src: tuple[torch.Tensor, torch.Tensor]  # (b, t) of the S * n query rows (padding: a copy)
    real: torch.Tensor  # which of the S * n rows are real
    dst: tuple[torch.Tensor, torch.Tensor]  # (b, t) of the real rows
    bias: torch.Tensor  # [S * Hkv, n * G, L] fp32: -inf after each row's position
    rows: slice | None  # the same n rows t0 .. t0+n-1 of every sequence (no padding): views


@dataclass
class _TreeRows:
    """Tree rows of one sequence reading L slots, in one call on the cache as it is
    (`_attend_tree`), padded to the probe's fewest rows with copies of the last."""

    b: int
    rows: list[int]  # the real rows
    src: torch.Tensor  # [n]: the rows computed (padding: the last row again)
    L: int
    idx: torch.Tensor  # [n, L]: each row's keys in decode order (after its own: slot 0)
    bias: torch.Tensor  # [n, L] in that order: 0, or -inf after the row's own slot
    zero: torch.Tensor  # [n * G, La] zeros (the scores' GEMM is the decode step's baddbmm)
    La: int  # cache slots read: L, or a bucket more where the tree's nodes sit past L
    copies: int  # the probe's fewest rows per call (`_attend_gathered` where La > L)


class InvariantAttention:
    """The row groups of one forward, shared by all layers: `attn(q, k_cache, v_cache,
    scale)` per layer. Chain row t of sequence b sits at position starts[b] + t and reads
    cache slots 0 .. L-1; rows of all sequences that read the same L run in one batched
    call. With `tree_mask`, row i sits at starts[b] + its depth and reads the committed
    slots, then its ancestors' slots, itself last: the keys a decode step at that position
    reads, in the same order (gathered, one GEMM per row). `exact` is False when this
    machine's GEMMs make a tree row differ from the decode step (`probe`)."""

    def __init__(self, starts, T: int, hkv: int, group: int, d: int, max_len: int, tree_mask=None):
        if max_len % BUCKET:
            raise ValueError(f"a cache of {max_len} slots is not a multiple of {BUCKET}")
        self.exact = True
        self.chains: list[_Chains] = []
        self.trees: list[_TreeRows] = []
        paths = tree_paths(tree_mask, T) if tree_mask is not None else None
        by_len: dict[int, dict[int, list[int]]] = {}  # L -> sequence -> its rows
        for b, start in enumerate(starts):
            for t in range(T):
                pos = start + (t if paths is None else len(paths[b][t]) - 1)
                by_len.setdefault(bucket_len(pos), {}).setdefault(b, []).append(t)
        for L, members in sorted(by_len.items()):
            fewest, trees_ok = probe(L, hkv, group, d)
            if paths is not None:
                if not trees_ok:
                    self.exact = False
                    return
                for b, rows in members.items():
                    self.trees.append(
                        self._tree_rows(b, rows, L, starts[b], paths[b], group, fewest)
                    )
                continue
            for i in range(0, max(len(r) for r in members.values()), ROWS):
                part = {b: r[i : i + ROWS] for b, r in members.items() if r[i : i + ROWS]}
                n = max(fewest, *(len(r) for r in part.values()))  # padded to `fewest`
                seqs = sorted(part)
                runs = [0] + [j for j in range(1, len(seqs)) if seqs[j] != seqs[j - 1] + 1]
                for a, z in zip(runs, runs[1:] + [len(seqs)]):
                    run = {b: part[b] for b in seqs[a:z]}
                    self.chains.append(self._chains(run, n, L, starts, hkv, group))

    @staticmethod
    def _chains(part: dict[int, list[int]], n, L, starts, hkv, group) -> _Chains:
        seqs = sorted(part)
        src_b, src_t, real, last = [], [], [], []
        for b in seqs:
            rows = part[b] + [part[b][-1]] * (n - len(part[b]))  # padding: the last row again
            src_b += [b] * n
            src_t += rows
            real += [True] * len(part[b]) + [False] * (n - len(part[b]))
            last += [starts[b] + t for t in rows]
        keys = torch.arange(L)[None, :] > torch.tensor(last).repeat_interleave(group)[:, None]
        bias = torch.zeros(len(seqs), 1, n * group, L)
        bias.masked_fill_(keys.view(len(seqs), 1, n * group, L), float("-inf"))
        real_t = torch.tensor(real)
        b_t, t_t = torch.tensor(src_b), torch.tensor(src_t)
        first = part[seqs[0]]
        same = all(part[b] == first for b in seqs) and len(first) == n
        uniform = same and first == list(range(first[0], first[0] + n))
        return _Chains(
            L,
            n,
            slice(seqs[0], seqs[-1] + 1),
            (b_t, t_t),
            real_t,
            (b_t[real_t], t_t[real_t]),
            bias.expand(-1, hkv, -1, -1).reshape(len(seqs) * hkv, n * group, L),
            slice(first[0], first[0] + n) if uniform else None,
        )

    @staticmethod
    def _tree_rows(b, rows, L, start, paths, group, fewest) -> _TreeRows:
        src = rows + [rows[-1]] * (max(fewest, len(rows)) - len(rows))
        idx = torch.zeros(len(src), L, dtype=torch.long)
        bias = torch.full((len(src), L), float("-inf"))
        for r, t in enumerate(src):
            mine = list(range(start)) + [start + a for a in paths[t]]
            idx[r, : len(mine)] = torch.tensor(mine)  # the masked rest: slot 0 (adds zeros)
            bias[r, : len(mine)] = 0
        La = max(L, bucket_len(start + max(a for t in src for a in paths[t])))
        zero = torch.zeros(len(src) * group, La)
        return _TreeRows(b, rows, torch.tensor(src), L, idx, bias, zero, La, fewest)

    def __call__(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """q [B, T, Hq, D] (the new keys already written); caches [B, Hkv, max_len, D] ->
        [B, T, Hq, D] in q's dtype."""
        B, T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        qs = q.float() * scale  # [B, T, Hq, D]
        out = torch.empty_like(q)
        for g in self.chains:
            S = g.seqs.stop - g.seqs.start
            # [S * Hkv, n * G, D]: per sequence and KV head, its rows' query heads stacked
            rows = qs[g.src] if g.rows is None else qs[g.seqs, g.rows]
            qg = rows.reshape(S, g.n, Hkv, G, D).transpose(1, 2).reshape(S * Hkv, g.n * G, D)
            k = k_cache[g.seqs, :, : g.L].flatten(0, 1).float()  # [S * Hkv, L, D], a view
            v = v_cache[g.seqs, :, : g.L].flatten(0, 1).float()
            o = _attend(qg, k, v, g.bias).view(S, Hkv, g.n, G, D).transpose(1, 2)
            if g.rows is None:
                out[g.dst] = o.reshape(S * g.n, Hq, D)[g.real].to(q.dtype)
            else:
                out[g.seqs, g.rows] = o.reshape(S, g.n, Hq, D)
        for g in self.trees:  # all of a sequence's rows of one L in one call
            n = len(g.src)
            qr = qs[g.b, g.src].view(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D)
            k, v = (c[g.b, :, : g.La].float() for c in (k_cache, v_cache))  # views
            if g.La == g.L:
                o = _attend_tree(qr, k, v, g.idx, g.bias, g.zero)
            else:  # nodes past the bucket: a longer GEMM could sum in another order
                o = _attend_gathered(qr, k, v, g.idx, g.bias, g.copies)
            o = o.view(Hkv, n, G, D).transpose(0, 1)
            out[g.b, g.rows] = o[: len(g.rows)].reshape(len(g.rows), Hq, D).to(q.dtype)
        return out


# -- the setting ---------------------------------------------------------------------------
_SETTING = ProcessSetting("batch_invariant", ENV, SETTINGS, "auto")
# force batch invariance for this process: auto | on | off (None restores
# $SPECDEC_BATCH_INVARIANT); resolve one. Booleans (Hydra's yes / no) are taken too
set_setting = _SETTING.force
resolve_setting = _SETTING.resolve


def choose(
    setting: str,
    dtype: torch.dtype,
    on_cpu_torch: bool,
    int8_activations: bool,
    on_triton: bool = False,
):
    """-> (on, why) for a model in `dtype`; the CPU torch backend and the Triton backend
    (`TRITON_MODE`) have the mode, torch's CUDA path does not."""
    if on_triton:
        if setting == "off":
            return False, "off (asked for)"
        if setting == "on":
            return True, f"on (asked for; {TRITON_MODE})"
        if dtype != torch.float32:
            return True, f"on (auto: {str(dtype)[6:]} rounds every layer's output; {TRITON_MODE})"
        return False, "off (auto: float32, whose GEMV rows are exact already)"
    if not on_cpu_torch:
        if setting == "on":
            raise SpecDecError(
                "batch_invariant=on needs the torch backend on CPU or the Triton backend "
                "(torch's CUDA kernels choose their blockings by shape)"
            )
        return False, "off (not the CPU torch backend)"
    if setting != "auto":
        return setting == "on", f"{setting} (asked for)"
    if int8_activations:
        return True, "on (auto: int8 activations turn last-bit differences into visible ones)"
    if dtype != torch.float32:
        return True, f"on (auto: {str(dtype)[6:]} rounds every layer's output to 16 bits)"
    return False, "off (auto: float32, where SDPA is faster and last bits rarely flip a token)"
