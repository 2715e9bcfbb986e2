"""Batch-invariant forwards on the CPU torch backend: a query row's result depends only on
its own cache slot and the keys it sees, never on how many rows share the forward.

Greedy speculative decoding is lossless only if row t of a T-token verification computes
the logits a one-token decode step at that slot computes. SDPA and BLAS pick kernels and
blockings by shape, so the two differ in the last bits. In float32 a flipped argmax is
rare; in bfloat16 every layer rounds its output to 8 significant bits, the last-bit
differences become visible, and 7 of `make run`'s 12 greedy outputs left plain greedy
(SmolLM2, 2026-12-02). In batch-invariant mode:

- **attention** (`InvariantAttention`): a row at slot p reads the first
  L = ceil((p + 1) / BUCKET) * BUCKET slots of its sequence's cache, those after p masked
  (-inf before the softmax: exact zero probabilities), so the shapes of its computation
  depend on p alone. Rows of one sequence whose L agree share two batched GEMMs (scores
  q k^T over D, output p v over L) and a softmax, in float32 (the KV cache is kept in
  float32 in this mode, so nothing is converted per layer; the output is rounded once to the
  model's dtype). Whether a row's result depends on how many rows share those
  calls is probed once per (L, shape) with random rows (`must_pad`): where it does, each
  group is padded to ROWS rows, so the shapes never change;
- **linear layers** (`CpuLinear.make_invariant`): the same probe per weight shape; a
  single row is computed as two where the M = 1 kernel differs (oneDNN's fp32 GEMV), and a
  machine whose kernels differ between 2..16 rows gets an error (asked for) or the mode
  off with the reason (auto);
- elementwise ops, RMSNorm and RoPE are per row already.

`tests/models/test_batch_invariant.py` checks verification rows against decode steps bit
for bit and greedy speculative output against plain greedy in bf16. Tree masks are not
covered: a tree row's ancestors sit at other slots than in the decode step that would
compute it, so tree verification keeps the masked SDPA path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError

BUCKET = 64  # key slots are read in whole buckets: L depends only on the row's slot
ROWS = 16  # rows per group; groups are padded to ROWS where the probe says rows interact

SETTINGS = ("auto", "on", "off")
ENV = "SPECDEC_BATCH_INVARIANT"
_override: str | None = None
_padding: dict[tuple, bool] = {}  # (L, Hkv, G, D) -> groups must be padded to ROWS rows


def bucket_len(slot: int) -> int:
    """Key slots a query row at cache `slot` reads (its own slot included, the rest masked)."""
    return (slot // BUCKET + 1) * BUCKET


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
    """q [Hkv, R, D] fp32 (scaled), k / v [Hkv, L, D] fp32, bias [R, L] -> [Hkv, R, D]."""
    return torch.bmm(torch.softmax(torch.baddbmm(bias, q, k.transpose(1, 2)), dim=-1), v)


def must_pad(L: int, hkv: int, group: int, d: int) -> bool:
    """Whether row 0 of the attention calls changes with the number of rows (1, 2, 5 or
    ROWS query positions of `group` heads each) at this key length: probed once per shape."""
    key = (L, hkv, group, d)
    if key not in _padding:
        g = torch.Generator().manual_seed(L)
        q = torch.randn(hkv, ROWS * group, d, generator=g)
        k, v = torch.randn(2, hkv, L, d, generator=g)
        bias = torch.zeros(ROWS * group, L)
        bias[:, L // 2 :] = float("-inf")
        rows = [_attend(q[:, : n * group], k, v, bias[: n * group])[:, :group] for n in (1, 2, 5)]
        rows.append(_attend(q, k, v, bias)[:, :group])
        _padding[key] = not all(torch.equal(r, rows[0]) for r in rows[1:])
    return _padding[key]


@dataclass
class _Group:
    b: int  # sequence
    t: int  # first row
    n: int  # rows t .. t + n - 1
    L: int  # key slots read
    bias: torch.Tensor  # [rows * G, L] fp32: 0 where visible, -inf after the row's slot
    q: torch.Tensor  # [Hkv, rows * G, D] fp32: the group's scaled queries (padding rows 0)


class InvariantAttention:
    """The row groups of one forward (they depend only on the start slots and T), shared by
    all layers: `attn(q, k_cache, v_cache, scale)` for each layer."""

    def __init__(self, starts: list[int], T: int, hkv: int, group: int, d: int, max_len: int):
        if max_len % BUCKET:
            raise ValueError(f"a cache of {max_len} slots is not a multiple of {BUCKET}")
        self.groups: list[_Group] = []
        for b, start in enumerate(starts):
            t = 0
            while t < T:
                L = bucket_len(start + t)
                n = min(T, L - start, t + ROWS) - t  # rows t .. t+n-1 read the same L slots
                rows = ROWS if must_pad(L, hkv, group, d) else n
                slot = start + t + torch.arange(rows).repeat_interleave(group)
                bias = torch.zeros(rows * group, L)
                bias.masked_fill_(torch.arange(L)[None, :] > slot[:, None], float("-inf"))
                q = torch.zeros(hkv, rows * group, d)
                self.groups.append(_Group(b, t, n, L, bias, q))
                t += n

    def __call__(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """q [B, T, Hq, D] (the new keys already written); caches [B, Hkv, max_len, D] ->
        [B, T, Hq, D] in q's dtype."""
        B, T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        qs = q.float() * scale  # [B, T, Hq, D]
        out = torch.empty_like(q)
        for g in self.groups:
            b, t, n, L = g.b, g.t, g.n, g.L
            # [Hkv, n * G, D]: the rows of one KV head together, query heads of a group adjacent
            g.q.view(Hkv, -1, G, D)[:, :n] = qs[b, t : t + n].view(n, Hkv, G, D).transpose(0, 1)
            o = _attend(g.q, k_cache[b, :, :L].float(), v_cache[b, :, :L].float(), g.bias)
            out[b, t : t + n] = o[:, : n * G].view(Hkv, n, G, D).transpose(0, 1).reshape(n, Hq, D)
        return out


# -- the setting ---------------------------------------------------------------------------
def set_setting(setting: str | bool | None) -> None:
    """Force batch invariance for this process: auto | on | off (None restores
    $SPECDEC_BATCH_INVARIANT, default auto). Booleans (Hydra's yes / no) are taken too."""
    global _override
    _override = None if setting is None else resolve_setting(setting)


def resolve_setting(setting: str | bool | None = None) -> str:
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    setting = setting or _override or os.environ.get(ENV) or "auto"
    if setting not in SETTINGS:
        raise SpecDecError(f"invalid batch_invariant {setting!r} (choose one of auto, on, off)")
    return setting


def choose(setting: str, dtype: torch.dtype, on_cpu_torch: bool, int8_activations: bool):
    """-> (on, why) for a model in `dtype`; only the CPU torch backend has the mode."""
    if not on_cpu_torch:
        if setting == "on":
            raise SpecDecError(
                "batch_invariant=on needs the torch backend on CPU (the Triton and CUDA paths "
                "have their own kernels)"
            )
        return False, "off (not the CPU torch backend)"
    if setting != "auto":
        return setting == "on", f"{setting} (asked for)"
    if int8_activations:
        return True, "on (auto: int8 activations turn last-bit differences into visible ones)"
    if dtype != torch.float32:
        return True, f"on (auto: {str(dtype)[6:]} rounds every layer's output to 16 bits)"
    return False, "off (auto: float32, where SDPA is faster and last bits rarely flip a token)"
