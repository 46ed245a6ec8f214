"""Normalising HF config.json dicts before ``ModelConfig.from_hf``.

transformers 5 writes ``rope_parameters`` (not ``rope_scaling``) and leaves ``architectures``
unset on configs built in code; both would otherwise be misread. Gemma 3 keeps one set of rope
parameters per layer type (``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``
in transformers 5; ``rope_theta`` + ``rope_local_base_freq`` before): both become the flat
``rope_theta`` (global layers, with their ``rope_scaling``) and ``rope_local_base_freq``.
"""

from __future__ import annotations

from typing import Any

# model_type -> architecture, for configs without "architectures"
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# Gemma 3's defaults where a config.json leaves them out (transformers' Gemma3TextConfig)
_GEMMA3_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096}


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
    if d["architectures"][0] == "Gemma3ForCausalLM":
        return _normalize_gemma3(d)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" not in d and "rope_theta" in rp:
            d["rope_theta"] = rp["rope_theta"]
        if d.get("rope_scaling") is None and rp.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return d


def _normalize_gemma3(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 configs with attn_logit_softcapping are not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not supported")
    for k, v in _GEMMA3_DEFAULTS.items():
        if d.get(k) is None:
            d[k] = v
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        d["rope_theta"] = full.get("rope_theta", d["rope_theta"])
        d["rope_local_base_freq"] = local.get("rope_theta", d["rope_local_base_freq"])
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 local rope type {local['rope_type']!r} is not supported")
        if full.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if not d.get("layer_types"):
        p = int(d["sliding_window_pattern"])
        d["layer_types"] = ["sliding_attention" if (i + 1) % p else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    d["hidden_act"] = d["hidden_activation"]
    d.setdefault("tie_word_embeddings", True)
    return d
