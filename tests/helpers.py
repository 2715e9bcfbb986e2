"""Tiny random models for tests: HF checkpoints (save_pretrained + a small trained BPE
tokenizer) and GGUF files written from them with gguf's writer and quantizers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "1 + 2 = 3, 10 * 7 = 70, 123456789",
    "Summaries, translations, questions and answers.",
]


def make_tokenizer(directory: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on a small corpus; write tokenizer.json + config. -> vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 4, trainer)
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    return tk.get_vocab_size()


def make_hf_model(
    directory: Path,
    arch: str = "llama",
    tie: bool = False,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 96,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = 320,
) -> Path:
    """Random LlamaForCausalLM / Qwen2ForCausalLM saved as safetensors in `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(directory, vocab_size)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # HF inits small; widen so logits are not all ~0
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5) * 4)
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    return directory


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert permutation (HF rotate-half -> interleaved rope)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(hf_dir: Path, path: Path, qtype: str = "Q8_0", arch: str | None = None) -> Path:
    """Write the HF checkpoint in `hf_dir` as a GGUF with 2-D weights in `qtype`
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1) and F32 norms/biases; tokenizer from tokenizer.json."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or ("qwen2" if cfg["architectures"][0].startswith("Qwen2") else "llama")
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    tokens = [None] * cfg["vocab_size"]
    for t, i in {**vocab, **added}.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def put(name: str, t: torch.Tensor, quant: bool):
        a = t.float().numpy()
        if quant and a.ndim == 2:
            if qt == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, a)
            elif qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a.astype(np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"], True)
    put("output_norm.weight", sd["model.norm.weight"], False)
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"], True)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], False)
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False)
        for hf, gg in names.items():
            t = sd[p + hf + ".weight"]
            if arch == "llama" and gg in ("attn_q", "attn_k"):
                t = torch.from_numpy(
                    _permute_qk(t.float().numpy(), n_head if gg == "attn_q" else n_kv)
                )
            put(f"blk.{i}.{gg}.weight", t, True)
            if p + hf + ".bias" in sd:
                put(f"blk.{i}.{gg}.bias", sd[p + hf + ".bias"], False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of integer `samples` against the distribution `probs` [V]: cells
    expected below 5 are pooled, a pooled cell still below 5 is folded into the largest one.
    Asserts first that no sample has probability 0."""
    from scipy.stats import chisquare

    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * counts.sum()
    assert (counts[probs == 0] == 0).all(), "sampled a token the target gives probability 0"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:
        obs[exp[:-1].argmax()] += obs[-1]
        exp[exp[:-1].argmax()] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@torch.inference_mode()
def first_two_token_probs(model, prompt: list[int], params) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference distributions of the first two tokens after `prompt` under `params`
    (plain forwards, float64): p1 [V], and p2 [V] = sum_a p1(a) p(. | prompt + a)."""
    from specdec.decode.sampling import logits_to_probs
    from specdec.models.transformer import KVCache

    n = len(prompt) + 2
    start = torch.zeros(1, dtype=torch.long)
    p1 = logits_to_probs(
        model(torch.tensor([prompt]), KVCache.for_model(model, 1, n), start)[0, -1], params
    ).double()
    cand = torch.nonzero(p1 > 0).flatten()
    seqs = torch.tensor([prompt + [int(c)] for c in cand])
    start = torch.zeros(len(cand), dtype=torch.long)
    p2c = logits_to_probs(
        model(seqs, KVCache.for_model(model, len(cand), n), start)[:, -1], params
    ).double()
    return p1, (p1[cand, None] * p2c).sum(0)


def assert_head_cache_is_fresh(drafter, b: int, feats: torch.Tensor, tokens: torch.Tensor):
    """Row b of a head drafter's cache, for the `drafter.fed[b]` positions it has read, must
    equal what a fresh head computes when fed only those: the target's features
    feats [1, T, n, dim] of the committed sequence tokens [1, T] (each position's feature
    paired with the next token). Returns the fresh head's output [1, fed, dim]."""
    from specdec.decode.heads.head import HeadCache

    head, fed = drafter.head, drafter.fed[b]
    fresh = HeadCache(head.cfg, 1, tokens.shape[1], "cpu")
    h = head.step(
        head.fuse_features(feats[:, :fed]),
        tokens[:, 1 : fed + 1],
        fresh,
        torch.zeros(1, dtype=torch.long),
    )
    torch.testing.assert_close(
        drafter.cache.k[b, :, :fed], fresh.k[0, :, :fed], atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        drafter.cache.v[b, :, :fed], fresh.v[0, :, :fed], atol=1e-5, rtol=1e-4
    )
    return h


def one_error_line(capsys, main, argv: list[str]) -> str:
    """Run a CLI's `main(argv)` in this process: it must exit with code 2 and print exactly
    one line on stderr, starting with 'error: ' (blank lines around it ignored) -> that line."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def hf_greedy_tokens(hf, ids: list[int], n: int, eos_token_id, pad_token_id: int) -> list[int]:
    """HF transformers' greedy `generate` of up to n tokens after `ids` (batch 1), stopping
    at `eos_token_id` (an id or a list of ids): the reference the parity tests compare to."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
    return out[0, len(ids) :].tolist()
