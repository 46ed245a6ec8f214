"""EAGLE / EAGLE-3 speculation in the engine's step: verify_step (one target forward, acceptance), commit,
draft_step (k per request, catch-up, drafts); plain steps via plain_step (docs/architecture.md, "One step")."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from specserve.attention.torch_native import TorchNativeBackend
from specserve.config import DEFAULT_HEAD, default_draft_path  # noqa: F401  (DEFAULT_HEAD: for tests)
from specserve.engine import logits_process, sampler
from specserve.engine.gc_pauses import clock
from specserve.engine.host_copy import host_to_device
from specserve.engine.request import Request, Status
from specserve.engine.runner import LaunchedStep, allocate_kv_cache
from specserve.engine.scheduler import CommitResult, StepPlan
from specserve.models.cpu_packing import pack_for_cpu
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.speculative import profile, static
from specserve.speculative.accept import Accepted, accept_chains_sampled, accept_greedy, accept_tree_sampled
from specserve.speculative.catch_up import CatchUp
from specserve.speculative.cycle import CycleClock
from specserve.speculative.features import FeatureStore
from specserve.speculative.pipeline import Pipeline
from specserve.speculative.policy.bandit import batch_key
from specserve.speculative.policy.interface import Batch
from specserve.speculative.policy.controller import SpecController, reached
from specserve.speculative.propose import Proposer
from specserve.speculative.state import Caps
from specserve.speculative.tree import DraftTree
from specserve.speculative.tree_graph import lane_blocks

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

class EagleSpeculator:
    def __init__(self, engine: "LLMEngine") -> None:
        cfg = engine.config.speculative
        assert cfg is not None
        self.cfg, self.engine, self.runner, self.target, self.device = cfg, engine, engine.runner, engine.runner.model, engine.device
        path = cfg.draft_model_path or default_draft_path()
        self.head_dtype = engine.dtype if cfg.draft_dtype == "auto" else getattr(torch, cfg.draft_dtype)
        self.head = Eagle3DraftModel.from_pretrained(path, device=self.device, dtype=self.head_dtype).eval()
        self.head.fuse_projections()
        if self.device.type == "cuda":  # rotary + KV write as one kernel: tables up to the longest position
            self.head.build_rope_tables(engine.max_model_len + cfg.num_steps + 2)
        pack_for_cpu(self.head, engine.config.cpu_weight_packing, self.device, self.head_dtype)
        hc, mc = self.head.config, engine.model_config
        if hc.algorithm != ("EAGLE3" if cfg.algorithm == "EAGLE3" else "EAGLE"):
            raise ValueError(f"--speculative-algorithm {cfg.algorithm} but the head at {path} is {hc.algorithm}")
        if hc.vocab_size != mc.vocab_size:
            raise ValueError(f"draft head vocab {hc.vocab_size} != target vocab {mc.vocab_size}")
        if self.head.is_eagle3:
            self.target.set_aux_hidden_layers(hc.resolved_aux_layer_ids(mc.num_hidden_layers))
        else:
            self.head.bind_target(self.target.compute_logits)
        self.topk = cfg.eagle_topk
        self.max_k = cfg.resolved_num_draft_tokens - 1  # most tokens one request verifies
        bs, max_seqs = engine.config.block_size, engine.config.max_num_seqs
        # one block past the engine's (draft steps past a request's k, padding rows), then trees' lanes
        lanes = max_seqs * self.topk * lane_blocks(bs, cfg.num_steps) if self.topk > 1 else 0
        caches = allocate_kv_cache(self.head.num_kv_layers, engine.blocks.num_blocks + 1 + lanes, bs,
                                   hc.num_key_value_heads, hc.head_dim, self.head_dtype, self.device)
        self.scratch_slot = engine.blocks.num_blocks * bs
        self.path_counts: Counter[str] = Counter()  # draft-side calls per path ("catch_up:graph", ...)
        self.features = FeatureStore(self.target, self.scratch_slot + bs, hc.feature_size, engine.dtype, self.device,
                                     self.head.is_eagle3, self.path_counts)
        self.attn = TorchNativeBackend(caches, bs, hc.head_dim**-0.5)
        engine.blocks.require_draft_kv = True
        self.controller = SpecController(cfg, defer=True, clock=clock)  # bookkeeping deferred to the next launch
        self.caps = Caps(self.max_k, self.topk, cfg.num_steps, engine.max_model_len)
        self.catch_up = CatchUp(self.head, self.target.embed_tokens, self.attn, self.features, engine.blocks, bs,
                                self.device, self.path_counts)
        self.proposer = Proposer(self.head, self.target.embed_tokens, self.catch_up, self.topk, mc.vocab_size,
                                 self.runner.generator, self.device, self.path_counts)
        if self.topk > 1:  # trees expand on static buffers (run eagerly unless captured: enable_static_draft)
            static.build_tree_runner(self)
        self.pipeline = Pipeline(engine, self.controller, self.caps, self.catch_up, self.proposer, cfg.policy,
                                 self.path_counts)
        self.cycle = CycleClock(self.controller, engine, self.max_k,
                                time_on_device=cfg.policy == "adaptive" and self.device.type == "cuda")
        self._launched_ahead = False  # the next step, plain, went to the device already (launch_ahead)
        self._t0 = 0.0  # clock() at the start of the current plain step
        self.calibration: dict[str, Any] | None = None  # what the start-up calibration measured
        self.cost_profile_path: str | None = None
        if cfg.policy == "adaptive" and self.runner.graphs is None:
            self.controller.cost, self.cost_profile_path = profile.load_or_profile_costs(self)  # else after_capture
        log.info("speculation: %s head from %s (draft vocab %d), policy %s, up to %d tokens",
                 hc.algorithm, path, hc.draft_vocab_size, cfg.policy, self.max_k)
        self.runner.ensure_graph_tokens(max_seqs * (self.max_k + 1), trees=self.topk > 1)
        if self.device.type == "cuda" and self.runner.backend_name == "triton" and self.runner.driver is None:
            self.enable_static_draft(graphs=not engine.config.enforce_eager)

    def enable_static_draft(self, graphs: bool = False, attention: str = "auto", fused_launch: bool | None = None) -> None:
        """The catch-up and draft loop on static buffers (CUDA graphs with ``graphs``): static.py."""
        static.build_static_draft(self, graphs, attention, fused_launch)

    @property
    def graph_memory_bytes(self) -> int:
        return static.graph_memory_bytes(self)

    def after_capture(self) -> None:
        """Where target steps replay CUDA graphs, profile them once captured; then calibrate."""
        if self.cfg.policy != "adaptive":
            return
        if self.runner.graphs is not None:
            self.controller.cost, self.cost_profile_path = profile.load_or_profile_costs(self)
        if self.cfg.calibrate if self.cfg.calibrate is not None else self.runner.graphs is not None:
            from specserve.speculative.policy.calibrate import calibrate

            self.calibration = calibrate(self)

    def release(self, req: Request) -> None:
        req.spec = None

    # -- plain steps: the engine may launch one ahead ---------------------------------------------------
    def plain_step(self, plan: StepPlan, launched: LaunchedStep | None = None) -> LaunchedStep:
        """A plain step's forward, features kept and sampling queued (``launched``: done a step ahead)."""
        self._t0 = clock()
        self._launched_ahead = False
        self.pipeline.reset()
        if launched is None:
            inputs, out = self.runner.launch_forward(plan)
        self.controller.flush()  # (the last cycle's bookkeeping, while the device computes)
        return launched if launched is not None else self._launch_plain(plan, inputs, out)

    def plain_next(self, plan: StepPlan) -> bool:
        """Whether the step after plain step ``plan`` is known now to be plain for everyone."""
        return self.pipeline.plain_next(plan)

    def launch_ahead(self, plan: StepPlan, after: LaunchedStep) -> LaunchedStep:
        """The next plain step launched before ``after``'s tokens are read back."""
        inputs, out = self.runner.launch_forward(plan, after)
        self.path_counts["plain_ahead"] += 1
        self._launched_ahead = True  # (the next decision is plain decoding: draft_step applies it)
        return self._launch_plain(plan, inputs, out)

    @torch.inference_mode()  # (as the runner's own launch: its sampling ops dispatch as inference ops)
    def _launch_plain(self, plan: StepPlan, inputs, out) -> LaunchedStep:
        hidden, feats = out if isinstance(out, tuple) else (out, out)
        self.features.keep_plain(plan, inputs, feats)
        return self.runner.launch_sampling(plan, inputs, hidden)

    def observe_plain(self, plan: StepPlan, result: CommitResult, own_time: bool) -> None:
        """A plain step's time (``own_time``: not overlapped with another step's)."""
        T, n = plan.num_tokens, len(result.token_ids)
        if self.controller.cycle_open:  # a drafting decision's requests, none of which drafted
            self._record(plan, [s for s in plan.scheduled if s.samples], [0] * n, clock() - self._t0, own_time)
        else:
            self.controller.observe_step(T, len(plan.scheduled), clock() - self._t0, T - n, n, own_time)
            profile.check_stale(self.controller.cost, self.engine.stats.steps, self.cost_profile_path)

    # -- verify ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def verify_step(self, plan: StepPlan) -> CommitResult:
        """A step that verifies drafts: one target forward, one host sync, acceptance."""
        t0 = clock()
        self._launched_ahead = False
        pipe = self.pipeline
        pipe.reset()
        early = pipe.take(plan)
        sampling = [s for s in plan.scheduled if s.samples]
        if early is not None:  # this step's forward was launched with the last step's sync
            inputs, out, logits, argmax, sb = early.inputs, early.out, early.logits, early.argmax, None
            pending, pending_rows, tree_extra = list(plan.scheduled), early.draft_rows, early.tree_extra
            self.controller.flush()
        else:
            inputs = self.runner.prepare(plan)
            pending, pending_rows, tree_extra = pipe.fill_drafts(plan, inputs)
            out = self.runner.forward(inputs)
            self.controller.flush()
            logits = argmax = sb = None
            if sampling:
                rows = host_to_device([i for a, n in inputs.sample_spans for i in range(a, a + n)], self.device)
                logits = self.target.compute_logits((out[0] if isinstance(out, tuple) else out)[rows])
                sb = self._row_sampling(sampling, inputs, rows)
                argmax = logits.argmax(-1)
        feats = out[1] if isinstance(out, tuple) else out
        processed = early is None and any(s.req.processes_logits for s in sampling)
        argmax_host: list[int] = []
        fused = None
        raw = logits
        if logits is not None:  # the step's one host sync (two where logits are processed): picks, drafts
            if not processed:
                argmax = sampler.picks(logits, sb, argmax)
            back = argmax
            if pending:
                back = torch.cat([argmax, inputs.input_ids.index_select(0, pending_rows)]
                                 + ([] if tree_extra is None else [tree_extra]))
            fused = pipe.fused_targets(plan) if sb is None and not processed else None
            if fused:  # the next catch-up and drafts go to the device before the host waits
                def launch() -> None:
                    pipe.launch_fused(fused, inputs, argmax, feats)
                    if pipe.presync_ok(fused):
                        pipe.launch_presync_verify(fused)

                vals = pipe.read_back_around(back, launch)
            else:
                vals = back.tolist()
            argmax_host = vals[: argmax.shape[0]]
            if pending:
                pipe.resolve_drafts(pending, vals[argmax.shape[0]:])
            if processed:  # the drafts are known now: each row's history
                logits = self._process(sampling, logits)
                argmax_host = sampler.picks(logits, sb).tolist()
        on_device = bool(fused) and self.topk > 1  # a fused tree launch moved KV and kept features already
        results = self._accept(sampling, logits, argmax_host, sb, compact=not on_device)
        if not pipe.adopt_presync_verify(results) and fused and pipe.early_verify:
            pipe.launch_early_verify(fused, results)
        kept_rows = [[0] + r.path for r in results]  # query rows whose KV/features are kept
        lps = self._logprobs(sampling, results, kept_rows, raw)
        if not on_device:
            self.features.keep_verified(plan, inputs, feats, kept_rows)
        # a verify queued behind drafts on a GPU: its time is not the target's alone
        own_time = early is None and (not pending or self.device.type != "cuda")
        accepted = [r.num_accepted for r in results]
        self._record(plan, sampling, accepted, clock() - t0, own_time)
        return CommitResult(token_ids=[r.tokens for r in results], logprobs=lps, num_accepted_drafts=accepted)

    def _row_sampling(self, sampling, inputs, rows: torch.Tensor) -> sampler.SamplingBatch | None:
        """Per verify row, its request's params and the output index of the token it predicts (the row's
        position + 1 - prompt length: a chain's row j, a tree node's depth, after the committed tokens);
        None where every request is greedy."""
        if all(s.req.params.greedy for s in sampling):
            return None
        params, prompt = [], []
        for s, (_, n) in zip(sampling, inputs.sample_spans):
            params += [s.req.params] * n
            prompt += [s.req.num_prompt_tokens - 1] * n
        out_index = inputs.positions.index_select(0, rows) - host_to_device(prompt, self.device)
        return sampler.SamplingBatch.build(params, out_index, self.device)

    def _process(self, sampling, logits: torch.Tensor) -> torch.Tensor:
        """Logits with each row's edits (logits_process), from its request's history and draft prefix."""
        spans, off = [], 0
        for s in sampling:
            k = len(s.draft_token_ids)
            if s.req.processes_logits:
                t = s.tree.truncated(k) if s.tree is not None else None
                spans.append((s.req, off, logits_process.tree_prefixes(t.tokens, t.parents) if t is not None
                              else logits_process.chain_prefixes(s.draft_token_ids)))
            off += k + 1
        return logits_process.process(logits, spans, self.engine.scheduler.eos_token_ids)

    def _accept(self, sampling, logits, picks: list[int], sb, compact: bool) -> list[Accepted]:
        """Per sampling request: accepted path and tokens; sampled chains in one batch; trees' accepted
        target KV moved up behind the root (``compact``). Greedy and seeded requests follow the target's
        picks (what plain sampling takes at each row); the others are verified by rejection sampling."""
        results: list[Accepted | None] = []
        chains: list[tuple[int, list[int]]] = []  # sampled chains (index, rows): accepted in one batch
        off = 0
        for i, s in enumerate(sampling):
            k, p = len(s.draft_token_ids), s.req.params
            span = list(range(off, off + k + 1))
            off += k + 1
            if p.greedy or p.seeded:
                tree = s.tree.truncated(k) if s.tree is not None else DraftTree.chain(0, s.draft_token_ids)
                results.append(accept_greedy(tree, picks[span[0] : span[-1] + 1]))
            elif s.tree is not None:
                probs = sampler.processed_probs(logits[span], sb.select(span))
                results.append(accept_tree_sampled(s.tree.truncated(k), probs, self.runner.generator))
            else:
                results.append(None)
                chains.append((i, span))
        if chains:
            rows = [j for _, span in chains for j in span]
            got = accept_chains_sampled(sampler.processed_probs(logits[rows], sb.select(rows)),
                                        [sampling[i].draft_token_ids for i, _ in chains],
                                        [sampling[i].req.spec.draft_probs if len(span) > 1 else None
                                         for i, span in chains], self.runner.generator)
            for (i, _), res in zip(chains, got):
                results[i] = res
        if compact:
            self._compact([(s, res.path) for s, res in zip(sampling, results) if s.tree is not None])
        return results  # type: ignore[return-value]

    def _compact(self, trees: list[tuple[Any, list[int]]]) -> None:
        """Accepted tree nodes' target KV to the slots right after each root (ModelRunner.compact_tree_kv)."""
        trees = [(s, p) for s, p in trees if any(node != m + 1 for m, node in enumerate(p))]
        if not trees:
            return
        D = max(len(p) for _, p in trees)
        W = max(len(s.req.kv.block_table) for s, _ in trees)
        flat = [len(p) for _, p in trees] + [s.req.num_computed_tokens for s, _ in trees]
        for s, p in trees:
            flat += [0] + p + [0] * (D - len(p))
        for s, _ in trees:
            flat += s.req.kv.block_table + [0] * (W - len(s.req.kv.block_table))
        B = len(trees)
        t = host_to_device(flat, self.device)
        path = t[2 * B : 2 * B + B * (D + 1)].view(B, D + 1)
        tables = t[2 * B + B * (D + 1) :].view(B, W)
        wt = None
        if len(self.runner.pool_caches) > 1:  # the sliding-window layers' pool: the same moves, its tables
            wt = [t + [0] * (W - len(t)) for t in (s.req.kv.window_table for s, _ in trees)]
            wt = host_to_device([b for t in wt for b in t], self.device).view(B, W)
        self.runner.compact_tree_kv(tables, t[B : 2 * B], t[:B], path, torch.ones_like(t[:B]), wt)

    def _logprobs(self, sampling, results: list[Accepted], kept_rows: list[list[int]], logits) -> list | None:
        if not any(s.req.params.logprobs is not None for s in sampling):
            return None
        lps, off = [], 0
        for s, res, kept in zip(sampling, results, kept_rows):
            n = len(s.draft_token_ids) + 1
            lp = s.req.params.logprobs
            lps.append(None if lp is None else sampler.top_logprobs(
                logits[off : off + n][kept], torch.tensor(res.tokens, device=self.device), lp))
            off += n
        return lps

    def _record(self, plan: StepPlan, sampling, accepted: list[int], seconds: float, own_time: bool = True) -> None:
        stats = self.engine.stats
        depths = [self._depth(s) for s in sampling]
        verified = [(d, a) for s, d, a in zip(sampling, depths, accepted) if s.draft_token_ids]
        K = self.cfg.num_steps
        if len(stats.spec_drafted_per_position) < K:
            stats.spec_drafted_per_position = [0] * K
            stats.spec_accepted_per_position = [0] * K
        if verified:
            stats.spec_steps += 1
            stats.spec_verify_steps += len(verified)
            stats.spec_draft_tokens += sum(len(s.draft_token_ids) for s in sampling)
            stats.spec_accepted_tokens += sum(a for _, a in verified)
            for per_pos, got in ((stats.spec_drafted_per_position, reached([d for d, _ in verified], K)),
                                 (stats.spec_accepted_per_position, reached([min(d, a) for d, a in verified], K))):
                for pos, n in enumerate(got):
                    per_pos[pos] += n
        if verified or self.controller.cycle_open:  # else nothing per request to learn
            self.controller.observe_many([s.req.request_id for s in sampling], depths, accepted,
                                         [s.tree is not None for s in sampling])
        prefill = sum(s.num_new_tokens - s.samples for s in plan.scheduled)
        self.controller.observe_step(plan.num_tokens, len(plan.scheduled), seconds, prefill, len(sampling), own_time)
        profile.check_stale(self.controller.cost, stats.steps, self.cost_profile_path)

    @staticmethod
    def _depth(s) -> int:
        """Draft positions a verify could accept: chain length, or a tree's depth."""
        return max(s.tree.depths[: len(s.draft_token_ids) + 1]) if s.tree is not None else len(s.draft_token_ids)

    # -- draft ----------------------------------------------------------------------------------------
    def draft_step(self, plan: StepPlan, result: CommitResult) -> None:
        """Decide k per request for the next step, then catch up and draft."""
        now = clock()
        prev, prev_s = self.cycle.close(now)
        if self._launched_ahead and not self.cycle.drafted_last:  # plain again, decided before the sync
            self._plain_decision(plan.num_running_on, prev, prev_s, now)  # (its requests: no list, a count)
            return
        # requests that produced a token this step and decode next step
        candidates = [r for s in plan.scheduled if s.samples and (r := s.req).status is not Status.FINISHED
                      and len(r.all_token_ids) - r.num_computed_tokens == 1]
        ks = self._decide(candidates, self._launched_ahead) if candidates else None
        if ks is None:  # plain decoding again: nothing per request
            if prev is not None:
                prev_s += self.cycle.unpaid_catch_up(candidates)
            self._plain_decision(len(candidates), prev, prev_s, now)
            return
        self._draft(candidates, ks, prev, prev_s, now)

    @torch.inference_mode()
    def _draft(self, candidates: list[Request], ks: list[int], prev, prev_s: float, now: float) -> None:
        """Catch up and draft ``ks`` tokens per candidate (where its KV has room); the last cycle ended."""
        ctl = self.controller
        sched = self.engine.scheduler
        todo = [(r, k) for r, k in zip(candidates, ks) if k > 0 and sched.reserve(r, r.num_tokens + k)]
        rest = self.pipeline.adopt_fused(todo, ctl.tree_drafts)  # drafted before the verify's sync: bookkeeping only
        ctl.note_launched_early(len(todo) - len(rest))
        shift = self.cycle.draft(rest, self.catch_up, self.proposer.propose, ctl.tree_drafts) if rest else 0.0
        if not todo:
            if prev is not None:
                prev_s += self.cycle.unpaid_catch_up(candidates)
            self._charge_plain_switch()
        ctl.finish_cycle(prev, prev_s + shift)
        self.cycle.drafted_last = bool(todo)
        self.cycle.open(now, shift)

    def _plain_decision(self, batch: int, prev, prev_s: float, now: float) -> None:
        """The next step is plain for ``batch`` requests (none: nothing decided): counted, the last cycle ended."""
        ctl = self.controller
        if batch:
            ctl.count_off(batch)
            self._charge_plain_switch()
        ctl.finish_cycle(prev, prev_s)
        if batch:
            self.cycle.drafted_last = False
            self.cycle.open(now)

    def _charge_plain_switch(self) -> None:
        """A cycle that drafts nothing after one that drafted: with overlap scheduling its step goes to the
        device after the verify's sync, the next ones ahead of their predecessors'; a switch's cost, charged."""
        if self.cycle.drafted_last and self.engine.overlap:
            self.controller.skip_cycle()

    def _decide(self, candidates: list[Request], launched_ahead: bool) -> list[int] | None:
        """k per candidate, None for plain decoding: the arm taken before the sync (pipeline) for a batch of
        the same bucket (the candidates: its requests less those that finished), else the policy's
        ``decide(Batch)``."""
        ctl = self.controller
        pre = self.pipeline.take_pre_arm()
        arm = 0 if launched_ahead else None
        if arm is None and ctl.forced_arm is None and pre is not None:
            if batch_key(pre[0]) == batch_key(len(candidates)):
                arm = pre[1]
            else:
                self.path_counts["decide:again"] += 1
        if arm == 0:
            return None
        tree, cap = ctl.tree_caps, self.caps.cap
        caps = [cap(r, tree=tree) for r in candidates]
        if arm is not None:
            return ctl.uniform(candidates, arm, caps)
        return ctl.decide(Batch(candidates, caps, len(self.engine.scheduler.running)))
