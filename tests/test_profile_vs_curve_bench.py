"""benchmarks/profile_vs_curve.py end to end on a tiny model (its own process): the controller's start-up
profile set against direct timings of the same engine's target steps; and the curve statistics it reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.bench.harness import median_abs_error, shape_error
from tiny_model import make_random_head, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # a benchmark's smoke test


def test_profile_predictions_are_set_against_direct_timings(tmp_path):
    model = make_tiny_model(str(tmp_path / "model"), vocab=256, layers=2)
    head = make_random_head(model, str(tmp_path / "head"))
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_vs_curve.py"), "--model", model, "--head", head,
                    "--max-num-seqs", "4", "--context", "32", "--tokens", "1,3,8,40", "--rounds", "2", "--iters", "1",
                    "--output-file", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    rows = {r["tokens"]: r for r in res["rows"]}
    assert [rows[n]["requests"] for n in (1, 3, 8, 40)] == [1, 3, 4, 4]  # spread as the profile spreads them
    top = res["profile_max_tokens"]
    assert 8 <= top < 40  # 4 requests x 4 verify tokens at most (chain 3): 40 is past the profile
    assert rows[40]["in_profile_range"] is False and rows[8]["in_profile_range"] is True
    assert rows[1]["profile_s"] > 0 and rows[40]["profile_s"] is None
    for r in res["rows"]:
        assert r["measured_s"] > 0 and r["one_request"]["measured_s"] > 0
        assert abs(r["predicted_over_measured"] - r["predicted_s"] / r["measured_s"]) < 2e-3
    inside = [r["predicted_over_measured"] for r in res["rows"] if r["in_profile_range"]]
    assert res["median_abs_error_in_range"] == median_abs_error(inside)
    # a chain of 3 (the default): one request verifies up to 4 tokens
    assert [r["one_request"]["a_verify"] for r in res["rows"]] == [True, True, False, False]
    assert res["median_abs_error_one_request_verify"] >= 0
    scale, err = res["shape_error"]
    assert scale > 0 and err >= 0


def test_shape_error_takes_out_one_drift_factor():
    # measured = 2 x predicted everywhere: no shape error; one point off by 10 % after the factor
    assert shape_error([1.0, 2.0, 4.0], [2.0, 4.0, 8.0]) == (2.0, 0.0)
    scale, err = shape_error([1.0, 2.0, 4.0], [2.0, 4.0, 8.0 / 1.1])
    assert scale == 2.0 and err == 0.0  # (the median point is exact: two of three are)
    assert shape_error([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0]) == (1.5, 0.375)  # half off by 1.5x, half by 0.75x
    assert shape_error([], []) is None
    assert median_abs_error([0.9, 1.0, 1.2]) == 0.1 and median_abs_error([]) is None
