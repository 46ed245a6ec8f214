"""Launch-ahead of drafting steps: the next drafts before a verify's sync, the next verify before its commit
(docs/architecture.md, "The next drafts before the verify's sync"); device drafts into a verify's inputs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from specserve.engine.host_copy import ReadBack, host_to_device
from specserve.engine.request import Request
from specserve.engine.runner import StepLists
from specserve.engine.scheduler import StepPlan
from specserve.engine.stop import may_stop
from specserve.speculative.accept import Accepted, accept_chains_on_device
from specserve.speculative.catch_up import CatchUp, catch_up_slots
from specserve.speculative.propose import Proposer, pend
from specserve.speculative.state import PENDING, Caps, EarlyVerify, catch_up_end
from specserve.speculative.tree import DraftTree

Target = tuple[Request, int, int]  # (request, drafts verified now, drafts next)


class Pipeline:
    def __init__(self, engine, controller, caps: Caps, catch_up: CatchUp, proposer: Proposer, policy: str,
                 path_counts: Counter) -> None:
        self.sched, self.runner, self.target = engine.scheduler, engine.runner, engine.runner.model
        self.block_size = engine.config.block_size
        self.max_tokens = engine.config.max_num_batched_tokens
        self.device = engine.device
        self.controller, self.caps, self.catch_up, self.proposer = controller, caps, catch_up, proposer
        self.policy, self.path_counts = policy, path_counts
        self.topk, self.max_k = proposer.topk, caps.max_k
        self.fused_launch: Any = None  # FusedLaunchRunner / FusedTreeLaunch / TreeVerifyGraph, where built
        self.tree_launch: Any = None
        self.tree_verify: Any = None
        self.fused: dict[str, tuple[int, int]] | None = None  # drafts launched early: request -> (row, k)
        self.fused_toks: torch.Tensor | None = None
        self.pre_arm: tuple[int, int] | None = None  # (batch, depth): a quick decision taken early
        self.early: EarlyVerify | None = None  # the next step's verify, launched already
        self.presync: tuple[list[Target], list[list[int]], EarlyVerify] | None = None
        self.read_back_around = ReadBack(self.device)  # the verify's picks, the next drafts launched meanwhile
        # the next verify before the commit (a GPU's default), a tree's before the sync (tests and
        # benchmarks/gpu_spec_c1.py turn them off to compare and measure)
        self.early_verify = self.device.type == "cuda"
        self.presync_verify = True

    def reset(self) -> None:
        """A new step: what the last one decided early is spent."""
        self.fused = self.pre_arm = None

    # -- decisions known before a sync ----------------------------------------------------------------
    def take_pre_arm(self) -> tuple[int, int] | None:
        """(batch, depth) of the quick decision taken before this step's sync, once (None: none)."""
        pre, self.pre_arm = self.pre_arm, None
        return pre

    def plain_next(self, plan: StepPlan) -> bool:
        """Whether the step after plain step ``plan`` is known, before its sync, to be plain for everyone
        (then the engine launches it ahead); a decision taken here is left for draft_step."""
        sched, ctl = self.sched, self.controller
        if plan.num_left_out and any(r.draft_token_ids for r in sched.running):
            return False  # drafts left on a request the budget did not schedule
        found = plan.num_sampling
        if not found:
            return True
        arm = ctl.forced_arm
        if arm is None:
            arm = ctl.quick_arm(found, len(sched.running))
            if arm is None:  # static, or threshold while on: drafting
                return False
            self.pre_arm = (found, arm)  # counted: draft_step applies it
        return arm == 0

    def _early_ks(self, found: list[tuple[Request, int]]) -> tuple[list[int], bool]:
        """Each request's next k where known before this verify's outcome (static policy, forced or
        adaptive decisions), capped after the most it commits, and whether they are trees; []."""
        ctl, caps = self.controller, self.caps
        if self.policy == "static":
            return [caps.after_verify(r, k, self.max_k) for r, k in found], self.topk > 1
        if self.policy != "adaptive":
            return [], False
        arm = ctl.forced_arm
        if arm is None:
            arm = ctl.quick_arm(len(found), len(self.sched.running))  # (adaptive: a table lookup)
            self.pre_arm = (len(found), arm)
        drafts, tree = ctl.drafts(arm)
        return [caps.after_verify(r, k, drafts, tree) for r, k in found], tree

    def fused_targets(self, plan: StepPlan) -> list[Target] | None:
        """(request, drafts verified, next k) of a step that only verifies greedy drafts with current
        draft KV, when every next k is known in advance; None otherwise."""
        tree = self.topk > 1
        if self.proposer.chain_runner is None:
            return None
        why = self.path_counts
        if tree and (self.tree_launch is None or len(plan.scheduled) > self.tree_launch.batch_sizes[-1]):
            why["unfused:batch"] += 1
            return None
        found, snapshot = [], None
        for s in plan.scheduled:
            r, k = s.req, len(s.draft_token_ids)
            if not (k and s.samples and s.num_new_tokens == 1 and (s.tree is not None) == tree and r.params.greedy
                    and r.params.logprobs is None):
                why["unfused:step"] += 1
                return None
            st = r.spec
            if st is None or st.draft_pos != r.num_computed_tokens:
                why["unfused:draft_kv"] += 1
                return None
            if tree:  # whole trees selected on the device, by one launch
                if k != self.max_k or st.device_tree is None or (snapshot is not None and st.device_tree[0] is not snapshot):
                    why["unfused:tree"] += 1
                    return None
                snapshot = st.device_tree[0]
            found.append((r, k))
        ks, next_tree = self._early_ks(found)
        if not ks or not any(ks) or next_tree != tree or (tree and not all(k == self.max_k for k in ks)):
            why["unfused:decision" if not ks else "unfused:k"] += 1
            return None
        out = [(r, k, kk) for (r, k), kk in zip(found, ks)]
        # every slot the catch-up, the drafts and the next verify can write
        if not all(self.sched.reserve(r, r.num_tokens + self.caps.most_committed(k) + kk) for r, k, kk in out):
            why["unfused:reserve"] += 1
            return None
        return out

    # -- the next drafts, before the verify's sync ----------------------------------------------------------
    def launch_fused(self, targets: list[Target], inputs, argmax: torch.Tensor, feats: torch.Tensor) -> None:
        """Catch-up over each request's verified rows and its next chain (or tree), from the verify's
        picks ``argmax`` (one per row) on the device; draft_step adopts the drafts."""
        reqs = [r for r, _, _ in targets]
        k_list = [k for _, k, _ in targets]
        nk = [kk for _, _, kk in targets]
        B, K, T = len(reqs), max(k_list), sum(k_list) + len(reqs)
        assert argmax.shape[0] == T == inputs.input_ids.shape[0], "a fused step verifies drafts only"
        if self.topk > 1:
            self._launch_fused_trees(reqs, argmax, feats[:T])
            return
        chain = self.proposer.chain_runner
        fl = self.fused_launch
        key = fl.key(T, B, K, max(nk)) if fl is not None else None
        if key is not None:  # what follows, as one graph
            fl.write(key, [r.num_computed_tokens for r in reqs], k_list, nk, [r.kv.block_table for r in reqs])
            path = fl.run(key, inputs.input_ids, argmax, feats[:T])
            self.path_counts[f"fused_launch:{path}"] += 1
            self.path_counts[f"catch_up:{path}"] += 1
            self._adopt_launched(reqs, nk, chain.tokens[:B, : max(nk)], path)
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
        positions, slots = catch_up_slots(reqs, nc.tolist(), q_lens.tolist(), self.block_size)
        tables = [r.kv.block_table for r in reqs]
        seq_lens = (nc + q_lens).tolist()
        buf = host_to_device(np.concatenate([nxt, j_row, req, drow.ravel(), valid.ravel(), first, nc + 1]),
                             self.device)
        o = np.cumsum([0, T, T, T, B * K, B * K, B, B])
        nxt_d, j_d, req_d, drow_d, valid_d, first_d, base_d = (buf[o[i] : o[i + 1]] for i in range(7))
        accepted, ids = accept_chains_on_device(inputs.input_ids, argmax, nxt_d, j_d, req_d, drow_d, valid_d, first_d)
        last = first_d + accepted
        cu, f = self.catch_up.runner, feats[:T]
        if cu is not None and T <= cu.max_tokens:
            path = cu.run(j_row, positions, slots, q_lens.tolist(), seq_lens, tables, f,  # (j_row: unused ids)
                          device_ids=ids, device_last=last)
            self.path_counts[f"catch_up:{path}"] += 1
        else:
            h = self.catch_up.run_head(reqs, q_lens.tolist(), positions, seq_lens, self.catch_up.embed(ids),
                                       self.catch_up.head.combine(f), host_to_device(slots, self.device))
            chain.h0[:B].copy_(h.index_select(0, last))
            self.path_counts["catch_up:torch"] += 1
        # the chain starts at nc + 1 + accepted, on the device (nc + 1 + k bounds it for the eager loop)
        toks, path = chain.run(seq_lens, nk, tables, device_base=base_d + accepted)
        self._adopt_launched(reqs, nk, toks, path)

    def _launch_fused_trees(self, reqs: list[Request], argmax: torch.Tensor, feats: torch.Tensor) -> None:
        tl = self.tree_launch
        key = tl.key(len(reqs))
        trees, _ = reqs[0].spec.device_tree
        tl.write(key, [r.num_computed_tokens for r in reqs], [r.kv.block_table for r in reqs],
                 [r.spec.device_tree[1] for r in reqs], [r.kv.window_table for r in reqs] if tl.window else ())
        path = tl.run(key, argmax, feats, trees)
        self.path_counts[f"fused_launch:{path}"] += 1
        self._adopt_launched(reqs, [self.max_k] * len(reqs), tl.tree.trees[: len(reqs)])

    def _adopt_launched(self, reqs: list[Request], nk: list[int], toks: torch.Tensor, chain_path: str = "") -> None:
        """The drafts launched (chains, or packed trees), for adopt_fused; ``chain_path``: the chain loop's."""
        if chain_path:
            self.path_counts[f"chain:{chain_path}"] += 1
        self.path_counts["fused"] += 1
        self.fused = {r.request_id: (i, kk) for i, (r, kk) in enumerate(zip(reqs, nk))}
        self.fused_toks = toks.clone()

    def adopt_fused(self, todo: list[tuple[Request, int]], tree: bool) -> list[tuple[Request, int]]:
        """Take the early drafts of the requests of ``todo`` (drafting trees, or chains) allowed at least as
        many, where of the same kind; returns the others."""
        fused, self.fused = self.fused, None
        if not fused or tree != (self.topk > 1):  # (a tree engine's fused launch drafts trees)
            return todo
        rest, adopted, rows = [], [], []
        for r, k in todo:
            row, kk = fused.get(r.request_id, (0, -1))
            if not 0 < kk <= k:
                rest.append((r, k))
                continue
            self.catch_up.caught_up(r, catch_up_end(r))
            adopted.append((r, kk))
            rows.append(row)
        if adopted:
            pend(adopted, self.fused_toks, rows, tree=self.topk > 1)
        return rest

    # -- the next verify, before the commit ------------------------------------------------------------
    def launch_early_verify(self, targets: list[Target], results: list[Accepted]) -> None:
        """The next step's verify from each accepted count, bonus token and drafts on the device; not where
        the next plan will differ (arrivals, requests outside the step, a stop, the budget, k = 0 next)."""
        sched = self.sched
        if not self._next_plan_known(targets):
            return
        toks = self.fused_toks
        K, lists = toks.shape[1], StepLists(self.block_size)
        src: list[int] = []  # the drafts' places in toks, and their input rows
        dst: list[int] = []
        tree_src: list[tuple[torch.Tensor, int, int, int, int, int]] = []
        plan, blocks = [], []
        for i, ((r, _, kk), res) in enumerate(zip(targets, results)):
            p = r.params
            if may_stop(r, res.tokens, sched.eos_token_ids):
                return
            if p.max_tokens is not None and r.num_output_tokens + len(res.tokens) + 1 >= p.max_tokens:
                return  # it ends in this commit, or has no draft left after it
            plan.append(self._next_verify(r, res, kk, r.kv.block_table, blocks))
            a = lists.add([res.tokens[-1]] + [0] * kk, plan[-1][1], r.kv.block_table, sample_rows=kk + 1,
                          window_table=r.kv.window_table)
            tree_src.append((toks, i, a, kk + 1, i, plan[-1][1]))
            src.extend(range(i * K, i * K + kk))
            dst.extend(range(a + 1, a + kk + 1))
        inputs = self.runner.upload(lists)
        extra = None
        if self.topk > 1:  # ids, positions and masks of the trees the fused launch selected
            inputs.meta.tree_masks = {}
            rows, extra = self._fill_trees(tree_src, inputs)
        else:
            rows = self._copy_drafts(inputs, toks, src, dst)
        out = self.runner.forward(inputs)
        logits = self.target.compute_logits(out[0] if isinstance(out, tuple) else out)
        self._keep_early(EarlyVerify(plan, blocks, [r for r, _, _ in targets], inputs, out, logits,
                                     logits.argmax(-1), rows, toks, extra))

    def _next_verify(self, r: Request, res: Accepted, kk: int, table: list[int], blocks: list) -> tuple:
        """``r``'s entry in a verify launched early (id, first position: its bonus token's, that token, drafts);
        the blocks its KV goes to appended to ``blocks``."""
        start, bs = r.num_computed_tokens + 1 + res.num_accepted, self.block_size
        blocks.append(table[start // bs : (start + kk) // bs + 1])
        return r.request_id, start, res.tokens[-1], kk

    def _keep_early(self, early: EarlyVerify) -> None:
        """Commit keeps the blocks the early verify's KV went to."""
        for r, (_, start, _, kk) in zip(early.reqs, early.plan):
            r.kv_hold_tokens = start + kk + 1
        self.early = early

    def presync_ok(self, targets: list[Target]) -> bool:
        """Whether the verify after a fused tree launch may go before the sync: what launch_early_verify
        asks short of the picks, and no request that can end by length in this commit."""
        if not (self.early_verify and self.presync_verify and self.topk > 1 and self.tree_verify is not None):
            return False
        return self._next_plan_known(targets) and all(r.params.max_tokens is None
                   or r.num_output_tokens + self.caps.most_committed(k) + 1 < r.params.max_tokens
                   for r, k, _ in targets)

    def _next_plan_known(self, targets: list[Target]) -> bool:
        """Whether the next plan verifies exactly ``targets``' next drafts: no prompt waiting, every running
        request among them, each drafting (a fused tree: all of it) within the step budget."""
        sched = self.sched
        return (not sched.waiting and len(targets) == len(sched.running) and all(kk for _, _, kk in targets)
                and sum(kk + 1 for _, _, kk in targets) <= self.max_tokens)

    def launch_presync_verify(self, targets: list[Target]) -> None:
        """The verify of the trees just selected, behind the fused launch and before the sync: inputs from
        its device buffers, the attention planned for the most it can commit and moved back by its shift."""
        tl, toks = self.tree_launch, self.fused_toks
        N, B = tl.N, len(targets)
        lists = StepLists(self.block_size)
        for r, _, _ in targets:  # (ids, positions and slots: placeholders the device overwrites)
            lists.add([0] * N, r.num_computed_tokens + tl.L, r.kv.block_table, sample_rows=N,
                      window_table=r.kv.window_table)
        inputs = self.runner.upload(lists)
        inputs.input_ids, inputs.positions = tl.next_ids[:B].view(-1), tl.next_pos[:B].view(-1)
        meta = inputs.meta
        meta.slot_mapping, meta.seq_shift = tl.next_slots[:B].view(-1), tl.next_shift[:B]
        if tl.window:
            meta.window_slot_mapping = tl.next_window_slots[:B].view(-1)
        meta.tree_masks = {b: toks[b, 3 * N : 4 * N] for b in range(B)}
        rows = host_to_device([b * N + i for b in range(B) for i in range(1, N)], self.device)
        extra = torch.cat([toks[:B, N + 1 : 2 * N], toks[:B, 2 * N + 1 : 3 * N]], 1).reshape(-1)
        self.runner.attn.plan(meta)
        path = self.tree_verify.run(B)  # picks and features into the launch's buffers
        self.path_counts[f"presync_verify:{path}"] += 1
        self.path_counts["presync_verify"] += 1
        T = B * N
        feats = tl.feats[:T]
        early = EarlyVerify([], [], [r for r, _, _ in targets], inputs, (feats, feats), self.tree_verify.logits[:T],
                            tl.picks[:T], rows, toks, extra)
        self.presync = (targets, [list(r.kv.block_table) for r, _, _ in targets], early)

    def adopt_presync_verify(self, results: list[Accepted]) -> bool:
        """After the sync: the verify launched before it is the next step's, unless a request may stop."""
        presync, self.presync = self.presync, None
        if presync is None:
            return False
        targets, tables, early = presync
        for (r, _, kk), res, table in zip(targets, results, tables):
            if may_stop(r, res.tokens, self.sched.eos_token_ids):
                self.path_counts["presync_verify:discarded"] += 1
                return True
            early.plan.append(self._next_verify(r, res, kk, table, early.blocks))
        self._keep_early(early)
        return True

    def take(self, plan: StepPlan) -> EarlyVerify | None:
        """The verify launched for ``plan`` already, if it verifies exactly what was launched."""
        early, self.early = self.early, None
        if early is None:
            return None
        for r in early.reqs:
            r.kv_hold_tokens = 0  # (the plan reserved what it verifies)
        if self._matches(early, plan):
            self.path_counts["early_verify"] += 1
            return early
        self.path_counts["early_verify:discarded"] += 1
        return None

    def _matches(self, early: EarlyVerify, plan: StepPlan) -> bool:
        """Same requests in the same order, each from the same position and token, blocks and drafts."""
        if len(plan.scheduled) != len(early.plan):
            return False
        bs = self.block_size
        for i, (s, (rid, start, first, kk), blocks) in enumerate(zip(plan.scheduled, early.plan, early.blocks)):
            r = s.req
            if (r.request_id != rid or r.num_computed_tokens != start or s.num_new_tokens != 1 or not s.samples
                    or (s.tree is not None) != (self.topk > 1) or len(s.draft_token_ids) != kk
                    or r.all_token_ids[start] != first
                    or r.kv.block_table[start // bs : (start + kk) // bs + 1] != blocks):
                return False
            st = r.spec
            dd = None if st is None else st.device_tree if self.topk > 1 else st.device_drafts
            if s.draft_token_ids[0] != PENDING or dd is None or dd[0] is not early.toks or dd[1] != i:
                return False
        return True

    # -- drafts on the device into a verify's inputs --------------------------------------------------
    def fill_drafts(self, plan: StepPlan, inputs) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
        """Write PENDING drafts into the step's input ids, device to device (trees: also positions and masks).
        Returns the requests filled (chains first), their input rows in the same order, and their trees'
        parents and depths."""
        groups: dict[int, tuple[torch.Tensor, list, list[int], list[int]]] = {}  # by drafts tensor: requests, src, dst
        trees: list = []
        spans = iter(inputs.sample_spans)
        tree_src: list[tuple[torch.Tensor, int, int, int, int, int]] = []  # (trees, row, input row, n, b, root)
        for b, s in enumerate(plan.scheduled):
            if not s.samples:
                continue
            a, n = next(spans)
            d, st = s.draft_token_ids, s.req.spec
            if not d or d[0] != PENDING:
                continue
            if st.device_tree is not None:
                trees.append(s)
                tree_src.append((*st.device_tree, a, n, b, s.req.num_computed_tokens + s.num_new_tokens - 1))
                continue
            toks, row = st.device_drafts
            K = toks.shape[1]
            _, reqs, src, dst = groups.setdefault(id(toks), (toks, [], [], []))
            reqs.append(s)
            src.extend(range(row * K, row * K + n - 1))  # (the scheduler may have cut the drafts short)
            dst.extend(range(a + 1, a + n))
        rows = [self._copy_drafts(inputs, toks, src, dst) for toks, _, src, dst in groups.values()]
        pending = [s for _, reqs, _, _ in groups.values() for s in reqs]
        extra = None
        if tree_src:  # (after the chains: a step may verify chains and trees decided apart)
            tree_rows, extra = self._fill_trees(tree_src, inputs)
            rows.append(tree_rows)
            pending += trees
        if not pending:
            return [], None, None
        return pending, rows[0] if len(rows) == 1 else torch.cat(rows), extra

    def _copy_drafts(self, inputs, toks: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
        """Chain drafts ``toks.view(-1)[src]`` into input rows ``dst``, device to device; returns those rows."""
        idx = host_to_device(dst + src, self.device)
        inputs.input_ids.index_copy_(0, idx[: len(dst)], toks.view(-1).index_select(0, idx[len(dst):]))
        return idx[: len(dst)]

    def _fill_trees(self, src: list[tuple[torch.Tensor, int, int, int, int, int]], inputs
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device trees into a step's inputs: ids, positions (root's + depth), mask rows. Returns the
        drafts' input rows and the parents and depths of nodes 1..n-1 (read back with the picks)."""
        N = self.max_k + 1
        W = src[0][0].shape[1]
        dst_ids, src_ids, dst_pos, src_pos, offs, src_extra = [], [], [], [], [], []  # type: ignore[var-annotated]
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
            inputs.meta.tree_masks[b] = flat[r0, 3 * N : 3 * N + n]
        k1, k2, k3 = len(dst_ids), 2 * len(dst_ids), 2 * len(dst_ids) + len(dst_pos)
        k4, k5 = k3 + len(dst_pos), k3 + 2 * len(dst_pos)
        idx = host_to_device(dst_ids + src_ids + dst_pos + src_pos + offs + src_extra, self.device)
        vals = flat.view(-1)
        inputs.input_ids.index_copy_(0, idx[:k1], vals.index_select(0, idx[k1:k2]))
        inputs.positions.index_copy_(0, idx[k2:k3], vals.index_select(0, idx[k3:k4]) + idx[k4:k5])
        return idx[:k1], vals.index_select(0, idx[k5:])

    @staticmethod
    def resolve_drafts(pending: list, values: list[int]) -> None:
        """The host values of the drafts fill_drafts wrote, in its order (then each tree's parents and depths)."""
        off = 0
        for s in pending:
            n = len(s.draft_token_ids)
            s.draft_token_ids = s.req.draft_token_ids = values[off : off + n]
            s.req.spec.device_drafts = None
            off += n
        for s in pending:
            if s.req.spec.device_tree is None:
                continue
            n = len(s.draft_token_ids)
            parents, depths = values[off : off + n], values[off + n : off + 2 * n]
            off += 2 * n
            s.tree = s.req.draft_tree = DraftTree([s.req.all_token_ids[-1]] + s.draft_token_ids, [-1] + parents,
                                                  [0] + depths)
            s.req.spec.device_tree = None
