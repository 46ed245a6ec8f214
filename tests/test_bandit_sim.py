"""The bandit in specserve.bench.bandit_sim's simulated load: what it must do whatever the noise."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from specserve.bench import bandit_sim


def test_a_useless_head_stays_off_in_noisy_cycles():
    # cycle times spread 25 %, rare 4x pauses; drafting only costs (nothing is ever accepted)
    sc = bandit_sim.SCENARIOS["cpu_c8_useless"]
    for seed in range(5):
        r = bandit_sim.run(sc, seed, {})
        assert r["share"][0] >= 0.95, (seed, r["share"])
        assert r["ratio"] >= 0.96, (seed, r["ratio"])


def test_a_depth_that_pays_well_is_found_and_kept():
    # depth 1 30 % ahead of plain decoding at 16 requests; 2 and 3 a little behind it
    sc = replace(bandit_sim.SCENARIOS["cpu_c16_pays"], ratio=(1.0, 1.3, 1.25, 1.15))
    runs = [bandit_sim.run(sc, seed, {}) for seed in range(5)]
    assert all(r["share"][0] < 0.15 for r in runs), [r["share"] for r in runs]
    assert sum(r["ratio"] for r in runs) / len(runs) >= 0.95, [r["ratio"] for r in runs]


def test_the_ratio_is_measured_against_the_best_depth():
    # every depth equally good: whatever it picks, the bandit runs at the best goodput (noise apart)
    sc = replace(bandit_sim.SCENARIOS["cpu_c1"], ratio=(1.0, 1.0, 1.0, 1.0), seconds=120.0)
    r = bandit_sim.run(sc, 0, {})
    assert r["ratio"] == pytest.approx(1.0, abs=0.04)


def test_bad_variants_and_scenarios_are_refused(tmp_path):
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit):
        bandit_sim.main(["--scenarios", "nope", "--output-file", out])
    with pytest.raises(SystemExit):
        bandit_sim.main(["--variant", "x:no_such_field=1", "--output-file", out])
    with pytest.raises(SystemExit):
        bandit_sim.main(["--variant", "x:margin=0.01", "--variant", "x:margin=0.02", "--output-file", out])
    assert not os.path.exists(out)
