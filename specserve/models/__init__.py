"""Model definitions: our own Llama / Qwen2 / Qwen3 / Gemma 3 decoders and the registry that builds them."""

from specserve.models.gemma3 import Gemma3ForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from specserve.models.registry import build_model, resolve_dtype, supported_architectures

__all__ = [
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "build_model",
    "resolve_dtype",
    "supported_architectures",
]
