"""Llama-family decoder (Llama 2/3, SmolLM2; Qwen2/Qwen3 differ only by flags, see qwen.py).

The model runs one flat, ragged batch: ``forward(input_ids[T], positions[T]) -> hidden[T, H]``.
Attention goes through ``get_forward_context().attn`` (paged KV cache, per-step metadata),
so layers see no metadata in their signatures.

Parameter names follow HF except for two fused matmuls per layer: ``self_attn.qkv_proj``
(q_proj, k_proj, v_proj stacked on rows) and ``mlp.gate_up_proj`` (gate_proj, up_proj).
``load_weights`` maps the separate HF tensors into their row slices.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from specserve.attention.base import get_forward_context
from specserve.config import ModelConfig
from specserve.distributed.parallel import TPGroup, rank_heads
from specserve.models import layers
from specserve.models.layers import (Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding,
                                     apply_rotary, rotary_qkv)


class Attention(nn.Module):
    """With ``tp`` (a distributed.TPGroup): this rank's query heads and their KV heads (qkv
    column-parallel, o_proj row-parallel, then the all-reduce of the ranks' partial sums)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = rank_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = config.attention_bias
        # Qwen2 has bias on q/k/v only; Llama and Qwen3 put `attention_bias` on o_proj too.
        o_bias = config.attention_bias and not config.architecture.startswith("Qwen2")  # (rank 0's alone, see hf_shard)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        attn = get_forward_context().attn
        if self.q_norm is None and attn.supports_fused_rope and layers.FUSED_OPS and qkv.is_cuda:
            # one kernel: rotary on q and k, k and v into the paged cache
            o = attn.forward_rope(self.layer_idx, qkv, cos, sin, self.num_heads)
            return self._out(o.reshape(T, self.q_size))
        if self.q_norm is None:
            q, k, v = rotary_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
            q = self.q_norm(qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim))  # type: ignore[misc]
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        o = attn.forward(self.layer_idx, q, k, v)
        return self._out(o.reshape(T, self.q_size))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(o)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is h + residual (just h when residual is None); returns the MLP's
        output and the stream before it, so the next norm adds them in its own kernel."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.forward_add(h, residual)
        x, residual = self.post_attention_layernorm.forward_add(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = (Embedding(config.vocab_size, config.hidden_size) if tp is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# HF tensor name suffix inside a layer -> (our fused parameter, which slice)
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}


class LlamaForCausalLM(nn.Module):
    """``tp`` (a distributed.TPGroup): this rank's shard of a tensor-parallel model, its embeddings and
    LM head vocab-parallel (``compute_logits`` gathers every rank's columns)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, tp)
        self.vocab_start, vocab = (0, config.vocab_size) if tp is None else tp.vocab(config.vocab_size)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self._aux_layers: tuple[int, ...] | None = None
        self.feature_sink: torch.Tensor | None = None  # set_feature_sink

    # -- the API the engine uses ---------------------------------------------------------------

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def get_input_embeddings(self) -> Embedding:
        return self.model.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_feature_sink(self, buf: torch.Tensor | None) -> None:
        """With aux layers set, also write each computed token's aux features (the concatenated residual
        streams) into row ``slot`` of ``buf``, ``slot`` being the token's KV cache slot: inside the forward
        (and its CUDA graph) rather than as a separate scatter after it, which cost a plain decode step a
        kernel launch on the host (EAGLE-3 drafters keep every token's features for the head's catch-up)."""
        self.feature_sink = buf

    def set_aux_hidden_layers(self, ids: tuple[int, ...] | None) -> None:
        """Make ``forward`` also return the residual stream entering each of these layers."""
        if ids is not None:
            ids = tuple(int(i) for i in ids)
            n = self.config.num_hidden_layers
            bad = [i for i in ids if not 0 <= i < n]
            if bad or not ids:
                raise ValueError(f"aux hidden layer ids must be a non-empty subset of [0, {n}), got {ids}")
        self._aux_layers = ids

    @property
    def aux_hidden_layers(self) -> tuple[int, ...] | None:
        return self._aux_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        aux_ids = self._aux_layers or ()
        captured: dict[int, torch.Tensor] = {}
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            if i in aux_ids:  # the residual stream entering layer i
                if residual is not None:
                    h, residual = h + residual, None
                captured[i] = h
            h, residual = layer(h, residual, cos, sin)
        out = self.model.norm.forward_add(h, residual)[0]
        if not aux_ids:
            return out
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1)
        if self.feature_sink is not None:
            self.feature_sink.index_copy_(0, get_forward_context().attn.step_slots(aux.shape[0]), aux)
        return out, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab]."""
        if self.lm_head is not None:  # own weight, or a packed copy of the tied one (cpu_packing)
            logits = self.lm_head(hidden).float()
        else:
            logits = torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        if self.tp is None:
            return logits
        return self.tp.gather_columns(logits, self.config.vocab_size)

    # -- weights -------------------------------------------------------------------------------

    def _slice_bounds(self, kind: str) -> tuple[int, int]:
        attn = self.model.layers[0].self_attn
        inter = self.model.layers[0].mlp.intermediate_size
        return {
            "q": (0, attn.q_size),
            "k": (attn.q_size, attn.kv_size),
            "v": (attn.q_size + attn.kv_size, attn.kv_size),
            "gate": (0, inter),
            "up": (inter, inter),
        }[kind]

    def hf_weight_map(self) -> dict[str, tuple[str, int, int]]:
        """HF tensor name -> (our parameter name, row start, row count); count -1 = whole tensor."""
        out: dict[str, tuple[str, int, int]] = {}
        stacked_by_ours = {}
        for hf_sfx, (ours, kind) in _STACKED.items():
            stacked_by_ours.setdefault(ours, []).append((hf_sfx, kind))
        for name, _ in self.named_parameters():
            base, _, leaf = name.rpartition(".")  # leaf: weight | bias
            matched = False
            for ours, parts in stacked_by_ours.items():
                if base.endswith("." + ours):
                    prefix = base[: -len(ours)]
                    for hf_sfx, kind in parts:
                        start, count = self._slice_bounds(kind)
                        out[f"{prefix}{hf_sfx}.{leaf}"] = (name, start, count)
                    matched = True
                    break
            if not matched:
                out[name] = (name, 0, -1)
        return out

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names and shapes this model expects from a checkpoint."""
        params = dict(self.named_parameters())
        shapes = {}
        for hf, (ours, start, count) in self.hf_weight_map().items():
            shape = tuple(params[ours].shape)
            shapes[hf] = shape if count < 0 else (count, *shape[1:])
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a stream of (HF name, tensor) into the parameters, converting dtype and device.

        Raises ValueError naming unexpected tensors, missing tensors or shape mismatches.
        """
        wmap = self.hf_weight_map()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still carry a copy of the embeddings
            if name not in wmap:
                unexpected.append(name)
                continue
            ours, start, count = wmap[name]
            dst = params[ours].data
            if count >= 0:
                dst = dst.narrow(0, start, count)
            tensor = self._shard(name, tensor, dst)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(wmap) - loaded)
        if unexpected or missing:
            msg = []
            if unexpected:
                msg.append(f"{len(unexpected)} unexpected tensor(s): {_preview(unexpected)}")
            if missing:
                msg.append(f"{len(missing)} missing tensor(s): {_preview(missing)}")
            raise ValueError(f"checkpoint does not match {type(self).__name__}: " + "; ".join(msg))

    def hf_shard(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, count): the part of checkpoint tensor ``name`` this tensor-parallel rank holds
        (None: all of it). Ranks past 0 take no row-parallel bias (the all-reduce adds rank 0's once)."""
        tp, D = self.tp, self.config.head_dim
        if tp is None:
            return None
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        base, _, leaf = name.rpartition(".")
        if base.endswith("self_attn.q_proj"):
            return 0, attn.q_start * D, attn.num_heads * D
        if base.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return 0, attn.kv_start * D, attn.num_kv_heads * D
        if base.endswith("self_attn.o_proj"):
            return (1, attn.q_start * D, attn.num_heads * D) if leaf == "weight" else (0, 0, -1)
        if base.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return 0, mlp.intermediate_start, mlp.intermediate_size
        if base.endswith("mlp.down_proj"):
            return (1, mlp.intermediate_start, mlp.intermediate_size) if leaf == "weight" else (0, 0, -1)
        if base in ("model.embed_tokens", "lm_head"):
            return 0, *tp.vocab(self.config.vocab_size)
        return None

    def _shard(self, name: str, tensor, dst: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: a torch tensor, or a lazy safetensors slice read here
        (only that part leaves the file)."""
        shard = self.hf_shard(name)
        if shard is not None and shard[2] < 0 and self.tp.rank > 0:  # a row-parallel bias: rank 0's alone
            return torch.zeros(dst.shape, dtype=dst.dtype)
        if shard is None or shard[2] < 0:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        dim, start, count = shard
        if isinstance(tensor, torch.Tensor):
            return tensor.narrow(dim, start, count)
        return tensor[start : start + count] if dim == 0 else tensor[:, start : start + count]

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This model's parameters as (HF name, tensor), un-fusing qkv and gate_up (views)."""
        params = dict(self.named_parameters())
        for hf, (ours, start, count) in self.hf_weight_map().items():
            p = params[ours].data
            yield hf, p if count < 0 else p.narrow(0, start, count)


def _preview(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")
