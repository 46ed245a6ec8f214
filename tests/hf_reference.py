"""transformers' own load of the SmolLM2 GGUF (its GGUF loader takes ~20-30 s on two cores), kept
for the test modules that compare against it (test_engine_e2e, then test_loader, which frees it
when it is done), instead of loaded once per module."""

from __future__ import annotations

import os

import torch

_models: dict[str, torch.nn.Module] = {}


def hf_smollm2() -> torch.nn.Module:
    """The float32 transformers model of the default GGUF, in eval mode (callers only read it)."""
    if "model" not in _models:
        from transformers import AutoModelForCausalLM

        from specserve.loader import default_model_path

        path = default_model_path()
        _models["model"] = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()
    return _models["model"]


def release() -> None:
    _models.clear()
