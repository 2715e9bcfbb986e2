"""Checks on model files at load time, before any tensor is used: GGUF metadata, HF
config.json / tokenizer_config.json / generation_config.json / safetensors index, and every
tensor's shape against the config. Each failure is a SpecDecError naming the file and the
field, so a malformed file is one error line instead of a RuntimeError at the first matmul.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.models.config import ARCHITECTURES, ModelConfig
from specdec.models.tensor_map import MODEL, tensor_names, tensor_shapes

# -- values -----------------------------------------------------------------------------------


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v: object, where: str) -> int:
    if not is_int(v) or v <= 0:
        raise SpecDecError(f"{where} must be a positive integer, got {v!r}")
    return v


def positive_float(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SpecDecError(f"{where} must be a positive finite number, got {v!r}")
    return float(v)


def _token_ids(v: object, where: str) -> None:
    """None, a non-negative int or a list of them (eos_token_id and friends)."""
    items = v if isinstance(v, list) else [v]
    if not all(x is None or (is_int(x) and x >= 0) for x in items):
        raise SpecDecError(f"{where} must be a token id or a list of token ids, got {v!r}")


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object -> the dict (one error line otherwise)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SpecDecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise SpecDecError(f"{path}: invalid JSON ({e})") from e
    except OSError as e:
        raise SpecDecError(f"{path}: unreadable ({e.strerror or e})") from e
    if not isinstance(obj, dict):
        raise SpecDecError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


# -- HF directories -----------------------------------------------------------------------

HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_hf_config(cfg: object, path: Path) -> None:
    """config.json of a Llama / Qwen2 checkpoint: an object with positive integer sizes."""
    if not isinstance(cfg, dict):
        raise SpecDecError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        raise SpecDecError(
            f"{path}: architectures must be a list of class names such as "
            f'["LlamaForCausalLM"], got {archs!r}'
        )
    missing = [k for k in (*HF_SIZES, "intermediate_size") if k not in cfg]
    if missing:
        raise SpecDecError(f"{path}: lacks {', '.join(missing)}")
    for k in (*HF_SIZES, "intermediate_size"):
        positive_int(cfg[k], f"{path}: {k}")
    for k in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if cfg.get(k) is not None:
            positive_int(cfg[k], f"{path}: {k}")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
    if kv and heads % kv:
        raise SpecDecError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise SpecDecError(
            f"{path}: hidden_size {cfg['hidden_size']} is not a multiple of "
            f"num_attention_heads {heads} (and there is no head_dim)"
        )
    for k in ("rms_norm_eps", "rope_theta"):
        if cfg.get(k) is not None:
            positive_float(cfg[k], f"{path}: {k}")
    for k in ("rope_scaling", "rope_parameters"):
        if cfg.get(k) is not None and not isinstance(cfg[k], dict):
            raise SpecDecError(f"{path}: {k} must be an object or null, got {cfg[k]!r}")
    for k in ("tie_word_embeddings", "attention_bias"):
        if k in cfg and not isinstance(cfg[k], bool):
            raise SpecDecError(f"{path}: {k} must be true or false, got {cfg[k]!r}")
    for k in ("bos_token_id", "eos_token_id"):
        _token_ids(cfg.get(k), f"{path}: {k}")


def check_tokenizer_config(tcfg: dict, path: Path) -> None:
    for k in ("bos_token", "eos_token"):
        v = tcfg.get(k)
        if not (v is None or isinstance(v, str) or isinstance(v, dict)):
            raise SpecDecError(f"{path}: {k} must be a string or an object, got {v!r}")
        if isinstance(v, dict) and not isinstance(v.get("content"), str):
            raise SpecDecError(f"{path}: {k} is an object without a string 'content'")
    if "add_bos_token" in tcfg and not isinstance(tcfg["add_bos_token"], bool):
        raise SpecDecError(f"{path}: add_bos_token must be true or false")


def check_generation_config(gcfg: dict, path: Path) -> None:
    _token_ids(gcfg.get("eos_token_id"), f"{path}: eos_token_id")


def read_safetensors_index(path: Path) -> list[str]:
    """model.safetensors.index.json -> the shard file names (plain names in the directory)."""
    index = read_json_object(path)
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise SpecDecError(f"{path}: weight_map must be an object of tensor name -> file name")
    files = sorted(set(wm.values()))
    for f in files:
        if Path(f).name != f or f in ("", ".", ".."):
            raise SpecDecError(f"{path}: shard {f!r} is not a file name in the model directory")
    return files


# -- GGUF metadata --------------------------------------------------------------------------


def check_gguf_metadata(field, path: Path) -> None:
    """field(key, default=None) -> a GGUF metadata value. Sizes must be positive integers,
    the head counts consistent, and the tokenizer present. An unknown architecture is left to
    the loader's message."""
    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        return
    missing = object()

    def get(key: str, required: bool):
        v = field(f"{arch}.{key}", missing)
        if v is missing and required:
            raise SpecDecError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return None if v is missing else v

    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        positive_int(get(key, True), f"{path}: {arch}.{key}")
    for key in ("attention.head_count_kv", "attention.key_length", "context_length", "vocab_size"):
        v = get(key, False)
        if v is not None:
            positive_int(v, f"{path}: {arch}.{key}")
    positive_float(
        get("attention.layer_norm_rms_epsilon", True),
        f"{path}: {arch}.attention.layer_norm_rms_epsilon",
    )
    theta = get("rope.freq_base", False)
    if theta is not None:
        positive_float(theta, f"{path}: {arch}.rope.freq_base")
    heads, kv = get("attention.head_count", True), get("attention.head_count_kv", False)
    if kv is not None and heads % kv:
        raise SpecDecError(
            f"{path}: {arch}.attention.head_count {heads} is not a multiple of "
            f"{arch}.attention.head_count_kv {kv}"
        )
    dim = get("embedding_length", True)
    if get("attention.key_length", False) is None and dim % heads:
        raise SpecDecError(
            f"{path}: {arch}.embedding_length {dim} is not a multiple of "
            f"{arch}.attention.head_count {heads}"
        )
    tokens = field("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpecDecError(f"{path}: GGUF metadata lacks the tokenizer's tokens")
    merges = field("tokenizer.ggml.merges")
    if merges is not None and not (
        isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)
    ):
        raise SpecDecError(f"{path}: tokenizer.ggml.merges must be 'a b' strings")
    types = field("tokenizer.ggml.token_type")
    if types is not None and not (isinstance(types, list) and len(types) == len(tokens)):
        raise SpecDecError(
            f"{path}: tokenizer.ggml.token_type must list one type per token ({len(tokens)})"
        )
    for key in ("bos_token_id", "eos_token_id", "eot_token_id"):
        v = field(f"tokenizer.ggml.{key}")
        if v is not None and not (is_int(v) and 0 <= v < len(tokens)):
            raise SpecDecError(
                f"{path}: tokenizer.ggml.{key} {v!r} is not a token id (vocabulary {len(tokens)})"
            )


# -- tensor shapes ----------------------------------------------------------------------------


def expected_shapes(cfg: ModelConfig, fmt: str) -> dict[str, tuple[int, ...]]:
    """File tensor name (fmt "gguf" | "hf") -> the shape the config implies, in torch's
    [out, in] order; from the tensor map (specdec.models.tensor_map)."""
    names, shapes = tensor_names(cfg, fmt), tensor_shapes(cfg)
    out = {names[k]: shapes[k] for k in names}
    # an LM head present in the file is checked even where the config ties it
    out.setdefault(MODEL["lm_head"].file_name(fmt), (cfg.vocab_size, cfg.dim))
    return out


def check_tensor_shapes(
    cfg: ModelConfig, shapes: Iterable[tuple[str, tuple[int, ...]]], fmt: str, origin: Path
) -> None:
    """Every tensor the model uses has the shape its config implies (missing tensors are the
    loader's message). `shapes`: (file tensor name, shape in [out, in] order)."""
    want = expected_shapes(cfg, fmt)
    for name, shape in shapes:
        exp = want.get(name)
        if exp is not None and tuple(shape) != exp:
            raise SpecDecError(
                f"{origin}: tensor {name} has shape {list(shape)}, but the config "
                f"(dim {cfg.dim}, {cfg.n_heads} heads x {cfg.head_dim}, {cfg.n_kv_heads} kv heads, "
                f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}) implies {list(exp)}"
            )
