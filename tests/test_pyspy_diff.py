"""benchmarks/pyspy_diff.py: a sampler's stacks, per engine's timed rounds, as microseconds per step."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import host_overhead  # noqa: E402
import pyspy_diff  # noqa: E402


def test_samples_inside_each_engines_timed_rounds_become_microseconds_per_step(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "<module> (b/h.py:1);main (b/h.py:2);timed[plain] (b/h.py:9);step (s/engine.py:10);launch (s/runner.py:5) 30\n"
        "<module> (b/h.py:1);main (b/h.py:2);timed[plain] (b/h.py:9);step (s/engine.py:11) 10\n"
        "<module> (b/h.py:1);main (b/h.py:2);timed[spec] (b/h.py:9);step (s/engine.py:10);verify (s/d.py:7);"
        "launch (s/runner.py:5) 30\n"
        "<module> (b/h.py:1);main (b/h.py:2);timed[spec] (b/h.py:9);step (s/engine.py:10);verify (s/d.py:8) 20\n"
        "<module> (b/h.py:1);main (b/h.py:2);setup (b/h.py:3) 500\n")  # outside any timed round: not counted
    ho = tmp_path / "ho.json"
    ho.write_text(json.dumps({"settings": {"rounds": 2}, "configs": {"plain": {"engine_steps": 5, "ms_per_step": 1.0},
                                                                    "spec": {"engine_steps": 5, "ms_per_step": 1.2}}}))
    res = pyspy_diff.main([str(raw), str(ho), "--rate", "1000", "--top", "10"])
    # 40 samples at 1 kHz over 2 rounds x 5 steps: 4 ms a step; the spec engine's 50: 5 ms
    assert res["plain"]["us_per_step"] == 4000.0 and res["spec"]["us_per_step"] == 5000.0
    inc = {r["function"]: r["us"] for r in res["spec"]["inclusive"]}
    assert inc["verify (d.py)"] == 5000.0  # both of its lines, one function
    assert inc["launch (runner.py)"] == 0.0 and inc["step (engine.py)"] == 1000.0
    own = {r["function"]: r["us"] for r in res["spec"]["own"]}
    assert own["verify (d.py)"] == 2000.0 and own["step (engine.py)"] == -1000.0


def test_each_engines_timed_rounds_run_under_its_own_name():
    fn = host_overhead.serve_as("spec_off")
    assert fn.__code__.co_name == "timed[spec_off]" and fn.__code__.co_code == host_overhead.serve.__code__.co_code
