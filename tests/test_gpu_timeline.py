"""benchmarks/gpu_timeline.py: device idle gaps charged to the host phase that ran through them."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from gpu_timeline import analyse  # noqa: E402


def span(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def kernel(ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def test_idle_gaps_go_to_the_innermost_phase():
    # two steps of 100 us: each prepares for 20 us (device idle), forwards (device busy 60 us),
    # then commits for 20 us (device idle); an overlapping kernel and a copy merge into one busy stretch
    ev = []
    for s in (0.0, 100.0):
        ev += [span("engine.step", s, 100), span("runner.prepare", s, 20), span("runner.forward", s + 20, 60),
               span("scheduler.commit", s + 80, 20), kernel(s + 20, 40), kernel(s + 50, 20), kernel(s + 70, 10, "gpu_memcpy")]
    ev.append(kernel(500, 50))  # outside the traced steps: ignored
    ev.append({"ph": "X", "cat": "user_annotation", "name": "other.thing", "ts": 0, "dur": 10})  # not a phase
    got = analyse({"traceEvents": ev}, steps=2)
    assert got["wall_ms_per_step"] == 0.1
    assert got["device_busy_ms_per_step"] == 0.06
    assert got["device_idle_ms_per_step"] == 0.04
    assert got["idle_ms_per_step_by_host_phase"] == {"runner.prepare": 0.02, "scheduler.commit": 0.02}
    assert got["host_phase_ms_per_step"]["runner.forward"] == 0.06


def test_a_gap_between_phases_goes_to_the_enclosing_step():
    ev = [span("engine.step", 0, 100), span("runner.forward", 0, 40), kernel(0, 40), kernel(70, 30)]
    got = analyse({"traceEvents": ev}, steps=1)
    assert got["idle_ms_per_step_by_host_phase"] == {"engine.step": 0.03}


def test_no_device_events_is_reported_not_divided_by_zero():
    got = analyse({"traceEvents": [span("engine.step", 0, 10)]}, steps=1)
    assert "error" in got
