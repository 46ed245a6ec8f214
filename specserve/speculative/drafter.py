"""EAGLE / EAGLE-3 speculation inside the engine's step.

Per step (engine.step): schedule -> ``verify_step`` (one target forward over every request's
query tokens: prefill chunks, plain decodes, and last token + drafts for those that drafted;
then verification) -> commit (scheduler appends tokens) -> ``draft_step`` (the controller picks k
per request for the next step; requests with k > 0 catch their draft KV up over the tokens
committed since they last drafted and draft k tokens). Where the next k is known before the verify's
outcome (the static policy, the adaptive policy's quick decisions) and every request verifies a
greedy chain, that catch-up and the next chain are launched before the verify's host sync, with the
accepted count picked on the device (``_launch_fused``), and draft_step only adopts their drafts.
On a GPU the verify after those drafts is then launched right after the sync, before the commit
(``_launch_early_verify``): the next step finds its forward queued and only checks that its plan
is the one launched. The static chain loop's drafts stay on the device until the next verify reads
them (``PENDING``).

The head's input at position i is (embedding of token i+1, target feature of token i); its
output there predicts token i+2. Target features of committed tokens are kept by KV slot
(``features``: one scatter per step) until the request drafts again, so a request with k = 0
costs no draft work at all; its catch-up reads them back by the slots of the positions it covers.

The draft KV cache has one layer per head layer and shares the target's block tables: the
draft KV of position i lives in the same slot as the target KV of position i.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.attention.torch_native import TorchNativeBackend
from specserve.engine import sampler
from specserve.engine.gc_pauses import clock
from specserve.engine.host_copy import host_to_device
from specserve.engine.kv_cache import KVSlots
from specserve.engine.request import Request, Status
from specserve.engine.runner import LaunchedStep, StepLists, allocate_kv_cache, kv_slab
from specserve.engine.scheduler import CommitResult, StepPlan
from specserve.models import cpu_packing
from specserve.models.cpu_packing import pack_for_cpu, packed_min_rows
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.speculative.policy.bandit import batch_key
from specserve.speculative.policy.controller import SpecController
from specserve.speculative.policy.cost_model import CostModel
from specserve.speculative.draft_graph import (FUSED_MAX_BATCH, CatchUpRunner, ChainDraftRunner, FusedLaunchRunner,
                                        TorchDecodeAttention)
from specserve.speculative.tree import (Candidate, DraftTree, TreeVerifyResult, select_tree, tree_is_final,
                                 verify_tree_greedy,
                                 verify_tree_sampled)
from specserve.speculative.tree_attention import TreeDraftBackend
from specserve.speculative.tree_graph import FusedTreeLaunch, TreeDraftRunner, TreeVerifyGraph, lane_blocks
from specserve.speculative.verify import verify_chains_sampled, verify_greedy

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

DEFAULT_HEAD = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-eagle3"


def default_draft_path() -> str:
    env = os.environ.get("SPECSERVE_DEFAULT_DRAFT")
    path = Path(env) if env else DEFAULT_HEAD
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no draft head given and the default head is missing at {path}; "
            "pass --speculative-draft-model-path"
        )
    return str(path)


def cost_profile_key(e: Any, head_config: Any, num_draft_tokens: int, graphs: bool) -> str:
    """What a cached cost profile is valid for: the engine's model, shapes, device and step limits,
    the head's shape (not its path: a retrained head of the same shape costs the same), and what
    changes a step's kernels (CUDA graphs, the K/V cache's dtype; on the CPU the weight packing and the row count from which
    the packed kernel runs, measured per process: a profile cached under another threshold put
    2-3-token verifies at 1.5-2x a decode step where they cost less than one)."""
    import dataclasses

    from specserve.speculative.policy.cost_model import FORMAT_VERSION

    dev_name = torch.cuda.get_device_name(e.device) if e.device.type == "cuda" else "cpu"
    sc = getattr(e.config, "speculative", None)
    draft_dtype = sc.draft_dtype if sc is not None else "auto"  # (the head's own dtype, where it has one)
    head_shape = dataclasses.replace(head_config, extra={})
    packing = f"packed>={packed_min_rows(e.dtype)}" if e.packed_linears else "unpacked"
    if e.packed_linears and cpu_packing.ROW_BUCKETS:  # steps of many rows run padded
        packing += f",rows>{cpu_packing.EXACT_ROWS}/{cpu_packing.ROW_BUCKETS_PER_OCTAVE}"
    return (f"v{FORMAT_VERSION}|{e.model_name}|{e.model_config}|{head_shape}|{dev_name}|{e.dtype}|"
            f"{torch.get_num_threads()}|{e.config.max_num_batched_tokens}|{e.config.max_num_seqs}|"
            f"{num_draft_tokens}|graphs={graphs}|{packing}"
            + ("" if draft_dtype == "auto" else f"|draft={draft_dtype}")
            # an 8-bit K/V cache halves what attention reads: other verify costs
            + ("" if getattr(e.config, "kv_cache_dtype", "auto") == "auto" else f"|kv={e.config.kv_cache_dtype}"))


@dataclass
class DraftState:
    """Per-request drafting state."""

    draft_pos: int  # first position whose draft KV is not computed (its target feature is in ``features``)
    draft_probs: torch.Tensor | None = None  # [k, V] q of the current drafts (sampled requests only)
    # (drafts [B, K], row) when the static chain loop left this request's drafts on the device: its
    # draft_token_ids then hold PENDING until the verify that reads them (see EagleSpeculator._fill_drafts)
    device_drafts: tuple[torch.Tensor, int] | None = None
    # (packed trees [B, tree_width], row) when the tree expansion selected this request's tree on the
    # device (spec.tree.select_trees): its draft_tree is then a placeholder until the verify's sync
    device_tree: tuple[torch.Tensor, int] | None = None


# a draft token whose value is still on the device (draft_token_ids keep the count on the host)
PENDING = -1


@dataclass
class EarlyVerify:
    """A verify launched before the step that runs it was scheduled (_launch_early_verify)."""

    plan: list[tuple[str, int, int, int]]  # per request: id, first position, first token, drafts
    blocks: list[list[int]]  # per request: the blocks its KV went to
    reqs: list[Request]
    inputs: Any  # StepInputs
    out: Any  # the forward's output (hidden, features)
    logits: torch.Tensor
    argmax: torch.Tensor
    draft_rows: torch.Tensor  # input rows holding drafts, in request order
    toks: torch.Tensor  # the drafts it read (the fused launch's: chains [B, K], or packed trees)
    tree_extra: torch.Tensor | None = None  # trees: their parents and depths, read back with the picks


@dataclass
class PlainAhead:
    """A plain step scheduled and launched before the last step's tokens were read back (overlap
    scheduling, _launch_plain_ahead): its features kept and its sampling queued already."""

    plan: StepPlan
    inputs: Any  # StepInputs
    launched: LaunchedStep


# finished requests' catch-up (Drafter._catch_up_finished): memory per step of the tokens it weighs,
# and the tokens at which a prefill's and a catch-up's costs per token are compared
FINISH_DECAY = 0.99
COST_PROBE_TOKENS = 256
CATCH_UP_PROFILE_ROWS = (16, 32, 64)  # head forwards profiled past max_num_seqs on the eager path (catch-ups)
CATCH_UP_TIMING_EVERY = 8  # steady catch-ups per one timed with device events (the adaptive policy on a GPU)


def catch_up_end(r: Request) -> int:
    """Where a catch-up of ``r`` stops: its last committed position, whose next token is known. All
    its computed positions, but for a request that stopped inside the drafts it accepted (its KV ran
    ahead of its last token: _catch_up_finished)."""
    return min(r.num_computed_tokens, r.num_tokens - 1)


def first_without_draft_kv(r: Request) -> int:
    """Where a request new to drafting starts: past what it has computed, or at the first cached prompt
    block it took that lacks draft KV (the head catches up from there)."""
    if r.draft_kv_tokens is None:
        return r.num_computed_tokens
    return min(r.draft_kv_tokens, r.num_computed_tokens)


def steady_share(caught_up: int, prompt_rows: int) -> float:
    """The part of a catch-up over ``caught_up`` rows that replays tokens the last verify committed
    (the rest, ``prompt_rows``, is the head's pass over prompts of requests new to drafting), by rows."""
    if caught_up <= 0:
        return 1.0
    return max(caught_up - prompt_rows, 0) / caught_up


class EagleSpeculator:
    def __init__(self, engine: "LLMEngine") -> None:
        cfg = engine.config.speculative
        assert cfg is not None
        self.cfg = cfg
        self.engine = engine
        self.runner = engine.runner
        self.target = engine.runner.model
        self.device = engine.device
        path = cfg.draft_model_path or default_draft_path()
        self.head_dtype = engine.dtype if cfg.draft_dtype == "auto" else getattr(torch, cfg.draft_dtype)
        self.head = Eagle3DraftModel.from_pretrained(path, device=self.device, dtype=self.head_dtype).eval()
        self.head.fuse_projections()
        # rotary + KV write as one kernel (positions < max_model_len + depth); SPECSERVE_DRAFT_ROPE_KERNEL=0:
        # the torch ops (the benchmarks' A/B)
        if self.device.type == "cuda" and os.environ.get("SPECSERVE_DRAFT_ROPE_KERNEL", "1") != "0":
            self.head.build_rope_tables(engine.max_model_len + cfg.num_steps + 2)
        pack_for_cpu(self.head, engine.config.cpu_weight_packing, self.device, self.head_dtype)
        hc = self.head.config
        want = "EAGLE3" if cfg.algorithm == "EAGLE3" else "EAGLE"
        if hc.algorithm != want:
            raise ValueError(f"--speculative-algorithm {cfg.algorithm} but the head at {path} is {hc.algorithm}")
        mc = engine.model_config
        if hc.vocab_size != mc.vocab_size:
            raise ValueError(f"draft head vocab {hc.vocab_size} != target vocab {mc.vocab_size}")
        if self.head.is_eagle3:
            self.target.set_aux_hidden_layers(hc.resolved_aux_layer_ids(mc.num_hidden_layers))
        else:
            self.head.bind_target(self.target.compute_logits)
        # one block beyond the block manager's: draft steps past a request's k (and padding rows) write
        # there; then, for trees, each frontier slot's lane (tree_graph.TreeDraftRunner)
        self.topk = cfg.eagle_topk
        lanes = engine.config.max_num_seqs * self.topk * lane_blocks(engine.config.block_size, cfg.num_steps) \
            if self.topk > 1 else 0
        caches = allocate_kv_cache(self.head.num_kv_layers, engine.blocks.num_blocks + 1 + lanes,
                                   engine.config.block_size, hc.num_key_value_heads, hc.head_dim,
                                   self.head_dtype, self.device)
        self.scratch_slot = engine.blocks.num_blocks * engine.config.block_size
        # the target features (aux layers' hidden states) of every computed token, by KV slot like
        # the KV itself: a step writes its committed rows with one scatter, and a catch-up reads back
        # the rows of the positions it covers with one gather. Kept per request as references to
        # each step's output, a catch-up after a stretch of plain decoding walked one entry per
        # request per step in Python: ~2.6 us a token on the H200's host, 50 ms at 256 requests
        self.features = torch.zeros(self.scratch_slot + engine.config.block_size, hc.feature_size,
                                    dtype=engine.dtype, device=self.device)
        # EAGLE-3: the target's forward writes them itself (every row at its slot), so a plain step keeps
        # them without a scatter of its own (a verify still keeps what it commits, trees moved up)
        self.features_in_forward = self.head.is_eagle3 and hasattr(self.target, "set_feature_sink")
        if self.features_in_forward:
            self.target.set_feature_sink(self.features)
        self._sink_checked: set[tuple[bool, int]] = set()  # (verify, tokens' bit length): shapes checked
        self.attn = TorchNativeBackend(caches, engine.config.block_size, hc.head_dim**-0.5)
        self.tree_attn = TreeDraftBackend(caches, engine.config.block_size, hc.head_dim**-0.5)
        engine.blocks.require_draft_kv = True
        engine.scheduler.reuse_without_draft_kv = self._reuse_without_draft_kv
        engine.scheduler.catch_up_cached_prefix = self._catch_up_cached_prefix
        self.states: dict[str, DraftState] = {}
        # its bookkeeping waits for the next target forward's launch (verify_step flushes it there)
        self.controller = SpecController(cfg, defer=True)
        # requests that finished this step without draft KV over all they committed, with their
        # blocks (freed, still cached): see _catch_up_finished
        self._finished: list[tuple[Request, KVSlots]] = []
        self._reuse_lost = 0.0  # decayed per step: prompt tokens recomputed, their cached blocks lacking draft KV
        self._finish_pending = 0.0  # decayed per step: tokens requests finished with and no draft KV over
        self._refused_seen = 0
        self.finish_catch_ups = 0  # requests given draft KV as they finished, and over how many tokens
        self.finish_catch_up_tokens = 0
        if cfg.policy == "adaptive":
            engine.scheduler.on_finish = self._on_finish
        self._cycle_head: float | None = None  # seconds from the last decision to the end of its draft_step
        self._head_ended = 0.0  # clock() when _cycle_head was taken (the rest of that step follows it)
        self._drafted_last = False  # whether the last decision drafted for anyone
        # drafts launched before the last verify's sync (_launch_fused): request -> (row, k), the rows
        self._fused: dict[str, tuple[int, int]] | None = None
        self._fused_toks: torch.Tensor | None = None
        self._pre_arm: tuple[int, int] | None = None  # (batch, depth) of a quick decision taken early
        self._pre_ks: tuple[list[str], list[int], Any] | None = None  # (requests, ks, cycle): a full one
        self._early: EarlyVerify | None = None  # the next step's verify, launched already
        self._ahead: PlainAhead | None = None  # the next step, plain, launched already (overlap scheduling)
        # ... launched before this step's sync (trees): its requests (with drafts verified now and next),
        # their block tables at the launch, and the verify (its plan and blocks filled after the sync)
        self._presync: tuple[list[tuple[Request, int, int]], list[list[int]], EarlyVerify] | None = None
        self.controller.early_verify = self.device.type == "cuda"
        self._readback: torch.Tensor | None = None  # pinned: the verify's picks, read after the fused launch
        self._readback_done: torch.cuda.Event | None = None
        # the adaptive controller times catch-ups to their end on the GPU (device events): every
        # switch's, and one steady catch-up in CATCH_UP_TIMING_EVERY (timing one costs ~0.08 ms of
        # host time, 3 % of a step at one request); the others take the timed ones' mean for their rows
        self._time_catch_up = cfg.policy == "adaptive" and self.device.type == "cuda"
        self._catch_up_marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._steady_s: dict[int, float] = {}  # seconds of a steady catch-up (to its end) by rows (bucketed), averaged
        self._steady_count = 0
        self.catch_ups_timed = 0  # catch-ups timed with device events
        self._head_path = path
        self.calibration: dict[str, Any] | None = None  # what the start-up calibration measured (calibrate.py)
        if cfg.policy == "adaptive" and self.runner.graphs is None:
            self.controller.cost = self._load_or_profile_costs(path)  # else after_capture()
        # most tokens one request verifies: the chain's steps or the tree's nodes
        self.max_k = cfg.resolved_num_draft_tokens - 1
        log.info("speculation: %s head from %s (draft vocab %d), policy %s, up to %d tokens",
                 hc.algorithm, path, hc.draft_vocab_size, cfg.policy, self.max_k)
        self._setup_static_draft()

    def _reuse_without_draft_kv(self, req: Request) -> bool:
        """Whether a waiting request may take cached prompt blocks whose draft KV was never
        computed (it then never drafts): when it would not draft anyway, by its own cap or because
        speculation is off (controller.speculation_off). Otherwise a stretch of plain decoding would cost
        the prefix cache: the blocks it fills never get draft KV, and no prompt could reuse them."""
        return req.params.max_spec_tokens == 0 or self.controller.speculation_off(len(self.engine.scheduler.running) + 1)

    def _catch_up_cached_prefix(self) -> bool:
        """Whether a waiting request takes cached prompt blocks that lack draft KV, its drafting state
        starting at the first of them (``first_without_draft_kv``): the head's catch-up computes their
        draft KV from the target features every step keeps at its KV slots (a cached block's slots are
        not written again until it is evicted), a head pass where refusing them recomputed the prompt
        through the target (controller flag ``catch_up_cached_prefix``)."""
        return self.controller.catch_up_cached_prefix

    # -- start-up cost profile ------------------------------------------------------------------
    def after_capture(self) -> None:
        """Where target steps replay CUDA graphs, the profile measures them once they are captured
        (eager forwards on a GPU cost several times a replay, and not in the same shape); then the
        calibration times whole steps per batch and depth (spec/calibrate.py)."""
        if self.cfg.policy != "adaptive":
            return
        if self.runner.graphs is not None:
            self.controller.cost = self._load_or_profile_costs(self._head_path)
        on = self.cfg.calibrate if self.cfg.calibrate is not None else self.runner.graphs is not None
        if on:
            from specserve.speculative.policy.calibrate import calibrate

            self.calibration = calibrate(self)

    def _load_or_profile_costs(self, head_path: str) -> CostModel:
        """Target step time vs. tokens and draft time vs. batch, measured here; cached per model+device.

        SPECSERVE_COST_PROFILE=refresh re-measures even when a cached profile exists.
        """
        import hashlib

        from specserve.loader.gguf import cache_root

        key = cost_profile_key(self.engine, self.head.config, self.cfg.resolved_num_draft_tokens,
                               self.runner.graphs is not None)
        path = os.path.join(cache_root(), "profiles", hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
        self.cost_profile_path = path
        refresh = os.environ.get("SPECSERVE_COST_PROFILE", "") == "refresh"
        cost = None if refresh else CostModel.load(path)
        if cost is not None:
            cost.meta["source"] = f"cache {path}"
            log.info("cost model loaded from %s (profiled %s)", path, cost.meta.get("date"))
            return cost
        cost = self._profile_costs()
        if cost.meta["noisy"]:
            log.warning("cost profile taken on a busy machine (not cached; online measurements refine it)")
        else:
            try:
                cost.save(path)
            except OSError as err:
                log.warning("could not cache the cost profile at %s: %s", path, err)
        cost.meta["source"] = "profiled at start-up" + (" (noisy, not cached)" if cost.meta["noisy"] else "")
        log.info("cost model profiled in %.1fs (re-checked %s): target ms %s, draft ms %s", cost.meta["seconds"],
                 cost.meta["rechecked"], {k: round(v * 1e3, 2) for k, v in sorted(cost.target.profile.items())},
                 {k: round(v * 1e3, 2) for k, v in sorted(cost.draft.profile.items())})
        return cost

    @torch.inference_mode()
    def _profile_costs(self) -> CostModel:
        """Decode-shaped steps on scratch KV (the engine is idle at start-up): n requests x 1 token,
        each over the same ``ctx`` cached positions (slots may alias: values do not matter, only time);
        the target step includes the logits of every row, as a verify step computes them."""
        import datetime

        from specserve.speculative.policy.cost_model import measure, profile_points

        e = self.engine
        bs = e.config.block_size
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        # CPU: a step of more than ~128 tokens is far past where drafting pays (32 requests x 4 tokens)
        most = e.config.max_num_seqs * self.cfg.resolved_num_draft_tokens
        max_tokens = min(e.config.max_num_batched_tokens, most if self.device.type == "cuda" else min(most, 128))
        max_batch = min(e.config.max_num_seqs, max_tokens)
        nblk = max(1, min(8, e.blocks.num_blocks - 1, self.engine.max_model_len // bs))
        ctx = nblk * bs
        hc = self.head.config
        table = torch.arange(nblk, device=self.device)

        def q_lens(n: int, b: int | None = None) -> list[int]:
            # more tokens than requests the backends are sized for: several tokens per request
            b = min(n, e.config.max_num_seqs) if b is None else b
            return [n // b + (1 if i < n % b else 0) for i in range(b)]

        def meta(n: int, b: int | None = None) -> AttentionMetadata:
            q = q_lens(n, b)
            return AttentionMetadata(query_lens=q, seq_lens=[ctx] * len(q),
                                     slot_mapping=torch.full((n,), ctx - 1, device=self.device),
                                     block_tables=table[None, :].expand(len(q), -1).contiguous())

        def inputs(n: int, b: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            pos = [ctx - qi + j for qi in q_lens(n, b) for j in range(qi)]
            return (torch.zeros(n, dtype=torch.long, device=self.device),
                    torch.tensor(pos, dtype=torch.long, device=self.device))

        def target(n: int, b: int | None = None) -> None:
            ids, pos = inputs(n, b)
            graphs = self.runner.graphs
            if graphs is not None and graphs.fits(n):
                out = graphs.replay(ids, pos, meta(n, b))
            else:
                self.runner.attn.plan(meta(n, b))
                with forward_context(self.runner.attn):
                    out = self.target(ids, pos)
            hidden = out[0] if isinstance(out, tuple) else out
            self.target.compute_logits(hidden)

        def draft(n: int) -> None:
            ids, pos = inputs(n)
            self.attn.plan(meta(n))
            emb = self.target.embed_tokens(ids)
            feats = torch.zeros(n, hc.hidden_size, device=self.device, dtype=e.dtype)
            with forward_context(self.attn):
                self.head.compute_logits(self.head(emb, feats, pos))

        # where greedy chains draft through the static runners (CUDA graphs on the GPU), time that
        # path as a step measures it (drafter.draft_step: catch-up + loop, per draft step): one
        # eager head forward on the GPU costs several times a graphed draft step, and a profile of
        # it made every drafting depth look worse than plain decoding before any was measured
        # (the CPU profiles before the static runners exist: its greedy chains draft eagerly)
        cu, chain = getattr(self, "catch_up_runner", None), getattr(self, "chain_runner", None)
        K = self.cfg.resolved_num_draft_tokens - 1
        static = chain is not None and cu is not None and self.topk == 1 and K > 0 and ctx > K + 2
        if static:
            rows = list(range(nblk))
            feat = torch.zeros(2 * max_batch, hc.feature_size, device=self.device, dtype=e.dtype)

            def draft_static(n: int) -> None:
                q = 2 if 2 * n <= cu.max_tokens else 1  # tokens a verify commits, about
                p = [ctx - K - 1 - q + j for _ in range(n) for j in range(1, q + 1)]
                cu.run([0] * (q * n), p, p, [q] * n, [ctx - K] * n, [rows] * n, feat[: q * n])
                chain.run([ctx - K] * n, [K] * n, [rows] * n)

        t0 = clock()
        mt = measure(profile_points(max_tokens), target, sync=sync, budget_s=60.0)
        # eager: a few row counts past the batch too, catch-up-shaped (several rows a request): the first
        # estimate of a catch-up (controller.catch_up_seconds) extrapolates this curve, and from one point
        # (max_num_seqs 1) it did so in proportion, ~20x what a catch-up over 125 rows took: no exploration
        # out of plain decoding ever fitted the budget
        points = profile_points(max_batch) + ([] if static else [n for n in CATCH_UP_PROFILE_ROWS if n > max_batch])
        md = measure(points, draft_static if static else draft, sync=sync, budget_s=20.0)
        if static:  # seconds per draft step
            md.seconds = {n: s / K for n, s in md.seconds.items()}
        # verify-shaped steps, b requests (a power of two) x t = 2..8 tokens: they do not cost what b*t
        # single-token requests cost (t = 1 is the profile above; trees verify more than 8, not profiled)
        pairs = [(b, b * t) for b in (1 << i for i in range(max_batch.bit_length())) if b in mt.seconds
                 for t in range(2, min(self.cfg.resolved_num_draft_tokens, 8) + 1) if b * t <= max_tokens]
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

    # -- static-buffer draft path (CUDA graphs) --------------------------------------------------
    def _setup_static_draft(self) -> None:
        """On CUDA with the Triton backend: the catch-up and the greedy chain loop on static buffers,
        captured as CUDA graphs now (unless --enforce-eager). On the CPU the eager loop stays the
        default; ``enable_static_draft()`` turns the static loop on (tests compare the two)."""
        self.chain_runner: ChainDraftRunner | None = None
        self.tree_runner: TreeDraftRunner | None = None
        self.catch_up_runner: CatchUpRunner | None = None
        self.fused_launch: FusedLaunchRunner | None = None
        self.tree_launch: FusedTreeLaunch | None = None
        self.tree_verify: TreeVerifyGraph | None = None
        # draft-side calls per path ("catch_up:graph", "chain:eager", ...): benchmarks check for fallbacks
        self.path_counts: Counter[str] = Counter()
        e = self.engine
        self.runner.ensure_graph_tokens(e.config.max_num_seqs * (self.max_k + 1), trees=self.topk > 1)
        if self.device.type == "cuda" and self.runner.backend_name == "triton":
            self.enable_static_draft(graphs=not e.config.enforce_eager)

    def enable_static_draft(self, graphs: bool = False, attention: str = "auto", fused_launch: bool | None = None) -> None:
        """attention: "triton" (Triton decode attention for the loop, a Triton backend for the
        catch-up; on the CPU only under TRITON_INTERPRET=1, as tests do), "torch", or "auto"
        (triton on CUDA with the triton backend, else torch). fused_launch: the fused launch of small
        steps as one graph (chains: FusedLaunchRunner, triton only; trees: FusedTreeLaunch; their
        bodies eagerly without graphs). Default: with graphs (one request on the H200: 1.79x no-spec
        with it, 1.54x without, session 29)."""
        e = self.engine
        self.catch_up_runner = None  # (re)built below over the new loop's h0
        self.fused_launch = None
        self.tree_launch = self.tree_verify = None
        bs, hc, dev = e.config.block_size, self.head.config, self.device
        max_batch = e.config.max_num_seqs
        max_blocks = -(-e.max_model_len // bs)
        caches = self.attn.kv_caches
        scale = hc.head_dim**-0.5
        if attention == "auto":
            attention = "triton" if dev.type == "cuda" and self.runner.backend_name == "triton" else "torch"
        triton = attention == "triton"
        if graphs and not (triton and dev.type == "cuda"):
            raise ValueError("CUDA graphs of the draft loop need a CUDA device and the triton attention backend")
        if triton:
            from specserve.attention.triton_backend import TritonBackend
            from specserve.engine.cuda_graph import capture_sizes
        dec = self._decode_attention(max_batch, triton)
        tables = dec.block_tables
        self.chain_runner = ChainDraftRunner(self.head, self.target.embed_tokens, dec, tables, bs, self.scratch_slot,
                                             max_batch, self.max_k, dev, self.head_dtype)
        # trees expand over the same h0 and tables, each frontier slot a query of a decode attention
        self.tree_runner = None
        if self.topk > 1:
            self.tree_runner = TreeDraftRunner(self.head, self.target.embed_tokens,
                                               self._decode_attention(max_batch * self.topk, triton), tables, bs,
                                               self.scratch_slot // bs + 1, self.chain_runner.h0, max_batch,
                                               self.topk, self.cfg.num_steps, dev, num_nodes=self.max_k + 1)
        if fused_launch is None:
            fused_launch = graphs
        if fused_launch and self.tree_runner is not None:
            self.tree_launch = self._tree_launch(triton)
            # the verify launched before the sync reads the launch's trees and leaves it the picks
            self.tree_verify = TreeVerifyGraph(self.tree_launch, self.target, self.runner.attn,
                                               self.target.config.vocab_size)
        if triton:
            cu_attn = TritonBackend(caches, bs, scale, num_heads=hc.num_attention_heads,
                                    max_num_tokens=e.config.max_num_batched_tokens, max_num_seqs=max_batch,
                                    max_blocks_per_seq=max_blocks, scratch_slot=self.scratch_slot)
            # after a verify a request catches up over its accepted drafts + 1; after a stretch of
            # plain decoding over every step of it, in chunks of up to a step's budget: both replay
            cu_sizes = capture_sizes(max(e.config.graph_token_limit, min(e.config.max_num_batched_tokens,
                                                                          max_batch * (self.max_k + 1)))) \
                if graphs or fused_launch else []
            self.catch_up_runner = CatchUpRunner(self.head, self.target.embed_tokens, cu_attn, self.chain_runner.h0,
                                                 cu_sizes, dev, e.dtype)
            if fused_launch and self.topk == 1:
                self.fused_launch = FusedLaunchRunner(self.catch_up_runner, self.chain_runner, dev)
        if graphs:
            pool = torch.cuda.graph_pool_handle()
            assert self.catch_up_runner is not None
            a = self.catch_up_runner.capture(pool)
            if self.tree_runner is None:
                b = self.chain_runner.capture(pool)
                what = f"chain loop {b.graphs} (batch {','.join(map(str, self.chain_runner.batch_sizes))} x k 1..{self.max_k})"
            else:
                b = self.tree_runner.capture(pool)
                what = (f"tree expansion {b.graphs} (batch {','.join(map(str, self.tree_runner.batch_sizes))}, "
                        f"top-{self.topk} x {self.cfg.num_steps} depths)")
            log.info("draft CUDA graphs: catch-up %d (token counts %s) and %s in %.2fs using %.1f MiB of GPU memory",
                     a.graphs, ",".join(map(str, self.catch_up_runner.sizes)), what, a.seconds + b.seconds,
                     (a.bytes + b.bytes) / 2**20)
            fl = self.fused_launch or self.tree_launch
            if fl is not None:
                c = fl.capture(pool)
                log.info("fused launch CUDA graphs: %d (batch <= %d) in %.2fs using %.1f MiB of GPU memory",
                         c.graphs, fl.batch_sizes[-1], c.seconds, c.bytes / 2**20)
            if self.tree_verify is not None:
                v = self.tree_verify.capture(pool)
                log.info("tree verify CUDA graphs: %d in %.2fs using %.1f MiB of GPU memory",
                         v.graphs, v.seconds, v.bytes / 2**20)

    def _tree_launch(self, triton: bool) -> FusedTreeLaunch:
        """The tree's fused launch over the expansion's buffers, its catch-up attending row by row."""
        tr = self.tree_runner
        assert tr is not None
        Bm = min(FUSED_MAX_BATCH, tr.batch_sizes[-1])
        attn = self._decode_attention(Bm * (min(tr.depth, tr.num_nodes - 1) + 1), triton)
        return FusedTreeLaunch(tr, attn, self.scratch_slot, self.head.config.feature_size, self.engine.dtype, Bm,
                               target_kv=kv_slab(self.runner.kv_caches), features=self.features)

    def _decode_attention(self, rows: int, triton: bool) -> Any:
        """A decode attention over the draft KV (one query per row), reading its own block tables
        ``block_tables`` [rows, max blocks] that its caller fills: Triton's, or plain PyTorch's."""
        hc, bs = self.head.config, self.engine.config.block_size
        tables = torch.zeros(rows, -(-self.engine.max_model_len // bs), dtype=torch.long, device=self.device)
        caches, scale = self.attn.kv_caches, hc.head_dim**-0.5
        if triton:
            from specserve.attention.triton_backend import TritonDecodeAttention

            return TritonDecodeAttention(caches, bs, scale, num_heads=hc.num_attention_heads, block_tables=tables)
        return TorchDecodeAttention(caches, bs, scale, tables)

    @property
    def graph_memory_bytes(self) -> int:
        """GPU memory the draft CUDA graphs took at capture."""
        n = self.catch_up_runner.stats.bytes if self.catch_up_runner else 0
        n += self.tree_runner.stats.bytes if self.tree_runner else 0
        n += self.fused_launch.stats.bytes if self.fused_launch else 0
        n += self.tree_launch.stats.bytes if self.tree_launch else 0
        n += self.tree_verify.stats.bytes if self.tree_verify else 0
        return n + (self.chain_runner.stats.bytes if self.chain_runner else 0)

    # -- lifecycle ------------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        self.states.pop(req.request_id, None)

    def _on_finish(self, req: Request) -> None:
        st = self.states.get(req.request_id)
        if st is not None and req.num_computed_tokens > st.draft_pos and not req.no_draft_kv:
            self._finished.append((req, KVSlots(list(req.kv.block_table))))

    def _catch_up_finished(self) -> None:
        """Draft KV for what the requests that finished this step committed while plain decoding,
        when that is measured to pay. Blocks filled while speculation is off have no draft KV, so a
        drafting request cannot reuse them from the prefix cache and recomputes the prompt (a no-spec
        engine would not). Requests admitted while plain decoding is the pick may take such blocks
        (controller.speculation_off); this is for the blocks a drafting request meets later.
        Catching up a finishing request costs a head pass over its tokens; it pays where the prompt
        tokens refused for lack of draft KV, at the target's cost per token, outweigh the tokens
        finishing requests leave without it, at the catch-up's. Nothing is spent where prompts share
        nothing (off stays off); once every finishing request is caught up the refusals stop and so
        does the spending, so the two settle where they balance. (On the H200 at 256 requests with
        prompts that repeat, held at plain decoding without admitting onto such blocks, it took back
        two thirds of the refused hits but cost about what it saved there:
        gpu_step_breakdown_session15_finish.json.) Runs before any block is handed out again this step."""
        done, self._finished = self._finished, []
        bm = self.engine.blocks
        refused, self._refused_seen = bm.stats.prefix_refused - self._refused_seen, bm.stats.prefix_refused
        pending = sum(r.num_computed_tokens - self.states[r.request_id].draft_pos for r, _ in done)
        self._reuse_lost = self._reuse_lost * FINISH_DECAY + refused
        self._finish_pending = self._finish_pending * FINISH_DECAY + pending
        if not done or self._reuse_lost <= 0:
            return
        ctl = self.controller
        prefill_s = ctl.cost.step_time(COST_PROBE_TOKENS) if ctl.cost.target.profile else 0.0
        catch_up_s = ctl.catch_up_seconds(COST_PROBE_TOKENS)
        if prefill_s <= 0 or catch_up_s <= 0 or self._reuse_lost * prefill_s <= self._finish_pending * catch_up_s:
            return
        # (one that stopped on its first token past the draft KV has nothing to catch up)
        done = [(r, kv) for r, kv in done if catch_up_end(r) > self.states[r.request_id].draft_pos]
        if not done:
            return
        reqs = [r for r, _ in done]
        for r, kv in done:
            r.kv = kv  # the freed blocks, for the catch-up's slots
        try:
            self._catch_up(reqs)
        finally:
            for r in reqs:
                r.kv = KVSlots()
        self.finish_catch_ups += len(reqs)
        self.finish_catch_up_tokens += pending

    def _state(self, req: Request) -> DraftState:
        st = self.states.get(req.request_id)
        if st is None:
            st = self.states[req.request_id] = DraftState(draft_pos=first_without_draft_kv(req))
        return st

    # -- target forward + verification ---------------------------------------------------------
    def take_ahead(self) -> StepPlan | None:
        """The plain step launched ahead (_launch_plain_ahead) for the engine to run next, or None (then
        it schedules one); dropped where every request in it ended or was aborted since."""
        a = self._ahead
        if a is not None and a.plan.all_finished:
            self._ahead = a = None
            self.path_counts["plain_ahead:dropped"] += 1
        return None if a is None else a.plan

    @torch.inference_mode()
    def verify_step(self, plan: StepPlan) -> CommitResult:
        t0 = clock()
        self._fused = self._pre_arm = self._pre_ks = None  # (what the last step decided early is spent)
        early, self._early = self._early, None
        if early is not None:
            for r in early.reqs:
                r.kv_hold_tokens = 0  # (the plan reserved what it verifies)
            if self._early_matches(early, plan):
                self.path_counts["early_verify"] += 1
            else:
                self.path_counts["early_verify:discarded"] += 1
                early = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.plan is not plan:
            raise RuntimeError("the engine ran another step than the one launched ahead")
        drafted = plan.num_drafts > 0
        tree_extra = None
        out = None
        if early is not None:  # this step's forward was launched with the last step's sync
            inputs, out = early.inputs, early.out
            pending, pending_rows, tree_extra = list(plan.scheduled), early.draft_rows, early.tree_extra
        elif ahead is not None:  # ... or before it (plain decoding), with its features kept and sampling
            inputs = ahead.inputs
        else:
            inputs = self.runner.prepare(plan)
            pending, pending_rows, tree_extra = self._fill_drafts(plan, inputs) if drafted else ([], None, None)
            # a plain step reads its outputs at once (features kept, then sampled): no copies
            out = self.runner.forward(inputs, copy=drafted)
        # launched: on a GPU the last cycle's bookkeeping runs while the device computes (a CPU forward
        # has returned by now, and it costs what it would have anyway)
        self.controller.flush()
        hidden, feats = out if isinstance(out, tuple) else (out, out)
        if not drafted:
            # nobody drafted (speculation off, prefill): the target features of every computed token
            # are kept for the head's catch-up, before the sampler's host sync (on a GPU this runs
            # while the device computes), then the plain-decode sampler.
            # Every row (one per computed token: no drafts) is kept as it is, queued before any other
            # replay can overwrite the graph's outputs
            T = inputs.input_ids.shape[0]
            launched = self._launch_plain(plan, inputs, out) if ahead is None else ahead.launched
            went_ahead = self._launch_plain_ahead(plan, launched)
            result = launched.result()
            n_sampling = len(result.token_ids)  # one per request that samples
            # (a step launched ahead, or one that launched the next before its sync, is not timed alone)
            own_time = ahead is None and not went_ahead
            if self.controller.cycle_open:  # a drafting decision's requests, none of which drafted
                sampling = [s for s in plan.scheduled if s.samples]
                self._record(plan, sampling, [0] * n_sampling, clock() - t0, own_time)
            else:  # nothing per request to record: only the step's time
                self.controller.observe_step(T, len(plan.scheduled), clock() - t0, T - n_sampling, n_sampling,
                                             own_time)
                self._check_stale()
            return result

        sampling = [s for s in plan.scheduled if s.samples]
        logits = None
        if early is not None:  # (chains only: every row samples)
            logits = early.logits
        elif sampling:
            rows = host_to_device([i for a, n in inputs.sample_spans for i in range(a, a + n)], self.device)
            logits = self.target.compute_logits(hidden[rows])
        # sampled requests only: building the batch copies its parameters to the device
        sb_all = None if all(s.req.params.greedy for s in sampling) else sampler.SamplingBatch.build(
            [s.req.params for s in sampling], [s.req.generator for s in sampling], self.device)
        # the step's one host sync: greedy acceptance is a comparison of these with the drafts, which
        # come back with them where the draft loop left them on the device
        greedy_argmax = []
        fused = None
        if logits is not None:
            argmax = early.argmax if early is not None else logits.argmax(-1)
            back = argmax
            if pending:  # (and the structure of trees selected on the device)
                back = torch.cat([argmax, inputs.input_ids.index_select(0, pending_rows)]
                                 + ([] if tree_extra is None else [tree_extra]))
            fused = self._fused_targets(plan) if sb_all is None else None
            if fused:  # the next cycle's catch-up and drafts go to the device before the host waits
                def launch() -> None:
                    self._launch_fused(fused, inputs, argmax, feats)
                    if self._presync_ok(fused):  # (trees) and the verify of those drafts
                        self._presync = self._launch_presync_verify(fused)

                vals = self._read_back_around(back, launch)
            else:
                vals = back.tolist()
            greedy_argmax = vals[: argmax.shape[0]]
            if pending:
                self._resolve_drafts(pending, vals[argmax.shape[0]:])

        # a fused tree launch moved the accepted nodes' KV and kept their features on the device
        on_device = bool(fused) and self.topk > 1
        results = self._verify_all(sampling, logits, greedy_argmax, sb_all, compacted=on_device)
        presync, self._presync = self._presync, None
        if presync is not None:
            self._adopt_presync_verify(presync, results)
        elif fused and self.controller.early_verify:
            self._launch_early_verify(fused, results)
        token_ids = [r.tokens for r in results]
        accepted = [r.num_accepted for r in results]
        kept_rows = [[0] + r.path for r in results]  # query rows whose KV/features are kept
        lps: list | None = None
        if any(s.req.params.logprobs is not None for s in sampling):
            lps, off = [], 0
            for s, res, kept in zip(sampling, results, kept_rows):
                n = len(s.draft_token_ids) + 1
                lp = s.req.params.logprobs
                lps.append(None if lp is None else sampler.top_logprobs(
                    logits[off : off + n][kept], torch.tensor(res.tokens, device=self.device), lp))
                off += n
        # keep target features of the tokens that will be committed, at the slots of the positions
        # they are committed at (a kept row j of a request's query goes to its j-th slot: accepted
        # tree nodes move up like their KV, _compact): one gather and one scatter for the whole step.
        # A fused tree launch kept them on the device already (FusedTreeLaunch: its steps only verify)
        if not on_device:
            self._keep_verified_features(plan, inputs, feats, kept_rows)
        # on a GPU a verify of drafts left on the device queued behind their draft loop (and a fused
        # one's host wait behind the next drafts' launch): its time is not the target's alone
        own_time = early is None and (not pending or self.device.type != "cuda")
        self._record(plan, sampling, accepted, clock() - t0, own_time)
        return CommitResult(token_ids=token_ids, logprobs=lps, num_accepted_drafts=accepted)

    def _launch_plain_ahead(self, plan: StepPlan, launched: LaunchedStep) -> bool:
        """Overlap scheduling of plain decoding (the engine's ``overlap``): where the step after this plain
        one is known before this one's sync to be plain for everyone (no one drafts: the policy's quick
        decision of k = 0, taken here for draft_step to apply, or no request samples), it is scheduled
        over this step's pending tokens (Scheduler.advance) and launched, its features kept and its
        sampling queued, before the sync: the host's commit, outputs and decision then run while the
        device computes. The next verify_step finds it (``_ahead``) and only reads its tokens back."""
        e, ctl = self.engine, self.controller
        if not e.overlap:
            return False
        sched = e.scheduler
        # drafts left on a request the budget did not schedule (a plain plan's own requests hold none)
        if plan.num_left_out and any(r.draft_token_ids for r in sched.running):
            return False
        found = plan.num_sampling  # the next decision's batch, unless one stops
        if found:
            arm = ctl.forced_arm
            if arm is None:
                if ctl.after_exploration(found):
                    return False
                # an exploration of plain decoding runs its measured cycle overlapped, as the pick would
                arm = 0 if ctl.plain_second_cycle(found) else ctl.quick_arm(found, len(sched.running))
                if arm is None:  # a full decision is due: taken now where it cannot explore, else after the sync
                    ks = self._plain_full_early(plan)
                    if ks is None:
                        return False
                    arm = max(ks, default=0)
                else:
                    self._pre_arm = (found, arm)  # the decision is counted: draft_step applies it
            if arm != 0:
                return False
        sched.advance(plan)
        nxt = sched.schedule()
        if not nxt.scheduled:
            return False  # (this step stays advanced: commit takes it so)
        inputs, out = self.runner.launch_forward(nxt, launched)
        self._ahead = PlainAhead(nxt, inputs, self._launch_plain(nxt, inputs, out))
        self.path_counts["plain_ahead"] += 1
        return True

    def _plain_full_early(self, plan: StepPlan) -> list[int] | None:
        """The full decision due after plain step ``plan``, taken before its sync where it cannot explore
        (controller.plain_full_early) for draft_step to apply (_pre_ks), as _early_ks takes a drafting
        pick's: plain decoding again is then launched ahead too. Taken after the sync, each such decision
        (one in ~16 cycles at 16 requests) ran its own step and the next step by step: ~0.7 ms each on an
        H100 against an overlapped plain step's ~1.4. Each request's cap is its cap after this step's
        one token; what drafting would catch up counts this step's tokens. Its ks, or None: not taken."""
        if not self.controller.plain_full_early(plan.num_sampling):
            return None
        reqs, caps, behind = [], [], 0
        for s in plan.scheduled:
            if s.samples:
                r = s.req
                reqs.append(r)
                caps.append(self._draft_cap(r, 1))
                if caps[-1] > 0:
                    behind += self._behind(r, r.num_computed_tokens + s.num_new_tokens)
        ks, cycle = self.controller.decide_early(reqs, caps, len(self.engine.scheduler.running),
                                                 self._prefill_tokens_next_step(), behind)
        self._pre_ks = ([r.request_id for r in reqs], ks, cycle)
        return ks

    def _draft_cap(self, r: Request, committed: int = 0) -> int:
        """The most ``r`` may draft once ``committed`` more tokens are committed (_cap; 0 without draft KV)."""
        return 0 if r.no_draft_kv else max(self._cap(r, committed), 0)

    def _behind(self, r: Request, computed: int) -> int:
        """Tokens drafting ``r`` would first catch up once ``computed`` of its tokens are computed."""
        st = self.states.get(r.request_id)
        return computed - (st.draft_pos if st is not None else 0)

    def _launch_plain(self, plan: StepPlan, inputs, out) -> LaunchedStep:
        """A plain step's features kept (every row) and its sampling queued, after its forward ``out``."""
        hidden, feats = out if isinstance(out, tuple) else (out, out)
        self._keep_all_features(plan, feats, inputs)
        return self.runner.launch_sampling(plan, inputs, hidden)

    def _keep_verified_features(self, plan: StepPlan, inputs, feats: torch.Tensor,
                                kept_rows: list[list[int]]) -> None:
        """A verify step's target features of the rows it commits, at the KV slots of their positions: where
        the forward writes every row's at its own slot (features_in_forward), only the rows that move (an
        accepted tree node off the first branch), so a chain's verify copies nothing."""
        j = 0
        start = 0
        keep: list[int] = []  # query rows kept
        dst: list[int] = []  # their indices in the step's slot mapping
        for s in plan.scheduled:
            if s.samples:
                n0 = s.num_new_tokens - 1  # prefill rows before the last known token
                rows_kept = list(range(start, start + n0)) + [start + n0 + r for r in kept_rows[j]]
                j += 1
            else:
                rows_kept = list(range(start, start + s.num_new_tokens))
            keep.extend(rows_kept)
            dst.extend(range(start, start + len(rows_kept)))
            if not s.req.no_draft_kv:
                self._state(s.req)
            start += s.num_query_tokens
        self._check_feature_sink(True, inputs, feats)
        if self.features_in_forward:
            moved = [(k, d) for k, d in zip(keep, dst) if k != d]
            if not moved:
                return
            keep, dst = [k for k, _ in moved], [d for _, d in moved]
        idx = host_to_device(keep + dst, self.device)
        self.features.index_copy_(0, inputs.meta.slot_mapping.index_select(0, idx[len(keep):]),
                                  feats.index_select(0, idx[: len(keep)]))

    def _fill_drafts(self, plan: StepPlan, inputs) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
        """Write drafts still on the device (PENDING on the host) into the step's input ids, device to
        device: the draft loop then needs no host sync of its own, and the host prepares this step
        while the device drafts. Trees selected on the device also bring their RoPE positions and
        attention masks (prepare() planned placeholders of the same shape). Returns the requests
        filled, their input rows, and their trees' parents and depths (the verify's sync brings the
        values back: _resolve_drafts)."""
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        pending = []
        spans = iter(inputs.sample_spans)
        states = self.states
        tree_src: list[tuple[torch.Tensor, int, int, int, int, int]] = []  # (trees, row, first input row, nodes, b, root)
        for b, s in enumerate(plan.scheduled):
            if not s.samples:
                continue
            a, n = next(spans)
            d = s.draft_token_ids
            if not d or d[0] != PENDING:
                continue
            st = states[s.req.request_id]
            if st.device_tree is not None:
                trees, row = st.device_tree
                tree_src.append((trees, row, a, n, b, s.req.num_computed_tokens + s.num_new_tokens - 1))
                pending.append(s)
                continue
            toks, row = st.device_drafts  # type: ignore[misc]
            K = toks.shape[1]
            _, src, dst = groups.setdefault(id(toks), (toks, [], []))
            src.extend(range(row * K, row * K + n - 1))  # (the scheduler may have cut the drafts short)
            dst.extend(range(a + 1, a + n))
            pending.append(s)
        if not pending:
            return pending, None, None
        rows = []
        for toks, src, dst in groups.values():
            idx = host_to_device(dst + src, self.device)
            rows.append(idx[: len(dst)])
            inputs.input_ids.index_copy_(0, rows[-1], toks.view(-1).index_select(0, idx[len(dst):]))
        extra = None
        if tree_src:
            tree_rows, extra = self._fill_trees(tree_src, inputs)
            rows.append(tree_rows)
        return pending, rows[0] if len(rows) == 1 else torch.cat(rows), extra

    def _fill_trees(self, src: list[tuple[torch.Tensor, int, int, int, int, int]], inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Device trees into a step's inputs: for each (packed trees, row, first input row, nodes n,
        request index in the step, root position) the drafts' ids, the nodes' positions (root's + depth) and the
        tree's attention rows (ancestor bits). Returns the drafts' input rows and the trees' parents and depths of nodes 1..n-1
        (a gather to read back with the picks)."""
        N = self.max_k + 1
        if len(src) == 1:  # one tree (one request: a host-bound cycle on a GPU): slices, no index lists
            trees, row, a, n, b, nc = src[0]
            t = trees[row]
            inputs.input_ids[a + 1 : a + n].copy_(t[1:n])
            torch.add(t[2 * N : 2 * N + n], nc, out=inputs.positions[a : a + n])
            inputs.meta.tree_masks[b] = t[3 * N : 3 * N + n]
            rows = torch.arange(a + 1, a + n, device=inputs.input_ids.device)
            return rows, torch.cat([t[N + 1 : N + n], t[2 * N + 1 : 2 * N + n]])
        W = src[0][0].shape[1]
        dst_ids: list[int] = []
        src_ids: list[int] = []
        dst_pos: list[int] = []
        src_pos: list[int] = []
        offs: list[int] = []
        src_extra: list[int] = []
        same = all(t is src[0][0] for t, *_ in src)
        flat = src[0][0] if same else torch.cat([t for t, *_ in src])
        base = 0
        for trees, row, a, n, b, nc in src:
            r0 = (base if not same else 0) + row
            if not same:
                base += trees.shape[0]
            dst_ids.extend(range(a + 1, a + n))
            src_ids.extend(range(r0 * W + 1, r0 * W + n))
            dst_pos.extend(range(a, a + n))
            src_pos.extend(range(r0 * W + 2 * N, r0 * W + 2 * N + n))
            offs.extend([nc] * n)
            src_extra.extend(range(r0 * W + N + 1, r0 * W + N + n))  # parents of nodes 1..n-1
            src_extra.extend(range(r0 * W + 2 * N + 1, r0 * W + 2 * N + n))  # their depths
            inputs.meta.tree_masks[b] = flat[r0, 3 * N : 3 * N + n]  # (rows packed as bits: AttentionMetadata)
        k1, k2, k3 = len(dst_ids), 2 * len(dst_ids), 2 * len(dst_ids) + len(dst_pos)
        k4, k5 = k3 + len(dst_pos), k3 + 2 * len(dst_pos)
        idx = host_to_device(dst_ids + src_ids + dst_pos + src_pos + offs + src_extra, self.device)
        vals = flat.view(-1)
        inputs.input_ids.index_copy_(0, idx[:k1], vals.index_select(0, idx[k1:k2]))
        inputs.positions.index_copy_(0, idx[k2:k3], vals.index_select(0, idx[k3:k4]) + idx[k4:k5])
        return idx[:k1], vals.index_select(0, idx[k5:])

    # -- the next cycle's drafts launched before the verify's sync ----------------------------------
    def _early_ks(self, found: list[tuple[Request, int]]) -> list[int]:
        """Each request's next k, where the next decision is known before this verify's outcome: the
        static policy's, a forced depth's (the adaptive policy's calibration) and, with ``fuse_quick``,
        the adaptive policy's quick decision and (``fuse_full``; ``fuse_exploit``: where it cannot
        explore; ``fuse_explorations``: an exploration's second cycle) its full one, taken here for
        draft_step to apply (_pre_arm, _pre_ks); each capped as the most this verify can commit leaves
        it (_capped). [] where the decision is not known."""
        ctl = self.controller
        if self.cfg.policy == "static":
            return [self._capped(r, k, self.max_k) for r, k in found]
        if self.cfg.policy != "adaptive" or not ctl.fuse_quick:
            return []
        # (a tree's arm is its depth: drafting it means the whole tree, as controller.uniform)
        def drafts(arm: int) -> int:
            return self.max_k if arm and self.topk > 1 else arm

        if ctl.forced_arm is not None:
            return [self._capped(r, k, drafts(ctl.forced_arm)) for r, k in found]
        if ctl.after_exploration(len(found)):
            return []
        arm = ctl.quick_arm(len(found), len(self.engine.scheduler.running))
        if arm is not None:
            self._pre_arm = (len(found), arm)  # quick_arm counted the decision: draft_step applies it
            return [self._capped(r, k, drafts(arm)) for r, k in found]
        caps = [self._capped(r, k, self.max_k) for r, k in found]
        if not all(caps) or not (ctl.fuse_full or ctl.full_early(len(found))):
            return []
        reqs = [r for r, _ in found]
        # (what this verify commits is not known yet: up to k + 1 tokens each to catch up)
        ks, cycle = ctl.decide_early(reqs, caps, len(self.engine.scheduler.running),
                                     self._prefill_tokens_next_step(), sum(k + 1 for _, k in found))
        self._pre_ks = ([r.request_id for r in reqs], ks, cycle)
        return ks

    def _cap(self, r: Request, committed: int = 0) -> int:
        """The most tokens ``r`` may draft once ``committed`` more tokens are committed (max_k, its
        max_spec_tokens, what is left of max_tokens and of the model length); may be negative. A tree
        drafts all its nodes while max_tokens leaves it any token to draft: it commits at most its depth
        plus one, and the commit cuts at max_tokens what it accepts past it (cut to fewer nodes, a tree
        in its last ~2 x nodes tokens left the fused launch: ~1 step in 5 at 128 tokens on the H200,
        session 32)."""
        p = r.params
        cap = self._spec_limit(r)
        if p.max_tokens is not None:
            left = p.max_tokens - (r.num_output_tokens + committed) - 1
            if self.topk == 1 or left <= 0:
                cap = min(cap, left)
        return min(cap, self.engine.max_model_len - (r.num_tokens + committed) - 1)

    def _spec_limit(self, r: Request) -> int:
        """max_k, or less where ``r`` asks for fewer drafts (max_spec_tokens)."""
        p = r.params
        return self.max_k if p.max_spec_tokens is None else min(self.max_k, p.max_spec_tokens)

    def _most_committed(self, k: int) -> int:
        """The most tokens a verify of ``k`` drafts commits: k + 1 for a chain, a tree's depth + 1."""
        return (k if self.topk == 1 else min(k, self.cfg.num_steps)) + 1

    def _capped(self, r: Request, k: int, arm: int) -> int:
        """min(arm, r's own cap) however much this verify (of ``k`` drafts) commits: the cap after
        the most it can commit, k + 1 tokens (0: none left). A request near its max_tokens then
        drafts a little less than draft_step would allow after a short commit, but its step still
        fuses (with a binding cap taken as 0, ~3 cycles of each request near its end did not: 47 of
        127 steps of 4 requests of 64 tokens on the CPU). A tree, all its nodes or none, drafts while
        the least this verify commits (its bonus token) leaves it a token to draft and its nodes fit in
        the model's length after the most (its depth and the bonus): the commit cuts at max_tokens what
        it accepts past it, and a request left with no draft after a long commit does not adopt it."""
        most = self._most_committed(k)
        if self.topk == 1:
            return max(min(arm, self._cap(r, most)), 0)
        fits = self.engine.max_model_len - (r.num_tokens + most) - 1 >= arm
        return max(min(arm, self._cap(r, 1)), 0) if fits else 0

    def _fused_targets(self, plan: StepPlan) -> list[tuple[Request, int, int]] | None:
        """(request, drafts verified, next k) for every request of a step that only verifies greedy
        chains whose draft KV is current, when each one's next k is known in advance (_early_ks) and
        the static loop can draft it; None otherwise. Their catch-up (over every verified row: which
        rows hold accepted tokens is computed on the device) and next chain are then launched before
        the verify's host sync, and run on the device while the host commits this step."""
        tree = self.topk > 1
        if self.chain_runner is None:
            return None
        why = self.path_counts
        if tree and (self.tree_launch is None or len(plan.scheduled) > self.tree_launch.batch_sizes[-1]):
            why["unfused:batch"] += 1
            return None
        found = []
        snapshot = None
        for s in plan.scheduled:
            r, k = s.req, len(s.draft_token_ids)
            if not (k and s.samples and s.num_new_tokens == 1 and (s.tree is not None) == tree and r.params.greedy
                    and r.params.logprobs is None and not r.no_draft_kv):
                why["unfused:step"] += 1  # a prompt, a request not verifying drafts, sampled, logprobs
                return None
            st = self.states.get(r.request_id)
            if st is None or st.draft_pos != r.num_computed_tokens:
                why["unfused:draft_kv"] += 1
                return None
            if tree:  # whole trees selected on the device, by one launch
                if k != self.max_k or st.device_tree is None or (snapshot is not None and st.device_tree[0] is not snapshot):
                    why["unfused:tree"] += 1
                    return None
                snapshot = st.device_tree[0]
            found.append((r, k))
        ks = self._early_ks(found)
        # chains: a request with no draft left after the most its verify can commit (near its end) rides
        # along with none (its row of the loop is a padding row's); trees: whole trees only
        if not ks or not any(ks) or (tree and not all(k == self.max_k for k in ks)):
            # no decision before the sync (a full one), plain decoding next, or caps that bind
            why["unfused:decision" if not ks else "unfused:k"] += 1
            return None
        out = [(r, k, kk) for (r, k), kk in zip(found, ks)]
        sched = self.engine.scheduler
        # every slot the catch-up, the drafts and the next verify can write (draft_step reserves as much):
        # kk more after the most this verify commits (for a tree its depth + 1: its node count + 1 ran
        # past the model's length and its block table near a request's end)
        if not all(sched._reserve(r, r.num_tokens + self._most_committed(k) + kk) for r, k, kk in out):
            why["unfused:reserve"] += 1
            return None
        return out

    def _launch_fused(self, targets: list[tuple[Request, int, int]], inputs, argmax: torch.Tensor,
                      feats: torch.Tensor) -> None:
        """The catch-up over each request's verified rows and its next chain, computed on the device
        from the verify's picks (``argmax``, one per row: the step has no other rows). Row j of a
        request (position nc + j) pairs its target feature with the token after it: draft j + 1 while
        j < accepted, the bonus token at j = accepted; rows past that write draft KV at positions the
        next catch-up rewrites before anything reads them. The drafts wait for draft_step to adopt."""
        reqs = [r for r, _, _ in targets]
        k_list = [k for _, k, _ in targets]
        nk = [kk for _, _, kk in targets]
        B, K, T = len(reqs), max(k_list), sum(k_list) + len(reqs)
        assert argmax.shape[0] == T == inputs.input_ids.shape[0], "a fused step verifies drafts only"
        if self.topk > 1:
            self._launch_fused_trees(reqs, argmax, feats[:T])
            return
        fl = self.fused_launch
        key = fl.key(T, B, K, max(nk)) if fl is not None and self.controller.fused_launch_graph else None
        if key is not None:  # what follows, as one graph (FusedLaunchRunner)
            assert fl is not None and self.chain_runner is not None
            fl.write(key, [r.num_computed_tokens for r in reqs], k_list, nk, [r.kv.block_table for r in reqs])
            path = fl.run(key, inputs.input_ids, argmax, feats[:T])
            self.path_counts[f"fused_launch:{path}"] += 1
            self.path_counts[f"catch_up:{path}"] += 1  # (inside it)
            self._adopt_launched(reqs, nk, self.chain_runner.tokens[:B, : max(nk)], path)
            return
        ks = np.asarray(k_list, dtype=np.int64)
        q_lens = ks + 1
        first = np.cumsum(q_lens) - q_lens  # each request's first row
        nc = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        req = np.repeat(np.arange(B), q_lens)
        j_row = np.arange(T) - first[req]
        nxt = np.minimum(np.arange(T) + 1, first[req] + ks[req])  # the row holding the next draft
        drow = np.minimum(first[:, None] + np.arange(K)[None, :], T - 1)
        valid = (np.arange(K)[None, :] < ks[:, None]).astype(np.int64)
        positions, slots = self._catch_up_slots(reqs, nc.tolist(), q_lens.tolist())
        tables = [r.kv.block_table for r in reqs]
        seq_lens = (nc + q_lens).tolist()
        f = feats[:T]
        cu = self.catch_up_runner
        buf = host_to_device(np.concatenate([nxt, j_row, req, drow.ravel(), valid.ravel(), first, nc + 1]),
                             self.device)
        o = np.cumsum([0, T, T, T, B * K, B * K, B, B])
        nxt_d, j_d, req_d, drow_d, valid_d, first_d, base_d = (buf[o[i] : o[i + 1]] for i in range(7))
        ids_in = inputs.input_ids
        following = ids_in.index_select(0, nxt_d)
        match = (following == argmax).index_select(0, drow_d).view(B, K) & valid_d.view(B, K).bool()
        accepted = match.long().cumprod(1).sum(1)
        bonus = argmax.index_select(0, first_d + accepted)
        ids = torch.where(j_d < accepted.index_select(0, req_d), following, bonus.index_select(0, req_d))
        last = first_d + accepted
        if cu is not None and T <= cu.max_tokens:
            path = cu.run(j_row, positions, slots, q_lens.tolist(), seq_lens, tables, f,  # (j_row: unused ids)
                          device_ids=ids, device_last=last)
            self.path_counts[f"catch_up:{path}"] += 1
        else:
            emb = self.target.embed_tokens(ids)
            h = self._run_head(reqs, q_lens.tolist(), positions, seq_lens, emb, self.head.combine(f),
                               host_to_device(slots, self.device))
            self.chain_runner.h0[:B].copy_(h.index_select(0, last))  # type: ignore[union-attr]
            self.path_counts["catch_up:torch"] += 1
        # (the chain starts at nc + 1 + accepted, on the device; nc + 1 + k, the catch-up's seq_lens,
        # bounds it for the eager loop)
        toks, path = self.chain_runner.run(seq_lens, nk, tables,  # type: ignore[union-attr]
                                           device_base=base_d + accepted)
        self._adopt_launched(reqs, nk, toks, path)

    def _launch_fused_trees(self, reqs: list[Request], argmax: torch.Tensor, feats: torch.Tensor) -> None:
        """FusedTreeLaunch from the verify's picks: acceptance, catch-up, the next expansion and trees."""
        tl = self.tree_launch
        assert tl is not None
        computed = [r.num_computed_tokens for r in reqs]
        key = tl.key(len(reqs))
        assert key is not None  # (_fused_targets checked the batch)
        trees, _ = self.states[reqs[0].request_id].device_tree  # type: ignore[misc]
        rows = [self.states[r.request_id].device_tree[1] for r in reqs]  # type: ignore[index]
        tl.write(key, computed, [r.kv.block_table for r in reqs], rows)
        path = tl.run(key, argmax, feats, trees)
        self.path_counts[f"fused_launch:{path}"] += 1  # (the expansion inside it)
        self.path_counts["fused"] += 1
        self._fused = {r.request_id: (i, self.max_k) for i, r in enumerate(reqs)}
        self._fused_toks = tl.tree.trees[: len(reqs)].clone()

    def _adopt_launched(self, reqs: list[Request], nk: list[int], toks: torch.Tensor, chain_path: str) -> None:
        """What a fused launch leaves for draft_step: each request's row and k, and a copy of the drafts."""
        self.path_counts[f"chain:{chain_path}"] += 1
        self.path_counts["fused"] += 1
        self._fused = {r.request_id: (i, kk) for i, (r, kk) in enumerate(zip(reqs, nk))}
        self._fused_toks = toks.clone()

    def _launch_early_verify(self, targets: list[tuple[Request, int, int]], results: list[TreeVerifyResult]) -> None:
        """Launch the next step's verify now, from what this step's sync brought back (each request's
        accepted count and bonus token) and the drafts _launch_fused left on the device: the step
        that follows then finds its forward queued behind those drafts (verify_step checks that its
        plan is this one). Not where the next plan will differ: prompts waiting to be admitted, a
        running request outside this step, a request stopping at an end-of-sequence token, drafts
        over the step's token budget, a request drafting nothing next (near its max_tokens)."""
        sched = self.engine.scheduler
        if sched.waiting or len(targets) != len(sched.running):
            return
        if sum(kk + 1 for _, _, kk in targets) > self.engine.config.max_num_batched_tokens:
            return
        if not all(kk for _, _, kk in targets):  # a request near its end (it may end in this commit)
            return
        toks = self._fused_toks
        assert toks is not None
        tree = self.topk > 1
        K, bs = toks.shape[1], self.engine.config.block_size
        lists = StepLists(bs)
        src: list[int] = []  # the drafts' places in toks, and their input rows
        dst: list[int] = []
        tree_src: list[tuple[torch.Tensor, int, int, int, int, int]] = []
        plan, blocks = [], []
        for i, ((r, _, kk), res) in enumerate(zip(targets, results)):
            p = r.params
            if self._stops_at(r, res.tokens):
                return
            if p.max_tokens is not None and r.num_output_tokens + len(res.tokens) + 1 >= p.max_tokens:
                return  # it ends in this commit, or has no draft left after it (a tree drafted past its cap)
            start = r.num_computed_tokens + 1 + res.num_accepted  # the bonus token's position
            bt = r.kv.block_table
            # (the drafts: filled on the device below)
            a = lists.add([res.tokens[-1]] + [0] * kk, start, bt, sample_rows=kk + 1)
            tree_src.append((toks, i, a, kk + 1, i, start))
            src.extend(range(i * K, i * K + kk))
            dst.extend(range(a + 1, a + kk + 1))
            plan.append((r.request_id, start, res.tokens[-1], kk))
            blocks.append(bt[start // bs : (start + kk) // bs + 1])
        inputs = self.runner.upload(lists)
        extra = None
        if tree:  # ids, positions and masks of the trees the fused launch selected
            inputs.meta.tree_masks = {}
            rows, extra = self._fill_trees(tree_src, inputs)
        else:
            idx = host_to_device(dst + src, self.device)
            rows = idx[: len(dst)]
            inputs.input_ids.index_copy_(0, rows, toks.view(-1).index_select(0, idx[len(dst):]))
        out = self.runner.forward(inputs)
        hidden = out[0] if isinstance(out, tuple) else out
        logits = self.target.compute_logits(hidden)
        self._keep_early(EarlyVerify(plan, blocks, [r for r, _, _ in targets], inputs, out, logits,
                                     logits.argmax(-1), rows, toks, extra))

    def _stops_at(self, r: Request, tokens: list[int]) -> bool:
        """Whether ``r`` stops at one of ``tokens`` (an end-of-sequence or stop token it commits)."""
        p = r.params
        eos = self.engine.scheduler.eos_token_ids
        return not p.ignore_eos and any(t in eos or t in p.stop_token_ids for t in tokens)

    def _keep_early(self, early: EarlyVerify) -> None:
        """``early`` as the next step's verify; commit keeps the blocks its KV went to (it would free
        the blocks past what it commits)."""
        for r, (_, start, _, kk) in zip(early.reqs, early.plan):
            r.kv_hold_tokens = start + kk + 1
        self._early = early

    def _presync_ok(self, targets: list[tuple[Request, int, int]]) -> bool:
        """Whether the verify after a fused tree launch may go to the device before the sync: what
        _launch_early_verify asks that does not need the picks, and no request that can end in this
        commit whatever it accepts (max_tokens; a stop token is seen after the sync: discarded)."""
        ctl, sched = self.controller, self.engine.scheduler
        if not (ctl.early_verify and ctl.presync_verify and self.topk > 1 and self.tree_verify is not None):
            return False
        if sched.waiting or len(targets) != len(sched.running) or not all(kk == self.max_k for _, _, kk in targets):
            return False
        if sum(kk + 1 for _, _, kk in targets) > self.engine.config.max_num_batched_tokens:
            return False
        for r, k, kk in targets:
            p = r.params
            if p.max_tokens is not None and r.num_output_tokens + self._most_committed(k) + 1 >= p.max_tokens:
                return False
        return True

    def _launch_presync_verify(self, targets: list[tuple[Request, int, int]]
                               ) -> tuple[list[tuple[Request, int, int]], list[list[int]], EarlyVerify]:
        """The verify of the trees the fused launch just selected, launched behind it before the sync:
        ids, positions and slots from FusedTreeLaunch's device buffers, the attention planned for the
        most this verify can commit (the root at nc + L) and moved back by the device's shift."""
        tl = self.tree_launch
        toks = self._fused_toks
        assert tl is not None and toks is not None
        N, B = tl.N, len(targets)
        lists = StepLists(self.engine.config.block_size)
        for r, _, _ in targets:  # (ids, positions and slots: placeholders the device overwrites)
            lists.add([0] * N, r.num_computed_tokens + tl.L, r.kv.block_table, sample_rows=N)
        inputs = self.runner.upload(lists)  # (of which the block tables are read)
        T = B * N
        inputs.input_ids, inputs.positions = tl.next_ids[:B].view(-1), tl.next_pos[:B].view(-1)
        meta = inputs.meta
        meta.slot_mapping, meta.seq_shift = tl.next_slots[:B].view(-1), tl.next_shift[:B]
        meta.tree_masks = {b: toks[b, 3 * N : 4 * N] for b in range(B)}
        if B == 1:
            rows = torch.arange(1, N, device=self.device)
        else:
            rows = host_to_device([b * N + i for b in range(B) for i in range(1, N)], self.device)
        extra = torch.cat([toks[:B, N + 1 : 2 * N], toks[:B, 2 * N + 1 : 3 * N]], 1).reshape(-1)
        vg = self.tree_verify
        assert vg is not None
        self.runner.attn.plan(meta)
        path = vg.run(B)  # picks and features into the launch's buffers, which its next run reads
        self.path_counts[f"presync_verify:{path}"] += 1
        self.path_counts["presync_verify"] += 1
        feats = tl.feats[:T]
        early = EarlyVerify([], [], [r for r, _, _ in targets], inputs, (feats, feats), vg.logits[:T], tl.picks[:T],
                            rows, toks, extra)
        return targets, [list(r.kv.block_table) for r, _, _ in targets], early

    def _adopt_presync_verify(self, presync: tuple[list[tuple[Request, int, int]], list[list[int]], EarlyVerify],
                              results: list[TreeVerifyResult]) -> None:
        """After the sync: the verify launched before it is the next step's (as _launch_early_verify's),
        unless a request stops at a token it commits now (its KV writes sit past what is committed)."""
        targets, tables, early = presync
        bs = self.engine.config.block_size
        for (r, _, kk), res, table in zip(targets, results, tables):
            if self._stops_at(r, res.tokens):
                self.path_counts["presync_verify:discarded"] += 1
                return
            start = r.num_computed_tokens + 1 + res.num_accepted
            early.plan.append((r.request_id, start, res.tokens[-1], kk))
            early.blocks.append(table[start // bs : (start + kk) // bs + 1])
        self._keep_early(early)

    def _early_matches(self, early: EarlyVerify, plan: StepPlan) -> bool:
        """Whether ``plan`` verifies what ``early`` launched: the same requests in the same order, each
        from the same position and token, over the same blocks, with the drafts it read."""
        if len(plan.scheduled) != len(early.plan):
            return False
        bs = self.engine.config.block_size
        for i, (s, (rid, start, first, kk), blocks) in enumerate(zip(plan.scheduled, early.plan, early.blocks)):
            r = s.req
            if (r.request_id != rid or r.num_computed_tokens != start or s.num_new_tokens != 1 or not s.samples
                    or (s.tree is not None) != (self.topk > 1) or len(s.draft_token_ids) != kk
                    or r.all_token_ids[start] != first
                    or r.kv.block_table[start // bs : (start + kk) // bs + 1] != blocks):
                return False
            st = self.states.get(rid)
            dd = None if st is None else st.device_tree if self.topk > 1 else st.device_drafts
            if s.draft_token_ids[0] != PENDING or dd is None or dd[0] is not early.toks or dd[1] != i:
                return False
        return True

    def _read_back_around(self, t: torch.Tensor, launch) -> list[int]:
        """``t``'s values on the host, with ``launch()`` queued on the device after ``t`` is computed
        but before the host waits for it (on a GPU: a copy to pinned memory, an event, then the wait)."""
        if self.device.type != "cuda":
            vals = t.tolist()
            launch()
            return vals
        n = t.shape[0]
        if self._readback is None or self._readback.shape[0] < n:
            self._readback = torch.empty(max(n, 1024), dtype=torch.long, pin_memory=True)
        host = self._readback[:n]
        host.copy_(t, non_blocking=True)
        if self._readback_done is None:
            self._readback_done = torch.cuda.Event()
        self._readback_done.record()
        launch()
        self._readback_done.synchronize()
        return host.tolist()

    def _adopt_fused(self, todo: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Take the drafts _launch_fused made for the requests of ``todo`` that may draft at least
        as many as it drafted (their draft KV is caught up over what the verify committed: fewer
        drafts than allowed are verified alike; _capped drafts a request near its end short);
        returns the others."""
        fused, self._fused = self._fused, None
        if not fused:
            return todo
        rest, adopted, rows = [], [], []
        for r, k in todo:
            row, kk = fused.get(r.request_id, (0, -1))
            if not 0 < kk <= k:
                rest.append((r, k))
                continue
            self._caught_up(r, catch_up_end(r))
            adopted.append((r, kk))
            rows.append(row)
        if adopted:
            assert self._fused_toks is not None
            if self.topk > 1:
                self._pend_trees(adopted, self._fused_toks, rows)
            else:
                self._pend(adopted, self._fused_toks, rows)
        return rest

    def _pend(self, todo: list[tuple[Request, int]], toks: torch.Tensor, rows: list[int]) -> None:
        """Drafts left on the device: row ``rows[i]`` of ``toks`` for request i (PENDING on the host)."""
        for (r, k), i in zip(todo, rows):
            r.draft_token_ids = [PENDING] * k
            r.draft_tree = None
            st = self.states[r.request_id]
            st.draft_probs = None
            st.device_drafts = (toks, i)

    def _pend_trees(self, todo: list[tuple[Request, int]], trees: torch.Tensor, rows: list[int]) -> None:
        """Trees left on the device: row ``rows[i]`` of packed ``trees`` for request i. On the host its
        drafts are PENDING and its tree a chain-shaped placeholder of as many nodes (prepare() plans
        with it; _fill_drafts writes the real positions and mask; the verify's sync brings the rest)."""
        for (r, k), i in zip(todo, rows):
            r.draft_token_ids = [PENDING] * k
            r.draft_tree = DraftTree([r.all_token_ids[-1]] + [PENDING] * k, list(range(-1, k)), list(range(k + 1)))
            st = self.states[r.request_id]
            st.draft_probs = None
            st.device_drafts = None
            st.device_tree = (trees, i)

    def _resolve_drafts(self, pending: list, values: list[int]) -> None:
        """The host values of the drafts _fill_drafts wrote, in its order (chains' and trees' drafts by
        input row, then each device tree's parents and depths)."""
        chains = [s for s in pending if self.states[s.req.request_id].device_tree is None]
        trees = [s for s in pending if self.states[s.req.request_id].device_tree is not None]
        off = 0
        for s in chains + trees:  # (the input rows' order)
            n = len(s.draft_token_ids)
            s.draft_token_ids = values[off : off + n]
            s.req.draft_token_ids = s.draft_token_ids
            self.states[s.req.request_id].device_drafts = None
            off += n
        for s in trees:
            n = len(s.draft_token_ids)
            parents, depths = values[off : off + n], values[off + n : off + 2 * n]
            off += 2 * n
            s.tree = s.req.draft_tree = DraftTree([s.req.all_token_ids[-1]] + s.draft_token_ids, [-1] + parents,
                                                  [0] + depths)
            self.states[s.req.request_id].device_tree = None

    def _verify_all(self, sampling, logits, greedy_argmax: list[int], sb_all,
                    compacted: bool = False) -> list[TreeVerifyResult]:
        """Per sampling request: accepted node path, tokens to commit. Sampled chains go in one batch.
        ``compacted``: the trees' accepted KV was moved on the device already."""
        results: list[TreeVerifyResult | None] = [None] * len(sampling)
        chains: list[int] = []
        offs, off = [], 0
        for i, s in enumerate(sampling):
            offs.append(off)
            k = len(s.draft_token_ids)
            span = slice(off, off + k + 1)
            off += k + 1
            if s.tree is not None:
                tree = s.tree.truncated(k)
                if s.req.params.greedy:
                    res = verify_tree_greedy(tree, greedy_argmax[span])
                else:
                    probs = sampler.processed_probs(logits[span], sb_all.select([i] * (k + 1)))
                    res = verify_tree_sampled(tree, probs, s.req.generator or self.runner.generator)
                if not compacted:
                    self._compact(s, res.path)
                results[i] = res
            elif s.req.params.greedy:
                r = verify_greedy(greedy_argmax[span], s.draft_token_ids)
                results[i] = TreeVerifyResult(list(range(1, r.num_accepted + 1)), r.tokens, r.num_accepted)
            else:
                chains.append(i)
        if chains:
            K = max(len(sampling[i].draft_token_ids) for i in chains)
            V = logits.shape[-1]
            row_idx = torch.tensor([offs[i] + min(j, len(sampling[i].draft_token_ids)) for i in chains
                                    for j in range(K + 1)], device=self.device)
            sb = sb_all.select([i for i in chains for _ in range(K + 1)])
            p = sampler.processed_probs(logits[row_idx], sb).view(len(chains), K + 1, V)
            drafts = torch.zeros(len(chains), K, dtype=torch.long)
            q = torch.zeros(len(chains), K, V, device=self.device)
            for c, i in enumerate(chains):
                d = sampling[i].draft_token_ids
                if d:
                    drafts[c, : len(d)] = torch.tensor(d)
                    q[c, : len(d)] = self.states[sampling[i].req.request_id].draft_probs[: len(d)]
            n_d = torch.tensor([len(sampling[i].draft_token_ids) for i in chains], device=self.device)
            acc, bonus = verify_chains_sampled(p, drafts.to(self.device), n_d, q,
                                               [sampling[i].req.generator for i in chains], self.runner.generator)
            for c, (a, b) in enumerate(zip(acc.tolist(), bonus.tolist())):
                i = chains[c]
                d = sampling[i].draft_token_ids
                results[i] = TreeVerifyResult(list(range(1, a + 1)), d[:a] + [b], a)
        return results  # type: ignore[return-value]

    def _keep_all_features(self, plan: StepPlan, feats: torch.Tensor, inputs) -> None:
        """Keep a plain step's target features (every row: one per computed token, in slot order) at
        their KV slots, and start the drafting state of requests new to the engine or back after a
        preemption (their first position without draft KV is where this step starts them: after a
        prefix-cache hit). Every other running request has one since its first step."""
        self._check_feature_sink(False, inputs, feats)
        if not self.features_in_forward:  # (a graph's output rows past the step's are padding)
            self.features.index_copy_(0, inputs.meta.slot_mapping, feats[: inputs.input_ids.shape[0]])
        for r in plan.admitted:
            if not r.no_draft_kv:
                self._state(r)

    def _check_feature_sink(self, verify: bool, inputs, feats: torch.Tensor) -> None:
        """Where the target's forward writes the features (features_in_forward), check the first step of
        each shape (plain or verify, and its token count's power-of-two range: graphs of every padding) that
        it wrote this step's rows at its slots, bit for bit what it returned; if not, scatter them after
        each forward from now on (the graphs are captured again without the write). The write inside a
        graph was never run on a GPU when it landed; each check is a host sync, so a few dozen in all
        (one per distinct token count would be hundreds under a stream of prompts)."""
        if not self.features_in_forward:
            return
        T = inputs.input_ids.shape[0]
        key = (verify, T.bit_length())
        if key in self._sink_checked:
            return
        self._sink_checked.add(key)
        got = self.features.index_select(0, inputs.meta.slot_mapping)
        if torch.equal(got.view(torch.uint8), feats[:T].contiguous().view(torch.uint8)):
            return
        log.warning("the target's forward did not write the EAGLE-3 features of a %s step of %d tokens at its "
                    "KV slots: the drafter scatters them after each forward from now on",
                    "verify" if verify else "plain", T)
        self.path_counts["feature_sink:fallback"] += 1
        self.target.set_feature_sink(None)
        self.features_in_forward = False

    def _compact(self, s, path: list[int]) -> None:
        """Move the target KV of accepted tree nodes to the slots right after the root."""
        r = s.req
        bs = self.engine.config.block_size
        bt = r.kv.block_table
        base = r.num_computed_tokens  # the root's position (commit has not run yet)
        src, dst = [], []
        for m, node in enumerate(path):
            if node != m + 1:
                a, b = base + node, base + m + 1
                src.append(bt[a // bs] * bs + a % bs)
                dst.append(bt[b // bs] * bs + b % bs)
        if not src:
            return
        moved = host_to_device(src + dst, self.device)
        slab = kv_slab(self.runner.kv_caches)  # every layer's K and V: one gather, one scatter
        slab[:, moved[len(src):]] = slab[:, moved[: len(src)]]

    def _depth(self, s) -> int:
        """Draft positions a verify could accept: chain length, or a tree's depth."""
        if s.tree is not None:
            return max(s.tree.depths[: len(s.draft_token_ids) + 1])
        return len(s.draft_token_ids)

    def _record(self, plan: StepPlan, sampling, accepted: list[int], seconds: float, own_time: bool = True) -> None:
        stats = self.engine.stats
        verified = [(s, a) for s, a in zip(sampling, accepted) if s.draft_token_ids]
        if verified:
            stats.spec_steps += 1
        K = self.cfg.num_steps
        if len(stats.spec_drafted_per_position) < K:
            stats.spec_drafted_per_position = [0] * K
            stats.spec_accepted_per_position = [0] * K
        for s, a in verified:
            stats.spec_verify_steps += 1
            stats.spec_draft_tokens += len(s.draft_token_ids)
            stats.spec_accepted_tokens += a
            for pos in range(self._depth(s)):
                stats.spec_drafted_per_position[pos] += 1
                if pos < a:
                    stats.spec_accepted_per_position[pos] += 1
        if verified or self.controller.cycle_open:  # else nothing per request to learn
            self.controller.observe_many([s.req.request_id for s in sampling], [self._depth(s) for s in sampling],
                                         accepted)
        prefill = sum(s.num_new_tokens - s.samples for s in plan.scheduled)
        self.controller.observe_step(plan.num_tokens, len(plan.scheduled), seconds, prefill, len(sampling), own_time)
        self._check_stale()

    def _check_stale(self) -> None:
        """Every 32 steps: whether the cached cost profile is far from what steps measure."""
        cost = self.controller.cost
        # (the staleness check takes a median of the last 256 steps' ratios: not every step)
        if self.engine.stats.steps % 32 == 0 and not cost.meta.get("stale_reported") and cost.stale:
            # the cached profile is far from what steps measure: the next start-up measures anew
            cost.meta["stale_reported"] = True
            path = getattr(self, "cost_profile_path", None)
            log.warning("cost profile off by x%.2f (median measured/profiled over %d steps); %s",
                        cost.profile_ratio, len(cost.profile_ratios),
                        f"removing {path} so the next start re-profiles" if path else "online estimates take over")
            if path and os.path.exists(path):
                try:
                    os.remove(path)
                except OSError:
                    pass

    # -- drafting -------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_step(self, plan: StepPlan, result: CommitResult) -> None:
        sched = self.engine.scheduler
        if self._finished or self._reuse_lost > 0:
            self._catch_up_finished()  # first: before any block is reserved again
        now = clock()
        prev, prev_s = None, 0.0
        if self._cycle_head is not None:
            # the last decision's cycle, in this engine's own time: its draft, the rest of its step
            # (the requests' outputs), then this step up to here; ended once this step's catch-up is
            # timed (below). Left out: what the caller ran between the two steps (in a benchmark that
            # interleaves engines, the others' steps) and the garbage collector's full collections
            # (clock() is the process's running time). The rest of the step and the finished requests'
            # catch-up just run were left out too until session 23: ~0.9 ms a cycle at 256 requests
            # on the H200 (outputs ~0.6, a catch-up of each finished request's plain steps ~0.3), the
            # same for every depth, so the bandit saw plain decoding 15-20 % faster than it ran and a
            # depth committing ~150 tokens a cycle 5-10 % (benchmarks/cycle_log.py measures both)
            tail = max(self.engine.step_ended - self._head_ended, 0.0)
            prev_s = self._cycle_head + tail + now - self.engine.step_started
            prev = self.controller.detach_cycle()
            self._cycle_head = None
        # requests that produced a token this step and decode next step (r.is_finished and r.num_tokens
        # spelt out: a third of the time, every step, at 64-256 requests)
        candidates = [r for s in plan.scheduled if s.samples and (r := s.req).status is not Status.FINISHED
                      and len(r.all_token_ids) - r.num_computed_tokens == 1]
        if not candidates:
            self.controller.finish_cycle(prev, prev_s)
            return
        arm = self.controller.forced_arm
        pre, self._pre_arm = self._pre_arm, None
        pre_ks, self._pre_ks = self._pre_ks, None
        early = None if pre_ks is None else self._early_decision(candidates, *pre_ks)
        if self._ahead is not None:
            arm = 0  # the next step went to the device as plain decoding (_launch_plain_ahead)
        elif arm is None and pre is not None and pre[0] == len(candidates):
            arm = pre[1]  # the quick decision taken before the verify's sync (_early_ks)
        elif arm is None and early is None:
            # (with a full decision taken before the sync, a quick one here would replace it: the bandit
            # has counted that decision's visit, so the next one would be a quick turn. Until session 32
            # it did: an exploration's second cycle, decided early, ran the pick instead)
            arm = self.controller.quick_arm(len(candidates), len(sched.running))
        if arm == 0:  # plain decoding again: nothing per request
            if prev is not None:
                prev_s += self._unpaid_catch_up(candidates)  # (a drafting successor runs it: shift below)
            if early is not None:  # a full decision of plain decoding, before the sync (_plain_full_early)
                self.controller.install_cycle(early[1])
            else:
                self.controller.count_off(len(candidates))
            self.controller.finish_cycle(prev, prev_s)
            self._drafted_last = False
            self._open_head(now)  # measured like any other cycle
            return
        caps = []
        never = 0  # requests that cannot draft (cached blocks without draft KV)
        for r in candidates:
            never += r.no_draft_kv
            caps.append(self._draft_cap(r))
        decide_s = 0.0
        if arm is not None:
            ks = self.controller.uniform(candidates, arm, caps)
        elif early is not None:
            ks = early[0]  # the full decision taken before the verify's sync (_early_ks)
            self.controller.install_cycle(early[1])
        else:
            t_decide = clock()
            behind = sum(self._behind(r, r.num_computed_tokens) for r, cap in zip(candidates, caps) if cap > 0)
            ks = self.controller.decide(candidates, caps, len(sched.running), self._prefill_tokens_next_step(), behind)
            decide_s = clock() - t_decide
            self.controller.observe_decide(decide_s)
        if never:
            self.controller.mixed_batch(ks, never)
        todo: list[tuple[Request, int]] = []
        for r, k in zip(candidates, ks):
            if k > 0 and sched._reserve(r, r.num_tokens + k):
                todo.append((r, k))
        shift = 0.0
        rest = self._adopt_fused(todo)  # drafted before the verify's sync: only their bookkeeping is left
        self.controller.note_launched_early(len(todo) - len(rest))
        # (adopted drafts ran inside the last step, with the catch-up of what its verify committed: that
        # cycle's time has them already, and their host time here is no draft step's cost)
        if rest:
            # the draft time per step includes a steady catch-up (the tokens the last verify
            # committed, and the prompts of requests new to drafting: a cost of drafting itself);
            # one after a stretch of plain decoding is a one-off switch, kept out of the measurement
            caught_up = prompt_rows = 0
            for r, _ in rest:
                pos = self.states[r.request_id].draft_pos
                caught_up += r.num_computed_tokens - pos
                prompt_rows += max(min(r.num_computed_tokens, r.num_prompt_tokens) - pos, 0)
            t0 = clock()
            usual = caught_up <= len(rest) * (self.max_k + 2)  # what a verify commits, no stretch of plain steps
            steady = self._drafted_last and usual
            rows_key = batch_key(caught_up)
            known = self._steady_s.get(rows_key)
            timed = False
            if self._time_catch_up:
                timed = not steady or known is None or self._steady_count % CATCH_UP_TIMING_EVERY == 0
            catch_up_s = self._draft(rest, time_catch_up=timed)
            if steady:
                self._steady_count += 1
                if self._time_catch_up and not timed:
                    catch_up_s = known
                elif timed or self.device.type != "cuda":  # timed to its end (a CPU's forward returns when done)
                    self._steady_s[rows_key] = catch_up_s if known is None else 0.8 * known + 0.2 * catch_up_s
            if usual:
                self.controller.observe_draft(len(rest), max(k for _, k in rest), clock() - t0)
            elif not self._drafted_last:  # nor is it what this depth costs per cycle once on
                self.controller.skip_cycle()
                self.controller.observe_catch_up(caught_up, catch_up_s)
            if self._drafted_last:
                # after a drafting cycle the catch-up replays what its verify committed: its cost,
                # not this cycle's, which would otherwise pay for its predecessor's depth (an
                # exploration of depth 1 after depth 3 would pay for three tokens per request, one
                # of depth 3 after depth 1 for two). The head's pass over the prompts of requests
                # new to drafting stays here, with the depth that drafts for them (its share by
                # rows): moved back, it fell in the cycle whose step prefilled those prompts, which
                # is seldom measured (prefill_share_limit), or in none at all where the batch had
                # emptied, so no drafting depth paid for it: a cost per prompt that plain decoding
                # does not have, left out of the comparison where prompts come most often (a closed
                # loop at 16-32 requests on a CPU prefills one about every other cycle)
                shift = catch_up_s * steady_share(caught_up, prompt_rows)
        if not todo and prev is not None:
            prev_s += self._unpaid_catch_up(candidates)  # a full decision for plain decoding, as above
        self.controller.finish_cycle(prev, prev_s + shift)
        self._drafted_last = bool(todo)
        # a full decision's host time is no arm's: it is the same whatever it picks, and every
        # exploration is one (quick decisions, 3 in 4 or fewer, only re-apply the pick). Counted in the
        # cycle it decides, it charged explored depths alone ~0.3 ms at one request on the H200 (~12 %
        # of a cycle) and ~0.8 ms at 256
        self._open_head(now, shift + decide_s)

    def _unpaid_catch_up(self, candidates: list[Request]) -> float:
        """Predicted seconds of the catch-up over what the last verify committed for ``candidates``, which
        plain decoding next does not run: a drafting cycle followed by another pays it (moved back to it,
        ``shift`` in draft_step), so one followed by plain decoding is charged the same. Without it a
        depth explored out of plain decoding (two cycles, then the pick again: the busy buckets' every
        exploration) was measured without that cost, which its exploited cycles pay. 0 after a plain cycle
        (nothing to catch up for it) or with the controller's ``charge_unpaid_catch_up`` off."""
        if not self._drafted_last or not self.controller.charge_unpaid_catch_up:
            return 0.0
        rows = 0
        for r in candidates:
            st = self.states.get(r.request_id)
            if st is not None and not r.no_draft_kv:
                rows += max(r.num_computed_tokens - st.draft_pos, 0)
        if rows <= 0 or rows > len(candidates) * (self.max_k + 2):  # (a stretch of plain steps: no cycle's)
            return 0.0
        known = self._steady_s.get(batch_key(rows))
        return known if known is not None else self.controller.catch_up_seconds(rows)

    @staticmethod
    def _early_decision(candidates: list[Request], ids: list[str], ks: list[int],
                        cycle: Any) -> tuple[list[int], Any] | None:
        """The full decision taken before the verify's sync (_early_ks, for requests ``ids``) as it applies
        to ``candidates``: as taken, or for the requests left where some stopped in the commit (a stop token
        or EOS; near max_tokens no decision is taken early), in the same batch bucket: the cycle then counts
        only those; None where the batch is another (an exploration's second cycle decided early was lost)."""
        now = [r.request_id for r in candidates]
        if now == ids:
            return ks, cycle
        by_id = dict(zip(ids, ks))
        if not now or any(i not in by_id for i in now) or (cycle is not None and batch_key(len(now)) != cycle.key):
            return None
        if cycle is not None and cycle.request_ids is not None:
            cycle.request_ids &= set(now)
            cycle.requests = len(now)
        return [by_id[i] for i in now], cycle

    def _open_head(self, now: float, left_out: float = 0.0) -> None:
        """The new decision's cycle so far: from ``now`` to here, less ``left_out`` seconds; the rest
        of this step, from here, is added when the next draft_step ends the cycle."""
        self._head_ended = clock()
        self._cycle_head = self._head_ended - now - left_out

    def _prefill_tokens_next_step(self) -> int:
        """Prompt tokens the next step will also carry: running prefills, and waiting requests for
        the free seats, within the step's token budget."""
        sched = self.engine.scheduler
        cfg = self.engine.config
        n = sum(r.num_tokens - r.num_computed_tokens for r in sched.running if r.is_prefilling)
        seats = max(cfg.max_num_seqs - len(sched.running), 0)
        n += sum(r.num_tokens for r in itertools.islice(sched.waiting, seats))
        return min(n, max(cfg.max_num_batched_tokens - len(sched.running), 0))

    def _slots(self, reqs: list[Request], q_lens: list[int], positions: list[int]) -> list[int]:
        bs = self.engine.config.block_size
        slots = []
        p_iter = iter(positions)
        for r, n in zip(reqs, q_lens):
            bt = r.kv.block_table
            for _ in range(n):
                p = next(p_iter)
                slots.append(bt[p // bs] * bs + p % bs)
        return slots

    def _run_head(self, reqs: list[Request], q_lens: list[int], positions: list[int] | np.ndarray,
                  seq_lens: list[int], embeds: torch.Tensor, hidden: torch.Tensor,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
        tables = [r.kv.block_table for r in reqs]
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_lens=q_lens, seq_lens=seq_lens,
            slot_mapping=slots if slots is not None else host_to_device(self._slots(reqs, q_lens, positions),
                                                                        self.device),
            block_tables=host_to_device([t + [0] * (width - len(t)) for t in tables], self.device),
        )
        self.attn.plan(meta)
        pos_t = host_to_device(positions, self.device)
        with forward_context(self.attn):
            return self.head(embeds, hidden, pos_t)

    def _pick(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
        """Next draft token per request (target ids) and, for sampled requests, its distribution q."""
        if all(r.params.greedy for r in reqs):
            ids = self.head.draft_to_target(logits.argmax(-1))
            return ids.tolist(), [None] * len(reqs)
        V = self.engine.model_config.vocab_size
        full = torch.full((logits.shape[0], V), float("-inf"), device=logits.device)
        tgt = self.head.draft_to_target(torch.arange(logits.shape[1], device=logits.device))
        full[:, tgt] = logits
        sb = sampler.SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs], self.device)
        q = sampler.processed_probs(full, sb)
        toks = sampler.draw(q, sb, self.runner.generator).tolist()
        return toks, [None if r.params.greedy else q[i] for i, r in enumerate(reqs)]

    def _draft(self, todo: list[tuple[Request, int]], time_catch_up: bool = False) -> float:
        """Draft for ``todo``; returns the seconds its catch-up took (with ``time_catch_up``, to the
        end of its device work: draft_step moves that time to the last cycle)."""
        reqs = [r for r, _ in todo]
        t0 = clock()
        marks = None
        if time_catch_up:
            # timed on the device with events, read once the drafts are back (that wait is needed
            # anyway): a synchronize here would idle the GPU while the draft loop is launched. The
            # device has just finished the verify, so the first event marks about t0
            if self._catch_up_marks is None:
                self._catch_up_marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks = self._catch_up_marks
            marks[0].record()
            self.catch_ups_timed += 1
        h = self._catch_up(reqs)
        if marks is not None:
            marks[1].record()
        catch_up_s = clock() - t0
        if self.tree_runner is not None:  # built only for trees
            self._draft_tree_static(todo)
        elif self.topk > 1:
            self._draft_tree(todo, h)
        elif self.chain_runner is not None and all(r.params.greedy for r in reqs):
            self._draft_chain_static(todo)
        else:
            self._draft_chain(todo, h)
        if marks is not None:
            marks[1].synchronize()
            catch_up_s = max(catch_up_s, marks[0].elapsed_time(marks[1]) / 1e3)
        return catch_up_s

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        """Draft KV over every position that lacks it: pairs (embed(token i+1), feature i).

        Returns the head's output at each request's last committed position (predicts the next
        token); with the static draft path that is a view of the loop's input buffer ``h0``.
        """
        starts = [self.states[r.request_id].draft_pos for r in reqs]
        ends = [max(catch_up_end(r), a) for r, a in zip(reqs, starts)]
        q_lens = [e - a for e, a in zip(ends, starts)]
        positions, slots = self._catch_up_slots(reqs, starts, q_lens)
        next_tokens = np.fromiter(itertools.chain.from_iterable(
            r.all_token_ids[a + 1 : e + 1] for r, a, e in zip(reqs, starts, ends)), np.int64, len(slots))
        slots_d = host_to_device(slots, self.device)
        feats = self.features.index_select(0, slots_d)
        seq_lens = ends
        cu = self.catch_up_runner
        if cu is not None and max(q_lens) <= cu.max_tokens:
            h = self._catch_up_in_chunks(cu, reqs, q_lens, positions, next_tokens, seq_lens, feats, slots)
        else:  # the CPU path, and on the GPU a request with more tokens than a step (a long prompt)
            emb = self.target.embed_tokens(host_to_device(next_tokens, self.device))
            h = self._run_head(reqs, q_lens, positions, seq_lens, emb, self.head.combine(feats), slots_d)
            last_rows = (np.cumsum(q_lens) - 1).tolist()  # each request's last position's row
            h = h[host_to_device(last_rows, self.device)]
            self.path_counts["catch_up:torch"] += 1
            if self.chain_runner is not None:
                self.chain_runner.h0[: len(reqs)].copy_(h)
        for r, e in zip(reqs, ends):
            self._caught_up(r, e)
        return h

    def _caught_up(self, r: Request, end: int) -> None:
        """``r``'s draft KV now reaches ``end``: mark the blocks its catch-up filled (those before were
        marked by the last one, or came from the prefix cache with draft KV: a request whose cached
        blocks lack it never drafts)."""
        st = self.states[r.request_id]
        bs = self.engine.config.block_size
        self.engine.blocks.mark_draft_ready(r.kv.block_table[st.draft_pos // bs : end // bs])
        st.draft_pos = end

    def _catch_up_slots(self, reqs: list[Request], starts: list[int],
                        q_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Positions start..start+q-1 of each request, and their KV slots, vectorised (a catch-up after
        a stretch of plain decoding covers ~50,000 positions at 256 requests)."""
        bs = self.engine.config.block_size
        counts = np.asarray(q_lens, dtype=np.int64)
        T = int(counts.sum())
        first = np.cumsum(counts) - counts  # each request's first row
        req = np.repeat(np.arange(len(reqs)), counts)
        positions = np.arange(T, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - first, counts)
        width = max(len(r.kv.block_table) for r in reqs)
        tables = np.zeros((len(reqs), width), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.kv.block_table)] = r.kv.block_table
        return positions, tables[req, positions // bs] * bs + positions % bs

    def _catch_up_in_chunks(self, cu: CatchUpRunner, reqs: list[Request], q_lens: list[int], positions: np.ndarray,
                            next_tokens: np.ndarray, seq_lens: list[int], feats: torch.Tensor,
                            slots: np.ndarray) -> torch.Tensor:
        """The catch-up through the static runner, in groups of whole requests within its token
        budget (after a long stretch of plain decoding a batch has more tokens to catch up than a
        step holds); returns each request's last output row (in ``cu.h_out``)."""
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

    def _draft_chain_static(self, todo: list[tuple[Request, int]]) -> None:
        """Greedy chains through the static loop (a CUDA graph per padded batch and K on the GPU):
        the head's output at the last committed position is already in ``chain_runner.h0``."""
        assert self.chain_runner is not None
        reqs = [r for r, _ in todo]
        toks, path = self.chain_runner.run([r.num_tokens - 1 for r in reqs], [k for _, k in todo],
                                           [r.kv.block_table for r in reqs])
        self.path_counts[f"chain:{path}"] += 1
        # no host sync: the drafts stay on the device until the next verify reads them there
        # (_fill_drafts); a copy, as the loop's buffer is rewritten by its next run, and a request
        # the scheduler leaves out of the next step keeps its drafts for a later one
        self._pend(todo, toks.clone(), list(range(len(todo))))

    def _draft_tree_static(self, todo: list[tuple[Request, int]]) -> None:
        """The tree expansion and each request's tree (select_trees) on static buffers, a CUDA graph per
        padded batch and width on the GPU (the head's output is already in ``h0``)."""
        assert self.tree_runner is not None
        reqs = [r for r, _ in todo]
        path = self.tree_runner.run_device([r.num_tokens - 1 for r in reqs], [r.kv.block_table for r in reqs],
                                           [k for _, k in todo])
        self.path_counts[f"tree:{path}"] += 1
        # no host sync: the trees stay on the device until the next verify reads them (_fill_drafts)
        self._pend_trees(todo, self.tree_runner.trees[: len(reqs)].clone(), list(range(len(reqs))))

    def _draft_chain(self, todo: list[tuple[Request, int]], h: torch.Tensor) -> None:
        reqs = [r for r, _ in todo]
        toks, qs = self._pick(reqs, self.head.compute_logits(h))
        drafts = [[t] for t in toks]
        dprobs = [[q] for q in qs]
        # draft step j (2..k) runs at position num_tokens + j - 3
        active = list(range(len(reqs)))
        for j in range(2, max(k for _, k in todo) + 1):
            active = [i for i in active if todo[i][1] >= j]
            if not active:
                break
            sub = [reqs[i] for i in active]
            idx = host_to_device(active, self.device)
            pos = [r.num_tokens + j - 3 for r in sub]
            emb = self.target.embed_tokens(host_to_device([drafts[i][-1] for i in active], self.device))
            h_sub = self._run_head(sub, [1] * len(sub), pos, [p + 1 for p in pos], emb, h[idx])
            h = h.index_copy(0, idx, h_sub)
            toks, qs = self._pick(sub, self.head.compute_logits(h_sub))
            for i, t, q in zip(active, toks, qs):
                drafts[i].append(t)
                dprobs[i].append(q)
        for i, r in enumerate(reqs):
            r.draft_token_ids = drafts[i]
            r.draft_tree = None
            self.states[r.request_id].draft_probs = None if r.params.greedy else torch.stack(dprobs[i])

    def _draft_tree(self, todo: list[tuple[Request, int]], h: torch.Tensor) -> None:
        """EAGLE-2: expand the topk best frontier nodes per step; keep the best k candidates."""
        reqs = [r for r, _ in todo]
        B, K, dev = len(reqs), self.topk, self.device
        score, tok = self.head.top_drafts(h, K)  # [B, K]
        cands: list[list[Candidate]] = [[] for _ in range(B)]
        sc_l, tok_l = score.tolist(), tok.tolist()
        for b in range(B):
            cands[b] = [Candidate(tok_l[b][i], sc_l[b][i], -1, 1) for i in range(K)]
        front_cand = [[i for i in range(K)] for _ in range(B)]
        front_best = [sc_l[b][0] for b in range(B)]  # the frontier's best score (topk sorts)
        front_h = h[:, None, :].expand(B, K, h.shape[-1]).reshape(B * K, -1)
        front_tok, front_score = tok, score
        self.tree_attn.begin([r.kv.block_table for r in reqs], [r.num_computed_tokens for r in reqs], K)
        anc = None
        for depth in range(2, self.cfg.num_steps + 1):
            if all(tree_is_final(cands[b], k, front_best[b]) for b, (_, k) in enumerate(todo)):
                self.path_counts["tree:depths_skipped"] += self.cfg.num_steps + 1 - depth
                break
            pos = torch.tensor([r.num_tokens + depth - 3 for r in reqs], device=dev).repeat_interleave(K)
            self.tree_attn.set_ancestors(anc)
            with forward_context(self.tree_attn):
                h_out = self.head(self.target.embed_tokens(front_tok.reshape(-1)), front_h, pos)
            c_score, c_tok = self.head.top_drafts(h_out, K)  # [B*K, K]
            c_score = (front_score.reshape(-1, 1) + c_score).reshape(B, K * K)
            c_tok = c_tok.reshape(B, K * K)
            best_score, best = c_score.topk(K, dim=-1)  # next frontier [B, K]
            cs_l, ct_l, best_l = c_score.tolist(), c_tok.tolist(), best.tolist()
            new_front = []
            for b in range(B):
                first = len(cands[b])
                for c in range(K * K):
                    cands[b].append(Candidate(ct_l[b][c], cs_l[b][c], front_cand[b][c // K], depth))
                new_front.append([first + c for c in best_l[b]])
            front_cand = new_front
            front_best = [cs_l[b][best_l[b][0]] for b in range(B)]
            parent = best // K  # which current query each new frontier node hangs under [B, K]
            onehot = torch.nn.functional.one_hot(parent, K).bool()
            anc = onehot if anc is None else torch.cat([anc.gather(1, parent[:, :, None].expand(-1, -1, anc.shape[2])),
                                                        onehot], 2)
            front_h = h_out.view(B, K, -1).gather(1, parent[:, :, None].expand(-1, -1, h_out.shape[-1]))
            front_h = front_h.reshape(B * K, -1)
            front_tok = c_tok.gather(1, best)
            front_score = best_score
        self._set_trees(todo, cands)

    @staticmethod
    def _set_trees(todo: list[tuple[Request, int]], cands: list[list[Candidate]]) -> None:
        """Each request's tree: its best k candidates below its last committed token."""
        for (r, k), c in zip(todo, cands):
            tree = select_tree(r.all_token_ids[-1], c, k)
            r.draft_tree = tree
            r.draft_token_ids = tree.tokens[1:]


def build_speculator(engine: "LLMEngine") -> EagleSpeculator:
    return EagleSpeculator(engine)
