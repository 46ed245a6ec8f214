"""What rank 0 sends the other ranks of a tensor-parallel group: one op per target-model call.

An op is a name, a small picklable header and tensors: the header goes over the gloo group
(``broadcast_object_list``), the tensors over the model's group, device to device.

    forward    header: query_lens, seq_lens, tree masks, shift  tensors: ids, positions, slots, tables(, shift)
    logits     tensors: hidden [N, H]
    embed      tensors: ids [N]
    aux        header: the layers whose residual stream the forward also returns
    kv_compact tensors: tables, starts, lengths, paths, valid(, the window pool's tables)
    init       header: num_blocks
    shutdown
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from specserve.distributed.parallel import TPGroup


def send_op(tp: TPGroup, op: str, header: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()) -> None:
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    dist.broadcast_object_list([(op, header or {}, specs)], src=0, group=tp.cpu_group)
    for t in tensors:  # (gloo has no bool: sent as bytes; NCCL takes device tensors only)
        t = t.to(tp.device).contiguous()
        dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=0, group=tp.group)


def recv_op(tp: TPGroup, device: torch.device) -> tuple[str, dict[str, Any], list[torch.Tensor]]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    op, header, specs = box[0]
    tensors = []
    for shape, dtype in specs:
        t = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        dist.broadcast(t, src=0, group=tp.group)
        tensors.append(t.view(torch.bool) if dtype == torch.bool else t)
    return op, header, tensors
