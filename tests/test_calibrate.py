"""Start-up calibration of the adaptive controller (spec/calibrate.py) on the tiny model, CPU."""

from __future__ import annotations

import time

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.policy.bandit import batch_key
from specserve.speculative.policy.calibrate import bucket_batches, nondecreasing


def test_bucket_batches_cover_every_bucket_once():
    bs = bucket_batches(256)
    assert bs[0] == 256 and bs[-1] == 1 and bs == sorted(set(bs), reverse=True)
    assert sorted({batch_key(b) for b in bs}) == sorted({batch_key(b) for b in range(1, 257)})
    assert bucket_batches(5)[0] == 5 and bucket_batches(1) == [1]


def test_nondecreasing_pools_what_violates_order_and_keeps_the_rest():
    assert nondecreasing([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    assert nondecreasing([]) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_model import make_random_head, make_tiny_model

    d = tmp_path_factory.mktemp("calib")
    model = make_tiny_model(str(d / "model"), vocab=64, logit_scale=3.0)
    return model, make_random_head(model, str(d / "head"), std=0.3)


def engine(tiny, calibrate: bool) -> LLM:
    model, head = tiny
    return LLM(dtype="float32", model=model, device="cpu", kv_cache_memory_gb=0.05, max_model_len=256,
               speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
               speculative_policy="adaptive", speculative_num_steps=2, max_num_seqs=4,
               speculative_calibrate=calibrate)


def test_calibration_times_every_batch_and_depth_and_leaves_nothing_behind(tiny):
    llm = engine(tiny, True)
    e = llm.engine
    d = e.drafter
    cal = d.calibration
    assert sorted(cal["ms"]) == [1, 2, 3, 4]
    assert all(sorted(per) == [0, 1, 2] and min(per.values()) > 0 for per in cal["ms"].values())
    assert cal["requests"] == 2 * (4 + 3 + 2 + 1)  # fresh requests for each pass of each batch size
    assert cal["prompt_len"] == 128
    assert all(per[0] <= per[1] <= per[2] for per in cal["ms"].values())  # a deeper draft is never cheaper
    ctl = d.controller
    for b in (1, 2, 3, 4):  # seeded: every arm of every bucket holds its pseudo-cycles, time only
        arms = ctl.bandit.stats[batch_key(b)]
        assert sorted(arms) == [0, 1, 2] and all(st.seed_n == 2 and st.n == 0 and st.seed_spr > 0 for st in arms.values())
    # the scratch requests and what they did are gone
    assert not e.requests and not e.has_unfinished_requests()
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
    assert e.get_stats().steps == 0 and e.get_stats().k_histogram == {}
    assert ctl.decisions == 0 and not ctl.k_histogram and ctl.forced_arm is None
    assert sum(ctl.overall.drafted) == 0  # scratch text taught the acceptance model nothing
    assert ctl.cost.target.samples  # the live cost model keeps the step times it saw
    # and the engine serves as one never calibrated does (greedy is lossless either way)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 3, 5, 7, 9, 2]]
    ref = engine(tiny, False)
    assert ref.engine.drafter.calibration is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]


def test_a_step_stalled_once_does_not_weigh_on_its_arms_calibration(tiny, monkeypatch):
    """One step of plain decoding at batch 4 stalls (a kernel compiled, a collection) 30x the slowest step before
    it, >= 0.6 s: the two windows' mean would put plain decoding at >= stall / 12, above every drafting depth;
    their median leaves it a normal step (a relative bound: on a loaded machine every step is slow alike)."""
    from specserve.engine.engine import LLMEngine

    step, seen, stall = LLMEngine.step, [], []

    def stall_once(self):
        d = self.drafter
        if d.controller.forced_arm == 0 and len(self.scheduler.running) == 4:
            if len(seen) == 3:  # the second timed step of the first pass (two warm-up steps before)
                stall.append(max(0.6, 30 * max(seen)))
                time.sleep(stall[0])
            t0 = time.perf_counter()
            out = step(self)
            seen.append(time.perf_counter() - t0)
            return out
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", stall_once)
    cal = engine(tiny, True).engine.drafter.calibration
    assert len(seen) > 4 and stall
    assert cal["ms"][4][0] < stall[0] * 1000 / 12 and cal["ms"][4][0] < cal["ms"][4][2]


def test_calibration_prompts_leave_room_for_a_pass_within_max_model_len(tiny):
    """A pass's requests grow by at most arms x (warm + steps) x (depth + 1) tokens (3 x 8 x 3 = 72 here):
    the prompt shrinks to fit max_model_len, and with no room at all calibration is skipped."""
    model, head = tiny
    kw = dict(dtype="float32", model=model, device="cpu", kv_cache_memory_gb=0.05, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_num_steps=2, max_num_seqs=2, speculative_calibrate=True)
    cal = LLM(max_model_len=100, **kw).engine.drafter.calibration
    assert cal["prompt_len"] == 100 - 72 - 1 and sorted(cal["ms"]) == [1, 2]
    assert "too short" in LLM(max_model_len=72, **kw).engine.drafter.calibration["skipped"]


def test_calibration_halves_the_largest_batch_to_fit_the_kv_budget(tiny):
    """A request takes ~(128 + 48) / 16 + 1 = 12 blocks by the end of a pass; 3/4 of the free blocks bound the
    batch: 40 blocks calibrate batches 2 and 1 of max_num_seqs 4, 12 blocks none."""
    model, head = tiny
    kw = dict(dtype="float32", model=model, device="cpu", max_model_len=256, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_num_steps=2, max_num_seqs=4, speculative_calibrate=True)
    assert sorted(LLM(num_kv_blocks=40, **kw).engine.drafter.calibration["ms"]) == [1, 2]
    assert "too few" in LLM(num_kv_blocks=12, **kw).engine.drafter.calibration["skipped"]


def test_a_tree_engines_calibration_times_each_chain_and_the_tree(tiny):
    """A tree engine's arms (plain, chains of 1..K, the tree as K + 1) are all timed and seeded; chain depths
    non-decreasing, the tree at least plain decoding's."""
    model, head = tiny
    llm = LLM(dtype="float32", model=model, device="cpu", kv_cache_memory_gb=0.05, max_model_len=256,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="adaptive",
              speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4, max_num_seqs=2,
              speculative_calibrate=True)
    d = llm.engine.drafter
    cal, ctl = d.calibration, d.controller
    assert ctl.tree_arm == 3 and sorted(cal["ms"]) == [1, 2]
    for b, per in cal["ms"].items():
        assert sorted(per) == [0, 1, 2, 3] and per[0] <= per[1] <= per[2] and per[3] >= per[0]
        assert sorted(ctl.bandit.stats[batch_key(b)]) == [0, 1, 2, 3]
    assert ctl.tree_seen == [0.0, 0.0] and not ctl.k_histogram  # scratch trees taught it nothing
