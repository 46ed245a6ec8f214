"""How many tokens each request drafts next step (0 = plain decode): ``static``, ``threshold`` or ``adaptive``
(a bandit over uniform depths per batch bucket, priors.py); interface.py is its narrow interface."""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.speculative.policy.bandit import GoodputBandit, batch_key, bucket_batch, shallower_tokens
from specserve.speculative.policy.cost_model import CostModel, LinearCost
from specserve.speculative.policy.interface import Batch, StepOutcome
from specserve.speculative.policy.priors import AcceptanceStats, arm_depths, arm_priors, prefill_share

ACCEPT_DECAY = 0.999  # per request observed: the overall acceptance rates' memory


@dataclass
class Cycle:
    """One adaptive decision in flight: measured from the decision to the next one."""

    key: int
    arm: int
    draft_predicted: float  # seconds of the drafting it starts, by the reference cost model
    request_ids: set[str] | None  # whose committed tokens count; None: counted already (plain decode)
    target_predicted: float | None = None  # of the verify step that ran, once it ran (its real size)
    tokens: int = 0
    measured: bool = True  # False: a one-off switch, charged to exploration but not the arm's measure
    requests: int = 0  # in the decision
    prefill_seconds: float = 0.0  # the live cost model's share of prompt tokens in its steps (left out)
    exploring: bool = False
    launched_early: int = 0  # requests whose drafts were launched before the last verify's sync
    tokens_at: dict[int, float] | None = None  # chains: depth e < arm -> tokens it would have committed


@dataclass
class SpecController:
    cfg: SpeculativeConfig
    cost: CostModel = field(default_factory=CostModel)
    reference: CostModel | None = None  # the profile, frozen: the bandit's time ratios are against it
    bandit: GoodputBandit = field(default=None)  # type: ignore[assignment]  # (cfg.adaptive's)
    overall: AcceptanceStats = field(init=False)
    per_request: dict[str, AcceptanceStats] = field(default_factory=dict)
    spec_on: bool = True  # threshold policy state
    k_histogram: Counter = field(default_factory=Counter)
    last_prediction: tuple[float, float] | None = None  # (predicted, measured) seconds of the last target step
    explorations: int = 0
    decisions: int = 0
    switches: int = 0  # decisions where speculation went on <-> off (explorations excluded)
    k_changes: int = 0  # decisions where some request kept from the last one got another k (same exclusions)
    cycles: int = 0  # adaptive decisions whose outcome was measured
    forced_arm: int | None = None  # every request drafts min(this, its cap): the start-up calibration
    # ``defer``: cycle outcomes and cost-model updates wait in ``pending`` until ``flush`` (the caller's
    # next forward launch); no decision reads them before that
    defer: bool = False
    pending: list[Callable[[], None]] = field(default_factory=list)
    _cycle: Cycle | None = None
    _quick_key: int = 0  # bucket of the last quick_arm
    _plain_exploring: bool = False  # plain_second_cycle took the next decision: count_off's cycle explores
    _draft_predicted: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, arm) -> seconds
    _reference_steps: dict[tuple[int, int, int, int], float] = field(default_factory=dict)  # step shape -> s
    _last_ids: list[str] = field(default_factory=list)  # requests and k of the last counted decision
    _last_ks: list[int] = field(default_factory=list)
    _was_on: bool | None = None
    _decide_s: float = 0.0  # moving averages: host seconds of a full decision, seconds of a cycle
    _cycle_s: float = 0.0
    catch_up_cost: LinearCost = field(default_factory=LinearCost)  # catch-ups after plain decoding
    switch_seconds: dict[int, float] = field(default_factory=dict)  # bucket -> predicted catch-up, last full decision
    _next: Cycle | None = None  # an early decision's cycle: current once ``observe`` ends the one in flight
    clock: Callable[[], float] = time.perf_counter  # times ``decide(Batch)``'s full decisions (host seconds) ...
    decide_seconds: float = 0.0  # ... the last one's (0: the last decide(Batch) was quick)

    # launch-path switches the pipeline reads (not policy): the next verify launched before the commit
    # (the drafter sets it on a GPU), a tree's before the sync, the fused launch as one graph
    early_verify = False
    presync_verify = True
    fused_launch_graph = True

    def __post_init__(self) -> None:
        self.policy = self.cfg.adaptive  # the adaptive policy's tunables
        if self.bandit is None:
            self.bandit = GoodputBandit(self.policy)
        self.overall = AcceptanceStats.zeros(self.cfg.num_steps)

    # -- observations ------------------------------------------------------------------------
    def observe_many(self, request_ids: list[str], ks: list[int], accepted: list[int]) -> None:
        """Requests ``request_ids`` verified ``ks`` drafts and accepted ``accepted`` (the overall rates decay
        by ACCEPT_DECAY a request)."""
        c = self._cycle
        if c is not None and c.request_ids is not None:
            mine = [a for rid, a in zip(request_ids, accepted) if rid in c.request_ids]
            c.tokens += sum(mine) + len(mine)
            if c.arm > 1 and self.cfg.is_chain and mine:
                at = c.tokens_at if c.tokens_at is not None else {}
                for e, t in shallower_tokens(mine, c.arm).items():
                    at[e] = at.get(e, 0.0) + t
                c.tokens_at = at
        ov = self.overall
        K = len(ov.drafted)
        dr, ac = [0.0] * K, [0.0] * K
        n = 0
        for rid, k, a in zip(request_ids, ks, accepted):
            if k == 0:
                continue
            n += 1
            for j in range(min(k, a + 1)):
                dr[j] += 1
            for j in range(a):
                ac[j] += 1
            st = self.per_request.get(rid)
            if st is None:
                st = self.per_request[rid] = AcceptanceStats.zeros(self.cfg.num_steps)
            st.observe(k, a)
        if n:
            f = ACCEPT_DECAY**n
            ov.drafted = [x * f + d for x, d in zip(ov.drafted, dr)]
            ov.accepted = [x * f + d for x, d in zip(ov.accepted, ac)]

    @property
    def cycle_open(self) -> bool:
        """A cycle whose requests' accepted counts are still to be observed."""
        return self._cycle is not None and self._cycle.request_ids is not None

    def quick_arm(self, batch: int, num_running: int | None = None) -> int | None:
        """The depth this batch's bucket exploits, applied without weighing the arms (None: weigh them,
        ``decide``); the threshold policy: 0 while off (``num_running`` running requests), else None."""
        self._plain_exploring = False  # (one plain_second_cycle took and the caller did not apply: lost)
        if self.cfg.policy == "threshold" and num_running is not None:
            return 0 if not self._threshold_on(num_running) else None
        if self.cfg.policy != "adaptive" or self.policy.full_every <= 1:
            return None
        b = self.bandit
        key = batch_key(batch)
        if b.full_decision_due(key, self.full_decision_every()):
            return None
        b.visits[key] = b.visits.get(key, 0) + 1
        self._quick_key = key
        return b.chosen[key]

    def note_launched_early(self, n: int) -> None:
        """``n`` requests of the cycle just decided took drafts launched before the sync (observability)."""
        if self._cycle is not None:
            self._cycle.launched_early = n

    def full_early(self, batch: int) -> bool:
        """Whether the next full decision for ``batch`` requests may be taken before the verify's sync:
        it is sure not to explore, or it is an exploration's second cycle (its depth known)."""
        if self.cfg.policy != "adaptive":
            return False
        key = batch_key(batch)
        return self.bandit.cannot_explore(key) or self.bandit.second_cycle_due(key)

    def plain_full_early(self, batch: int) -> bool:
        """Whether the full decision due after a plain step may be taken before that step's sync (it is
        sure not to explore), so that plain decoding again can be launched ahead."""
        return self.cfg.policy == "adaptive" and self.bandit.cannot_explore(batch_key(batch))

    def full_decision_every(self) -> int:
        """``full_every``, or more apart (at most 64, a power of two: on the bandit's exploration turns)
        where a full decision costs more than ``decide_budget`` of the time between them."""
        p = self.policy
        if self._decide_s <= 0 or self._cycle_s <= 0:
            return p.full_every
        need = math.ceil(self._decide_s / (p.decide_budget * self._cycle_s))
        return 1 << (max(p.full_every, min(need, 64)) - 1).bit_length()

    def observe_decide(self, seconds: float) -> None:
        """Host seconds the full decision just taken took; an exploration's is charged to its bucket's budget."""
        self._decide_s = seconds if self._decide_s <= 0 else 0.9 * self._decide_s + 0.1 * seconds
        c = self._cycle
        if c is not None and c.exploring:
            self._later(self.bandit.charge_overhead, c.key, seconds)

    def plain_second_cycle(self, batch: int) -> bool:
        """Take the next decision now where it is plain decoding's second exploration cycle (launched ahead
        like the pick's; its first is then charged, not measured). True: taken, ``count_off`` applies it."""
        if self.cfg.policy != "adaptive":
            return False
        key = batch_key(batch)
        if not self.bandit.take_plain_second_cycle(key):
            return False
        c = self._cycle
        if c is not None and c.exploring and c.arm == 0 and c.key == key:
            c.measured = False
        self._quick_key = key
        self._plain_exploring = True
        self.explorations += 1
        return True

    def count_off(self, batch: int) -> None:
        """A quick decision of k = 0 for the whole batch (adaptive: still measured, one token a request),
        or the plain exploration cycle ``plain_second_cycle`` took."""
        exploring, self._plain_exploring = self._plain_exploring, False
        if self.cfg.policy == "adaptive":
            self._cycle = Cycle(self._quick_key, 0, 0.0, None, tokens=batch, requests=batch, exploring=exploring)
        self.decisions += 1
        self.k_histogram[0] += batch
        if exploring:  # (explorations are no switches)
            return
        if self._was_on:
            self.switches += 1
        self._was_on = False

    def uniform(self, requests: list, arm: int, caps: list[int]) -> list[int]:
        """Every request drafts min(arm, its cap) (a tree: all of it, or none), counted as a decision."""
        if arm and not self.cfg.is_chain:
            ks = [self.cfg.resolved_num_draft_tokens - 1 if c > 0 else 0 for c in caps]
        else:
            ks = [min(arm, c) for c in caps]
        key = self._quick_key
        self._cycle = Cycle(key, arm, self._draft_predicted.get((key, arm), 0.0),
                            {r.request_id for r in requests}, requests=len(requests))
        self._count(requests, ks, False)
        return ks

    def skip_cycle(self) -> None:
        """The current cycle is not typical of its arm (it caught the draft KV up over a stretch of
        plain decoding, a one-off cost of switching): leave it out of the arm's measurement."""
        if self._cycle is not None:
            self._cycle.measured = False

    def detach_cycle(self) -> Cycle | None:
        """The cycle in flight, taken out so that a new decision can start before it is ended."""
        c, self._cycle = self._cycle, None
        return c

    def _later(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` now, or at the next ``flush`` when deferring."""
        if self.defer:
            self.pending.append(functools.partial(fn, *args))
        else:
            fn(*args)

    def flush(self) -> None:
        """Run the bookkeeping ``defer`` held back, in the order it came."""
        todo, self.pending = self.pending, []
        for fn in todo:
            fn()

    def finish_cycle(self, c: Cycle | None, seconds: float) -> None:
        """The wall time of a detached cycle (None: nothing to measure)."""
        if c is None or c.tokens <= 0:
            return
        self._later(self._finish_cycle, c, seconds)

    def _finish_cycle(self, c: Cycle, seconds: float) -> None:
        self._cycle_s = seconds if self._cycle_s <= 0 else 0.9 * self._cycle_s + 0.1 * seconds
        measured = c.measured and c.prefill_seconds <= self.policy.prefill_share_limit * seconds
        seconds = max(seconds - c.prefill_seconds, 0.2 * seconds)
        if not measured:
            self.bandit.charge(c.key, c.arm, c.tokens, seconds)
        elif c.target_predicted is not None:
            self.bandit.observe(c.key, c.arm, c.target_predicted + c.draft_predicted, c.tokens, seconds,
                                c.requests, c.tokens_at)
            self.cycles += 1

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float, prefill_tokens: int = 0,
                     decode_rows: int = 0, own_time: bool = True) -> None:
        """A target step of ``num_tokens`` (``prefill_tokens`` of them prompt, ``decode_rows`` sampling,
        the rest drafts) took ``seconds``; ``own_time`` False: with device work queued before it."""
        # the cycle in flight now, whenever this runs
        self._later(self._observe_step, self._cycle, num_tokens, num_seqs, seconds, prefill_tokens, decode_rows,
                    own_time)

    def _observe_step(self, c: Cycle | None, num_tokens: int, num_seqs: int, seconds: float, prefill_tokens: int,
                      decode_rows: int, own_time: bool = True) -> None:
        if c is not None:
            if c.target_predicted is None:
                c.target_predicted = self._reference_step(num_tokens, num_seqs, decode_rows, prefill_tokens)
            c.prefill_seconds += prefill_share(self.cost, decode_rows, prefill_tokens, num_seqs)
        if not own_time:
            return
        pred = self.cost.observe_step(num_tokens, seconds, num_seqs)
        if pred is not None:
            self.last_prediction = (pred, seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        self._later(lambda: self.cost.observe_draft(batch, steps, seconds))  # self.cost as it is when this runs

    def _reference_step(self, num_tokens: int, num_seqs: int, decode_rows: int, prefill_tokens: int) -> float:
        """The reference's seconds for a target step of this shape, less its prompt share: remembered where
        the reference is the frozen profile, computed where it is the live model (which learns)."""
        ref = self._reference()
        frozen = ref is not self.cost
        key = (num_tokens, num_seqs, decode_rows, prefill_tokens)
        if frozen and key in self._reference_steps:
            return self._reference_steps[key]
        seconds = ref.step_time(num_tokens, num_seqs) - prefill_share(ref, decode_rows, prefill_tokens, num_seqs)
        if frozen:
            if len(self._reference_steps) >= 4096:  # (prompt tokens vary: shapes without bound)
                self._reference_steps.clear()
            self._reference_steps[key] = seconds
        return seconds

    def _reference(self) -> CostModel:
        if self.reference is None:
            self.reference = CostModel.from_json(self.cost.to_json()) if self.cost.target.profile else self.cost
        return self.reference

    # -- start-up calibration ----------------------------------------------------------------
    def arms(self) -> list[int]:
        """The uniform depths the adaptive policy chooses among (a tree: off or all of it)."""
        return list(range(self.cfg.num_steps + 1)) if self.cfg.is_chain else [0, self.cfg.num_steps]

    def seed(self, batch: int, arm: int, seconds: float, cycles: float = 2.0) -> None:
        """Steps of ``batch`` requests all drafting ``arm`` took ``seconds`` each (timed before serving): the
        bandit's time for that arm and bucket as ``cycles`` cycles, against the reference's prediction."""
        K = self.cfg.num_steps
        tree = None if self.cfg.is_chain else (self.cfg.resolved_num_draft_tokens - 1, self.cfg.eagle_topk)
        ks = np.full((1, batch), arm, dtype=np.int64)
        (_, predicted), = arm_priors(np.array([arm]), ks, np.zeros((batch, K)), batch, self._reference(), tree)[0]
        self.bandit.seed(batch_key(batch), arm, predicted, seconds, batch, cycles)

    # -- the narrow interface: decide(Batch) -> k per request, observe(StepOutcome) --------------
    def decide(self, batch: Batch | list, caps: list[int] | None = None, num_running: int = 0,
               prefill_tokens: int = 0, behind: int = 0, early: bool = False) -> list[int] | None:
        """k per request of ``batch`` (``early``: before the step in flight's outcome, None where it needs it);
        ``decide(requests, caps, num_running, prefill_tokens, behind)``: the arms weighed now."""
        if isinstance(batch, Batch):
            return self._decide_early(batch) if early else self._decide_now(batch)
        return self._decide_full(batch, caps or [], num_running, prefill_tokens, behind)

    def observe(self, o: StepOutcome) -> None:
        """What the step of the last decision did; ends its cycle (and makes an early decision current)."""
        if any(o.drafted) or self.cycle_open:
            self.observe_many(o.request_ids, o.drafted, o.accepted)
        n = len(o.request_ids)
        self.observe_step(o.num_tokens, o.num_seqs or n, o.seconds, o.prefill_tokens, n, o.own_time)
        if o.draft_seconds > 0 and any(o.drafted):
            self.observe_draft(sum(1 for k in o.drafted if k), max(o.drafted), o.draft_seconds)
        if o.caught_up:
            self.skip_cycle()
            self.observe_catch_up(o.caught_up, o.catch_up_seconds)
        prev, self._cycle, self._next = self._cycle, self._next, None
        self.finish_cycle(prev, o.cycle_seconds)

    def _decide_now(self, batch: Batch) -> list[int]:
        B = len(batch.requests)
        self.decide_seconds = 0.0
        arm = self.forced_arm if self.forced_arm is not None else self.quick_arm(B, batch.num_running)
        if arm == 0:
            self.count_off(B)
            ks = [0] * B
        elif arm is not None:
            ks = self.uniform(batch.requests, arm, batch.caps)
        else:
            t0 = self.clock()
            prefill, behind = batch.weighed()
            ks = self._decide_full(batch.requests, batch.caps, batch.num_running, prefill, behind)
            self.decide_seconds = self.clock() - t0
            self.observe_decide(self.decide_seconds)
        return ks

    def _decide_early(self, batch: Batch) -> list[int] | None:
        """The drafter's launch-ahead decisions: the pick (or plain decoding's second exploration cycle
        after a plain step), or a full decision sure not to need the outcome in flight."""
        B = len(batch.requests)
        plain = self._cycle is None or self._cycle.arm == 0
        arm = self.forced_arm
        if arm is None and plain and self.plain_second_cycle(B):
            arm = 0
        elif arm is None:
            arm = self.quick_arm(B, batch.num_running)
        if arm is None:
            if self.cfg.policy == "adaptive":
                sure = self.plain_full_early(B) if plain else all(batch.caps) and self.full_early(B)
            else:
                sure = self.cfg.policy == "static"
            if not sure:
                return None
            ks, self._next = self.decide_early(batch.requests, batch.caps, batch.num_running, *batch.weighed())
        else:
            in_flight = self.detach_cycle()
            ks = [0] * B if arm == 0 else self.uniform(batch.requests, arm, batch.caps)
            if arm == 0:
                self.count_off(B)
            self._next, self._cycle = self.detach_cycle(), in_flight
        return ks

    # -- decision ----------------------------------------------------------------------------
    def _decide_full(self, requests: list, caps: list[int], num_running: int, prefill_tokens: int,
                     behind: int = 0) -> list[int]:
        """k per request, the arms weighed; ``behind``: tokens whose draft KV drafting would first catch
        up (what an exploration out of plain decoding pays before its first draft)."""
        caps_a = np.asarray(caps, dtype=np.int64)
        policy = self.cfg.policy
        exploring = False
        if policy == "static":
            ks = caps_a
        elif policy == "threshold":
            ks = caps_a if self._threshold_on(num_running) else np.zeros_like(caps_a)
        else:
            ks, exploring = self._decide_adaptive(requests, caps_a, num_running, prefill_tokens,
                                                  self.catch_up_seconds(behind))
        out = [int(k) for k in ks]
        self._count(requests, out, exploring)
        return out

    def decide_early(self, requests: list, caps: list[int], num_running: int, prefill_tokens: int,
                     behind: int = 0) -> tuple[list[int], Cycle | None]:
        """``decide`` before the cycle in flight has its tokens: that cycle stays current; the new one is
        returned for ``install_cycle``."""
        saved = self.detach_cycle()
        ks = self.decide(requests, caps, num_running, prefill_tokens, behind)
        early = self.detach_cycle()
        if (saved is not None and early is not None and saved.exploring
                and early.exploring and saved.arm == early.arm and saved.key == early.key):
            saved.measured = False  # an exploration's first cycle, holding its second's drafts
        self._cycle = saved
        return ks, early

    def install_cycle(self, c: Cycle | None) -> None:
        """Make ``c`` (from decide_early) the cycle in flight."""
        self._cycle = c

    def _threshold_on(self, num_running: int) -> bool:
        """The threshold policy's state: off above N running requests, on again at N - N/4 or fewer."""
        n = self.cfg.disable_batch_threshold or 0
        hyst = max(1, n // 4)
        if self.spec_on and num_running > n:
            self.spec_on = False
        elif not self.spec_on and num_running <= max(n - hyst, 0):
            self.spec_on = True
        return self.spec_on

    def catch_up_seconds(self, tokens: int) -> float:
        """Predicted seconds of a catch-up over ``tokens``: fitted on past catch-ups, else one head forward
        over that many rows by the reference profile (an over-estimate: the first exploration waits)."""
        if tokens <= 0:
            return 0.0
        s = self.catch_up_cost.predict(tokens)
        return s if s is not None else self._reference().draft.predict(tokens)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A switch's catch-up (after plain decoding) over ``tokens`` took ``seconds``."""
        self.catch_up_cost.observe(tokens, seconds)

    def _decide_adaptive(self, requests: list, caps: np.ndarray, n_base: int, prefill: int,
                         switch_s: float = 0.0) -> tuple[np.ndarray, bool]:
        self._cycle = None
        self._plain_exploring = False
        K = int(caps.max(initial=0))
        if K == 0 or self.cfg.num_steps == 0:
            return np.zeros(len(caps), dtype=np.int64), False
        prior = np.asarray(self.overall.rates())
        # per-request rates shrunk towards the overall ones (AcceptanceStats.rates with a prior): [B, K]
        zeros = [0.0] * len(prior)
        stats = [self.per_request.get(r.request_id) for r in requests]
        acc = np.array([st.accepted if st is not None else zeros for st in stats])
        drafted = np.array([st.drafted if st is not None else zeros for st in stats])
        strength = AcceptanceStats.prior_strength
        cumacc = np.cumprod((acc + strength * prior) / (drafted + strength), axis=1)
        overall = np.cumprod(prior)
        if self.cfg.is_chain:
            tree = None
            arms = np.arange(min(K, self.cfg.num_steps) + 1)
        else:  # trees are all or nothing per request: off, or the full tree (depth num_steps)
            tree = (self.cfg.resolved_num_draft_tokens - 1, self.cfg.eagle_topk)
            arms = np.array([0, self.cfg.num_steps])
            caps = np.where(caps > 0, self.cfg.num_steps, 0)
        # one request: no cut by its own rates (the arms are its depths, measured)
        relative = self.policy.truncate_relative if len(requests) >= self.policy.cut_min_batch else 0.0
        depths = arm_depths(arms, cumacc, caps, overall, relative)
        # arms that draft the same depths are one arm, the shallowest (equal rows are neighbours)
        keep = np.concatenate([[True], (depths[1:] != depths[:-1]).any(axis=1)])
        arms, depths = arms[keep], depths[keep]
        ref = self._reference()
        priors, drafting = arm_priors(arms, depths, cumacc, n_base, ref, tree, prefill)
        key = batch_key(len(requests))
        self.switch_seconds[key] = switch_s
        b = self.bandit
        pick = b.chosen.get(key)
        if pick is not None and pick > arms[-1] and not b.second_cycle_due(key):
            # every cap binds below the bucket's pick: the pick cut to the caps, not weighed again
            arm, exploring = int(arms[-1]), False
            b.visits[key] = b.visits.get(key, 0) + 1
        else:
            arm, exploring = b.choose(key, dict(zip(arms.tolist(), priors)), len(requests), switch_s)
        self._draft_predicted.update({(key, int(a)): d for a, d in zip(arms, drafting)})
        i = int(np.flatnonzero(arms == arm)[0])
        # plain decoding: one token a request, counted now, as for a quick decision (count_off)
        plain = arm == 0
        self._cycle = Cycle(key, arm, drafting[i], None if plain else {r.request_id for r in requests},
                            tokens=len(requests) if plain else 0, requests=len(requests), exploring=exploring)
        ks = depths[i]
        if len(self.per_request) > 4 * len(requests) + 256:  # finished requests' stats
            self.per_request = {r.request_id: self.per_request[r.request_id] for r in requests
                                if r.request_id in self.per_request}
        if tree is not None:  # depth -> nodes of the tree to verify
            ks = np.where(ks > 0, self.cfg.resolved_num_draft_tokens - 1, 0)
        self.explorations += exploring
        return ks, exploring

    def _count(self, requests: list, ks: list[int], exploring: bool) -> None:
        self.decisions += 1
        self.k_histogram.update(ks)
        if exploring:
            return
        on = any(ks)
        if self._was_on is not None and on != self._was_on:
            self.switches += 1
        self._was_on = on
        ids = [r.request_id for r in requests]
        if ids == self._last_ids:  # the usual case: the same batch as last step
            changed = ks != self._last_ks
        else:
            last = dict(zip(self._last_ids, self._last_ks))
            changed = any(last.get(rid, k) != k for rid, k in zip(ids, ks))
        self.k_changes += changed
        self._last_ids, self._last_ks = ids, ks

    def _catch_up_fit(self) -> dict | None:
        f = self.catch_up_cost.fit()
        return None if f is None else {"fixed_ms": round(f[0] * 1e3, 4), "us_per_token": round(f[1] * 1e6, 4)}

    def snapshot(self) -> dict:
        """Observable state: decisions, switches, k histogram, measured goodput per arm, cost model
        (what ``defer`` held back included: call it from the thread that steps the engine)."""
        self.flush()
        n = sum(self.k_histogram.values())
        return {"policy": self.cfg.policy, "decisions": self.decisions, "switches": self.switches,
                "k_changes": self.k_changes, "explorations": self.explorations, "cycles": self.cycles,
                "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
                "mean_k": sum(k * v for k, v in self.k_histogram.items()) / n if n else None,
                "acceptance": [round(float(x), 4) for x in self.overall.rates()],
                "measured_goodput": self.bandit.summary(),
                "exploration_budget": {bucket_batch(k): {**v, "switch_s": round(self.switch_seconds.get(k, 0.0), 4)}
                                       for k, v in self.bandit.budget_summary().items()},
                "catch_up_fit": self._catch_up_fit(),
                "last_prediction": self.last_prediction, "cost": self.cost.summary()}
