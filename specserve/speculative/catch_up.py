"""The head's catch-up: draft KV over every position since a request last drafted; row i pairs (embedding of
token i+1, target feature of token i), and the last row's output seeds the drafts (``h``, or h0)."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.engine.host_copy import host_to_device
from specserve.engine.kv_cache import kv_slot
from specserve.engine.request import Request
from specserve.speculative.features import FeatureStore
from specserve.speculative.state import catch_up_end


def catch_up_slots(reqs: list[Request], starts: list[int], q_lens: list[int],
                   block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions start..start+q-1 of each request and their KV slots, vectorised."""
    counts = np.asarray(q_lens, dtype=np.int64)
    first = np.cumsum(counts) - counts  # each request's first row
    req = np.repeat(np.arange(len(reqs)), counts)
    positions = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(np.asarray(starts, np.int64) - first, counts)
    tables = np.zeros((len(reqs), max(len(r.kv.block_table) for r in reqs)), dtype=np.int64)
    for i, r in enumerate(reqs):
        tables[i, : len(r.kv.block_table)] = r.kv.block_table
    return positions, kv_slot(tables, positions, block_size, req)


class CatchUp:
    def __init__(self, head, embed, attn, features: FeatureStore, blocks, block_size: int,
                 device: torch.device, path_counts: Counter) -> None:
        self.head, self.embed, self.attn = head, embed, attn
        self.features = features
        self.blocks, self.block_size, self.device = blocks, block_size, device
        self.path_counts = path_counts
        self.runner: Any = None  # CatchUpRunner (static buffers), where built
        self.h0: torch.Tensor | None = None  # the static draft loop's input, where built

    def run_head(self, reqs: list[Request], q_lens: list[int], positions, seq_lens: list[int],
                 embeds: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One eager head forward over ``reqs``' rows (their draft KV written at ``slots``)."""
        tables = [r.kv.block_table for r in reqs]
        width = max(len(t) for t in tables)
        self.attn.plan(AttentionMetadata(
            query_lens=q_lens, seq_lens=seq_lens, slot_mapping=slots,
            block_tables=host_to_device([t + [0] * (width - len(t)) for t in tables], self.device)))
        with forward_context(self.attn):
            return self.head(embeds, hidden, host_to_device(positions, self.device))

    def __call__(self, reqs: list[Request]) -> torch.Tensor:
        """Draft KV up to each request's ``catch_up_end``; returns the head's output at that position
        [B, H] (with the static path a view of ``h0``)."""
        starts = [r.spec.draft_pos for r in reqs]
        ends = [max(catch_up_end(r), a) for r, a in zip(reqs, starts)]
        q_lens = [e - a for e, a in zip(ends, starts)]
        positions, slots = catch_up_slots(reqs, starts, q_lens, self.block_size)
        next_tokens = np.fromiter(itertools.chain.from_iterable(
            r.all_token_ids[a + 1 : e + 1] for r, a, e in zip(reqs, starts, ends)), np.int64, len(slots))
        slots_d = host_to_device(slots, self.device)
        feats = self.features.gather(slots_d)
        cu = self.runner
        if cu is not None and max(q_lens) <= cu.max_tokens:
            h = self._in_chunks(cu, reqs, q_lens, positions, next_tokens, ends, feats, slots)
        else:  # the CPU, and a request with more tokens than a step
            emb = self.embed(host_to_device(next_tokens, self.device))
            h = self.run_head(reqs, q_lens, positions, ends, emb, self.head.combine(feats), slots_d)
            h = h[host_to_device((np.cumsum(q_lens) - 1).tolist(), self.device)]
            self.path_counts["catch_up:torch"] += 1
            if self.h0 is not None:
                self.h0[: len(reqs)].copy_(h)
        for r, e in zip(reqs, ends):
            self.caught_up(r, e)
        return h

    def caught_up(self, r: Request, end: int) -> None:
        """``r``'s draft KV reaches ``end``: the blocks this catch-up filled are draft-ready."""
        bs = self.block_size
        self.blocks.mark_draft_ready(r.kv.block_table[r.spec.draft_pos // bs : end // bs])
        r.spec.draft_pos = end

    def _in_chunks(self, cu, reqs, q_lens, positions, next_tokens, seq_lens, feats, slots) -> torch.Tensor:
        """Through the static runner in groups of whole requests within its token budget."""
        tables = [r.kv.block_table for r in reqs]
        groups = []  # (first request, end request, first token, end token)
        a = p = e = 0
        for j, q in enumerate(q_lens):
            if e + q - p > cu.max_tokens:
                groups.append((a, j, p, e))
                a, p = j, e
            e += q
        groups.append((a, len(reqs), p, e))
        outs = []
        for a, b, p, e in groups:
            path = cu.run(next_tokens[p:e], positions[p:e], slots[p:e], q_lens[a:b], seq_lens[a:b], tables[a:b],
                          feats[p:e])
            self.path_counts[f"catch_up:{path}"] += 1
            if len(groups) > 1:
                outs.append(cu.h_out[: b - a].clone())  # the next group's run rewrites h_out
        if outs:
            cu.h_out[: len(reqs)].copy_(torch.cat(outs, 0))
        return cu.h_out[: len(reqs)]

