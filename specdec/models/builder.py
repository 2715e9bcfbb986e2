"""Assemble a Transformer from a loader's state (shared by the GGUF and HF loaders).

state = {"embed", "norm", "lm_head" (None when tied), "layers": [{"wq", "wk", "wv", "wo",
"w_gate", "w_up", "w_down", "attn_norm", "ffn_norm", optional "bq", "bk", "bv"}]}.
q/k/v and gate/up are fused along the output dimension here (`tensor_map.PACKED`), so a
decode step makes 3 GEMV calls per layer plus the output projection.
"""

from __future__ import annotations

import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import QuantizedWeight
from specdec.models.config import ModelConfig
from specdec.models.tensor_map import NORMS, PACKED, PACKED_BIAS, layer_shapes
from specdec.models.transformer import (
    Attention,
    Block,
    FeedForward,
    Linear,
    RMSNorm,
    Transformer,
)

# the parts whose shapes the builder checks (their names in its errors)
CHECKED = {"wq": "q", "wk": "k", "wv": "v", "w_gate": "gate", "w_down": "down"}


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
    """The Transformer of a loader's state. Consumes `state["layers"]`: each layer's
    entry is dropped once its fused weights are built, so the unfused copies of the layers
    built so far are freed on the way (Qwen2.5-Coder-0.5B's GGUF: the load's peak resident
    memory went from 1,976 to 1,777 MiB with this; `gguf_loader.drop_vocabulary_fields`
    took it to 1,366)."""
    shapes = layer_shapes(cfg)
    blocks = []
    layers = state["layers"]
    for i in range(len(layers)):
        L, layers[i] = layers[i], None
        for part in CHECKED:
            _check_shape(f"layer {i} {CHECKED[part]}", L[part], shapes[part])
        lin = {}
        for path, parts in PACKED.items():
            biases = PACKED_BIAS.get(path) if cfg.qkv_bias else None
            bias = torch.cat([L[b] for b in biases]).float() if biases else None
            ws = [L[p] for p in parts]
            fused = _fuse(ws)
            # a dense fusion of quantized parts of different formats keeps the parts: the
            # ort backend runs them from their codes as one MatMulNBits
            keep = isinstance(fused, torch.Tensor) and all(
                isinstance(w, QuantizedWeight) for w in ws
            )
            lin[path] = Linear(fused, bias, parts=ws if keep else None)
        attn = Attention(cfg, lin["attn.wqkv"], lin["attn.wo"])
        ffn = FeedForward(lin["ffn.w_gate_up"], lin["ffn.w_down"])
        norms = [RMSNorm(L[n].float(), cfg.rms_eps) for n in NORMS]
        blocks.append(Block(attn, ffn, *norms))
    embed = state["embed"]
    head = state["lm_head"] if state["lm_head"] is not None else embed
    _check_shape("lm_head", head, (cfg.vocab_size, cfg.dim))
    return Transformer(
        cfg, embed, blocks, RMSNorm(state["norm"].float(), cfg.rms_eps), Linear(head)
    )
