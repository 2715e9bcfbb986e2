"""Chat templates from model files, rendered in Jinja's immutable sandbox.

A chat template is code written by whoever made the model file (GGUF metadata
`tokenizer.chat_template`, an HF directory's `tokenizer_config.json`), so it is rendered the
way HF transformers renders it: `jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute
starting with `_`, no mutation of the data passed in, no unsafe callables), with the helpers
real templates call (`raise_exception`, `strftime_now`, the `tojson` filter, `namespace`,
`break` / `continue`) and nothing else. Every failure of the template -- a syntax error, an
undefined name, `raise_exception`, an attempt to leave the sandbox -- is a SpecDecError naming
the file, so a CLI prints it as one error line.
"""

from __future__ import annotations

import json
import operator
from datetime import datetime
from typing import Any

from specdec.errors import SpecDecError

# Largest string / list a template may build with `*`, and largest exponent of `**`: a template
# must not be able to exhaust memory with one expression.
MAX_REPEAT_LEN = 1 << 20
MAX_EXPONENT = 1024


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which chat templates do not want
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _make_environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class SafeNamespace(Namespace):
        """`namespace(...)` that refuses attribute names starting with `_`."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"namespace attribute {name!r} starts with '_' (not allowed)"
                )

    class ChatSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
            if op == "**":
                if isinstance(right, int) and abs(right) > MAX_EXPONENT and left not in (0, 1, -1):
                    raise jinja2.exceptions.SecurityError(
                        f"exponent {right} is larger than {MAX_EXPONENT}"
                    )
                return operator.pow(left, right)
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > MAX_REPEAT_LEN:
                        raise jinja2.exceptions.SecurityError(
                            f"repetition builds {len(seq) * n} items (limit {MAX_REPEAT_LEN})"
                        )
            return operator.mul(left, right)

    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = SafeNamespace
    return env


class ChatTemplate:
    """A chat template from `origin` (the file it came from, for error messages).

    Compiled on first use, so a model whose template is broken still loads and runs
    without --chat."""

    def __init__(self, source: str, origin: str):
        if not isinstance(source, str):
            raise SpecDecError(
                f"{origin}: chat template is a {type(source).__name__}, not a string"
            )
        self.source = source
        self.origin = origin
        self._compiled = None

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **tokens: Any
    ) -> str:
        """messages ([{"role", "content"}, ...]) -> the prompt text. `tokens`: the special
        token strings the template may use (bos_token, eos_token, ...)."""
        try:
            if self._compiled is None:
                self._compiled = _make_environment().from_string(self.source)
            out = self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **tokens
            )
        except Exception as e:  # the template is the model file's code: any failure is the file's
            raise SpecDecError(
                f"{self.origin}: chat template failed ({type(e).__name__}: {_one_line(e)})"
            ) from e
        return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "no message"


def select_hf_template(value: object, origin: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"}
    (transformers' named templates; the one named "default" is used) -> the source or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise SpecDecError(
                    f"{origin}: chat_template list entries must be "
                    '{"name": str, "template": str} objects'
                )
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise SpecDecError(
                f"{origin}: chat_template has no template named 'default' "
                f"(names: {', '.join(sorted(named)) or 'none'})"
            )
        return named["default"]
    raise SpecDecError(
        f"{origin}: chat_template is a {type(value).__name__}, not a string or a list"
    )
