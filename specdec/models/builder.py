"""Assemble a Transformer from a loader's state (shared by the GGUF and HF loaders).

state = {"embed", "norm", "lm_head" (None when tied), "layers": [{"wq", "wk", "wv", "wo",
"w_gate", "w_up", "w_down", "attn_norm", "ffn_norm", optional "bq", "bk", "bv"}]}.
q/k/v and gate/up are fused along the output dimension here, so a decode step makes
3 GEMV calls per layer plus the output projection.
"""

from __future__ import annotations

import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import QuantizedWeight
from specdec.models.config import ModelConfig
from specdec.models.transformer import (
    Attention,
    Block,
    FeedForward,
    Linear,
    RMSNorm,
    Transformer,
)


def _fuse(parts: list) -> torch.Tensor | QuantizedWeight:
    if all(isinstance(p, QuantizedWeight) for p in parts):
        if len({(p.fmt, p.group_size) for p in parts}) == 1:
            return QuantizedWeight.cat_rows(parts)
    if any(isinstance(p, QuantizedWeight) for p in parts):
        # mixed formats (e.g. a GGUF with a Q8_0 v next to Q4_1 q/k): fuse dense
        return torch.cat(
            [p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in parts]
        )
    return torch.cat(parts)


def _check_shape(name: str, w, shape: tuple[int, int]) -> None:
    if tuple(w.shape) != shape:
        raise SpecDecError(f"tensor {name} has shape {tuple(w.shape)}, expected {shape}")


def build_model(cfg: ModelConfig, state: dict) -> Transformer:
    blocks = []
    for i, L in enumerate(state["layers"]):
        _check_shape(f"layer {i} q", L["wq"], (cfg.q_dim, cfg.dim))
        _check_shape(f"layer {i} k", L["wk"], (cfg.kv_dim, cfg.dim))
        _check_shape(f"layer {i} v", L["wv"], (cfg.kv_dim, cfg.dim))
        _check_shape(f"layer {i} gate", L["w_gate"], (cfg.ffn_dim, cfg.dim))
        _check_shape(f"layer {i} down", L["w_down"], (cfg.dim, cfg.ffn_dim))
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([L["bq"], L["bk"], L["bv"]]).float()
        wqkv = Linear(_fuse([L["wq"], L["wk"], L["wv"]]), bias)
        attn = Attention(cfg, wqkv, Linear(L["wo"]))
        ffn = FeedForward(Linear(_fuse([L["w_gate"], L["w_up"]])), Linear(L["w_down"]))
        blocks.append(
            Block(
                attn,
                ffn,
                RMSNorm(L["attn_norm"].float(), cfg.rms_eps),
                RMSNorm(L["ffn_norm"].float(), cfg.rms_eps),
            )
        )
    embed = state["embed"]
    head = state["lm_head"] if state["lm_head"] is not None else embed
    _check_shape("lm_head", head, (cfg.vocab_size, cfg.dim))
    return Transformer(
        cfg, embed, blocks, RMSNorm(state["norm"].float(), cfg.rms_eps), Linear(head)
    )
