"""The goodput table (bandit.py) with numbers alone: what it picks, what it explores, what it spends."""

from __future__ import annotations

import pytest

from specserve.config import AdaptivePolicyConfig
from specserve.speculative.policy.bandit import GoodputBandit, batch_key, bucket_batch

B = 8
TOKENS = {0: 1.0, 1: 1.6, 2: 1.9, 3: 2.1}  # tokens a request commits per cycle


def priors(seconds: dict[int, float]) -> dict[int, tuple[float, float]]:
    return {a: (TOKENS[a], s) for a, s in seconds.items()}


def serve(b: GoodputBandit, true_s: dict[int, float], pred_s: dict[int, float], cycles: int,
          batch: int = B) -> list[int]:
    """``cycles`` decisions in one bucket, each cycle taking its arm's true seconds; the arms run."""
    key, arms = batch_key(batch), []
    b.refresh(key, priors(pred_s), batch)
    for _ in range(cycles):
        arm, _ = b.decide(key)
        arms.append(arm)
        b.observe(key, arm, pred_s[arm], TOKENS[arm] * batch, true_s[arm], batch)
        if b.due(key, arm):  # as the controller rebuilds it
            b.refresh(key, priors(pred_s), batch)
    return arms


def test_batch_buckets_are_half_octaves_around_powers_of_two():
    assert batch_key(31) == batch_key(32) != batch_key(24)
    assert [bucket_batch(batch_key(n)) for n in (1, 2, 4, 16, 256)] == [1, 2, 4, 16, 256]


def test_a_row_is_due_after_every_other_arm_in_the_warm_up_and_every_8th_cycle_of_the_pick():
    from specserve.speculative.policy.bandit import ROW_CYCLES

    b = GoodputBandit(AdaptivePolicyConfig(warm_visits=4))
    key = batch_key(B)
    b.refresh(key, priors({0: 0.010, 1: 0.011, 2: 0.012, 3: 0.013}), B)
    pick = b.chosen[key]
    assert pick == 3
    due = []
    for _ in range(3 + 2 * ROW_CYCLES):
        b.decide(key)
        due.append(b.due(key, pick))
    assert all(due[:3])  # the warm-up (decisions 1-3 of 4): every cycle
    assert due[3:] == ([False] * (ROW_CYCLES - 1) + [True]) * 2
    assert b.due(key, 0) and not b.due(key, pick)  # another arm's cycle at once, the count starting over


def lost_share(arms: list[int], true_s: dict[int, float]) -> float:
    """Of the time ``arms`` took (plain decoding the pick), the share drafting cycles took over plain decoding's
    time for their tokens."""
    lost = sum(max(true_s[a] - TOKENS[a] * true_s[0], 0.0) for a in arms if a)
    return lost / sum(true_s[a] for a in arms)


def test_an_exploration_loses_what_it_took_over_the_picks_time_for_its_tokens():
    b = GoodputBandit()
    key = batch_key(B)
    b.refresh(key, priors({0: 0.010, 1: 0.016, 2: 0.019, 3: 0.021}), B)
    assert b.chosen[key] == 0  # plain decoding: B tokens in 10 ms
    b.observe(key, 2, 0.019, TOKENS[2] * B, 0.019, B)  # 1.9 B tokens in 19 ms: plain decoding's rate
    assert b.spent[key] == pytest.approx(0.0, abs=1e-12)
    b.observe(key, 3, 0.021, TOKENS[3] * B, 0.042, B)  # 2.1 B tokens in 42 ms: plain decoding takes 21
    assert b.spent[key] == pytest.approx(0.021)


def test_measured_time_overrules_the_prediction():
    # predicted: depth 3 best; measured: its cycles take 3x, depth 1 is best
    true_s = {0: 0.010, 1: 0.011, 2: 0.016, 3: 0.030}
    pred_s = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.010}
    arms = serve(GoodputBandit(), true_s, pred_s, 600)
    assert arms[-200:].count(1) >= 190


def test_plain_decoding_is_measured_first_and_wins_where_drafting_costs_more_than_it_gains():
    true_s = {0: 0.010, 1: 0.018, 2: 0.021, 3: 0.024}
    pred_s = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.013}  # a profile that favours drafting
    b = GoodputBandit()
    arms = serve(b, true_s, pred_s, 600)
    assert 0 in arms[:8]  # the floor measured in the bucket's first decisions
    assert arms[-300:].count(0) >= 270 and lost_share(arms[-300:], true_s) < 0.012  # kept, explorations in budget


def test_near_equal_arms_do_not_flap():
    true_s = {0: 0.010, 1: 0.016, 2: 0.0190, 3: 0.0211}  # every depth within 0.5 % of plain decoding
    b = GoodputBandit()
    serve(b, true_s, dict(true_s), 800)
    assert len(b.pick_changes(since=200)) <= 3  # (explorations of arms that tie lose nothing: they go on)


def test_pick_changes_are_logged_with_what_the_row_read():
    true_s = {0: 0.010, 1: 0.011, 2: 0.016, 3: 0.030}  # as predicted at first: depth 3; measured: depth 1
    pred_s = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.010}
    b = GoodputBandit()
    serve(b, true_s, pred_s, 600)
    changes = b.pick_changes()
    assert changes and changes[-1]["to"] == 1 == b.chosen[batch_key(B)]
    assert all(c["batch"] == B and c["from"] != c["to"] for c in changes)
    assert [c["from"] for c in changes[1:]] == [c["to"] for c in changes[:-1]]  # one chain of picks
    last = changes[-1]
    assert last["goodput"][1] >= last["goodput"][0] and last["tokens"] == [TOKENS[last["from"]], TOKENS[1]]
    assert 0 < last["turn"] <= b.turns == 600 and b.pick_changes(since=last["turn"]) == []


def test_a_depth_committing_about_one_token_a_request_is_never_the_pick():
    b = GoodputBandit()
    key = batch_key(B)
    useless = {0: (1.0, 0.010), 1: (1.01, 0.004)}  # by time alone depth 1 looks 2.5x faster
    b.refresh(key, useless, B)
    assert b.chosen[key] == 0 and b.explore[key] is None


def test_start_up_seeds_rank_the_arms_until_served_cycles_displace_them():
    b = GoodputBandit()
    key = batch_key(B)
    pred = priors({0: 0.010, 1: 0.010, 2: 0.010, 3: 0.010})
    for arm, s in {0: 0.010, 1: 0.012, 2: 0.030, 3: 0.040}.items():
        b.seed(key, arm, s, B)
    b.refresh(key, pred, B)
    assert b.chosen[key] == 1  # the seeds' ranking, not the flat prediction's (3)
    for _ in range(3):  # three served cycles of depth 1 at plain decoding's speed: the seeds are gone
        b.observe(key, 1, 0.010, TOKENS[1] * B, 0.010, B)
    b.refresh(key, pred, B)
    assert b.stats[key][1].seed_n == 0 and b.spr[key][1] == pytest.approx(0.010 / B, rel=0.02)


def test_the_picks_cycles_in_a_row_add_up_as_if_added_one_by_one():
    """The pick's cycles after its first are summed aside and added when the table is read: every sum still
    decays once a cycle (the other arms' too), a pause still counts at most clip x the estimate."""
    b = GoodputBandit()
    key = batch_key(B)
    b.refresh(key, priors({0: 0.010, 1: 0.016, 2: 0.019, 3: 0.021}), B)
    assert b.chosen[key] == 0
    f, g = b.cfg.decay, b.cfg.budget_decay
    b.observe(key, 2, 0.019, TOKENS[2] * B, 0.030, B)  # an exploration that lost time
    spent, elapsed = b.spent[key], b.elapsed[key]
    assert spent > 0
    cap = b.cfg.clip * b.spr[key][0] * B
    secs = [0.010, 0.011, 1.0, 0.009, 0.012]  # the third a pause
    for sec in secs:
        b.observe(key, 0, 0.010, B, sec, B)
    b.budget_summary()  # a read: the run is in
    counted = [min(sec, cap) for sec in secs]
    n = len(secs)

    def decayed(xs: list[float], r: float) -> float:  # [x1, x2, x3] -> x1 r^2 + x2 r + x3
        return sum(x * r ** (len(xs) - 1 - i) for i, x in enumerate(xs))

    assert b.stats[key][0].seconds == pytest.approx(decayed(counted, f), rel=1e-12)
    assert b.stats[key][0].n == pytest.approx(decayed([1.0] * n, f), rel=1e-12)
    assert b.stats[key][0].requests == pytest.approx(B * decayed([1.0] * n, f), rel=1e-12)
    assert b.stats[key][2].seconds == pytest.approx(0.030 * f**n, rel=1e-12)
    assert b.elapsed[key] == pytest.approx(elapsed * g**n + decayed(counted, g), rel=1e-12)
    assert b.spent[key] == pytest.approx(spent * g**n, rel=1e-12)


def test_one_pause_counts_at_most_clip_times_the_arms_estimate():
    b = GoodputBandit()
    key = batch_key(B)
    b.refresh(key, priors({0: 0.010, 1: 0.012, 2: 0.014, 3: 0.016}), B)
    est = b.spr[key][0] * B
    b.observe(key, 0, 0.010, B, 1.0, B)  # a 1-s pause in a 10-ms cycle
    assert b.stats[key][0].seconds == pytest.approx(b.cfg.clip * est)


def test_explorations_stay_within_the_budget_past_the_warm_up():
    true_s = {0: 0.010, 1: 0.0170, 2: 0.020, 3: 0.023}
    pred_s = {0: 0.010, 1: 0.0095, 2: 0.0096, 3: 0.0097}  # a profile that keeps saying drafting wins
    cfg = AdaptivePolicyConfig(explore_budget=0.01)
    arms = serve(GoodputBandit(cfg), true_s, pred_s, 3000)
    late = arms[1000:]
    assert 0.002 < lost_share(late, true_s) < 0.012  # explorations lose about 1 % of the time, not more
    never = serve(GoodputBandit(AdaptivePolicyConfig(explore_every=0)), true_s, dict(true_s), 300)
    assert set(never[1:]) == {0}


def test_plain_decoding_under_a_drafting_pick_is_measured_again_whatever_the_budget():
    # a pause-hit plain cycle must not hold drafting where plain decoding is better: plain decoding, the floor,
    # is explored again once its cycles fade, even with no exploration budget at all
    true_s = {0: 0.010, 1: 0.018, 2: 0.021, 3: 0.024}
    b = GoodputBandit(AdaptivePolicyConfig(explore_budget=0.0))
    key = batch_key(B)
    pred_s = dict(true_s)
    b.refresh(key, priors(pred_s), B)
    b.observe(key, 0, 0.010, B, 0.040, B)  # plain decoding's first cycle: a 4x pause
    b.chosen[key] = 2
    arms = []
    for _ in range(1500):
        arm, _ = b.decide(key)
        arms.append(arm)
        b.observe(key, arm, pred_s[arm], TOKENS[arm] * B, true_s[arm], B)
        b.refresh(key, priors(pred_s), B)
    assert arms[-200:].count(0) >= 190


def test_an_arm_whose_bound_clears_the_pick_is_explored_before_faded_neighbours():
    b = GoodputBandit()
    key = batch_key(B)
    for _ in range(40):  # plain decoding and depth 1 served, then faded far; depth 3 never served
        b.observe(key, 0, 0.010, B, 0.010, B)
    b.observe(key, 1, 0.011, TOKENS[1] * B, 0.030, B)
    b.visits[key] = 100
    b.refresh(key, priors({0: 0.010, 1: 0.011, 2: 0.020, 3: 0.009}), B)
    assert b.chosen[key] == 0 and b.explore[key] == 3  # (depth 1's cycle faded, but 3 may beat the pick)


def test_an_unserved_depth_borrows_the_drafting_cycles_excess_not_plain_decodings():
    # elsewhere plain cycles ran 2x their prediction (host time drafting cycles do not share) and depth 1's
    # ran as predicted: a depth never served in a new bucket keeps its prediction
    b = GoodputBandit()
    other, new = batch_key(8), batch_key(32)
    for _ in range(20):
        b.observe(other, 0, 0.010, 8, 0.020, 8)
        b.observe(other, 1, 0.012, 8 * TOKENS[1], 0.012, 8)
    b.refresh(new, priors({0: 0.010, 1: 0.011, 2: 0.012, 3: 0.013}), 32)
    assert b.spr[new][2] == pytest.approx(0.012 / 32)


def test_an_exploration_of_plain_decoding_whose_cycle_is_charged_runs_once_more():
    # an exploration is two cycles of its arm; where plain decoding's first is only charged (a switch out of
    # drafting), it runs one cycle more, once, so that two are measured. A drafting arm's charged cycle (its
    # catch-up after plain steps) and a charged cycle of the pick add none
    cfg = AdaptivePolicyConfig(warm_visits=0, explore_every=16)
    b = GoodputBandit(cfg)
    key = batch_key(B)
    b.refresh(key, priors({0: 0.010, 1: 0.011, 2: 0.012, 3: 0.013}), B)
    pick = b.chosen[key]
    runs = [b.decide(key) for _ in range(16)]
    assert [x[1] for x in runs] == [False] * 15 + [True]  # the 16th decision explores ...
    assert pick == 3 and runs[-1][0] == 0  # ... plain decoding (never measured: first)
    assert b.decide(key) == (0, True)  # for two cycles
    b.charge(key, 0, B, 0.02, B, explored=True)  # its first cycle's outcome: charged
    assert b.decide(key) == (0, True)  # a third cycle
    b.charge(key, 0, B, 0.02, B, explored=True)
    assert b.decide(key) == (pick, False)  # once
    b.charge(key, pick, TOKENS[pick] * B, 0.02, B)
    b.charge(key, 1, TOKENS[1] * B, 0.02, B, explored=True)
    assert b.decide(key) == (pick, False)


def test_drafting_that_starts_to_pay_at_16_requests_is_found_within_the_budget():
    """16 requests: drafting first loses (the pick goes to plain decoding), then pays 1.3x; an exploration
    costs what it loses against plain decoding's time for its tokens, not 16x that (a 16x charge kept it
    waiting ~800 cycles)."""
    key = batch_key(16)
    b = GoodputBandit()
    pred = {0: 0.010, 1: 0.012, 2: 0.013, 3: 0.014}
    serve(b, {0: 0.010, 1: 0.020, 2: 0.026, 3: 0.030}, pred, 40, batch=16)
    assert b.chosen[key] == 0
    later = serve(b, {0: 0.010, 1: 0.0125, 2: 0.0145, 3: 0.016}, pred, 400, batch=16)
    assert b.chosen[key] != 0 and later[-100:].count(0) <= 15
