"""The cost model: exact small counts, online buckets, stale profiles, the start-up measurement."""

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from specserve.speculative.policy.cost_model import (EXACT, GRID, CostModel, Curve, bucket, measure, profile_points)

CPU_LIKE = {1: 0.020, 2: 0.021, 3: 0.022, 4: 0.040, 5: 0.041, 8: 0.050, 16: 0.060, 32: 0.090, 64: 0.150}


def test_small_counts_are_exact_buckets_and_the_jump_survives():
    assert [bucket(n) for n in range(1, EXACT + 1)] == list(range(1, EXACT + 1))
    assert bucket(17) == 16 and bucket(19) == 20 and bucket(10**6) == GRID[-1]
    c = Curve(dict(CPU_LIKE))
    assert c.predict(3) == pytest.approx(0.022) and c.predict(4) == pytest.approx(0.040)
    assert c.predict(48) == pytest.approx(0.120)  # linear between grid points
    assert c.predict(128) == pytest.approx(0.270)  # last slope past the end


def test_profile_points_cover_every_small_count_then_a_grid():
    pts = profile_points(128)
    assert pts[:EXACT] == list(range(1, EXACT + 1)) and pts[-1] == 128 and set(pts) <= set(GRID)


def test_observations_replace_the_profile_after_a_few_samples():
    c = Curve(dict(CPU_LIKE), min_samples=3)
    c.observe(4, 0.025)
    assert c.predict(4) == pytest.approx((0.025 * 0.040) ** 0.5)  # one sample: half-way (in log) from the profile
    c.observe(4, 0.026)
    assert 0.025 < c.predict(4) < 0.032  # two: two thirds of the way
    c.observe(4, 0.100)  # an outlier does not move a median
    assert c.predict(4) == pytest.approx(0.026)


def test_predictions_never_fall_as_the_count_grows():
    c = Curve(dict(CPU_LIKE))
    for _ in range(3):
        c.observe(4, 0.040)
        c.observe(5, 0.015)  # a lucky bucket: faster than 4 tokens
    assert c.predict(5) == pytest.approx(0.040)  # held at the 4-token time, not below it
    xs = np.arange(1, 65)
    assert (np.diff([c.predict(x) for x in xs]) >= 0).all()


def test_unseen_buckets_keep_the_profile_increments_shifted_by_seen_neighbours():
    c = Curve(dict(CPU_LIKE))
    for _ in range(3):  # real steps take 10 ms more than the profiled forward at 2, 20 ms more at 8
        c.observe(2, CPU_LIKE[2] + 0.010)
        c.observe(8, CPU_LIKE[8] + 0.020)
    assert c.predict(3) == pytest.approx(0.022 + 0.010 + 0.010 / 6)
    assert c.predict(4) == pytest.approx(0.040 + 0.010 + 0.020 / 6)  # the jump is still there, as profiled
    assert c.predict(1) == pytest.approx(0.020 + 0.010)  # constant offset past the seen ones
    assert c.predict(64) == pytest.approx(0.150 + 0.020)


def test_off_grid_observations_land_on_the_nearest_grid_point_by_shape():
    c = Curve(dict(CPU_LIKE))
    for _ in range(3):
        c.observe(48, 0.240)  # 2x the profile's 0.120 at 48 (a grid point between 32 and 64)
    assert c.predict(48) == pytest.approx(0.240)
    c2 = Curve(dict(CPU_LIKE))
    v = 2 * c2.predict(62)
    for _ in range(3):
        c2.observe(62, v)  # credited to 64, scaled by the curve's shape
    assert c2.predict(64) == pytest.approx(0.300, rel=0.05)


def test_prediction_errors_and_a_stale_profile_are_observable():
    cm = CostModel(target=Curve(dict(CPU_LIKE)), draft=Curve({1: 0.002}), stale_after=16)
    for i in range(15):
        cm.observe_step(1 + i % 3, 2.0 * cm.target.profile_at(1 + i % 3))
    assert not cm.stale and cm.profile_ratio == pytest.approx(2.0)
    cm.observe_step(2, 0.042)
    assert cm.stale
    assert cm.mean_abs_error is not None and cm.summary()["stale"] is True
    ok = CostModel(target=Curve(dict(CPU_LIKE)), stale_after=16)
    for i in range(40):
        ok.observe_step(4, 0.040 * (1.1 if i % 2 else 0.9))
    assert not ok.stale and abs(ok.mean_abs_error) < 0.15


def test_json_round_trip_keeps_the_profile_and_rejects_old_formats(tmp_path):
    cm = CostModel(target=Curve(dict(CPU_LIKE)), draft=Curve({1: 0.002, 8: 0.003}), meta={"date": "x"})
    cm.target.observe(4, 1.0)  # observations are not persisted
    path = str(tmp_path / "p" / "profile.json")
    cm.save(path)
    back = CostModel.load(path)
    assert back is not None and back.target.profile == CPU_LIKE and back.draft.profile == {1: 0.002, 8: 0.003}
    assert back.meta == {"date": "x"} and not back.target.samples
    (tmp_path / "old.json").write_text('{"target": {"1": 0.01}, "draft": {"1": 0.001}}')
    assert CostModel.load(str(tmp_path / "old.json")) is None


def test_measure_takes_medians_of_interleaved_rounds_and_rechecks_noisy_points():
    t = itertools.count()
    now = [0.0]
    calls = []
    burst = {5, 6, 7, 8, 9, 10}  # call indices hit by background load (the first round of point 2)

    def fn(n):
        i = next(t)
        calls.append(n)
        now[0] += n * 0.01 * (3.0 if i in burst else 1.0)

    m = measure([1, 2], fn, rounds=3, repeats=3, recheck_spread=0.15, clock=lambda: now[0])
    assert m.seconds[1] == pytest.approx(0.01) and m.seconds[2] == pytest.approx(0.02)
    assert m.rechecked == [2] and m.spread[2] == pytest.approx(2.0)
    # warm-up 1, 2; round 1 up, round 2 down, round 3 up; then the re-check rounds of point 2
    assert calls[:2] == [1, 2] and calls[2:8] == [1] * 3 + [2] * 3 and calls[8:14] == [2] * 3 + [1] * 3
    assert len(calls) == 2 + 3 * 6 + 2 * 3


def test_measure_stops_at_its_budget_and_calls_that_noisy():
    now = [0.0]

    def fn(n):
        now[0] += 1.0

    m = measure([1, 2, 3], fn, rounds=3, repeats=1, clock=lambda: now[0], budget_s=4.0)
    assert m.rounds == 1 and m.over_budget and m.noisy  # warm-up 3 s + one round 3 s: no second round
    quiet = measure([1, 2, 3], fn, rounds=3, repeats=1, clock=lambda: now[0])
    assert quiet.rounds == 3 and not quiet.noisy and quiet.rechecked == []


def test_measure_past_its_budget_in_the_first_round_still_measures_every_point_once():
    now = [0.0]
    calls = []

    def fn(n):
        calls.append(n)
        now[0] += 1.0

    m = measure([1, 2, 3, 4], fn, rounds=3, repeats=3, clock=lambda: now[0], budget_s=5.0)
    assert m.over_budget and m.noisy and set(m.seconds) == {1, 2, 3, 4}
    assert len(calls) == 4 + 3 + 3  # warm-up, point 1 in full, then one call each (the budget ran out)


def test_steps_of_the_same_size_are_learnt_per_batch():
    # 32 tokens as 32 decodes cost more than as 8 requests x 4 verify tokens (per-request work)
    cm = CostModel(target=Curve(dict(CPU_LIKE)))
    for _ in range(3):
        cm.observe_step(32, 0.200, num_seqs=32)
        cm.observe_step(32, 0.120, num_seqs=8)
        cm.observe_step(8, 0.080, num_seqs=8)
    assert cm.step_time(32, num_seqs=32) == pytest.approx(0.200)
    assert cm.step_time(32, num_seqs=8) == pytest.approx(0.120)
    assert cm.step_time(32, num_seqs=7) == pytest.approx(0.120)  # same power-of-two bucket
    # an unmeasured batch falls back to all steps' curve; unseen counts in a batch's curve keep the
    # profile's increments, shifted by that batch's own measurements
    assert cm.step_time(32, num_seqs=2) == pytest.approx(cm.target.predict(32))
    assert cm.step_time(16, num_seqs=8) == pytest.approx(0.060 + 0.030)  # offset 0.030 at both 8 and 32
    assert len(cm.by_batch[8].samples[32]) == 3 and 16 not in cm.by_batch[8].samples
    assert set(cm.summary()["target_ms_by_batch"]) == {8, 32}


def test_a_batch_profile_gives_verify_shaped_steps_their_own_curve(tmp_path):
    # 8 single-token requests cost 0.050; 8 requests x 2 tokens 0.055 (not the 16-request 0.060)
    cm = CostModel(target=Curve(dict(CPU_LIKE)), batch_profiles={8: {8: 0.050, 16: 0.055, 24: 0.058}})
    assert cm.step_time(16, num_seqs=8) == pytest.approx(0.055)
    assert cm.step_time(16, num_seqs=16) == pytest.approx(0.060)  # no batch profile there: all-batch curve
    assert cm.step_time(64, num_seqs=8) == pytest.approx(0.150)  # past the batch profile: the all-batch one
    cm.save(str(tmp_path / "p.json"))
    back = CostModel.load(str(tmp_path / "p.json"))
    assert back.batch_profiles == cm.batch_profiles
    assert back.step_time(24, num_seqs=5) == pytest.approx(0.058)


def test_cost_profile_key_follows_cpu_packing(monkeypatch) -> None:
    """A cached profile is reused only under the same CPU weight packing and packed-row threshold:
    the threshold decides whether 2-3-token verifies cost more or less than a decode step."""
    from types import SimpleNamespace

    import torch

    from specserve.models import cpu_packing
    from specserve.models.eagle3 import Eagle3Config
    from specserve.speculative import drafter, profile

    head = Eagle3Config.from_json(Path(drafter.DEFAULT_HEAD) / "config.json")
    eng = SimpleNamespace(model_name="m", model_config="cfg", device=torch.device("cpu"), dtype=torch.float32,
                          packed_linears=7, config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=32))
    monkeypatch.setitem(cpu_packing._MIN_ROWS, torch.float32, 2)
    two = profile.cost_profile_key(eng, head, 4, False)
    assert profile.cost_profile_key(eng, head, 4, False) == two  # stable
    monkeypatch.setitem(cpu_packing._MIN_ROWS, torch.float32, 4)
    four = profile.cost_profile_key(eng, head, 4, False)
    eng.packed_linears = 0
    unpacked = profile.cost_profile_key(eng, head, 4, False)
    assert len({two, four, unpacked}) == 3
    assert profile.cost_profile_key(eng, head, 4, True) != unpacked  # graphs change the kernels too
    eng.config.kv_cache_dtype = "fp8"  # and an 8-bit K/V cache what attention reads
    assert profile.cost_profile_key(eng, head, 4, False) != unpacked


def test_linear_cost_separates_a_fixed_part_from_the_rate_per_unit():
    from specserve.speculative.policy.cost_model import LinearCost

    lc = LinearCost()
    assert lc.predict(100) is None
    lc.observe(1000, 0.2)
    assert lc.fit() == (0.0, pytest.approx(2e-4))  # one size: through the origin
    lc = LinearCost()
    # catch-ups of 0.4 ms + 20 ns per token, as at small batches on a GPU, and one larger
    for tokens in (20, 40, 30, 60, 2000, 25):
        lc.observe(tokens, 4e-4 + 2e-8 * tokens)
    fixed, per = lc.fit()
    assert fixed == pytest.approx(4e-4) and per == pytest.approx(2e-8)
    # 50,000 tokens: ~1.4 ms, where the mean rate per token of those catch-ups (~10 us) says ~0.5 s
    assert lc.predict(50_000) == pytest.approx(4e-4 + 1e-3)
    lc.observe(0, 1.0)  # ignored
    lc.observe(10, -1.0)
    assert lc.predict(50_000) == pytest.approx(4e-4 + 1e-3)
    # seconds falling with size (noise) give no negative rate: the ratio of the sums instead
    lc = LinearCost()
    lc.observe(100, 0.003)
    lc.observe(1000, 0.001)
    assert lc.fit() == (0.0, pytest.approx((0.8 * 0.003 + 0.001) / (0.8 * 100 + 1000)))  # decayed sums


def test_a_curve_observed_between_predictions_predicts_as_one_built_from_its_samples():
    """Medians are taken again only for buckets observed since the last table (lazily): the table must
    be the one every bucket's median would give."""
    rng = np.random.default_rng(3)
    profile = {1: 0.010, 4: 0.012, 16: 0.020, 64: 0.050}
    c = Curve(dict(profile))
    for i in range(300):
        x = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        c.observe(x, 0.001 * x * rng.lognormal(0, 0.3) + 0.01)
        if i % 7 == 0:
            c.predict(10)  # builds the table, caching the medians
    fresh = Curve(dict(profile))
    fresh.samples = {g: type(s)(s, maxlen=s.maxlen) for g, s in c.samples.items()}
    for x in (1, 3, 10, 24, 50, 100):
        assert c.predict(x) == pytest.approx(fresh.predict(x), rel=1e-12)


def test_one_seat_profiles_catch_up_sized_head_forwards(tmp_path, monkeypatch):
    # with max_num_seqs 1 the eager start-up profile still times head forwards over catch-up-sized row
    # counts: a catch-up's first estimate (before any switch measured one) extrapolated a one-point curve
    # in proportion, 125 rows at 125x one row's forward, so no exploration out of plain decoding ever fitted
    # the exploration budget and the engine never drafted where depth 5 paid
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_model import make_random_head, make_tiny_model

    from specserve import LLM
    from specserve.speculative.profile import CATCH_UP_PROFILE_ROWS

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(str(tmp_path / "m"), vocab=64, layers=4)
    head = make_random_head(model, str(tmp_path / "h"))
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=1, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_num_steps=3, speculative_policy="adaptive",
              speculative_calibrate=False)
    ctl = llm.engine.drafter.controller
    assert set(CATCH_UP_PROFILE_ROWS) <= set(ctl.cost.draft.profile)
    one = ctl.cost.draft.profile[1]
    # a head forward over 64 rows costs a few single-row ones, not 64: the estimate follows the curve
    assert ctl.catch_up_seconds(125) < 16 * one


def test_profile_lookups_follow_a_profile_taken_again():
    # profile_at remembers its points; a profile taken again (a new dict, the same counts) is read anew
    c = Curve(profile={1: 1.0, 8: 2.0, 64: 4.0})
    assert c.profile_at(4) == pytest.approx(1.0 + 3 / 7) and c.profile_top == 64
    c.profile = {1: 2.0, 8: 4.0, 64: 8.0}
    assert c.profile_at(4) == pytest.approx(2.0 + 6 / 7) and c.profile_at(64) == 8.0
    c.profile = {1: 2.0, 8: 4.0, 64: 8.0, 128: 9.0}
    assert c.profile_top == 128


def test_sampled_errors_are_against_the_table_decisions_last_read():
    cm = CostModel(error_every=1)
    cm.target.profile = {1: 1.0, 64: 2.0}
    assert cm.target.predict(64) == 2.0  # the table decisions read: the profile alone
    cm.observe_step(64, 3.0)  # the first observation: predicted 2.0 by that table
    cm.observe_step(64, 3.0)  # one sample in the bucket since: the table as last built still says 2.0
    assert list(cm.errors) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert cm.target.predict(64) > 2.0  # rebuilt when a decision reads it


def test_measure_logs_its_progress_per_round(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        measure([1, 2], lambda n: None, rounds=3, repeats=1, label="draft")
    assert [r.getMessage().split(":")[0] for r in caplog.records].count("profiling draft") == 3
