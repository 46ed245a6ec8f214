"""benchmarks/cycle_log.py: a cycle's own time is the engine's time inside its steps from one
decision to the next (the caller's time between steps left out), and the summary sets the bandit's
measure against it."""

import os
import sys
from types import SimpleNamespace

import pytest

from specserve.config import AdaptivePolicyConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from cycle_log import CycleLog  # noqa: E402


def make_log(steps, draft_calls, raw):
    log = CycleLog.__new__(CycleLog)
    log.steps, log.draft_calls, log.raw = steps, draft_calls, raw
    log.ctl = SimpleNamespace(policy=AdaptivePolicyConfig(prefill_share_limit=0.25))
    return log


def test_own_time_spans_decision_to_decision_inside_steps():
    # step i runs [10 i, 10 i + 8] (the caller takes 2 s between steps), its draft_step starts at 10 i + 6;
    # step 2 serves nobody that drafts (no draft_step)
    steps = [[0.0, 6.0, 8.0], [10.0, 16.0, 18.0], [20.0, -1.0, 28.0], [30.0, 36.0, 38.0]]
    log = make_log(steps, [0, 1, 3], [])
    assert log.own_seconds(1) is None  # no decision before the first
    # decided in step 0's draft_step, ended in step 1's: 2 s of step 0 and 6 of step 1
    assert log.own_seconds(2) == pytest.approx(8.0)
    # decided in step 1, ended in step 3: 2 + the whole of step 2 (8) + 6; not the caller's 2 s gaps
    assert log.own_seconds(3) == pytest.approx(16.0)
    assert log.own_seconds(4) is None  # its finishing call has not run


def test_summary_compares_the_bandits_measure_with_own_time():
    steps = [[0.0, 6.0, 8.0], [10.0, 16.0, 18.0], [20.0, 26.0, 28.0]]
    # [bucket, arm, tokens, seconds, prompt share, measured, draft calls, exploring, launched early]:
    # 4 requests (bucket 4); the first cycle's drafts launched before the sync, the second exploring
    raw = [[4, 2, 12, 6.0, 0.0, 1, 2, 0, 4], [4, 2, 12, 7.0, 1.0, 1, 3, 1, 0]]
    s = make_log(steps, [0, 1, 2], raw).summary(min_cycles=1)
    arm = s["by_bucket"]["4"]["2"]
    assert arm["cycles"] == 2 and arm["own_ms"] == pytest.approx(8000.0)
    assert arm["raw_over_own"] == pytest.approx(13.0 / 16.0, abs=1e-3)  # rounded to 3 places
    # tok/s rounded to one place
    assert arm["tok_s_own"] == pytest.approx(24 / 16.0, abs=0.05)
    assert arm["tok_s_raw"] == pytest.approx(24 / 13.0, abs=0.05)
    assert arm["tok_s_bandit"] == pytest.approx(24 / 12.0, abs=0.05)  # the prompt share (1 s) taken out
    assert s["engine_s"] == pytest.approx(24.0) and s["cycles_own_s"] == pytest.approx(16.0)
    assert arm["fused_share"] == 0.5 and arm["exploring_share"] == 0.5
    assert arm["tok_s_raw_fused"] == pytest.approx(12 / 6.0, abs=0.05)


def test_a_log_attached_to_an_adaptive_engine_records_its_drafting_cycles(tmp_path):
    # the log wraps the bandit's own methods: its wrappers must take what the controller hands them (a
    # chain cycle's tokens at shallower depths too), or a benchmark run with --log-cycles fails at the
    # first measured drafting cycle (as it did after session 38)
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_model import make_random_head, make_tiny_model

    from specserve import LLM, SamplingParams

    model = make_tiny_model(str(tmp_path / "m"), vocab=64, layers=4)
    head = make_random_head(model, str(tmp_path / "h"))
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=4, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_num_steps=2, speculative_policy="adaptive",
              speculative_calibrate=False)
    llm.engine.drafter.controller.forced_arm = 2  # every cycle drafts two tokens: measured, nested tokens
    log = CycleLog.start(llm)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", [3 + i, 5, 7, 9], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    log.detach()
    measured = [c for c in log.cycles if c[5] == 1]
    assert measured and all(c[1] == 2 for c in measured)  # (bucket, arm 2, tokens, seconds, requests, measured)
    assert sum(c[2] for c in measured) > 0
    s = log.summary(min_cycles=1)
    arms = {a for arms in s["by_bucket"].values() for a in arms}
    assert "2" in arms
    assert llm.engine.drafter.controller.bandit.increments  # the nested tokens reached the bandit through the log
