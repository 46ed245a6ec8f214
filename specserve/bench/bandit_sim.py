"""The adaptive controller's goodput table in a simulated load: what deciding costs, apart from the engine's noise.

A sweep point of ``adaptive.py`` compares engines whose rates move 2-4 % between runs of the same
configuration, so the 1-3 % the policy (specserve/speculative/policy/bandit.py) itself may lose (explorations, a
pick that lags, a wrong pick on noisy cycles, hysteresis holding a worse arm) cannot be read from
it. Here each scenario fixes every depth's true goodput; the real ``GoodputBandit`` decides cycle by
cycle as the controller drives it (a lookup each cycle; its row rebuilt after each measured cycle, whose
outcome arrives one decision late), and each cycle's outcome is drawn: every request's committed tokens
from per-position acceptance rates (which the table learns its tokens per depth from, as the controller
does), the cycle's seconds from the depth's mean with a spread (gamma, ``time_cv``) and rare pauses.
Predicted seconds are the cost model's: each depth's true time off by a random factor (``prior_error``)
drawn once per seed. Drafting after plain cycles first catches every request's draft KV up over what it
committed meanwhile: that cycle pays ``catch_per_token`` a token and is left out of the depth's
measurement (charged, as the drafter's ``skip_cycle`` does). With overlap scheduling (the GPU scenarios) the
first plain cycle after drafting takes ``plain_switch_x`` its time and is charged too; an exploration of plain
decoding so charged runs one cycle more.

Output per scenario and variant: the achieved goodput over the run (tokens / seconds, catch-ups
included) as a share of the best depth's true goodput, over ``--seeds`` seeds (mean, min,
quartiles), the share of cycles per depth and the switches of the pick. Scenarios are set from
measured sweeps: the CPU at C = 16 where depth 1 paid only 3 %, C = 1, C = 32 where plain decoding won;
a GPU at C = 1-256 (``gpu_c*``: fitted to a measured GPU sweep, docs/decisions.md; ``s.seconds=3`` is about one pass of it).

    python -m specserve.bench.bandit_sim --seeds 20 --output-file benchmarks/results/bandit_sim.json
    python -m specserve.bench.bandit_sim --scenarios cpu_c16_edge --variant m1:margin=0.01 --output-file ...
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from specserve.bench.harness import parse_variant, run_metadata, write_json
from specserve.speculative.policy.bandit import GoodputBandit, batch_key
from specserve.speculative.policy.controller import AcceptanceStats
from specserve.config import AdaptivePolicyConfig

# conditional acceptance per draft position of the shipped head on ShareGPT (CPU fp32 sweeps: accept
# length 1.56 / 1.85 / 2.0 at chains 1 / 2 / 3); the GPU's bf16 runs accept a little more
SHIPPED_ALPHA = (0.56, 0.52, 0.52, 0.50, 0.50)


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    plain_s: float  # mean seconds of a plain cycle
    ratio: tuple[float, ...]  # goodput of depth d over plain decoding's, d = 0..K (ratio[0] = 1)
    alpha: tuple[float, ...] = SHIPPED_ALPHA
    # spread of one cycle's seconds: a cycle log at C = 16 on the CPU had
    # cv 0.27-0.43 per depth (interquartile range +-10 %, tails both ways: prompts' shares taken out)
    time_cv: float = 0.25
    prior_error: float = 0.12  # relative spread of the cost model's predicted seconds per depth
    # seconds a catch-up takes per token the head has not passed over: ~0.3 s after a long plain stretch at
    # C = 16 (16 x ~180 tokens), as the CPU measured (0.15-0.45 s, bandit.py)
    catch_per_token: float = 1e-4
    output_len: int = 64  # mean output tokens of a request (spread over [0.5, 1.5] x, as adaptive.py)
    prompt_len: int = 150  # tokens of a request's prompt, which the head passes over when it first drafts
    pause_p: float = 0.003  # share of cycles hit by a pause of the machine ...
    pause_x: float = 4.0  # ... that many times their time
    seconds: float = 60.0  # of the measured window (each engine's own clock in adaptive.py)
    # requests differ: each one's acceptance rates are alpha x a factor drawn for it (lognormal, this
    # sigma; rates capped at 0.95), so that cycles of one request (C = 1: ~50 cycles each) accept more
    # or less than the mean together (0: every request alike)
    request_spread: float = 0.0
    # share of a drafting cycle's seconds its measure lacks when plain decoding follows it: the catch-up
    # over what its verify committed, which a drafting successor runs and plain decoding does not (the
    # drafter charges it: EagleSpeculator._unpaid_catch_up)
    unpaid_catch_up: float = 0.0
    # the cost model's predicted seconds of every drafting depth are its true seconds over this (the draft
    # loop's host time, which no profile has: 1.6-1.9 on a GPU at 16 requests), besides
    # prior_error; plain decoding's are not
    draft_prior_bias: float = 1.0
    # overlap scheduling (a GPU): plain steps go to the device ahead of their predecessor's sync, but the first
    # after a verify cannot: that cycle takes plain_switch_x its time and the drafter charges it (a switch)
    overlap: bool = False
    plain_switch_x: float = 1.0

    def tokens_per_request(self, d: int) -> float:
        return 1.0 + sum(math.prod(self.alpha[:j]) for j in range(1, d + 1))

    def cycle_s(self, d: int) -> float:
        """True mean seconds of a depth-d cycle, from its goodput ratio."""
        return self.plain_s * self.tokens_per_request(d) / self.ratio[d]

    def goodput(self, d: int) -> float:
        return self.batch * self.tokens_per_request(d) / self.cycle_s(d)


# a plain cycle right after a verify takes 1.3x a steady one (its step is not launched ahead; docs/decisions.md)
GPU_SWITCH = {"overlap": True, "plain_switch_x": 1.3}

SCENARIOS = {
    s.name: s for s in [
        # CPU at C = 16 (60-s windows): chain 1 1.03x none, chain 2 0.96x, chain 3 0.92x; ~60-ms
        # plain cycles, a ~0.45-s catch-up after a long plain stretch
        Scenario("cpu_c16_edge", 16, 0.060, (1.0, 1.03, 0.96, 0.92)),
        # CPU at C = 16 on another day: chain 1 well ahead
        Scenario("cpu_c16_pays", 16, 0.075, (1.0, 1.18, 1.12, 1.05)),
        # CPU at C = 1 (40-s windows): chain 2 best, 1 and 3 ~7-10 % below it
        Scenario("cpu_c1", 1, 0.042, (1.0, 1.37, 1.47, 1.32), seconds=40.0),
        # C = 32 where plain decoding wins by a little (chain 1 0.99x, 2 0.96x, 3 0.94x)
        Scenario("cpu_c32_plain", 32, 0.130, (1.0, 0.99, 0.96, 0.94)),
        # a head that is never right: drafting only costs
        Scenario("cpu_c8_useless", 8, 0.080, (1.0, 1 / 1.3, 1 / 1.6, 1 / 1.9), alpha=(0.0,) * 5),
        # a GPU at one request (chain 5 2.13-2.17x none), depths 0..5, ~1.3-ms
        # plain cycles; 20 s of it here (~9,000 cycles) to keep the run short
        Scenario("gpu_c1", 1, 0.0013, (1.0, 1.45, 1.75, 1.95, 2.08, 2.15), alpha=(0.75, 0.72, 0.7, 0.68, 0.66),
                 time_cv=0.1, catch_per_token=2e-5, seconds=20.0, **GPU_SWITCH),
        # a GPU sweep (16-s points): chain 3 2.06x / 1.90x none, chain 5 2.20x / 1.96x at C = 1 / 4
        # (depths 1, 2, 4 in between by guess), accept lengths 2.18 / 2.39 at chains 3 / 5
        Scenario("gpu_c1_sweep", 1, 0.00136, (1.0, 1.55, 1.85, 2.06, 2.15, 2.20),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=2e-5, seconds=16.0, **GPU_SWITCH),
        Scenario("gpu_c4_sweep", 4, 0.00152, (1.0, 1.40, 1.70, 1.90, 1.94, 1.96),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=2e-5, seconds=16.0, **GPU_SWITCH),
        # ... at 64 and 256 requests plain decoding wins: chain 3 0.90x / 0.85x none, chain 5 0.91x / 0.86x
        # (depths 1, 2, 4 by guess); a catch-up ~1.4 ms + 0.5 us a token (its fit there): 1.5 us a token
        # ... at 16 requests drafting pays a little (chain 3 1.025x, chain 5 1.015x none; depths 1, 2, 4 by
        # guess)
        Scenario("gpu_c16_sweep", 16, 0.00201, (1.0, 0.96, 1.0, 1.025, 1.02, 1.015),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=2e-5, seconds=14.0, **GPU_SWITCH),
        # a host-bound GPU sweep at 16 requests (10-s points): overlapped plain decoding ~1.8 ms
        # a cycle (its best), depths 1 / 3 / 4 / 5 served at 0.65 / 0.90 / 0.81 / 0.91x its goodput (2 by
        # guess), their cycles at 1.6-1.9x the profile's prediction where plain ones ran at 0.96x
        Scenario("gpu_c16_hostbound", 16, 0.0018, (1.0, 0.65, 0.80, 0.90, 0.81, 0.91),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=2e-5, seconds=10.0,
                 draft_prior_bias=1.7, **GPU_SWITCH),
        Scenario("gpu_c64_sweep", 64, 0.00344, (1.0, 0.93, 0.91, 0.90, 0.905, 0.91),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=1.5e-6, seconds=14.0, **GPU_SWITCH),
        Scenario("gpu_c256_sweep", 256, 0.00973, (1.0, 0.90, 0.87, 0.85, 0.855, 0.86),
                 alpha=(0.63, 0.56, 0.56, 0.60, 0.62), time_cv=0.1, catch_per_token=1.5e-6, seconds=14.0, **GPU_SWITCH),
    ]
}


# conditional acceptance per position on the GPU (bf16): chain 3 commits 0.89x chain 5's tokens, as adaptive
# with depth <= 3 ran 0.89-0.90x static chain 5 at C = 1-4 where drafting deeper costs almost nothing
GPU_ALPHA = (0.70, 0.68, 0.66, 0.64, 0.62)


def gpu_scenario(name: str, batch: int, plain_ms: float, fixed_ms: float, depth_ms: float, **kw) -> Scenario:
    """A GPU point whose depth-d cycle takes plain_ms + fixed_ms + d x depth_ms (d >= 1): fixed_ms and depth_ms
    fitted to a measured GPU sweep (plain_ms from no-spec's tok/s, chain 5's cycle from its tok/s)."""
    tpr = [1.0 + sum(math.prod(GPU_ALPHA[:j]) for j in range(1, d + 1)) for d in range(6)]
    ratio = tuple(tpr[d] * plain_ms / (plain_ms + (fixed_ms + d * depth_ms if d else 0.0)) for d in range(6))
    # a catch-up: ~1.4 ms + 0.5 us a token (a GPU's fit at 64-256 requests), here 2 us a token
    return Scenario(name, batch, plain_ms / 1e3, ratio, alpha=GPU_ALPHA, time_cv=0.1, catch_per_token=2e-6,
                    seconds=10.0, **GPU_SWITCH, **kw)


for _s in [gpu_scenario("gpu_c1", 1, 1.015, 0.6, 0.005), gpu_scenario("gpu_c4", 4, 1.084, 0.87, 0.004),
           gpu_scenario("gpu_c16", 16, 1.27, 1.337, 0.1), gpu_scenario("gpu_c64", 64, 2.07, 1.5, 0.84),
           gpu_scenario("gpu_c256", 256, 5.4, 3.0, 3.19)]:
    SCENARIOS[_s.name] = _s


def run(sc: Scenario, seed: int, policy: dict[str, Any]) -> dict[str, Any]:
    """One window of ``sc`` under AdaptivePolicyConfig(**policy): achieved goodput / best, cycles per depth."""
    rng = np.random.default_rng(seed)
    cfg = AdaptivePolicyConfig.from_dict(policy)
    bandit = GoodputBandit(cfg)
    K = len(sc.ratio) - 1
    key = batch_key(sc.batch)
    true_s = [sc.cycle_s(d) for d in range(K + 1)]  # (a cycle's time does not depend on who drafts)
    pred_s = [t * float(np.exp(rng.normal(0.0, sc.prior_error))) / (sc.draft_prior_bias if d else 1.0)
              for d, t in enumerate(true_s)]
    alpha = np.asarray(sc.alpha[:K]) if K else np.zeros(0)

    def rates(n: int, g: np.random.Generator) -> np.ndarray:  # per-position acceptance of n new requests
        f = np.exp(g.normal(0.0, sc.request_spread, (n, 1))) if sc.request_spread > 0 else np.ones((n, 1))
        return np.minimum(alpha[None, :] * f, 0.95)

    # tokens a request commits per cycle at each depth, over the requests' spread: a request's life is
    # its tokens, so one that accepts less runs more cycles, and a cycle's tokens average harmonically
    tpr = [sc.tokens_per_request(d) for d in range(K + 1)]
    if sc.request_spread > 0 and K:
        cum = np.cumprod(rates(100_000, np.random.default_rng(12345)), axis=1)
        tpr = [1.0 / float(np.mean(1.0 / (1.0 + cum[:, :d].sum(axis=1)))) for d in range(K + 1)]
    acc = AcceptanceStats.zeros(K)  # what the controller learns tokens per request from

    def refresh() -> None:
        tokens = acc.tokens()
        bandit.refresh(key, {d: (tokens[d], pred_s[d]) for d in range(K + 1)}, sc.batch)

    shape = 1.0 / sc.time_cv**2
    # closed loop: a finished request's successor takes its place. lag: tokens the head has not
    # passed over (a new request's prompt, then what plain cycles committed), caught up before drafting
    life = rng.integers(sc.output_len // 2, sc.output_len * 3 // 2 + 1, sc.batch)
    req_alpha = rates(sc.batch, rng)
    age = (rng.random(sc.batch) * life).astype(np.int64)
    lag = np.zeros(sc.batch, dtype=np.int64)
    clock = tokens_total = 0.0
    counts = [0] * (K + 1)
    # every configuration pays the pauses: the best depth's goodput with them
    inflate = 1 + sc.pause_p * (sc.pause_x - 1)
    best_raw = max(sc.batch * tpr[d] / true_s[d] for d in range(K + 1))
    best = best_raw / inflate
    loss = {"exploring": 0.0, "exploiting": 0.0, "catch_up": 0.0}
    switches = 0
    last_pick = None
    refresh()
    # a cycle's outcome reaches the table after the next decision, as in the drafter (finish_cycle runs
    # after the decision that ends the cycle): (arm, tokens, seconds, measured, exploring)
    pending: tuple[int, float, float, bool, bool] | None = None
    prev_arm = 0
    while clock < sc.seconds:
        behind = int(lag.sum())
        switch_s = sc.catch_per_token * behind
        arm, exploring = bandit.decide(key)
        pick = bandit.chosen.get(key)
        switches += last_pick is not None and pick != last_pick
        last_pick = pick
        if pending is not None:
            p_arm, p_tokens, p_seconds, p_measured, p_exploring = pending
            if p_arm > 0 and arm == 0:
                p_seconds *= 1.0 - sc.unpaid_catch_up
            if p_measured:
                bandit.observe(key, p_arm, pred_s[p_arm], p_tokens, p_seconds, sc.batch)
            else:
                bandit.charge(key, p_arm, p_tokens, p_seconds, sc.batch, p_exploring)
            if bandit.due(key, p_arm):
                refresh()
        # the cycle's outcome
        per_req = 1 + np.cumprod(rng.random((sc.batch, arm)) < req_alpha[:, :arm], axis=1).sum(axis=1)  # arm 0: ones
        tokens = float(np.sum(per_req))
        seconds = true_s[arm] * rng.gamma(shape, 1.0 / shape)
        if rng.random() < sc.pause_p:
            seconds *= sc.pause_x
        caught_up = arm > 0 and behind > 0
        if caught_up:
            seconds += switch_s
        plain_switch = sc.overlap and arm == 0 and prev_arm > 0
        if plain_switch:
            seconds *= sc.plain_switch_x
        lag = np.zeros_like(lag) if arm else lag + per_req
        age += per_req
        done = age >= life
        if done.any():
            n = int(done.sum())
            life[done] = rng.integers(sc.output_len // 2, sc.output_len * 3 // 2 + 1, n)
            req_alpha[done] = rates(n, rng)
            age[done] = 0
            lag[done] = 0 if arm else sc.prompt_len
        for a in (per_req - 1).tolist():  # the controller's acceptance counts
            if arm:
                for j in range(min(arm, a + 1)):
                    acc.drafted[j] += 1
                for j in range(a):
                    acc.accepted[j] += 1
        # a catch-up after plain cycles is charged only
        pending = (arm, tokens, seconds, not caught_up and not plain_switch, exploring)
        prev_arm = arm
        clock += seconds
        tokens_total += tokens
        counts[arm] += 1
        # expected seconds lost against the best depth for these expected tokens, by cause
        lost = (true_s[arm] - sc.batch * tpr[arm] / best_raw) * inflate
        loss["exploring" if exploring else "exploiting"] += lost
        loss["catch_up"] += switch_s if caught_up else 0.0
    n = sum(counts)
    return {"ratio": tokens_total / clock / best, "share": [c / n for c in counts], "switches": switches,
            "cycles": n, "lost": {k: v / clock for k, v in loss.items()}}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    r = sorted(x["ratio"] for x in runs)
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    K = len(runs[0]["share"])
    return {"mean": round(statistics.fmean(r), 4), "min": round(r[0], 4), "q1": round(q[0], 4),
            "median": round(q[1], 4), "q3": round(q[2], 4), "below_0.97": sum(x < 0.97 for x in r) / len(r),
            "share": [round(statistics.fmean(x["share"][d] for x in runs), 4) for d in range(K)],
            "switches": round(statistics.fmean(x["switches"] for x in runs), 1),
            "lost": {k: round(statistics.fmean(x["lost"][k] for x in runs), 4) for k in runs[0]["lost"]},
            "cycles": round(statistics.fmean(x["cycles"] for x in runs))}


def bandit_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``--variant`` over AdaptivePolicyConfig's fields (or scenario fields as s.FIELD)."""
    name, out = parse_variant(spec)
    known = {f.name for f in fields(AdaptivePolicyConfig)} | {f"s.{f.name}" for f in fields(Scenario)}
    bad = [k for k in out if k not in known]
    if bad:
        raise ValueError(f"--variant: {bad} are not fields of AdaptivePolicyConfig (or s.<scenario field>)")
    AdaptivePolicyConfig.from_dict({k: v for k, v in out.items() if not k.startswith("s.")})  # bad values
    return name, out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {','.join(SCENARIOS)}")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                    help="AdaptivePolicyConfig fields (or s.<scenario field>) beside the default; repeatable")
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    variants = {"default": {}}
    for spec in args.variant:
        try:
            name, vals = bandit_variant(spec)
        except (ValueError, SyntaxError) as e:
            ap.error(str(e))
        if name in variants:
            ap.error(f"--variant: the name {name!r} is used twice")
        variants[name] = vals
    results: dict[str, dict[str, Any]] = {}
    for sname in names:
        results[sname] = {}
        for vname, vals in variants.items():
            sc = replace(SCENARIOS[sname], **{k[2:]: v for k, v in vals.items() if k.startswith("s.")})
            bf = {k: v for k, v in vals.items() if not k.startswith("s.")}
            s = summarize([run(sc, seed, bf) for seed in range(args.seeds)])
            results[sname][vname] = s
            print(f"{sname:16s} {vname:12s} mean {s['mean']:.4f} min {s['min']:.4f} q1 {s['q1']:.4f} "
                  f"median {s['median']:.4f} <0.97 {s['below_0.97']:.2f} share {s['share']} "
                  f"switches {s['switches']} cycles {s['cycles']} lost {s['lost']}", flush=True)
    out = {"benchmark": "bandit_sim", **run_metadata(), "settings": vars(args), "scenarios": {n: SCENARIOS[n].__dict__ for n in names},
           "variants": variants, "results": results}
    write_json(args.output_file, out)
    return out


if __name__ == "__main__":
    main()
