"""Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k, no bias).

Both are the Llama decoder with flags that ``ModelConfig`` already carries
(``attention_bias``, ``qk_norm``); the classes exist so checkpoints map by architecture name.
"""

from __future__ import annotations

from specserve.config import ModelConfig
from specserve.distributed.parallel import TPGroup
from specserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if config.qk_norm:
            raise ValueError("Qwen2 has no q/k norm; got a config with qk_norm=True")
        super().__init__(config, tp)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if not config.qk_norm:
            raise ValueError("Qwen3 needs qk_norm=True in its ModelConfig")
        super().__init__(config, tp)
