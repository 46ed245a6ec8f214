"""The adaptive policy's start-up cost profile: target step time vs. tokens, draft time vs. batch,
measured on scratch KV and cached per model, shapes, device and step limits."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
from typing import Any

import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.engine.gc_pauses import clock
from specserve.models import cpu_packing
from specserve.models.cpu_packing import packed_min_rows
from specserve.speculative.policy.cost_model import FORMAT_VERSION, CostModel, measure, profile_points

log = logging.getLogger(__name__)

CATCH_UP_PROFILE_ROWS = (16, 32, 64)  # head forwards profiled past max_num_seqs on the eager path (catch-ups)


def cost_profile_key(e: Any, head_config: Any, num_draft_tokens: int, graphs: bool) -> str:
    """What a cached profile is valid for: model, shapes, device, step limits, the head's shape (not its
    path), and what changes a step's kernels (graphs, K/V dtype, CPU weight packing and its row threshold)."""
    dev_name = torch.cuda.get_device_name(e.device) if e.device.type == "cuda" else "cpu"
    sc = getattr(e.config, "speculative", None)
    draft_dtype = sc.draft_dtype if sc is not None else "auto"
    kv_dtype = getattr(e.config, "kv_cache_dtype", "auto")
    packing = f"packed>={packed_min_rows(e.dtype)}" if e.packed_linears else "unpacked"
    if e.packed_linears and cpu_packing.ROW_BUCKETS:  # steps of many rows run padded
        packing += f",rows>{cpu_packing.EXACT_ROWS}/{cpu_packing.ROW_BUCKETS_PER_OCTAVE}"
    return (f"v{FORMAT_VERSION}|{e.model_name}|{e.model_config}|{dataclasses.replace(head_config, extra={})}|"
            f"{dev_name}|{e.dtype}|{torch.get_num_threads()}|{e.config.max_num_batched_tokens}|"
            f"{e.config.max_num_seqs}|{num_draft_tokens}|graphs={graphs}|{packing}"
            + ("" if draft_dtype == "auto" else f"|draft={draft_dtype}")
            + ("" if kv_dtype == "auto" else f"|kv={kv_dtype}")
            + ("" if getattr(e.config, "tensor_parallel_size", 1) == 1 else f"|tp={e.config.tensor_parallel_size}"))


def load_or_profile_costs(d: Any) -> tuple[CostModel, str]:
    """The cached profile of drafter ``d``'s engine, or one measured now (cached unless noisy)."""
    from specserve.loader.gguf import cache_root

    key = cost_profile_key(d.engine, d.head.config, d.cfg.resolved_num_draft_tokens, d.runner.graphs is not None)
    path = os.path.join(cache_root(), "profiles", hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    cost = None if d.cfg.recalibrate else CostModel.load(path)
    if cost is not None:
        cost.meta["source"] = f"cache {path}"
        log.info("cost model loaded from %s (profiled %s%s)", path, cost.meta.get("date"),
                 ", on a busy machine" if cost.meta.get("noisy") else "")
        return cost, path
    log.info("profiling step costs (%s; cached for later starts)...",
             "--speculative-recalibrate" if d.cfg.recalibrate else f"no profile cached at {path}")
    cost = profile_costs(d)
    if cost.meta["noisy"]:  # cached all the same: check_stale removes a profile that steps disprove
        log.warning("cost profile taken on a busy machine (online measurements refine it; "
                    "--speculative-recalibrate takes it again)")
    try:
        cost.save(path)
    except OSError as err:
        log.warning("could not cache the cost profile at %s: %s", path, err)
    cost.meta["source"] = "profiled at start-up" + (" (noisy)" if cost.meta["noisy"] else "")
    log.info("cost model profiled in %.1fs (re-checked %s): target ms %s, draft ms %s", cost.meta["seconds"],
             cost.meta["rechecked"], {k: round(v * 1e3, 2) for k, v in sorted(cost.target.profile.items())},
             {k: round(v * 1e3, 2) for k, v in sorted(cost.draft.profile.items())})
    return cost, path


@torch.inference_mode()
def profile_costs(d: Any) -> CostModel:
    """Decode-shaped steps on scratch KV: n requests x 1 token over the same ``ctx`` cached positions (slots
    alias), logits included; draft steps time the path greedy chains take (static runners where built)."""
    e, dev, hc = d.engine, d.device, d.head.config
    bs = e.config.block_size
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    most = e.config.max_num_seqs * d.cfg.resolved_num_draft_tokens
    # CPU: a step of more than ~128 tokens is far past where drafting pays
    max_tokens = min(e.config.max_num_batched_tokens, most if dev.type == "cuda" else min(most, 128))
    max_batch = min(e.config.max_num_seqs, max_tokens)
    window = e.scheduler.window  # (sliding-window layers' pool: the same scratch blocks there)
    nblk = max(1, min(8, e.blocks.num_blocks - 1, e.max_model_len // bs, window.pool.num_blocks if window else 8))
    ctx = nblk * bs
    table = torch.arange(nblk, device=dev)

    def q_lens(n: int, b: int | None = None) -> list[int]:
        b = min(n, e.config.max_num_seqs) if b is None else b
        return [n // b + (1 if i < n % b else 0) for i in range(b)]

    def meta(n: int, b: int | None = None) -> AttentionMetadata:
        q = q_lens(n, b)
        slots, tables = torch.full((n,), ctx - 1, device=dev), table[None, :].expand(len(q), -1).contiguous()
        return AttentionMetadata(query_lens=q, seq_lens=[ctx] * len(q), slot_mapping=slots, block_tables=tables,
                                 window_slot_mapping=slots if window else None,
                                 window_block_tables=tables if window else None)

    def inputs(n: int, b: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = [ctx - qi + j for qi in q_lens(n, b) for j in range(qi)]
        return torch.zeros(n, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev)

    def target(n: int, b: int | None = None) -> None:
        ids, pos = inputs(n, b)
        graphs = d.runner.graphs
        if graphs is not None and graphs.fits(n):
            out = graphs.replay(ids, pos, meta(n, b))
        else:
            d.runner.attn.plan(meta(n, b))
            with forward_context(d.runner.attn):
                out = d.target(ids, pos)
        d.target.compute_logits(out[0] if isinstance(out, tuple) else out)

    def draft(n: int) -> None:
        ids, pos = inputs(n)
        d.attn.plan(meta(n))
        feats = torch.zeros(n, hc.hidden_size, device=dev, dtype=e.dtype)
        with forward_context(d.attn):
            d.head.compute_logits(d.head(d.target.embed_tokens(ids), feats, pos))

    cu, chain = d.catch_up.runner, d.proposer.chain_runner
    K = d.cfg.resolved_num_draft_tokens - 1
    static = chain is not None and cu is not None and d.topk == 1 and K > 0 and ctx > K + 2
    if static:
        rows = list(range(nblk))
        feat = torch.zeros(2 * max_batch, hc.feature_size, device=dev, dtype=e.dtype)

        def draft_static(n: int) -> None:
            q = 2 if 2 * n <= cu.max_tokens else 1  # tokens a verify commits, about
            p = [ctx - K - 1 - q + j for _ in range(n) for j in range(1, q + 1)]
            cu.run([0] * (q * n), p, p, [q] * n, [ctx - K] * n, [rows] * n, feat[: q * n])
            chain.run([ctx - K] * n, [K] * n, [rows] * n)

    t0 = clock()
    mt = measure(profile_points(max_tokens), target, sync=sync, budget_s=60.0)
    # eager: catch-up-shaped row counts past the batch too (a catch-up's first estimate extrapolates this)
    points = profile_points(max_batch) + ([] if static else [n for n in CATCH_UP_PROFILE_ROWS if n > max_batch])
    md = measure(points, draft_static if static else draft, sync=sync, budget_s=20.0)
    if static:  # seconds per draft step
        md.seconds = {n: s / K for n, s in md.seconds.items()}
    # verify-shaped steps, b requests (a power of two) x t = 2..8 tokens
    pairs = [(b, b * t) for b in (1 << i for i in range(max_batch.bit_length())) if b in mt.seconds
             for t in range(2, min(d.cfg.resolved_num_draft_tokens, 8) + 1) if b * t <= max_tokens]
    mb = measure(list(range(len(pairs))), lambda i: target(pairs[i][1], pairs[i][0]), rounds=2, repeats=2,
                 sync=sync, budget_s=30.0)
    cost = CostModel()
    cost.target.profile = mt.seconds
    cost.draft.profile = md.seconds
    for i, (b, n) in enumerate(pairs):
        cost.batch_profiles.setdefault(b, {b: mt.seconds[b]})[n] = mb.seconds[i]
    cost.meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "seconds": round(clock() - t0, 1), "context": ctx,
                 "rounds": {"target": mt.rounds, "draft": md.rounds, "by_batch": mb.rounds},
                 "rechecked": {"target": mt.rechecked, "draft": md.rechecked},
                 "draft_path": "static (catch-up + chain loop, per step)" if static else "eager head forward",
                 "noisy": mt.noisy or md.noisy or mb.noisy,
                 "over_budget": mt.over_budget or md.over_budget or mb.over_budget,
                 "max_spread": {"target": round(max(mt.spread.values()), 3),
                                "draft": round(max(md.spread.values()), 3)}}
    return cost


def check_stale(cost: CostModel, steps: int, path: str | None) -> None:
    """Every 32 steps: a cached profile far from what steps measure is removed (the next start re-profiles)."""
    if steps % 32 or cost.meta.get("stale_reported") or not cost.stale:
        return
    cost.meta["stale_reported"] = True
    log.warning("cost profile off by x%.2f (median measured/profiled over %d steps); %s",
                cost.profile_ratio, len(cost.profile_ratios),
                f"removing {path} so the next start re-profiles" if path else "online estimates take over")
    if path and os.path.exists(path):
        try:
            os.remove(path)
        except OSError:
            pass
