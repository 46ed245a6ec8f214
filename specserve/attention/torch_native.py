"""Reference attention backend in plain PyTorch (CPU default; correctness reference on GPU).

The ragged batch is padded to [B, max_q] queries and [B, max_kv] keys once per step; every
layer then runs one batched scaled_dot_product_attention with a boolean mask. Padding costs
B x max_q x max_kv, so a step that mixes decodes (one query each, or a verify's few) with a
prompt of hundreds of tokens would pad every decode to the prompt's length: requests with more
than ``short_q`` queries get a padded group of their own (one more attention call per layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, AttentionMetadata, gather_kv, is_fp8, write_kv


@dataclass
class _Group:
    """Requests padded together: [B, max_q] queries x [B, max_kv] keys."""

    q_index: torch.Tensor  # [B, max_q] flat token index of each padded query (pads -> the zero row T)
    kv_slots: torch.Tensor  # [B, max_kv] cache slot of each padded key
    window_kv_slots: torch.Tensor | None  # the same in the window pool (meta.window_block_tables)
    mask: torch.Tensor  # [B, 1, max_q, max_kv] row attends column
    # positions of each padded query [B, 1, max_q, 1] and key [B, 1, 1, max_kv] (sliding windows): the
    # KV index, but a tree token's is its prefix length + depth
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_flat: torch.Tensor  # position of each real query in the padded [B * max_q] layout
    shape: tuple[int, int, int]
    min_q_pos: int  # the smallest query position: keys below min_q_pos - window + 1 are seen by none


class TorchNativeBackend(AttentionBackend):
    short_q = 32  # requests with at most this many queries share one padded group

    def plan(self, meta: AttentionMetadata) -> None:
        if meta.seq_shift is not None:  # (the reference backend reads it back: on a GPU, a sync)
            shift = meta.seq_shift.tolist()
            meta = dataclasses.replace(meta, seq_lens=[s + d for s, d in zip(meta.seq_lens, shift)], seq_shift=None)
        device = meta.slot_mapping.device
        q_lens = meta.query_lens
        starts, acc = [], 0
        for q in q_lens:
            starts.append(acc)
            acc += q
        T = acc
        short = [b for b, q in enumerate(q_lens) if q <= self.short_q]
        groups = ([short] if short else []) + [[b] for b, q in enumerate(q_lens) if q > self.short_q]
        bt_all = meta.block_tables.to("cpu", torch.long)
        wt_all = None if meta.window_block_tables is None else meta.window_block_tables.to("cpu", torch.long)
        self._groups = [self._plan_group(meta, g, starts, T, bt_all, wt_all, device) for g in groups]
        self._order: torch.Tensor | None = None
        if len(groups) > 1:  # the groups' outputs, concatenated, back in flat token order
            dest = torch.cat([torch.arange(starts[b], starts[b] + q_lens[b]) for g in groups for b in g])
            self._order = torch.argsort(dest).to(device)
        self._slot_mapping = meta.slot_mapping
        self._window_slot_mapping = meta.window_slot_mapping
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}

    def step_slots(self, num_tokens: int) -> torch.Tensor:
        return self._slot_mapping[:num_tokens]

    def _plan_group(self, meta: AttentionMetadata, members: list[int], starts: list[int], T: int,
                    bt_all: torch.Tensor, wt_all: torch.Tensor | None, device: torch.device) -> _Group:
        B = len(members)
        sel = torch.tensor(members, dtype=torch.long)
        q_lens = torch.tensor([meta.query_lens[b] for b in members], dtype=torch.long)
        kv_lens = torch.tensor([meta.seq_lens[b] for b in members], dtype=torch.long)
        max_q = int(q_lens.max())
        max_kv = int(kv_lens.max())

        # query padding: [B, max_q] -> flat token index, pad rows point at a zero row T
        first = torch.tensor([starts[b] for b in members], dtype=torch.long)
        qi = torch.arange(max_q)
        q_valid = qi[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, first[:, None] + qi[None, :], torch.full_like(q_valid, T, dtype=torch.long))

        # key gather: [B, max_kv] -> cache slot
        kj = torch.arange(max_kv)
        kv_valid = kj[None, :] < kv_lens[:, None]

        def slots_of(tables: torch.Tensor) -> torch.Tensor:
            bt = tables if B == tables.shape[0] else tables[sel]
            blk = bt.gather(1, (kj // self.block_size).clamp(max=bt.shape[1] - 1)[None, :].expand(B, -1))
            kv_slots = blk * self.block_size + (kj % self.block_size)[None, :]
            return torch.where(kv_valid, kv_slots, torch.zeros_like(kv_slots)).to(device)

        kv_slots = slots_of(bt_all)
        window_kv_slots = None if wt_all is None else slots_of(wt_all)

        # mask: query i of request b sits at kv position kv_len - q_len + i
        q_pos = (kv_lens - q_lens)[:, None] + qi[None, :]
        mask = (kj[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
        k_pos = kj[None, :].repeat(B, 1) if meta.tree_masks else kj[None, :]
        for i, b in enumerate(members):
            tm = (meta.tree_masks or {}).get(b)
            if tm is None:
                continue
            ql, kl = meta.query_lens[b], meta.seq_lens[b]
            if tm.dim() == 1 and tm.dtype == torch.int64 and tm.shape[0] == ql:  # rows packed as bits
                tm = ((tm[:, None] >> torch.arange(ql, device=tm.device)) & 1).bool()
            if tm.shape != (ql, ql):
                raise ValueError(f"tree mask of request {b} has shape {tuple(tm.shape)}, expected {(ql, ql)}")
            tm = tm.to("cpu", torch.bool)
            mask[i, :ql, kl - ql : kl] = tm
            depth = tm.sum(1) - 1  # a row holds the token and its ancestors
            q_pos[i, :ql] = kl - ql + depth
            k_pos[i, kl - ql : kl] = kl - ql + depth
        mask[~q_valid] = False
        mask[:, :, 0] |= ~q_valid  # padded query rows attend something, avoiding NaN

        return _Group(q_index.to(device), kv_slots, window_kv_slots, mask[:, None].to(device),
                      q_pos[:, None, :, None].to(device), k_pos[:, None, None, :].to(device),
                      # flat position of each real query in the padded [B * max_q] layout
                      q_valid.reshape(-1).nonzero()[:, 0].to(device), (B, max_q, max_kv), int(q_pos.min()))

    def _mask(self, g: _Group, window: int | None) -> tuple[torch.Tensor, int]:
        """The group's mask limited to the last ``window`` positions, from its first key column that
        any query sees (made once per step and window), and that column."""
        if window is None:
            return g.mask, 0
        got = self._window_masks.get((id(g), window))
        if got is None:  # a key at position j is seen by a query at position p when p - j < window
            lo = max(0, g.min_q_pos - window + 1)  # (a tree key's position is at most its column)
            m = (g.mask & (g.q_pos - g.k_pos < window))[..., lo:]
            m[..., 0] |= ~m.any(-1)  # (rows left empty are padding: their output is dropped)
            got = self._window_masks[(id(g), window)] = (m, lo)
        return got

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        pooled = window is not None and self._window_slot_mapping is not None  # (the window pool's layer)
        k_flat, v_flat = write_kv(self.kv_caches[layer], self._window_slot_mapping if pooled else self._slot_mapping,
                                  k, v)
        kvh, d = k_flat.shape[1:]
        h = q.shape[1]
        q_ext = torch.cat([q, q.new_zeros(1, h, d)], 0)
        outs = []
        if is_fp8(k_flat.dtype):  # gathered as bytes (indexing kernels may lack fp8)
            k_src, v_src = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
        else:
            k_src, v_src = k_flat, v_flat
        for g in self._groups:
            B, max_q, max_kv = g.shape
            mask, lo = self._mask(g, window)
            slots = g.window_kv_slots if pooled else g.kv_slots
            slots = slots if lo == 0 else slots[:, lo:]
            qp = q_ext[g.q_index].transpose(1, 2)  # [B, H, max_q, D]
            kp = gather_kv(k_src, slots).view(k_flat.dtype).transpose(1, 2)  # [B, KVH, max_kv - lo, D]
            vp = gather_kv(v_src, slots).view(v_flat.dtype).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qp, kp.to(qp.dtype), vp.to(qp.dtype), attn_mask=mask, scale=self.scale, enable_gqa=h != kvh
            )
            outs.append(out.transpose(1, 2).reshape(B * max_q, h, d)[g.q_flat])  # [T_g, H, D]
        if self._order is None:
            return outs[0]  # one group: already in flat order
        return torch.cat(outs, 0)[self._order]
