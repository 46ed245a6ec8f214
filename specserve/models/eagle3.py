"""The EAGLE draft head: one definition for the engine's drafting loop and the trainer.

EAGLE-3 (``algorithm="EAGLE3"``, public layout ``LlamaForCausalLMEagle3``)::

    combine(aux[T, 3*Ht]) = fc(aux)                                  -> h0 [T, H]
    forward(e, h, pos):  x = cat(input_layernorm(e), hidden_norm(h))  (embeds first)
                         h = h + o_proj(attn(q/k/v_proj(x), RoPE(pos)))
                         h = h + mlp(post_attention_layernorm(h))   -> returned PRE-norm
    compute_logits(h)  = lm_head(norm(h))   fp32 over the draft vocab
    draft_to_target(d) = d + d2t[d]

EAGLE-1 (``algorithm="EAGLE"``, e.g. ``LlamaForCausalLMEagle``): the feature is the target's
final hidden state, ``forward`` first fuses ``fc(cat(e, h))`` (2H -> H, optional bias) and then
runs ``layers.*`` (plain Llama decoder layers; layer 0 has no input_layernorm). It has no norm or
lm_head of its own: ``bind_target(compute_logits)`` attaches the target's, and the draft vocab is
the target vocab.

Position convention (shared with the trainer): the pair (feature of token t, embedding of token
t+1) sits at position t, and each further draft step adds 1. Attention goes through
``get_forward_context().attn.forward(layer, q, k, v)`` with layer indices of the draft's own KV
cache (0 for an EAGLE-3 head). Embeddings are not owned: the caller passes the target's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.base import get_forward_context
from specserve.models import layers
from specserve.models.layers import RMSNorm, silu_mul

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3Draft")
EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "EAGLEModel")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
# keys some public checkpoints carry that this module does not own (the target provides them)
IGNORED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """Layers whose entering residual stream EAGLE-3 feeds to ``fc`` (SGLang/vLLM default)."""
    n = num_target_layers
    if n < 4:  # tiny test models: stay inside the target
        return (min(2, n - 1), n // 2, max(n - 3, 0))
    return (2, n // 2, n - 3)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None  # None: same as hidden_size
    aux_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layer_ids(target layers)
    algorithm: str = "EAGLE3"  # or "EAGLE" (EAGLE-1 layout)
    num_hidden_layers: int = 1  # EAGLE-1 heads may have more than one decoder layer
    fc_bias: bool = False  # EAGLE-1 fc may carry a bias
    attention_bias: bool = False
    norm_before_residual: bool = False  # some EAGLE-3 heads take the residual after hidden_norm
    hidden_act: str = "silu"
    architecture: str = "LlamaForCausalLMEagle3"
    extra: dict[str, Any] = field(default_factory=dict)  # other config.json keys, kept on save

    def __post_init__(self) -> None:
        if self.algorithm not in ("EAGLE3", "EAGLE"):
            raise ValueError(f"algorithm must be EAGLE3 or EAGLE, got {self.algorithm!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.algorithm == "EAGLE" and self.draft_vocab_size != self.vocab_size:
            raise ValueError("an EAGLE-1 head drafts over the full target vocab (draft_vocab_size == vocab_size)")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu MLPs are supported, got hidden_act={self.hidden_act!r}")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
            if self.algorithm == "EAGLE3" and len(self.aux_layer_ids) != 3:
                raise ValueError(f"an EAGLE-3 head takes 3 aux layers, got {self.aux_layer_ids}")

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes: 3*Ht (EAGLE-3) or H (EAGLE-1)."""
        ht = self.target_hidden_size or self.hidden_size
        return 3 * ht if self.algorithm == "EAGLE3" else ht

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        for i in ids:
            if not 0 <= i < num_target_layers:
                raise ValueError(f"aux layer id {i} out of range for a target of {num_target_layers} layers")
        return tuple(ids)

    @classmethod
    def from_target(cls, target: Any, draft_vocab_size: int, **overrides: Any) -> "Eagle3Config":
        """An EAGLE-3 head shaped like the target (a ModelConfig)."""
        kw: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            aux_layer_ids=default_aux_layer_ids(target.num_hidden_layers),
        )
        kw.update(overrides)
        return cls(**kw)

    # ---- public config.json layout -------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3Config":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else "LlamaForCausalLMEagle3"
        if arch in EAGLE1_ARCHS:
            algorithm = "EAGLE"
        elif arch in EAGLE3_ARCHS or "Eagle3" in arch or d.get("draft_vocab_size"):
            algorithm = "EAGLE3"
        else:
            raise ValueError(f"config.json architectures={archs} is not an EAGLE or EAGLE-3 draft head")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise ValueError(f"draft config.json lacks {key!r}")
        n_heads = d["num_attention_heads"]
        eagle_cfg = d.get("eagle_config") or {}
        aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
        vocab = d["vocab_size"]
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        known = {
            "architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "target_hidden_size", "eagle_config", "num_hidden_layers", "bias",
            "attention_bias", "norm_before_residual", "hidden_act", "model_type", "tie_word_embeddings",
        }
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            vocab_size=vocab,
            draft_vocab_size=d.get("draft_vocab_size") or vocab,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            target_hidden_size=d.get("target_hidden_size"),
            aux_layer_ids=tuple(aux) if aux else None,
            algorithm=algorithm,
            num_hidden_layers=d.get("num_hidden_layers", 1),
            fc_bias=bool(d.get("bias", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            hidden_act=d.get("hidden_act", "silu"),
            architecture=arch,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Eagle3Config":
        """Read ``config.json`` (a file, or a directory holding it)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no draft config.json at {p}")
        with open(p) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: v for k, v in self.extra.items()}
        d.update(
            architectures=[self.architecture],
            model_type="llama",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            tie_word_embeddings=False,
        )
        if self.algorithm == "EAGLE3":
            d["draft_vocab_size"] = self.draft_vocab_size
            if self.target_hidden_size is not None:
                d["target_hidden_size"] = self.target_hidden_size
            if self.aux_layer_ids is not None:
                d["eagle_config"] = {**(d.get("eagle_config") or {}),
                                     "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
            if self.norm_before_residual:
                d["norm_before_residual"] = True
        else:
            d["bias"] = self.fc_bias
        if self.attention_bias:
            d["attention_bias"] = True
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


# ---- building blocks ------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The head's RoPE inverse frequencies: layers.rope_inv_freq computed in fp64, then fp32."""
    return layers.rope_inv_freq(head_dim, theta, scaling, torch.float64)[0].float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D/2] for ``apply_rope`` (computed once for q and k)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by position (half-split / NeoX-style, as Llama in HF layout);
    ``cos_sin`` from ``rope_cos_sin``."""
    cos, sin = cos_sin
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One frozen linear whose output is the outputs of ``parts`` (same input) side by side."""
    w = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if has_bias:
            out.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return out.requires_grad_(False)


class DraftAttention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_dim: int, layer_index: int) -> None:
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.layer_index = layer_index
        self.q_proj = nn.Linear(in_dim, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_dim, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_dim, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None  # q, k, v stacked, after fuse_projections()
        self.register_buffer("inv_freq", rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling), persistent=False)
        # cos, sin [positions, D/2] (fp32, rope_cos_sin's values) for the GPU's one-kernel rotary +
        # KV write (build_rope_tables; inference with fused projections only)
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def build_rope_tables(self, num_positions: int) -> None:
        """cos and sin of every position below ``num_positions``, computed as rope_cos_sin computes
        them, on the device of ``inv_freq``: on a CUDA device with the triton attention, the fused
        head then rotates q and k and writes k, v to the cache in one kernel (a draft step's rotary
        was ~15 small kernels, a third of the head's)."""
        cos, sin = rope_cos_sin(torch.arange(num_positions, device=self.inv_freq.device), self.inv_freq)
        self.rope_tables = (cos[:, 0].contiguous(), sin[:, 0].contiguous())

    def fuse_projections(self) -> None:
        self.qkv_proj = stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        attn = get_forward_context().attn
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            if (self.rope_tables is not None and qkv.is_cuda and layers.FUSED_OPS and attn.supports_fused_rope
                    and qkv.dtype == attn.kv_caches[self.layer_index][0].dtype):
                out = attn.forward_rope(self.layer_index, qkv, *self.rope_tables, h, positions=positions)
                return self.o_proj(out.reshape(T, h * d))
            # q and k heads side by side: one rotation for both
            q, k = apply_rope(qkv[:, : (h + kv) * d].view(T, h + kv, d),
                              rope_cos_sin(positions, self.inv_freq)).split((h, kv), dim=1)
            v = qkv[:, (h + kv) * d :].view(T, kv, d)
        else:
            cs = rope_cos_sin(positions, self.inv_freq)
            q = apply_rope(self.q_proj(x).view(T, h, d), cs)
            k = apply_rope(self.k_proj(x).view(T, kv, d), cs)
            v = self.v_proj(x).view(T, kv, d)
        out = attn.forward(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(T, h * d))


class DraftMLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # gate and up stacked, after fuse_projections()

    def fuse_projections(self) -> None:
        self.gate_up_proj = stacked_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(silu_mul(self.gate_up_proj(x)))  # (one kernel on the GPU)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    """The EAGLE-3 decoder layer: attention over cat(input_layernorm(embeds), hidden_norm(h))."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, trainable=True)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, trainable=True)
        self.self_attn = DraftAttention(cfg, 2 * cfg.hidden_size, layer_index=0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, trainable=True)
        self.mlp = DraftMLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h_normed = self.hidden_norm(hidden)
        residual = h_normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), h_normed], dim=-1)
        # h = residual + attention and its norm: one kernel on the GPU
        normed, h = self.post_attention_layernorm.forward_add(self.self_attn(x, positions), residual)
        return h + self.mlp(normed)


class Eagle1Layer(nn.Module):
    """A plain Llama decoder layer; EAGLE-1's first layer skips input_layernorm."""

    def __init__(self, cfg: Eagle3Config, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, trainable=True) if index > 0 else None
        self.self_attn = DraftAttention(cfg, cfg.hidden_size, layer_index=index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, trainable=True)
        self.mlp = DraftMLP(cfg)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h) if self.input_layernorm is not None else h
        h = h + self.self_attn(x, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---- the head -------------------------------------------------------------------------------


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        cfg = config
        H = cfg.hidden_size
        self.is_eagle3 = cfg.algorithm == "EAGLE3"
        self._target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.fused = False  # fuse_projections() was called (inference only)
        if self.is_eagle3:
            self.fc = nn.Linear(cfg.feature_size, H, bias=False)
            self.midlayer = Eagle3MidLayer(cfg)
            self.norm = RMSNorm(H, cfg.rms_norm_eps, trainable=True)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                                 if cfg.draft_vocab_size == cfg.vocab_size
                                 else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
            self.layers = nn.ModuleList([Eagle1Layer(cfg, i) for i in range(cfg.num_hidden_layers)])

    def fuse_projections(self) -> "Eagle3DraftModel":
        """For inference: q/k/v and gate/up each become one matmul (one weight read and one call
        instead of three and two: on a CPU a draft step is mostly per-call overhead). The public
        layout is gone after this (the head can no longer be saved or loaded into)."""
        if not self.fused:
            for m in list(self.modules()):
                if isinstance(m, (DraftAttention, DraftMLP)):
                    m.fuse_projections()
            if self.is_eagle3:  # draft id -> target id as one gather (d + d2t[d] is two kernels)
                self.register_buffer("draft_ids", torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
                                     + self.d2t, persistent=False)
            self.fused = True
        return self

    def build_rope_tables(self, num_positions: int) -> None:
        """Every attention's cos/sin tables (DraftAttention.build_rope_tables)."""
        for m in self.modules():
            if isinstance(m, DraftAttention):
                m.build_rope_tables(num_positions)

    @property
    def num_kv_layers(self) -> int:
        """Layers of KV cache the head needs in its own attention backend."""
        return 1 if self.is_eagle3 else self.config.num_hidden_layers

    # ---- drafting API ----

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target feature -> the head's hidden input. EAGLE-3: fc over [T, 3Ht]; EAGLE-1: identity."""
        if aux_hidden.shape[-1] != self.config.feature_size:
            raise ValueError(f"target feature has width {aux_hidden.shape[-1]}, head expects {self.config.feature_size}")
        if self.is_eagle3:
            return self.fc(aux_hidden.to(self.fc.weight.dtype))
        return aux_hidden

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One draft step over a flat batch: returns the PRE-norm hidden [T, H] (fed back next step)."""
        dtype = self.fc.weight.dtype
        input_embeds = input_embeds.to(dtype)
        hidden = hidden.to(dtype)
        if self.is_eagle3:
            return self.midlayer(input_embeds, hidden, positions)
        h = self.fc(torch.cat([input_embeds, hidden], dim=-1))
        for layer in self.layers:
            h = layer(h, positions)
        return h

    def bind_target(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Attach the target's logits function (EAGLE-1 heads have no lm_head of their own)."""
        self._target_logits = compute_logits

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, draft_vocab] (EAGLE-1: the target's full vocab)."""
        if self.is_eagle3:
            return self.lm_head(self.norm(hidden_out)).float()
        if self._target_logits is None:
            raise RuntimeError("an EAGLE-1 head needs the target's lm_head: call bind_target(target.compute_logits)")
        return self._target_logits(hidden_out).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.is_eagle3:
            return ids
        if self.fused:
            return self.draft_ids[ids]
        return ids + self.d2t[ids]

    def greedy_draft(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """The target-vocab id of each row's most likely draft token (compute_logits' argmax, without
        its fp32 copy: the cast changes no value)."""
        if self.is_eagle3:
            return self.draft_to_target(self.lm_head(self.norm(hidden_out)).argmax(-1))
        return self.compute_logits(hidden_out).argmax(-1)

    def top_drafts(self, hidden_out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``k`` most likely draft tokens: (fp32 log-probabilities, target-vocab ids) [T, k],
        best first (layers.topk_logprobs: one kernel on the GPU, reading the logits in their own dtype)."""
        logits = self.lm_head(self.norm(hidden_out)) if self.is_eagle3 else self.compute_logits(hidden_out)
        score, ids = layers.topk_logprobs(logits, k)
        return score, self.draft_to_target(ids)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise ValueError(f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                             f"draft_vocab_size={cfg.draft_vocab_size}, vocab_size={cfg.vocab_size}")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))
        if self.fused:
            self.draft_ids.copy_(torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t)

    # ---- public checkpoint layout ----

    def _check_public_layout(self) -> None:
        if self.fused:
            raise RuntimeError("this head's projections are fused for inference; save or load an unfused copy")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors in the public layout (float tensors cast to ``dtype``)."""
        from safetensors.torch import save_file

        self._check_public_layout()
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for k, v in self.state_dict().items():
            v = v.detach()
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            tensors[k] = v.contiguous().cpu()
        self.config.to_json(os.path.join(path, "config.json"))
        save_file(tensors, os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Eagle3DraftModel":
        cfg = Eagle3Config.from_json(path)
        model = cls(cfg)
        model.load_state(_read_checkpoint(os.fspath(path)), source=os.fspath(path))
        return model.to(device=device, dtype=dtype)  # .to(dtype) leaves the int/bool buffers alone

    def load_state(self, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Load a public-layout state dict; missing tensors or wrong shapes raise naming the tensor."""
        self._check_public_layout()
        expected = self.expected_shapes()
        tensors = {k: v for k, v in tensors.items() if k not in IGNORED_KEYS}
        if self.is_eagle3 and "d2t" not in tensors and "t2d" not in tensors \
                and self.config.draft_vocab_size == self.config.vocab_size:
            # a full-vocab head may omit the map: identity
            tensors = dict(tensors, d2t=torch.zeros(self.config.draft_vocab_size, dtype=torch.int64),
                           t2d=torch.ones(self.config.vocab_size, dtype=torch.bool))
        missing = [k for k in expected if k not in tensors]
        if missing:
            raise ValueError(f"draft head at {source} is missing tensor(s): {', '.join(missing)}")
        unexpected = [k for k in tensors if k not in expected]
        if unexpected:
            raise ValueError(f"draft head at {source} has unexpected tensor(s): {', '.join(sorted(unexpected))}")
        for k, shape in expected.items():
            got = tuple(tensors[k].shape)
            if got != shape:
                raise ValueError(f"draft head at {source}: tensor {k} has shape {got}, config implies {shape}")
        state = {}
        for k, v in tensors.items():
            if k == "d2t":
                v = v.to(torch.int64)
            elif k == "t2d":
                v = v.to(torch.bool)
            state[k] = v
        self.load_state_dict(state, strict=True)


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a head directory: single or sharded safetensors, or a torch .bin."""
    from safetensors.torch import load_file

    def shards(index_file: str) -> Iterable[str]:
        with open(os.path.join(path, index_file)) as f:
            weight_map = json.load(f).get("weight_map") or {}
        return sorted(set(weight_map.values()))

    files: list[str]
    if os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        files = [os.path.join(path, s) for s in shards(SAFETENSORS_INDEX)]
    elif os.path.isfile(os.path.join(path, SAFETENSORS_FILE)):
        files = [os.path.join(path, SAFETENSORS_FILE)]
    elif os.path.isfile(os.path.join(path, TORCH_BIN_INDEX)):
        files = [os.path.join(path, s) for s in shards(TORCH_BIN_INDEX)]
    elif os.path.isfile(os.path.join(path, TORCH_BIN_FILE)):
        files = [os.path.join(path, TORCH_BIN_FILE)]
    else:
        raise FileNotFoundError(f"no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_BIN_FILE} in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"draft head shard {f} listed in the index does not exist")
        if f.endswith(".safetensors"):
            out.update(load_file(f))
        else:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


__all__ = ["Eagle3Config", "Eagle3DraftModel", "RMSNorm", "default_aux_layer_ids", "rope_inv_freq", "rope_cos_sin", "apply_rope",
           "stacked_linear"]

