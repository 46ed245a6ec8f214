"""The measured-cycle bandit behind the adaptive controller, with numbers alone."""

import numpy as np

from specserve.config import AdaptivePolicyConfig
from specserve.speculative.policy.bandit import GoodputBandit, batch_key


def bandit(**policy) -> GoodputBandit:
    return GoodputBandit(AdaptivePolicyConfig(**policy))


def run(bandit: GoodputBandit, priors: dict, true_ratio: dict, cycles: int, seed: int = 0,
        noise: float = 0.1, key: int = 6) -> list[tuple[int, bool]]:
    """Cycles where arm a takes priors[a] seconds x true_ratio[a] x noise; the choices made."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(cycles):
        arm, exploring = bandit.choose(key, priors)
        tok, sec = priors[arm]
        bandit.observe(key, arm, sec, tok, sec * true_ratio[arm] * rng.lognormal(0, noise))
        out.append((arm, exploring))
    return out


def fill(bandit: GoodputBandit, key: int, arm: int, predicted: float, tokens: float, seconds: float,
         requests: int = 1, cycles: int = 50) -> None:
    """``cycles`` identical cycles of ``arm`` in bucket ``key``."""
    for _ in range(cycles):
        bandit.observe(key, arm, predicted, tokens, seconds, requests=requests)


def test_batch_buckets_are_half_octaves_around_powers_of_two():
    assert batch_key(31) == batch_key(32) == batch_key(36)
    assert batch_key(8) != batch_key(16) and batch_key(1) == 0
    assert sorted({batch_key(b) for b in range(1, 65)}) == [0, *range(2, 13)]


def test_measured_time_overrules_the_prediction():
    # the model says drafting 1 token gives 1.6 tokens for 1.2x the time (1.33x better); in truth
    # its cycles take 1.5x what the model says, plain decode's 1.0x: drafting is 11 % worse
    priors = {0: (1.0, 0.010), 1: (1.6, 0.012)}
    b = bandit()
    choices = run(b, priors, {0: 1.0, 1: 1.5}, 400)
    assert choices[0][0] == 1  # the prior's pick first
    tail = [a for a, _ in choices[-200:]]
    assert tail.count(0) >= 190
    est = b.estimates(6, priors)
    assert est[0][0] > est[1][0]


def test_a_clearly_worse_arm_is_rarely_tried_again():
    priors = {0: (1.0, 0.010), 1: (1.1, 0.012), 2: (1.2, 0.014)}  # 1 and 2: 8 % and 14 % worse
    b = bandit()
    choices = run(b, priors, {0: 1.0, 1: 1.0, 2: 1.0}, 2000)
    late = choices[1000:]
    assert all(a == 0 for a, e in late if not e)
    gap = {0: 0.0, 1: 1 - (1.1 / 0.012) / 100, 2: 1 - (1.2 / 0.014) / 100}
    assert sum(gap[a] for a, _ in late) / len(late) < 0.01  # exploring costs under 1 % of throughput


def test_near_equal_arms_do_not_flap():
    priors = {0: (1.0, 0.010), 1: (1.2, 0.012)}  # the same goodput
    b = bandit()
    choices = [a for a, e in run(b, priors, {0: 1.0, 1: 1.005}, 3000, noise=0.2) if not e]
    flips = sum(x != y for x, y in zip(choices, choices[1:]))
    assert flips <= 8  # over 3000 cycles


def test_a_change_in_the_machine_is_followed():
    priors = {0: (1.0, 0.010), 1: (1.5, 0.012)}
    b = bandit()
    run(b, priors, {0: 1.0, 1: 1.0}, 500)
    assert b.chosen[6] == 1
    # drafting becomes 1.6x as slow as before (1.5 tokens for 1.92x the time): plain decode wins
    choices = run(b, priors, {0: 1.0, 1: 1.6}, 600, seed=1)
    assert [a for a, e in choices[-200:] if not e].count(0) >= 170


def test_an_unmeasured_arm_borrows_the_bucket_excess_time():
    # every cycle in this bucket takes 10 ms more than predicted (host time no profile sees): an arm
    # never run is judged with those 10 ms added too, so its prediction compares fairly
    priors = {0: (1.0, 0.010), 1: (1.5, 0.012)}
    b = bandit(explore_every=0)
    fill(b, 6, 0, 0.010, 1.0, 0.020)
    est = b.estimates(6, priors)
    assert np.isclose(est[0][0], 1.0 / 0.020, rtol=1e-3) and np.isclose(est[1][0], 1.5 / 0.022, rtol=1e-3)
    summary = b.summary()
    assert summary[8][0]["time_ratio"] == 2.0 and summary[8][0]["tok_per_s"] == 50.0


def test_a_drafting_arm_borrows_the_excess_time_of_drafting_cycles_not_of_plain_ones():
    # plain decoding is the pick and runs at its prediction (1 ms for 16 requests); depth 2's few cycles
    # took 3 ms against 1.2 predicted (the draft loop's host time, which no profile has). Depth 3, never
    # run, is judged with drafting's excess: 1.3 + 1.8 ms, below plain decoding. Borrowing the bucket's
    # excess (plain decoding's cycles: ~0) it read 40 tokens / 1.33 ms, 1.9x plain decoding
    priors = {0: (16.0, 0.0010), 2: (32.0, 0.0012), 3: (40.0, 0.0013)}
    b = bandit(explore_every=0)
    fill(b, 8, 2, 0.0012, 32.0, 0.0030, requests=16, cycles=4)
    fill(b, 8, 0, 0.0010, 16.0, 0.0010, requests=16, cycles=200)
    est = b.estimates(8, priors, batch=16)
    assert est[3][0] < est[0][0], est
    assert np.isclose(est[0][0], 16 / 0.0010, rtol=1e-3)  # plain decoding: its own cycles
    b = bandit(explore_every=0)
    fill(b, 8, 2, 0.0012, 32.0, 0.0030, requests=16, cycles=4)
    fill(b, 8, 0, 0.0010, 16.0, 0.0010, requests=16, cycles=200)
    assert np.isclose(b.estimates(8, priors, batch=16)[3][0], 40 / (0.0013 + 0.0018), rtol=0.02)
    # a new bucket borrows the drafting cycles' excess per request (1.8 ms / 16) times its batch
    assert np.isclose(b.estimates(10, {0: (32.0, 0.002), 3: (80.0, 0.0026)}, batch=32)[3][0],
                      80 / (0.0026 + 0.0036), rtol=0.02)


def test_plain_decoding_never_run_borrows_no_time_the_profile_over_predicted():
    # a profile taken on a busy machine put 3-token cycles at 70 ms; they take 50 ms. Plain
    # decoding (45 ms predicted, never run here) is not credited with those 20 ms: borrowed whole
    # it would look 1.8x faster than its prediction, faster than it ever runs, and win the bucket
    priors = {0: (1.0, 0.045), 3: (3.0, 0.070)}
    b = bandit(explore_every=0)
    fill(b, 0, 3, 0.070, 3.0, 0.050)
    est = b.estimates(0, priors)
    assert np.isclose(est[0][0], 1.0 / 0.045, rtol=1e-3)
    assert np.isclose(est[3][0], 3.0 / 0.050, rtol=0.05)
    # a positive excess (host time every cycle pays) is still borrowed by plain decoding
    b = bandit(explore_every=0)
    fill(b, 0, 3, 0.070, 3.0, 0.080)
    assert np.isclose(b.estimates(0, priors)[0][0], 1.0 / 0.055, rtol=0.03)


def test_plain_decoding_is_measured_first_in_a_new_bucket_where_drafting_is_the_pick():
    # the profile puts plain decoding last (its host time unseen), deeper depths near the pick; in
    # truth plain decoding is the best by 18 % and depths 3 and 4 take 3x their prediction (their
    # explorations would spend the budget before plain decoding's turn): it is measured, then chosen
    priors = {0: (256.0, 0.012), 2: (512.0, 0.017), 3: (600.0, 0.020), 4: (650.0, 0.022)}
    truth = {0: 0.6, 2: 1.0, 3: 3.0, 4: 3.0}
    for seed in range(3):
        b = bandit()
        choices = run(b, priors, truth, 500, seed=seed)
        assert (0, True) in choices[:8]  # the first warm-up exploration
        late = [a for a, _ in choices[250:]]
        assert late.count(0) >= 0.9 * len(late), seed


def test_a_new_bucket_borrows_the_excess_per_request_of_the_others():
    # 8 requests (bucket 6) ran at 1 ms per request above the profile; at 32 requests (bucket 10,
    # never run) the profile alone prefers plain decoding (107 vs 104 tok/s), with 32 ms of host
    # time added to both arms drafting is better (96 vs 98): the first decision there drafts
    b = bandit(explore_every=0)
    fill(b, 6, 0, 0.100, 8.0, 0.108, requests=8)
    priors = {0: (32.0, 0.300), 1: (48.0, 0.460)}
    est = b.estimates(10, priors, batch=32)
    assert np.isclose(est[0][0], 32 / 0.332, rtol=1e-3) and np.isclose(est[1][0], 48 / 0.492, rtol=1e-3)
    assert b.choose(10, priors, 32)[0] == 1
    # a head that is never right (drafting yields no extra token) stays off whatever is added
    assert b.choose(12, {0: (64.0, 0.600), 1: (64.0, 0.700)}, 64)[0] == 0


def run_with_catch_up(bandit: GoodputBandit, cycles: int, seed: int = 0) -> tuple[float, float]:
    """A head that is never right at 32 requests, where the first cycle after plain decoding also
    pays a catch-up (charged, not measured): (share of time lost against plain decoding, share
    of cycles drafting)."""
    rng = np.random.default_rng(seed)
    priors = {0: (32.0, 0.30), 1: (48.0, 0.36), 2: (56.0, 0.42)}  # the prior overrates drafting
    last, lost, total, drafted = 0, 0.0, 0.0, 0
    for _ in range(cycles):
        arm, _ = bandit.choose(10, priors, 32)
        sec = priors[arm][1] * rng.lognormal(0, 0.1)
        if arm and last == 0:
            sec += 0.3
            bandit.charge(10, arm, 32.0, sec)
        else:
            bandit.observe(10, arm, priors[arm][1], 32.0, sec, requests=32)
        total += sec
        lost += sec - 32.0 / (32 / 0.30)
        drafted += arm != 0
        last = arm
    return lost / total, drafted / cycles


def test_explorations_that_pay_a_catch_up_stay_within_the_budget():
    unlimited = run_with_catch_up(bandit(explore_budget=float("inf")), 4000)
    budgeted = run_with_catch_up(bandit(explore_budget=0.01), 4000)
    # (the rest of the loss: the prior, which overrates drafting here, pulls a faded arm back)
    assert budgeted[0] < 0.015 and budgeted[0] < 0.6 * unlimited[0], (budgeted, unlimited)
    assert budgeted[1] < unlimited[1]


def test_committed_tokens_overrule_an_acceptance_model_that_overrates_an_arm():
    # the acceptance model expects 0.8 accepted drafts per cycle at depth 2, the request gets 0.4:
    # with times as predicted, depth 1 (0.5 expected and accepted) is the better arm
    priors = {1: (1.5, 0.010), 2: (1.8, 0.011)}
    b = bandit()
    rng = np.random.default_rng(0)
    arms = []
    for _ in range(600):
        arm, _ = b.choose(6, priors)
        tok = 1 + (priors[arm][0] - 1) * (1.0 if arm == 1 else 0.5) * rng.lognormal(0, 0.2)
        b.observe(6, arm, priors[arm][1], tok, priors[arm][1] * rng.lognormal(0, 0.1))
        arms.append(arm)
    assert arms[0] == 2 and arms[-200:].count(1) >= 180


def test_plain_decoding_is_measured_even_when_the_profile_says_it_is_far_worse():
    # a profile of the wrong shape (eager forwards, where steps replay CUDA graphs) says plain
    # decoding is 2.7x worse than drafting; in truth it is 12 % better. Upper bounds alone would
    # never try it; it is measured anyway and wins
    priors = {0: (1.0, 0.020), 1: (1.6, 0.012)}
    b = bandit()
    choices = run(b, priors, {0: 0.4, 1: 1.2}, 400)
    assert choices[0][0] == 1
    assert [a for a, _ in choices[-200:]].count(0) >= 190


def test_tokens_per_request_are_pooled_over_buckets():
    # depth 2 ran only at 4 requests (bucket 4), committing 2.0 tokens per request where the
    # acceptance model expected 2.5; at 8 requests (bucket 6, never run at depth 2) the estimate
    # uses the measured 2.0, timed by the prediction
    b = bandit(explore_every=0, borrow=0.0)
    for _ in range(200):
        b.observe(4, 2, 0.050, 8.0, 0.050, requests=4)
    est = b.estimates(6, {0: (8.0, 0.040), 2: (20.0, 0.060)}, batch=8)
    assert np.isclose(est[2][0], 8 * 2.0 / 0.060, rtol=0.02)
    assert np.isclose(est[0][0], 8 / 0.040, rtol=1e-3)


def test_a_small_gap_is_found_through_noisy_accept_counts():
    # 4 requests, each accepting a random number of drafts: depth 2 commits 1.9 tokens per request
    # in 0.056 s, depth 1 1.6 in 0.050 s (depth 2 is 6 % better); per cycle the tokens' spread
    # (~20 %) hides the gap, the time's (5 %) does not. A second bucket (8 requests) adds
    # measurements of the same acceptance
    rng = np.random.default_rng(3)
    true_tpr, true_sec = {0: 1.0, 1: 1.6, 2: 1.9}, {0: 0.040, 1: 0.050, 2: 0.056}
    b = bandit()
    picks = []
    for i in range(1200):
        B, key = (4, 4) if i % 2 == 0 else (8, 6)
        scale = 1.0 if B == 4 else 1.6  # 8 requests take 1.6x the time of 4
        # the acceptance model overrates depth 1 (1.9 tokens): its prior picks depth 1
        priors = {a: (B * (1.0, 1.9, 2.0)[a], true_sec[a] * scale) for a in true_tpr}
        arm, exploring = b.choose(key, priors, B)
        accepted = rng.binomial(arm, (true_tpr[arm] - 1) / arm, size=B) if arm else np.zeros(B)
        tokens = float(B + accepted.sum())
        b.observe(key, arm, priors[arm][1], tokens, true_sec[arm] * scale * rng.lognormal(0, 0.05), requests=B)
        if key == 4 and not exploring and i >= 600:
            picks.append(arm)
    assert picks.count(2) >= 0.85 * len(picks), np.bincount(picks)


def run_new_bucket(bandit: GoodputBandit, decisions: int, seed: int = 0) -> list[tuple[int, bool]]:
    """A new bucket (16 requests) whose profile ranks the depths wrongly: it says depths 2 and 3
    cost the same and pick depth 3; in truth depth 1 is best (120 tok/s vs 108 and 101). The
    tokens per request of every depth are already known from another bucket."""
    rng = np.random.default_rng(seed)
    tpr = {0: 1.0, 1: 1.5, 2: 1.75, 3: 1.9}
    for _ in range(100):  # another bucket (4 requests) measured every depth
        for a in tpr:
            bandit.observe(4, a, 0.05, 4 * tpr[a], 0.05, requests=4)
    priors = {0: (16.0, 0.160), 1: (24.0, 0.179), 2: (28.0, 0.213), 3: (30.4, 0.213)}
    true_sec = {0: 0.150, 1: 0.200, 2: 0.260, 3: 0.300}
    out = []
    for _ in range(decisions):
        arm, exploring = bandit.choose(8, priors, 16)
        bandit.observe(8, arm, priors[arm][1], 16 * tpr[arm], true_sec[arm] * rng.lognormal(0, 0.1), requests=16)
        out.append((arm, exploring))
    return out


def test_a_new_bucket_tries_the_depths_its_profile_may_rank_wrongly_early():
    for seed in range(3):
        choices = run_new_bucket(bandit(), 80, seed)
        assert choices[0][0] == 3  # the profile's pick
        late = [a for a, e in choices[40:] if not e]
        assert late.count(1) >= 0.9 * len(late), (seed, late)


def test_a_useless_head_stays_off_in_new_buckets():
    # plain decoding is the pick everywhere; a drafting arm's upper bound (an unmeasured time is
    # uncertain) still beats it, and each try pays a catch-up. New buckets keep appearing (the
    # batch size wanders): warm-up explorations there stay within the budget too
    rng = np.random.default_rng(0)
    b = bandit()
    last, lost, total = 0, 0.0, 0.0
    for i in range(3000):
        key = 9 + (i // 50) % 3  # buckets 9, 10, 11 in turn
        B = round(2 ** (key / 2))
        priors = {0: (B, 0.01 * B), 1: (B, 0.013 * B), 2: (B, 0.016 * B)}
        arm, _ = b.choose(key, priors, B)
        sec = priors[arm][1] * rng.lognormal(0, 0.1)
        if arm and last == 0:
            sec += 0.005 * B
            b.charge(key, arm, B, sec)
        else:
            b.observe(key, arm, priors[arm][1], B, sec, requests=B)
        total += sec
        lost += sec - 0.01 * B
        last = arm
    assert lost / total < 0.02


def test_a_depth_that_commits_one_token_per_request_never_beats_plain_decoding():
    # a head that is never right: its few drafting cycles were timed in a quiet moment (as fast as
    # plain decoding's), plain decoding's many in busier ones; a drafting cycle still does all a
    # plain one does, so its goodput is at most plain decoding's x 1.0 tokens per request
    b = bandit(explore_every=0)
    for _ in range(100):
        b.observe(10, 0, 0.30, 32.0, 0.45, requests=32)
    for _ in range(3):
        b.observe(10, 1, 0.36, 32.0, 0.40, requests=32)
    priors = {0: (32.0, 0.30), 1: (32.0, 0.36)}
    est = b.estimates(10, priors, 32)
    assert est[1][0] <= est[0][0]
    assert b.choose(10, priors, 32)[0] == 0


def test_a_useless_depth_picked_on_lucky_timing_gives_the_pick_back_to_plain_decoding():
    # depth 1 of a head that is never right was picked while its cycles were timed faster than plain
    # decoding's (a loaded machine: at 15x their profile, timing says little); measured, plain
    # decoding caps it at plain decoding's goodput x 1.0 tokens per request: a tie, which hysteresis
    # would leave with the pick. Its requests commit one token a cycle: it cannot be the pick
    b = bandit(explore_every=0, warm_visits=0)
    priors = {0: (32.0, 0.30), 1: (32.0, 0.36)}
    for _ in range(20):
        b.observe(10, 1, 0.36, 32.0, 0.40, requests=32)
    b.chosen[10] = 1
    for _ in range(10):
        b.observe(10, 0, 0.30, 32.0, 0.45, requests=32)
    est = b.estimates(10, priors, 32)
    assert est[1][0] >= est[0][0]  # by time alone depth 1 still ties plain decoding
    assert b.tokens_per_request(1, 32.0, 32) < 1 + b.cfg.margin
    assert b.choose(10, priors, 32)[0] == 0
    # a depth whose requests commit 1.5 tokens a cycle is picked on the same times
    useful = bandit(explore_every=0, warm_visits=0)
    for _ in range(20):
        useful.observe(10, 1, 0.36, 48.0, 0.40, requests=32)
    useful.chosen[10] = 1
    for _ in range(10):
        useful.observe(10, 0, 0.30, 32.0, 0.45, requests=32)
    assert useful.choose(10, {0: (32.0, 0.30), 1: (48.0, 0.36)}, 32)[0] == 1


def test_calibration_seeds_rank_the_arms_from_the_first_decision_without_warm_up_explorations():
    # the profile says depth 3 is best; steps timed at start-up say plain decoding is (host time
    # per request the profile cannot see): seeded, the bucket picks plain decoding at once and its
    # warm-up visits explore nothing, where an unseeded bucket drafts and explores
    priors = {0: (256.0, 0.010), 1: (400.0, 0.012), 3: (600.0, 0.014)}
    truth = {0: 1.0, 1: 2.5, 3: 2.8}
    seeded = bandit()
    for arm, (_, sec) in priors.items():
        seeded.seed(10, arm, sec, sec * truth[arm], requests=1)
    assert seeded.summary()[32][0]["tok_per_s"] is None  # seeds carry time, no tokens
    choices = run(seeded, priors, truth, 32, key=10)
    assert all(a == 0 and not e for a, e in choices)
    fresh = run(bandit(), priors, truth, 32, key=10)
    assert fresh[0] == (3, False) and any(e for _, e in fresh)
    # seeds fade like cycles: an arm measured later takes over (the machine changed)
    late = run(seeded, priors, {0: 1.0, 1: 0.7, 3: 0.6}, 400, key=10)
    assert [a for a, _ in late[-50:]].count(3) >= 40


def test_plain_decoding_measured_low_early_costs_little():
    # a bucket of 32 requests (a CPU at the top of a ramp): calibration seeds every depth; plain
    # decoding is truly 1 % better than depth 1 and depths 2-3 are 8 % and 14 % worse, but of its
    # first two served cycles one took 2.3x as long (a prompt the cost model under-predicted).
    # Served cycles displace the seeds, so that outlier is half of what plain decoding has, and its
    # upper bound stays short of depth 1's: it is not tried again in these 150 decisions. (Kept
    # beside the seeds, which guessed it optimistically here, it was; at 256 requests on the GPU
    # they guessed it pessimistically and kept it out for good, at 0.83x its throughput: see
    # test_plain_decoding_is_served_where_start_up_seeds_put_a_depth_ahead.) What that costs: the
    # 1 % plain decoding was worth, and the explorations
    from specserve.speculative.policy.bandit import ArmStats

    B, key = 32, batch_key(32)
    tpr = {0: 1.0, 1: 1.56, 2: 1.89, 3: 2.10}
    true_s = {0: 0.333, 1: 0.525, 2: 0.684, 3: 0.813}  # goodput 96.1, 95.1, 88.4, 82.6 tok/s
    priors = {a: (B * tpr[a], s) for a, s in {0: 0.255, 1: 0.437, 2: 0.591, 3: 0.795}.items()}
    ratios = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        b = bandit()
        for a, (_, s) in priors.items():
            b.seed(key, a, s, s, B)
        for a in (1, 2, 3):  # acceptance measured in smaller buckets
            for _ in range(100):
                b.pooled.setdefault(a, ArmStats()).add(B * tpr[a], 1.0, 1.0, B, tpr[a] * rng.lognormal(0, 0.2))
        b.observe(key, 0, priors[0][1], B, 0.333, B)
        b.observe(key, 0, priors[0][1], B, 0.333 * 2.3, B)
        tokens_sum = seconds_sum = 0.0
        for _ in range(150):  # a 60-s level at C = 32
            arm, _ = b.choose(key, priors, B)
            tokens = B * tpr[arm] * (rng.lognormal(0, 0.05) if arm else 1.0)
            seconds = true_s[arm] * rng.lognormal(0, 0.1)
            b.observe(key, arm, priors[arm][1], tokens, seconds, B)
            tokens_sum += tokens
            seconds_sum += seconds
        ratios.append(tokens_sum / seconds_sum / (B / true_s[0]))
        assert ratios[-1] > 0.95, (seed, ratios)
    assert np.mean(ratios) > 0.97, ratios


def test_an_exploration_out_of_plain_decoding_waits_until_its_catch_up_fits_the_budget():
    # 32 requests decoding plainly (the right choice); depth 1, never measured in this bucket, has an
    # upper bound above plain decoding's. Trying it first catches up every request's draft KV (1 s,
    # three cycles' time). Without that predicted cost the first exploration came within 16 decisions,
    # 2.5 % of a 40-s window; with it, not before the bucket's time makes 1 s a 1 % share
    B, key = 32, batch_key(32)
    priors = {0: (32.0, 0.30), 1: (40.0, 0.45)}

    def run_bucket(switch_s: float, decisions: int) -> tuple[list[int], float, float]:
        b = bandit()
        explored, lost, total, last = [], 0.0, 0.0, 0
        for i in range(decisions):
            arm, exploring = b.choose(key, priors, B, switch_s=switch_s if last == 0 else 0.0)
            sec = priors[arm][1]
            if arm and last == 0:  # the switch: its catch-up, left out of the arm's measure
                sec += switch_s
                b.charge(key, arm, priors[arm][0], sec)
            else:
                b.observe(key, arm, priors[arm][1], priors[arm][0], sec, requests=B)
            if exploring:
                explored.append(i)
            total += sec
            lost += max(sec - priors[arm][0] / (32.0 / 0.30), 0.0)
            last = arm
        return explored, lost, total

    free, _, _ = run_bucket(0.0, 130)  # the catch-up left out of the prediction: its old behaviour
    assert free and free[0] < 16
    explored, lost, total = run_bucket(1.0, 130)  # ~40 s
    assert explored == []
    explored, lost, total = run_bucket(1.0, 3000)  # ~15 min: drafting is still checked, within the budget
    assert explored and explored[0] >= 300
    assert lost / total < 0.012


def test_an_arm_whose_bound_cannot_reach_the_switching_margin_is_not_explored():
    # depth 2 is measured well and best; depth 3's goodput is 1 % lower and its spread small, so its
    # optimistic bound stays under best x (1 + margin): exploring it could never end in a switch
    priors = {2: (1.9, 0.0100), 3: (2.0, 0.0106)}  # 190 vs 188.7 tokens per second
    b = bandit(warm_visits=0)
    for _ in range(300):
        b.observe(6, 2, 0.0100, 1.9, 0.0100)
        b.observe(6, 3, 0.0106, 2.0, 0.0106)
    b.pooled[2].x2 = b.pooled[2].x ** 2 / b.pooled[2].n  # tokens per request with no spread
    b.pooled[3].x2 = b.pooled[3].x ** 2 / b.pooled[3].n
    choices = [b.choose(6, priors) for _ in range(200)]
    assert all(a == 2 for a, _ in choices)
    assert not any(e for _, e in choices)
    # the same with depth 3 5 % better: it is chosen, and depth 2 is then explored no more than depth 3 was
    b2 = bandit(warm_visits=0)
    for _ in range(300):
        b2.observe(6, 2, 0.0100, 1.9, 0.0100)
        b2.observe(6, 3, 0.0100, 2.0, 0.0100)
    assert b2.choose(6, priors)[0] == 3


def test_one_hiccup_counts_at_most_clip_times_the_arms_measured_time():
    # a 10x pause of the machine in one cycle: clipped at 3x the arm's measured/predicted ratio, it
    # moves the arm's time by a tenth instead of by nearly half, and the loss charged to an
    # exploration that meets it is bounded likewise
    b = bandit()
    fill(b, 6, 0, 0.01, 8.0, 0.01, requests=8, cycles=20)
    b.observe(6, 0, 0.01, 8.0, 0.10, requests=8)
    ratio = b.summary()[8][0]["time_ratio"]
    assert 1.05 < ratio < 1.15, ratio
    # an arm new to the bucket is held to the bucket's ratio (now ~1.1), times the clip
    b.observe(6, 1, 0.012, 8.0, 0.5, requests=8)
    assert b.summary()[8][1]["time_ratio"] <= b.cfg.clip * ratio * 1.01


def test_plain_decoding_is_served_where_start_up_seeds_put_a_depth_ahead():
    # 256 requests on the GPU: the start-up seeds (scratch requests, short prompts) timed plain
    # decoding at 8.1 ms and depth 5 at 14.5 ms a cycle, so depth 5 (2.3 tokens per request) looked
    # ~30 % better; served, plain decoding takes 5.5 ms and depth 5 13.5 ms: plain decoding is
    # ~7 % better. With seeds counted as measured cycles, plain decoding was never served there
    # and the engine made 0.83x of plain decoding's throughput
    from specserve.speculative.policy.bandit import ArmStats

    B, key = 256, batch_key(256)
    tpr = {0: 1.0, 5: 2.3}
    priors = {0: (B * 1.0, 0.0018), 5: (B * 2.3, 0.0042)}
    seeds = {0: 0.0081, 5: 0.0145}
    truth = {0: 0.0055, 5: 0.0135}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        b = bandit()
        for a, (_, s) in priors.items():
            b.seed(key, a, s, seeds[a], B)
        for _ in range(100):  # acceptance measured in smaller buckets
            b.pooled.setdefault(5, ArmStats()).add(B * 2.3, 1.0, 1.0, B, 2.3 * rng.lognormal(0, 0.1))
        choices = []
        for _ in range(200):
            arm, _ = b.choose(key, priors, B)
            b.observe(key, arm, priors[arm][1], B * tpr[arm], truth[arm] * rng.lognormal(0, 0.05), B)
            choices.append(arm)
        assert 0 in choices[:20], (seed, choices[:20])
        assert choices[-50:].count(0) >= 45, (seed, choices[-50:])


def test_turning_drafting_on_must_repay_its_catch_up():
    # plain decoding chosen at 256 requests (5.5 ms a cycle); depth 2 measured 4 % better. Its
    # catch-up after a long stretch of plain decoding (30 ms) is not repaid by 4 % within 64 cycles:
    # plain decoding stays. With a short stretch behind (1 ms) it switches
    B, key = 256, batch_key(256)
    priors = {0: (B * 1.0, 0.0055), 2: (B * 2.0, 0.0106)}
    picks = {}
    for switch_s in (0.030, 0.001):
        b = bandit(explore_every=0)
        fill(b, key, 0, 0.0055, B, 0.0055, requests=B, cycles=40)
        fill(b, key, 2, 0.0106, 2.0 * B, 0.0106 / 1.04, requests=B, cycles=40)
        b.chosen[key] = 0
        picks[switch_s] = b.choose(key, priors, B, switch_s)[0]
    assert picks == {0.030: 0, 0.001: 2}, picks


def test_an_arm_known_only_by_its_prior_and_fading_seeds_is_explored_not_picked():
    # 256 requests on the GPU: plain decoding served at 7.4 ms a cycle, depth 1 truly
    # 16 ms (1.58 tokens per request: 0.74x plain decoding's goodput). The profile sees the target
    # forward only; start-up seeds put the depths behind plain decoding, so the bucket's warm-up
    # picks plain decoding. As the seeds fade, a depth's estimate goes back to its prior plus plain
    # decoding's excess time, which is above plain decoding's: picked on that alone (from decision
    # ~450 here; in the engine's 12-s point depth 1 drafted ~120 cycles) it loses. Past the warm-up
    # it must be measured by an exploration first, and then it is not picked
    from specserve.speculative.policy.bandit import ArmStats

    B, key = 256, batch_key(256)
    tpr = {0: 1.0, 1: 1.58, 3: 2.2}
    true_s = {0: 7.4e-3, 1: 16e-3, 3: 22e-3}
    predicted = {0: 1.8e-3, 1: 2.6e-3, 3: 3.6e-3}
    seeded = {0: 5.5e-3, 1: 14e-3, 3: 20e-3}
    priors = {a: (B * tpr[a], s) for a, s in predicted.items()}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        b = bandit()
        for a, s in seeded.items():
            b.seed(key, a, predicted[a], s, B)
        for a in (1, 3):  # acceptance measured in smaller buckets
            for _ in range(100):
                b.pooled.setdefault(a, ArmStats()).add(B * tpr[a], 1.0, 1.0, B, tpr[a] * rng.lognormal(0, 0.2))
        last, picked, tokens_sum, seconds_sum = 0, [], 0.0, 0.0
        for i in range(600):
            arm, exploring = b.choose(key, priors, B, switch_s=9e-3 if last == 0 else 0.0)
            seconds = true_s[arm] * rng.lognormal(0, 0.05)
            if arm and last == 0:  # a switch: every request's draft KV caught up first, charged only
                seconds += 9e-3
                b.charge(key, arm, B * tpr[arm], seconds)
            else:
                b.observe(key, arm, predicted[arm], B * tpr[arm], seconds, B)
            if arm and not exploring:
                picked.append(i)
            tokens_sum += B * tpr[arm]
            seconds_sum += seconds
            last = arm
        assert picked == [], (seed, picked)
        assert tokens_sum / seconds_sum > 0.99 * B / true_s[0]


def test_plain_decoding_keeps_its_own_measured_speed_as_its_cycles_fade():
    # plain decoding's cycles ran 4.2x the profile (1.5 -> 6.25 ms), depth 3's 4.7x (3.2 -> 15 ms);
    # as plain decoding's few cycles fade it keeps its own ratio, not depth 3's ~12 ms excess per cycle
    B = 256
    key = batch_key(B)
    priors = {0: (float(B), 0.0015), 3: (2.16 * B, 0.0032)}
    b = bandit()
    fill(b, key, 0, 0.0015, float(B), 0.00625, requests=B, cycles=11)
    fill(b, key, 3, 0.0032, 2.16 * B, 0.015, requests=B, cycles=700)
    est = b.estimates(key, priors, B)
    assert est[0][0] > est[3][0]
    assert abs(est[0][0] / (B / 0.00625) - 1) < 0.05  # still its measured goodput


def test_a_new_buckets_warm_up_leaves_plain_decoding_only_within_its_own_budget():
    # 64 requests enter a new bucket after ~40 s in another; plain decoding is the prior's pick and
    # depth 1's upper bound beats it. Trying depth 1 costs a 0.2-s catch-up: over 1 % of the new
    # bucket's time, so the warm-up stays on plain decoding; with no catch-up to pay it explores
    B, key, other = 64, batch_key(64), batch_key(16)
    priors = {0: (64.0, 0.60), 1: (80.0, 0.90)}

    def warm_up(switch_s: float) -> list[int]:
        b = bandit()
        fill(b, other, 0, 0.1, 16.0, 0.1, requests=16, cycles=400)
        explored = []
        for i in range(b.cfg.warm_visits):
            arm, exploring = b.choose(key, priors, B, switch_s=switch_s)
            b.observe(key, arm, priors[arm][1], priors[arm][0], priors[arm][1], requests=B)
            if exploring:
                explored.append(arm)
        return explored

    assert warm_up(0.2) == []
    assert 1 in warm_up(0.0)


def serve_never_right(b: GoodputBandit, rng: np.random.Generator, priors: dict, arm: int, last: int) -> None:
    """One cycle of ``arm`` at 32 requests (bucket 10) for a head that is never right: 32 tokens whatever
    the depth, and a drafting cycle after plain decoding also pays a 0.3-s catch-up (charged, not measured)."""
    sec = priors[arm][1] * rng.lognormal(0, 0.1)
    if arm and last == 0:
        b.charge(10, arm, 32.0, sec + 0.3)
    else:
        b.observe(10, arm, priors[arm][1], 32.0, sec, requests=32)


def test_a_decision_sure_not_to_explore_never_explores():
    """``cannot_explore`` (what lets a full decision be taken before the cycle in flight is known)
    is never wrong, and is sure on more than the turns between explorations: on exploration turns
    whose budget is spent too, here a head that is never right with a catch-up out of plain decoding."""
    rng = np.random.default_rng(3)
    b = bandit(explore_budget=0.01)
    priors = {0: (32.0, 0.30), 1: (48.0, 0.36), 2: (56.0, 0.42)}
    last, sure_turns, turns = 0, 0, 0
    for _ in range(3000):
        visit = b.visits.get(10, 0)
        sure = b.cannot_explore(10)
        turn = b.explores_at(10, visit) and visit >= b.cfg.warm_visits
        between = not b.explores_at(10, visit) and 10 not in b._explore_again
        arm, exploring = b.choose(10, priors, 32, switch_s=0.3)
        assert not (sure and exploring), visit
        if between:
            assert sure
        turns += turn
        sure_turns += turn and sure
        serve_never_right(b, rng, priors, arm, last)
        last = arm
    assert 0 < sure_turns < turns, (sure_turns, turns)
    # an exploration's second cycle and a warm-up turn are never sure
    fresh = bandit()
    fresh.visits[4] = fresh.cfg.warm_every - 1
    assert not fresh.cannot_explore(4)
    fresh.visits[4] = 40
    fresh._explore_again[4] = 2
    assert not fresh.cannot_explore(4)


def test_an_exploration_turn_whose_budget_is_spent_is_a_quick_decision():
    """Past the warm-up, an exploration turn that cannot explore (its bucket's budget spent) does not need
    the arms weighed: with full decisions every 64th, the turns at 16, 32 and 48 stay quick; one that may
    explore, and every 64th, are full. Here a head that is never right, with a catch-up out of plain
    decoding, spends the budget."""
    rng = np.random.default_rng(3)
    priors = {0: (32.0, 0.30), 1: (48.0, 0.36), 2: (56.0, 0.42)}
    b = bandit(explore_budget=0.01)
    last, full_turns, spent_turns, open_turns = 0, 0, 0, 0
    for _ in range(3000):
        visit = b.visits.get(10, 0)
        due = b.full_decision_due(10, 64)
        turn = visit >= b.cfg.warm_visits and b.explores_at(10, visit) and visit % 64 != 63
        if turn and b.cannot_explore(10):
            spent_turns += 1
            assert not due, visit
        elif turn:
            open_turns += 1
            assert due, visit
        full_turns += turn and due
        if due:
            arm, _ = b.choose(10, priors, 32, switch_s=0.3)
        else:  # a quick decision: the pick again (SpecController.quick_arm)
            b.visits[10] = visit + 1
            arm = b.chosen[10]
        serve_never_right(b, rng, priors, arm, last)
        last = arm
    assert spent_turns > 50 and open_turns > 0
    assert full_turns < spent_turns, (full_turns, spent_turns)


def test_a_chain_cycle_also_measures_the_tokens_of_every_shallower_depth():
    """The first e drafts of a depth-d chain are depth e's, so a cycle of depth 5 says what depths 1-4
    would have committed (tokens_at): their tokens per request are measured without running them."""
    rng = np.random.default_rng(0)
    alpha, B = 0.7, 4
    truth = {e: 1 + sum(alpha**j for j in range(1, e + 1)) for e in range(1, 6)}
    for nested in (True, False):  # False: the cycles without what shallower depths would have committed
        b = bandit()
        key = batch_key(B)
        for _ in range(400):
            acc = np.cumprod(rng.random((B, 5)) < alpha, axis=1).sum(axis=1)
            at = {e: float(np.minimum(acc, e).sum() + B) for e in range(1, 5)}
            b.observe(key, 5, 1e-3, float(acc.sum() + B), 1e-3, B, at if nested else None)
        # priors of one token a request (a head never right): what depths 1-4 show is measured or nothing
        est = {e: b.tokens_per_request(e, float(B), B) for e in range(1, 6)}
        assert abs(est[5] - truth[5]) < 0.15
        for e in range(1, 5):
            if nested:
                assert abs(est[e] - truth[e]) < 0.1, (e, est[e], truth[e])
            else:
                assert est[e] == 1.0  # never ran: the prior alone
        # depths 1-4 gained no time of their own (their time is measured on their own cycles only)
        assert all(b.stats[key].get(e) is None for e in range(1, 5))


def test_a_depth_explored_now_and_then_is_known_by_what_its_last_drafts_added():
    """Depth 4 exploited, depth 5 run on 10 cycles: depth 5's tokens are depth 4's (measured on every
    cycle) plus what its fifth drafts added on those 10 (paired on the same cycles), not those
    cycles' whole counts, which a wrong acceptance model then outweighs."""
    rng = np.random.default_rng(1)
    alpha, B = 0.7, 4
    truth5 = 1 + sum(alpha**j for j in range(1, 6))
    priors = {d: (float(B), 1e-3) for d in range(6)}  # an acceptance model that expects nothing
    errors = {}
    for nested in (True, False):  # False: the cycles without what shallower depths would have committed
        b = bandit()
        key = batch_key(B)
        for i in range(410):
            arm = 5 if i % 41 == 40 else 4
            acc = np.cumprod(rng.random((B, arm)) < alpha, axis=1).sum(axis=1)
            at = {e: float(np.minimum(acc, e).sum() + B) for e in range(1, arm)}
            b.observe(key, arm, 1e-3, float(acc.sum() + B), 1e-3, B, at if nested else None)
        errors[nested] = abs(b.token_estimates(priors, B)[5][0] - truth5)
    # (what is left with nested tokens: the fifth drafts' 40 requests, shrunk a little towards the model)
    assert errors[True] < 0.25 and errors[False] > 0.4, errors


def test_an_explorations_decision_time_counts_against_the_exploration_budget():
    # each exploration's first decision costs 5 ms of host time that no cycle's measure holds (10-12 ms
    # cycles): charged, explorations keep to the budget's share of the time; uncharged, the decisions
    # alone take several times that share
    priors = {0: (4.0, 0.010), 1: (6.0, 0.010), 2: (7.2, 0.012)}
    true_ratio = {0: 1.0, 1: 1.0, 2: 1.0}

    def share(charge: bool) -> tuple[float, int]:  # charge False: the decisions' time not reported
        b = bandit()
        rng = np.random.default_rng(0)
        total = overhead = 0.0
        explorations = 0
        for _ in range(3000):
            second = b.second_cycle_due(6)
            arm, exploring = b.choose(6, priors)
            if exploring and not second:
                explorations += 1
                overhead += 0.005
                total += 0.005
                if charge:
                    b.charge_overhead(6, 0.005)
            tok, sec = priors[arm]
            t = sec * true_ratio[arm] * rng.lognormal(0, 0.1)
            b.observe(6, arm, sec, tok, t)
            total += t
        return overhead / total, explorations

    charged, n_charged = share(True)
    free, n_free = share(False)
    assert charged < 0.012 and free > 0.02
    assert n_charged * 3 < n_free
