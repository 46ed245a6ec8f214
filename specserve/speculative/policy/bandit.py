"""Measured goodput per (batch-size bucket, draft depth), the models' predictions as priors: what the adaptive
controller decides by (docs/architecture.md, "Controller"; the fields: AdaptivePolicyConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specserve.config import AdaptivePolicyConfig


def batch_key(batch: int) -> int:
    """Half-octave buckets centred on powers of two: 31 and 32 requests share one."""
    return int(round(2 * math.log2(max(batch, 1))))


def shallower_tokens(accepted: list[int], depth: int) -> dict[int, float]:
    """What each depth e < ``depth`` would have committed on a chain cycle's drafts: sum of min(a, e) + 1.
    accepted [0, 5, 2], depth 5 -> {1: 5.0, 2: 7.0, 3: 8.0, 4: 9.0}"""
    reached = [0] * (depth + 1)  # reached[j]: requests that accepted exactly j (depth: j or more)
    for a in accepted:
        reached[a if a < depth else depth] += 1
    out: dict[int, float] = {}
    at_least = len(accepted)  # requests that accepted e - 1 or more
    total = float(len(accepted))  # tokens at depth e - 1
    for e in range(1, depth):
        at_least -= reached[e - 1]
        total += at_least
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
    # what start-up seeds (pseudo-cycles, no tokens) put in: each served cycle displaces one
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
        if self.seed_n:
            self.displace_seed()
        self.n += 1
        self.tokens += tokens
        self.seconds += seconds
        self.predicted += predicted
        self.requests += requests
        self.x += x
        self.x2 += x * x

    def displace_seed(self) -> None:
        """Take one seed pseudo-cycle out (a served cycle is coming in)."""
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
    st = arms.get(arm)
    if st is None:
        st = arms[arm] = ArmStats()
    return st


def served(st: ArmStats | None) -> float:
    """(Decayed) cycles an arm ran while serving: its start-up seeds left out."""
    return st.n - st.seed_n if st is not None else 0.0


@dataclass
class GoodputBandit:
    cfg: AdaptivePolicyConfig = field(default_factory=AdaptivePolicyConfig)
    stats: dict[int, dict[int, ArmStats]] = field(default_factory=dict)  # bucket -> arm -> sums
    pooled: dict[int, ArmStats] = field(default_factory=dict)  # arm -> sums over every bucket
    # depth e -> tokens drafting e rather than e - 1 added, on every cycle of depth >= e, all buckets
    increments: dict[int, ArmStats] = field(default_factory=dict)
    spent: dict[int, float] = field(default_factory=dict)  # bucket -> seconds explorations lost (decayed)
    elapsed: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of its cycles (decayed)
    _best_goodput: dict[int, float] = field(default_factory=dict)  # bucket -> the pick's goodput
    _last_loss: dict[int, float] = field(default_factory=dict)  # bucket -> seconds its last exploration lost
    chosen: dict[int, int] = field(default_factory=dict)  # bucket -> arm exploited last
    visits: dict[int, int] = field(default_factory=dict)  # decisions per bucket
    _explore_again: dict[int, int] = field(default_factory=dict)  # bucket -> arm explored once so far
    _plain_turn: dict[int, bool] = field(default_factory=dict)  # bucket -> plain decoding's turn to be explored

    def excess_per_request(self) -> float:
        """Measured minus predicted seconds per cycle and request, over every bucket."""
        num = den = 0.0
        for arms in self.stats.values():
            for st in arms.values():
                num += st.seconds - st.predicted
                den += st.requests
        return num / den if den > 0 else 0.0

    def _drafting_excess(self, arms: dict[int, ArmStats], batch: int, bucket: float) -> float:
        """Excess seconds per cycle a drafting arm of bucket ``arms`` borrows: its served drafting cycles', with
        every bucket's per request worth ``borrow`` cycles; ``bucket`` where none was served anywhere."""
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
        borrow = self.cfg.borrow
        return (ex + borrow * num / den * batch) / (n + borrow) if n + borrow else 0.0

    def tokens_per_request(self, arm: int, tokens: float, batch: int = 1) -> float:
        """Tokens a request commits per cycle of ``arm``: pooled measure, the model's ``tokens`` as prior."""
        pool = self.pooled.get(arm) or _NO_STATS
        w = self.cfg.prior_requests
        return (pool.tokens + w * tokens / batch) / (pool.requests + w)

    def token_estimates(self, priors: dict[int, Prior], batch: int = 1) -> dict[int, tuple[float, float]]:
        """(tokens a request commits per cycle, cycles that measured them) per arm in ``priors``: a depth's
        is the next shallower arm's plus the measured increments of the depths between (same cycles)."""
        w = self.cfg.prior_requests
        out: dict[int, tuple[float, float]] = {}
        prev: tuple[int, float, float] | None = None  # (arm, tokens, cycles) of the next shallower arm
        for arm in sorted(priors):
            pool = self.pooled.get(arm)
            tpr, n = self.tokens_per_request(arm, priors[arm][0], batch), (pool.n if pool is not None else 0.0)
            if prev is not None:
                p_arm, p_tpr, p_n = prev
                inc = [self.increments[d] for d in range(p_arm + 1, arm + 1) if d in self.increments]
                if len(inc) == arm - p_arm and all(st.n > 0 for st in inc):
                    model = (priors[arm][0] - priors[p_arm][0]) / batch
                    measured = sum(st.tokens / st.requests for st in inc)
                    m = min(st.requests for st in inc)
                    tpr = p_tpr + (m * measured + w * model) / (m + w)
                    n = max(n, min(p_n, min(st.n for st in inc)))
            out[arm] = (tpr, n)
            prev = (arm, tpr, n)
        return out

    def estimates(self, key: int, priors: dict[int, Prior], batch: int = 1,
                  token_est: dict[int, tuple[float, float]] | None = None) -> dict[int, tuple[float, float]]:
        """(goodput, standard error) per arm for a cycle of ``batch`` requests in bucket ``key``."""
        c = self.cfg
        arms = self.stats.get(key, {})
        n = sum(st.n for st in arms.values())
        excess = sum(st.seconds - st.predicted for st in arms.values())
        # this bucket's excess seconds per cycle, starting from every bucket's per request
        bucket = (excess + c.borrow * self.excess_per_request() * batch) / (n + c.borrow) if n + c.borrow else 0.0
        drafting = self._drafting_excess(arms, batch, bucket)
        out: dict[int, tuple[float, float]] = {}
        cap_on = (arms.get(0) or _NO_STATS).n >= c.cap_cycles  # plain decoding's goodput bounds the others
        if token_est is None:
            token_est = self.token_estimates(priors, batch)
        for arm in sorted(priors):
            tokens, psec = priors[arm]
            st = arms.get(arm) or _NO_STATS
            pool = self.pooled.get(arm) or _NO_STATS
            tpr, n_tok = token_est[arm]
            cv_tok = pool.cv(c.default_cv) if arm else 0.0  # plain decoding: exactly one token
            cv = st.cv(c.default_cv)
            w = (cv / c.prior_cv) ** 2  # the prediction counts as (cycle spread / its error)^2 cycles
            if arm == 0:  # plain decoding: its own measured/predicted ratio, else no over-prediction borrowed
                borrowed = (st.seconds / st.predicted - 1.0) * psec if st.predicted > 0 else max(bucket, 0.0)
            else:
                borrowed = drafting
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
        predicted catch-up an exploration out of plain decoding pays first."""
        c = self.cfg
        token_est = self.token_estimates(priors, batch)
        est = self.estimates(key, priors, batch, token_est)
        visit = self.visits.get(key, 0)
        self.visits[key] = visit + 1
        again = self._explore_again.pop(key, None)
        if again in est:  # an exploration's second cycle (its first paid the switch)
            return again, True
        arms = self.stats.get(key, {})
        # past the warm-up the pick is among arms served in this bucket (not known by priors or seeds alone)
        known = [a for a in est if served(arms.get(a)) >= c.pick_cycles] if visit >= c.warm_visits else []
        plain = min(est)
        # a depth committing under 1 + margin tokens a request cannot beat plain decoding by the margin
        useless = {a for a in est if a != plain and token_est[a][0] < 1 + c.margin}
        best = max([a for a in (known or est) if a not in useless] or [a for a in est if a not in useless],
                   key=lambda a: est[a][0])
        cur = self.chosen.get(key)
        if cur in est and cur != best and cur not in useless:
            (gb, sb), (gc, sc) = est[best], est[cur]
            cur_st = arms.get(cur)
            # the noise band once the pick has cycles of its own (a pick on the prior alone is left at once)
            band = c.band * math.hypot(sb, sc) if cur_st is not None and cur_st.n >= 2 else 0.0
            need = max(c.margin * gc, band)
            if cur == plain and switch_s > 0 and gc > 0:  # repay the catch-up within switch_horizon cycles
                need = max(need, gc * gc * switch_s / (c.switch_horizon * batch))
            if gb - gc < need:
                best = cur
        self.chosen[key] = best
        self._best_goodput[key] = est[best][0]
        if not self.explores_at(key, visit):
            return best, False
        others = [a for a in est if a != best]
        # expected loss: the last exploration's, and out of plain decoding at least its catch-up
        expected = max(self._last_loss.get(key, 0.0), switch_s if best == plain else 0.0)
        within_budget = self._within_budget(key, expected)
        if visit < c.warm_visits and (best != plain or within_budget):
            # warm-up: every arm not measured here whose upper bound beats the pick gets a cycle
            unmeasured = [a for a in others if (arms[a].n if a in arms else 0.0) < c.min_cycles
                          and est[a][0] + c.z * est[a][1] > est[best][0]]
            if best != plain and served(arms.get(plain)) < c.min_cycles:
                unmeasured = [plain]  # plain decoding first, whatever its bound: the floor
            if unmeasured:
                alt = max(unmeasured, key=lambda a: est[a][0] + c.z * est[a][1])
                self._explore_again[key] = alt
                self._last_loss[key] = 0.0
                return alt, True
        if visit % c.explore_every == c.explore_every - 1 and within_budget:
            def measured(a: int) -> float:  # plain decoding by its served cycles
                return served(arms.get(a)) if a == plain else (arms[a].n if a in arms else 0.0)

            # plain decoding and the pick's neighbours are measured whatever the prior says
            must = [a for a in others if (a == plain or abs(a - best) == 1) and measured(a) < c.min_cycles]
            alt = None
            if must:
                alt = min(must, key=lambda a: arms[a].n if a in arms else 0.0)
            elif others and (best != plain or visit % (c.off_slower * c.explore_every)
                             == c.off_slower * c.explore_every - 1):
                # only an arm whose upper bound clears the switching margin; plain decoding every other time
                bound = {a: est[a][0] + c.z * est[a][1] for a in others}
                cands = [a for a in others if bound[a] > est[best][0] * (1 + c.margin)]
                if cands:
                    alt = max(cands, key=lambda a: bound[a])
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
        """Whether the next decision in bucket ``key`` must weigh the arms (``choose``): none yet, an
        exploration's second cycle, an exploration turn that may explore, or every ``every``-th."""
        visit = self.visits.get(key, 0)
        if key not in self.chosen or key in self._explore_again or visit % every == every - 1:
            return True
        return self.explores_at(key, visit) and not self.cannot_explore(key)

    def second_cycle_due(self, key: int) -> bool:
        """Whether ``choose``'s next decision in bucket ``key`` is an exploration's second cycle."""
        return key in self._explore_again

    def take_plain_second_cycle(self, key: int) -> bool:
        """Take ``choose``'s next decision now where it is plain decoding's second exploration cycle
        (known without weighing), counted as ``choose`` counts it; False (nothing taken) otherwise."""
        if self._explore_again.get(key) != 0:
            return False
        self.visits[key] = self.visits.get(key, 0) + 1
        del self._explore_again[key]
        return True

    def cannot_explore(self, key: int) -> bool:
        """Whether ``choose``'s next decision in bucket ``key`` is sure not to explore: no second cycle due,
        and not an exploration turn or its budget spent (warm-up turns: never sure)."""
        visit = self.visits.get(key, 0)
        if key in self._explore_again:
            return False
        if not self.explores_at(key, visit):
            return True
        if visit < self.cfg.warm_visits:
            return False
        return not self._within_budget(key, self._last_loss.get(key, 0.0))

    def _within_budget(self, key: int, expected: float) -> bool:
        """Whether an exploration expected to lose ``expected`` seconds fits bucket ``key``'s budget."""
        return self.spent.get(key, 0.0) + expected <= self.cfg.explore_budget * self.elapsed.get(key, 0.0)

    def explores_at(self, key: int, visit: int) -> bool:
        """Whether decision number ``visit`` of bucket ``key`` may explore (so needs a full decision)."""
        c = self.cfg
        if not c.explore_every:
            return False
        if visit < c.warm_visits and visit % c.warm_every == c.warm_every - 1:
            return True
        return visit % c.explore_every == c.explore_every - 1

    def observe(self, key: int, arm: int, predicted: float, tokens: float, seconds: float,
                requests: int = 1, tokens_at: dict[int, float] | None = None) -> None:
        """A cycle of ``arm`` for ``requests`` requests: predicted and measured seconds, committed tokens,
        and (``tokens_at``, chains) what each shallower depth would have committed on the same drafts."""
        if seconds <= 0 or predicted <= 0 or requests <= 0:
            return
        c = self.cfg
        arms = self.stats.setdefault(key, {})
        seconds = min(seconds, c.clip * predicted * self._time_ratio(arms, arm))  # a pause is not the arm's
        for st in arms.values():
            st.fade(c.decay)
        _stats_of(arms, arm).add(tokens, seconds, predicted, requests, requests / seconds)
        for st in self.pooled.values():
            st.fade(c.pool_decay)
        _stats_of(self.pooled, arm).add(tokens, seconds, predicted, requests, tokens / requests)
        if tokens_at is not None and arm > 0:
            for d, t in tokens_at.items():  # tokens only: no time (_time_ratio skips what predicted nothing)
                if 0 < d < arm:
                    _stats_of(self.pooled, d).add(t, 0.0, 0.0, requests, t / requests)
            for st in self.increments.values():
                st.fade(c.pool_decay)
            last = float(requests)  # plain decoding's: one token a request
            for d in range(1, arm + 1):
                t = tokens if d == arm else tokens_at.get(d)
                if t is None:  # (a depth collapsed into another: no increment of its own)
                    continue
                _stats_of(self.increments, d).add(t - last, 0.0, 0.0, requests, (t - last) / requests)
                last = t
        self._account(key, arm, tokens, seconds)

    def _time_ratio(self, arms: dict[int, ArmStats], arm: int) -> float:
        """Measured over predicted seconds: the highest of ``arm`` in the bucket, the bucket's arms, and
        ``arm`` over all buckets; with none, every arm's anywhere (1.0 before any)."""
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
        """``cycles`` pseudo-cycles of ``arm`` in bucket ``key`` timed before serving: time only (scratch
        text says nothing of acceptance); they fade like cycles until served ones displace them."""
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
        """A cycle left out of ``arm``'s measure (a one-off switch): still counted against the budget."""
        if seconds > 0:
            self._account(key, arm, tokens, seconds)

    def charge_overhead(self, key: int, seconds: float) -> None:
        """Host seconds an exploration's decision cost outside any cycle: spent against the budget."""
        if seconds <= 0:
            return
        self.spent[key] = self.spent.get(key, 0.0) + seconds
        self.elapsed[key] = self.elapsed.get(key, 0.0) + seconds
        self._last_loss[key] = self._last_loss.get(key, 0.0) + seconds

    def _account(self, key: int, arm: int, tokens: float, seconds: float) -> None:
        f = self.cfg.budget_decay
        self.elapsed[key] = self.elapsed.get(key, 0.0) * f + seconds
        lost = 0.0
        best = self._best_goodput.get(key, 0.0)
        if arm != self.chosen.get(key) and best > 0:
            lost = max(seconds - tokens / best, 0.0)
            self._last_loss[key] = self._last_loss.get(key, 0.0) + lost
        self.spent[key] = self.spent.get(key, 0.0) * f + lost

    def budget_summary(self) -> dict:
        """Per bucket key: seconds explorations lost, seconds of its cycles (decayed), the last loss."""
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
