"""Measured goodput per (batch size, draft depth): what the adaptive controller decides by.

A cost model predicts a step's time from a table, and an acceptance model the tokens a depth
returns; on a noisy machine their errors (10-15 % per table entry on a 2-core CPU, a few % per
draft position, more where the two interact with prefill sharing the step) are larger than the
gap between drafting 1 and 2 tokens, so a plan picked from predictions alone wanders. Here every
decision's outcome is measured instead: the tokens its requests committed and the wall time of
the whole cycle it started (draft, verify, sampling, commit, scheduling: everything the user
waits for), kept per arm, where an arm is a uniform draft depth d (0 = plain decode) in one
batch-size bucket. An arm's goodput is the tokens a request commits per cycle at that depth times
the requests per second its cycles serve. The first is pooled over every bucket (acceptance is a
property of the head and the text, not of the batch size, and one request's accepted count is
the noisiest part of a cycle: at 4 requests its spread is ~25 % of the tokens, the time's ~5-10 %),
with the acceptance model's expectation as a prior worth ``prior_requests`` requests; the second
is this bucket's decayed sums, with the cost model's prediction as a prior worth (time spread /
``prior_cv``)^2 cycles: it decides only until the arm has a few cycles of its own.

The time a prediction misses is mostly additive: host time per cycle (scheduling, sampling,
commit), attention over contexts the profile did not have, the same for every depth. So an arm's
predicted seconds are corrected by adding the measured excess (measured - predicted seconds per
cycle): the arm's own once it has cycles, else its bucket's, and a bucket with few cycles borrows
the excess per request measured in all buckets, times its batch size. A constant added to every
arm cannot make drafting a head that is never right look better than plain decoding (it drafts
the same tokens for more seconds), while a ratio borrowed from elsewhere could. And once plain
decoding has a few cycles in a bucket, a depth's goodput is bounded by plain decoding's times the
depth's tokens per request: a drafting cycle does all a plain one does, and more. So a depth whose
requests commit under 1 + ``margin`` tokens a cycle is never the pick.

Choice: the arm with the best goodput (past a bucket's warm-up, among arms with served cycles there;
another is explored first), kept unless another is better by ``margin`` and by ``band``
standard errors of the difference (hysteresis), and out of plain decoding by enough to repay the
catch-up that turning drafting on starts with (the caller's prediction) within ``switch_horizon``
cycles. Start-up seeds (``seed``) stand in for an arm's time until served cycles displace them, and
plain decoding counts as measured by its served cycles only. A cycle counts at most ``clip`` x its
expected time (a pause of the machine is not the arm's). Exploration: every ``explore_every``
decisions of a bucket, plain decoding or a neighbour of the chosen arm if measured less than ``min_cycles``, else
the arm with the highest upper bound (``z`` standard errors) if that bound beats the chosen arm,
runs for two cycles (the first may pay a one-off switch, which the caller leaves out of the arm's
measurement but charges to exploration); an arm clearly worse stops being tried. A new bucket's
first ``warm_visits`` decisions may explore every ``warm_every``: each arm not measured there yet
whose upper bound beats the pick gets a cycle, since until then its time is the profile's guess
(within the budget while plain decoding is the pick). Explorations are held back while what they
lost (seconds over what the chosen arm would have taken for the same tokens), with what the next
one is expected to lose (the last one's loss, and out of plain decoding the catch-up the caller
predicts), exceeds ``explore_budget`` of the bucket's time: a catch-up of every request's draft KV
after a long stretch of plain decoding, or a head that is never right, then costs at most that
share. Old cycles fade (``decay`` per decision in the bucket), so uncertainty grows back and a load
that drifts is followed. Pure numbers: no clock, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def batch_key(batch: int) -> int:
    """Half-octave buckets centred on powers of two: 31 and 32 requests share one (a closed loop at
    C = 32 runs 31 while a finished request's successor prefills)."""
    return int(round(2 * math.log2(max(batch, 1))))


def shallower_tokens(accepted: list[int], depth: int) -> dict[int, float]:
    """What each depth e < ``depth`` would have committed on a chain cycle's drafts, whose requests
    accepted ``accepted`` of them: the sum of min(a, e) + 1 (``GoodputBandit.nested_tokens``)."""
    reached = [0] * (depth + 1)  # reached[j]: requests that accepted exactly j (depth: j or more)
    for a in accepted:
        reached[a if a < depth else depth] += 1
    out: dict[int, float] = {}
    at_least = len(accepted)  # requests that accepted e - 1 or more, e = 1 ...
    total = float(len(accepted))  # ... and the tokens at depth e - 1 (every request commits one)
    for e in range(1, depth):
        at_least -= reached[e - 1]
        total += at_least  # each request that accepted e or more commits one more at depth e
        out[e] = total
    return out


def bucket_batch(key: int) -> int:
    """The batch size at the centre of bucket ``key`` (``batch_key``'s inverse, for reports)."""
    return round(2 ** (key / 2))


@dataclass(slots=True)
class ArmStats:
    """Decayed sums over the cycles an arm ran (in one bucket, or pooled over all of them)."""

    n: float = 0.0
    tokens: float = 0.0  # committed
    seconds: float = 0.0  # measured
    predicted: float = 0.0  # by the cost model, for the cycles as they ran
    requests: float = 0.0  # request-cycles
    x: float = 0.0  # per-cycle value whose spread matters (see add), and its square
    x2: float = 0.0
    # of the above, what calibration pseudo-cycles (no tokens) put in: each served cycle displaces one
    seed_n: float = 0.0
    seed_seconds: float = 0.0
    seed_predicted: float = 0.0
    seed_requests: float = 0.0

    def fade(self, f: float) -> None:
        self.n *= f
        self.tokens *= f
        self.seconds *= f
        self.predicted *= f
        self.requests *= f
        self.x *= f
        self.x2 *= f
        if self.seed_n:  # (0 once served cycles displaced them all: then every seed field is 0)
            self.seed_n *= f
            self.seed_seconds *= f
            self.seed_predicted *= f
            self.seed_requests *= f

    def add(self, tokens: float, seconds: float, predicted: float, requests: float, x: float) -> None:
        if self.seed_n:  # (no call where none are left: a cycle adds to ten of these at depth 5)
            self.displace_seed()
        self.n += 1
        self.tokens += tokens
        self.seconds += seconds
        self.predicted += predicted
        self.requests += requests
        self.x += x
        self.x2 += x * x

    def displace_seed(self) -> None:
        """Take one pseudo-cycle of calibration out (a served cycle is coming in): seeds stand in for
        an arm not yet served. Kept beside served cycles they outweighed them: at 256 requests on
        the H200, seeds timed on scratch requests put plain decoding at 8.1 ms a cycle where served
        it took 5.5, and two served cycles left it below a depth it beat by 7 %."""
        if self.seed_n <= 1e-9:
            return
        d = min(self.seed_n, 1.0)
        sec, pred, req = (v / self.seed_n for v in (self.seed_seconds, self.seed_predicted, self.seed_requests))
        x = req / sec if sec > 0 else 0.0
        self.n = max(self.n - d, 0.0)
        self.seconds = max(self.seconds - d * sec, 0.0)
        self.predicted = max(self.predicted - d * pred, 0.0)
        self.requests = max(self.requests - d * req, 0.0)
        self.x = max(self.x - d * x, 0.0)
        self.x2 = max(self.x2 - d * x * x, 0.0)
        self.seed_n -= d
        if self.seed_n <= 1e-9:  # the last of them: no rounding left behind
            self.seed_n = self.seed_seconds = self.seed_predicted = self.seed_requests = 0.0
            return
        self.seed_seconds = max(self.seed_seconds - d * sec, 0.0)
        self.seed_predicted = max(self.seed_predicted - d * pred, 0.0)
        self.seed_requests = max(self.seed_requests - d * req, 0.0)

    def cv(self, default: float, strength: float = 4.0) -> float:
        """Coefficient of variation of the per-cycle value, shrunk towards ``default``."""
        var = 0.0
        if self.n > 1e-9 and self.x > 0:
            m = self.x / self.n
            var = max(self.x2 / self.n - m * m, 0.0) / (m * m)
        return math.sqrt((self.n * var + strength * default**2) / (self.n + strength))


Prior = tuple[float, float]  # expected tokens, predicted seconds of one cycle


_NO_STATS = ArmStats()  # what an arm without cycles reads as (never added to)


def _stats_of(arms: dict[int, ArmStats], arm: int) -> ArmStats:
    """``arms[arm]``, made if missing (``setdefault`` would build a new one on every call)."""
    st = arms.get(arm)
    if st is None:
        st = arms[arm] = ArmStats()
    return st


def served(st: ArmStats | None) -> float:
    """(Decayed) cycles an arm ran while serving: its start-up seeds left out."""
    return st.n - st.seed_n if st is not None else 0.0


@dataclass
class GoodputBandit:
    decay: float = 0.995  # per decision in a bucket: ~200 cycles of memory
    prior_cv: float = 0.3  # relative error of the models' prediction for an arm (one never run gets tried)
    default_cv: float = 0.3  # of one cycle's tokens per request, before their spread is measured
    default_time_cv: float = 0.3  # of one cycle's time, likewise
    prior_requests: float = 16.0  # requests' worth of the acceptance model's tokens per request
    pool_decay: float = 0.998  # per cycle in any bucket: the pooled tokens per request
    z: float = 1.5  # standard errors of optimism when exploring
    margin: float = 0.02  # a better arm must beat the chosen one by this fraction to replace it
    band: float = 0.5  # ... and by this many standard errors of the difference
    explore_every: int = 16  # an exploration runs two cycles: the first may pay a switch (a catch-up)
    off_slower: int = 4  # upper-bound explorations this many times rarer while plain decoding is chosen
    warm_visits: int = 32  # a bucket's first decisions ...
    warm_every: int = 4  # ... may explore this often, an arm not yet measured there whose bound beats the pick
    min_cycles: float = 0.3  # (decayed) cycles plain decoding and the chosen arm's neighbours keep
    pick_cycles: float = 0.3  # served (decayed) cycles an arm needs in a bucket, past its warm-up, to be picked (choose)
    explore_budget: float = 0.01  # share of a bucket's time explorations may lose ...
    # ... over this memory per decision (~1,000 cycles): over the arms' ~200 a catch-up out of plain
    # decoding (~2 cycles' time at 8-32 requests on a CPU) would never fit, and plain decoding, once
    # chosen in a busy bucket, would never be checked again
    budget_decay: float = 0.999
    borrow: float = 4.0  # cycles' worth of the excess time per request measured in all buckets
    cap_cycles: float = 4.0  # plain decoding's own cycles before it bounds the drafting arms
    # cycles in which turning drafting on must repay its catch-up. At 16 requests on a CPU (74-ms
    # cycles, a ~0.45-s catch-up) that asks ~9 % of a depth. Repaying over the pick's stay so far
    # instead (up to 1,024 decisions) was tried in session 19 and reverted: level on the CPU in an
    # A/B (0.964 vs 0.980, 0.993 vs 0.993 of the best fixed at 32 and 16 requests), and at 256
    # requests on the H200 it drafted more where plain decoding was best (mean k 2.23 vs 0.60)
    switch_horizon: float = 64.0
    # a cycle counts at most this x its predicted seconds x the arm's measured/predicted ratio so far
    # (in its bucket or over all of them, whichever is higher): a hiccup of the machine (a garbage
    # collection, another process) is not the arm's. Unclipped, one 0.3-s pause in one of plain
    # decoding's first cycles at 8 requests on a CPU put it at 0.4x a useless depth's goodput, and
    # the loss charged to that exploration held every later one back: drafting stayed on
    clip: float = 3.0
    # plain decoding's prior time, once it has cycles in a bucket: its own measured/predicted ratio
    # there, not the bucket's excess seconds per cycle (see estimates). False: the bucket's, as before
    # session 25 (kept for A/Bs: benchmarks/adaptive.py --variant NAME:bandit.plain_own_ratio=False)
    plain_own_ratio: bool = True
    # a bucket's warm-up explorations out of plain decoding may draw on every bucket's budget (the
    # sum of what explorations lost against 1 % of all buckets' time) when its own is too small:
    # a new bucket has no time yet, and by the time it has, the catch-up of its plain stretch has
    # grown with it (at 64 requests on the H200 no depth was tried for ~450 decisions, session 25)
    warm_global: bool = False
    # a cycle of chain depth d also says what each shallower depth would have committed: the first e
    # drafts of a chain are the same whatever its depth, so a request that accepted a of them commits
    # min(a, e) + 1 at depth e (``observe``'s tokens_at). Pooled with the shallower depths' own cycles,
    # their tokens per request are measured on every drafting cycle, paired with the drafted depth's,
    # not on the few exploration cycles they get: at one request on the H200 depths 3, 4 and 5 (2.06x,
    # 2.14x, 2.20x no-spec) took 21 %, 28 % and 48 % of the decisions on the noise of those (0.948)
    nested_tokens: bool = True
    # the host time of an exploration's decision (taken after the verify's sync, with nothing queued on
    # the device) counts against the exploration budget (``charge_overhead``): no cycle's measure holds
    # it (a full decision's host time is no arm's), yet the engine spends it only to explore. At 16
    # requests on the H200 it was ~0.7 ms an exploration, about as much as the explored cycles lost
    # (session 37's cycle logs), so the budget let explorations take ~2x its share. False: for A/Bs
    charge_decisions: bool = True
    # a drafting arm borrows the excess time of the drafting arms' cycles (in its bucket, then in all of
    # them), not of every arm's: the host time a profile lacks is much the same for every depth, but
    # plain decoding's cycles lack the draft loop's. Where plain decoding is the pick its cycles are
    # nearly all the bucket's, so depths whose own cycles had faded were put at plain decoding's
    # excess: at 16 requests on an H100 (session 43) drafting cycles ran 1.6-1.9x their predictions and
    # plain ones 0.96x, depths known by their priors read 12,000-13,000 tok/s against 7,700 served,
    # and were picked in stretches (17 % of the time) where plain decoding served 8,800. False: for A/Bs
    drafting_excess: bool = True
    # an exploration turn whose bucket's budget is spent (cannot_explore) is a quick decision, not a full
    # one: it could only re-weigh the arms, which every ``every``-th decision does (the controller's
    # full_decision_every keeps those within its host-time budget). A full decision took ~0.5-0.8 ms at 16
    # requests on an H100 host (session 43: 0.83 ms in gpu_step_breakdown), and with plain decoding the
    # pick (explorations budgeted by their catch-ups) nearly every turn, one decision in 16, was spent:
    # ~3 % of a host-bound 1.6-ms step. False: for A/Bs
    quick_turns_when_spent: bool = True
    stats: dict[int, dict[int, ArmStats]] = field(default_factory=dict)  # bucket -> arm -> sums
    pooled: dict[int, ArmStats] = field(default_factory=dict)  # arm -> sums over every bucket
    # depth e -> what drafting e rather than e - 1 added to the committed tokens, on every cycle of depth
    # >= e (nested_tokens: each cycle's tokens at e less its tokens at e - 1), over every bucket
    increments: dict[int, ArmStats] = field(default_factory=dict)
    spent: dict[int, float] = field(default_factory=dict)  # bucket -> seconds explorations lost (decayed)
    elapsed: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of its cycles (decayed)
    _best_goodput: dict[int, float] = field(default_factory=dict)  # bucket -> the chosen arm's, when chosen
    _last_loss: dict[int, float] = field(default_factory=dict)  # bucket -> seconds its last exploration lost
    chosen: dict[int, int] = field(default_factory=dict)  # bucket -> arm exploited last
    visits: dict[int, int] = field(default_factory=dict)  # decisions per bucket
    _explore_again: dict[int, int] = field(default_factory=dict)  # bucket -> arm explored once so far
    _plain_turn: dict[int, bool] = field(default_factory=dict)  # bucket -> plain decoding's turn to be explored
    _measured_at: dict[int, int] = field(default_factory=dict)  # bucket -> decision of its last exploration's second cycle

    def excess_per_request(self) -> float:
        """Measured minus predicted seconds per cycle and request, over every bucket."""
        num = den = 0.0
        for arms in self.stats.values():
            for st in arms.values():
                num += st.seconds - st.predicted
                den += st.requests
        return num / den if den > 0 else 0.0

    def _drafting_excess(self, arms: dict[int, ArmStats], batch: int, bucket: float) -> float:
        """The excess seconds per cycle a drafting arm of bucket ``arms`` borrows (``drafting_excess``):
        its drafting arms' served cycles together, with the excess per request of every bucket's worth
        ``borrow`` cycles; ``bucket`` (every arm's) where no drafting cycle was served anywhere. Start-up
        seeds are left out: they stand in for their own arm alone, and fade (a machine that changed since
        is followed as before)."""
        if not self.drafting_excess:
            return bucket
        num = den = n = ex = 0.0
        for key_arms in self.stats.values():
            for arm, st in key_arms.items():
                if arm:
                    e = (st.seconds - st.seed_seconds) - (st.predicted - st.seed_predicted)
                    num += e
                    den += st.requests - st.seed_requests
                    if key_arms is arms:
                        n += served(st)
                        ex += e
        if den <= 1e-9:
            return bucket
        return (ex + self.borrow * num / den * batch) / (n + self.borrow) if n + self.borrow else 0.0

    def tokens_per_request(self, arm: int, tokens: float, batch: int = 1) -> float:
        """Tokens a request commits per cycle of ``arm``: measured in every bucket, with the acceptance
        model's ``tokens`` (for ``batch`` requests) worth ``prior_requests`` requests."""
        pool = self.pooled.get(arm) or _NO_STATS
        return (pool.tokens + self.prior_requests * tokens / batch) / (pool.requests + self.prior_requests)

    def token_estimates(self, priors: dict[int, Prior], batch: int = 1) -> dict[int, tuple[float, float]]:
        """(tokens a request commits per cycle, cycles that measured them) per arm in ``priors``.

        With ``nested_tokens``, a depth's tokens are the next shallower depth's plus what the deeper
        drafts added on the cycles that drafted them (``increments``, paired on the same cycles, with
        the acceptance model's increment worth ``prior_requests`` requests): a depth explored now and
        then past the one exploited is known by a few cycles' last draft positions, not by a few
        cycles' whole counts (at one request ~25 % apart each, and whichever request was running)."""
        out: dict[int, tuple[float, float]] = {}
        prev: tuple[int, float, float] | None = None  # (arm, tokens, cycles) of the next shallower arm
        for arm in sorted(priors):
            pool = self.pooled.get(arm)
            tpr, n = self.tokens_per_request(arm, priors[arm][0], batch), (pool.n if pool is not None else 0.0)
            if self.nested_tokens and prev is not None:
                p_arm, p_tpr, p_n = prev
                inc = [self.increments[d] for d in range(p_arm + 1, arm + 1) if d in self.increments]
                if len(inc) == arm - p_arm and all(st.n > 0 for st in inc):
                    model = (priors[arm][0] - priors[p_arm][0]) / batch
                    measured = sum(st.tokens / st.requests for st in inc)
                    w = min(st.requests for st in inc)
                    tpr = p_tpr + (w * measured + self.prior_requests * model) / (w + self.prior_requests)
                    n = max(n, min(p_n, min(st.n for st in inc)))
            out[arm] = (tpr, n)
            prev = (arm, tpr, n)
        return out

    def estimates(self, key: int, priors: dict[int, Prior], batch: int = 1,
                  token_est: dict[int, tuple[float, float]] | None = None) -> dict[int, tuple[float, float]]:
        """(goodput, standard error) per arm, for a cycle of ``batch`` requests in bucket ``key``.

        goodput = tokens per request (pooled over all buckets: acceptance does not depend on the
        batch size) x requests per second (this bucket's measured cycle time)."""
        arms = self.stats.get(key, {})
        n = sum(st.n for st in arms.values())
        excess = sum(st.seconds - st.predicted for st in arms.values())
        # this bucket's excess seconds per cycle, starting from every bucket's per request
        bucket = (excess + self.borrow * self.excess_per_request() * batch) / (n + self.borrow) if n + self.borrow else 0.0
        drafting = self._drafting_excess(arms, batch, bucket)
        out: dict[int, tuple[float, float]] = {}
        # a drafting cycle does all a plain one does and more, so its goodput is at most plain
        # decoding's times its tokens per request: a head that is never right (1.0) cannot look
        # better than plain decoding however its few cycles happened to be timed (once plain
        # decoding's own goodput is measured: a guessed one would cap every depth alike; plain
        # decoding, arm 0, comes first)
        cap_on = (arms.get(0) or _NO_STATS).n >= self.cap_cycles
        if token_est is None:
            token_est = self.token_estimates(priors, batch)
        for arm in sorted(priors):
            tokens, psec = priors[arm]
            st = arms.get(arm) or _NO_STATS
            pool = self.pooled.get(arm) or _NO_STATS
            # tokens per request: measured in every bucket, the acceptance model's worth
            # ``prior_requests`` requests (token_estimates); n_tok: the cycles that measured them
            tpr, n_tok = token_est[arm]
            cv_tok = pool.cv(self.default_cv) if arm else 0.0  # plain decoding: exactly one token
            cv = st.cv(self.default_time_cv)
            # the time prediction counts as many cycles as it is accurate: (cycle spread / its error)^2
            w = (cv / self.prior_cv) ** 2
            # the prediction's seconds plus this arm's own excess once it has cycles (one
            # pseudo-cycle of the bucket's), else the bucket's. Plain decoding borrows no time the
            # profile over-predicted: that is measured on drafting cycles (a profile taken on a busy
            # machine puts multi-token verifies and draft steps high), and taken whole it made plain
            # decoding, never run in the bucket, look faster than anything it was measured at
            borrowed = max(bucket, 0.0) if arm == 0 else drafting
            if arm == 0 and self.plain_own_ratio and st.predicted > 0:
                # once plain decoding has cycles here, its own excess, scaled to its predicted cycle.
                # The bucket's excess is measured almost all on drafting cycles and is seconds per
                # cycle: at 256 requests on the H200 depth 3's 15-ms cycles ran ~12 ms over the
                # profile and plain decoding's ~6 ms ones ~4.8. Borrowed whole as plain decoding's
                # own cycles faded, it took plain decoding's estimate from 40,500 tok/s (measured)
                # to 25,600 with no new measurement, below depth 3's 36,800, and plain decoding, 11 %
                # faster, was not served again (0.900 of the best fixed, session 25)
                borrowed = (st.seconds / st.predicted - 1.0) * psec
            own = (st.seconds - st.predicted + borrowed) / (st.n + 1)
            denom = st.seconds + w * max(psec + own, 0.1 * psec)
            rate = (st.requests + w * batch) / denom if denom > 0 else 0.0
            g = rate * tpr
            if arm and cap_on and 0 in out and g > out[0][0] * tpr:
                bound = out[0][0] * tpr
                out[arm] = (bound, bound * cv_tok / math.sqrt(n_tok + 1))
                continue
            out[arm] = (g, g * math.sqrt(cv**2 / (st.n + w) + cv_tok**2 / (n_tok + 1)))
        return out

    def choose(self, key: int, priors: dict[int, Prior], batch: int = 1, switch_s: float = 0.0) -> tuple[int, bool]:
        """(arm, exploring) for the next cycle of ``batch`` requests in bucket ``key``; ``switch_s``: the
        predicted seconds of catching the requests' draft KV up, which an exploration out of plain
        decoding pays first."""
        token_est = self.token_estimates(priors, batch)
        est = self.estimates(key, priors, batch, token_est)
        visit = self.visits.get(key, 0)
        self.visits[key] = visit + 1
        again = self._explore_again.pop(key, None)
        if again in est:  # an exploration's second cycle (its first paid the switch)
            self._measured_at[key] = visit
            return again, True
        arms = self.stats.get(key, {})
        # past a bucket's warm-up the pick is among arms with served cycles there: an arm known only by
        # its prior, or by start-up seeds fading towards it, earns an exploration (below), not the pick.
        # At 256 requests on the H200 the drafting arms' estimates rose past plain decoding's measured
        # one as their seeds faded (the prior adds plain decoding's excess time per cycle, and
        # drafting's host time per request is more), and depth 1 was picked unmeasured: 0.74x plain
        # decoding. In the warm-up, fresh seeds may pick: required there, at 32 requests on a CPU
        # drafting was never tried within a 40-s window (an exploration out of plain decoding waits
        # for its catch-up to fit the budget), 0.922 of the best fixed against 1.041 (session 21)
        known = [a for a in est if served(arms.get(a)) >= self.pick_cycles] if visit >= self.warm_visits else []
        # a depth whose requests commit under 1 + margin tokens a cycle cannot beat plain decoding by
        # the margin (its cycle does all a plain one does, and more): never the pick, whatever its
        # cycles' timing said. By time alone, capped at plain decoding's goodput x its tokens per
        # request (estimates), a useless head's depth tied plain decoding and, picked once, kept the
        # pick on hysteresis: on a loaded CPU (steps 15x their profile) a random head drafted on
        # 70 % of request-steps (session 36)
        plain = min(est)
        useless = {a for a in est if a != plain and token_est[a][0] < 1 + self.margin}
        best = max([a for a in (known or est) if a not in useless] or [a for a in est if a not in useless],
                   key=lambda a: est[a][0])
        cur = self.chosen.get(key)
        if cur in est and cur != best and cur not in useless:
            (gb, sb), (gc, sc) = est[best], est[cur]
            cur_st = self.stats.get(key, {}).get(cur)
            # the noise band only once the current arm has cycles of its own: a pick made on the
            # prior alone is left as soon as the prior (or a measurement) says otherwise
            band = self.band * math.hypot(sb, sc) if cur_st is not None and cur_st.n >= 2 else 0.0
            need = max(self.margin * gc, band)
            if cur == min(est) and switch_s > 0 and gc > 0:
                # drafting again first catches every request's draft KV up over the plain steps:
                # the gain must repay that within ``switch_horizon`` cycles (plain decoding's take
                # batch / gc seconds). Without this, at 256 requests on the H200 depths measured
                # level with plain decoding were switched to and back 23 times in 500 steps
                need = max(need, gc * gc * switch_s / (self.switch_horizon * batch))
            if gb - gc < need:
                best = cur
        self.chosen[key] = best
        self._best_goodput[key] = est[best][0]
        if not self.explores_at(key, visit):
            return best, False
        others = [a for a in est if a != best]
        # the next exploration is expected to lose what the last one did, and out of plain decoding
        # at least the catch-up it starts with: it must fit in the budget. (Without the catch-up the
        # first exploration of a bucket was free: at 32 requests on a CPU, after a stretch of plain
        # decoding it caught up ~6,000 tokens, 2.5 % of a 40-s window where plain decoding was right)
        expected = max(self._last_loss.get(key, 0.0), switch_s if best == min(est) else 0.0)
        within_budget = self._within_budget(key, expected)
        if self.warm_global and not within_budget and visit < self.warm_visits and best == min(est):
            within_budget = (sum(self.spent.values()) + expected
                             <= self.explore_budget * sum(self.elapsed.values()))
        # (while plain decoding is the pick, warm-up explorations too: each pays a catch-up, and a
        # head that is never right must cost nothing)
        if visit < self.warm_visits and (best != min(est) or within_budget):
            # a new bucket: its times are the profile's guesses until measured, and a coarse profile
            # can rank depths wrongly; every arm whose upper bound beats the pick gets a cycle
            unmeasured = [a for a in others if (arms[a].n if a in arms else 0.0) < self.min_cycles
                          and est[a][0] + self.z * est[a][1] > est[best][0]]
            if best != min(est) and served(arms.get(min(est))) < self.min_cycles:
                # plain decoding first, whatever its bound: it is what drafting must never fall below,
                # and later explorations of other depths can spend the budget before its turn comes
                # (at 256 requests on the H200 it was never measured, and drafting stayed on at
                # 0.7-0.8 of its throughput). Start-up seeds do not count: timed on scratch requests
                # with short prompts, they put plain decoding at 256 requests on the H200 where
                # depth 5 looked better, and it was never served there (0.83x of plain decoding)
                unmeasured = [min(est)]
            if unmeasured:
                alt = max(unmeasured, key=lambda a: est[a][0] + self.z * est[a][1])
                self._explore_again[key] = alt
                self._last_loss[key] = 0.0
                return alt, True
        if visit % self.explore_every == self.explore_every - 1 and within_budget:
            # plain decoding and the chosen arm's neighbours are measured whatever the prior says:
            # plain decoding is what speculation must never fall below, and a profile of the wrong
            # shape (taken eagerly where steps replay graphs) can put any arm far off
            def measured(a: int) -> float:  # plain decoding by its served cycles (see the warm-up above)
                return served(arms.get(a)) if a == min(est) else (arms[a].n if a in arms else 0.0)

            must = [a for a in others if (a == min(est) or abs(a - best) == 1) and measured(a) < self.min_cycles]
            alt = None
            if must:
                alt = min(must, key=lambda a: arms[a].n if a in arms else 0.0)
            elif others and (best != min(est) or visit % (self.off_slower * self.explore_every)
                             == self.off_slower * self.explore_every - 1):
                # while plain decoding is chosen, trying a depth costs a catch-up over the steps
                # since the last draft as well: upper-bound explorations are ``off_slower`` x rarer
                # only an arm whose bound clears the switching margin: an exploration that cannot
                # end in a switch is spent for nothing (at C = 2 on a CPU depths 2 and 3, a few
                # percent apart, took one cycle pair in 16 each way: ~12 % of cycles exploring)
                bound = {a: est[a][0] + self.z * est[a][1] for a in others}
                cands = [a for a in others if bound[a] > est[best][0] * (1 + self.margin)]
                if cands:
                    alt = max(cands, key=lambda a: bound[a])
                    plain = min(est)
                    # plain decoding, the floor, takes every other one of these explorations while it
                    # may beat the pick: by the highest bound alone the deeper depths (their tokens
                    # spread more) took nearly all of them, and at 16-32 requests on a CPU plain
                    # decoding kept an estimate from 2-3 cycles taken as the bucket came into use
                    if plain in cands:
                        if alt != plain and self._plain_turn.get(key, True):
                            alt = plain
                        self._plain_turn[key] = alt != plain
            if alt is not None:
                self._explore_again[key] = alt
                self._last_loss[key] = 0.0
                return alt, True
        return best, False

    def full_decision_due(self, key: int, every: int) -> bool:
        """Whether the next decision in bucket ``key`` must weigh the arms (``choose``) rather than keep the
        pick: none yet, an exploration's second cycle, an exploration turn, or every ``every``-th decision."""
        visit = self.visits.get(key, 0)
        if key not in self.chosen or key in self._explore_again or visit % every == every - 1:
            return True
        # an exploration turn weighs the arms only where it may explore (quick_turns_when_spent)
        return self.explores_at(key, visit) and not (self.quick_turns_when_spent and self.cannot_explore(key))

    def second_cycle_due(self, key: int) -> bool:
        """Whether ``choose``'s next decision in bucket ``key`` is an exploration's second cycle (its
        depth known already: the first one's)."""
        return key in self._explore_again

    def take_plain_second_cycle(self, key: int) -> bool:
        """Take ``choose``'s next decision in bucket ``key`` now where it is the second cycle of an
        exploration of plain decoding (arm 0: known without weighing the arms), counted as ``choose``
        counts it; False (nothing taken) otherwise."""
        if self._explore_again.get(key) != 0:
            return False
        visit = self.visits.get(key, 0)
        self.visits[key] = visit + 1
        del self._explore_again[key]
        self._measured_at[key] = visit
        return True

    def exploration_in_flight(self, key: int) -> bool:
        """Whether the last decision in bucket ``key`` was an exploration's second (measured) cycle."""
        return self._measured_at.get(key, -2) == self.visits.get(key, 0) - 1

    def cannot_explore(self, key: int) -> bool:
        """Whether ``choose``'s next decision in bucket ``key`` is sure not to explore (so that it can be
        taken before the outcome of the cycle in flight is known): no exploration's second cycle is
        due, and the decision is not an exploration turn or its budget is spent even before the
        catch-up an exploration out of plain decoding would add. Warm-up turns may explore whatever
        the budget (while drafting is the pick): never sure."""
        visit = self.visits.get(key, 0)
        if key in self._explore_again:
            return False
        if not self.explores_at(key, visit):
            return True
        if visit < self.warm_visits:
            return False
        return not self._within_budget(key, self._last_loss.get(key, 0.0))

    def _within_budget(self, key: int, expected: float) -> bool:
        """Whether an exploration expected to lose ``expected`` seconds fits bucket ``key``'s budget."""
        return self.spent.get(key, 0.0) + expected <= self.explore_budget * self.elapsed.get(key, 0.0)

    def explores_at(self, key: int, visit: int) -> bool:
        """Whether decision number ``visit`` of bucket ``key`` may explore (so needs a full decision)."""
        if not self.explore_every:
            return False
        if visit < self.warm_visits and visit % self.warm_every == self.warm_every - 1:
            return True
        return visit % self.explore_every == self.explore_every - 1

    def observe(self, key: int, arm: int, predicted: float, tokens: float, seconds: float,
                requests: int = 1, tokens_at: dict[int, float] | None = None) -> None:
        """A cycle of ``arm`` for ``requests`` requests: its predicted and measured seconds, the
        tokens it committed, and (``tokens_at``, chains) the tokens each shallower depth would have
        committed on the same drafts (``nested_tokens``)."""
        if seconds <= 0 or predicted <= 0 or requests <= 0:
            return
        arms = self.stats.setdefault(key, {})
        seconds = min(seconds, self.clip * predicted * self._time_ratio(arms, arm))
        for st in arms.values():
            st.fade(self.decay)
        _stats_of(arms, arm).add(tokens, seconds, predicted, requests, requests / seconds)
        for st in self.pooled.values():
            st.fade(self.pool_decay)
        _stats_of(self.pooled, arm).add(tokens, seconds, predicted, requests, tokens / requests)
        if self.nested_tokens and tokens_at is not None and arm > 0:
            for d, t in tokens_at.items():  # tokens only: no time (_time_ratio skips what predicted nothing)
                if 0 < d < arm:
                    _stats_of(self.pooled, d).add(t, 0.0, 0.0, requests, t / requests)
            for st in self.increments.values():
                st.fade(self.pool_decay)
            last = float(requests)  # plain decoding's: one token a request
            for d in range(1, arm + 1):
                t = tokens if d == arm else tokens_at.get(d)
                if t is None:  # (a depth collapsed into another: no increment of its own)
                    continue
                _stats_of(self.increments, d).add(t - last, 0.0, 0.0, requests, (t - last) / requests)
                last = t
        self._account(key, arm, tokens, seconds)

    def _time_ratio(self, arms: dict[int, ArmStats], arm: int) -> float:
        """Measured over predicted seconds so far of ``arm`` in a bucket (``arms``), of the bucket's
        arms together, and of ``arm`` over every bucket: the highest (host time the profile lacks
        put single arms at up to 12x on the H200); with none, every arm's anywhere (1.0 before any)."""
        bucket = [st for st in arms.values() if st.n >= 1]
        sums = [(st.seconds, st.predicted) for st in (arms.get(arm), self.pooled.get(arm))
                if st is not None and st.n >= 1]
        sums.append((sum(st.seconds for st in bucket), sum(st.predicted for st in bucket)))
        ratios = [sec / pred for sec, pred in sums if pred > 0]
        if ratios:
            return max(ratios)
        sec = sum(st.seconds for st in self.pooled.values())
        pred = sum(st.predicted for st in self.pooled.values())
        return sec / pred if pred > 0 else 1.0

    def seed(self, key: int, arm: int, predicted: float, seconds: float, requests: int, cycles: float = 2.0) -> None:
        """``cycles`` pseudo-cycles of ``arm`` in bucket ``key`` timed before serving (a start-up
        calibration on scratch requests): their time per cycle, as measured cycles would give it,
        and nothing of their tokens (scratch text says nothing of acceptance). They fade like any
        cycle and count as measured until served cycles displace them (one each), so the bucket's
        first decisions need no warm-up explorations."""
        if seconds <= 0 or predicted <= 0 or requests <= 0 or cycles <= 0:
            return
        st = self.stats.setdefault(key, {}).setdefault(arm, ArmStats())
        st.n += cycles
        st.seconds += cycles * seconds
        st.predicted += cycles * predicted
        st.requests += cycles * requests
        st.seed_n += cycles
        st.seed_seconds += cycles * seconds
        st.seed_predicted += cycles * predicted
        st.seed_requests += cycles * requests
        st.x += cycles * requests / seconds
        st.x2 += cycles * (requests / seconds) ** 2

    def charge(self, key: int, arm: int, tokens: float, seconds: float) -> None:
        """A cycle left out of ``arm``'s measurement (it paid a one-off switch): what it lost, if it
        was an exploration, still counts against the exploration budget."""
        if seconds > 0:
            self._account(key, arm, tokens, seconds)

    def charge_overhead(self, key: int, seconds: float) -> None:
        """Host seconds an exploration in bucket ``key`` cost outside any cycle's measure (its decision):
        spent against the budget, and expected of the next exploration (with its cycles' losses)."""
        if seconds <= 0 or not self.charge_decisions:
            return
        self.spent[key] = self.spent.get(key, 0.0) + seconds
        self.elapsed[key] = self.elapsed.get(key, 0.0) + seconds
        self._last_loss[key] = self._last_loss.get(key, 0.0) + seconds

    def _account(self, key: int, arm: int, tokens: float, seconds: float) -> None:
        f = self.budget_decay
        self.elapsed[key] = self.elapsed.get(key, 0.0) * f + seconds
        lost = 0.0
        best = self._best_goodput.get(key, 0.0)
        if arm != self.chosen.get(key) and best > 0:
            lost = max(seconds - tokens / best, 0.0)
            self._last_loss[key] = self._last_loss.get(key, 0.0) + lost
        self.spent[key] = self.spent.get(key, 0.0) * f + lost

    def budget_summary(self) -> dict:
        """Per bucket key: seconds explorations lost and seconds of its cycles (both decayed;
        explorations wait while the first plus the next one's expected loss exceeds ``explore_budget``
        of the second), and what the last exploration lost."""
        return {key: {"spent_s": round(self.spent.get(key, 0.0), 4),
                      "elapsed_s": round(self.elapsed[key], 3),
                      "last_loss_s": round(self._last_loss.get(key, 0.0), 4)}
                for key in sorted(self.elapsed)}

    def summary(self) -> dict:
        """Per bucket (as its batch size) and arm: cycles (decayed), tok/s, measured/predicted time."""
        out: dict[int, dict[int, dict]] = {}
        for key, arms in sorted(self.stats.items()):
            for arm, st in sorted(arms.items()):
                if st.n >= 1e-3:
                    run = st.seconds - st.seed_seconds  # tokens were counted in served cycles only
                    out.setdefault(bucket_batch(key), {})[arm] = {
                        "cycles": round(st.n, 1), "tok_per_s": round(st.tokens / run, 2) if run > 1e-9 else None,
                        "time_ratio": round(st.seconds / st.predicted, 3)}
        return out
