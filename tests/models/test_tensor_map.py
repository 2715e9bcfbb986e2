"""specdec/models/tensor_map.py against the files themselves: the names and shapes it
declares are exactly the tensors HF transformers saves and gguf's writer stores, and its
q/k row order inverts llama.cpp's converter permutation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec.models.gguf_loader import gguf_shape, open_gguf, read_config
from specdec.models.hf_loader import config_from_hf
from specdec.models.tensor_map import gguf_row_order, tensor_names, tensor_shapes
from tests.helpers import _permute_qk


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_hf_names_and_shapes_are_the_checkpoint(tiny_dir, arch, tie):
    from safetensors import safe_open

    d = tiny_dir(arch, tie)
    cfg = config_from_hf(json.loads((d / "config.json").read_text()))
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names, shapes = tensor_names(cfg, "hf"), tensor_shapes(cfg)
    assert names.keys() == shapes.keys()
    assert {names[k]: shapes[k] for k in names} == on_disk


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen2", "F16")])
def test_gguf_names_and_shapes_are_the_file(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    on_disk = {t.name: gguf_shape(t) for t in reader.tensors}
    names, shapes = tensor_names(cfg, "gguf"), tensor_shapes(cfg)
    assert {names[k]: shapes[k] for k in names} == on_disk


def test_row_order_inverts_llama_cpp_permutation(tiny_gguf):
    path = tiny_gguf("llama", "F32")
    cfg = read_config(open_gguf(path), path)
    rows = np.random.default_rng(0).standard_normal((cfg.q_dim, 3))
    permuted = torch.from_numpy(_permute_qk(rows, cfg.n_heads))
    order = gguf_row_order(cfg, "wq", cfg.q_dim)
    assert not torch.equal(order, torch.arange(cfg.q_dim))
    assert torch.equal(permuted[order], torch.from_numpy(rows))
    qwen = read_config(open_gguf(tiny_gguf("qwen2", "F32")), path)
    assert gguf_row_order(qwen, "wq", cfg.q_dim) is None  # llama.cpp permutes Llama only
    assert gguf_row_order(cfg, "wv", cfg.kv_dim) is None
