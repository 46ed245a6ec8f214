"""specserve.bench.adaptive's ramp: every engine meets the same prompts at each level, however fast it is."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
from specserve.bench import adaptive  # noqa: E402


@dataclass
class FakeEngine:
    """One token per live request per step, a step of ``step_s`` seconds; records each prompt it got."""

    step_s: float
    live: dict[str, int] = field(default_factory=dict)  # request id -> tokens left
    prompts: list[tuple[float, int]] = field(default_factory=list)  # (when, prompt id)
    drafter: SimpleNamespace | None = None  # with a controller: every request drafts 1 token each step
    t0: float = field(default_factory=time.perf_counter)

    def add_request(self, rid, prompt, params) -> None:
        self.live[rid] = params.max_tokens
        self.prompts.append((time.perf_counter() - self.t0, prompt[0]))

    def abort_request(self, rid) -> None:
        self.live.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        time.sleep(self.step_s)
        if self.drafter is not None:
            self.drafter.controller.k_histogram[1] += len(self.live)
        outs = []
        for rid in list(self.live):
            self.live[rid] -= 1
            done = self.live[rid] == 0
            if done:
                del self.live[rid]
            outs.append(SimpleNamespace(request_id=rid, new_token_ids=[0], finished=done))
        return outs

    def get_stats(self):
        return SimpleNamespace(spec_verify_steps=0, spec_accepted_tokens=0, k_histogram={}, prefix_cache_queries=0,
                               prefix_cache_hits=0)


def test_ramp_levels_draw_the_same_prompts_for_fast_and_slow_engines() -> None:
    pool = [([i], 2 + i % 3) for i in range(500)]  # prompt id i; outputs of 2-4 tokens
    fast, slow = FakeEngine(0.001), FakeEngine(0.003)
    clients = [adaptive.Client(n, SimpleNamespace(engine=e)) for n, e in (("fast", fast), ("slow", slow))]
    levels, level_s = [1, 3, 2], 0.15
    out = adaptive.run_ramp(clients, levels, level_s, level_s, lambda i: pool[i % len(pool)])

    per_level = {}
    for name, eng, c in (("fast", fast, clients[0]), ("slow", slow, clients[1])):
        assert c.clock >= level_s * len(levels)
        counts = out["issued_per_level"][name]
        assert sum(counts) == len(eng.prompts)
        ids = [pid for _, pid in eng.prompts]  # in the order issued: level by level
        per_level[name] = [ids[sum(counts[:i]): sum(counts[: i + 1])] for i in range(len(levels))]
    for lvl, (f, s) in enumerate(zip(per_level["fast"], per_level["slow"])):
        assert len(f) > len(s) > 0, lvl  # the fast engine finished more requests at every level
        assert f[: len(s)] == s, lvl  # ... and the slow one's prompts are the start of the fast one's
        assert f[0] == lvl * adaptive.RAMP_LEVEL_STRIDE


def test_ramp_k0_share_per_window_counts_only_the_ramp() -> None:
    # the controller counted 1,000 plain decisions before the ramp (calibration, earlier points); in the
    # ramp every request drafts: every window's k = 0 share is 0
    ctl = SimpleNamespace(k_histogram=Counter({0: 1000}), switches=0, k_changes=0, explorations=0, decisions=0)
    eng = FakeEngine(0.001, drafter=SimpleNamespace(controller=ctl))
    client = adaptive.Client("adaptive", SimpleNamespace(engine=eng))
    out = adaptive.run_ramp([client], [1, 2], 0.1, 0.1, lambda i: ([i], 3))
    assert out["configs"]["adaptive"]["windows_k0_share"] == [0.0, 0.0]


def test_slices_run_each_engine_for_its_slice_in_turn() -> None:
    """--slice-s: an engine's turn is steps for that many seconds of its own clock (one step without)."""
    pool = [([i], 50) for i in range(50)]
    engines = {"a": FakeEngine(0.002), "b": FakeEngine(0.002)}
    clients = [adaptive.Client(n, SimpleNamespace(engine=e)) for n, e in engines.items()]
    order: list[str] = []
    for c in clients:
        c.reset()
        step = c.step
        c.step = lambda c=c, step=step: (order.append(c.name), step())[1]
    adaptive.run_side_by_side(clients, lambda c: 2, lambda i: pool[i], None, lambda c: c.clock >= 0.1, slice_s=0.02)
    runs = [len(list(g)) for _, g in itertools.groupby(order)]
    assert len(runs) >= 4 and all(r >= 5 for r in runs[:-2]), runs  # ~0.02 s of 2-ms steps per turn
    assert all(c.clock >= 0.1 for c in clients)
    order.clear()
    for c in clients:
        c.reset()
    adaptive.run_side_by_side(clients, lambda c: 2, lambda i: pool[i], None, lambda c: c.clock >= 0.02)
    assert order[:4] == ["a", "b", "b", "a"]  # one step per turn, the order reversed every round


def test_a_variant_is_an_adaptive_engine_with_its_policy_config() -> None:
    name, policy = adaptive.variant("m1:margin=0.01,explore_every=8")
    assert name == "adaptive_m1" and policy.margin == 0.01 and policy.explore_every == 8 and policy.z == 1.5
    args = SimpleNamespace(static_steps=[5], tree=(5, 4, 16), threshold_n=8, threshold_steps=1, adaptive_steps=None,
                           adaptive_calibrate=None, adaptive_tree=(5, 4, 8))
    cfgs = adaptive.configs(args, {name: policy})
    assert cfgs["tree"]["speculative_eagle_topk"] == 4 and cfgs["chain5"]["speculative_num_steps"] == 5
    assert cfgs["adaptive_tree"]["speculative_policy"] == "adaptive"
    assert cfgs["adaptive_tree"]["speculative_num_draft_tokens"] == 8
    assert cfgs[name]["speculative_adaptive_config"]["margin"] == 0.01
    assert {k: v for k, v in cfgs[name].items() if k != "speculative_adaptive_config"} == cfgs["adaptive"]
    with pytest.raises(ValueError, match="unknown key"):
        adaptive.variant("m1:marign=0.01")
    with pytest.raises(ValueError):
        adaptive.variant("mem0")
