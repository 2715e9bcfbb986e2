"""Load LlamaForCausalLM / Qwen2ForCausalLM from an HF directory (config.json,
*.safetensors, optionally sharded with model.safetensors.index.json, tokenizer.json).

Tensors are read through safetensors' memory map; optional quantize-on-load turns every
linear layer into int8 (per output channel) or int4 (group-wise asymmetric) for the
quantized GEMV kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import quantize_int4, quantize_int8
from specdec.models.config import ModelConfig
from specdec.models.tensor_map import LINEAR, MODEL, part_of, read_state
from specdec.models.tokenizer import Tokenizer
from specdec.models.validate import (
    check_hf_config,
    check_tensor_shapes,
    read_json_object,
    read_safetensors_index,
)

HF_ARCHES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHES[a] for a in archs if a in HF_ARCHES), None)
    if arch is None:
        raise SpecDecError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(HF_ARCHES)})"
        )
    rs = cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
        rope_theta = cfg["rope_parameters"].get("rope_theta")
        rs = rs or cfg["rope_parameters"]
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "default":
            rs = None
        elif kind != "llama3":
            raise SpecDecError(f"unsupported rope scaling {kind!r} (supported: llama3)")
    n_heads = cfg["num_attention_heads"]
    return ModelConfig(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        ffn_dim=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rope_theta=float(rope_theta or 10000.0),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=rs,
        name=name,
    )


def _open_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = read_safetensors_index(index)
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise SpecDecError(f"{directory}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        fp = directory / f
        if not fp.is_file():
            raise SpecDecError(f"{directory}: shard {f} listed in the index is missing")
        try:
            with safe_open(str(fp), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        except SpecDecError:
            raise
        except Exception as e:
            raise SpecDecError(f"{fp}: unreadable safetensors file ({e})") from e
    return out


def load_hf(directory: str | Path, quantize: str | None = None, group_size: int = 64):
    """-> (Transformer, Tokenizer). quantize: None | "int8" | "int4"."""
    from specdec.models.builder import build_model

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise SpecDecError(f"{directory}: config.json not found (not an HF model directory)")
    raw_cfg = read_json_object(cfg_path)
    check_hf_config(raw_cfg, cfg_path)
    cfg = config_from_hf(raw_cfg, name=directory.name)
    tensors = _open_tensors(directory)
    check_tensor_shapes(cfg, ((k, tuple(v.shape)) for k, v in tensors.items()), "hf", directory)
    if quantize not in (None, "int8", "int4"):
        raise SpecDecError(f"unknown quantization {quantize!r} (choose int8 or int4)")

    if MODEL["lm_head"].hf not in tensors:
        cfg.tie_embeddings = True

    def lin(w: torch.Tensor):
        if quantize == "int8":
            return quantize_int8(w)
        if quantize == "int4":
            return quantize_int4(w, group_size)
        return w

    def get(name: str, file_name: str):
        if file_name not in tensors:
            raise SpecDecError(f"{directory}: missing tensor {file_name}")
        w = tensors[file_name]
        return lin(w) if part_of(name) in LINEAR else w

    state = read_state(cfg, "hf", get)
    if cfg.tie_embeddings and quantize:  # the LM head is the largest GEMV: quantize it,
        state["lm_head"] = lin(state["embed"])  # keep the table dense
    tokenizer = Tokenizer.from_hf_dir(directory, raw_cfg)
    return build_model(cfg, state), tokenizer
