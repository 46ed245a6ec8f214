"""Start-up calibration: scratch requests stepped through the engine at every (batch bucket, arm), the mean
of two windows' median step (two passes on fresh requests) seeding the bandit (time only); everything else the
steps touched is put back."""

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


def nondecreasing(xs: list[float]) -> list[float]:
    """The closest non-decreasing sequence in squared error (pooled adjacent violators): [3, 1, 2] -> [2, 2, 2]."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in xs:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def calibrate(drafter: EagleSpeculator, steps: int = 6, warm: int = 2, prompt_len: int = 128,
              max_seconds: float = 60.0, seed: int = 0) -> dict[str, Any]:
    """Time ``steps`` consecutive engine steps (after ``warm`` untimed ones) per (batch, depth) in two passes,
    each on fresh requests of ``prompt_len`` tokens, depths ascending then descending; the mean of the two
    windows' median steps, made non-decreasing in depth, seeds the bandit.
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
    # a pass's requests grow by at most this; every pass starts from the same context, so that a step's
    # attention over it weighs the same on every depth and batch size
    growth = len(arms) * (warm + steps) * (K + 1)
    prompt_len = min(prompt_len, e.max_model_len - growth - 1)
    if prompt_len < 1:
        return {"skipped": f"max_model_len {e.max_model_len} too short"}
    typical = len(arms) * (warm + steps) * (K + 2) // 2  # about what they grow (half the drafts kept)
    blocks = (prompt_len + typical) // e.config.block_size + 1  # a request's, at the end of a pass
    budget = e.blocks.num_free_blocks * 3 // 4
    max_batch = min(e.config.max_num_seqs, e.config.max_num_batched_tokens // (K + 1))
    while max_batch > 1 and max_batch * blocks > budget:
        max_batch //= 2
    if max_batch * blocks > budget:
        return {"skipped": f"{e.blocks.num_free_blocks} free KV blocks too few"}
    g = torch.Generator().manual_seed(seed)
    vocab = e.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=growth, ignore_eos=True)
    sched = e.scheduler
    ids: list[str] = []
    added = 0
    passes: dict[int, list[dict[int, float]]] = {}

    def start(n: int) -> list[str]:
        """``n`` fresh scratch requests, prefilled."""
        nonlocal added
        new = [f"{PREFIX}{added + i}" for i in range(n)]
        added += n
        for rid in new:
            e.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
        for _ in range(4 * n * prompt_len // e.config.max_num_batched_tokens + 8):
            if not sched.waiting and not any(r.is_prefilling for r in sched.running):
                break
            e.step()
        return new

    def window(b: int, arm: int) -> float | None:
        """The median seconds of ``steps`` consecutive steps of ``b`` requests drafting ``arm`` (None: cut short),
        timed as the cycle clock times them: the device's queue as the warm-up steps left it, no sync."""
        ctl.forced_arm = arm
        times: list[float] = []
        t0 = time.perf_counter()
        for j in range(warm + steps):
            if len(sched.running) != b or any(r.is_prefilling for r in sched.running) or sched.waiting:
                return None
            preempted = sched.num_preemptions
            e.step()
            if sched.num_preemptions != preempted:  # out of KV: a step that recomputes is no measure
                return None
            t1 = time.perf_counter()
            if j >= warm:
                times.append(t1 - t0)
            t0 = t1
        return median(times)  # a step stalled once (a kernel compiled, a collection) is no measure of the arm

    try:
        for b in bucket_batches(max_batch):
            for order in (arms, arms[::-1]):  # a depth's mean context is the same in both orders together
                for rid in ids:
                    e.abort_request(rid)
                ids = start(b)
                got = {}
                for arm in order:
                    s = window(b, arm)
                    if s is not None:
                        got[arm] = s
                passes.setdefault(b, []).append(got)
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
    measured: dict[int, dict[int, float]] = {}
    for b, got in passes.items():
        per_arm = {a: [p[a] for p in got if a in p] for a in arms}
        mean = {a: sum(v) / len(v) for a, v in per_arm.items() if v}
        depths = [a for a in arms if a in mean and a != ctl.tree_arm]  # a deeper chain does all a shallower one
        measured[b] = dict(zip(depths, nondecreasing([mean[a] for a in depths])))  # does, and more
        if ctl.tree_arm in mean:  # (a tree: at least plain decoding's)
            measured[b][ctl.tree_arm] = max(mean[ctl.tree_arm], measured[b].get(0, 0.0))
    for b, per_arm in measured.items():
        for arm, s in per_arm.items():
            ctl.seed(b, arm, s)
    out = {"seconds": round(time.perf_counter() - t_start, 2), "steps": steps, "warm": warm, "requests": added,
           "prompt_len": prompt_len,
           "ms": {b: {a: round(s * 1e3, 3) for a, s in per_arm.items()} for b, per_arm in sorted(measured.items())}}
    log.info("adaptive calibration in %.1fs: ms per step by batch and depth %s", out["seconds"], out["ms"])
    return out
