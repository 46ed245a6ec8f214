"""Tokenizer: a HF fast tokenizer (``tokenizers``) plus the chat template (jinja2).

Loaded from an HF-style directory (tokenizer.json, tokenizer_config.json, optional
generation_config.json / chat_template.jinja). transformers is not imported: loading takes
tens of milliseconds.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        eos = {int(i) for i in extra_eos_token_ids}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: set[int] = eos
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._template = None

    def __getstate__(self) -> dict[str, Any]:
        # pickled to the server's front-ends; the compiled template is rebuilt there on first use
        return {**self.__dict__, "_template": None}

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer vocabulary")
        return tid

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path} (a fast-tokenizer file is required)")
        backend = HFTokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif template is None:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        extra = gen.get("eos_token_id")
        extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
        return cls(
            backend,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            chat_template=template,
            extra_eos_token_ids=extra,
        )

    # -- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens=True applies the tokenizer's post-processor (e.g. a BOS prefix).

        Through encode_batch, which releases the GIL (encode does not): a server thread tokenizing a long
        prompt leaves the event loop free."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A streaming decoder for one request's output ids (the server's front-end keeps one per request)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template_text(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the chat template to a prompt string (special tokens as literal text)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (a base model): send a plain prompt (/v1/completions) instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        text = self.apply_chat_template_text(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _compile_template(source: str):
    """Compile a chat template in a sandbox with the helpers HF templates expect."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    One ``tokenizers`` DecodeStream step per token (Rust: ~1 us, where decoding a window of ids
    twice a token in Python took ~3): it withholds text while the ids end inside a UTF-8 sequence
    split across byte tokens. Primed with the prompt's last ids, so tokenizers that drop a leading
    space at decode start (SentencePiece) still produce it for the first generated token.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.backend = tokenizer.backend
        self.stream = DecodeStream(ids=list(prompt_ids[-6:]), skip_special_tokens=skip_special_tokens)
        self.text = ""  # everything emitted so far

    def append(self, new_ids: Sequence[int] | int) -> str:
        """Add generated ids; return the newly completed text (possibly "")."""
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        step, backend = self.stream.step, self.backend
        delta = ""
        for i in new_ids:
            piece = step(backend, int(i))
            if piece:
                delta += piece
        self.text += delta
        return delta
