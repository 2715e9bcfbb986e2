"""Load Llama / Qwen2 models from GGUF files (read with the `gguf` package).

Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay quantized: their bytes are split into the
QuantizedWeight planes, never dequantized at load. F32/F16/BF16 tensors load as dense.
llama.cpp's converter permutes the rows of Llama's q/k projections for its interleaved
RoPE; we undo that by reordering rows (valid for block formats, whose blocks lie along
the input dimension), so one RoPE convention serves GGUF and safetensors models.

Tensor names and the permuted parts come from `tensor_map`; `gguf_tensor` is the one place
a GGUF tensor type becomes a weight, and `mapped*` are zero-copy views of the file for the
streaming GGUF source.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.kernels.quant import (
    GGUF_BLOCK,
    GGUF_BLOCK_BYTES,
    KQUANT_BLOCKS,
    QuantizedWeight,
    from_gguf_blocks,
    from_gguf_kquant,
)
from specdec.models.config import ARCHITECTURES, ModelConfig
from specdec.models.tensor_map import MODEL, gguf_row_order, layer_names, part_of, read_state
from specdec.models.tokenizer import Tokenizer
from specdec.models.validate import check_gguf_metadata, check_tensor_shapes

DENSE_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
# where each QuantizedWeight plane lies in one block of a GGUF block format: plane -> bytes
# [a, b) (the layout `from_gguf_blocks` splits; the streaming GGUF source copies these ranges)
BLOCK_PLANES = {
    "q8_0": {"scales": (0, 2), "qweight": (2, 34)},
    "q4_0": {"scales": (0, 2), "qweight": (2, 18)},
    "q4_1": {"scales": (0, 2), "mins": (2, 4), "qweight": (4, 20)},
}
KQUANT_TYPES = {fmt.upper(): fmt for fmt in KQUANT_BLOCKS}  # Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
SUPPORTED_TYPES = (*DENSE_TYPES, *QUANT_TYPES, *KQUANT_TYPES)


def open_gguf(path: Path):
    """A gguf.GGUFReader over the memory-mapped file; SpecDecError if it is not GGUF."""
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
        tie_embeddings=MODEL["lm_head"].gguf not in tensor_names,
        qkv_bias=layer_names("gguf", 0, ("bq",))["bq"] in tensor_names,
        name=str(_field(reader, "general.name", path.stem)),
    )


def gguf_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists [in, out])."""
    return tuple(int(s) for s in reversed(t.shape.tolist()))


def mapped(t) -> torch.Tensor:
    """The tensor's bytes or elements as stored, a torch view of the read-only mapping."""
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(t.data)


def mapped_dense(t) -> torch.Tensor:
    """A dense (F32/F16/BF16) tensor in its stored dtype, shaped, over the mapping."""
    src = mapped(t)
    if t.tensor_type.name == "BF16":  # stored as raw bytes
        src = src.view(torch.bfloat16)
    return src.reshape(gguf_shape(t))


def mapped_planes(t) -> dict[str, torch.Tensor] | None:
    """A block-format tensor's QuantizedWeight planes as raw bytes over the mapping,
    {plane: uint8 [N, K/32, bytes]}; None for a type without a `BLOCK_PLANES` layout."""
    planes = BLOCK_PLANES.get(QUANT_TYPES.get(t.tensor_type.name))
    if planes is None:
        return None
    n, k = gguf_shape(t)
    blocks = mapped(t).view(n, k // GGUF_BLOCK, GGUF_BLOCK_BYTES[QUANT_TYPES[t.tensor_type.name]])
    return {plane: blocks[:, :, a:b] for plane, (a, b) in planes.items()}


def gguf_tensor(t, path: Path) -> torch.Tensor | QuantizedWeight:
    """A GGUF tensor as the model holds it: block formats as QuantizedWeight planes,
    F32/F16 as they are, BF16 as float32 (exact)."""
    ttype = t.tensor_type.name
    if ttype not in SUPPORTED_TYPES:
        raise SpecDecError(
            f"{path}: tensor {t.name} has unsupported type {ttype} "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    shape = gguf_shape(t)
    if ttype in QUANT_TYPES or ttype in KQUANT_TYPES:
        if len(shape) != 2:
            raise SpecDecError(f"{path}: quantized tensor {t.name} is not 2-D")
        if ttype in KQUANT_TYPES:
            return from_gguf_kquant(t.data, KQUANT_TYPES[ttype], shape)
        return from_gguf_blocks(t.data, QUANT_TYPES[ttype], shape)
    dense = mapped_dense(t)
    return dense.float() if ttype == "BF16" else dense.clone()


def _unpermute_rows(w, order: torch.Tensor):
    if isinstance(w, QuantizedWeight):
        return w.select_rows(order)
    return w.index_select(0, order)


def load_gguf(path: str | Path):
    """-> (Transformer, Tokenizer) on CPU, weights as stored (call model.setup(...) next)."""
    from specdec.models.builder import build_model

    path = Path(path)
    if not path.is_file():
        raise SpecDecError(f"model file not found: {path}")
    reader = open_gguf(path)
    check_gguf_metadata(lambda key, default=None: _field(reader, key, default), path)
    cfg = read_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    check_tensor_shapes(
        cfg, ((n, tuple(reversed(t.shape.tolist()))) for n, t in tensors.items()), "gguf", path
    )

    def get(name: str, file_name: str):
        t = tensors.get(file_name)
        if t is None:
            raise SpecDecError(f"{path}: missing tensor {file_name}")
        w = gguf_tensor(t, path)
        order = gguf_row_order(cfg, part_of(name), w.shape[0])
        return w if order is None else _unpermute_rows(w, order)

    tokenizer = Tokenizer.from_gguf_reader(reader, path)
    drop_vocabulary_fields(reader)
    state = read_state(cfg, "gguf", get)
    emb = state["embed"]
    if emb.shape[0] != cfg.vocab_size:
        raise SpecDecError(
            f"{path}: token_embd has {emb.shape[0]} rows but the vocabulary has {cfg.vocab_size}"
        )
    return build_model(cfg, state), tokenizer


# the reader's per-token fields: gguf.GGUFReader keeps one or two numpy views per element
VOCABULARY_FIELDS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


def drop_vocabulary_fields(reader) -> None:
    """Free the reader's per-token fields once the tokenizer is built. gguf.GGUFReader
    parses an array field into one or two numpy views per element, about 380 MiB for
    Qwen2.5-Coder's 151,936 tokens and 151,387 merges (the reader's anonymous memory: 488
    MiB, 108 MiB without them), which otherwise stay alive while the weights are copied out
    of the file."""
    for key in VOCABULARY_FIELDS:
        reader.fields.pop(key, None)
