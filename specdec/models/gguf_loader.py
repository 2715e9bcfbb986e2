"""Load Llama / Qwen2 models from GGUF files (read with the `gguf` package).

Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay quantized: their bytes are split into the
QuantizedWeight planes, never dequantized at load. F32/F16/BF16 tensors load as dense.
llama.cpp's converter permutes the rows of Llama's q/k projections for its interleaved
RoPE; we undo that by reordering rows (valid for block formats, whose blocks lie along
the input dimension), so one RoPE convention serves GGUF and safetensors models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import KQUANT_BLOCKS, QuantizedWeight, from_gguf_blocks, from_gguf_kquant
from specdec.models.config import ARCHITECTURES, ModelConfig
from specdec.models.tokenizer import Tokenizer

DENSE_TYPES = {"F32": np.float32, "F16": np.float16}
QUANT_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
KQUANT_TYPES = {fmt.upper(): fmt for fmt in KQUANT_BLOCKS}  # Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
SUPPORTED_TYPES = (*DENSE_TYPES, "BF16", *QUANT_TYPES, *KQUANT_TYPES)


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError/struct.error/... on bad bytes
        raise SpecDecError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecDecError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )

    def req(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise SpecDecError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    n_heads = int(req("attention.head_count"))
    dim = int(req("embedding_length"))
    n_vocab = _field(reader, f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        arch=arch,
        vocab_size=int(n_vocab),
        dim=dim,
        n_layers=int(req("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        ffn_dim=int(req("feed_forward_length")),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", dim // n_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(req("attention.layer_norm_rms_epsilon")),
        max_seq_len=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        name=str(_field(reader, "general.name", path.stem)),
    )


def _tensor(t, path: Path) -> torch.Tensor | QuantizedWeight:
    ttype = t.tensor_type.name
    if ttype not in SUPPORTED_TYPES:
        raise SpecDecError(
            f"{path}: tensor {t.name} has unsupported type {ttype} "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists [in, out]
    if ttype in QUANT_TYPES or ttype in KQUANT_TYPES:
        if len(shape) != 2:
            raise SpecDecError(f"{path}: quantized tensor {t.name} is not 2-D")
        if ttype in KQUANT_TYPES:
            return from_gguf_kquant(t.data, KQUANT_TYPES[ttype], shape)
        return from_gguf_blocks(t.data, QUANT_TYPES[ttype], shape)
    if ttype == "BF16":
        raw = np.ascontiguousarray(t.data).view(np.uint16).reshape(shape)
        return torch.from_numpy(raw.astype(np.int32) << 16).view(torch.float32)
    arr = np.asarray(t.data, dtype=DENSE_TYPES[ttype]).reshape(shape)
    return torch.from_numpy(arr.copy())


def _unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's q/k row permutation: hf[h, t, i] = gguf[h, i, t] (t in {0, 1})."""
    n = w.shape[0]
    idx = torch.arange(n).view(n_heads, n // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(w, QuantizedWeight):
        return w.select_rows(idx)
    return w.index_select(0, idx)


def load_gguf(path: str | Path):
    """-> (Transformer, Tokenizer) on CPU, weights as stored (call model.setup(...) next)."""
    from specdec.models.builder import build_model

    path = Path(path)
    if not path.is_file():
        raise SpecDecError(f"model file not found: {path}")
    reader = _reader(path)
    cfg = read_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, required: bool = True):
        t = tensors.get(name)
        if t is None:
            if required:
                raise SpecDecError(f"{path}: missing tensor {name}")
            return None
        return _tensor(t, path)

    state: dict = {
        "embed": get("token_embd.weight"),
        "norm": get("output_norm.weight"),
        "lm_head": None if cfg.tie_embeddings else get("output.weight"),
        "layers": [],
    }
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wq, wk = get(p + "attn_q.weight"), get(p + "attn_k.weight")
        if cfg.arch == "llama":
            wq, wk = _unpermute_rows(wq, cfg.n_heads), _unpermute_rows(wk, cfg.n_kv_heads)
        layer = {
            "wq": wq,
            "wk": wk,
            "wv": get(p + "attn_v.weight"),
            "wo": get(p + "attn_output.weight"),
            "w_gate": get(p + "ffn_gate.weight"),
            "w_up": get(p + "ffn_up.weight"),
            "w_down": get(p + "ffn_down.weight"),
            "attn_norm": get(p + "attn_norm.weight"),
            "ffn_norm": get(p + "ffn_norm.weight"),
        }
        if cfg.qkv_bias:
            layer["bq"] = get(p + "attn_q.bias")
            layer["bk"] = get(p + "attn_k.bias")
            layer["bv"] = get(p + "attn_v.bias")
        state["layers"].append(layer)
    emb = state["embed"]
    if emb.shape[0] != cfg.vocab_size:
        raise SpecDecError(
            f"{path}: token_embd has {emb.shape[0]} rows but the vocabulary has {cfg.vocab_size}"
        )
    tokenizer = Tokenizer.from_gguf_reader(reader, path)
    return build_model(cfg, state), tokenizer
