"""Tokenizers built with HF `tokenizers` from GGUF metadata or from tokenizer.json.

GGUF byte-level BPE ("gpt2" tokenizer model) is rebuilt the way HF transformers converts
it: a BPE model over the GGUF vocabulary and merges, ByteLevel pre-tokenizer and decoder,
control / user-defined tokens registered as special tokens so they are never split.
"""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecDecError
from specdec.models.chat_template import ChatTemplate, select_hf_template
from specdec.models.validate import (
    check_generation_config,
    check_tokenizer_config,
    read_json_object,
)

# gguf token types
_CONTROL, _USER_DEFINED = 3, 4


# GGUF `tokenizer.ggml.pre` values whose split differs from GPT-2's byte-level regex
# (the regexes of HF's tokenizer converters)
_PRE_TOKENIZER_REGEX = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}


class Tokenizer:
    def __init__(
        self,
        backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        stop_ids: set[int] | None = None,
        origin: str = "model",
    ):
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, origin) if chat_template else None
        self.stop_ids = set(stop_ids or ()) | ({eos_id} if eos_id is not None else set())

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise SpecDecError("this model has no chat template; run without --chat")
        tok = lambda i: self.backend.id_to_token(i) if i is not None else ""  # noqa: E731
        return self._template.render(
            messages,
            add_generation_prompt,
            bos_token=tok(self.bos_id),
            eos_token=tok(self.eos_id),
        )

    def encode_chat(self, text: str | list[dict]) -> list[int]:
        """User message (or a whole conversation: [{"role", "content"}, ...]) -> ids of the
        chat-formatted prompt (template decides BOS)."""
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        rendered = self.apply_chat_template(messages)
        return self.backend.encode(rendered, add_special_tokens=False).ids

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_gguf_reader(cls, reader, path: Path) -> Tokenizer:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise SpecDecError(
                f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)"
            )
        tokens = field("tokenizer.ggml.tokens")
        merges = field("tokenizer.ggml.merges") or []
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
        tk = HFTokenizer(bpe)
        split = _PRE_TOKENIZER_REGEX.get(field("tokenizer.ggml.pre"))
        if split is None:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=True, use_regex=True
            )
        else:  # as HF transformers' GGUF converter: split, then bytes (no normalizer)
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tk.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
        tk.add_special_tokens(special)
        eos = field("tokenizer.ggml.eos_token_id")
        stop = {field("tokenizer.ggml.eot_token_id")} - {None}
        return cls(
            tk,
            bos_id=field("tokenizer.ggml.bos_token_id"),
            eos_id=eos,
            add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
            chat_template=field("tokenizer.chat_template"),
            stop_ids=stop,
            origin=str(path),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path, config: dict) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        tj = directory / "tokenizer.json"
        if not tj.is_file():
            raise SpecDecError(f"{directory}: tokenizer.json not found")
        try:
            tk = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise SpecDecError(f"{tj}: unreadable tokenizer ({e})") from e
        tcfg = {}
        tc_path = directory / "tokenizer_config.json"
        if tc_path.is_file():
            tcfg = read_json_object(tc_path)
            check_tokenizer_config(tcfg, tc_path)

        def tok_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return tk.token_to_id(value) if isinstance(value, str) else None

        bos = tok_id(tcfg.get("bos_token"))
        if bos is None:
            bos = config.get("bos_token_id")
        eos = tok_id(tcfg.get("eos_token"))
        if eos is None:
            eos = config.get("eos_token_id")
        if isinstance(eos, list):
            stop, eos = set(eos), eos[0]
        else:
            stop = set()
        gen = directory / "generation_config.json"
        if gen.is_file():
            gcfg = read_json_object(gen)
            check_generation_config(gcfg, gen)
            g = gcfg.get("eos_token_id")
            stop |= set(g if isinstance(g, list) else [g]) - {None}
        # tokenizer.json's post-processor adds BOS when the model wants it; we add it ourselves
        add_bos = bool(tcfg.get("add_bos_token", False))
        return cls(
            tk,
            bos_id=bos,
            eos_id=eos,
            add_bos=add_bos,
            chat_template=select_hf_template(tcfg.get("chat_template"), str(tc_path)),
            stop_ids=stop,
            origin=str(tc_path),
        )
