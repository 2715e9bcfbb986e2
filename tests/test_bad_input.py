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
