"""Target features (the aux layers' hidden states) of every computed token, kept by KV slot like the KV; with
EAGLE-3 the target's forward writes them itself (``set_feature_sink``) and a chain's verify copies nothing."""

from __future__ import annotations

from collections import Counter

import torch

from specserve.engine.host_copy import host_to_device
from specserve.engine.scheduler import StepPlan
from specserve.speculative.state import state_of


class FeatureStore:
    def __init__(self, target, num_slots: int, feature_size: int, dtype: torch.dtype, device: torch.device,
                 in_forward: bool, path_counts: Counter) -> None:
        self.target = target
        self.device = device
        self.features = torch.zeros(num_slots, feature_size, dtype=dtype, device=device)  # [slots, F]
        self.in_forward = in_forward and hasattr(target, "set_feature_sink")
        if self.in_forward:
            target.set_feature_sink(self.features)
        self.path_counts = path_counts

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self.features.index_select(0, slots)

    def keep_plain(self, plan: StepPlan, inputs, feats: torch.Tensor) -> None:
        """A plain step's rows (one per computed token) at their slots; starts the state of admitted requests."""
        if not self.in_forward:  # (a graph's output rows past the step's are padding)
            self.features.index_copy_(0, inputs.meta.slot_mapping, feats[: inputs.input_ids.shape[0]])
        for r in plan.admitted:
            state_of(r)

    def keep_verified(self, plan: StepPlan, inputs, feats: torch.Tensor, kept_rows: list[list[int]]) -> None:
        """A verify's committed rows: kept row j of a request's query goes to its j-th slot."""
        j = start = 0
        keep: list[int] = []  # query rows kept
        dst: list[int] = []  # their indices in the step's slot mapping
        for s in plan.scheduled:
            if s.samples:
                n0 = s.num_new_tokens - 1  # prefill rows before the last known token
                rows = list(range(start, start + n0)) + [start + n0 + r for r in kept_rows[j]]
                j += 1
            else:
                rows = list(range(start, start + s.num_new_tokens))
            keep.extend(rows)
            dst.extend(range(start, start + len(rows)))
            state_of(s.req)
            start += s.num_query_tokens
        if self.in_forward:
            moved = [(k, d) for k, d in zip(keep, dst) if k != d]
            if not moved:
                return
            keep, dst = [k for k, _ in moved], [d for _, d in moved]
        idx = host_to_device(keep + dst, self.device)
        self.features.index_copy_(0, inputs.meta.slot_mapping.index_select(0, idx[len(keep):]),
                                  feats.index_select(0, idx[: len(keep)]))
