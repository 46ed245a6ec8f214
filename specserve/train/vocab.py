"""The draft vocabulary: the most frequent target tokens the head is trained to predict.

``d2t[d]`` is the offset from draft id d to its target id (target = d + d2t[d]); ``t2d`` marks the
target ids that have a draft id. Draft ids follow target-id order, so d2t is non-decreasing.
"""

from __future__ import annotations

from typing import Iterable

import torch


def count_tokens(sequences: Iterable[tuple[list[int], list[bool]]], vocab_size: int) -> torch.Tensor:
    """Frequency of each target token over loss-masked positions: [vocab_size] int64."""
    kept: list[int] = []
    for ids, mask in sequences:
        kept.extend(t for t, m in zip(ids, mask) if m)
    t = torch.tensor(kept, dtype=torch.int64)
    if t.numel() and int(t.max()) >= vocab_size:
        raise ValueError(f"token id {int(t.max())} >= vocab_size {vocab_size}")
    return torch.bincount(t, minlength=vocab_size)


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft_vocab_size] int64, t2d [vocab] bool) from token counts.

    Takes the ``draft_vocab_size`` most frequent tokens (ties: lower id first); when fewer tokens
    were seen, the rest are filled with the lowest unseen ids so the map is always full.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size={vocab_size}]")
    # stable sort by descending count keeps lower ids first among ties
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_ids_of(t2d: torch.Tensor) -> torch.Tensor:
    """Target ids in draft-id order (the inverse view of d2t)."""
    return torch.nonzero(t2d, as_tuple=False).flatten()
