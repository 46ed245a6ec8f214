"""Start-up calibration: scratch requests stepped through the engine at every (batch bucket, depth), the
median step time seeding the bandit (time only); everything else the steps touched is put back."""

from __future__ import annotations

import copy
import logging
import time
from statistics import median
from typing import TYPE_CHECKING, Any

import torch

from specserve.sampling_params import SamplingParams
from specserve.speculative.policy.bandit import batch_key, bucket_batch

if TYPE_CHECKING:
    from specserve.speculative.drafter import EagleSpeculator

log = logging.getLogger(__name__)
PREFIX = "__specserve_calibration_"


def bucket_batches(max_batch: int) -> list[int]:
    """One batch size per bandit bucket (1, 2, 3, 4, 6, 8, 11, 16, 23, ...) up to max_batch, largest first."""
    sizes = {bucket_batch(k) for k in range(batch_key(max_batch) + 1)}
    return sorted({max_batch} | {b for b in sizes if b <= max_batch}, reverse=True)


def calibrate(drafter: EagleSpeculator, steps: int = 3, warm: int = 1, prompt_len: int = 64,
              max_seconds: float = 60.0, seed: int = 0) -> dict[str, Any]:
    """Time ``steps`` engine steps (after ``warm`` untimed ones) per (batch, depth); seed the bandit.
    Returns what was measured ({batch: {depth: seconds}}) and how long it took."""
    e = drafter.engine
    ctl = drafter.controller
    t_start = time.perf_counter()
    ctl._reference()  # frozen now: the steps below must not shift the prior the bandit is measured against
    ctl.flush()  # (the calibration's own bookkeeping, left pending when it ends, is dropped with its state)
    saved_ctl = {k: copy.deepcopy(v) for k, v in vars(ctl).items() if k not in ("cfg", "cost", "reference")}
    saved_stats = copy.deepcopy(e.stats)
    saved_paths = copy.deepcopy(drafter.path_counts)
    saved_preempt = e.scheduler.num_preemptions
    arms = ctl.arms()
    K = drafter.max_k
    per_batch = len(arms) * (warm + steps) * (K + 1)  # most tokens a request gains per batch size
    typical = len(arms) * (warm + steps) * (K + 2) // 2  # ... and about what it gains (half the drafts kept)
    bs = e.config.block_size
    max_batch = min(e.config.max_num_seqs, e.config.max_num_batched_tokens // (K + 1))
    while max_batch > 1:
        # every request long enough for all batch sizes it stays through (the first ones: all)
        batches = bucket_batches(max_batch)
        tokens = sum(b * typical for b in batches) + max_batch * (prompt_len + K + 2)
        if tokens // bs + max_batch <= e.blocks.num_free_blocks * 3 // 4:
            break
        max_batch //= 2
    batches = bucket_batches(max_batch)
    max_new = min(len(batches) * per_batch + 1, e.max_model_len - prompt_len - 1)
    if max_new < per_batch:
        return {"skipped": f"max_model_len {e.max_model_len} too short"}
    g = torch.Generator().manual_seed(seed)
    vocab = e.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    ids = [f"{PREFIX}{i}" for i in range(max_batch)]
    measured: dict[int, dict[int, float]] = {}
    try:
        for rid in ids:
            e.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
        sched = e.scheduler
        for _ in range(4 * max_batch * prompt_len // e.config.max_num_batched_tokens + 8):  # prefill them all
            if not sched.waiting and not any(r.is_prefilling for r in sched.running):
                break
            e.step()
        for b in batches:
            for rid in ids[b:]:
                e.abort_request(rid)
            ids = ids[:b]
            for arm in arms:
                ctl.forced_arm = arm
                times = []
                for i in range(warm + steps):
                    if len(sched.running) != b or any(r.is_prefilling for r in sched.running) or sched.waiting:
                        break
                    preempted = sched.num_preemptions
                    t0 = time.perf_counter()
                    e.step()
                    if sched.num_preemptions != preempted:  # out of KV: a step that recomputes is no measure
                        break
                    if i >= warm:
                        times.append(time.perf_counter() - t0)
                if len(times) == steps:
                    measured.setdefault(b, {})[arm] = median(times)
            if time.perf_counter() - t_start > max_seconds:
                break
    finally:
        ctl.forced_arm = None
        for rid in ids:
            e.abort_request(rid)
        e.blocks.reset_prefix_cache()
        vars(ctl).update(saved_ctl)
        e.stats = saved_stats
        drafter.path_counts.clear()  # (shared with the step modules: restored in place)
        drafter.path_counts.update(saved_paths)
        e.scheduler.num_preemptions = saved_preempt
        drafter.cycle.reset()
    for b, per_arm in measured.items():
        for arm, s in per_arm.items():
            ctl.seed(b, arm, s)
    out = {"seconds": round(time.perf_counter() - t_start, 2), "steps": steps, "warm": warm,
           "ms": {b: {a: round(s * 1e3, 3) for a, s in per_arm.items()} for b, per_arm in sorted(measured.items())}}
    log.info("adaptive calibration in %.1fs: ms per step by batch and depth %s", out["seconds"], out["ms"])
    return out
