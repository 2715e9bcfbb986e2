"""Where every tensor of a model comes from, declared once as data.

`MODEL` and `LAYER` give each tensor our name, its name in a GGUF file and in an HF
checkpoint, and its shape in `ModelConfig` fields; a layer's file names sit behind
`LAYER_PREFIX`. `PACKED` says which of a layer's tensors one `Linear` stacks along its
output rows (q|k|v and gate|up, as nano-vllm's packed_modules_mapping), `PACKED_BIAS` the
biases that go with them, and `PERMUTED` the rows llama.cpp's converter permutes for its
interleaved RoPE (Llama GGUF files only). The GGUF and HF loaders, the builder and the
streaming GGUF source all read these tables.

Flat names: "embed", "norm", "lm_head" and "layers.{i}.{part}" (e.g. "layers.3.wq");
`tensor_names(cfg, fmt)` and `tensor_shapes(cfg)` list every tensor a model of `cfg`
reads, before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.models.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    gguf: str
    hf: str
    shape: tuple[str, ...]  # ModelConfig fields: (out, in) for a matrix, (n,) for a vector

    def file_name(self, fmt: str) -> str:
        return self.gguf if fmt == "gguf" else self.hf


MODEL = {
    "embed": TensorSpec("token_embd.weight", "model.embed_tokens.weight", ("vocab_size", "dim")),
    "norm": TensorSpec("output_norm.weight", "model.norm.weight", ("dim",)),
    "lm_head": TensorSpec("output.weight", "lm_head.weight", ("vocab_size", "dim")),  # untied
}
LAYER_PREFIX = {"gguf": "blk.{i}.", "hf": "model.layers.{i}."}
LAYER = {
    "wq": TensorSpec("attn_q.weight", "self_attn.q_proj.weight", ("q_dim", "dim")),
    "wk": TensorSpec("attn_k.weight", "self_attn.k_proj.weight", ("kv_dim", "dim")),
    "wv": TensorSpec("attn_v.weight", "self_attn.v_proj.weight", ("kv_dim", "dim")),
    "wo": TensorSpec("attn_output.weight", "self_attn.o_proj.weight", ("dim", "q_dim")),
    "w_gate": TensorSpec("ffn_gate.weight", "mlp.gate_proj.weight", ("ffn_dim", "dim")),
    "w_up": TensorSpec("ffn_up.weight", "mlp.up_proj.weight", ("ffn_dim", "dim")),
    "w_down": TensorSpec("ffn_down.weight", "mlp.down_proj.weight", ("dim", "ffn_dim")),
    "attn_norm": TensorSpec("attn_norm.weight", "input_layernorm.weight", ("dim",)),
    "ffn_norm": TensorSpec("ffn_norm.weight", "post_attention_layernorm.weight", ("dim",)),
    "bq": TensorSpec("attn_q.bias", "self_attn.q_proj.bias", ("q_dim",)),  # qkv_bias only
    "bk": TensorSpec("attn_k.bias", "self_attn.k_proj.bias", ("kv_dim",)),
    "bv": TensorSpec("attn_v.bias", "self_attn.v_proj.bias", ("kv_dim",)),
}
BIASES = ("bq", "bk", "bv")

# a Block's Linear (module path) -> the parts stacked along its output rows, in order
PACKED = {
    "attn.wqkv": ("wq", "wk", "wv"),
    "attn.wo": ("wo",),
    "ffn.w_gate_up": ("w_gate", "w_up"),
    "ffn.w_down": ("w_down",),
}
PACKED_BIAS = {"attn.wqkv": ("bq", "bk", "bv")}
NORMS = ("attn_norm", "ffn_norm")  # a Block's RMSNorm modules, named as their parts
# parts whose rows llama.cpp permutes (GGUF, arch llama) -> the config field with the head count
PERMUTED = {"wq": "n_heads", "wk": "n_kv_heads"}
LINEAR = frozenset({"lm_head", *(p for parts in PACKED.values() for p in parts)})


def layer_parts(cfg: ModelConfig) -> tuple[str, ...]:
    """The parts of one layer of `cfg` (the q/k/v biases only with qkv_bias)."""
    return tuple(p for p in LAYER if cfg.qkv_bias or p not in BIASES)


def layer_names(fmt: str, i: int, parts: tuple[str, ...] = tuple(LAYER)) -> dict[str, str]:
    """{part: name in a `fmt` file} for layer i."""
    prefix = LAYER_PREFIX[fmt].format(i=i)
    return {p: prefix + LAYER[p].file_name(fmt) for p in parts}


def tensor_names(cfg: ModelConfig, fmt: str) -> dict[str, str]:
    """{flat name: name in a `fmt` file} of every tensor a model of `cfg` reads."""
    out = {k: s.file_name(fmt) for k, s in MODEL.items()}
    if cfg.tie_embeddings:
        del out["lm_head"]
    parts = layer_parts(cfg)
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{p}": n for p, n in layer_names(fmt, i, parts).items()})
    return out


def _shape(cfg: ModelConfig, spec: TensorSpec) -> tuple[int, ...]:
    return tuple(getattr(cfg, f) for f in spec.shape)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{part: shape} of one layer of `cfg`."""
    return {p: _shape(cfg, LAYER[p]) for p in layer_parts(cfg)}


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{flat name: shape} ([out, in] for matrices) of every tensor a model of `cfg` reads."""
    layer = layer_shapes(cfg)
    return {
        k: layer[part_of(k)] if k.startswith("layers.") else _shape(cfg, MODEL[k])
        for k in tensor_names(cfg, "hf")
    }


def part_of(name: str) -> str:
    """ "layers.3.wq" -> "wq"; "embed" -> "embed"."""
    return name.rsplit(".", 1)[-1]


def read_state(cfg: ModelConfig, fmt: str, get: Callable[[str, str], object]) -> dict:
    """The builder's state for `cfg`, each tensor from get(flat name, file name):
    {"embed", "norm", "lm_head" (None when tied), "layers": [{part: tensor}]}."""
    state: dict = {"lm_head": None, "layers": [{} for _ in range(cfg.n_layers)]}
    for name, file_name in tensor_names(cfg, fmt).items():
        t = get(name, file_name)
        if name.startswith("layers."):
            state["layers"][int(name.split(".")[1])][part_of(name)] = t
        else:
            state[name] = t
    return state


def gguf_row_order(cfg: ModelConfig, part: str, n: int) -> torch.Tensor | None:
    """Rows of a GGUF tensor in our order (hf row r = gguf row order[r]), or None where the
    file keeps our order. llama.cpp permutes Llama's q/k rows for its interleaved RoPE:
    hf[h, t, i] = gguf[h, i, t] (t in {0, 1}) for each head h of `n // n_heads` rows."""
    field = PERMUTED.get(part) if cfg.arch == "llama" else None
    if field is None:
        return None
    heads = getattr(cfg, field)
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
