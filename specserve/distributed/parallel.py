"""Tensor-parallel groups and how a model's dimensions are split over their ranks.

A ``TPGroup`` is one rank's view: its rank, the group size, the process group the model's
collectives run on (NCCL on CUDA, gloo on the CPU) and a gloo group for the step plans rank 0
broadcasts (``driver.py`` / ``worker.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from specserve.config import ModelConfig

# a collective waits this long for a rank before it raises (a dead rank's socket fails them sooner)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part ``i`` when ``n`` items are cut into ``parts`` contiguous parts, the first
    ``n % parts`` one longer: split(9, 2, 0) = (0, 5), split(9, 2, 1) = (5, 4)."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (i < extra)


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of ``rank``. Query heads go with their
    KV head; with fewer KV heads than ranks each rank keeps one KV head (replicated) and a share of its
    query heads: 9 heads, 3 KV heads, 2 ranks -> (0, 6, 0, 2), (6, 3, 2, 1); 4, 1, 2 -> (0, 2, 0, 1), (2, 2, 0, 1)."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv0, kvn = split(num_kv_heads, size, rank)
        return kv0 * group, kvn * group, kv0, kvn
    if size % num_kv_heads:
        raise ValueError(f"tensor parallelism over {size} ranks needs a multiple of the {num_kv_heads} KV heads")
    per_kv = size // num_kv_heads
    kv = rank // per_kv
    q0, qn = split(group, per_kv, rank % per_kv)
    if qn == 0:
        raise ValueError(f"tensor parallelism over {size} ranks: more ranks than the {num_heads} attention heads")
    return kv * group + q0, qn, kv, 1


@dataclass
class TPGroup:
    rank: int
    size: int
    group: Any = None  # the model's all-reduces and gathers
    cpu_group: Any = None  # step plans (pickled objects), gloo
    device: torch.device = torch.device("cpu")  # this rank's: where ``group``'s tensors live

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Each rank's columns [N, split(total)] -> all of them [N, total] in rank order, on every rank."""
        widths = [split(total, self.size, r)[1] for r in range(self.size)]
        w = max(widths)
        if x.shape[-1] < w:
            x = torch.nn.functional.pad(x, (0, w - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, widths)], dim=-1)

    def heads(self, mc: ModelConfig) -> tuple[int, int, int, int]:
        return head_shard(mc.num_attention_heads, mc.num_key_value_heads, self.size, self.rank)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        return split(vocab_size, self.size, self.rank)

    def local_config(self, mc: ModelConfig) -> ModelConfig:
        """``mc`` with this rank's attention heads: what its KV cache and attention backend hold."""
        _, qn, _, kvn = self.heads(mc)
        return dataclasses.replace(mc, num_attention_heads=qn, num_key_value_heads=kvn)


def rank_heads(mc: ModelConfig, tp: TPGroup | None) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of this rank; all of them without ``tp``."""
    return tp.heads(mc) if tp is not None else (0, mc.num_attention_heads, 0, mc.num_key_value_heads)


def check_tp_shapes(mc: ModelConfig, size: int) -> None:
    """A clear error before any process starts if ``mc`` cannot be split over ``size`` ranks."""
    if mc.architecture not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        raise ValueError(f"tensor parallelism supports Llama, Qwen2, Qwen3 and Gemma 3, not {mc.architecture}")
    for r in range(size):
        head_shard(mc.num_attention_heads, mc.num_key_value_heads, size, r)
    if mc.intermediate_size < size or mc.vocab_size < size:
        raise ValueError(f"tensor parallelism over {size} ranks: the model is too small to split")


def torchrun_env() -> dict[str, str] | None:
    """The torchrun variables when this process was started by torchrun (or alike), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"RANK and WORLD_SIZE are set but not {', '.join(missing)}: start the ranks with torchrun")
    return {v: os.environ[v] for v in TORCHRUN_VARS}


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: cuda:LOCAL_RANK on CUDA, the CPU elsewhere."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the default process group (NCCL on CUDA, gloo on the CPU) plus a gloo group for plans."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process (one per process)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, cpu_group, device)
