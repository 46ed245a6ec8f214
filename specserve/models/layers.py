"""Building blocks shared by the decoder models: linear, RMSNorm, rotary embedding, gated MLP.

Parameters are created uninitialised (``torch.empty``): real weights come from
``load_weights`` and random ones from ``specserve.loader.dummy_weights``. This keeps model
construction instant even for large models on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel import split

# CUDA tensors go through the fused Triton kernels of ``triton_ops`` (False: the torch ops there too)
FUSED_OPS = True


def _fused(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    if not (FUSED_OPS and x.is_cuda and x.stride(-1) == 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False  # the kernels have no backward (the trainer on a GPU keeps the torch ops)
    if weight is not None and weight.dtype != x.dtype:
        return False
    return _triton_ops() is not None


_TRITON_OPS: Any = None


def _triton_ops() -> Any:
    """specserve.models.triton_ops, imported on first use (None without triton)."""
    global _TRITON_OPS
    if _TRITON_OPS is None:
        try:
            from specserve.models import triton_ops
        except ImportError:
            triton_ops = False  # type: ignore[assignment]
        _TRITON_OPS = triton_ops
    return _TRITON_OPS or None


class Linear(nn.Module):
    """y = x W^T (+ b), with an uninitialised weight of shape [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """A tensor-parallel rank's rows [start, start + count) of the embedding table: ids outside them
    look up zeros, and the all-reduce sums the one rank that holds each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: Any) -> None:
        self.start, count = tp.vocab(num_embeddings)
        super().__init__(count, embedding_dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(h)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float, trainable: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight stored as an offset from one, normalised and scaled by (1 + weight)
    in fp32, then cast back, as transformers does (a bf16 1 + weight would round it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + residual
        return self.forward(s), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalised in fp32 by one fused op, cast back, then times the
    weight, bit for bit what transformers computes (with the weight inside the op, bf16 would round
    once, not twice)."""
    if _fused(x, weight):
        return _triton_ops().add_rms_norm(x, None, weight, eps)[0]
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual: one kernel on the GPU."""
    if _fused(x, weight) and residual.stride(-1) == 1 and residual.dtype == x.dtype:
        return _triton_ops().add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return rms_norm(s, weight, eps), s


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits) in fp32, top ``k`` per row: (values, indices). One kernel on the GPU for
    rows up to triton_ops.TOPK_LOGPROBS_MAX_N wide (a draft vocabulary), torch's ops elsewhere."""
    if _fused(logits) and logits.dim() == 2 and logits.shape[-1] <= _triton_ops().TOPK_LOGPROBS_MAX_N:
        return _triton_ops().topk_logprobs(logits, k)
    return torch.log_softmax(logits.float(), -1).topk(k, dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] on the last dim: one kernel on the GPU."""
    if _fused(gate_up):
        return _triton_ops().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) (tanh approximation, HF's gelu_pytorch_tanh) * up for gate_up = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_GATED_ACTS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one [2*I, H] matmul. With ``tp`` (a
    distributed.TPGroup) this rank's slice of I: gate_up column-parallel, down row-parallel, then the
    all-reduce of the ranks' partial sums."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", tp: Any = None) -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: implemented are {', '.join(_GATED_ACTS)}")
        self.act_mul = _GATED_ACTS[hidden_act]
        self.tp = tp
        self.intermediate_start = 0
        if tp is not None:
            self.intermediate_start, intermediate_size = split(intermediate_size, tp.size, tp.rank)
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (the "rotate half" / NeoX layout used by HF Llama and Qwen).


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (computed in ``dtype``) and the cos/sin multiplier for a rope config."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim))
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0  # type: ignore[index]
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope_scaling), 1.0  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: supported are default, linear, llama3")


def llama3_inv_freq(inv_freq: torch.Tensor, rs: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, smooth between."""
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim] in fp32, gathered by explicit per-token positions.

    Stored as ``cos`` = [cos, cos] and ``sin`` = [-sin, sin] over the two halves, so the
    rotation is ``x * cos + roll(x, D/2) * sin``: four kernels, and bit-identical to the
    rotate-half form. The tables are plain attributes, not buffers, so ``model.to(bfloat16)``
    leaves them in fp32; they follow the positions' device on first use.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        inv_freq, mscale = rope_inv_freq(head_dim, theta, rope_scaling)
        device = torch.empty(0).device  # honours an enclosing `with torch.device(...)`
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos() * mscale, freqs.sin() * mscale
        self.cos = torch.cat((cos, cos), dim=-1).to(device)
        self.sin = torch.cat((-sin, sin), dim=-1).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in `dtype` for the given positions."""
        if self.cos.device != positions.device:
            self.cos = self.cos.to(positions.device)
            self.sin = self.sin.to(positions.device)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the tables of ``RotaryEmbedding.forward`` (rotate-half layout)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] rotated, v [T, KVH, D], from the fused projection qkv
    [T, (H + 2 KVH) * D]: the q and k heads side by side, so one rotary pass covers both."""
    T, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    q, k = apply_rotary(qkv[:, : qk_heads * head_dim].view(T, qk_heads, head_dim), cos, sin).split(
        (num_heads, num_kv_heads), dim=1)
    return q, k, qkv[:, qk_heads * head_dim :].view(T, num_kv_heads, head_dim)
