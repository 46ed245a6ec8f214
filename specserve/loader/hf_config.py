"""Normalising HF config.json dicts before ``ModelConfig.from_hf``.

transformers 5 writes ``rope_parameters`` (not ``rope_scaling``) and leaves ``architectures``
unset on configs built in code; both would otherwise be misread.
"""

from __future__ import annotations

from typing import Any

# model_type -> architecture, for configs without "architectures"
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def normalize_hf_config(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of `d` with ``architectures``, ``rope_theta`` and ``rope_scaling`` filled in."""
    d = dict(d)
    if not d.get("architectures"):
        mt = d.get("model_type")
        if mt not in _ARCH_BY_MODEL_TYPE:
            raise ValueError(
                f"config has no 'architectures' and an unknown model_type {mt!r} "
                f"(known: {', '.join(sorted(_ARCH_BY_MODEL_TYPE))})"
            )
        d["architectures"] = [_ARCH_BY_MODEL_TYPE[mt]]
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" not in d and "rope_theta" in rp:
            d["rope_theta"] = rp["rope_theta"]
        if d.get("rope_scaling") is None and rp.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return d
