"""Architecture name (HF ``architectures[0]``) -> model class."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel import TPGroup, check_tp_shapes
from specserve.models.gemma3 import Gemma3ForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
    tp: TPGroup | None = None,
) -> nn.Module:
    """An uninitialised model for `config` on `device` in `dtype` (weights: ``load_weights``); with ``tp``
    the shard of one tensor-parallel rank."""
    cls = _MODELS.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    if cls is not Gemma3ForCausalLM and any(config.layer_window(i) for i in range(config.num_hidden_layers)):
        raise ValueError(f"{config.architecture} with sliding-window layers is not supported (only Gemma 3's are)")
    dtype = resolve_dtype(dtype)
    if tp is not None:
        check_tp_shapes(config, tp.size)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config) if tp is None else cls(config, tp)
    return model.eval()
