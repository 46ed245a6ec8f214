"""The speculation controller, with numbers alone."""

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.spec.controller import AcceptanceStats, Plan, SpecController, decide_adaptive, goodput
from specserve.spec.cost_model import CostModel, CurveTable


def cost(per_token_ms: float, floor_ms: float = 10.0, draft_ms: float = 1.0) -> CostModel:
    """Flat until 64 tokens (a GPU-like roofline), then linear; draft cost per step flat."""
    c = CostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        c.target.values[n] = 1e-3 * max(floor_ms, per_token_ms * n)
    c.draft = CurveTable({1: draft_ms * 1e-3, 1024: draft_ms * 1e-3})
    return c


def cum(alpha, B, K=5):
    return np.cumprod(np.full((B, K), alpha), axis=1)


def test_speculates_deep_when_verify_is_nearly_free():
    plan, ks = decide_adaptive(cum(0.8, 1), np.array([5]), 1, cost(0.05), None)
    assert ks.tolist() == [5] and plan.depth == 5


def test_turns_off_when_tokens_cost_linear_time():
    # 1 token per ms: k drafts cost k ms and return < k tokens: never pays
    plan, ks = decide_adaptive(cum(0.8, 32), np.full(32, 5), 32, cost(1.0, floor_ms=0), None)
    assert ks.tolist() == [0] * 32 and plan.depth == 0


def test_switches_off_as_batch_grows_past_the_roofline():
    c = cost(0.2)  # flat 10 ms until 50 tokens, then 0.2 ms per token
    small = decide_adaptive(cum(0.7, 4), np.full(4, 5), 4, c, None)[1]
    big = decide_adaptive(cum(0.7, 256), np.full(256, 5), 256, c, None)[1]
    assert small.min() > 0 and big.max() == 0


def test_per_request_acceptance_gates_low_acceptors_first():
    c = cost(0.1, floor_ms=5)
    acc = np.vstack([cum(0.9, 8), cum(0.1, 8)])
    _, ks = decide_adaptive(acc, np.full(16, 5), 16, c, None)
    assert ks[:8].min() > ks[8:].max()


def test_caps_are_respected():
    _, ks = decide_adaptive(cum(0.9, 3), np.array([0, 2, 5]), 3, cost(0.01), None)
    assert ks.tolist() == [0, 2, 5]


def test_hysteresis_keeps_a_nearly_as_good_plan():
    c = cost(0.05)
    acc = cum(0.8, 4)
    best, _ = decide_adaptive(acc, np.full(4, 5), 4, c, None)
    near = Plan(best.depth - 1, 0.0)
    g_best = goodput(acc, np.full(4, best.depth), 4, c)[2]
    g_near = goodput(acc, np.full(4, near.depth), 4, c)[2]
    kept, _ = decide_adaptive(acc, np.full(4, 5), 4, c, near, margin=0.5)
    assert g_near < g_best and kept == near
    switched, _ = decide_adaptive(acc, np.full(4, 5), 4, c, near, margin=0.0)
    assert switched == best


def test_tree_mode_is_all_or_nothing_per_request():
    c = cost(0.2, floor_ms=5)
    acc = np.vstack([cum(0.8, 2, K=3), cum(0.01, 2, K=3)])
    _, ks = decide_adaptive(acc, np.full(4, 7), 4, c, None, tree=(7, 2))
    assert ks.tolist() == [3, 3, 0, 0]


def test_acceptance_stats_are_conditional():
    st = AcceptanceStats.zeros(3)
    st.observe(3, 1)  # accepted the first, rejected the second, third never reached
    st.observe(3, 3)
    assert st.drafted.tolist() == [2, 2, 1] and st.accepted.tolist() == [2, 1, 1]
    assert np.allclose(st.rates(), [1.0, 0.5, 1.0])
    # a request with no history borrows the overall rates
    assert np.allclose(AcceptanceStats.zeros(3).rates(prior=np.array([0.5, 0.5, 0.5])), [0.5] * 3)


class R:
    def __init__(self, rid):
        self.request_id = rid


def test_threshold_policy_with_hysteresis():
    ctl = SpecController(SpeculativeConfig(policy="threshold", disable_batch_threshold=8, num_steps=3))
    reqs = [R(str(i)) for i in range(2)]
    assert ctl.decide(reqs, [3, 3], num_running=8, prefill_tokens=0) == [3, 3]
    assert ctl.decide(reqs, [3, 3], num_running=9, prefill_tokens=0) == [0, 0]
    assert ctl.decide(reqs, [3, 3], num_running=7, prefill_tokens=0) == [0, 0]  # inside the hysteresis band
    assert ctl.decide(reqs, [3, 3], num_running=6, prefill_tokens=0) == [3, 3]


def test_cost_table_interpolates_and_learns():
    t = CurveTable({1: 0.01, 64: 0.01, 128: 0.02})
    assert abs(t.predict(96) - 0.015) < 1e-12 and abs(t.predict(256) - 0.04) < 1e-12
    for _ in range(50):
        t.observe(64, 0.02)
    assert abs(t.predict(64) - 0.02) < 1e-4
