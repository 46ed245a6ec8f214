"""The target model as the trainer sees it: our engine's model class, features with aux capture."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.train.attention import DenseCausalBackend


@dataclass
class Target:
    model: nn.Module  # specserve model: forward(ids[T], positions[T]), compute_logits, embed_tokens
    config: ModelConfig
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    path: str | None = None  # where it was loaded from (None: the default model)
    name: str = "target"  # for logs and the model card

    @property
    def stop_ids(self) -> list[int]:
        ids: set[int] = set(getattr(self.tokenizer, "eos_token_ids", None) or ())
        eos = self.config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        return sorted(ids)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(path: str | None, device: torch.device, dtype: torch.dtype | None = None) -> Target:
    """Load a model the engine can load (GGUF or HF directory; None = the default model)."""
    from specserve.loader import load_model_source
    from specserve.models.registry import build_model

    src = load_model_source(path)
    dtype = dtype or default_dtype(device)
    model = build_model(src.config, device, dtype)
    model.load_weights(src.weights())
    model.eval()
    return Target(model=model, config=src.config, tokenizer=src.tokenizer, device=device, dtype=dtype,
                  path=path, name=os.path.basename(src.path))


@torch.no_grad()
def target_features(target: Target, input_ids: torch.Tensor, aux_layer_ids: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target causally over a right-padded [B, L] batch.

    Returns (aux [B*L, len(aux)*H] residual streams entering the aux layers, final hidden [B*L, H]).
    """
    from specserve.attention.base import forward_context

    B, L = input_ids.shape
    model = target.model
    prev = model.aux_hidden_layers
    model.set_aux_hidden_layers(aux_layer_ids)
    try:
        positions = torch.arange(L, device=input_ids.device).repeat(B)
        backend = DenseCausalBackend(B, L, scale=target.config.head_dim ** -0.5)
        with forward_context(backend):
            hidden, aux = model(input_ids.reshape(-1), positions)
    finally:
        model.set_aux_hidden_layers(prev)
    return aux, hidden
