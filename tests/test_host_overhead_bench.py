"""benchmarks/host_overhead.py end to end on tiny settings: every engine serves the closed loop, is
timed and profiled, and the JSON says so."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import host_overhead  # noqa: E402


def test_host_overhead_times_and_profiles_every_engine(tmp_path):
    out = tmp_path / "h.json"
    res = host_overhead.main(["--concurrency", "4", "--requests", "8", "--max-tokens", "4", "--rounds", "1",
                              "--top", "5", "--configs", "nospec,spec_off,static_chain1", "--output-file", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["configs"]) == {"nospec", "spec_off", "static_chain1"}
    for name, c in res["configs"].items():
        assert c["ms_per_step"] > 0 and c["engine_steps"] >= 4  # 8 requests x 4 tokens, 4 at a time
        rows = [ln for ln in c["profile_top"] if ".py:" in ln or "{built-in" in ln]
        assert len(rows) == 5, (name, c["profile_top"])  # --top 5 functions by own time
    assert res["configs"]["nospec"]["over_first"] == 1.0
    # what each spec engine adds on the host, per function, most first
    for name in ("spec_off", "static_chain1"):
        rows = res["profile_differing"][name]
        assert rows[0]["function"] == "(every function)" and len(rows) == 6
        assert [r["own_us"] for r in rows[1:]] == sorted((r["own_us"] for r in rows[1:]), reverse=True)
    # static chain 1 drafts: fewer engine steps than plain decoding for the same tokens, or as many
    assert res["configs"]["static_chain1"]["engine_steps"] <= res["configs"]["nospec"]["engine_steps"]


def test_differing_functions_are_per_step_differences_against_the_first_engine():
    own = {"plain": {"a.py:1(f)": (10.0, 1.0), "a.py:2(g)": (5.0, 2.0)},
           "spec": {"a.py:1(f)": (12.0, 1.0), "a.py:2(g)": (4.0, 2.0), "d.py:9(verify)": (30.0, 1.0)}}
    rows = host_overhead.differing_functions(own, "plain", 2)["spec"]
    assert rows[0] == {"function": "(every function)", "own_us": 31.0, "calls": 0.0}  # 2 - 1 + 30
    assert rows[1:] == [{"function": "d.py:9(verify)", "own_us": 30.0, "calls": 1.0},
                        {"function": "a.py:1(f)", "own_us": 2.0, "calls": 0.0}]


def test_torch_profile_lists_the_ops_a_drafting_engine_adds(tmp_path):
    res = host_overhead.main(["--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--rounds", "1",
                              "--top", "40", "--configs", "nospec,static_chain1", "--torch-profile",
                              "--output-file", str(tmp_path / "h.json")])
    plain = res["configs"]["nospec"]["torch_ops_per_step"]
    chain = res["configs"]["static_chain1"]["torch_ops_per_step"]
    # a chain-1 engine runs the head every step as well: more ops per step than plain decoding
    assert sum(v["calls"] for v in chain.values()) > sum(v["calls"] for v in plain.values()) > 0
    rows = res["torch_ops_differing"]["static_chain1"]
    assert 0 < len(rows) <= 40
    for r in rows:  # each row is the difference of the two tables
        a = chain.get(r["name"], {}).get("calls", 0.0)
        b = plain.get(r["name"], {}).get("calls", 0.0)
        assert abs(r["calls"] - (a - b)) < 0.02, r


def test_agree_makes_every_draft_accepted(tmp_path):
    # --agree: a tiny model and head that both emit token 0, so a static chain's every draft is accepted
    # and (with drafts priced within the profile: --max-num-seqs above one request) an adaptive engine
    # drafts, as on a GPU at one request; without it the random head's drafts are all rejected
    res = host_overhead.main(["--agree", "--concurrency", "1", "--max-num-seqs", "16", "--requests", "4",
                              "--max-tokens", "24", "--rounds", "1", "--top", "5",
                              "--configs", "static_chain1,adaptive_forced5", "--output-file", str(tmp_path / "h.json")])
    chain, held = res["configs"]["static_chain1"], res["configs"]["adaptive_forced5"]
    assert chain["accepted_share"] == 1.0 and held["accepted_share"] == 1.0
    assert chain["accepted_per_verify"] == 1.0 and held["accepted_per_verify"] > 4  # (the last cycles' caps)
    assert held["k_histogram"].get(5, 0) > 0
    assert res["model"]["agree"] is True


def test_time_calls_times_a_spec_engines_bookkeeping_per_step(tmp_path):
    res = host_overhead.main(["--concurrency", "4", "--requests", "8", "--max-tokens", "6", "--rounds", "1",
                              "--top", "3", "--configs", "nospec,adaptive_at_0", "--time-calls",
                              "--output-file", str(tmp_path / "h.json")])
    assert "calls_per_step" not in res["configs"]["nospec"]  # (no drafter: nothing to time)
    timed = res["configs"]["adaptive_at_0"]["calls_per_step"]
    assert set(timed) == {f"{o}.{f}" for o, fs in host_overhead.TIMED_CALLS.items() for f in fs}
    # every engine step runs a draft step and the deferred bookkeeping, within it the cycle's outcome
    assert timed["drafter.draft_step"]["calls_per_step"] == 1.0 and timed["controller.flush"]["calls_per_step"] >= 0.9
    assert timed["controller._finish_cycle"]["calls_per_step"] > 0.5 and timed["bandit.observe"]["calls_per_step"] > 0.5
    step_us = timed["drafter.verify_step"]["us_per_step"] + timed["drafter.plain_step"]["us_per_step"]
    assert 0 < timed["controller.flush"]["us_per_step"] < step_us
