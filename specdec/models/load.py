"""`load_model("smollm2-135m" | "x.gguf" | "hf_dir/", dtype=..., device=...)`."""

from __future__ import annotations

import torch

from specdec.errors import SpecDecError
from specdec.models.registry import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The compute dtype `auto` means: bfloat16 on a CPU with bf16 dot-product instructions
    (AVX512-BF16 or AMX-BF16, which oneDNN's bf16 GEMM uses: a verification of 5 tokens then
    costs about one decode step, README "CPU backend"), float32 on other CPUs (bf16 is
    converted in software there and runs slower than fp32) and on CUDA (no GPU run has
    compared them yet)."""
    from specdec.models.cpu_linear import cpu_features

    if torch.device(device).type == "cpu" and cpu_features()["bf16_native"]:
        return torch.bfloat16
    return torch.float32


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name (float32 | bfloat16 | float16 | auto: `auto_dtype(device)`)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        choices = ", ".join([*DTYPES, "auto"])
        raise SpecDecError(f"invalid dtype {name!r} (choose one of {choices})")
    return DTYPES[name]


def parse_device(name: str | torch.device) -> torch.device:
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise SpecDecError(f"invalid device {name!r} ({e})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device {name!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise SpecDecError(f"unsupported device {name!r} (cpu or cuda)")
    return dev


def load_weights(name_or_path: str, *, quantize: str | None = None, group_size: int = 64):
    """-> (Transformer with its weights as loaded, on the CPU and not set up, Tokenizer, path)."""
    from specdec.models.gguf_loader import load_gguf
    from specdec.models.hf_loader import load_hf

    path = resolve_model_path(name_or_path)
    if path.is_dir():
        model, tok = load_hf(path, quantize=quantize, group_size=group_size)
    elif path.suffix == ".gguf":
        if quantize:
            raise SpecDecError(
                "--quantize applies to safetensors models; GGUF weights are already quantized"
            )
        model, tok = load_gguf(path)
    else:
        raise SpecDecError(f"{path}: expected a .gguf file or an HF model directory")
    return model, tok, path


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    backend: str | None = None,
    quantize: str | None = None,
    group_size: int = 64,
    cpu_linear: str | None = None,
    batch_invariant: str | bool | None = None,
    cpu_compile: str | bool | None = None,
):
    """-> (Transformer ready on `device` in `dtype`, Tokenizer). `cpu_linear`: the CPU linear
    mode (`specdec.models.cpu_linear`; None: $SPECDEC_CPU_LINEAR or "dense");
    `batch_invariant`: auto | on | off (`specdec.models.batch_invariant`; None:
    $SPECDEC_BATCH_INVARIANT or auto); `cpu_compile`: off | on (`specdec.models.cpu_compile`;
    None: $SPECDEC_CPU_COMPILE or off)."""
    dev = parse_device(device)
    dt = parse_dtype(dtype, dev)
    model, tok, _ = load_weights(name_or_path, quantize=quantize, group_size=group_size)
    with torch.inference_mode():
        model.setup(
            dt,
            dev,
            backend,
            cpu_linear=cpu_linear,
            batch_invariant_setting=batch_invariant,
            cpu_compile=cpu_compile,
        )
    model.eval()
    return model, tok


def load_tokenizer(name_or_path: str):
    """The tokenizer of a registered model, .gguf file or HF directory, without its weights."""
    from specdec.models.gguf_loader import _field, open_gguf
    from specdec.models.tokenizer import Tokenizer
    from specdec.models.validate import check_gguf_metadata, check_hf_config, read_json_object

    path = resolve_model_path(name_or_path)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise SpecDecError(f"{path}: config.json not found (not an HF model directory)")
        raw = read_json_object(cfg_path)
        check_hf_config(raw, cfg_path)
        return Tokenizer.from_hf_dir(path, raw)
    if path.suffix != ".gguf":
        raise SpecDecError(f"{path}: expected a .gguf file or an HF model directory")
    if not path.is_file():
        raise SpecDecError(f"model file not found: {path}")
    reader = open_gguf(path)
    check_gguf_metadata(lambda key, default=None: _field(reader, key, default), path)
    return Tokenizer.from_gguf_reader(reader, path)
