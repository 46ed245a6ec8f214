"""Continuous batching: who runs this step and with how many tokens; committing the results.

Each step is one flat batch under a token budget. Running requests come first (a decode is 1
token, or 1 + k when k drafted tokens are verified; a request still prefilling gets a chunk),
then waiting requests are admitted with a prefix-cache lookup and a (possibly chunked) prefill.
When KV blocks run out, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later from its tokens (prefix cache permitting). With sliding-window
layers (``window``) a request holds blocks in both pools, and those of the window pool that fell
out of its window are freed whenever it is scheduled.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.kv_cache import BlockManager, KVSlots, WindowBlocks
from specserve.engine.request import PENDING_TOKEN, Request, Status
from specserve.engine.stop import check_stop


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # known tokens computed this step, from req.num_computed_tokens on
    draft_token_ids: list[int] = field(default_factory=list)  # verified after them
    tree: object | None = None  # spec.tree.DraftTree when verifying a tree
    # True when this step reaches the end of the request's known tokens (so it samples);
    # fixed at scheduling time, before commit moves num_computed_tokens
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.req.num_computed_tokens + self.num_new_tokens == self.req.num_tokens

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    # Scheduler.advance ran: computed counts moved and sampled tokens are placeholders until commit
    advanced: bool = False
    # requests this step took from the waiting queue (new to the engine, or back after a preemption)
    admitted: list[Request] = field(default_factory=list)
    # scheduled requests that sample, and running requests the token budget left out (counted by
    # ``schedule``, which builds every plan)
    num_sampling: int = 0
    num_left_out: int = 0
    num_drafts: int = 0  # draft tokens it verifies (0: a plain step)
    num_tokens: int = 0  # query tokens: sum(s.num_query_tokens for s in scheduled)
    num_running_on: int = 0  # (``commit``) sampling requests still running after it: one token each to compute

    @property
    def all_finished(self) -> bool:
        """Every request in it ended or was aborted (a step launched ahead then has nothing to read)."""
        return all(s.req.is_finished for s in self.scheduled)

    @property
    def num_decode_requests(self) -> int:
        return sum(1 for s in self.scheduled if s.samples and s.num_new_tokens == 1)


@dataclass
class CommitResult:
    """Per scheduled request that sampled: the tokens to append (accepted drafts + one sampled)."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None] | None = None
    num_accepted_drafts: list[int] | None = None


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int], window: WindowBlocks | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.window = window  # the sliding-window layers' pool (None: every layer is in block_manager's)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # output tokens committed, over the engine's life

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_tokens_next_step(self) -> int:
        """Prompt tokens the next step will also carry: running prefills and waiting requests for free seats."""
        n = sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)
        seats = max(self.config.max_num_seqs - len(self.running), 0)
        n += sum(r.num_tokens for r in itertools.islice(self.waiting, seats))
        return min(n, max(self.config.max_num_batched_tokens - len(self.running), 0))

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and release its KV blocks at once (used for stops and aborts)."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.metrics.finished_time = time.time()
        self._release(req)
        req.kv = KVSlots()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # -- scheduling ----------------------------------------------------------------------------
    def _ends_by_length(self, req: Request) -> bool:
        """Whether the request stops at its pending token whatever it is (max_tokens, context)."""
        p = req.params
        return ((p.max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= p.max_tokens)
                or req.num_tokens >= self.max_model_len)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Grow req's block tables to hold ``num_tokens`` tokens; False if blocks ran out. Frees its
        window blocks that no token from ``num_computed_tokens`` on can see (a forward still in flight
        may read them: only forwards launched after it write them again)."""
        win = self.window
        if win is not None:
            win.drop(req.kv, req.num_computed_tokens)
        need = self.blocks.blocks_needed(num_tokens) - len(req.kv.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free_blocks or (win is not None and need > win.pool.num_free_blocks):
            return False
        req.kv.block_table.extend(self.blocks.allocate(need))
        if win is not None:
            win.grow(req.kv, need)
        return True

    def _cache(self, req: Request) -> None:
        """Make req's full blocks of computed tokens findable (both pools)."""
        self.blocks.cache_blocks(req.kv.block_table, req.kv.block_hashes, req.all_token_ids, req.num_computed_tokens)
        if self.window is not None:
            self.window.cache(req.kv)

    def _release(self, req: Request) -> None:
        """Free req's blocks; its committed full blocks stay in the prefix cache until evicted."""
        self._cache(req)
        self.blocks.free(req.kv.block_table)
        if self.window is not None:
            self.window.release(req.kv)
        req.kv = KVSlots()
        req.kv_hold_tokens = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.draft_tree = None
        req.status = Status.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        admitted: list[Request] = []
        num_sampling = num_drafts = 0

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and self._ends_by_length(req):
                i += 1  # its pending token is its last: nothing left to compute
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n_new = min(remaining, budget)
            drafts = req.draft_token_ids[: max(0, budget - n_new)] if n_new == remaining else []
            while not self.reserve(req, req.num_computed_tokens + n_new + len(drafts)):
                if drafts:  # give up speculation before preempting anyone
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break
            if len(drafts) < len(req.draft_token_ids):
                req.draft_token_ids = drafts  # a tree's nodes are in depth order: any prefix is a tree
            tree = req.draft_tree if drafts else None
            scheduled.append(ScheduledRequest(req, n_new, list(drafts), tree))
            num_sampling += n_new == remaining
            num_drafts += len(drafts)
            budget -= n_new + len(drafts)
            i += 1

        num_left_out = len(self.running) - i
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if not req.kv.block_table:
                cached_ids, hashes = self.blocks.match_prefix(req.all_token_ids)
                window_ids: list[int] = []
                if self.window is not None:  # a hit also needs the window blocks before its end
                    n, window_ids = self.window.match(hashes)
                    self.blocks.stats.prefix_hits -= (len(cached_ids) - n) * self.blocks.block_size
                    cached_ids, hashes = cached_ids[:n], hashes[:n]
                    self.window.pool.take_cached([b for b in window_ids if b != self.window.null])
                req.draft_kv_tokens = None
                if self.blocks.lacks_draft_kv(cached_ids):  # the head catches up over them (features kept)
                    req.draft_kv_tokens = self.blocks.draft_ready_prefix(cached_ids) * self.blocks.block_size
                self.blocks.take_cached(cached_ids)
                req.kv = KVSlots(list(cached_ids), list(hashes), window_ids, len(hashes))
                req.num_computed_tokens = len(cached_ids) * self.blocks.block_size
                if req.metrics.first_scheduled_time is None:
                    req.metrics.num_cached_tokens = req.num_computed_tokens
            n_new = req.num_tokens - req.num_computed_tokens
            if n_new > budget:
                if not self.config.enable_chunked_prefill and scheduled:
                    break
                n_new = budget
            if not self.reserve(req, req.num_computed_tokens + n_new):
                # what it took from the prefix cache goes back (still cached): a waiting request holds no
                # blocks, or requests that could not be admitted could pin the cache between them
                self.blocks.free(req.kv.block_table)
                if self.window is not None:
                    self.window.release(req.kv)
                req.kv = KVSlots()
                req.num_computed_tokens = 0
                if not self.running:
                    raise RuntimeError("KV cache too small for a single request; lower max_model_len")
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            self.running.append(req)
            admitted.append(req)
            scheduled.append(s := ScheduledRequest(req, n_new))
            num_sampling += s.samples
            budget -= n_new
        return StepPlan(scheduled, preempted, admitted=admitted, num_sampling=num_sampling,
                        num_left_out=num_left_out, num_drafts=num_drafts,
                        num_tokens=self.config.max_num_batched_tokens - budget)

    # -- commit -------------------------------------------------------------------------------
    def advance(self, plan: StepPlan) -> None:
        """Overlap scheduling: before ``plan``'s tokens are read back, move its requests past the tokens
        it computes and give each sampling request a placeholder (PENDING_TOKEN) for the token it
        samples, so that ``schedule`` can plan the next step, whose forward reads that token on the
        device. ``commit`` then puts the real tokens in. Plain steps only (no drafts)."""
        for s in plan.scheduled:
            req = s.req
            if req.is_finished:  # aborted after the step was launched
                continue
            if s.draft_token_ids:
                raise ValueError("a step that verifies drafts cannot be scheduled past")
            req.num_computed_tokens += s.num_new_tokens
            if s.samples:
                req.all_token_ids.append(PENDING_TOKEN)
        plan.advanced = True

    def commit(self, plan: StepPlan, result: CommitResult, detokenize) -> list[Request]:
        """Advance computed counts (unless ``advance`` did), append sampled/accepted tokens, apply stops.
        Returns touched requests."""
        touched: list[Request] = []
        now = time.time()
        j = running_on = 0
        for s in plan.scheduled:
            req = s.req
            if req.is_finished:  # ended (stop, abort) after this step was launched ahead: its token is dropped
                j += s.samples
                continue
            if not plan.advanced:
                req.num_computed_tokens += s.num_new_tokens
            if not s.samples:
                continue
            if plan.advanced:
                if not req.num_pending_tokens:
                    raise RuntimeError(f"request {req.request_id} has no pending token to commit")
                req.all_token_ids.pop()
            tokens = result.token_ids[j]
            lps = result.logprobs[j] if result.logprobs is not None else None
            n_acc = result.num_accepted_drafts[j] if result.num_accepted_drafts is not None else 0
            j += 1
            # accepted drafts' KV is valid (tree KV was compacted by the runner); the last token's is not
            req.num_computed_tokens += n_acc
            if s.draft_token_ids:
                m = req.metrics
                m.spec_verify_steps += 1
                m.spec_draft_tokens += len(s.draft_token_ids)
                m.spec_accepted_tokens += n_acc
            req.draft_token_ids = []
            req.draft_tree = None
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            for t_i, tok in enumerate(tokens):
                req.append_token(tok)
                self.num_generated_tokens += 1
                if lps is not None and req.logprobs is not None:
                    req.logprobs.append(lps[t_i])
                text_start = len(req.text)
                detokenize(req)
                stop = check_stop(req, self.eos_token_ids, self.max_model_len, text_start)
                if stop is not None:
                    # KV of tokens after the stop is irrelevant: the request is freed below
                    self.finish(req, *stop)
                    break
            req.metrics.num_generation_tokens = req.num_output_tokens
            touched.append(req)
            if not req.is_finished:
                running_on += req.status is Status.RUNNING  # (not preempted by the step scheduled past this one)
                self._cache(req)
                if plan.advanced:  # no drafts; blocks past its tokens are the next step's, launched already
                    continue
                # release blocks reserved for drafts that were rejected
                keep = self.blocks.blocks_needed(max(req.num_computed_tokens, req.kv_hold_tokens))
                if len(req.kv.block_table) > keep:
                    extra = req.kv.block_table[keep:]
                    del req.kv.block_table[keep:]
                    self.blocks.free(extra)
                    if self.window is not None:
                        self.window.trim(req.kv, keep)
        for s in plan.scheduled:  # prefill chunks: their full blocks become shareable at once
            if not s.samples and not s.req.is_finished:
                self._cache(s.req)
        plan.num_running_on = running_on
        return touched
