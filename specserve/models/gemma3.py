"""Gemma 3 text decoder (HF ``Gemma3ForCausalLM``): the Llama decoder plus

- interleaved layer types: ``sliding_attention`` layers see the last ``sliding_window`` positions
  and rotate with the local RoPE base, ``full_attention`` layers see all and use the global base
  (with its ``rope_scaling``);
- RMSNorms scaled by (1 + weight), on q and k per head too, and around both sublayers
  (input -> attn -> post_attention, pre_feedforward -> mlp -> post_feedforward);
- embeddings scaled by sqrt(hidden_size), a GELU-tanh gated MLP, attention scaled by
  query_pre_attn_scalar ** -0.5, and optional tanh soft-capping of the final logits.

Parameter names, the fused qkv / gate_up matmuls and the engine-facing API are LlamaForCausalLM's.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.attention.base import get_forward_context
from specserve.config import ModelConfig
from specserve.distributed.parallel import TPGroup, rank_heads
from specserve.models.layers import (Embedding, GatedMLP, Linear, OffsetRMSNorm, RotaryEmbedding,
                                     VocabParallelEmbedding, apply_rotary)
from specserve.models.llama import LlamaForCausalLM


class Gemma3Attention(nn.Module):
    """With ``tp``: this rank's heads, as llama.Attention."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.tp = tp
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = rank_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        # the backend scales by head_dim ** -0.5; Gemma by query_pre_attn_scalar ** -0.5
        qpas = config.query_pre_attn_scalar or config.head_dim
        self.q_scale = (config.head_dim / qpas) ** 0.5 if qpas != config.head_dim else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        o = get_forward_context().attn.forward(self.layer_idx, q, k, v, window=self.window)
        out = self.o_proj(o.reshape(T, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_window(layer_idx) is not None
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(config, layer_idx, tp)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, tp)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = (Embedding(config.vocab_size, config.hidden_size) if tp is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        if config.layer_types is None:
            raise ValueError("Gemma3ForCausalLM needs layer_types in its ModelConfig")
        self.config = config
        self.tp = tp
        self.model = Gemma3Model(config, tp)
        self.vocab_start, vocab = (0, config.vocab_size) if tp is None else tp.vocab(config.vocab_size)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                config.rope_local_theta or config.rope_theta, None)
        self.embed_scale = config.hidden_size**0.5
        self._aux_layers: tuple[int, ...] | None = None
        self.feature_sink: torch.Tensor | None = None

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        # (the scale rounded to the weights' dtype first, as HF does)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.embed_tokens(input_ids)
        rope = {False: self.rotary_emb(positions, h.dtype), True: self.local_rotary_emb(positions, h.dtype)}
        aux_ids = self._aux_layers or ()
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_ids:  # the residual stream entering layer i
                captured[i] = h
            h = layer(h, *rope[layer.is_sliding])
        out = self.model.norm(h)
        if not aux_ids:
            return out
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1)
        if self.feature_sink is not None:
            self.feature_sink.index_copy_(0, get_forward_context().attn.step_slots(aux.shape[0]), aux)
        return out, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab], soft-capped to (-cap, cap) if configured."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
