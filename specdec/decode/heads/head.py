"""An EAGLE-style draft head: one decoder layer over the target's own features.

For token position t the head reads g_t, the target's hidden states after token t-1 at
`feature_layers` (fused low / mid / high layers as in EAGLE-3: one linear n*dim -> dim),
and the embedding of token t (the target's embedding table, frozen):

    x_t = W_in [rms(g_t); rms(e(x_t))]           # 2*dim -> dim
    h_t = Block(x_t)                              # attention over the head's own KV cache + MLP
    logits_t = W_lm[vocab_map] . rms_final(h_t)   # the target's final norm and LM head, frozen

and predicts the target's next token after x_t. Drafting further, the head feeds its own
h_t back in place of g_{t+1} (what it was trained on: `unroll`, EAGLE-3's training-time
test). `vocab_map` (FR-Spec) restricts the LM head to the N tokens the target predicts
most often; drafts map back to full-vocabulary ids.

Only the head's own weights are saved (`save_head` / `load_head`: safetensors + JSON); the
embedding, final norm and LM head come from the target it is attached to, which must
match the fingerprint stored with the head.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecDecError
from specdec.models.config import ModelConfig
from specdec.models.cpu_linear import CpuLinear, choose_backend
from specdec.models.transformer import Transformer, apply_rope, rope_tables

WEIGHTS, CONFIG = "head.safetensors", "head.json"
SAVE_DTYPE = torch.float16  # the dtype save_head writes a head's weights in (load_head: fp32)


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer (EAGLE-3's fusion); fewer for shallow models."""
    return tuple(sorted({n_layers // 10, n_layers // 2, n_layers - 1}))


@dataclass
class HeadConfig:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    feature_layers: tuple[int, ...]
    vocab_size: int  # the target's
    vocab_top: int  # rows of the draft LM head (vocab_size: the full vocabulary)
    rms_eps: float
    target: dict = field(default_factory=dict)  # fingerprint of the target (`fingerprint`)

    @classmethod
    def for_target(
        cls,
        target: Transformer,
        feature_layers: tuple[int, ...] | None = None,
        vocab_top: int = 0,
        ffn_dim: int | None = None,
    ) -> HeadConfig:
        c = target.config
        layers = tuple(feature_layers or default_feature_layers(c.n_layers))
        if not layers or any(not 0 <= i < c.n_layers for i in layers):
            raise SpecDecError(f"feature layers {layers} out of range for {c.n_layers} layers")
        if vocab_top < 0:
            raise SpecDecError(f"vocab_top must be >= 0 (0: the full vocabulary), got {vocab_top}")
        return cls(
            dim=c.dim,
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            ffn_dim=ffn_dim or c.ffn_dim,
            feature_layers=layers,
            vocab_size=c.vocab_size,
            vocab_top=min(vocab_top or c.vocab_size, c.vocab_size),
            rms_eps=c.rms_eps,
            target=fingerprint(target),
        )


def fingerprint(target: Transformer) -> dict:
    """What identifies the target a head was trained on: its shape and a checksum of the
    first embedding rows (the head reuses the target's embedding and LM head)."""
    c = target.config
    rows = target.embed_dense[:64].double()
    return {
        "vocab_size": c.vocab_size,
        "dim": c.dim,
        "n_layers": c.n_layers,
        "embed_checksum": float(rows.abs().sum()),
    }


def matches(fp: dict, target: Transformer) -> bool:
    mine = fingerprint(target)
    same_shape = all(fp.get(k) == mine[k] for k in ("vocab_size", "dim", "n_layers"))
    a, b = fp.get("embed_checksum", float("nan")), mine["embed_checksum"]
    return same_shape and math.isclose(a, b, rel_tol=1e-3)


class HeadCache:
    """The head's KV cache: k, v [B, kv_heads, max_len, head_dim]; slot s holds token
    position s + 1 (position 0 has no preceding feature)."""

    def __init__(self, cfg: HeadConfig, batch: int, max_len: int, device, dtype=torch.float32):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)


class DraftHead(nn.Module):
    """The head's weights (trainable) plus references to the target's frozen embedding,
    final norm and LM head rows (`attach`)."""

    def __init__(self, cfg: HeadConfig, rope_cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.dim, len(cfg.feature_layers)
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.fuse = nn.Linear(n * d, d, bias=False) if n > 1 else None
        self.feature_norm = nn.Parameter(torch.ones(d))
        self.embed_norm = nn.Parameter(torch.ones(d))
        self.inp = nn.Linear(2 * d, d, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.wqkv = nn.Linear(d, q + 2 * kv, bias=False)
        self.wo = nn.Linear(q, d, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, d, bias=False)
        self.register_buffer("vocab_map", torch.arange(cfg.vocab_top))  # draft row -> token id
        self.rope_cfg = rope_cfg
        self.embed = self.final_norm = self.lm_weight = None
        self.cos = self.sin = None
        self.lm_kernel = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in (self.fuse, self.inp, self.wqkv, self.wo, self.w_gate_up, self.w_down):
            if m is not None:
                nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.in_features))
        # start the block near the identity on the residual stream
        nn.init.normal_(self.wo.weight, std=0.1 / math.sqrt(self.wo.in_features))
        nn.init.normal_(self.w_down.weight, std=0.1 / math.sqrt(self.w_down.in_features))

    # -- the target's frozen parts ------------------------------------------------------
    def attach(self, target: Transformer) -> DraftHead:
        """Read the embedding, final norm and LM head rows of `target` (checked to be the
        target the head was trained on)."""
        if not matches(self.cfg.target, target):
            raise SpecDecError(
                f"this head was trained for a different target ({self.cfg.target}); "
                f"the given target is {fingerprint(target)}"
            )
        if target.embed_dense is None:
            raise SpecDecError("the head needs the target's dense embedding (not streamed)")
        dev = target.device
        self.to(dev)
        self.embed = target.embed_dense  # [V, dim]
        self.final_norm = (target.norm.weight.float(), target.norm.eps)
        self.lm_weight = lm_head_weight(target)[self.vocab_map].float().contiguous()  # [N, dim]
        self.cos, self.sin = rope_tables(self.rope_cfg, dev)
        # drafting on CPU: the draft LM head (the head's largest weight, 8192 x 576 for
        # SmolLM2) through the target's CPU linear policy, i.e. oneDNN prepacked in fp32:
        # `logits` takes 0.84 against 1.9 ms on MKL on the 2-core EPYC, warm caches (README
        # "Trained draft heads"). Training keeps F.linear (the prepacked op has no autograd).
        self.lm_kernel = None
        if dev.type == "cpu":
            choice = choose_backend(getattr(target, "cpu_linear", "dense"), None, torch.float32)
            if choice.backend == "onednn":
                self.lm_kernel = CpuLinear(
                    "onednn", dense=self.lm_weight, qweight=None, bias=None, dtype=torch.float32
                )
        return self

    def set_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict the draft LM head to these token ids (before `attach`)."""
        if token_ids.numel() != self.cfg.vocab_top:
            raise ValueError(f"{token_ids.numel()} token ids for vocab_top {self.cfg.vocab_top}")
        self.vocab_map.copy_(token_ids)

    # -- the layer ----------------------------------------------------------------------
    def fuse_features(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, T, n, dim] (the target's, at feature_layers) -> g [B, T, dim]."""
        if self.fuse is None:
            return feats[..., 0, :]
        return self.fuse(feats.flatten(-2))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # in fp32 (a no-op when drafting; under bf16 autocast in training the fused kernel
        # needs input and weight in one dtype, and the norm is kept exact)
        return F.rms_norm(x.float(), w.shape, w, self.cfg.rms_eps)

    def _qkv(self, g, tokens, positions):
        """-> x (the layer input), q [B, T, H, D], k, v [B, T, Hkv, D]."""
        cfg = self.cfg
        B, T = tokens.shape
        e = self.embed[tokens].float()
        x = self.inp(
            torch.cat([self._rms(g, self.feature_norm), self._rms(e, self.embed_norm)], -1)
        )
        qkv = self.wqkv(self._rms(x, self.attn_norm))
        nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        qk = apply_rope(qkv[..., : (nq + nkv) * hd].view(B, T, nq + nkv, hd), cos, sin)
        v = qkv[..., (nq + nkv) * hd :].view(B, T, nkv, hd)
        return x, qk[:, :, :nq], qk[:, :, nq:], v

    def _finish(self, x, o):
        """Attention output o [B, T, H, D] -> h [B, T, dim] (residuals and MLP)."""
        B, T = o.shape[:2]
        h = x + self.wo(o.reshape(B, T, -1))
        g, u = self.w_gate_up(self._rms(h, self.ffn_norm)).chunk(2, dim=-1)
        return h + self.w_down(F.silu(g) * u)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., dim] -> draft logits over vocab_map [..., vocab_top] (fp32)."""
        w, eps = self.final_norm
        x = F.rms_norm(h.float(), w.shape, w, eps)
        if self.lm_kernel is not None and not torch.is_grad_enabled():
            return self.lm_kernel(x)
        return F.linear(x, self.lm_weight)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., dim] -> logits over the target's vocabulary (-inf off vocab_map)."""
        small = self.logits(h)
        if self.cfg.vocab_top == self.cfg.vocab_size:
            return small
        out = small.new_full((*small.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab_map, small)

    # -- inference: one step over the head's cache --------------------------------------
    def step(self, g, tokens, cache: HeadCache, start: torch.Tensor) -> torch.Tensor:
        """g [B, T, dim], tokens [B, T] at cache slots start[b] + i -> h [B, T, dim]."""
        T = tokens.shape[1]
        slot = start[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        L = int(slot.max()) + 1
        visible = torch.arange(L, device=tokens.device) <= slot[:, :, None]  # [B, T, L]
        return self.tree_step(g, tokens, cache, slot, slot, visible)

    def tree_step(
        self,
        g: torch.Tensor,
        tokens: torch.Tensor,
        cache: HeadCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """The general step: g [B, T, dim], tokens [B, T] written at cache slots [B, T]
        with RoPE positions [B, T]; query i attends to the slots j < L where visible
        [B, T, L] is set (its own slot included) -> h [B, T, dim]. A chain step is slot =
        position = start + i over a causal mask; a tree node sees the committed slots and
        its ancestors' (and its slot differs from its position)."""
        B = tokens.shape[0]
        x, q, k, v = self._qkv(g, tokens, positions)
        b_idx = torch.arange(B, device=tokens.device)[:, None]
        cache.k.transpose(1, 2)[b_idx, slots] = k
        cache.v.transpose(1, 2)[b_idx, slots] = v
        L = visible.shape[-1]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            cache.k[:, :, :L],
            cache.v[:, :, :L],
            attn_mask=visible[:, None],
            enable_gqa=True,
        )
        return self._finish(x, o.transpose(1, 2))

    # -- training: teacher-forced step 1, then its own features fed back ----------------
    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3) over whole sequences.

        feats [B, T, n, dim]: the target's features after tokens[:, i]; tokens [B, T + 1].
        Head position i (slot i) reads (g_i, tokens[:, i + 1]) and predicts the target's
        next token after tokens[:, i + 1]. Step s >= 2 replaces g_i by the head's step
        s-1 output at i-1, and attends as it would when drafting: step-1 keys up to
        i-s+1, then the keys of steps 2..s at positions i-s+2..i.
        -> [h_1, ..., h_steps], each [B, T, dim] (step s valid from position s-1 on).
        """
        B, T = tokens.shape[0], tokens.shape[1] - 1
        dev = tokens.device
        toks = tokens[:, 1:]
        pos = torch.arange(T, device=dev).expand(B, T)
        g = self.fuse_features(feats)
        outs, keys, vals = [], [], []
        i = torch.arange(T, device=dev)
        for s in range(1, steps + 1):
            x, q, k, v = self._qkv(g, toks, pos)
            keys.append(k)
            vals.append(v)
            # query i of step s sees key j of step s' (keys laid out step by step)
            vis = [i[None, :] <= (i[:, None] - (s - 1))]  # step 1 keys
            for sp in range(2, s + 1):
                vis.append(i[None, :] == (i[:, None] - (s - sp)))
            mask = torch.cat(vis, dim=1)  # [T, s*T]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                torch.cat(keys, 1).transpose(1, 2),
                torch.cat(vals, 1).transpose(1, 2),
                attn_mask=mask,
                enable_gqa=True,
            )
            h = self._finish(x, o.transpose(1, 2))
            outs.append(h)
            g = torch.cat([h[:, :1], h[:, :-1]], dim=1)  # position i reads h at i - 1
        return outs


def lm_head_weight(target: Transformer) -> torch.Tensor:
    """The target's LM head as a dense [V, dim] tensor."""
    lm = target.lm_head
    if getattr(lm, "dense", None) is not None:
        return lm.dense
    return lm.qweight.dequantize(torch.float32)


def round_to_saved(head: DraftHead, dtype: torch.dtype = SAVE_DTYPE) -> None:
    """Rounds the head's weights in place to the values save_head(dtype) writes and
    load_head reads back, so what is measured next is the head as it ships: the fp32 head
    and its fp16 copy can pick different argmaxes where two logits nearly tie."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def save_head(head: DraftHead, directory: Path, meta: dict | None = None, dtype=SAVE_DTYPE):
    """Write head.safetensors (the head's own weights in `dtype`, vocab_map int32) and
    head.json (config + `meta`) atomically into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(torch.int32) if k == "vocab_map" else v.detach().to(dtype)).contiguous().cpu()
        for k, v in head.state_dict().items()
    }
    cfg = asdict(head.cfg)
    cfg["feature_layers"] = list(cfg["feature_layers"])
    _atomic(directory / WEIGHTS, lambda p: save_file(tensors, p))
    text = json.dumps({"config": cfg, **(meta or {})}, indent=2)
    _atomic(directory / CONFIG, lambda p: Path(p).write_text(text))


def load_head(directory: Path | str, target: Transformer) -> DraftHead:
    """The head saved in `directory`, attached to `target` (fp32 on the target's device)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise SpecDecError(f"no trained head in {str(directory)!r} (needs {CONFIG}, {WEIGHTS})")
    try:
        raw = json.loads((directory / CONFIG).read_text())["config"]
        raw["feature_layers"] = tuple(raw["feature_layers"])
        cfg = HeadConfig(**raw)
        state = load_file(str(directory / WEIGHTS))
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise SpecDecError(f"corrupt head in {str(directory)!r}: {e}") from e
    head = DraftHead(cfg, target.config)
    state = {k: (v.long() if k == "vocab_map" else v.float()) for k, v in state.items()}
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise SpecDecError(f"corrupt head in {str(directory)!r}: {e}") from e
    return head.attach(target).eval().requires_grad_(False)


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
